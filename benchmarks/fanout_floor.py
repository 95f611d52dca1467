"""The floor under a coordinator's fan-out: how long gRPC alone takes to write one message to each of N
open streams on this machine, with nothing of remesh's on the server.

    python benchmarks/fanout_floor.py [--streams 5000,10000] [--clients 2] [--beats-per-second 1000]
        [--rounds 5]

One asyncio gRPC server (this process; mutual TLS, the coordinator's server options) holds N
bidirectional streams opened by --clients client processes, a channel (a TLS connection) each, as
`benchmarks/scale.py`'s simulated agents open them; the clients send a small heartbeat on every
stream, --beats-per-second over all of them (the coordinator's default budget). Each round the server
wakes every stream's handler at once, as a new epoch does, and each writes one message of the size of
a one-host topology delta. Measured per round: the server's wall and CPU time from the wake to its last
write completed, and each stream's time from the wake to its client reading the message. Prints (to
standard error) a line per round and, last, JSON with `streams`, `write_all_s_p50` (the server's time to write to
every stream, median of the rounds), `write_cpu_us_per_stream`, `receive_p99_s` (the clients' p99 of
the round with the median p99) and `rounds`, for the largest --streams; the line before it, `all
figures: {...}`, for every size.

`benchmarks/scale.py` measures the coordinator's own fan-out in the same shape (its
`remesh_topology_delivery_seconds` and the simulated agents' receipt times): the difference between
the two is what remesh's coordinator adds to gRPC's floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from remesh.cli.certs import DevPki  # noqa: E402
from remesh.v1.security import Role, Tls, aio_channel  # noqa: E402

_METHOD = "/remesh.bench.Floor/Beat"
# A one-host delta of a 10,000-member topology, encoded, is about this size.
_PAYLOAD = 160
_BEAT = b"b" * 48


# ---- the server (this process) --------------------------------------------------------------------


class _Streams:
    """Every open stream's wake-up, and the count of writes of the round in progress."""

    def __init__(self) -> None:
        self.bells: list[asyncio.Future[float]] = []
        self.opened = 0
        self.written = 0
        self.expected = 0
        self.done: asyncio.Future[float] | None = None
        # Set once every stream waits for its next wake-up (``waiting`` of them).
        self.waiting = 0
        self.all_waiting = asyncio.Event()

    async def handle(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        self.opened += 1

        async def read() -> None:
            async for _ in requests:
                pass

        reader = asyncio.create_task(read())
        try:
            while True:
                bell: asyncio.Future[float] = loop.create_future()
                self.bells.append(bell)
                if len(self.bells) >= self.waiting:
                    self.all_waiting.set()
                woke = await bell
                if woke < 0:
                    return  # the benchmark is over
                yield struct.pack("!d", woke) + b"t" * (_PAYLOAD - 8)
                self.written += 1
                if self.written == self.expected and self.done is not None and not self.done.done():
                    self.done.set_result(time.perf_counter())
        finally:
            reader.cancel()


async def _serve_size(
    pki: DevPki, streams_n: int, clients_n: int, beats_per_second: float, rounds: int
) -> dict[str, float]:
    calls = 2 * streams_n + 1024
    server = grpc.aio.server(
        maximum_concurrent_rpcs=calls,
        options=[
            ("grpc.server.max_pending_requests", calls),
            ("grpc.server.max_pending_requests_hard_limit", calls),
        ],
    )
    state = _Streams()
    handler = grpc.stream_stream_rpc_method_handler(state.handle)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("remesh.bench.Floor", {"Beat": handler}),)
    )
    port = server.add_secure_port("127.0.0.1:0", pki.tls(Role.COORDINATOR, "floor").server_credentials())
    await server.start()
    per_client = [streams_n // clients_n + (i < streams_n % clients_n) for i in range(clients_n)]
    interval = streams_n / beats_per_second
    host = pki.tls(Role.HOST, "floor-client")
    tls = [str(host.ca_file), str(host.cert_file), str(host.key_file)]
    client_args = ["--client", f"localhost:{port}", "--client-interval", str(interval), "--client-tls", *tls]
    clients = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            *client_args,
            "--client-streams",
            str(n),
            stdout=asyncio.subprocess.PIPE,
            limit=1 << 24,  # a round's latencies, one line of JSON
        )
        for n in per_client
    ]
    try:
        start = time.monotonic()
        while state.opened < streams_n:
            if time.monotonic() - start > 300:
                raise SystemExit(f"only {state.opened} of {streams_n} streams opened in 300 s")
            await asyncio.sleep(0.2)
        print(
            f"  {streams_n} streams open after {time.monotonic() - start:.1f}s", file=sys.stderr, flush=True
        )
        await asyncio.sleep(min(interval, 5.0) + 1.0)  # every stream's first heartbeat in flight
        walls, cpus, p99s = [], [], []
        for round_ in range(rounds):
            state.waiting = streams_n
            state.all_waiting.clear()
            if len(state.bells) < streams_n:
                await state.all_waiting.wait()
            bells, state.bells = state.bells, []
            state.written, state.expected = 0, streams_n
            state.done = asyncio.get_running_loop().create_future()
            cpu0, t0 = time.process_time(), time.perf_counter()
            woke = time.time()
            for bell in bells:
                bell.set_result(woke)
            t1 = await state.done
            cpu = time.process_time() - cpu0
            received: list[float] = []
            for client in clients:
                assert client.stdout is not None
                line = await asyncio.wait_for(client.stdout.readline(), 60.0)
                received += json.loads(line)["latencies"]
            p99 = statistics.quantiles(received, n=100)[98]
            walls.append(t1 - t0)
            cpus.append(cpu)
            p99s.append(p99)
            print(
                f"  {streams_n} streams, round {round_ + 1}/{rounds}: written in {t1 - t0:.3f}s "
                f"({1e6 * cpu / streams_n:.0f} us of the server's CPU a stream), received p99 {p99:.3f}s "
                f"max {max(received):.3f}s",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(1.0)
        return {
            "streams": streams_n,
            "write_all_s_p50": round(statistics.median(walls), 3),
            "write_cpu_us_per_stream": round(1e6 * statistics.median(cpus) / streams_n, 1),
            "receive_p99_s": round(statistics.median(p99s), 3),
            "rounds": rounds,
        }
    finally:
        for bell in state.bells:
            bell.set_result(-1.0)
        await server.stop(1.0)
        for client in clients:
            if client.returncode is None:
                client.kill()
            await client.wait()


def measure_floor(
    streams: int, clients: int = 2, beats_per_second: float = 1000.0, rounds: int = 5
) -> dict[str, float]:
    """One size's figures (the keys of the JSON line); progress lines go to stdout."""
    with tempfile.TemporaryDirectory(prefix="remesh-floor-") as tmp:
        return asyncio.run(_serve_size(DevPki(Path(tmp)), streams, clients, beats_per_second, rounds))


# ---- a client process ------------------------------------------------------------------------------


async def _client(args: argparse.Namespace) -> None:
    tls = Tls(*(Path(p) for p in args.client_tls))
    latencies: list[float] = []
    expected = args.client_streams

    def received(message: bytes) -> None:
        (woke,) = struct.unpack("!d", message[:8])
        latencies.append(time.time() - woke)
        if len(latencies) == expected:
            sys.stdout.write(json.dumps({"latencies": [round(x, 4) for x in latencies]}) + "\n")
            sys.stdout.flush()
            latencies.clear()

    async def one() -> None:
        channel = aio_channel(args.client, tls)

        async def beats() -> AsyncIterator[bytes]:
            await asyncio.sleep(random.random() * args.client_interval)
            while True:
                yield _BEAT
                await asyncio.sleep(args.client_interval)

        call = channel.stream_stream(_METHOD, request_serializer=bytes, response_deserializer=bytes)(beats())
        async for message in call:
            received(message)

    await asyncio.gather(*(one() for _ in range(args.client_streams)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="5000,10000", help="stream counts, comma-separated")
    parser.add_argument(
        "--clients", type=int, default=2, help="client processes (scale.py runs 2 simulators)"
    )
    parser.add_argument("--beats-per-second", type=float, default=1000.0, help="heartbeats over all streams")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--client-streams", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client-interval", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--client-tls", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        asyncio.run(_client(args))
        return
    if args.clients < 1 or args.rounds < 1 or args.beats_per_second <= 0:
        parser.error("--clients and --rounds must be at least 1, --beats-per-second above 0")
    figures = [
        measure_floor(int(n), args.clients, args.beats_per_second, args.rounds)
        for n in args.streams.split(",")
        if n
    ]
    print("all figures: " + json.dumps(figures))
    print(json.dumps(figures[-1]))


if __name__ == "__main__":
    main()

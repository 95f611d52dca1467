"""The floor under a coordinator's fan-out: how long gRPC alone takes to write one message to each of N
open streams on this machine, with nothing of remesh's on the server.

    python benchmarks/fanout_floor.py [--streams 5000,10000] [--clients 2] [--beats-per-second 1000]
        [--rounds 5] [--acks none|unary|stream] [--ack-delay 1.0] [--relays 0]

One asyncio gRPC server (this process; mutual TLS, the coordinator's server options) holds N
bidirectional streams opened by --clients client processes, a channel (a TLS connection) each, as
`benchmarks/scale.py`'s simulated agents open them; the clients send a small heartbeat on every
stream, --beats-per-second over all of them (the coordinator's default budget). Each round the server
wakes every stream's handler at once, as a new epoch does, and each writes one message of the size of
a one-host topology delta. Measured per round: the server's wall and CPU time from the wake to its last
write completed, and each stream's time from the wake to its client reading the message. Prints (to
standard error) a line per round and, last, JSON with `streams`, `write_all_s_p50` (the server's time to write to
every stream, median of the rounds), `write_cpu_us_per_stream`, `receive_p99_s` (the clients' p99 of
the round with the median p99), `rounds`, `server_streams` (the streams the server held) and, without
acknowledgements, `machine_busy_cores_p50` and `machine_cpu_us_per_stream`: the whole machine's CPU
(every process's and the kernel's, from `/proc/stat`) from the wake to the last receipt, as cores
busy and per stream. These are for the largest --streams; the line before them, `all figures: {...}`,
has every size. A client stream that breaks (as some do while thousands of TLS connections open at
once) is opened again after a second or so, as an agent would, and the breaks are counted on
standard error.

`benchmarks/scale.py` measures the coordinator's own fan-out in the same shape (its
`remesh_topology_delivery_seconds` and the simulated agents' receipt times): the difference between
the two is what remesh's coordinator adds to gRPC's floor.

With ``--acks unary`` or ``--acks stream`` every client also acknowledges each message ``--ack-delay``
to twice that after reading it, as a trainer acknowledges a new epoch once it has re-meshed: a unary
call of its own on the same channel (as remesh's agents call ``AckEpoch``), or a message on the stream
that carried the epoch, answered on that stream (as remesh's coordinator answers with an
``ack_reply``). The acknowledgements arrive while the round's last writes are still going
out; the round then also reports the server's CPU from the wake to the last acknowledgement
(``round_cpu_us_per_stream``) and that time (``acked_all_s_p50``); ``acks_received`` counts what
arrived by each path.

With ``--relays R`` the message goes in two hops, as the relays of ``docs/scale.md`` would carry an
epoch: the server writes it to R relay processes, each a server of its own for its share of the
clients' streams (client process i opens its streams to relay i mod R), and each relay writes it on
to every stream it holds. The clients' heartbeats go to their relay; a relay sends the server one
message a second (its count of open streams), as a relay would aggregate its hosts' heartbeats. The
clients' receipt times are still taken from the server's wake, so ``receive_p99_s`` is the floor of
a relayed fan-out on this machine (``--acks`` must stay ``none``), and the server's write figures
are its writes to the relays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from remesh.embedded import bound_to_parent  # noqa: E402
from remesh.embedded.certs import DevPki  # noqa: E402
from remesh.v1.security import Role, Tls, aio_channel  # noqa: E402

_METHOD = "/remesh.bench.Floor/Beat"
_ACK_METHOD = "/remesh.bench.Floor/Ack"
# An acknowledgement (host, incarnation, epoch, restored step, phases) encodes to about this size.
_ACK = b"a" * 96
_ACK_REPLY = b"\x08\x01"
# A one-host delta of a 10,000-member topology, encoded, is about this size.
_PAYLOAD = 160
_BEAT = b"b" * 48


# ---- the server (this process) --------------------------------------------------------------------


class _Stream:
    """One open stream's doorbell: a round's wake-up (``woke``, the wall time it began; negative:
    the benchmark is over) and the answers owed to acknowledgements it carried."""

    def __init__(self) -> None:
        self.woke: float | None = None
        self.replies = 0
        self.bell: asyncio.Future[None] | None = None

    def ring(self) -> None:
        if self.bell is not None and not self.bell.done():
            self.bell.set_result(None)


class _Streams:
    """Every open stream, and the count of writes of the round in progress."""

    def __init__(self) -> None:
        # A set: a stream whose client broke it leaves (its client opens another), so that a round
        # counts only the streams open.
        self.streams: set[_Stream] = set()
        self.written = 0
        self.expected = 0
        self.done: asyncio.Future[float] | None = None
        # Acknowledgements of the round in progress, by either path, and their expected count.
        self.acked = 0
        self.acks_expected = 0
        self.acks_done: asyncio.Future[float] | None = None
        # Every acknowledgement received, by the path it came (whatever was asked).
        self.by_path: Counter[str] = Counter()
        # With relays: the streams each relay holds, by its stream (from its latest report).
        self.relayed: dict[_Stream, int] = {}

    def wake(self, woke: float) -> None:
        for stream in self.streams:
            stream.woke = woke
            stream.ring()

    def ack(self, path: str) -> None:
        self.by_path[path] += 1
        self.acked += 1
        if self.acked == self.acks_expected and self.acks_done is not None and not self.acks_done.done():
            self.acks_done.set_result(time.perf_counter())

    async def handle_ack(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.ack("unary")
        return _ACK_REPLY

    async def handle(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        me = _Stream()
        self.streams.add(me)

        async def read() -> None:
            async for message in requests:
                if message[:1] == b"a":
                    # Answered on the stream, as remesh's coordinator answers one (an ack_reply).
                    self.ack("stream")
                    me.replies += 1
                    me.ring()
                elif message[:1] == b"o":
                    # A relay's report: how many of the clients' streams it holds.
                    (self.relayed[me],) = struct.unpack("!I", message[1:5])

        reader = asyncio.create_task(read())
        try:
            while True:
                if me.woke is not None:
                    woke, me.woke = me.woke, None
                    if woke < 0:
                        return  # the benchmark is over
                    yield struct.pack("!d", woke) + b"t" * (_PAYLOAD - 8)
                    self.written += 1
                    if self.written == self.expected and self.done is not None and not self.done.done():
                        self.done.set_result(time.perf_counter())
                    continue
                if me.replies:
                    me.replies -= 1
                    yield _ACK_REPLY
                    continue
                me.bell = loop.create_future()
                await me.bell
                me.bell = None
        finally:
            reader.cancel()
            self.streams.discard(me)
            self.relayed.pop(me, None)


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since it booted (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


async def _start_server(tls: Tls, streams_n: int) -> tuple[grpc.aio.Server, _Streams, int]:
    """A server for up to ``streams_n`` streams, with the coordinator's limits on pending calls."""
    calls = 2 * streams_n + 1024
    server = grpc.aio.server(
        maximum_concurrent_rpcs=calls,
        options=[
            ("grpc.server.max_pending_requests", calls),
            ("grpc.server.max_pending_requests_hard_limit", calls),
        ],
    )
    state = _Streams()
    handlers = {
        "Beat": grpc.stream_stream_rpc_method_handler(state.handle),
        "Ack": grpc.unary_unary_rpc_method_handler(state.handle_ack),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("remesh.bench.Floor", handlers),))
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    await server.start()
    return server, state, port


async def _serve_size(
    pki: DevPki,
    streams_n: int,
    clients_n: int,
    beats_per_second: float,
    rounds: int,
    acks: str = "none",
    ack_delay: float = 1.0,
    relays: int = 0,
) -> dict[str, Any]:
    server_tls = pki.tls(Role.COORDINATOR, "floor")
    server, state, port = await _start_server(server_tls, streams_n)
    host = pki.tls(Role.HOST, "floor-client")
    tls = [str(host.ca_file), str(host.cert_file), str(host.key_file)]
    relay_processes = []
    ports = [port]
    if relays:
        relay_args = ["--relay", f"localhost:{port}", "--client-tls", *tls, "--relay-server-tls"]
        relay_args += [str(server_tls.ca_file), str(server_tls.cert_file), str(server_tls.key_file)]
        for _ in range(relays):
            relay_processes.append(
                await asyncio.create_subprocess_exec(
                    *bound_to_parent(
                        [sys.executable, __file__, *relay_args, "--client-streams", str(streams_n)]
                    ),
                    stdout=asyncio.subprocess.PIPE,
                )
            )
        ports = []
        for relay in relay_processes:
            assert relay.stdout is not None
            ports.append(json.loads(await asyncio.wait_for(relay.stdout.readline(), 60.0))["port"])
    per_client = [streams_n // clients_n + (i < streams_n % clients_n) for i in range(clients_n)]
    interval = streams_n / beats_per_second
    client_args = ["--client-interval", str(interval), "--client-tls", *tls]
    client_args += ["--acks", acks, "--ack-delay", str(ack_delay)]
    clients = []
    for i, n in enumerate(per_client):
        address = f"localhost:{ports[i % len(ports)]}"  # the server, or this client's relay
        command = [sys.executable, __file__, "--client", address, *client_args, "--client-streams", str(n)]
        clients.append(
            await asyncio.create_subprocess_exec(
                *bound_to_parent(command),
                stdout=asyncio.subprocess.PIPE,
                limit=1 << 24,  # a round's latencies, one line of JSON
            )
        )

    def opened() -> int:
        return sum(state.relayed.values()) if relays else len(state.streams)

    try:
        start = time.monotonic()
        while opened() < streams_n or len(state.streams) < max(relays, 1):
            if time.monotonic() - start > 300:
                raise SystemExit(f"only {opened()} of {streams_n} streams opened in 300 s")
            await asyncio.sleep(0.2)
        print(
            f"  {streams_n} streams open after {time.monotonic() - start:.1f}s", file=sys.stderr, flush=True
        )
        await asyncio.sleep(min(interval, 5.0) + 1.0)  # every stream's first heartbeat in flight
        walls, cpus, p99s, acked_walls, round_cpus, busy, machine_cpus = [], [], [], [], [], [], []
        for round_ in range(rounds):
            state.written, state.expected = 0, len(state.streams)
            state.done = asyncio.get_running_loop().create_future()
            state.acked, state.acks_expected = 0, streams_n
            state.acks_done = asyncio.get_running_loop().create_future()
            machine0, cpu0, t0 = _machine_busy_s(), time.process_time(), time.perf_counter()
            state.wake(time.time())
            t1 = await state.done
            cpu = time.process_time() - cpu0
            acked_line = ""
            if acks != "none":
                t2 = await asyncio.wait_for(state.acks_done, 120.0)
                acked_walls.append(t2 - t0)
                round_cpus.append(time.process_time() - cpu0)
                acked_line = (
                    f", acknowledged ({acks}) in {t2 - t0:.3f}s "
                    f"({1e6 * round_cpus[-1] / streams_n:.0f} us of CPU a stream in all)"
                )
            received: list[float] = []
            for client in clients:
                assert client.stdout is not None
                line = await asyncio.wait_for(client.stdout.readline(), 60.0)
                received += json.loads(line)["latencies"]
            busy_line = ""
            if acks == "none":
                # Every process's CPU on the machine (the clients', relays', the kernel's), from the
                # wake to the last receipt read here.
                machine_cpus.append(_machine_busy_s() - machine0)
                busy.append(machine_cpus[-1] / (time.perf_counter() - t0))
                busy_line = (
                    f", the machine's cores busy {busy[-1]:.2f} "
                    f"({1e6 * machine_cpus[-1] / streams_n:.0f} us of its CPU a stream)"
                )
            p99 = statistics.quantiles(received, n=100)[98]
            walls.append(t1 - t0)
            cpus.append(cpu / state.expected)  # a stream the server wrote to (with relays, a relay's)
            p99s.append(p99)
            print(
                f"  {streams_n} streams, round {round_ + 1}/{rounds}: written in {t1 - t0:.3f}s "
                f"({1e6 * cpus[-1]:.0f} us of the server's CPU a stream), received p99 {p99:.3f}s "
                f"max {max(received):.3f}s{busy_line}{acked_line}",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(1.0)
        figures: dict[str, Any] = {
            "streams": streams_n,
            "write_all_s_p50": round(statistics.median(walls), 3),
            "write_cpu_us_per_stream": round(1e6 * statistics.median(cpus), 1),
            "receive_p99_s": round(statistics.median(p99s), 3),
            "rounds": rounds,
            "acks": acks,
            "acks_received": dict(state.by_path),
            "relays": relays,
            "server_streams": len(state.streams),  # with relays, theirs alone
        }
        if busy:
            figures["machine_busy_cores_p50"] = round(statistics.median(busy), 2)
            figures["machine_cpu_us_per_stream"] = round(1e6 * statistics.median(machine_cpus) / streams_n, 1)
        if acks != "none":
            figures["acked_all_s_p50"] = round(statistics.median(acked_walls), 3)
            figures["round_cpu_us_per_stream"] = round(1e6 * statistics.median(round_cpus) / streams_n, 1)
        return figures
    finally:
        state.wake(-1.0)
        await server.stop(1.0)
        for process in clients + relay_processes:
            if process.returncode is None:
                process.kill()
            await process.wait()


def measure_floor(
    streams: int,
    clients: int = 2,
    beats_per_second: float = 1000.0,
    rounds: int = 5,
    acks: str = "none",
    ack_delay: float = 1.0,
    relays: int = 0,
) -> dict[str, Any]:
    """One size's figures (the keys of the JSON line); progress lines go to stdout."""
    with tempfile.TemporaryDirectory(prefix="remesh-floor-") as tmp:
        return asyncio.run(
            _serve_size(
                DevPki(Path(tmp)), streams, clients, beats_per_second, rounds, acks, ack_delay, relays
            )
        )


# ---- a relay process (--relays) -------------------------------------------------------------------


async def _relay(args: argparse.Namespace) -> None:
    """Serve a share of the clients' streams and write on each message the server sends this relay."""
    server, state, port = await _start_server(
        Tls(*(Path(p) for p in args.relay_server_tls)), args.client_streams
    )
    sys.stdout.write(json.dumps({"port": port}) + "\n")
    sys.stdout.flush()
    channel = aio_channel(args.relay, Tls(*(Path(p) for p in args.client_tls)))

    async def reports() -> AsyncIterator[bytes]:
        while True:
            yield b"o" + struct.pack("!I", len(state.streams))
            await asyncio.sleep(1.0)

    call = channel.stream_stream(_METHOD, request_serializer=bytes, response_deserializer=bytes)(reports())
    try:
        async for message in call:
            (woke,) = struct.unpack("!d", message[:8])
            if woke < 0:
                break
            state.wake(woke)
    except grpc.aio.AioRpcError:
        pass  # the server ends its streams when the benchmark is over
    finally:
        state.wake(-1.0)
        await server.stop(1.0)


# ---- a client process ------------------------------------------------------------------------------


async def _client(args: argparse.Namespace) -> None:
    tls = Tls(*(Path(p) for p in args.client_tls))
    latencies: list[float] = []
    expected = args.client_streams
    broken: Counter[str] = Counter()

    def received(message: bytes) -> None:
        (woke,) = struct.unpack("!d", message[:8])
        latencies.append(time.time() - woke)
        if len(latencies) == expected:
            sys.stdout.write(json.dumps({"latencies": [round(x, 4) for x in latencies]}) + "\n")
            sys.stdout.flush()
            latencies.clear()

    async def one() -> None:
        # A stream that breaks is opened again, as an agent would, on a channel of its own each time:
        # the server waits for every stream, and a round for every stream's reading.
        while True:
            if await stream_once(aio_channel(args.client, tls)):
                return
            await asyncio.sleep(0.5 + random.random())

    async def stream_once(channel: grpc.aio.Channel) -> bool:
        """One stream until the server ends it (True) or it breaks (False)."""
        ack_call = channel.unary_unary(_ACK_METHOD, request_serializer=bytes, response_deserializer=bytes)
        # The stream's outgoing messages: heartbeats, and acknowledgements when they go on the stream.
        outgoing: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def beat() -> None:
            await asyncio.sleep(random.random() * args.client_interval)
            while True:
                outgoing.put_nowait(_BEAT)
                await asyncio.sleep(args.client_interval)

        async def requests() -> AsyncIterator[bytes]:
            while (message := await outgoing.get()) is not None:
                yield message

        async def acknowledge() -> None:
            await asyncio.sleep(args.ack_delay * (1.0 + random.random()))
            if args.acks == "stream":
                outgoing.put_nowait(_ACK)
            else:
                await ack_call(_ACK, timeout=60)

        beating = asyncio.create_task(beat())
        acking: set[asyncio.Task[None]] = set()
        call = channel.stream_stream(_METHOD, request_serializer=bytes, response_deserializer=bytes)(
            requests()
        )
        try:
            async for message in call:
                if message == _ACK_REPLY:
                    continue  # the answer to an acknowledgement sent on the stream
                received(message)
                if args.acks != "none":
                    task = asyncio.create_task(acknowledge())
                    acking.add(task)
                    task.add_done_callback(acking.discard)
            return True
        except grpc.aio.AioRpcError as exc:
            # Also how a stream ends when the server stops at the end, just before it kills this
            # process; counted, and told now and then, for a stream that breaks before.
            broken[exc.code().name] += 1
            if sum(broken.values()) % 100 == 1:
                print(f"  client: streams broken so far {dict(broken)}", file=sys.stderr, flush=True)
            return False
        finally:
            beating.cancel()
            outgoing.put_nowait(None)  # the request generator ends: gRPC need not close it mid-wait
            await channel.close(None)

    await asyncio.gather(*(one() for _ in range(args.client_streams)))


def main() -> None:
    # Stopped by SIGTERM (timeout, a scheduler), it still stops every process it started.
    from remesh.embedded import stop_on_sigterm

    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="5000,10000", help="stream counts, comma-separated")
    parser.add_argument(
        "--clients", type=int, default=2, help="client processes (scale.py runs 2 simulators)"
    )
    parser.add_argument("--beats-per-second", type=float, default=1000.0, help="heartbeats over all streams")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--acks",
        choices=("none", "unary", "stream"),
        default="none",
        help="each client acknowledges every message: a unary call each, or a message on its stream",
    )
    parser.add_argument(
        "--ack-delay",
        type=float,
        default=1.0,
        help="an acknowledgement goes this to twice this after receipt",
    )
    parser.add_argument(
        "--relays",
        type=int,
        default=0,
        help="relay processes between the server and the clients (0: the server writes to every stream)",
    )
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--relay", help=argparse.SUPPRESS)
    parser.add_argument("--relay-server-tls", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--client-streams", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client-interval", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--client-tls", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        asyncio.run(_client(args))
        return
    if args.relay:
        asyncio.run(_relay(args))
        return
    if args.clients < 1 or args.rounds < 1 or args.beats_per_second <= 0:
        parser.error("--clients and --rounds must be at least 1, --beats-per-second above 0")
    if args.relays < 0 or (args.relays and args.acks != "none"):
        parser.error("--relays must be at least 0, and with relays --acks must be none")
    figures = [
        measure_floor(
            int(n), args.clients, args.beats_per_second, args.rounds, args.acks, args.ack_delay, args.relays
        )
        for n in args.streams.split(",")
        if n
    ]
    print("all figures: " + json.dumps(figures))
    print(json.dumps(figures[-1]))


if __name__ == "__main__":
    main()

"""A fleet of simulated agents that speak the real protocol to a real coordinator.

Each simulator process runs hundreds to thousands of agents on one asyncio loop. Every simulated
agent is what a real agent is to the coordinator: its own gRPC channel with its own certificate
(``host/<id>``, mutual TLS), a registration, a heartbeat stream at the interval the coordinator
asks for, an acknowledgement of each epoch it is a member of, and a new registration when told.
It trains nothing. On command it fails the way hosts fail:

- ``crash``: the process is gone; its stream and connection close at once;
- ``silent``: it stops sending but keeps the connection (a stopped process, a hung host);
- ``resume``: a silent agent sends again (and registers again if it was declared dead).

The orchestrator (``Fleet``, used by ``tests/test_fleet.py`` and ``benchmarks/scale.py``) starts the
processes, sends them commands on stdin and reads what they saw on stdout, one JSON line each:
``{"ready": N}`` once every agent of the process is registered and streaming, then
``{"host": H, "epoch": E, "t": T, "whole": W, "via": V}`` for each new epoch an agent received
(T: wall-clock time; W: false when it came as a delta from the one before; V: "heartbeat", or
"relay" where it came first from a ``remesh relay``, with ``--relay``), ``{"following": H,
"relay": R}`` when an agent starts (R true) or stops following its relay, and
``{"beats": N, "t": T}`` every second. Run a simulator by hand with ``python benchmarks/fleet.py
--help``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from remesh.agent.connection import CoordinatorLink  # noqa: E402
from remesh.agent.settings import AgentSettings  # noqa: E402
from remesh.embedded import bound_to_parent  # noqa: E402
from remesh.v1 import coordinator_pb2 as pb  # noqa: E402
from remesh.v1 import coordinator_pb2_grpc as pb_grpc  # noqa: E402
from remesh.v1.security import Tls, aio_channel  # noqa: E402

__all__ = ["Fleet", "host_ids"]


def host_ids(count: int, prefix: str = "sim") -> list[str]:
    return [f"{prefix}-{i:05d}" for i in range(count)]


# ---- one simulator process ----------------------------------------------------------------------


# An acknowledgement that failed with these is sent again. CANCELLED is among them: the simulator
# never cancels one itself unless its host crashed, yet a coordinator under load answers some with it.
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class _Output:
    """What a simulator tells its orchestrator, a JSON line a document, written to standard output by a
    thread of its own, as many lines at a time as have come. A new epoch is a line from each of
    thousands of agents: written and flushed one by one on the event loop (which blocked whenever the
    orchestrator's pipe was full), they held up the agents' reading of the next messages on their
    streams, the fan-out being measured. Each receipt's time is taken when its agent reads it."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._closing = False
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._write, name="output", daemon=True)
        self._thread.start()

    def emit(self, doc: dict[str, Any]) -> None:
        line = json.dumps(doc, separators=(",", ":")) + "\n"
        with self._ready:
            self._lines.append(line)
            self._ready.notify()

    def close(self) -> None:
        """Every line emitted so far is written before this returns."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join(timeout=30)

    def _write(self) -> None:
        while True:
            with self._ready:
                while not self._lines and not self._closing:
                    self._ready.wait()
                lines, self._lines = self._lines, []
                closing = self._closing
            if lines:
                sys.stdout.write("".join(lines))
                sys.stdout.flush()
            if closing and not lines:
                return


_output: _Output | None = None


def _emit(doc: dict[str, Any]) -> None:
    assert _output is not None, "a simulator's output starts in main()"
    _output.emit(doc)


def _why(exc: grpc.aio.AioRpcError) -> str:
    """What gRPC said ended a call, its numbers left out so that the same cause counts once (a
    stream that ends UNAVAILABLE ended for a reason only the details name: a reset connection, a
    GOAWAY, a transport closed for memory)."""
    first = (exc.details() or "").partition("\n")[0]
    return re.sub(r"\d+", "N", first)[:100]


class SimAgent:
    def __init__(
        self,
        host_id: str,
        spare: bool,
        address: str,
        tls: Tls | None,
        beats: list[int],
        ack_delay_s: float = 0.0,
        acks_on_stream: bool = True,
        relay: str = "",
    ) -> None:
        self.host_id = host_id
        # As an agent given --relay does: topologies from this relay (``remesh relay``) while it
        # serves them, heartbeats saying so; from the heartbeat stream when it does not.
        self.relay = relay
        self.from_relay = False
        self.ack_delay_s = ack_delay_s
        # As an agent does: acknowledgements on the heartbeat stream where the coordinator answers
        # them there (RegisterResponse.acks_on_stream), else an AckEpoch call each.
        self.acks_on_stream = acks_on_stream
        self.spare = spare
        self.address = address
        self.tls = tls
        self.silent = asyncio.Event()  # set: send nothing
        self.speaking = asyncio.Event()
        self.speaking.set()
        self.crashed = False
        self.registered = asyncio.Event()
        self._beats = beats
        self._task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._acks: set[asyncio.Task[None]] = set()
        self.epoch = 0  # the newest epoch received
        self.member = False  # whether that epoch's topology holds this host
        self._acked: tuple[int, int] = (0, 0)  # the (incarnation, epoch) acknowledged last
        # The agent's own pauses and registration deadlines (its defaults), kept by the agent's link;
        # the channels are this simulator's (no keepalive pings: thousands per process).
        self._policy = CoordinatorLink(
            [address],
            keepalive_s=AgentSettings.keepalive_s,
            reconnect_initial_s=AgentSettings.reconnect_initial_s,
            reconnect_max_s=AgentSettings.reconnect_max_s,
            register_timeout_s=AgentSettings.coordinator_silence_s,
            register_timeout_max_s=AgentSettings.register_timeout_max_s,
        )
        self._registering = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.host_id)

    async def crash(self) -> None:
        self.crashed = True
        if self._task is not None:
            self._task.cancel()
        if self._channel is not None:
            await self._channel.close(grace=None)

    def go_silent(self) -> None:
        self.speaking.clear()

    def resume(self) -> None:
        self.speaking.set()

    async def _run(self) -> None:
        # As an agent does: a pause doubling after each failure, jittered, and a registration
        # deadline doubling after each that ran out; a registration resets both. A new channel each time.
        while not self.crashed:
            self._channel = aio_channel(self.address, self.tls)
            stub = pb_grpc.CoordinatorStub(self._channel)
            try:
                await self._session(stub)
            except grpc.aio.AioRpcError as exc:
                _emit(
                    {"stream_end": self.host_id, "code": exc.code().name, "why": _why(exc), "t": time.time()}
                )
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self._registering:
                    self._policy.registration_timed_out()
                await asyncio.sleep(self._policy.failed() * (0.5 + random.random()))
            finally:
                await self._channel.close(grace=None)

    async def _session(self, stub: pb_grpc.CoordinatorStub) -> None:
        role = pb.ROLE_SPARE if self.spare else pb.ROLE_ACTIVE
        self._registering = True
        reply = await stub.Register(
            pb.RegisterRequest(host_id=self.host_id, role=role, device_count=1, address="127.0.0.1"),
            timeout=self._policy.register_timeout_s,
        )
        self._registering = False
        self._policy.registered()
        incarnation = reply.member.incarnation
        interval = reply.heartbeat_interval_s or 1.0
        self.registered.set()

        # The stream's messages: heartbeats, and acknowledgements when they go on the stream.
        outgoing: asyncio.Queue[pb.HeartbeatRequest | None] = asyncio.Queue()
        on_stream = self.acks_on_stream and reply.acks_on_stream

        async def beat() -> None:
            # Spread over the interval, as agents started at different moments are.
            await asyncio.sleep(random.random() * interval)
            while True:
                await self.speaking.wait()
                self._beats[0] += 1
                outgoing.put_nowait(self._heartbeat(incarnation))
                await asyncio.sleep(interval)

        async def requests() -> Any:
            while (message := await outgoing.get()) is not None:
                yield message

        beating = asyncio.create_task(beat())
        relaying = (
            asyncio.create_task(
                self._follow_relay(stub, incarnation, outgoing, outgoing if on_stream else None)
            )
            if self.relay
            else None
        )
        try:
            await self._read(stub, stub.Heartbeat(requests()), incarnation, outgoing if on_stream else None)
        finally:
            beating.cancel()
            if relaying is not None:
                relaying.cancel()
            self.from_relay = False
            outgoing.put_nowait(None)

    async def _follow_relay(
        self,
        stub: pb_grpc.CoordinatorStub,
        incarnation: int,
        beats: asyncio.Queue[pb.HeartbeatRequest | None],
        outgoing: asyncio.Queue[pb.HeartbeatRequest | None] | None,
    ) -> None:
        """Topologies from the relay while it serves them, as an agent's ``_follow_relay`` takes them;
        a heartbeat says so at once. A relay stream that ends hands them back to the heartbeat stream."""

        def flag(value: bool) -> None:
            if self.from_relay != value:
                self.from_relay = value
                _emit({"following": self.host_id, "relay": value})
                if self.speaking.is_set():
                    beats.put_nowait(self._heartbeat(incarnation))

        while True:
            channel = aio_channel(self.relay, self.tls)
            try:
                # Read as bytes and parsed one at a time below: two relays write a new epoch to a
                # simulator's thousands of streams faster than it handles them, and gRPC parses
                # each message as it arrives; the first topology (9000 members, ~0.5 MB) parsed
                # for 5000 streams at once took a simulator past 9 GB, killed by the kernel. A real
                # agent reads one stream.
                follow = channel.unary_stream(
                    "/remesh.v1.TopologyRelay/FollowTopology",
                    request_serializer=pb.FollowTopologyRequest.SerializeToString,
                    response_deserializer=None,
                )
                call = follow(pb.FollowTopologyRequest(host_id=self.host_id, topology_deltas=True))
                held = 0
                async for raw in call:
                    message = pb.HeartbeatResponse.FromString(raw)
                    del raw
                    if not (message.HasField("topology") or message.HasField("topology_delta")):
                        continue  # a keepalive
                    held = self._received(message, held, "relay", stub, incarnation, outgoing)
                    del message
                    if held < 0:
                        break
                    flag(True)
            except grpc.aio.AioRpcError as exc:
                _emit(
                    {
                        "stream_end": self.host_id,
                        "code": f"relay {exc.code().name}",
                        "why": _why(exc),
                        "t": time.time(),
                    }
                )
            finally:
                flag(False)
                await channel.close(grace=None)
            await asyncio.sleep(self._policy.reconnect_max_s * (0.5 + random.random()))

    async def _read(
        self,
        stub: pb_grpc.CoordinatorStub,
        call: Any,
        incarnation: int,
        outgoing: asyncio.Queue[pb.HeartbeatRequest | None] | None,
    ) -> None:
        # What this simulated agent keeps of the topology: its epoch (``self.epoch``) and whether it
        # is a member. A real agent rebuilds the whole member list from a delta
        # (remesh.v1.deltas.apply: O(members) on its own host); a thousand of them in one process
        # would measure this process, not the coordinator, so a simulated one applies the delta to
        # what it keeps, and checks its base. A new stream starts with a whole topology.
        held = 0  # the epoch this stream sent last
        async for message in call:
            if message.HasField("ack_reply") and message.ack_reply.code:
                refused = message.ack_reply
                if not (
                    refused.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
                    and self.epoch > refused.epoch
                ):
                    _emit({"ack_failed": self.host_id, "epoch": refused.epoch, "code": str(refused.code)})
            if message.HasField("topology") or message.HasField("topology_delta"):
                held = self._received(message, held, "heartbeat", stub, incarnation, outgoing)
                if held < 0:
                    call.cancel()
                    return
            if message.command in (pb.COMMAND_REREGISTER, pb.COMMAND_DRAIN):
                _emit({"stream_end": self.host_id, "code": pb.Command.Name(message.command)})
                return  # register again (a drained host would leave; the simulator keeps it simple)
            if message.command == pb.COMMAND_FINISHED:
                self.crashed = True
                return
            # Not held until the next message (a keepalive, seconds away): parsed, a whole topology of
            # 9000 members is megabytes, and thousands of agents of one process each held one.
            del message

    def _received(
        self,
        message: pb.HeartbeatResponse,
        held: int,
        stream: str,
        stub: pb_grpc.CoordinatorStub,
        incarnation: int,
        outgoing: asyncio.Queue[pb.HeartbeatRequest | None] | None,
    ) -> int:
        """A topology or delta that came on ``stream`` (whose last epoch was ``held``); the epoch it
        brings, or -1 when a delta does not apply (the stream is out of step). Recorded and
        acknowledged once per epoch and incarnation, whichever stream brought it first."""
        if message.HasField("topology"):
            topology = message.topology
            member = any(m.host_id == self.host_id for m in topology.members)
        else:
            delta = message.topology_delta
            if delta.base_epoch != held:
                _emit(
                    {"delta_mismatch": self.host_id, "detail": f"{stream}: from {delta.base_epoch} on {held}"}
                )
                return -1
            topology = delta.topology
            if self.host_id in delta.removed:
                member = False
            elif any(m.host_id == self.host_id for m in delta.changed):
                member = True
            else:
                member = self.member
        if topology.epoch == 0 or topology.epoch < self.epoch or (incarnation, topology.epoch) == self._acked:
            # No job yet (the empty topology before its first epoch), stale, or already in hand (it
            # came on the other stream first).
            return topology.epoch
        self.epoch, self.member = topology.epoch, member
        whole = message.HasField("topology")
        _emit({"host": self.host_id, "epoch": self.epoch, "t": time.time(), "whole": whole, "via": stream})
        self._acked = (incarnation, self.epoch)
        if member and self.speaking.is_set():  # a silent host acknowledges nothing
            ack = asyncio.create_task(self._ack(stub, incarnation, self.epoch, outgoing))
            self._acks.add(ack)
            ack.add_done_callback(self._acks.discard)
        return topology.epoch

    def _heartbeat(self, incarnation: int, ack: pb.AckEpochRequest | None = None) -> pb.HeartbeatRequest:
        """One heartbeat of a running trainer, carrying ``ack`` when given."""
        return pb.HeartbeatRequest(
            host_id=self.host_id,
            incarnation=incarnation,
            trainer_status=pb.TRAINER_STATUS_RUNNING,
            topology_deltas=True,
            topology_from_relay=self.from_relay,
            ack=ack,
        )

    async def _ack(
        self,
        stub: pb_grpc.CoordinatorStub,
        incarnation: int,
        epoch: int,
        outgoing: asyncio.Queue[pb.HeartbeatRequest | None] | None,
    ) -> None:
        """As a trainer does (through its agent): once it has re-meshed (``ack_delay_s`` to twice
        that, drawn per epoch), on the heartbeat stream (``outgoing``; a refusal comes back on it), or
        as a call retried while the coordinator is busy or away; a refusal (the epoch is no longer
        current) ends it."""
        if self.ack_delay_s > 0:
            await asyncio.sleep(self.ack_delay_s * (1.0 + random.random()))
            if self.crashed or not self.speaking.is_set():
                return
        request = pb.AckEpochRequest(
            host_id=self.host_id, incarnation=incarnation, epoch=epoch, restored_step=-1, restore_source="sim"
        )
        if outgoing is not None:
            # In a heartbeat like the others, as an agent sends it: the coordinator reads every
            # message on the stream as a heartbeat, this one's trainer status included.
            outgoing.put_nowait(self._heartbeat(incarnation, request))
            return
        code = "?"
        for attempt in range(10):
            try:
                await stub.AckEpoch(request, timeout=30)
                return
            except grpc.aio.AioRpcError as exc:
                if self.crashed:
                    return
                code = exc.code().name
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and self.epoch > epoch:
                    return  # refused because a newer epoch came meanwhile: that one is acknowledged next
                if exc.code() not in _TRANSIENT:
                    break
                _emit({"ack_retried": self.host_id, "code": code})
                await asyncio.sleep(min(5.0, 0.2 * 2**attempt))
        _emit({"ack_failed": self.host_id, "epoch": epoch, "code": code})


async def _simulate(args: argparse.Namespace) -> None:
    hosts = [h for h in args.hosts.split(",") if h]
    spares = set(h for h in args.spares.split(",") if h)
    pki = Path(args.pki) if args.pki else None
    beats = [0]
    agents = {
        h: SimAgent(
            h,
            h in spares,
            args.coordinator,
            Tls(pki / "ca.pem", pki / f"host-{h}.pem", pki / f"host-{h}-key.pem") if pki else None,
            beats,
            args.ack_delay,
            args.acks == "stream",
            args.relay,
        )
        for h in hosts
    }
    for agent in agents.values():
        agent.start()
        await asyncio.sleep(args.start_spread / max(1, len(agents)))
    await asyncio.gather(*(a.registered.wait() for a in agents.values()))
    _emit({"ready": len(agents)})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def report() -> None:
        while True:
            await asyncio.sleep(1.0)
            _emit({"beats": beats[0], "t": time.time()})

    reporting = asyncio.create_task(report())
    while line := await reader.readline():
        command, *names = line.decode().split()
        chosen = [agents[n] for n in names if n in agents]
        if command == "crash":
            await asyncio.gather(*(a.crash() for a in chosen))
        elif command == "silent":
            for a in chosen:
                a.go_silent()
        elif command == "resume":
            for a in chosen:
                a.resume()
        elif command == "stop":
            break
        _emit({"done": command, "n": len(chosen), "t": time.time()})
    reporting.cancel()
    await asyncio.gather(*(a.crash() for a in agents.values()), return_exceptions=True)


# ---- the orchestrator ----------------------------------------------------------------------------


@dataclass
class Fleet:
    """Simulated agents in ``processes`` simulator processes, talking to ``coordinator``.

    ``pki``: a ``remesh.embedded.certs.DevPki`` whose CA the coordinator trusts (each agent gets its own
    certificate), or None for an insecure coordinator."""

    coordinator: str
    hosts: Sequence[str]
    spares: Sequence[str] = ()
    processes: int = 2
    pki: Any = None
    start_spread_s: float = 2.0
    # How long a simulated trainer takes to re-mesh before it acknowledges an epoch (0: at once).
    ack_delay_s: float = 0.0
    # "stream": acknowledgements on the heartbeat stream where the coordinator offers it, as agents
    # send them; "unary": an AckEpoch call each, as agents send them where it is not offered.
    acks: str = "stream"
    # Relays (``remesh relay`` addresses): simulator i's agents follow relays[i % len(relays)].
    relays: Sequence[str] = ()
    arrivals: dict[int, dict[str, float]] = field(default_factory=dict)
    # The agents that received each epoch as a delta from the one before.
    as_delta: dict[int, set[str]] = field(default_factory=dict)
    # The agents whose relay brought them each epoch first.
    via_relay: dict[int, set[str]] = field(default_factory=dict)
    # The agents that follow their relay now.
    following: set[str] = field(default_factory=set)
    beats: list[tuple[float, int]] = field(default_factory=list)
    # What went wrong at the simulated agents, counted: acknowledgements given up, streams broken.
    trouble: Counter[str] = field(default_factory=Counter)
    # When each kind of stream end was seen first and last (wall clock): a burst of thousands at one
    # moment is one cause, to be matched against the coordinator's log.
    trouble_seen: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._procs: list[subprocess.Popen[str]] = []
        self._owner: dict[str, subprocess.Popen[str]] = {}
        self._ready = 0
        self._done: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._beats_by_proc: dict[int, tuple[float, int]] = {}

    def start(self, timeout: float = 300.0) -> None:
        everyone = [*self.hosts, *self.spares]
        if self.pki is not None:
            from remesh.v1.security import Role

            for h in everyone:
                self.pki.tls(Role.HOST, h)
        shards = [everyone[i :: self.processes] for i in range(self.processes)]
        for i, shard in enumerate(shards):
            args = [
                sys.executable, str(Path(__file__).resolve()), "--coordinator", self.coordinator,
                "--hosts", ",".join(shard), "--spares", ",".join(h for h in shard if h in set(self.spares)),
                "--start-spread", str(self.start_spread_s), "--ack-delay", str(self.ack_delay_s),
                "--acks", self.acks,
            ]  # fmt: skip
            if self.pki is not None:
                args += ["--pki", str(self.pki.directory)]
            if self.relays:
                args += ["--relay", self.relays[i % len(self.relays)]]
            proc = subprocess.Popen(
                bound_to_parent(args),  # killed with whoever started it, even by SIGKILL
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self._procs.append(proc)
            for h in shard:
                self._owner[h] = proc
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while self._ready < len(self._procs):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self._ready} of {len(self._procs)} simulators ready after {timeout:.0f}s"
                )
            if any(p.poll() is not None for p in self._procs):
                raise RuntimeError("a simulator exited before its agents were ready")
            time.sleep(0.1)

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            doc = json.loads(line)
            with self._lock:
                if "ready" in doc:
                    self._ready += 1
                elif "host" in doc:
                    self.arrivals.setdefault(doc["epoch"], {}).setdefault(doc["host"], doc["t"])
                    if not doc["whole"]:
                        self.as_delta.setdefault(doc["epoch"], set()).add(doc["host"])
                    if doc["via"] == "relay":
                        self.via_relay.setdefault(doc["epoch"], set()).add(doc["host"])
                elif "following" in doc:
                    (self.following.add if doc["relay"] else self.following.discard)(doc["following"])
                elif "beats" in doc:
                    self._beats_by_proc[proc.pid] = (doc["t"], doc["beats"])
                    self.beats.append((doc["t"], sum(b for _, b in self._beats_by_proc.values())))
                elif "done" in doc:
                    self._done.append(doc)
                elif "ack_failed" in doc:
                    self.trouble[f"acknowledgement given up ({doc['code']})"] += 1
                elif "ack_retried" in doc:
                    self.trouble[f"acknowledgement retried ({doc['code']})"] += 1
                elif "delta_mismatch" in doc:
                    self.trouble[f"topology delta out of step ({doc['detail']})"] += 1
                elif "stream_end" in doc:
                    why = f": {doc['why']}" if doc.get("why") else ""
                    key = f"stream ended ({doc['code']}{why})"
                    self.trouble[key] += 1
                    if "t" in doc:
                        first, _ = self.trouble_seen.get(key, (doc["t"], doc["t"]))
                        self.trouble_seen[key] = (first, doc["t"])

    def trouble_report(self) -> str:
        """What went wrong at the simulated agents, one kind a line, with when it was seen (UTC)."""
        with self._lock:
            counted = list(self.trouble.items())
            seen = dict(self.trouble_seen)
        if not counted:
            return "no trouble"

        def when(key: str) -> str:
            if key not in seen:
                return ""
            first, last = (time.strftime("%H:%M:%S", time.gmtime(t)) for t in seen[key])
            return f" at {first}" if first == last else f" from {first} to {last}"

        return "".join(f"\n    {n} x {key}{when(key)}" for key, n in counted)

    def command(self, command: str, hosts: Sequence[str]) -> float:
        """Send ``command`` to the agents ``hosts`` at once; returns when the last simulator did it."""
        by_proc: dict[subprocess.Popen[str], list[str]] = {}
        for h in hosts:
            by_proc.setdefault(self._owner[h], []).append(h)
        with self._lock:
            before = len(self._done)
        for proc, names in by_proc.items():
            assert proc.stdin is not None
            proc.stdin.write(f"{command} {' '.join(names)}\n")
            proc.stdin.flush()
        deadline = time.monotonic() + 30
        while True:
            with self._lock:
                done = self._done[before:]
            if len(done) >= len(by_proc):
                return max(d["t"] for d in done)
            if time.monotonic() > deadline:
                raise TimeoutError(f"simulators did not carry out {command!r}")
            time.sleep(0.01)

    def relay_followers(self) -> set[str]:
        """The agents that follow their relay now."""
        with self._lock:
            return set(self.following)

    def received(self, epoch: int) -> dict[str, float]:
        with self._lock:
            return dict(self.arrivals.get(epoch, {}))

    def heartbeat_rate(self, seconds: float = 5.0) -> float:
        """Heartbeats sent per second by the whole fleet over the last ``seconds``."""
        with self._lock:
            samples = list(self.beats)
        if len(samples) < 2:
            return 0.0
        end_t, end_n = samples[-1]
        start = next(((t, n) for t, n in samples if t >= end_t - seconds), samples[0])
        return (end_n - start[1]) / max(1e-9, end_t - start[0])

    def close(self) -> None:
        for proc in self._procs:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write("stop\n")
                proc.stdin.flush()
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    parser.add_argument("--hosts", required=True, help="comma-separated host ids this process simulates")
    parser.add_argument("--spares", default="", help="which of them register as spares")
    parser.add_argument(
        "--pki", default="", help="directory of a `remesh certs` CA with host-<id> certificates"
    )
    parser.add_argument("--start-spread", type=float, default=2.0, help="seconds over which agents start")
    parser.add_argument(
        "--ack-delay",
        type=float,
        default=0.0,
        help="seconds (to twice that) an agent's trainer takes to re-mesh before it acknowledges an epoch",
    )
    parser.add_argument(
        "--acks",
        choices=("stream", "unary"),
        default="stream",
        help="acknowledge on the heartbeat stream where the coordinator offers it (as agents do), or by AckEpoch calls",
    )
    parser.add_argument(
        "--relay", default="", help="host:port of a `remesh relay` the agents take their topologies from"
    )
    args = parser.parse_args()
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    global _output
    _output = _Output()
    try:
        asyncio.run(_simulate(args))
    finally:
        _output.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

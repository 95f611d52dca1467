"""The agent: one per training host. Registers, heartbeats, supervises the trainer, relays epochs.

::

    run ─> register ─> heartbeat stream ──topology──> start / stop / keep the trainer
             ^              │  ──command──> REREGISTER: stop the trainer, register again (spare)
             │              │              DRAIN: stop the trainer, leave, exit
             └──backoff─────┘  (stream or coordinator lost: the trainer keeps running)

Beside the active trainer the agent keeps a warm standby process (same command, JAX imported, told
rank -1): when the active trainer dies as collateral damage (a peer's death aborted its JAX runtime)
the standby is promoted at once, so the host rejoins without paying for a process start. The next
standby starts once the new active trainer has acknowledged its epoch: importing JAX takes seconds of
CPU that a recovering trainer needs more.

With several coordinator replicas the agent finds the leader itself: a follower refuses with
UNAVAILABLE and names the leader in the trailing metadata ``remesh-leader``; the agent goes there at
once (unless that address just failed: a dead leader is named until its lease runs out), else tries
the next address after a short pause. A leader that stops answering (no message on the heartbeat
stream, not even its keepalive, for ``coordinator_silence_s``) counts as lost, like a broken stream.

The trainer talks to the agent through the local API (``remesh.v1.AgentLocal``) whose address it finds
in ``REMESH_AGENT_ADDRESS``; its assignment for the epoch it was started on is in its environment too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc
import structlog

from remesh.agent import core
from remesh.agent.connection import CoordinatorLink, StreamAcks, StreamClosed, leader_hint, metadata
from remesh.agent.core import AgentState, Decision, Do, Fault
from remesh.agent.local_api import LocalApi
from remesh.agent.metrics import AgentMetrics
from remesh.agent.pauses import Pauses
from remesh.agent.settings import AgentSettings
from remesh.agent.supervisor import Role, Run, TrainerProcess
from remesh.v1 import agent_pb2 as apb
from remesh.v1 import agent_pb2_grpc as apb_grpc
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1 import deltas
from remesh.v1.contract import (
    FINISHED_METADATA,
    SNAPSHOT_OWNER_FILE,
    Env,
    TrainerAssignment,
    commits_of,
    rank_of,
    recovery_id,
    snapshot_dir_name,
)
from remesh.v1.security import aio_channel

__all__ = ["Agent", "AgentExit"]

# Where trainers keep host-memory snapshots by default (remesh.elastic.Policy.shm_dir): what the
# agent cleans up after a finished job. Under another Policy.shm_dir a ranked trainer still deletes
# its own on the way out; a spare's is left there.
DEFAULT_SHM_DIR = "/dev/shm"

log = structlog.get_logger("remesh.agent")

T = TypeVar("T")


def _thread_schedstat() -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread; None where
    the kernel does not say (not Linux, or schedstats off)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            ran, waited = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(ran) / 1e9, int(waited) / 1e9


def _where_the_time_went(
    gap: float, before: tuple[float, float] | None, after: tuple[float, float] | None
) -> dict[str, float]:
    if before is None or after is None:
        return {}
    ran, waited = after[0] - before[0], after[1] - before[1]
    return {
        "ran_s": round(ran, 3),
        "waited_for_cpu_s": round(waited, 3),
        "blocked_s": round(gap - ran - waited, 3),
    }


class AgentExit(Exception):
    """The agent must stop: the job halted, the host was drained, or the coordinator refused it."""

    def __init__(self, reason: str, code: int = 0) -> None:
        super().__init__(reason)
        self.code = code


class _Reregister(Exception):
    pass


class _StreamEnded(Exception):
    """The coordinator closed the heartbeat stream without a command (it is shutting down), or
    stopped answering on it."""


# Keepalives a coordinator may miss in a row before the agent takes it for lost.
_KEEPALIVES_MISSED = 4
_EOF: Any = getattr(grpc.aio, "EOF")  # noqa: B009 - the type stubs lack it

# How long a call the trainer waits on (acknowledge, commit, finish) keeps trying through a leader
# change or a reconnect: longer than a failover takes (~1.5 s), shorter than the trainer's own
# deadline for the local call.
_RELAYED_CALL_S = 8.0
# What a relayed call is sent again after. UNAVAILABLE and DEADLINE_EXCEEDED: a leader change or a
# reconnect. CANCELLED: the agent closed the channel under the call to reconnect, or a coordinator
# under load shed it (benchmarks/scale.py at 2000 hosts: gRPC answered a few of a burst of 1800
# acknowledgements that way within a second). The agent never cancels a relayed call itself, and each
# of them is safe to repeat.
_RELAY_AGAIN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# How long a trainer fault's report keeps trying (``_relay``): nothing else tells the coordinator that
# the trainer died, so longer than a relayed call, yet bounded (the stall detector is the fallback).
_FAULT_REPORT_S = 30.0
# An answer on the heartbeat stream carries its status as the number (pb.AckReply.code).
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


_FAULT_KINDS = {
    Fault.TRAINER_EXITED: pb.FAULT_KIND_TRAINER_EXITED,
    Fault.TRAINER_HUNG: pb.FAULT_KIND_TRAINER_HUNG,
    Fault.ADDRESS_IN_USE: pb.FAULT_KIND_ADDRESS_IN_USE,
    Fault.STATE_LOST: pb.FAULT_KIND_STATE_LOST,
    Fault.TRAINER_RESTARTED: pb.FAULT_KIND_TRAINER_RESTARTED,
}


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        # This agent process's own id: its trainers keep host-memory snapshots under it, and drop
        # those they find under another (remesh.elastic.snapshots.claim).
        self.session_id = uuid.uuid4().hex
        # Where its trainer processes leave their exit notes (Env.EXIT_NOTE): only this user may
        # enter it, and it goes with the agent.
        self._notes_dir = tempfile.mkdtemp(prefix="remesh-agent-notes-")
        self.log = log.bind(host=settings.host_id)
        self.incarnation = 0
        # How long the coordinator waits before it declares a silent host dead, as its last
        # registration said (0: not registered yet): what the lease derives from.
        self._heartbeat_timeout_s = 0.0
        self.topology = pb.Topology(epoch=0, restore_step=-1)
        self.topology_changed = asyncio.Condition()
        self.last_step = -1
        self.last_progress = time.monotonic()
        # Whether the trainer completed a step since its start or its epoch's: the hang clock's
        # limit is the start-up timeout until it has.
        self.stepped = False
        self._stall_reported = False
        # The newest epoch the trainer reported a step of: an older one's report arrives late.
        self._reported_epoch = 0
        # The tiers a trainer said cannot keep its snapshots, each with the incarnation the
        # coordinator was told of it for (or is being told): once per incarnation, however often
        # the reports repeat it and whichever trainer process says it.
        self._tiers_told: dict[str, int] = {}
        self._telling: set[asyncio.Task[None]] = set()
        self.local_address = ""
        self.trainer: TrainerProcess | None = None
        self.warm: TrainerProcess | None = None
        self._slots = 0
        # Bumped on every new epoch and every promotion: assignment watchers wake on it.
        self._version = 0
        # Where the agent stands with the coordinator, and whether it starts trainers (core.AgentState).
        self.state = AgentState()
        self._starting = asyncio.Lock()
        self.metrics = AgentMetrics(settings.host_id, settings.job_id)
        # When this process itself did not run: silence that fell into such a pause is not the
        # coordinator's (remesh.agent.pauses).
        self.pauses = Pauses()
        # Read when scraped (another thread): a warm standby is ready while its process runs.
        self.metrics.standby_ready.set_function(lambda: float(self.warm is not None and self.warm.running()))
        self.metrics.cut_off_seconds.set_function(self._cut_off_for)
        self.link = CoordinatorLink(
            settings.coordinators,
            keepalive_s=settings.keepalive_s,
            reconnect_initial_s=settings.reconnect_initial_s,
            reconnect_max_s=settings.reconnect_max_s,
            register_timeout_s=settings.coordinator_silence_s,
            register_timeout_max_s=settings.register_timeout_max_s,
            tls=settings.tls,
        )
        self._stopping = asyncio.Event()
        self._trainer_watch: asyncio.Task[None] | None = None
        self._shutdown_task: asyncio.Task[None] | None = None
        # Set by a progress report: the next heartbeat goes out at once, so the coordinator knows
        # every member's last step within milliseconds (it picks the restore step from them).
        self._progress = asyncio.Event()
        self._warm_task: asyncio.Task[None] | None = None
        # The open heartbeat stream's acknowledgements, when its coordinator answers them there.
        self._stream_acks: StreamAcks | None = None
        # The trainer's CPU time at the last heartbeat, and when it last changed (see _trainer_status).
        self._cpu_ticks: int | None = None
        self._cpu_changed_at: float | None = None
        # Topologies come from the relay (settings.relay) now: heartbeats say so, and the coordinator
        # writes none on the stream until they stop saying so.
        self._from_relay = False
        # One topology at a time, whichever stream brought it (the heartbeat stream's, the relay's).
        self._topology_lock = asyncio.Lock()

    # ---- coordinator connection ------------------------------------------------------------------

    def _connect(self) -> pb_grpc.CoordinatorStub:
        return self.link.stub()

    async def run(self) -> int:
        """Serve until told to stop; returns the process exit code."""
        local = grpc.aio.server()
        apb_grpc.add_AgentLocalServicer_to_server(LocalApi(self), local)
        private_dir = self._bind_local(local)
        await local.start()
        metrics_port = (
            self.metrics.serve(self.settings.metrics_port, self.settings.metrics_address)
            if self.settings.metrics_port is not None
            else None
        )
        self.log.info(
            "agent started",
            local_api=self.local_address,
            metrics_port=metrics_port,
            coordinators=",".join(self.settings.coordinators),
            tls=self.settings.tls is not None,
        )
        lease = asyncio.create_task(self._lease_watch(), name="lease")
        pauses = asyncio.create_task(self.pauses.run(), name="pauses")
        try:
            while not self._stopping.is_set():
                try:
                    await self._session()
                except _Reregister as exc:
                    self.log.warning("coordinator asked to register again", reason=str(exc))
                    await self._stop_trainer("this incarnation is no longer a member")
                    self.link.registered()
                except (grpc.aio.AioRpcError, _StreamEnded) as exc:
                    if isinstance(exc, grpc.aio.AioRpcError) and metadata(exc, FINISHED_METADATA):
                        raise AgentExit(f"nothing to do: {exc.details()}", code=0) from exc
                    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.FAILED_PRECONDITION,
                    ):
                        raise AgentExit(f"coordinator refused this agent: {exc.details()}", code=2) from exc
                    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (
                        grpc.StatusCode.UNAUTHENTICATED,
                        grpc.StatusCode.PERMISSION_DENIED,
                    ):
                        raise AgentExit(
                            f"coordinator refused this agent's identity: {exc.details()} (its certificate "
                            f"must name spiffe://<trust domain>/host/{self.settings.host_id})",
                            code=2,
                        ) from exc
                    hint = leader_hint(exc) if isinstance(exc, grpc.aio.AioRpcError) else None
                    if hint is not None:
                        # A replica answered: this host is not cut off, whatever the leader's state.
                        self.state = self.state.answered()
                        await self._follow(hint)
                        continue
                    self.state = self.state.unreachable(time.monotonic())
                    address, pause = self.link.address, self.link.failed()
                    self.log.warning(
                        "coordinator unreachable; retrying",
                        address=address,
                        error=exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc),
                        retry_in_s=round(pause, 3),
                    )
                    await self.link.close(rotate=True)
                    await self._pause(pause)
            return 0
        except AgentExit as exc:
            (self.log.info if exc.code == 0 else self.log.error)("agent exiting", reason=str(exc))
            return exc.code
        finally:
            lease.cancel()
            pauses.cancel()
            await self._stop_trainer("agent stopping", warm_too=True)
            await local.stop(0.2)
            await self.link.close(rotate=False)
            if private_dir is not None:
                shutil.rmtree(private_dir, ignore_errors=True)
            shutil.rmtree(self._notes_dir, ignore_errors=True)

    def _bind_local(self, server: grpc.aio.Server) -> str | None:
        """Bind the trainer's local API; returns the private directory made for it (None for TCP).

        By default a Unix socket in a fresh directory only this user may enter (mode 0700): no other
        local user can speak for the trainer. ``local_listen`` host:port binds TCP on loopback
        instead, which any local user can reach; ``unix:/path`` a Unix socket there.
        """
        if self.settings.local_listen.startswith("unix:"):
            server.add_insecure_port(self.settings.local_listen)
            self.local_address = self.settings.local_listen
            return None
        if self.settings.local_listen:
            port = server.add_insecure_port(self.settings.local_listen)
            host = self.settings.local_listen.rsplit(":", 1)[0] or "127.0.0.1"
            self.local_address = f"{host}:{port}"
            return None
        directory = tempfile.mkdtemp(prefix="remesh-agent-")  # 0700
        path = os.path.join(directory, "local.sock")
        server.add_insecure_port(f"unix:{path}")
        os.chmod(path, 0o600)
        self.local_address = f"unix:{path}"
        return directory

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds * (0.5 + random.random()))

    async def _follow(self, leader: str) -> None:
        """A follower answered: go to the leader it names at once, or try the next address shortly
        (no leader known yet, or it names the one that just failed)."""
        usable = self.link.usable(leader)
        self.log.info(
            "coordinator is a follower", address=self.link.address, leader=leader or None, following=usable
        )
        await self.link.close(rotate=not usable)
        if usable:
            self.link.follow(leader)
        else:
            await self._pause(self.settings.leader_retry_s)

    def request_shutdown(self, reason: str) -> None:
        """From a signal handler: shut down in the background."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.create_task(self.shutdown(reason))

    async def shutdown(self, reason: str) -> None:
        """Graceful stop (SIGTERM): stop the trainer, leave the job, exit."""
        self.log.info("agent shutting down", reason=reason)
        await self._stop_trainer(reason, warm_too=True)
        await self._leave(reason)
        self._stopping.set()

    async def _leave(self, reason: str) -> None:
        """Leave the job (best effort): the coordinator records ``member_left``, where the stream's
        end would otherwise read as this host failing."""
        if self.incarnation:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._connect().Leave(
                    pb.LeaveRequest(
                        host_id=self.settings.host_id, incarnation=self.incarnation, reason=reason
                    ),
                    timeout=2,
                )

    async def _session(self) -> None:
        """Register, then keep one heartbeat stream until it ends."""
        stub = self._connect()
        t_register = time.monotonic()
        try:
            reply = await stub.Register(
                pb.RegisterRequest(
                    host_id=self.settings.host_id,
                    role=pb.ROLE_SPARE if self.settings.spare else pb.ROLE_ACTIVE,
                    device_count=self.settings.device_count,
                    address=self.settings.address,
                    job_id=self.settings.job_id,
                ),
                timeout=self.link.register_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.link.registration_timed_out()
            raise
        self.link.registered()
        self.metrics.call("Register", time.monotonic() - t_register)
        self.metrics.registrations.inc()
        self.incarnation = reply.member.incarnation
        self._heartbeat_timeout_s = reply.heartbeat_timeout_s
        self.state = self.state.registered(
            epoch=reply.topology.epoch,
            as_spare_listed_with_rank=reply.member.role == pb.ROLE_SPARE
            and rank_of(reply.topology, self.settings.host_id) >= 0,
        )
        self.log = log.bind(host=self.settings.host_id, incarnation=self.incarnation)
        self.log.info("registered", role=pb.Role.Name(reply.member.role), epoch=reply.topology.epoch)
        interval = reply.heartbeat_interval_s or 0.1
        acks = StreamAcks() if reply.acks_on_stream else None
        call = stub.Heartbeat(self._heartbeats(interval, acks))
        # A coordinator of a large fleet sends keepalives less often (RegisterResponse.keepalive_s):
        # silent for four of them is lost, as 2 s is at the default 0.5 s.
        silence = max(self.settings.coordinator_silence_s, _KEEPALIVES_MISSED * reply.keepalive_s)
        self.metrics.connected.set(1)
        self._stream_acks = acks
        reading = asyncio.ensure_future(self._read_stream(call, silence, acks))
        following = asyncio.create_task(self._follow_relay(), name="relay") if self.settings.relay else None
        try:
            if following is None:
                await reading
            else:
                # The relay follower runs until the session ends; what ends it early (the job
                # halted, a command) ends the session as the heartbeat stream's would.
                await asyncio.wait((reading, following), return_when=asyncio.FIRST_COMPLETED)
                if following.done():
                    reading.cancel()
                    following.result()
                await reading
        finally:
            for task in (reading, following):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            self._from_relay = False
            self.metrics.connected.set(0)
            if acks is not None:
                acks.close()
            self._stream_acks = None

    async def _follow_relay(self) -> None:
        """Topologies from the relay (``settings.relay``) for as long as it serves them; while it does,
        heartbeats say so and the coordinator writes none. A relay stream that ends or says nothing
        for ``relay_silence_s`` (its keepalives stopped) hands the topologies back to the heartbeat
        stream at once, and is opened again after a pause doubling up to ``reconnect_max_s``."""
        relay, pause = self.settings.relay, self.settings.reconnect_initial_s
        options = [("grpc.keepalive_time_ms", int(self.settings.relay_ping_s * 1000))]
        while True:
            channel = aio_channel(relay, self.settings.tls, options)
            held: pb.Topology | None = None
            try:
                call = pb_grpc.TopologyRelayStub(channel).FollowTopology(
                    pb.FollowTopologyRequest(host_id=self.settings.host_id, topology_deltas=True)
                )
                while True:
                    message = await asyncio.wait_for(call.read(), self.settings.relay_silence_s)
                    if message is _EOF:
                        reason = "the relay closed the stream"
                        break
                    if message.HasField("topology"):
                        held = message.topology
                    elif message.HasField("topology_delta"):
                        held = deltas.apply(held or pb.Topology(), message.topology_delta)
                    else:
                        continue  # a keepalive
                    if not self._from_relay:
                        self._from_relay = True
                        self._progress.set()  # the next heartbeat says so now
                        self.log.info("topologies from the relay", relay=relay, epoch=held.epoch)
                    pause = self.settings.reconnect_initial_s
                    await self._on_topology(held, "relay")
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except TimeoutError:
                reason = f"the relay sent nothing for {self.settings.relay_silence_s}s"
            except deltas.DeltaMismatch as exc:
                reason = f"the relay stream is out of step ({exc})"
            finally:
                await channel.close(grace=None)
            if self._from_relay:
                self._from_relay = False
                self._progress.set()  # the coordinator sends the current topology on the next heartbeat
            self.log.warning(
                "relay lost; topologies from the coordinator meanwhile",
                relay=relay,
                reason=reason,
                retry_in_s=round(pause, 3),
            )
            await asyncio.sleep(pause * (0.5 + random.random()))
            pause = min(self.settings.reconnect_max_s, 2 * pause)

    async def _read_stream(self, call: Any, silence: float, acks: StreamAcks | None) -> None:
        # The topology this stream sent last: a delta on it is a difference from that one.
        held: pb.Topology | None = None
        while True:
            reading = asyncio.ensure_future(call.read())
            window = time.monotonic()
            while not (await asyncio.wait({reading}, timeout=silence))[0]:
                now = time.monotonic()
                paused = self.pauses.since(window, now)
                if paused > 0:
                    # This process did not run for part of the window (the machine stalled): what
                    # the coordinator sent may be waiting unread. A fresh window, not a lost stream.
                    self.log.info(
                        "the agent itself was paused; the coordinator's silence is not counted",
                        paused_s=round(paused, 3),
                    )
                    window = now
                    continue
                reading.cancel()
                call.cancel()
                raise _StreamEnded(
                    f"the coordinator at {self.link.address} sent nothing for {silence}s (not even a keepalive)"
                )
            message = reading.result()
            if message is _EOF:
                break
            assert isinstance(message, pb.HeartbeatResponse)
            if message.HasField("ack_reply") and acks is not None:
                acks.answered(message.ack_reply)
            if message.echo:
                self.metrics.heartbeat_rtt.observe(
                    max(0.0, time.monotonic() - message.echo - message.echo_held_s)
                )
            if message.HasField("topology"):
                held = message.topology
                await self._on_topology(held, "whole")
            elif message.HasField("topology_delta"):
                try:
                    held = deltas.apply(held or pb.Topology(), message.topology_delta)
                except deltas.DeltaMismatch as exc:
                    call.cancel()
                    raise _StreamEnded(
                        f"the heartbeat stream is out of step ({exc}); starting it again"
                    ) from None
                await self._on_topology(held, "delta")
            if message.command == pb.COMMAND_REREGISTER:
                raise _Reregister(message.reason)
            if message.command == pb.COMMAND_DRAIN:
                await self.shutdown(f"drained: {message.reason}")
                raise AgentExit("drained by the coordinator")
            if message.command == pb.COMMAND_FINISHED:
                await self._job_finished(message.reason)
                self._release_snapshots()
                raise AgentExit(message.reason, code=0)
        raise _StreamEnded("the coordinator closed the heartbeat stream")

    async def _heartbeats(
        self, interval: float, acks: StreamAcks | None
    ) -> AsyncIterator[pb.HeartbeatRequest]:
        incarnation = self.incarnation
        sent, sched = time.monotonic(), _thread_schedstat()
        while not self._stopping.is_set():
            gap, sent = time.monotonic() - sent, time.monotonic()
            before, sched = sched, _thread_schedstat()
            if gap > 3 * interval:
                # The coordinator declares a host dead after a few missed heartbeats: a gap like
                # this one comes from the agent's own host, not the network. Where the time went
                # tells the cause: waiting for a CPU (starved), running (the loop was busy with work
                # of its own), or neither (asleep in a system call, on a lock, or stopped).
                self.log.warning(
                    "heartbeat late", gap_s=round(gap, 3), **_where_the_time_went(gap, before, sched)
                )
            yield pb.HeartbeatRequest(
                host_id=self.settings.host_id,
                incarnation=incarnation,
                step=self.last_step,
                trainer_status=self._trainer_status(),
                probe=time.monotonic(),  # echoed in a keepalive: the round trip
                topology_deltas=True,  # read from the first: new epochs may come as deltas
                topology_from_relay=self._from_relay,
                ack=acks.outbox.popleft() if acks is not None and acks.outbox else None,
            )
            if acks is not None and acks.outbox:
                continue  # another acknowledgement waits: no pause before it
            self._check_hang()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), interval)
            self._progress.clear()

    def _lease_s(self) -> float:
        """How long this host may be cut off before its ranked trainer stops (``core.lease_s``):
        ``--lease``, else derived from the heartbeat timeout the coordinator sent."""
        return core.lease_s(configured=self.settings.lease_s, heartbeat_timeout_s=self._heartbeat_timeout_s)

    async def _lease_watch(self) -> None:
        """Stop the ranked trainer once no coordinator has been reachable for the lease."""
        if self._lease_s() <= 0:
            return  # --lease 0: no fence
        while True:
            lease_s = self._lease_s()
            await asyncio.sleep(min(0.1, lease_s / 4))
            trainer = self.trainer
            now, lost_at = time.monotonic(), self.state.lost_at
            decision = core.lease_lost(
                self.state,
                # A pause of this whole process is no time spent cut off: the coordinator was not
                # given the chance to answer.
                now=now - (self.pauses.since(lost_at, now) if lost_at is not None else 0.0),
                lease_s=lease_s,
                running=trainer is not None and trainer.running(),
                ranked=self._rank(self.topology) >= 0,
            )
            if decision.do is Do.STOP_TRAINER:
                self.metrics.lease_expiries.inc()
                self.log.warning(
                    "lease lost: no coordinator reachable; stopping the trainer, which may no longer "
                    "hold its rank",
                    reason=decision.reason,
                    epoch=self.topology.epoch,
                )
                await self._stop_trainer(decision.reason)

    def _cut_off_for(self) -> float:
        lost_at = self.state.lost_at  # one read: the state is replaced, never changed in place
        return 0.0 if lost_at is None else max(0.0, time.monotonic() - lost_at)

    def _rank(self, topology: pb.Topology) -> int:
        return core.rank_in(
            topology.epoch, rank_of(topology, self.settings.host_id), self.state.unranked_through
        )

    # ---- trainer supervision ---------------------------------------------------------------------

    def _trainer_status(self) -> Any:
        trainer = self.trainer
        if trainer is None or trainer.run is Run.NOT_STARTED:
            return pb.TRAINER_STATUS_NOT_STARTED
        if trainer.hung:  # killed for no progress, whether or not it has exited yet
            return pb.TRAINER_STATUS_HUNG
        if trainer.run is Run.EXITED:
            return pb.TRAINER_STATUS_EXITED
        # A trainer that used no CPU for a while is stopped or deadlocked (or waits in a collective,
        # which its own stall report says): the coordinator blames no member that still computes.
        now, ticks = time.monotonic(), trainer.cpu_ticks()
        if ticks is None or ticks != self._cpu_ticks or self._cpu_changed_at is None:
            self._cpu_ticks, self._cpu_changed_at = ticks, now
        idle = now - self._cpu_changed_at >= self.settings.idle_after_s
        return pb.TRAINER_STATUS_HUNG if idle else pb.TRAINER_STATUS_RUNNING

    def _check_hang(self) -> None:
        trainer = self.trainer
        if trainer is None or trainer.hung:
            return
        now = time.monotonic()
        if core.hung(
            now=now,
            timeout_s=self.settings.hang_timeout_s,
            startup_timeout_s=self.settings.startup_timeout_s,
            stepped=self.stepped,
            last_progress=self.last_progress,
            started_at=trainer.started_at,
            ranked=self._rank(self.topology) >= 0,
            running=trainer.running(),
        ):
            silent = now - max(self.last_progress, trainer.started_at)
            self.log.warning(
                "trainer hung: no step progress; killing it",
                silent_s=round(silent, 1),
                epoch=trainer.epoch,
                clock="step" if self.stepped else "start-up",
            )
            trainer.kill_hung()

    async def _on_topology(self, topology: pb.Topology, sent_as: str) -> None:
        """A topology arrived on the heartbeat stream, ``sent_as`` "whole" or as a "delta" from the
        one before it, or from the "relay"."""
        async with self._topology_lock:
            await self._on_topology_locked(topology, sent_as)

    async def _on_topology_locked(self, topology: pb.Topology, sent_as: str) -> None:
        self.metrics.topology_received(sent_as)
        if topology.epoch < self.topology.epoch:
            return  # stale: the agent keeps the newer topology it has (the core says so too)
        trainer = self.trainer
        decision = core.on_topology(
            self.state,
            current_epoch=self.topology.epoch,
            epoch=topology.epoch,
            halted=topology.halted,
            halt_reason=topology.reason,
            trainer_running=trainer is not None and trainer.running(),
        )
        changed = topology.epoch != self.topology.epoch
        if changed and self._rank(topology) >= 0:
            # The hang clock starts afresh with every epoch the host holds a rank in: joining one
            # (runtime, restore, compile) is no step progress, and must not count as a hang.
            self.last_progress = time.monotonic()
            self.stepped = False
        self.topology = topology
        self.log = self.log.bind(epoch=topology.epoch)
        if changed and topology.epoch >= 2:  # every later epoch is a recovery's (or a drain's, a grow's)
            self.log = self.log.bind(recovery=recovery_id(self.settings.job_id, topology.epoch))
        if changed:
            await self._assignments_changed()
        rank = self._rank(topology)
        self.metrics.epoch.set(topology.epoch)
        self.metrics.rank.set(rank)
        self.log.info(
            "topology",
            rank=rank,
            world_size=len(topology.members),
            reason=topology.reason,
            sent_as=sent_as,
        )
        if decision.do is Do.STOP_ALL_AND_EXIT:
            await self._stop_trainer("job halted", warm_too=True)
            # Every agent of a halted job exits: its end is the job's, not a failure of its host.
            await self._leave("the job halted")
            raise AgentExit(decision.reason, code=decision.exit_code)
        if decision.do is Do.START_TRAINER:
            await self._start_trainer(topology, rank)

    def trainer_env(self, topology: pb.Topology, rank: int, slot: int) -> Mapping[str, str]:
        assignment = TrainerAssignment(
            agent_address=self.local_address,
            slot=slot,
            host_id=self.settings.host_id,
            job_id=self.settings.job_id,
            epoch=topology.epoch,
            rank=rank,
            world_size=len(topology.members),
            jax_coordinator=topology.jax_coordinator_address,
            restore_step=topology.restore_step,
            device_count=self.settings.device_count,
            commits=commits_of(topology.commits),
        ).to_env()
        return {
            **assignment,
            Env.LOG_FORMAT: "json" if self.settings.log_json else "console",
            Env.AGENT_SESSION: self.session_id,
            # Where the process says why, should it leave for a fresh one (read when it exits).
            Env.EXIT_NOTE: os.path.join(self._notes_dir, f"trainer-{slot}.exit"),
        }

    async def _spawn(self, topology: pb.Topology, rank: int, role: Role) -> TrainerProcess:
        self._slots += 1
        trainer = TrainerProcess(
            self.settings.trainer_command,
            self.trainer_env(topology, rank, self._slots),
            topology.epoch,
            nice=self.settings.trainer_nice,
            role=role,
            waiting_nice=self.settings.standby_nice or self.settings.trainer_nice,
            ranked=rank >= 0,
        )
        trainer.slot = self._slots
        await trainer.start()
        self.metrics.trainer_started(role.value)
        return trainer

    async def _start_trainer(self, topology: pb.Topology, rank: int) -> None:
        # Two paths may want a trainer for the same epoch (a new topology arrives while a fault
        # report is in flight): one trainer per host, whoever comes first.
        async with self._starting:
            if self.trainer is not None and self.trainer.running():
                return
            await self._start_trainer_locked(topology, rank)

    async def _start_trainer_locked(self, topology: pb.Topology, rank: int) -> None:
        self.state = self.state.trainer_started()
        self.last_progress = time.monotonic()
        self.stepped = False
        warm = self.warm
        if warm is not None and warm.running():
            # Promote the standby: it waits on WatchAssignments and takes the rank at once.
            self.warm = None
            warm.promote(topology.epoch)
            self.trainer = warm
            self.log.info("warm standby trainer promoted", pid=warm.pid, slot=warm.slot, epoch=topology.epoch)
            await self._assignments_changed()
        else:
            try:
                self.trainer = await self._spawn(topology, rank, Role.ACTIVE)
            except OSError as exc:
                self.log.error(
                    "cannot start the trainer",
                    error=str(exc),
                    command=" ".join(self.settings.trainer_command),
                )
                await self._report_fault(
                    Decision(
                        Do.REPORT_FAULT, f"cannot start: {exc}", Fault.TRAINER_EXITED, epoch=topology.epoch
                    ),
                    exit_code=127,
                )
                return
            await self._assignments_changed()
        self._trainer_watch = asyncio.create_task(self._watch_trainer(self.trainer))
        # The next warm standby starts once this trainer has acknowledged its epoch (see ack_epoch):
        # importing JAX takes seconds of CPU that a recovering trainer needs more.

    async def _ensure_warm(self) -> None:
        if not self.settings.warm_standby or (self.warm is not None and self.warm.running()):
            return
        trainer = self.trainer
        if trainer is None or not trainer.running() or self._stopping.is_set():
            return
        self.warm = await self._spawn(self.topology, -1, Role.STANDBY)
        self.log.info("warm standby trainer started", pid=self.warm.pid, slot=self.warm.slot)

    async def _job_finished(self, reason: str) -> None:
        """The job completed its last step: the standby goes now, the ranked trainer gets time to
        leave the JAX runtime and write its outputs (``finish_grace_s``), then the agent exits 0."""
        self.log.info("job finished; stopping supervision", reason=reason)
        self.state = self.state.finished()
        if self.warm is not None and self.warm.running():
            await self.warm.stop(self.settings.stop_grace_s)
        trainer = self.trainer
        if trainer is None or not trainer.running():
            return
        if self._rank(self.topology) < 0:
            await self._stop_trainer("the job finished; a standby trainer has nothing to do")
            return
        try:
            await asyncio.wait_for(asyncio.shield(trainer.wait()), self.settings.finish_grace_s)
        except TimeoutError:
            await self._stop_trainer(
                f"the job finished but the trainer was still running {self.settings.finish_grace_s:g}s later"
            )

    def _release_snapshots(self) -> None:
        """The job finished and its trainers are gone: delete the host-memory snapshots they kept in
        /dev/shm (RAM until deleted), where this agent's trainers wrote them (the owner file names
        this agent's session). A trainer that held a rank deleted its own on the way out; a spare's
        standby, stopped, never does."""
        directory = Path(DEFAULT_SHM_DIR) / snapshot_dir_name(self.settings.job_id, self.settings.host_id)
        try:
            owner = (directory / SNAPSHOT_OWNER_FILE).read_text()
        except OSError:
            return
        if owner != self.session_id:
            return
        shutil.rmtree(directory, ignore_errors=True)
        self.log.info("host-memory snapshots deleted: the job finished", directory=str(directory))

    async def _stop_trainer(self, reason: str, *, warm_too: bool = False) -> None:
        for trainer in (self.trainer, self.warm if warm_too else None):
            if trainer is not None and trainer.running():
                self.log.info(
                    "stopping trainer",
                    reason=reason,
                    pid=trainer.pid,
                    slot=trainer.slot,
                    role=trainer.role.value,
                )
                await trainer.stop(self.settings.stop_grace_s)

    async def _watch_trainer(self, trainer: TrainerProcess) -> None:
        result = await trainer.wait()
        self.metrics.trainer_exited(result.cause, active=self.trainer is trainer)
        if self.trainer is not trainer:
            return
        said = {} if result.note is None else {"why": result.note.why, "reason": result.note.reason}
        self.log.info(
            "trainer exited",
            code=result.returncode,
            epoch=result.epoch,
            stopped=result.stopped,
            hung=result.hung,
            **said,
            # Not stopped by the agent: a failure, which the recovery producing the next epoch handles.
            **(
                {}
                if result.stopped
                else {"recovery": recovery_id(self.settings.job_id, self.topology.epoch + 1)}
            ),
        )
        decision = core.on_trainer_exit(
            self.state,
            result,
            current_epoch=self.topology.epoch,
            restore_step=self.topology.restore_step,
            abort_delay_s=self.settings.abort_report_delay_s,
        )
        if decision.do is Do.MARK_FINISHED:
            self.state = self.state.finished()
            self.log.info(decision.reason)
        elif decision.do is Do.START_TRAINER:
            self.log.info("trainer restarted", reason=decision.reason)
            await self._start_trainer(self.topology, self._rank(self.topology))
            if result.note is not None:
                # Why it could not recover in place, into the job's event log (never a fault of the
                # host): told while the fresh process starts, not before it.
                task = asyncio.create_task(
                    self._record_restart(result.epoch, result.returncode, decision.reason)
                )
                self._telling.add(task)
                task.add_done_callback(self._telling.discard)
        elif decision.do is Do.REPORT_FAULT:
            if decision.delay_s:
                await asyncio.sleep(decision.delay_s)
            await self._report_fault(decision, exit_code=result.returncode)
        elif not result.stopped:
            self.log.info("trainer exit needs nothing", reason=decision.reason, code=result.returncode)

    def _fault_request(self, fault: Fault, epoch: int, exit_code: int, detail: str) -> pb.ReportFaultRequest:
        return pb.ReportFaultRequest(
            host_id=self.settings.host_id,
            incarnation=self.incarnation,
            kind=_FAULT_KINDS[fault],
            epoch=epoch,
            exit_code=exit_code,
            detail=detail,
        )

    async def _record_restart(self, epoch: int, exit_code: int, reason: str) -> None:
        """Tell the coordinator why the trainer asked for a fresh process: an event for operators
        (FAULT_KIND_TRAINER_RESTARTED), never charged to the host; its answer changes nothing here."""
        try:
            reply = await self._connect().ReportFault(
                self._fault_request(Fault.TRAINER_RESTARTED, epoch, exit_code, reason), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            self.log.warning(
                "could not record the trainer's restart", code=exc.code().name, detail=exc.details()
            )
            return
        self.log.info("trainer restart recorded", reason=reply.reason)

    async def _report_fault(self, fault: Decision, exit_code: int) -> None:
        assert fault.fault is not None
        request = self._fault_request(fault.fault, fault.epoch, exit_code, fault.reason)
        try:
            # Through a failover too: a report lost there would leave the trainer dead with nobody told.
            reply = await self._relay(
                "ReportFault",
                lambda stub, _: stub.ReportFault(request, timeout=5),
                deadline=time.monotonic() + _FAULT_REPORT_S,
            )
        except grpc.aio.AioRpcError as exc:
            self.log.warning("could not report the trainer fault", code=exc.code().name, detail=exc.details())
            return
        self.log.info(
            "fault reported",
            member_dead=reply.member_dead,
            reason=reply.reason,
            recovery=recovery_id(self.settings.job_id, fault.epoch + 1),
        )
        decision = core.on_fault_reply(
            member_dead=reply.member_dead, fault_epoch=fault.epoch, current_epoch=self.topology.epoch
        )
        if decision.do is Do.START_TRAINER:
            await self._start_trainer(self.topology, self._rank(self.topology))
        elif decision.do is Do.WAIT_FOR_NEWER_EPOCH:
            self.state = self.state.trainer_died_with(decision.epoch)

    # ---- local API helpers -----------------------------------------------------------------------

    def _trainer_runs(self, epoch: int) -> None:
        # A trainer starts in one epoch and may move on in-process: faults are charged to the epoch
        # it last said it runs.
        if self.trainer is not None and epoch > self.trainer.epoch:
            self.trainer.epoch = epoch

    def report_progress(
        self,
        step: int,
        epoch: int,
        totals: apb.TrainerTotals | None = None,
        tiers_missing: Mapping[str, str] | None = None,
    ) -> int:
        self._trainer_runs(epoch)
        if totals is not None:
            self.metrics.trainer_totals(totals)
        self._tiers_missing(epoch, tiers_missing or {})
        if epoch < self._reported_epoch:
            # Sent before a report of a newer epoch (a report waits up to progress_every_s): stale.
            return int(self.topology.epoch)
        self._reported_epoch = epoch
        if step != self.last_step:
            self.last_progress = time.monotonic()
            if epoch >= self.topology.epoch:
                # The coordinator hears of a step with the next heartbeat; at once only of the
                # trainer's first (its epoch runs) and of the first after a stall report (the
                # coordinator counts the member blocked until it hears of a newer step). A heartbeat
                # per step would multiply the fleet's heartbeat rate by its step rate.
                if not self.stepped or self._stall_reported:
                    self._progress.set()
                self.stepped = True
                self._stall_reported = False
            # Else a step of the epoch before this one, reported after the new topology came: the
            # trainer has yet to join the new epoch, and its start-up clock keeps running.
        self.last_step = step
        return int(self.topology.epoch)

    def _tiers_missing(self, epoch: int, missing: Mapping[str, str]) -> None:
        """The trainer says these tiers cannot keep its snapshots (each with its last error):
        published as metrics, and each tier told to the coordinator once per incarnation, in the
        background (the trainer's report does not wait for it)."""
        self.metrics.tiers_missing(missing)
        for tier, error in missing.items():
            if self._tiers_told.get(tier) == self.incarnation:
                continue
            self._tiers_told[tier] = self.incarnation
            self.log.warning(
                "the trainer's snapshots are not kept in a tier: kept in its process only (see its log)",
                tier=tier,
                error=error,
                epoch=epoch,
            )
            task = asyncio.create_task(self._tell_tier_missing(self.incarnation, epoch, tier, error))
            self._telling.add(task)
            task.add_done_callback(self._telling.discard)

    async def _tell_tier_missing(self, told_for: int, epoch: int, tier: str, error: str) -> None:
        """Tell the coordinator, which records it in the job's event log (``told_for``: the
        incarnation it is told for). A call that found no coordinator is made again with the
        trainer's next report that names the tier."""
        try:
            missing = pb.TierMissingObservation(tier=tier, detail=error)
            reply = await self._observed(pb.ObserveRequest(epoch=epoch, tier_missing=missing))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _RELAY_AGAIN and self._tiers_told.get(tier) == told_for:
                del self._tiers_told[tier]
            self.log.warning(
                "could not tell the coordinator a tier is missing",
                tier=tier,
                code=exc.code().name,
                detail=exc.details(),
            )
            return
        self.log.info("tier missing told to the coordinator", tier=tier, reason=reply.reason)

    async def _relay(
        self,
        method: str,
        call: Callable[[pb_grpc.CoordinatorStub, int], Awaitable[T]],
        deadline: float | None = None,
    ) -> T:
        """A call the trainer waits on, sent to whichever coordinator leads now.

        Retried through a leader change, a reconnect or a call shed under load (``_RELAY_AGAIN``) until
        ``deadline`` (monotonic; by default ``_RELAYED_CALL_S`` from now): the session loop finds the
        new leader meanwhile. Anything else, and the last failure, goes back to the trainer as it came.
        """
        deadline = time.monotonic() + _RELAYED_CALL_S if deadline is None else deadline
        pause = 0.05
        while True:
            sent = time.monotonic()
            try:
                answer = await call(self._connect(), self.incarnation)
                self.metrics.call(method, time.monotonic() - sent)
                return answer
            except grpc.aio.AioRpcError as exc:
                transient = exc.code() in _RELAY_AGAIN
                if not transient or time.monotonic() + pause >= deadline:
                    raise
                self.log.info("coordinator call retried", code=exc.code().name, detail=exc.details())
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)

    async def ack_epoch(self, request: apb.LocalAckRequest) -> bool:
        # The furthest of what the trainer says and what it last reported here (a trainer process
        # started for this epoch knows nothing of the one before; its predecessor's reports do).
        reached = max(request.reached_step, self.last_step)
        ack = pb.AckEpochRequest(
            epoch=request.epoch,
            restored_step=request.restored_step,
            restore_source=request.restore_source,
            phases=dict(request.phases),
            restored_bytes=dict(request.restored_bytes),
            reached_step=reached,
        )
        live = await self._acknowledge(ack)
        self.metrics.restored(request.restore_source, request.phases.get("restore"), request.restored_bytes)
        self.last_progress = time.monotonic()
        self._trainer_runs(request.epoch)
        # The trainer runs this epoch now: a report of an older one that comes after is stale.
        self._reported_epoch = max(self._reported_epoch, request.epoch)
        if request.restored_step >= 0:
            self.last_step = request.restored_step  # the trainer resumes from there
            self._progress.set()
        # In the background: the trainer waits for this reply before its second step.
        self._warm_task = asyncio.create_task(self._ensure_warm())
        return live

    async def _acknowledge(self, ack: pb.AckEpochRequest) -> bool:
        """``ack`` on the heartbeat stream where its coordinator answers it there, else (or once that
        stream ends before the answer) as an ``AckEpoch`` call, retried like any relayed call.

        The stream's identity is the acknowledgement's: ``ack`` names no host or incarnation."""
        deadline = time.monotonic() + _RELAYED_CALL_S
        acks = self._stream_acks
        if acks is not None:
            sent = time.monotonic()
            try:
                answer = acks.send(ack)
                self._progress.set()  # the heartbeat generator sends it at once
                # Most of the budget: an answer is slow only when the coordinator is (thousands of
                # members acknowledging at once); a call each then would only add to its load.
                reply = await asyncio.wait_for(answer, 0.75 * _RELAYED_CALL_S)
            except (StreamClosed, TimeoutError) as exc:
                self.log.info(
                    "acknowledgement sent again as a call", epoch=ack.epoch, why=str(exc) or "no answer"
                )
            else:
                code = _STATUS_BY_VALUE.get(reply.code, grpc.StatusCode.UNKNOWN)
                if code is grpc.StatusCode.OK:
                    self.metrics.call("AckEpoch", time.monotonic() - sent)
                    return bool(reply.live)
                if code not in _RELAY_AGAIN:
                    raise grpc.aio.AioRpcError(
                        code, grpc.aio.Metadata(), grpc.aio.Metadata(), reply.details, ""
                    )
                self.log.info("acknowledgement sent again as a call", epoch=ack.epoch, why=reply.details)

        def call(stub: pb_grpc.CoordinatorStub, incarnation: int) -> Awaitable[pb.AckEpochResponse]:
            request = pb.AckEpochRequest(host_id=self.settings.host_id, incarnation=incarnation)
            request.MergeFrom(ack)
            return stub.AckEpoch(request, timeout=2)

        return bool((await self._relay("AckEpoch", call, deadline)).live)

    async def commit_checkpoint(self, request: apb.LocalCommitRequest) -> None:
        """Ask the coordinator to accept the trainer's checkpoint commit; raises its refusal."""

        def commit(stub: pb_grpc.CoordinatorStub, incarnation: int) -> Awaitable[pb.CommitCheckpointResponse]:
            return stub.CommitCheckpoint(
                pb.CommitCheckpointRequest(
                    host_id=self.settings.host_id,
                    incarnation=incarnation,
                    epoch=request.epoch,
                    step=request.step,
                    tier=request.tier,
                ),
                timeout=2,
            )

        await self._relay("CommitCheckpoint", commit)

    async def report_stall(self, request: apb.LocalStallRequest) -> None:
        """The trainer has been blocked in a step for a while: the coordinator weighs it against its
        peers' reports (a member none of them hears from is frozen)."""
        self._stall_reported = True
        self.log.warning(
            "trainer blocked in a step",
            epoch=request.epoch,
            step=request.step,
            blocked_s=round(request.blocked_s, 2),
        )
        stall = pb.StallObservation(step=request.step)
        await self._observed(pb.ObserveRequest(epoch=request.epoch, stall=stall))

    async def report_collective_failure(self, request: apb.LocalCollectiveFailureRequest) -> None:
        """A collective of the epoch failed in the trainer, which left the epoch and waits for the
        next: the coordinator replaces a lost member, or forms the same members again."""
        self.log.warning(
            "trainer's collective failed", epoch=request.epoch, step=request.step, detail=request.detail
        )
        failure = pb.CollectiveFailureObservation(detail=request.detail)
        await self._observed(pb.ObserveRequest(epoch=request.epoch, collective_failure=failure))

    async def _observed(self, observed: pb.ObserveRequest) -> pb.ObserveResponse:
        """Relay what the trainer observed (``observed``: its epoch and the observation; this host's
        identity is filled in) to the coordinator, which weighs it: no fault of this host."""

        def observe(stub: pb_grpc.CoordinatorStub, incarnation: int) -> Awaitable[pb.ObserveResponse]:
            request = pb.ObserveRequest(host_id=self.settings.host_id, incarnation=incarnation)
            request.MergeFrom(observed)
            return stub.Observe(request, timeout=2)

        return await self._relay("Observe", observe)

    async def finish(self, request: apb.LocalFinishRequest) -> None:
        """The trainer completed the job's last step: tell the coordinator, and from now on take no
        exit of the trainer for a fault. Raises the coordinator's refusal (a newer epoch began)."""

        def finish(stub: pb_grpc.CoordinatorStub, incarnation: int) -> Awaitable[pb.FinishResponse]:
            return stub.Finish(
                pb.FinishRequest(
                    host_id=self.settings.host_id,
                    incarnation=incarnation,
                    epoch=request.epoch,
                    step=request.step,
                ),
                timeout=2,
            )

        try:
            await self._relay("Finish", finish)
        except grpc.aio.AioRpcError as exc:
            if not metadata(exc, FINISHED_METADATA):
                raise
        self.state = self.state.finished()
        self.log.info("trainer finished the job", step=request.step, epoch=request.epoch)

    async def _assignments_changed(self) -> None:
        # A process given a rank gets the trainer's priority before it hears of it (it joins the
        # epoch at once); one that lost its rank waits at the standby's.
        for process in (self.trainer, self.warm):
            if process is not None:
                await process.hold_rank(self._rank_for(process.slot) >= 0)
        self._version += 1
        async with self.topology_changed:
            self.topology_changed.notify_all()

    async def assignment_changes(self, slot: int, after_epoch: int) -> AsyncIterator[apb.Assignment]:
        """The caller's assignment now (if its epoch is newer than ``after_epoch``) and whenever it
        changes: a new epoch, or the caller's promotion from standby."""
        last = None if self.topology.epoch > after_epoch else self._key(slot)
        while True:
            key = self._key(slot)
            if key != last:
                last = key
                yield self.assignment(slot)
            version = self._version

            def moved(seen: int = version) -> bool:
                return self._version != seen

            async with self.topology_changed:
                await self.topology_changed.wait_for(moved)

    def _key(self, slot: int) -> tuple[int, int]:
        return int(self.topology.epoch), self._rank_for(slot)

    def _rank_for(self, slot: int) -> int:
        active = self.trainer.slot if self.trainer is not None else 0
        if slot and slot != active:
            return -1  # a warm standby process: no rank until it is promoted
        return self._rank(self.topology)

    def assignment(self, slot: int = 0) -> apb.Assignment:
        return apb.Assignment(
            topology=self.topology,
            host_id=self.settings.host_id,
            rank=self._rank_for(slot),
            world_size=len(self.topology.members),
        )

"""The Coordinator service (grpc.aio): requests in, ``Coordinator`` calls, replies out.

Each handler translates a request into a call on the engine (``remesh.coordinator.service``) and its
result into a reply; refusals become statuses in ``remesh.coordinator.rpc``. The heartbeat stream is
the busiest: it writes new topologies (encoded once for every stream, ``fanout``), the commands and
acknowledgement answers the engine queues on the agent's ``AgentStream``, and keepalives.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass

import grpc
import structlog

from remesh.coordinator import convert
from remesh.coordinator.agent_stream import AgentStream, Command
from remesh.coordinator.auth import Authorizer, identity_of
from remesh.coordinator.errors import (
    CoordinatorError,
    InvalidRequest,
    NotFound,
    NotLeader,
    Rejected,
    ResourceExhausted,
)
from remesh.coordinator.fanout import EncodedTopology
from remesh.coordinator.feed import EventFeed, event_id_key
from remesh.coordinator.membership import FaultKind, validate_host_id
from remesh.coordinator.model import Event, EventType, Topology
from remesh.coordinator.rpc import Malformed, abort, admit, answer, status_of
from remesh.coordinator.service import Coordinator
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["CoordinatorServicer", "StreamLimit"]

log = structlog.get_logger("remesh.coordinator")

# Topologies kept encoded for heartbeat streams (and their deltas): a stream further behind than
# this gets its next topology whole.
_EPOCHS_ENCODED = 4
_EVENT_ID = re.compile(r"^\d+(-\d+)?$")
_FAULT = {
    pb.FAULT_KIND_TRAINER_EXITED: FaultKind.TRAINER_EXITED,
    pb.FAULT_KIND_TRAINER_HUNG: FaultKind.TRAINER_HUNG,
    pb.FAULT_KIND_HOST: FaultKind.HOST,
    pb.FAULT_KIND_ADDRESS_IN_USE: FaultKind.ADDRESS_IN_USE,
    pb.FAULT_KIND_STATE_LOST: FaultKind.STATE_LOST,
    pb.FAULT_KIND_TRAINER_RESTARTED: FaultKind.TRAINER_RESTARTED,
}


@dataclass
class _Probe:
    """The newest heartbeat's probe on one stream, and when it arrived (this process's clock)."""

    value: float
    received: float

    def echo(self) -> pb.HeartbeatResponse:
        if not self.value:
            return pb.HeartbeatResponse()
        reply = pb.HeartbeatResponse(echo=self.value, echo_held_s=time.monotonic() - self.received)
        self.value = 0.0  # each probe once
        return reply


def _reregister(reason: str) -> pb.HeartbeatResponse:
    """The answer to a heartbeat of an incarnation the coordinator no longer counts."""
    return pb.HeartbeatResponse(command=convert.command_to_pb(Command.REREGISTER), reason=reason)


def _idle(request: pb.HeartbeatRequest) -> bool:
    """The agent saw its trainer use no CPU for a while (or killed it as hung)."""
    return request.trainer_status == pb.TRAINER_STATUS_HUNG


def _matches(event: Event, hosts: set[str], types: set[EventType], since: float) -> bool:
    # A topology event concerns every host it names.
    if hosts and event.host_id not in hosts and not (event.topology and hosts & set(event.topology.host_ids)):
        return False
    return (not types or event.type in types) and event.time >= since


def _caller(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, for per-caller limits: the certificate's identity, else the peer's address."""
    identity = identity_of(context.auth_context())
    if identity is not None:
        return str(identity)
    peer = context.peer()  # "ipv4:127.0.0.1:54321", "ipv6:[::1]:54321", "unix:/path"
    return peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer


class StreamLimit:
    """At most ``limit`` long-lived streams (event follows, topology watches) open per caller: a
    client that opens them in a loop is refused, not served until memory runs out."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: Counter[str] = Counter()

    @contextlib.contextmanager
    def _held(self, caller: str) -> Iterator[None]:
        try:
            yield
        finally:
            self._open[caller] -= 1
            if self._open[caller] <= 0:
                del self._open[caller]

    def take(self, caller: str) -> contextlib.AbstractContextManager[None]:
        if self._open[caller] >= self.limit:
            raise ResourceExhausted(
                f"{caller} has {self._open[caller]} streams open (the limit is {self.limit}): close some first"
            )
        self._open[caller] += 1
        return self._held(caller)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator, auth: Authorizer, *, streams_per_caller: int = 16) -> None:
        self._c = coordinator
        self.auth = auth
        # One Redis reader for every follower of the event log.
        self.feed = EventFeed(coordinator.store)
        self._stream_limit = StreamLimit(streams_per_caller)
        # The newest topologies sent on heartbeat streams, by epoch, encoded.
        self._encoded: dict[int, EncodedTopology] = {}

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        job = self._c.settings.job_id
        if request.job_id and request.job_id != job:
            await abort(
                context,
                Rejected(
                    f"this coordinator runs job {job!r}, not {request.job_id[:128]!r}: start the agent with "
                    f"--job {job} (or REMESH_JOB={job}), or point its --coordinator at the coordinator of "
                    f"job {request.job_id[:128]!r}"
                ),
            )
        member = await answer(
            context,
            self._c.register(
                request.host_id, convert.role_from_pb(request.role), request.device_count, request.address
            ),
        )
        detector = self._c.settings.detector
        return pb.RegisterResponse(
            member=convert.member_to_pb(member, self._c.member_step(member.host_id)),
            topology=self._encode(self._c.state.topology).message,
            heartbeat_interval_s=detector.heartbeat_interval_s,
            heartbeat_timeout_s=detector.heartbeat_timeout_s,
            keepalive_s=self._c.settings.stream_keepalive_s,
            acks_on_stream=True,
            job_id=job,
        )

    async def Heartbeat(
        self, request_iterator: AsyncIterator[pb.HeartbeatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HeartbeatResponse | bytes]:
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            return
        await admit(self.auth, "Heartbeat", first, context)
        try:
            await self._c.heartbeat(first.host_id, first.incarnation, first.step, _idle(first))
        except (Rejected, NotFound) as exc:
            yield _reregister(str(exc))
            return
        except CoordinatorError as exc:
            await abort(context, exc)
        stream = self._c.attach_stream(first.host_id, first.incarnation)
        probe = _Probe(first.probe, time.monotonic())
        reader = asyncio.create_task(self._read(request_iterator, first, probe, stream))
        reader.add_done_callback(lambda _: stream.ring())
        keepalive = self._c.settings.stream_keepalive_s
        stream.from_relay = first.topology_from_relay
        # The topology sent last on this stream (None: none yet, or its agent follows a relay): a
        # later one goes as a delta from it when the agent applies deltas, whole otherwise.
        sent: EncodedTopology | None = None
        try:
            while True:
                # What is due, in this order: a newer topology (only the newest: it supersedes the
                # ones before; none while a relay carries them), the agent's commands, the end of
                # the agent's side.
                topology = self._c.state.topology
                if stream.from_relay:
                    sent = None  # should the relay be lost, the current topology goes whole
                elif sent is None or (topology is not None and topology.epoch > sent.message.epoch):
                    encoded = self._encode(topology)
                    if sent is None:
                        yield encoded.whole
                    else:
                        yield encoded.reply(sent.message if first.topology_deltas else None)
                        # Written: how long this stream's agent waited on the coordinator for it.
                        # Only for an agent still sending (a host that just failed is rung with the
                        # epoch that replaces it before its handler sees its side end).
                        if topology is not None and not reader.done():
                            self._c.metrics.delivery.observe(max(0.0, time.time() - topology.created_at))
                    sent = encoded
                    continue
                if stream.replies:
                    yield stream.replies.popleft()
                    continue
                if stream.commands:
                    command, reason = stream.commands.popleft()
                    if command is Command.NOT_LEADER:
                        await abort(context, self._c.not_leader(reason))
                    yield pb.HeartbeatResponse(command=convert.command_to_pb(command), reason=reason)
                    if command.ends_stream:
                        return
                    continue
                if reader.done():
                    error = None if reader.cancelled() else reader.exception()
                    if isinstance(error, NotLeader):
                        await abort(context, error)
                    if isinstance(error, Rejected | NotFound | InvalidRequest):
                        yield _reregister(str(error))
                    elif error is not None:
                        log.warning("heartbeat stream failed", host=first.host_id, error=repr(error))
                    return
                if not await stream.wait(keepalive):
                    # Nothing to say: an empty message tells the agent this coordinator still answers,
                    # and echoes its newest heartbeat's probe (its round trip).
                    yield probe.echo()
        finally:
            reader.cancel()
            self._c.detach_stream(stream)

    def _encode(self, topology: Topology | None) -> EncodedTopology:
        """The heartbeat reply carrying ``topology``, encoded once per epoch for every stream: a new
        epoch of N members goes to N agents, and encoding it for each would be N x N work. Every
        other answer that carries the topology (a registration, ``GetTopology``, ``WatchTopology``)
        takes its ``message`` too: building a topology of 9000 members in Python takes 15 ms of the
        event loop on an idle machine and 78 ms during a 10,000-host run (measured), copying and
        serialising the one built per epoch 2 and 6 ms."""
        key = topology.epoch if topology is not None else -1
        encoded = self._encoded.get(key)
        if encoded is None or encoded.topology is not topology:
            encoded = self._encoded[key] = EncodedTopology.of(convert.topology_to_pb(topology), topology)
            while len(self._encoded) > _EPOCHS_ENCODED:
                del self._encoded[min(self._encoded)]
        return encoded

    async def _read(
        self,
        requests: AsyncIterator[pb.HeartbeatRequest],
        first: pb.HeartbeatRequest,
        probe: _Probe,
        stream: AgentStream,
    ) -> None:
        acks: set[asyncio.Task[None]] = set()
        async for request in requests:
            if isinstance(request, Malformed):
                raise InvalidRequest(request.message)
            if (request.host_id, request.incarnation) != (first.host_id, first.incarnation):
                raise InvalidRequest(
                    f"a heartbeat stream belongs to {first.host_id} incarnation {first.incarnation}; "
                    f"got {request.host_id} incarnation {request.incarnation}"
                )
            probe.value, probe.received = request.probe, time.monotonic()
            if request.topology_from_relay != stream.from_relay:
                stream.from_relay = request.topology_from_relay
                stream.ring()  # a stream back from its relay gets the current topology now
            await self._c.heartbeat(request.host_id, request.incarnation, request.step, _idle(request))
            if request.HasField("ack"):
                # Committed with the other members' in the next batch; the stream reads on meanwhile.
                task = asyncio.create_task(self._ack_on_stream(request.ack, stream))
                acks.add(task)
                task.add_done_callback(acks.discard)

    async def _ack_on_stream(self, ack: pb.AckEpochRequest, stream: AgentStream) -> None:
        """``AckEpoch`` for an acknowledgement a heartbeat stream carried; its answer, or refusal,
        goes back on the stream (``ack_reply``)."""
        reply = pb.AckReply(epoch=ack.epoch)
        try:
            # The stream is the acknowledgement's identity: it may leave both out, not name another.
            if ack.host_id not in ("", stream.host_id) or ack.incarnation not in (0, stream.incarnation):
                raise InvalidRequest(
                    f"an acknowledgement on {stream.host_id} incarnation {stream.incarnation}'s heartbeat "
                    f"stream names {ack.host_id} incarnation {ack.incarnation}"
                )
            reply.live = await self._acknowledge(stream.host_id, stream.incarnation, ack)
        except CoordinatorError as exc:
            reply.code, reply.details = status_of(exc).value[0], str(exc)
        except Exception as exc:
            # A fault of the coordinator's own: answered as the call would be (UNKNOWN), at once, so
            # that the agent does not wait out its budget for an answer before it tries the call.
            log.exception(
                "acknowledgement on a heartbeat stream failed", host=stream.host_id, epoch=ack.epoch
            )
            reply.code = grpc.StatusCode.UNKNOWN.value[0]
            reply.details = f"the coordinator failed on this acknowledgement: {exc!r}"
        stream.reply(pb.HeartbeatResponse(ack_reply=reply))

    def _acknowledge(self, host_id: str, incarnation: int, ack: pb.AckEpochRequest) -> Awaitable[bool]:
        """``ack`` from ``host_id``'s incarnation, by either path (a call, or its heartbeat stream)."""
        return self._c.ack_epoch(
            host_id,
            incarnation,
            ack.epoch,
            ack.restored_step,
            ack.restore_source,
            dict(ack.phases),
            dict(ack.restored_bytes),
            ack.reached_step,
        )

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        member = await answer(context, self._c.leave(request.host_id, request.incarnation, request.reason))
        return pb.LeaveResponse(member=convert.member_to_pb(member, self._c.member_step(member.host_id)))

    async def GetTopology(
        self, request: pb.GetTopologyRequest, context: grpc.aio.ServicerContext
    ) -> pb.Topology:
        state = await answer(context, self._c.observe())
        return self._encode(state.topology).message

    async def WatchTopology(
        self, request: pb.WatchTopologyRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Topology]:
        if request.after_epoch < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"after_epoch {request.after_epoch} is negative"
            )
        with await self._stream_slot(context):
            async for topology in self._c.watch_topology(request.after_epoch):
                yield self._encode(topology).message

    async def _stream_slot(
        self, context: grpc.aio.ServicerContext
    ) -> contextlib.AbstractContextManager[None]:
        """One of the caller's long-lived streams (a follow, a watch); over its limit, RESOURCE_EXHAUSTED."""
        try:
            return self._stream_limit.take(_caller(context))
        except CoordinatorError as exc:
            await abort(context, exc)
            raise AssertionError("unreachable") from exc

    async def ListMembers(
        self, request: pb.ListMembersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListMembersResponse:
        try:
            states = {convert.member_state_from_pb(s) for s in request.states}
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        state = await answer(context, self._c.observe())
        members = sorted(state.members.values(), key=lambda m: (m.rank < 0, m.rank, m.host_id))
        return pb.ListMembersResponse(
            members=[
                convert.member_to_pb(m, self._c.member_step(m.host_id))
                for m in members
                if not states or m.state in states
            ],
            epoch=state.epoch,
        )

    async def GetMember(self, request: pb.GetMemberRequest, context: grpc.aio.ServicerContext) -> pb.Member:
        async def get() -> pb.Member:
            validate_host_id(request.host_id, self._c.settings.max_id_length)
            member = (await self._c.observe()).members.get(request.host_id)
            if member is None:
                raise NotFound(f"unknown host {request.host_id!r}")
            return convert.member_to_pb(member, self._c.member_step(member.host_id))

        return await answer(context, get())

    async def ReplayEvents(
        self, request: pb.ReplayEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Event]:
        try:
            if request.after_id and not _EVENT_ID.match(request.after_id):
                raise ValueError(f"after_id {request.after_id!r} is not an event id like 1733150000000-0")
            if not math.isfinite(request.since) or request.since < 0:
                raise ValueError(f"since {request.since} is not a time: seconds since the Unix epoch")
            types = {convert.event_type_from_pb(t) for t in request.types}
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        hosts = set(request.host_ids)
        last = request.after_id
        slot = await self._stream_slot(context) if request.follow else contextlib.nullcontext()
        with slot:
            try:
                # Subscribed first, read second: nothing committed in between is missed; what both
                # bring is sent once (ids only grow).
                async with self.feed.subscribe() if request.follow else contextlib.nullcontext() as feed:
                    async for page in self._c.store.page_events(request.after_id, request.since):
                        for event in page:
                            if _matches(event, hosts, types, request.since):
                                yield convert.event_to_pb(event)
                        last = page[-1].id
                    if feed is None:
                        return
                    while True:
                        for event in await feed.next():
                            if last and event_id_key(event.id) <= event_id_key(last):
                                continue
                            last = event.id
                            if _matches(event, hosts, types, request.since):
                                yield convert.event_to_pb(event)
            except CoordinatorError as exc:
                await abort(context, exc)

    async def AckEpoch(
        self, request: pb.AckEpochRequest, context: grpc.aio.ServicerContext
    ) -> pb.AckEpochResponse:
        live = await answer(context, self._acknowledge(request.host_id, request.incarnation, request))
        return pb.AckEpochResponse(live=live)

    async def ReportFault(
        self, request: pb.ReportFaultRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportFaultResponse:
        legacy = convert.legacy_report_from_pb(request)
        if legacy is not None:
            # An agent of remesh 0.1.0 sends what its trainer observed as a fault report: until
            # remesh 0.3.0 it is handled as Observe would handle it, and blames nobody.
            reason = await answer(
                context,
                self._c.report_observation(request.host_id, request.incarnation, request.epoch, legacy),
            )
            return pb.ReportFaultResponse(member_dead=False, reason=reason)
        kind = _FAULT.get(request.kind)
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fault kind {request.kind}")
            raise AssertionError("unreachable")
        outcome = await answer(
            context,
            self._c.report_fault(
                request.host_id, request.incarnation, kind, request.epoch, request.exit_code, request.detail
            ),
        )
        return pb.ReportFaultResponse(member_dead=outcome.member_dead, reason=outcome.reason)

    async def Observe(
        self, request: pb.ObserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ObserveResponse:
        try:
            report = convert.report_from_pb(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from exc
        reason = await answer(
            context, self._c.report_observation(request.host_id, request.incarnation, request.epoch, report)
        )
        return pb.ObserveResponse(reason=reason)

    async def CommitCheckpoint(
        self, request: pb.CommitCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitCheckpointResponse:
        await answer(
            context,
            self._c.commit_checkpoint(
                request.host_id, request.incarnation, request.epoch, request.step, request.tier
            ),
        )
        return pb.CommitCheckpointResponse()

    async def Finish(self, request: pb.FinishRequest, context: grpc.aio.ServicerContext) -> pb.FinishResponse:
        await answer(
            context, self._c.finish(request.host_id, request.incarnation, request.epoch, request.step)
        )
        return pb.FinishResponse()

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        member = await answer(context, self._c.drain(request.host_id, request.reason))
        return pb.DrainResponse(member=convert.member_to_pb(member, self._c.member_step(member.host_id)))

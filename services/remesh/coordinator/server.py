"""The coordinator's gRPC adapter (grpc.aio): requests in, ``Coordinator`` calls, statuses out.

Every ``CoordinatorError`` is turned into its gRPC status here and nowhere else. A follower replica
answers writes with UNAVAILABLE and the leader's address in the trailing metadata ``remesh-leader``
(empty while no leader is known). The standard health service and server reflection run beside the
Coordinator service, so probes and generic clients (grpcurl, grpc_health_probe) work without the
.proto files; followers report SERVING too (they serve reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from remesh.coordinator import convert
from remesh.coordinator.auth import Authorizer, identity_of
from remesh.coordinator.errors import (
    Conflict,
    CoordinatorError,
    InvalidRequest,
    JobFinished,
    NotFound,
    NotLeader,
    PermissionDenied,
    Rejected,
    ResourceExhausted,
    StoreUnavailable,
    Unauthenticated,
)
from remesh.coordinator.feed import EventFeed, event_id_key
from remesh.coordinator.membership import FaultKind, validate_host_id
from remesh.coordinator.model import Event, EventType, Topology
from remesh.coordinator.redis_connection import RedisConnection
from remesh.coordinator.service import AgentStream, Coordinator
from remesh.coordinator.settings import Settings
from remesh.coordinator.store import RedisStore
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1 import deltas
from remesh.v1.contract import FINISHED_METADATA, LEADER_METADATA
from remesh.v1.security import Tls

__all__ = [
    "FINISHED_METADATA",
    "LEADER_METADATA",
    "EncodedTopology",
    "RunningCoordinator",
    "bind",
    "grpc_server_options",
    "is_unix",
    "listen_host",
    "serve",
    "server_options",
]

log = structlog.get_logger("remesh.coordinator")

T = TypeVar("T")

_STATUS: list[tuple[type[CoordinatorError], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Rejected, grpc.StatusCode.FAILED_PRECONDITION),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (Conflict, grpc.StatusCode.ABORTED),
    (NotLeader, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
]
# Topologies kept encoded for heartbeat streams (and their deltas): a stream further behind than
# this gets its next topology whole.
_EPOCHS_ENCODED = 4
_COMMANDS = {
    "reregister": pb.COMMAND_REREGISTER,
    "drain": pb.COMMAND_DRAIN,
    "finished": pb.COMMAND_FINISHED,
}
_EVENT_ID = re.compile(r"^\d+(-\d+)?$")
_FAULT = {
    pb.FAULT_KIND_TRAINER_EXITED: FaultKind.TRAINER_EXITED,
    pb.FAULT_KIND_TRAINER_HUNG: FaultKind.TRAINER_HUNG,
    pb.FAULT_KIND_HOST: FaultKind.HOST,
    pb.FAULT_KIND_ADDRESS_IN_USE: FaultKind.ADDRESS_IN_USE,
    pb.FAULT_KIND_STALLED: FaultKind.STALLED,
    pb.FAULT_KIND_STATE_LOST: FaultKind.STATE_LOST,
    pb.FAULT_KIND_COLLECTIVE_FAILED: FaultKind.COLLECTIVE_FAILED,
}


def status_of(exc: CoordinatorError) -> grpc.StatusCode:
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, exc: CoordinatorError) -> None:
    if isinstance(exc, NotLeader):
        await context.abort(status_of(exc), str(exc), trailing_metadata=((LEADER_METADATA, exc.leader),))
    if isinstance(exc, JobFinished):
        await context.abort(status_of(exc), str(exc), trailing_metadata=((FINISHED_METADATA, str(exc.step)),))
    await context.abort(status_of(exc), str(exc))


async def _answer(context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
    try:
        return await call
    except CoordinatorError as exc:
        await _abort(context, exc)
        raise AssertionError("unreachable") from exc  # abort always raises


@dataclass
class EncodedTopology:
    """One epoch's reply on a topology stream, encoded once for every stream: whole, and as a delta
    from each topology a stream held before it (None where the whole one is sent instead). The
    coordinator's heartbeat streams and a relay's followers (``remesh.coordinator.relay``) share it."""

    topology: Topology | None  # the coordinator's own, where it encoded it
    message: pb.Topology
    whole: bytes
    deltas: dict[int, tuple[pb.Topology, bytes | None]]

    @classmethod
    def of(cls, message: pb.Topology, topology: Topology | None = None) -> EncodedTopology:
        return cls(topology, message, pb.HeartbeatResponse(topology=message).SerializeToString(), {})

    def reply(self, base: pb.Topology | None) -> bytes:
        """The reply for a stream that last sent ``base`` (None: it takes whole topologies)."""
        if base is None or not 0 < base.epoch < self.message.epoch:
            return self.whole
        cached = self.deltas.get(base.epoch)
        if cached is None or cached[0] is not base:
            d = deltas.delta(base, self.message)
            encoded = None if d is None else pb.HeartbeatResponse(topology_delta=d).SerializeToString()
            cached = self.deltas[base.epoch] = (base, encoded)
        return cached[1] or self.whole


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


class _Malformed:
    """What a request that does not parse becomes, so the handler can answer INVALID_ARGUMENT."""

    def __init__(self, type_name: str, error: str) -> None:
        self.message = f"malformed request: not a valid {type_name} ({error})"


def _lenient(cls: type[Message]) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return _Malformed(cls.DESCRIPTOR.full_name, str(exc))

    return parse


async def _admit(auth: Authorizer, method: str, request: object, context: grpc.aio.ServicerContext) -> None:
    """The caller may make this request (else the refusal's status); the request parsed (else
    INVALID_ARGUMENT: asked only of a caller the policy lets call ``method`` at all)."""
    host_id = None if isinstance(request, _Malformed) else getattr(request, "host_id", None)
    try:
        auth.check(context, method, host_id)
    except CoordinatorError as exc:
        await _abort(context, exc)
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _unary(
    impl: Callable[..., Awaitable[object]], method: str, auth: Authorizer
) -> Callable[..., Awaitable[object]]:
    async def handler(request: object, context: grpc.aio.ServicerContext) -> object:
        await _admit(auth, method, request, context)
        return await impl(request, context)

    return handler


def _server_stream(
    impl: Callable[..., AsyncIterator[object]], method: str, auth: Authorizer
) -> Callable[..., AsyncIterator[object]]:
    async def handler(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
        await _admit(auth, method, request, context)
        async for reply in impl(request, context):
            yield reply

    return handler


def add_servicer(servicer: Any, server: grpc.aio.Server, service_name: str = "Coordinator") -> None:
    """Like the generated ``add_CoordinatorServicer_to_server``, but every call passes the access policy
    first (``servicer.auth``, ``remesh.coordinator.auth``), and a request that does not parse gets
    INVALID_ARGUMENT with the reason (the generated code answers a bare UNKNOWN). The heartbeat stream
    is checked by the servicer, on its first message (the host it is for). ``service_name``: the
    service of ``remesh.v1`` that ``servicer`` implements (a relay's is TopologyRelay)."""
    service = pb.DESCRIPTOR.services_by_name[service_name]
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        impl = getattr(servicer, method.name)
        kw = {
            "request_deserializer": _lenient(getattr(pb, method.input_type.name)),
            "response_serializer": _serialize,
        }
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(impl, **kw)
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _server_stream(impl, method.name, servicer.auth), **kw
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(impl, method.name, servicer.auth), **kw
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


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


def _serialize(message: Message | bytes) -> bytes:
    """A reply to send: a message, or one encoded already (the same bytes for every stream)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


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
        member = await _answer(
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
        )

    async def Heartbeat(
        self, request_iterator: AsyncIterator[pb.HeartbeatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HeartbeatResponse | bytes]:
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            return
        await _admit(self.auth, "Heartbeat", first, context)
        try:
            await self._c.heartbeat(first.host_id, first.incarnation, first.step, _idle(first))
        except (Rejected, NotFound) as exc:
            yield pb.HeartbeatResponse(command=pb.COMMAND_REREGISTER, reason=str(exc))
            return
        except CoordinatorError as exc:
            await _abort(context, exc)
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
                    if command == "not_leader":
                        await _abort(context, self._c.not_leader(reason))
                    code = _COMMANDS[command]
                    yield pb.HeartbeatResponse(command=code, reason=reason)
                    if code in (pb.COMMAND_REREGISTER, pb.COMMAND_FINISHED):
                        return
                    continue
                if reader.done():
                    error = None if reader.cancelled() else reader.exception()
                    if isinstance(error, NotLeader):
                        await _abort(context, error)
                    if isinstance(error, Rejected | NotFound | InvalidRequest):
                        yield pb.HeartbeatResponse(command=pb.COMMAND_REREGISTER, reason=str(error))
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
        epoch of N members goes to N agents, and encoding it for each was N x N work. Every other
        answer that carries the topology (a registration, ``GetTopology``, ``WatchTopology``) takes
        its ``message`` too: built in Python for each answer, a topology of 9000 members took 15 ms
        of the event loop on an idle machine and 78 ms during a 10,000-host run, where copying and
        serialising the one built per epoch takes 2 and 6 ms."""
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
            if isinstance(request, _Malformed):
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
            # A fault of the coordinator's own: answered as the call would be (UNKNOWN), at once,
            # where no answer left the agent waiting out its budget before it tried the call.
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
        member = await _answer(context, self._c.leave(request.host_id, request.incarnation, request.reason))
        return pb.LeaveResponse(member=convert.member_to_pb(member, self._c.member_step(member.host_id)))

    async def GetTopology(
        self, request: pb.GetTopologyRequest, context: grpc.aio.ServicerContext
    ) -> pb.Topology:
        state = await _answer(context, self._c.observe())
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
            await _abort(context, exc)
            raise AssertionError("unreachable") from exc

    async def ListMembers(
        self, request: pb.ListMembersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListMembersResponse:
        try:
            states = {convert.member_state_from_pb(s) for s in request.states}
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        state = await _answer(context, self._c.observe())
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

        return await _answer(context, get())

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
                await _abort(context, exc)

    async def AckEpoch(
        self, request: pb.AckEpochRequest, context: grpc.aio.ServicerContext
    ) -> pb.AckEpochResponse:
        live = await _answer(context, self._acknowledge(request.host_id, request.incarnation, request))
        return pb.AckEpochResponse(live=live)

    async def ReportFault(
        self, request: pb.ReportFaultRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportFaultResponse:
        if request.kind == pb.FAULT_KIND_TIER_MISSING:
            # Not a fault: a trainer's observation riding this call until trainer observations have
            # an RPC of their own. Recorded for operators, never weighed against the host.
            noted = self._c.report_tier_missing(
                request.host_id, request.incarnation, request.epoch, request.tier, request.detail
            )
            return pb.ReportFaultResponse(member_dead=False, reason=await _answer(context, noted))
        kind = _FAULT.get(request.kind)
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fault kind {request.kind}")
            raise AssertionError("unreachable")
        if kind is FaultKind.STALLED:

            async def stall() -> str:
                return self._c.report_stall(request.host_id, request.incarnation, request.epoch, request.step)

            return pb.ReportFaultResponse(member_dead=False, reason=await _answer(context, stall()))
        outcome = await _answer(
            context,
            self._c.report_fault(
                request.host_id, request.incarnation, kind, request.epoch, request.exit_code, request.detail
            ),
        )
        return pb.ReportFaultResponse(member_dead=outcome.member_dead, reason=outcome.reason)

    async def CommitCheckpoint(
        self, request: pb.CommitCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitCheckpointResponse:
        await _answer(
            context,
            self._c.commit_checkpoint(
                request.host_id, request.incarnation, request.epoch, request.step, request.tier
            ),
        )
        return pb.CommitCheckpointResponse()

    async def Finish(self, request: pb.FinishRequest, context: grpc.aio.ServicerContext) -> pb.FinishResponse:
        await _answer(
            context, self._c.finish(request.host_id, request.incarnation, request.epoch, request.step)
        )
        return pb.FinishResponse()

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        member = await _answer(context, self._c.drain(request.host_id, request.reason))
        return pb.DrainResponse(member=convert.member_to_pb(member, self._c.member_step(member.host_id)))


def is_unix(address: str) -> bool:
    """Whether a gRPC address names a Unix socket (``unix:/path``, ``unix:///path``,
    ``unix-abstract:name``) rather than a host and a TCP port."""
    return address.startswith(("unix:", "unix-abstract:"))


def bind(server: grpc.aio.Server, listen: str, tls: Tls | None) -> int:
    """Add ``listen`` to ``server`` (mutual TLS with ``tls``, else plain); the TCP port bound (0 for a
    Unix socket: no TCP port at all). Raises OSError, saying what to do, when the address is taken
    or invalid.

    Over a Unix socket, TLS works as over TCP: clients check the coordinator's name
    (``COORDINATOR_NAME``), never the address they dialled."""
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, tls.server_credentials())
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {listen}: the address is taken or invalid; pick another --listen")
    return 0 if is_unix(listen) else port


def listen_host(listen: str) -> str:
    """The host part of a gRPC ``--listen`` address, for the metrics endpoint to bind beside it.

    /metrics listens where gRPC does: loopback stays private on one machine, and a coordinator told
    to listen on every interface (``0.0.0.0:50051`` in a pod) can be scraped by Prometheus as well.
    One on a Unix socket is reached from this machine only: its /metrics stays on loopback.
    """
    if is_unix(listen):
        return "127.0.0.1"
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    host = host.removeprefix("[").removesuffix("]")  # [::]:50051 -> ::
    return host or "0.0.0.0"


@dataclass
class RunningCoordinator:
    coordinator: Coordinator
    server: grpc.aio.Server
    port: int
    metrics_port: int | None
    feed: EventFeed
    health: asyncio.Task[None]
    # The plaintext port that serves the health service alone (``--health-port``), if any.
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None
    # The address it listens on, as given.
    listen: str = ""

    @property
    def address(self) -> str:
        """Where a client on this machine reaches it."""
        return self.listen if is_unix(self.listen) else f"127.0.0.1:{self.port}"

    async def stop(self, grace: float = 0.5) -> None:
        self.health.cancel()
        if self.health_server is not None:
            await self.health_server.stop(None)
        await self.server.stop(grace)
        await self.feed.close()
        await self.coordinator.stop()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


# gRPC sets TCP_USER_TIMEOUT on every socket its server accepts to its keepalive timeout, 20 s by default.
_GRPC_USER_TIMEOUT_S = 20.0


def grpc_server_options(calls: int, peer_timeout_s: float) -> list[tuple[str, int]]:
    """The gRPC server options of the coordinator and of a relay: ``calls`` concurrent calls, and
    connections the kernel drops once what was written to the peer stays unread for
    ``peer_timeout_s`` (never less than gRPC's own 20 s).

    The kernel aborts a connection whose data stays unacknowledged for TCP_USER_TIMEOUT, and a peer
    that reads nothing fills its receive window: at 20 s an agent busy for 20 s lost its stream, and
    the coordinator took the broken stream for a crash. At 10,000 hosts a first epoch of 9000
    members kept simulated agents busy that long, and 651 healthy hosts were declared dead."""
    return [
        # Agents ping every half second to notice a dead link quickly: allow it, never count strikes.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 100),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # A server's own keepalive pings come every two hours (gRPC's default): in effect this sets
        # only the sockets' TCP_USER_TIMEOUT.
        ("grpc.keepalive_timeout_ms", round(max(_GRPC_USER_TIMEOUT_S, peer_timeout_s) * 1000)),
        # gRPC's core cancels calls that arrive while more than 1000 (3000 at once) wait for the
        # server to take them: a fleet acknowledging a new epoch together got CANCELLED answers
        # (the event loop takes one call at a time). Calls wait for the loop instead.
        ("grpc.server.max_pending_requests", calls),
        ("grpc.server.max_pending_requests_hard_limit", calls),
    ]


def _concurrent_calls(settings: Settings) -> int:
    """Heartbeat streams are RPCs too (one per agent): room for every member twice (a reconnect's old
    and new stream) and the operators; past that, gRPC answers RESOURCE_EXHAUSTED at once."""
    return 2 * settings.max_members + 1024


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """The coordinator's gRPC server options. Silence is the detector's to judge
    (``heartbeat_timeout_s``, which grows with the fleet), so the kernel waits at least as long."""
    return grpc_server_options(_concurrent_calls(settings), settings.detector.heartbeat_timeout_s)


async def serve(settings: Settings, tls: Tls | None) -> RunningCoordinator:
    """Load the job's state from Redis and serve the Coordinator, health and reflection services.

    With ``tls`` every client must present a certificate of the job's CA, and the access policy
    applies; with None (``--insecure``) anyone reachable may do anything. With ``settings.ha.enabled``
    this is one replica of several: it leads only while it holds the lease.
    """
    connection = RedisConnection(
        settings.redis_url, settings.redis_username, settings.redis_password, settings.redis_ca_file
    )
    store = RedisStore(connection, settings.job_id)
    coordinator = Coordinator(settings, store)
    server = grpc.aio.server(
        maximum_concurrent_rpcs=_concurrent_calls(settings), options=server_options(settings)
    )
    servicer = CoordinatorServicer(coordinator, Authorizer(coordinator.metrics, secure=tls is not None))
    add_servicer(servicer, server)
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_name = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
    reflection.enable_server_reflection(
        (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    try:
        port = bind(server, settings.listen, tls)
    except OSError:
        await store.close()
        raise
    try:
        await coordinator.start(advertise=_advertised(settings.listen, port))
    except BaseException:
        await server.stop(None)
        await store.close()
        raise
    await server.start()
    if tls is None:
        log.warning(
            "serving WITHOUT TLS (--insecure): anyone who reaches this port may register as any host, "
            "drain hosts and read every member and event; give --tls-ca/--tls-cert/--tls-key outside a "
            "local experiment",
            listen=settings.listen,
        )
    # "" (the process serves; liveness, readiness): SERVING while it runs. The Coordinator service's
    # own name: SERVING only while this replica takes writes (it leads, Redis answers), so a load
    # balancer or a probe asking for it finds the replica to send agents to.
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_task = asyncio.create_task(_report_health(coordinator, health_servicer, service_name))
    health_server, health_port = None, None
    if settings.health_port is not None:
        # Kubelet probes cannot present a client certificate: health, and nothing else, in plaintext.
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = health_server.add_insecure_port(
            f"{listen_host(settings.listen)}:{settings.health_port}"
        )
        await health_server.start()
    metrics_port = (
        coordinator.metrics.serve(settings.metrics_port, addr=listen_host(settings.listen))
        if settings.metrics_port is not None
        else None
    )
    log.info(
        "coordinator serving",
        listen=settings.listen,
        port=port,
        metrics_port=metrics_port,
        health_port=health_port,
        job=settings.job_id,
        redis=connection.redacted_url,
        ha=settings.ha.enabled,
        tls=tls is not None,
        advertise=coordinator.advertise if settings.ha.enabled else None,
    )
    return RunningCoordinator(
        coordinator,
        server,
        port,
        metrics_port,
        servicer.feed,
        health_task,
        health_server,
        health_port,
        settings.listen,
    )


async def _report_health(coordinator: Coordinator, health_servicer: Any, service_name: str) -> None:
    """Keep the Coordinator service's health in step with whether this replica takes writes."""
    said: bool | None = None
    while True:
        writable = coordinator.writable
        if writable != said:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if writable
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await health_servicer.set(service_name, status)
            said = writable
        await asyncio.sleep(0.2)


def _advertised(listen: str, port: int) -> str:
    """Where agents reach this replica when ``--advertise`` is not given: the listen host (this
    machine's name for a wildcard address) with the port bound; a Unix socket as it is."""
    if is_unix(listen):
        return listen
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

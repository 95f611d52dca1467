"""The gRPC plumbing every remesh server shares (the coordinator's, a relay's): each call admitted
before it runs, errors answered as gRPC statuses, addresses bound, server options set.

Every ``CoordinatorError`` is turned into its gRPC status here and nowhere else. A follower replica
answers writes with UNAVAILABLE and the leader's address in the trailing metadata ``remesh-leader``
(empty while no leader is known); a finished job answers with its last step in ``remesh-finished``.
Every call passes the access policy (``remesh.coordinator.auth``) first, and a request that does not
parse is answered INVALID_ARGUMENT with the reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from remesh.coordinator.auth import Authorizer
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
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.contract import FINISHED_METADATA, LEADER_METADATA
from remesh.v1.security import Tls

__all__ = [
    "Malformed",
    "abort",
    "add_servicer",
    "admit",
    "answer",
    "bind",
    "grpc_server_options",
    "is_unix",
    "listen_host",
    "status_of",
]

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


def status_of(exc: CoordinatorError) -> grpc.StatusCode:
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def abort(context: grpc.aio.ServicerContext, exc: CoordinatorError) -> None:
    if isinstance(exc, NotLeader):
        await context.abort(status_of(exc), str(exc), trailing_metadata=((LEADER_METADATA, exc.leader),))
    if isinstance(exc, JobFinished):
        await context.abort(status_of(exc), str(exc), trailing_metadata=((FINISHED_METADATA, str(exc.step)),))
    await context.abort(status_of(exc), str(exc))


async def answer(context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
    try:
        return await call
    except CoordinatorError as exc:
        await abort(context, exc)
        raise AssertionError("unreachable") from exc  # abort always raises


class Malformed:
    """What a request that does not parse becomes, so the handler can answer INVALID_ARGUMENT."""

    def __init__(self, type_name: str, error: str) -> None:
        self.message = f"malformed request: not a valid {type_name} ({error})"


def _lenient(cls: type[Message]) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Malformed(cls.DESCRIPTOR.full_name, str(exc))

    return parse


async def admit(auth: Authorizer, method: str, request: object, context: grpc.aio.ServicerContext) -> None:
    """The caller may make this request (else the refusal's status); the request parsed (else
    INVALID_ARGUMENT: asked only of a caller the policy lets call ``method`` at all)."""
    host_id = None if isinstance(request, Malformed) else getattr(request, "host_id", None)
    try:
        auth.check(context, method, host_id)
    except CoordinatorError as exc:
        await abort(context, exc)
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _unary(
    impl: Callable[..., Awaitable[object]], method: str, auth: Authorizer
) -> Callable[..., Awaitable[object]]:
    async def handler(request: object, context: grpc.aio.ServicerContext) -> object:
        await admit(auth, method, request, context)
        return await impl(request, context)

    return handler


def _server_stream(
    impl: Callable[..., AsyncIterator[object]], method: str, auth: Authorizer
) -> Callable[..., AsyncIterator[object]]:
    async def handler(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
        await admit(auth, method, request, context)
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


def _serialize(message: Message | bytes) -> bytes:
    """A reply to send: a message, or one encoded already (the same bytes for every stream)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


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


# gRPC sets TCP_USER_TIMEOUT on every socket its server accepts to its keepalive timeout, 20 s by default.
_GRPC_USER_TIMEOUT_S = 20.0


def grpc_server_options(calls: int, peer_timeout_s: float) -> list[tuple[str, int]]:
    """The gRPC server options of the coordinator and of a relay: ``calls`` concurrent calls, and
    connections the kernel drops once what was written to the peer stays unread for
    ``peer_timeout_s`` (never less than gRPC's own 20 s).

    The kernel aborts a connection whose data stays unacknowledged for TCP_USER_TIMEOUT, and a peer
    that reads nothing fills its receive window: at 20 s an agent busy for 20 s loses its stream, and
    the coordinator takes the broken stream for a crash. A first epoch of 9000 members keeps
    simulated agents busy that long (in one 10,000-host run, 651 healthy hosts were declared dead)."""
    return [
        # Agents ping every half second to notice a dead link quickly: allow it, never count strikes.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 100),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # A server's own keepalive pings come every two hours (gRPC's default): in effect this sets
        # only the sockets' TCP_USER_TIMEOUT.
        ("grpc.keepalive_timeout_ms", round(max(_GRPC_USER_TIMEOUT_S, peer_timeout_s) * 1000)),
        # gRPC's core cancels calls that arrive while more than 1000 (3000 at once) wait for the
        # server to take them, and a fleet acknowledging a new epoch together sends more (the event
        # loop takes one call at a time): calls wait for the loop instead of failing CANCELLED.
        ("grpc.server.max_pending_requests", calls),
        ("grpc.server.max_pending_requests_hard_limit", calls),
    ]

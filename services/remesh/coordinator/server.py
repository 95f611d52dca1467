"""The coordinator process: its store, engine and gRPC server wired together (``serve``).

Beside the Coordinator service (``remesh.coordinator.servicer``) it serves the standard health
service and server reflection, so probes and generic clients (grpcurl, grpc_health_probe) work
without the .proto files; followers report SERVING too (they serve reads). Prometheus metrics and a
plaintext health port for kubelet probes are optional listeners beside it.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from remesh.coordinator.auth import Authorizer
from remesh.coordinator.feed import EventFeed
from remesh.coordinator.redis_connection import RedisConnection
from remesh.coordinator.rpc import add_servicer, bind, grpc_server_options, is_unix, listen_host
from remesh.coordinator.service import Coordinator
from remesh.coordinator.servicer import CoordinatorServicer
from remesh.coordinator.settings import Settings
from remesh.coordinator.store import RedisStore
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.security import Tls

__all__ = ["RunningCoordinator", "serve", "server_options"]

log = structlog.get_logger("remesh.coordinator")


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
    servicer = CoordinatorServicer(
        coordinator,
        Authorizer(coordinator.metrics, secure=tls is not None, ca_file=tls.ca_file if tls else None),
    )
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

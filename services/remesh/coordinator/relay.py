"""A topology relay (``remesh relay``): one stream from the coordinator, written on to many hosts.

At thousands of hosts the coordinator's largest cost in a recovery is writing the new epoch to every
heartbeat stream (``docs/scale.md``). A relay follows the coordinator's ``WatchTopology`` once and
serves ``TopologyRelay.FollowTopology`` to the hosts of its rack or slice: the coordinator writes an
epoch to a few relays, and each relay writes it to its share of the hosts, in parallel on other CPUs.

Only topologies go through a relay. Heartbeats, stream breaks, acknowledgements and commands stay on
each agent's own stream to the coordinator, so failure detection does not depend on a relay, and a
relay's death loses no liveness: an agent whose relay stream ends clears
``HeartbeatRequest.topology_from_relay`` and gets its topologies from the coordinator again.

A relay that loses the coordinator ends every stream it served a topology on (UNAVAILABLE): it never
leaves a topology it cannot vouch for as current in an agent's hands. A stream opened while the relay
does not follow the coordinator (before its first topology, or after a loss) is held open with
keepalives and served once it does: thousands of agents retrying a refusal would cost the relay a TLS
handshake each, every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import structlog

from remesh.coordinator.auth import Authorizer
from remesh.coordinator.doorbell import Doorbell
from remesh.coordinator.fanout import EncodedTopology
from remesh.coordinator.metrics import RelayMetrics
from remesh.coordinator.rpc import add_servicer, bind, grpc_server_options, listen_host
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.security import Tls, aio_channel

__all__ = ["RelayServicer", "RunningRelay", "follow_coordinator", "relay_server_options", "serve_relay"]

log = structlog.get_logger("remesh.relay")

_KEEPALIVE = pb.HeartbeatResponse().SerializeToString()


class _Lost(Exception):
    """This relay lost the coordinator: the stream ends so its agent goes back to its heartbeat stream."""


class RelayServicer(pb_grpc.TopologyRelayServicer):
    """The relay's side of its followers: the newest topology it got from the coordinator, encoded
    once per epoch (and once per delta base) for every follower, and the doorbell they wait on."""

    def __init__(self, auth: Authorizer, keepalive_s: float, metrics: RelayMetrics | None = None) -> None:
        self.auth = auth
        self.keepalive_s = keepalive_s
        self.metrics = metrics or RelayMetrics()
        self.followers = 0
        self.metrics.followers.set_function(lambda: self.followers)
        # The current topology with its replies, encoded; None: not following the coordinator now.
        self._encoded: EncodedTopology | None = None
        self._bell = Doorbell()
        self._generation = 0  # bumped when the coordinator is lost: older streams end
        self._loss = ""

    @property
    def topology(self) -> pb.Topology | None:
        """The newest topology from the coordinator; None while the relay follows none."""
        return self._encoded.message if self._encoded is not None else None

    def publish(self, topology: pb.Topology) -> None:
        """A topology from the coordinator: the new current one, written to every follower."""
        if self.topology is not None and topology.epoch <= self.topology.epoch:
            return
        self.metrics.epoch.set(topology.epoch)
        self._encoded = EncodedTopology.of(topology)
        self._bell.ring()

    def lost(self, reason: str) -> None:
        """The coordinator's stream ended: every follower served a topology goes back to its heartbeat
        stream (the others wait for the relay to follow again)."""
        if self.topology is None:
            return  # another failed attempt: nobody holds a topology of this relay's
        self._encoded = None
        self.metrics.epoch.set(-1)
        self.metrics.losses.inc()
        self._loss = reason
        self._generation += 1
        self._bell.ring()

    async def FollowTopology(
        self, request: pb.FollowTopologyRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        generation = self._generation
        self.followers += 1
        sent: pb.Topology | None = None
        try:
            while True:
                if generation != self._generation:
                    raise _Lost(self._loss)
                encoded = self._encoded
                if encoded is not None and (sent is None or encoded.message.epoch > sent.epoch):
                    yield encoded.reply(sent if request.topology_deltas else None)
                    sent = encoded.message
                    continue
                # Until a new topology or a loss, or a keepalive period with neither.
                if not await self._bell.wait(self.keepalive_s):
                    yield _KEEPALIVE
        except _Lost as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}: follow the coordinator meanwhile")
        finally:
            self.followers -= 1


async def follow_coordinator(
    servicer: RelayServicer,
    coordinators: Sequence[str],
    tls: Tls | None,
    *,
    keepalive_s: float = 1.0,
    retry_max_s: float = 5.0,
) -> None:
    """Follow the coordinator's topology into ``servicer`` for ever: the first address that answers,
    the next one after a failure (a pause doubling up to ``retry_max_s``, jittered). A silent
    coordinator is noticed by gRPC keepalive pings (``keepalive_s``)."""
    options = [
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(2 * keepalive_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A whole topology of tens of thousands of members is a few MB.
        ("grpc.max_receive_message_length", 64 * 2**20),
    ]
    pause, attempt = 0.2, 0
    while True:
        address = coordinators[attempt % len(coordinators)]
        channel = aio_channel(address, tls, options)
        reason = f"the stream from the coordinator at {address} ended"
        try:
            call = pb_grpc.CoordinatorStub(channel).WatchTopology(pb.WatchTopologyRequest())
            await call.wait_for_connection()
            if servicer.topology is None:
                # Before the job's first epoch the coordinator has no topology to send: its followers
                # get the empty one it would write on their heartbeat streams, so that they say so
                # and the first epoch reaches each of them once (from here), not twice, whole.
                servicer.publish(pb.Topology(epoch=0, restore_step=-1))
            async for topology in call:
                if servicer.topology is None or servicer.topology.epoch == 0:
                    log.info("following the coordinator", coordinator=address, epoch=topology.epoch)
                servicer.publish(topology)
                pause = 0.2
        except grpc.aio.AioRpcError as exc:
            reason = f"lost the coordinator at {address} ({exc.code().name}: {exc.details()})"
        finally:
            await channel.close(grace=None)
        was_following = servicer.topology is not None
        servicer.lost(reason)
        log.warning(
            "relay lost the coordinator; its followers go back to their heartbeat streams",
            coordinator=address,
            reason=reason,
            followers=servicer.followers if was_following else 0,
            retry_in_s=round(pause, 2),
        )
        await asyncio.sleep(pause * (0.5 + random.random()))
        pause = min(retry_max_s, 2 * pause)
        attempt += 1


@dataclass
class RunningRelay:
    servicer: RelayServicer
    server: grpc.aio.Server
    port: int
    following: asyncio.Task[None]

    async def stop(self, grace: float = 0.5) -> None:
        self.following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.following
        self.servicer.lost("the relay is stopping")
        await self.server.stop(grace)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def relay_server_options(max_followers: int, follower_timeout_s: float) -> list[tuple[str, int]]:
    """A relay's gRPC server options: a follower that leaves what the relay wrote unread for
    ``follower_timeout_s`` loses its connection (at 10,000 hosts gRPC's 20 s aborts thousands of busy
    followers' connections, and each of them then takes its topologies from the coordinator)."""
    return grpc_server_options(max_followers, follower_timeout_s)


async def serve_relay(
    listen: str,
    coordinators: Sequence[str],
    tls: Tls | None,
    *,
    keepalive_s: float = 5.0,
    follower_timeout_s: float = 120.0,
    max_followers: int = 20_000,
    metrics_port: int | None = None,
) -> RunningRelay:
    """Serve ``TopologyRelay`` on ``listen`` (port 0: a free one), following ``coordinators``.

    With ``tls`` (a coordinator certificate: agents check the coordinator's name on a relay too)
    every follower must present a host certificate of the job's CA, for its own host. A follower
    that leaves what was written to it unread for ``follower_timeout_s`` loses its connection."""
    metrics = RelayMetrics()
    servicer = RelayServicer(
        Authorizer(metrics, secure=tls is not None, ca_file=tls.ca_file if tls else None),
        keepalive_s,
        metrics,
    )
    server = grpc.aio.server(
        maximum_concurrent_rpcs=max_followers,
        options=relay_server_options(max_followers, follower_timeout_s),
    )
    add_servicer(servicer, server, "TopologyRelay")
    port = bind(server, listen, tls)
    await server.start()
    following = asyncio.create_task(follow_coordinator(servicer, coordinators, tls), name="follow")
    bound_metrics = metrics.serve(metrics_port, listen_host(listen)) if metrics_port is not None else None
    log.info(
        "relay serving",
        port=port,
        metrics_port=bound_metrics,
        host=listen_host(listen),
        coordinators=list(coordinators),
        tls=tls is not None,
    )
    return RunningRelay(servicer, server, port, following)

"""Topology relays (``remesh relay``): epochs reach agents through a relay, the coordinator writes
them on no heartbeat stream whose agent says its relay carries them, and an agent whose relay dies
gets them from the coordinator again."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import random
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from benchmarks.fleet import Fleet, host_ids
from remesh.coordinator.auth import Authorizer
from remesh.coordinator.metrics import RelayMetrics
from remesh.coordinator.relay import RelayServicer
from remesh.coordinator.rpc import add_servicer
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1 import deltas
from remesh.v1.security import Role
from tests.procs import Cluster, hold, wait_for

# ---- the relay's own side, on a real gRPC server ------------------------------------------------


def _topology(epoch: int, hosts: list[str]) -> pb.Topology:
    return pb.Topology(
        epoch=epoch,
        members=[pb.TopologyMember(host_id=h, rank=r, device_count=1) for r, h in enumerate(hosts)],
        restore_step=-1,
    )


@contextlib.asynccontextmanager
async def _relay() -> AsyncIterator[tuple[RelayServicer, pb_grpc.TopologyRelayStub, str]]:
    """A relay's servicer on a real gRPC server (no coordinator: the test publishes), and a stub."""
    metrics = RelayMetrics()
    servicer = RelayServicer(Authorizer(metrics, secure=False), keepalive_s=0.2, metrics=metrics)
    server = grpc.aio.server()
    add_servicer(servicer, server, "TopologyRelay")
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    channel = grpc.aio.insecure_channel(address)
    try:
        yield servicer, pb_grpc.TopologyRelayStub(channel), address
    finally:
        await channel.close()
        await server.stop(None)


def test_a_relay_sends_the_topology_whole_then_deltas_and_keepalives() -> None:
    hosts = [f"host-{i}" for i in range(8)]
    replaced = [*hosts[:3], "spare-0", *hosts[4:]]

    async def go() -> None:
        async with _relay() as (servicer, stub, _):
            servicer.publish(_topology(1, hosts))
            call = stub.FollowTopology(pb.FollowTopologyRequest(host_id="host-0", topology_deltas=True))
            first = await call.read()
            assert first.topology == _topology(1, hosts)
            assert not (await call.read()).ListFields()  # nothing new: an empty keepalive
            servicer.publish(_topology(2, replaced))
            servicer.publish(_topology(2, hosts))  # the same epoch again changes nothing
            servicer.publish(_topology(1, hosts))  # nor does an older one
            second = await call.read()
            assert second.HasField("topology_delta")
            assert deltas.apply(first.topology, second.topology_delta) == _topology(2, replaced)
            # A follower that takes whole topologies gets the current one whole.
            whole = stub.FollowTopology(pb.FollowTopologyRequest(host_id="host-1"))
            assert (await whole.read()).topology == _topology(2, replaced)
            assert servicer.followers == 2
            whole.cancel()
            call.cancel()

    asyncio.run(go())


def test_a_relay_that_loses_the_coordinator_ends_the_streams_it_served_and_holds_new_ones() -> None:
    async def go() -> None:
        async with _relay() as (servicer, stub, _):
            # Not following the coordinator yet: a follower is held, with keepalives only.
            early = stub.FollowTopology(pb.FollowTopologyRequest(host_id="host-0", topology_deltas=True))
            assert not (await asyncio.wait_for(early.read(), 5)).ListFields()
            servicer.publish(_topology(3, ["host-0", "host-1"]))
            assert (await asyncio.wait_for(early.read(), 5)).topology.epoch == 3
            assert _sample(servicer, "remesh_relay_epoch") == 3
            assert _sample(servicer, "remesh_relay_followers") == 1
            servicer.lost("lost the coordinator at 127.0.0.1:1 (UNAVAILABLE: gone)")
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while True:
                    await asyncio.wait_for(early.read(), 5)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "lost the coordinator" in (ended.value.details() or "")
            assert servicer.followers == 0
            # Lost: a new follower is held again, and a failed attempt more ends nobody's stream.
            late = stub.FollowTopology(pb.FollowTopologyRequest(host_id="host-1"))
            assert not (await asyncio.wait_for(late.read(), 5)).ListFields()
            servicer.lost("lost the coordinator at 127.0.0.1:1 (UNAVAILABLE: still gone)")
            assert not (await asyncio.wait_for(late.read(), 5)).ListFields()
            # One loss counted (the failed attempt after it is none), and no epoch held meanwhile.
            assert _sample(servicer, "remesh_relay_coordinator_losses_total") == 1
            assert _sample(servicer, "remesh_relay_epoch") == -1
            # Following again, it serves the coordinator's topology, whatever epoch it had before.
            servicer.publish(_topology(2, ["host-1"]))
            assert (await asyncio.wait_for(late.read(), 5)).topology.epoch == 2
            late.cancel()

    asyncio.run(go())


def _sample(servicer: RelayServicer, name: str) -> float | None:
    return servicer.metrics.registry.get_sample_value(name)


def test_a_malformed_follow_request_is_refused_with_the_reason() -> None:
    async def go() -> None:
        async with _relay() as (servicer, _, address):
            servicer.publish(_topology(1, ["host-0"]))
            async with grpc.aio.insecure_channel(address) as channel:
                follow = channel.unary_stream(
                    "/remesh.v1.TopologyRelay/FollowTopology",
                    request_serializer=lambda b: b,
                    response_deserializer=pb.HeartbeatResponse.FromString,
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await follow(b"\xff\xff\xff").read()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "FollowTopologyRequest" in (refused.value.details() or "")
            assert servicer.followers == 0

    asyncio.run(go())


# ---- the coordinator's side: a stream whose agent follows a relay -------------------------------


class _Stream:
    """One host's heartbeat stream, its heartbeats sent when asked, its replies queued."""

    def __init__(self, cluster: Cluster, host_id: str) -> None:
        self._channel = cluster.channel(Role.HOST, host_id)
        stub = pb_grpc.CoordinatorStub(self._channel)
        reply = stub.Register(
            pb.RegisterRequest(host_id=host_id, device_count=1, address="127.0.0.1"), timeout=5
        )
        self.host_id, self.incarnation = host_id, reply.member.incarnation
        self._out: queue.Queue[pb.HeartbeatRequest | None] = queue.Queue()
        self.replies: queue.Queue[pb.HeartbeatResponse] = queue.Queue()
        self._call = stub.Heartbeat(iter(self._out.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def beat(self, from_relay: bool) -> None:
        self._out.put(
            pb.HeartbeatRequest(
                host_id=self.host_id,
                incarnation=self.incarnation,
                trainer_status=pb.TRAINER_STATUS_RUNNING,
                topology_deltas=True,
                topology_from_relay=from_relay,
            )
        )

    def _read(self) -> None:
        try:
            for reply in self._call:
                self.replies.put(reply)
        except grpc.RpcError:
            pass

    def topologies(self) -> list[pb.HeartbeatResponse]:
        got = []
        while not self.replies.empty():
            reply = self.replies.get()
            if reply.HasField("topology") or reply.HasField("topology_delta"):
                got.append(reply)
        return got

    def close(self) -> None:
        self._out.put(None)
        self._call.cancel()
        self._channel.close()


@pytest.mark.integration
def test_the_coordinator_writes_no_topology_to_a_stream_whose_relay_carries_them(cluster: Cluster) -> None:
    cluster.start_coordinator("--world-size", "1")
    stream = _Stream(cluster, "host-0")
    try:
        stream.beat(from_relay=True)
        cluster.wait_epoch(1)
        # Heartbeats keep coming, and keepalives with them; never a topology.
        received: list[pb.HeartbeatResponse] = []

        def none_written() -> None:
            stream.beat(from_relay=True)
            received.extend(stream.topologies())
            assert not received, received

        hold(1.5, none_written, interval=0.1)
        # Its relay lost: the next heartbeat says so, and the current topology comes whole.
        stream.beat(from_relay=False)
        reply = wait_for(lambda: next(iter(stream.topologies()), None), 10, "the topology on the stream")
        assert reply.HasField("topology") and reply.topology.epoch == 1
    finally:
        stream.close()


# ---- end to end: real agents, a real relay, killed -----------------------------------------------


def _said(cluster: Cluster, host: str, epoch: int) -> list[str]:
    """The ways ``host``'s agent logged receiving ``epoch`` (sent_as=whole, delta or relay)."""
    return [
        line.split("sent_as=")[1].split()[0]
        for line in cluster.agents[host].output().splitlines()
        if "topology" in line and f"epoch={epoch} " in line and "sent_as=" in line
    ]


def _live(cluster: Cluster, epoch: int) -> bool:
    return any(e.type == pb.EVENT_TYPE_EPOCH_LIVE and e.epoch == epoch for e in cluster.events())


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["killed", "silent"])
def test_agents_take_epochs_from_their_relay_and_from_the_coordinator_once_it_dies(
    cluster: Cluster, how: str
) -> None:
    """``how`` the relay goes: SIGKILLed (its streams end), or SIGSTOPped (silent: its streams stay
    open and say nothing; each agent notices within its relay silence timeout, 20 s)."""
    cluster.start_coordinator("--world-size", "2")
    relay, address = cluster.start_relay()
    hosts = ["host-0", "host-1", "spare-0", "spare-1"]
    for h in hosts:
        cluster.start_agent(h, spare=h.startswith("spare"), extra=["--relay", address])
    cluster.wait_epoch(1, timeout=60)
    wait_for(lambda: _live(cluster, 1), 60, "epoch 1 live")
    wait_for(
        lambda: all("topologies from the relay" in cluster.agents[h].output() for h in hosts),
        30,
        "every agent to follow the relay",
    )

    cluster.agents["host-1"].kill()  # SIGKILL
    second = cluster.wait_epoch(2, timeout=30)
    assert "spare-0" in {m.host_id for m in second.members}
    wait_for(lambda: _live(cluster, 2), 60, "epoch 2 live")
    for h in ("host-0", "spare-0", "spare-1"):
        # Through the relay only: the coordinator wrote epoch 2 on none of their heartbeat streams.
        assert _said(cluster, h, 2) == ["relay"], (h, _said(cluster, h, 2))

    if how == "killed":
        relay.kill()  # SIGKILL: the relay's followers go back to their heartbeat streams
    else:
        relay.signal_group(signal.SIGSTOP)
    stopped = time.monotonic()
    wait_for(
        lambda: all("relay lost" in cluster.agents[h].output() for h in ("host-0", "spare-0", "spare-1")),
        30 if how == "killed" else 20 + 15,
        "the agents to notice the relay gone",
    )
    if how == "silent":
        # Noticed by its silence (it broke no stream): 20 s after the relay's last keepalive, which
        # it sends every 5 s, so 15-20 s after the stop, and within the timeout and a moment.
        assert time.monotonic() - stopped >= 20 - 5 - 1
        assert all(
            "the relay sent nothing for 20.0s" in cluster.agents[h].output()
            for h in ("host-0", "spare-0", "spare-1")
        )
    cluster.agents["host-0"].kill()
    third = cluster.wait_epoch(3, timeout=30)
    assert {m.host_id for m in third.members} == {"spare-0", "spare-1"}
    wait_for(lambda: _live(cluster, 3), 60, "epoch 3 live")
    for h in ("spare-0", "spare-1"):
        assert _said(cluster, h, 3) and "relay" not in _said(cluster, h, 3), (h, _said(cluster, h, 3))


# ---- a fleet through relays ----------------------------------------------------------------------

ACTIVE, SPARES = 90, 10


@pytest.fixture
def relayed_fleet(cluster: Cluster) -> Iterator[Fleet]:
    cluster.start_coordinator(
        "--world-size", str(ACTIVE), "--heartbeat-interval", "0.5", "--jax-port-span", "5000"
    )  # fmt: skip
    relays = [cluster.start_relay()[1] for _ in range(2)]
    fleet = Fleet(
        cluster.address,
        host_ids(ACTIVE),
        host_ids(SPARES, "spare"),
        processes=2,
        pki=cluster.pki,
        relays=relays,
    )
    try:
        fleet.start(timeout=120)
        cluster.wait_epoch(1, timeout=60)
        wait_for(lambda: _live(cluster, 1), 60, "epoch 1 live")
        yield fleet
    finally:
        fleet.close()


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_correlated_failure_reaches_every_survivor_through_the_relays(
    cluster: Cluster, relayed_fleet: Fleet
) -> None:
    fleet = relayed_fleet
    everyone = set(fleet.hosts) | set(fleet.spares)
    # Every agent follows its relay (and its heartbeats say so) before the failure.
    wait_for(lambda: everyone <= fleet.relay_followers(), 30, "every agent to follow its relay")
    before = cluster.topology().epoch
    victims = random.Random(7).sample(list(fleet.hosts), ACTIVE // 10)
    fleet.command("crash", victims)
    new = wait_for(lambda: cluster.topology() if cluster.topology().epoch > before else None, 30, "an epoch")
    survivors = everyone - set(victims)
    wait_for(lambda: survivors <= set(fleet.received(new.epoch)), 30, "every survivor to receive the epoch")
    assert survivors <= fleet.via_relay.get(new.epoch, set()), survivors - fleet.via_relay.get(
        new.epoch, set()
    )
    assert not [t for t in fleet.trouble if "delta" in t], fleet.trouble
    changes = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED and e.epoch > before]
    assert len(changes) == 1, [(e.epoch, e.reason) for e in changes]

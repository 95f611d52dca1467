"""The Observe call end to end (a real coordinator process, real Redis, hosts heartbeating over gRPC
as agents do): what a trainer observed is weighed, never charged to its host, and the fault kinds an
agent of remesh 0.1.0 still sends for the same observations are handled exactly as Observe would."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.security import Role
from tests.procs import Cluster, GrpcHost, hold

pytestmark = pytest.mark.integration

# How each call says "the collective of ``epoch`` failed in this host's trainer".
Say = Callable[[Cluster, GrpcHost, int], str]


def observe(cluster: Cluster, host: GrpcHost, epoch: int) -> str:
    request = pb.ObserveRequest(
        host_id=host.host_id,
        incarnation=host.incarnation,
        epoch=epoch,
        collective_failure=pb.CollectiveFailureObservation(detail="Gloo AllReduce timed out"),
    )
    reply: pb.ObserveResponse = cluster.stub_as(Role.HOST, host.host_id).Observe(request, timeout=10)
    return reply.reason


def as_a_fault_of_old(cluster: Cluster, host: GrpcHost, epoch: int) -> str:
    request = pb.ReportFaultRequest(
        host_id=host.host_id,
        incarnation=host.incarnation,
        kind=pb.FAULT_KIND_COLLECTIVE_FAILED,
        epoch=epoch,
        detail="Gloo AllReduce timed out",
    )
    reply: pb.ReportFaultResponse = cluster.stub_as(Role.HOST, host.host_id).ReportFault(request, timeout=10)
    assert not reply.member_dead
    return reply.reason


@pytest.fixture
def two_hosts(cluster: Cluster) -> Iterator[list[GrpcHost]]:
    cluster.start_coordinator("--world-size", "2")
    hosts = [GrpcHost(cluster, f"host-{i}", 0) for i in range(2)]
    try:
        cluster.wait_epoch(1)
        yield hosts
    finally:
        for host in hosts:
            host.stop()


@pytest.mark.parametrize("say", [observe, as_a_fault_of_old], ids=["Observe", "ReportFault of 0.1.0"])
def test_every_member_saying_its_collective_failed_re_forms_the_same_members(
    cluster: Cluster, two_hosts: list[GrpcHost], say: Say
) -> None:
    reasons = [say(cluster, host, 1) for host in two_hosts]
    assert all("reported a failed collective in epoch 1" in r for r in reasons), reasons
    topology = cluster.wait_epoch(2)
    assert "every member said a collective of epoch 1 failed" in topology.reason
    assert sorted(m.host_id for m in topology.members) == ["host-0", "host-1"]
    assert not [
        e for e in cluster.events() if e.type in (pb.EVENT_TYPE_MEMBER_DEAD, pb.EVENT_TYPE_FAULT_REPORTED)
    ]
    # Of an epoch that is over: ignored, by either call.
    assert "ignored" in say(cluster, two_hosts[0], 1)


def test_a_stall_and_a_missing_tier_say_the_same_by_either_call(
    cluster: Cluster, two_hosts: list[GrpcHost]
) -> None:
    host = two_hosts[0]
    stub = cluster.stub_as(Role.HOST, host.host_id)
    identity = {"host_id": host.host_id, "incarnation": host.incarnation, "epoch": 1}
    stalled = stub.Observe(pb.ObserveRequest(**identity, stall=pb.StallObservation(step=7)), timeout=10)
    old = stub.ReportFault(pb.ReportFaultRequest(**identity, kind=pb.FAULT_KIND_STALLED, step=7), timeout=10)
    assert stalled.reason == old.reason == "host-0 blocked in epoch 1 after step 7: noted"
    missing = pb.TierMissingObservation(tier="host-shm", detail="No space left on device")
    first = stub.Observe(pb.ObserveRequest(**identity, tier_missing=missing), timeout=10)
    again = stub.ReportFault(
        pb.ReportFaultRequest(**identity, kind=pb.FAULT_KIND_TIER_MISSING, tier="host-shm", detail="x"),
        timeout=10,
    )
    assert "cannot keep host-0's snapshots" in first.reason and "recorded already" in again.reason
    recorded = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_TIER_MISSING]
    assert [(e.host_id, e.details["tier"], e.details["detail"]) for e in recorded] == [
        ("host-0", "host-shm", "No space left on device")
    ]

    # Nobody was charged with anything, and the epoch stands (a stall alone is no verdict: the other
    # member's trainer is not idle).
    def untouched() -> None:
        assert cluster.topology().epoch == 1
        assert {m.state for m in cluster.members().values()} == {pb.MEMBER_STATE_ALIVE}

    hold(2.0, untouched, interval=0.2)

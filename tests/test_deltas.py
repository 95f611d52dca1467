"""Topology deltas on heartbeat streams (remesh.v1.deltas): what the coordinator writes, the agent
rebuilds exactly, and a delta that does not fit the topology held is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import deltas


def topology(epoch: int, hosts: list[str], devices: int = 2, **fields: object) -> pb.Topology:
    return pb.Topology(
        epoch=epoch,
        members=[
            pb.TopologyMember(host_id=h, rank=r, device_count=devices, address=f"{h}.local")
            for r, h in enumerate(hosts)
        ],
        mesh_shape=[len(hosts), devices],
        jax_coordinator_address=f"{hosts[0]}.local:8476" if hosts else "",
        restore_step=7,
        job_id="job",
        **fields,  # type: ignore[arg-type]
    )


def test_a_spare_taking_a_dead_hosts_rank_is_one_member_each_way() -> None:
    base = topology(3, [f"h{i}" for i in range(1000)])
    hosts = [f"h{i}" for i in range(1000)]
    hosts[417] = "spare-0"
    new = topology(4, hosts, reason="h417 dead", commits=[pb.CheckpointCommit(step=5, epoch=3)])
    d = deltas.delta(base, new)
    assert d is not None
    assert (d.base_epoch, list(d.removed), [m.host_id for m in d.changed]) == (3, ["h417"], ["spare-0"])
    assert not d.topology.members and d.topology.reason == "h417 dead"
    assert deltas.apply(base, d) == new
    whole = pb.HeartbeatResponse(topology=new).ByteSize()
    assert pb.HeartbeatResponse(topology_delta=d).ByteSize() * 50 < whole


def test_a_change_of_most_members_goes_whole() -> None:
    base = topology(3, [f"h{i}" for i in range(10)])
    # A shrink that drops rank 0 renumbers every other rank: nothing to save.
    assert deltas.delta(base, topology(4, [f"h{i}" for i in range(1, 10)])) is None
    # The first topology of a stream's job: everything is new.
    assert deltas.delta(pb.Topology(epoch=0), base) is None


@pytest.mark.parametrize(
    "tamper, why",
    [
        (lambda d: setattr(d, "base_epoch", 2), "arrived while epoch 3 is held"),
        (lambda d: d.removed.append("nobody"), "removes nobody"),
        (lambda d: setattr(d, "member_count", 11), "not 11"),
    ],
)
def test_a_delta_that_does_not_fit_the_topology_held_is_refused(tamper: object, why: str) -> None:
    hosts = [f"h{i}" for i in range(10)]
    base = topology(3, hosts)
    d = deltas.delta(base, topology(4, [*hosts[:9], "spare-0"]))
    assert d is not None
    tamper(d)  # type: ignore[operator]
    with pytest.raises(deltas.DeltaMismatch, match=why):
        deltas.apply(base, d)


@st.composite
def two_topologies(draw: st.DrawFn) -> tuple[pb.Topology, pb.Topology]:
    pool = [f"h{i}" for i in range(40)]
    old = draw(st.lists(st.sampled_from(pool), unique=True, max_size=30))
    new = draw(st.lists(st.sampled_from(pool), unique=True, max_size=30))
    devices = draw(st.sampled_from([1, 2]))
    return topology(5, old), topology(6, new, devices=devices, halted=not new)


@given(two_topologies())
def test_whatever_changed_the_delta_rebuilds_the_new_topology_or_none_is_sent(
    pair: tuple[pb.Topology, pb.Topology],
) -> None:
    base, new = pair
    held = {m.host_id: m for m in base.members}
    kept = {m.host_id for m in new.members}
    churn = sum(held.get(m.host_id) != m for m in new.members) + len(held.keys() - kept)
    d = deltas.delta(base, new)
    assert (d is not None) == (churn < max(1, len(new.members)))
    if d is None:
        return
    assert deltas.apply(base, d) == new
    assert (
        pb.HeartbeatResponse(topology_delta=d).ByteSize()
        <= pb.HeartbeatResponse(topology=new).ByteSize() + 16
    )

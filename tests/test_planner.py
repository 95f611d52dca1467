"""Table-driven tests of the pure planner: ``plan`` decides, ``plan_events`` records the decision.

Each row of ``CASES`` is one observed state and the decision it must lead to. Every row is also run
through ``plan_events`` and replayed, to check what holds for every decision: a new topology gets the
next epoch, ranks in member records match the topology, and planning again from the result changes
nothing. No clock, no sockets.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from remesh.coordinator.frozen_map import FrozenMap
from remesh.coordinator.model import (
    ClusterState,
    Event,
    EventType,
    Member,
    MemberState,
    Role,
    Topology,
    TopologyMember,
    replay,
)
from remesh.coordinator.observations import CollectiveFailures, Crash, CrashLoop, Observations, StateLost
from remesh.coordinator.planner import RULES, Decision, Kind, Situation, natural_key, plan, plan_events
from remesh.coordinator.settings import PlannerSettings

ALIVE = MemberState.ALIVE
DEAD = MemberState.DEAD
SUSPECT = MemberState.SUSPECT
JOINING = MemberState.JOINING
LEFT = MemberState.LEFT
DRAINING = MemberState.DRAINING

TOPOLOGY_KINDS = (Kind.FORM, Kind.REPLACE, Kind.SHRINK, Kind.GROW, Kind.READDRESS, Kind.REFORM)


def member(
    host: str,
    state: MemberState = ALIVE,
    *,
    role: Role = Role.SPARE,
    rank: int = -1,
    devices: int = 4,
    incarnation: int = 1,
) -> Member:
    return Member(
        host_id=host,
        incarnation=incarnation,
        role=role,
        state=state,
        device_count=devices,
        address=f"10.0.0.{sum(map(ord, host)) % 250}",
        rank=rank,
        reason=f"{host} is {state.value}",
        updated_at=1.0,
    )


def actives(*hosts: str, state: MemberState = ALIVE) -> list[Member]:
    """Registered before the job formed: role ACTIVE, no rank yet."""
    return [member(h, state, role=Role.ACTIVE) for h in hosts]


def spares(*hosts: str, state: MemberState = ALIVE) -> list[Member]:
    return [member(h, state) for h in hosts]


def formed(
    hosts: Sequence[str],
    *,
    epoch: int = 1,
    states: Mapping[str, MemberState] | None = None,
    others: Sequence[Member] = (),
    restore_step: int = -1,
    waiting_since: float | None = None,
    halted: bool = False,
) -> ClusterState:
    """A job running ``hosts`` (rank = position) at ``epoch``, plus ``others`` outside the topology."""
    states = states or {}
    ms = [member(h, states.get(h, ALIVE), role=Role.ACTIVE, rank=r) for r, h in enumerate(hosts)]
    topology = Topology(
        epoch=epoch,
        members=tuple(TopologyMember(m.host_id, m.rank, m.device_count, m.address) for m in ms),
        mesh_shape=(len(ms), 4),
        jax_coordinator_address=f"{ms[0].address}:47000" if ms else "",
        restore_step=restore_step,
        reason="earlier decision",
        created_at=0.5,
        halted=halted,
    )
    return ClusterState(
        members={m.host_id: m for m in [*ms, *others]},
        topology=topology,
        waiting_since=waiting_since,
        live_epoch=epoch,
        acks={m.host_id: epoch for m in ms},
    )


def unformed(*ms: Member) -> ClusterState:
    return ClusterState(members={m.host_id: m for m in ms})


def S(
    world_size: int = 4, min_world_size: int = 1, must_divide: int = 0, max_wait_s: float = 30.0
) -> PlannerSettings:
    return PlannerSettings(
        world_size=world_size,
        min_world_size=min_world_size,
        world_size_must_divide=must_divide,
        max_wait_s=max_wait_s,
    )


def seen(steps: Mapping[str, int] | None = None, **fields: Any) -> Observations:
    """What the coordinator observed: the members' steps, and any other field of ``Observations``."""
    return Observations(steps=FrozenMap(steps or {}), **fields)


def failed(epoch: int, since: float, reported: int, futile: int = 0) -> dict[str, Any]:
    """The fields of observations in which ``reported`` members said a collective of ``epoch``
    failed, the first at ``since``, after ``futile`` re-forms in a row that completed no step."""
    hosts = FrozenMap({f"a{i}": since for i in range(reported)})
    return {"collective_failures": CollectiveFailures(epoch, since, hosts), "futile_reforms": futile}


FOUR = ("a0", "a1", "a2", "a3")


@dataclass(frozen=True)
class Case:
    state: ClusterState
    kind: Kind
    hosts: tuple[str, ...] = ()
    settings: PlannerSettings = field(default_factory=S)
    steps: Mapping[str, int] = field(default_factory=dict)
    now: float = 100.0
    restore_step: int | None = None
    reason_has: tuple[str, ...] = ()


CASES = {
    # ---- form ----------------------------------------------------------------------------------
    "form waits below world size": Case(
        unformed(*actives("a0", "a1", "a2"), *spares("s0")),
        Kind.NONE,
        reason_has=("3 of 4",),
    ),
    "form counts only alive actives": Case(
        unformed(*actives("a0", "a1", "a2"), *actives("a3", state=JOINING), *spares("s0", "s1")),
        Kind.NONE,
        reason_has=("3 of 4",),
    ),
    "form places world_size actives in natural order": Case(
        unformed(*actives("h10", "h2", "h1", "h3", "h11"), *spares("h0")),
        Kind.FORM,
        ("h1", "h2", "h3", "h10"),
        restore_step=-1,
        reason_has=("formed with 4 hosts",),
    ),
    "form with exactly world_size": Case(
        unformed(*actives("a0", "a1"), *spares("s0")),
        Kind.FORM,
        ("a0", "a1"),
        settings=S(world_size=2),
    ),
    # ---- healthy -------------------------------------------------------------------------------
    "healthy topology": Case(formed(FOUR, others=spares("s0")), Kind.NONE, reason_has=("healthy",)),
    "suspect member keeps its rank": Case(
        formed(FOUR, states={"a2": SUSPECT}, others=spares("s0")), Kind.NONE, reason_has=("healthy",)
    ),
    "rejoining member keeps its rank": Case(
        formed(FOUR, states={"a2": JOINING}, others=spares("s0")), Kind.NONE, reason_has=("healthy",)
    ),
    # ---- replace -------------------------------------------------------------------------------
    "a job below its size replaces the lost member and grows in the same epoch": Case(
        formed(("a0", "a1", "a2"), states={"a1": DEAD}, others=spares("s0", "s1", "s2")),
        Kind.REPLACE,
        ("a0", "s0", "a2", "s1"),
        reason_has=("s0 takes rank 1 of a1", "grew from 3 to 4 hosts: added s1"),
    ),
    "replace one dead member with a spare": Case(
        formed(FOUR, states={"a1": DEAD}, others=spares("s0"), restore_step=5),
        Kind.REPLACE,
        ("a0", "s0", "a2", "a3"),
        steps={"a0": 12, "a1": 3, "a2": 10, "a3": 11, "s0": 0},
        restore_step=10,
        reason_has=("a1 dead", "s0 takes rank 1 of a1"),
    ),
    "replace a member that left": Case(
        formed(FOUR, states={"a3": LEFT}, others=spares("s0")),
        Kind.REPLACE,
        ("a0", "a1", "a2", "s0"),
        reason_has=("a3 left", "s0 takes rank 3 of a3"),
    ),
    "replace a draining member": Case(
        formed(FOUR, states={"a0": DRAINING}, others=spares("s0")),
        Kind.REPLACE,
        ("s0", "a1", "a2", "a3"),
        reason_has=("a0 draining", "s0 takes rank 0 of a0"),
    ),
    "replace several dead with enough spares": Case(
        formed(FOUR, states={"a1": DEAD, "a3": DEAD}, others=spares("s2", "s1", "s3")),
        Kind.REPLACE,
        ("a0", "s1", "a2", "s2"),
        steps={"a0": 7, "a2": 9, "s1": 100},
        restore_step=7,
        reason_has=("a1 dead", "a3 dead", "s1 takes rank 1 of a1", "s2 takes rank 3 of a3"),
    ),
    "only alive spares replace": Case(
        formed(
            FOUR, states={"a1": DEAD}, others=[*spares("s0", state=JOINING), *spares("s1", state=SUSPECT)]
        ),
        Kind.SHRINK,
        ("a0", "a2", "a3"),
    ),
    "restore step falls back to the topology's without progress": Case(
        formed(FOUR, states={"a1": DEAD}, others=spares("s0"), restore_step=42),
        Kind.REPLACE,
        ("a0", "s0", "a2", "a3"),
        steps={"a0": -1},
        restore_step=42,
    ),
    # ---- shrink --------------------------------------------------------------------------------
    "shrink without spares": Case(
        formed(FOUR, states={"a1": DEAD}),
        Kind.SHRINK,
        ("a0", "a2", "a3"),
        steps={"a0": 8, "a2": 6, "a3": 9},
        restore_step=6,
        reason_has=("a1 dead", "0 spare(s) for 1 lost", "from 4 to 3"),
    ),
    "shrink to a size that divides the batch": Case(
        formed(FOUR, states={"a1": DEAD}),
        Kind.SHRINK,
        ("a0", "a2"),
        settings=S(must_divide=8),
        reason_has=("a1 dead", "from 4 to 2"),
    ),
    "shrink puts survivors first, then spares": Case(
        formed(FOUR, states={"a0": DEAD, "a2": DEAD}, others=spares("s0")),
        Kind.SHRINK,
        ("a1", "a3", "s0"),
        reason_has=("a0 dead", "a2 dead", "1 spare(s) for 2 lost"),
    ),
    "shrink respects the minimum": Case(
        formed(FOUR, states={"a0": DEAD, "a3": DEAD}),
        Kind.SHRINK,
        ("a1", "a2"),
        settings=S(min_world_size=2),
    ),
    "shrink twice from an already shrunk topology": Case(
        formed(("a0", "a2", "a3"), epoch=5, states={"a2": DEAD}),
        Kind.SHRINK,
        ("a0", "a3"),
        settings=S(min_world_size=2),
    ),
    # ---- grow ----------------------------------------------------------------------------------
    "grow back when spares appear": Case(
        formed(("a0", "a2"), epoch=3, others=spares("s1", "s0", "s2")),
        Kind.GROW,
        ("a0", "a2", "s0", "s1"),
        steps={"a0": 20, "a2": 21},
        restore_step=20,
        reason_has=("from 2 to 4", "added s0, s1"),
    ),
    "grow only to a valid size": Case(
        formed(("a0", "a2"), epoch=3, others=spares("s0")),
        Kind.NONE,
        settings=S(must_divide=8),
        reason_has=("healthy",),
    ),
    "grow partly": Case(
        formed(("a0", "a2"), epoch=3, others=spares("s0")),
        Kind.GROW,
        ("a0", "a2", "s0"),
        reason_has=("from 2 to 3", "added s0"),
    ),
    "no grow from spares that are not alive": Case(
        formed(("a0", "a2"), epoch=3, others=spares("s0", "s1", state=JOINING)),
        Kind.NONE,
    ),
    "no grow at full size": Case(formed(FOUR, others=spares("s0", "s1")), Kind.NONE),
    # ---- wait and halt -------------------------------------------------------------------------
    "wait below the minimum": Case(
        formed(FOUR, states={"a0": DEAD, "a1": DEAD}),
        Kind.WAIT,
        settings=S(min_world_size=3),
        reason_has=("a0 dead", "a1 dead", "minimum is 3", "30s"),
    ),
    "keep waiting within max_wait_s": Case(
        formed(FOUR, states={"a0": DEAD, "a1": DEAD}, waiting_since=80.0),
        Kind.NONE,
        settings=S(min_world_size=3),
        now=109.5,
        reason_has=("waiting", "29.5s of 30s"),
    ),
    "halt once max_wait_s ran out": Case(
        formed(FOUR, states={"a0": DEAD, "a1": DEAD}, waiting_since=70.0),
        Kind.HALT,
        settings=S(min_world_size=3),
        now=100.0,
        reason_has=("waited 30.0s", "2 host(s) up", "minimum is 3"),
    ),
    "a spare ends the wait": Case(
        formed(FOUR, states={"a0": DEAD, "a1": DEAD}, waiting_since=10.0, others=spares("s0")),
        Kind.SHRINK,
        ("a2", "a3", "s0"),
        settings=S(min_world_size=3),
    ),
    "halted job stays halted": Case(
        formed((), epoch=7, halted=True, others=spares("s0", "s1", "s2", "s3")),
        Kind.NONE,
        reason_has=("halted",),
    ),
    "rank 0 found the address taken": Case(
        replace(formed(FOUR, epoch=5, restore_step=12, others=spares("s0")), address_refused_epoch=5),
        Kind.READDRESS,
        FOUR,
        restore_step=12,
        reason_has=("taken on a0",),
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_plan(case: Case) -> None:
    decision = plan(case.now, case.state, seen(case.steps), case.settings)

    assert decision.kind is case.kind, decision.reason
    assert decision.hosts == case.hosts
    if case.restore_step is not None:
        assert decision.restore_step == case.restore_step
    for part in case.reason_has:
        assert part in decision.reason


def _changed(before: Member, after: Member) -> bool:
    return (before.rank, before.role) != (after.rank, after.role)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_plan_events(case: Case) -> None:
    state = case.state
    decision = plan(case.now, state, seen(case.steps), case.settings)
    events = plan_events(case.now, state, decision, case.settings, job_id="job-1")
    after = replay(events, state)

    if decision.kind is Kind.NONE:
        assert events == []
        return
    if decision.kind is Kind.WAIT:
        assert [e.type for e in events] == [EventType.JOB_WAITING]
        assert events[0].epoch == state.epoch
        assert events[0].reason == decision.reason
        assert after.waiting_since == case.now
        assert after.topology == state.topology
        return

    *assigned, final = events
    assert all(e.type is EventType.MEMBER_ASSIGNED and e.epoch == state.epoch for e in assigned)
    assert final.epoch == state.epoch + 1
    assert final.topology is not None and final.topology.epoch == state.epoch + 1
    assert final.topology.job_id == "job-1"
    assert final.reason == decision.reason == final.topology.reason
    assert final.details["decision"] == decision.kind.value
    assert after.epoch == state.epoch + 1
    assert after.waiting_since is None and after.acks == {}

    # Exactly the members whose rank or role changed get a MEMBER_ASSIGNED, once each, with the
    # incarnation they have now.
    changed = {h for h, m in after.members.items() if _changed(state.members[h], m)}
    assert sorted(e.host_id for e in assigned) == sorted(changed)
    for e in assigned:
        assert e.member is not None and e.incarnation == state.members[e.host_id].incarnation
        assert e.member.state is state.members[e.host_id].state
        assert f"epoch {final.epoch}" in e.reason

    if decision.kind is Kind.HALT:
        assert final.type is EventType.JOB_HALTED
        assert after.halted and after.topology is not None and after.topology.members == ()
    else:
        assert final.type is EventType.TOPOLOGY_CHANGED
        assert after.topology is not None and not after.halted
        assert after.topology.host_ids == decision.hosts
        assert [m.rank for m in after.topology.members] == list(range(len(decision.hosts)))
        assert after.topology.restore_step == decision.restore_step

    # Member records agree with the new topology.
    topology = after.topology
    assert topology is not None
    for h, m in after.members.items():
        rank = topology.rank_of(h)
        assert m.rank == rank
        if rank >= 0:
            assert m.role is Role.ACTIVE
        elif decision.kind is Kind.FORM:
            assert m.role is state.members[h].role  # extra actives and spares stay as they were
        else:
            assert m.role is Role.SPARE

    # Observe, plan, commit: planning again from the result changes nothing.
    assert plan(case.now, after, seen(case.steps), case.settings).kind is Kind.NONE


def test_a_new_topology_records_how_far_the_epoch_it_replaces_got() -> None:
    state = formed(FOUR, epoch=3, states={"a1": DEAD}, others=spares("s0"))
    steps = {"a0": 40, "a1": 44, "a2": 41, "a3": 39}
    # The furthest member (the dead one included: its steps were trained, then lost).
    assert plan(50.0, state, seen(steps), S()).details == {"reached_step": "44"}
    # Every member registered again (a whole-job restart) and reports -1: the step the caller
    # tracked for the epoch says it; the furthest of the two wins.
    restarted = {h: -1 for h in FOUR}
    assert plan(50.0, state, seen(restarted, reached=52), S()).details == {"reached_step": "52"}
    assert plan(50.0, state, seen(steps, reached=12), S()).details == {"reached_step": "44"}
    assert plan(50.0, state, seen(restarted), S()).details == {"reached_step": "-1"}  # nobody knows


def test_every_topology_carries_when_the_job_formed_and_the_recoveries_since() -> None:
    """What the trainers' cadence reads as the job's observed failure rate."""

    def next_topology(now: float, state: ClusterState, observed: Observations) -> Topology:
        decision = plan(now, state, observed, S())
        (topology,) = [e.topology for e in plan_events(now, state, decision, S()) if e.topology]
        return topology

    first = next_topology(10.0, unformed(*actives(*FOUR)), seen())
    assert (first.formed_at, first.recoveries) == (10.0, 0)
    lost = formed(FOUR, states={"a1": DEAD}, others=spares("s0"))
    lost = replace(lost, topology=replace(lost.topology, formed_at=10.0, recoveries=0))
    replaced = next_topology(70.0, lost, seen(STEPS_41))
    assert (replaced.formed_at, replaced.recoveries) == (10.0, 1)
    # Growing back is no failure; a re-formed epoch (a collective failed) is one.
    grown = formed(("a0", "a1"), others=spares("s0"))
    grown = replace(grown, topology=replace(grown.topology, formed_at=10.0, recoveries=1))
    assert next_topology(90.0, grown, seen()).recoveries == 1
    reformed = formed(FOUR, epoch=3)
    reformed = replace(reformed, topology=replace(reformed.topology, formed_at=10.0, recoveries=1))
    assert next_topology(100.0, reformed, seen(STEPS_41, **failed(3, 99.9, 4))).recoveries == 2


def test_a_job_whose_every_member_was_lost_still_restores_what_it_completed() -> None:
    """A job of one whose trainer died: its host registered again as a spare and takes its rank
    back. No member survived to report a step, yet the job completed some: the new epoch must not
    say -1 ("start from scratch"), or the trainer would skip the snapshot its predecessor left."""
    state = formed(("a0",), states={"a0": ALIVE}, restore_step=-1)
    state = ClusterState(
        {"a0": member("a0", ALIVE, incarnation=2)}, state.topology, None, state.live_epoch, state.acks
    )
    decision = plan(20.0, state, seen({"a0": -1}, reached=17), S(world_size=1))
    assert (decision.kind, decision.hosts, decision.restore_step) == (Kind.REPLACE, ("a0",), 17)
    # With a survivor that reported, its step decides, as before.
    two = formed(("a0", "a1"), states={"a1": DEAD}, others=spares("s0"), restore_step=5)
    assert plan(20.0, two, seen({"a0": 9, "a1": 12}, reached=12), S(world_size=2)).restore_step == 9
    # Nobody knows of a step: what the last topology said stays.
    assert plan(20.0, state, seen({"a0": -1}), S(world_size=1)).restore_step == -1


def test_new_epoch_is_old_plus_one_and_survivors_keep_their_ranks() -> None:
    state = formed(FOUR, epoch=9, states={"a2": DEAD}, others=spares("s0", "s1"))
    decision = plan(50.0, state, seen({"a0": 4, "a1": 4, "a3": 4}), S())
    events = plan_events(50.0, state, decision, S())
    after = replay(events, state)

    assert after.epoch == 10
    assert after.topology is not None
    for h in ("a0", "a1", "a3"):
        assert after.topology.rank_of(h) == state.members[h].rank
    assert after.topology.rank_of("s0") == 2
    assert after.topology.world_size == 4
    assert after.topology.restore_step == 4
    assigned = {e.host_id: e.member for e in events if e.type is EventType.MEMBER_ASSIGNED}
    assert set(assigned) == {"a2", "s0"}
    assert assigned["s0"] is not None and (assigned["s0"].rank, assigned["s0"].role) == (2, Role.ACTIVE)
    assert assigned["a2"] is not None and (assigned["a2"].rank, assigned["a2"].role) == (-1, Role.SPARE)
    assert assigned["a2"].state is DEAD


def test_form_topology_fields() -> None:
    ms = [
        member("a0", role=Role.ACTIVE, devices=8),
        member("a1", role=Role.ACTIVE, devices=4),
        member("a2", role=Role.ACTIVE, devices=8),
    ]
    settings = PlannerSettings(world_size=3, jax_port_base=40000, jax_port_span=100)
    state = unformed(*ms)
    decision = plan(3.0, state, seen(), settings)
    events = plan_events(3.0, state, decision, settings, "job-x")
    topology = events[-1].topology

    assert topology is not None
    assert topology.epoch == 1
    assert topology.created_at == 3.0
    assert topology.mesh_shape == (3, 4)  # the smallest host decides the device axis
    assert topology.jax_coordinator_address == f"{ms[0].address}:{settings.jax_port('job-x', 1)}"
    assert topology.members == tuple(
        TopologyMember(m.host_id, r, m.device_count, m.address) for r, m in enumerate(ms)
    )
    assert [e.host_id for e in events[:-1]] == ["a0", "a1", "a2"]


def test_jax_port_moves_with_the_epoch_and_wraps_within_the_span() -> None:
    settings = PlannerSettings(world_size=2, jax_port_base=40000, jax_port_span=10)
    ports = [settings.jax_port("job-a", epoch) for epoch in range(1, 21)]
    assert all(40000 <= p < 40010 for p in ports)
    assert all(b == (a + 1 if a < 40009 else 40000) for a, b in itertools.pairwise(ports))
    state = formed(("a0", "a1"), epoch=19, states={"a1": DEAD}, others=spares("s0"))
    events = plan_events(2.0, state, plan(2.0, state, seen(), settings), settings, "job-a")
    topology = events[-1].topology
    assert topology is not None
    assert topology.jax_coordinator_address.endswith(f":{settings.jax_port('job-a', 20)}")


def test_jobs_sharing_a_host_start_on_different_ports() -> None:
    settings = PlannerSettings()
    first = {settings.jax_port(f"job-{i}", 1) for i in range(20)}
    assert len(first) > 10  # spread by the job id, not all on one port
    assert all(28000 <= p < 29000 for p in first)  # below Linux's ephemeral ports


def test_a_refused_address_moves_the_same_members_to_a_new_epoch() -> None:
    state = replace(formed(FOUR, epoch=3, restore_step=40), address_refused_epoch=3)
    decision = plan(1.0, state, seen({"a0": 41, "a1": 41, "a2": 41, "a3": 41}), S())
    assert decision.kind is Kind.READDRESS
    assert decision.hosts == FOUR
    assert decision.restore_step == 40  # nobody trained in the refused epoch
    topology = plan_events(1.0, state, decision, S())[-1].topology
    assert topology is not None and topology.epoch == 4
    assert topology.jax_coordinator_address != state.topology.jax_coordinator_address  # type: ignore[union-attr]


def test_a_refused_address_of_an_older_epoch_changes_nothing() -> None:
    state = replace(formed(FOUR, epoch=3), address_refused_epoch=2)
    assert plan(1.0, state, seen(), S()).kind is Kind.NONE


def test_a_lost_member_is_replaced_even_when_the_address_was_refused() -> None:
    state = replace(formed(FOUR, epoch=3, states={"a2": DEAD}, others=spares("s0")), address_refused_epoch=3)
    decision = plan(2.0, state, seen(), S())
    assert decision.kind is Kind.REPLACE
    assert decision.hosts == ("a0", "a1", "s0", "a3")


STEPS_41 = dict.fromkeys(FOUR, 41)


def test_a_collective_every_member_says_failed_forms_the_same_members_again_at_once() -> None:
    state = formed(FOUR, epoch=3, restore_step=40)
    decision = plan(10.0, state, seen(STEPS_41, **failed(3, since=9.9, reported=4)), S())
    assert decision.kind is Kind.REFORM, decision.reason
    assert decision.hosts == FOUR
    assert decision.restore_step == 41  # the newest step every member completed
    assert "every member" in decision.reason
    topology = plan_events(10.0, state, decision, S())[-1].topology
    assert topology is not None and topology.epoch == 4 and topology.host_ids == FOUR


def test_a_collective_some_members_say_failed_is_held_for_the_detection_window_then_reformed() -> None:
    settings = S()
    state = formed(FOUR, epoch=3, restore_step=40)
    broken = failed(3, since=10.0, reported=3)  # a3 said nothing (yet)
    held = plan(10.0 + settings.reform_after_s - 0.1, state, seen(STEPS_41, **broken), settings)
    assert held.kind is Kind.HOLD, held.reason
    assert "3 of 4" in held.reason
    after = plan(10.0 + settings.reform_after_s, state, seen(STEPS_41, **broken), settings)
    assert after.kind is Kind.REFORM, after.reason
    assert after.hosts == FOUR
    assert "none was lost" in after.reason


def test_a_suspect_member_holds_a_reform_longer_for_its_verdict() -> None:
    settings = S()
    state = formed(FOUR, epoch=3, states={"a2": SUSPECT})
    broken = failed(3, since=10.0, reported=3)
    at = 10.0 + settings.reform_after_s
    assert plan(at, state, seen(STEPS_41, **broken), settings).kind is Kind.HOLD
    assert plan(at + settings.suspect_hold_s, state, seen(STEPS_41, **broken), settings).kind is Kind.REFORM


def test_a_member_lost_after_a_failed_collective_is_replaced_not_reformed() -> None:
    state = formed(FOUR, epoch=3, states={"a2": DEAD}, others=spares("s0"))
    decision = plan(20.0, state, seen(STEPS_41, **failed(3, since=10.0, reported=3)), S())
    assert decision.kind is Kind.REPLACE
    assert decision.hosts == ("a0", "a1", "s0", "a3")


def test_reports_of_a_failed_collective_in_an_older_epoch_change_nothing() -> None:
    state = formed(FOUR, epoch=3)
    assert plan(20.0, state, seen(STEPS_41, **failed(2, since=10.0, reported=4)), S()).kind is Kind.NONE


def test_a_reform_takes_in_the_spares_a_shrunk_job_can_grow_by() -> None:
    state = formed(("a0", "a1"), epoch=3, others=spares("s0", "s1"))
    decision = plan(20.0, state, seen({"a0": 5, "a1": 5}, **failed(3, since=19.0, reported=2)), S())
    assert decision.kind is Kind.REFORM
    assert decision.hosts == ("a0", "a1", "s0", "s1")


def test_hosts_re_formed_without_progress_too_often_halt_instead_of_forming_again() -> None:
    settings = S()
    state = formed(FOUR, epoch=9, restore_step=41)
    again = plan(20.0, state, seen(STEPS_41, **failed(9, 19.0, 4, settings.max_futile_reforms - 1)), settings)
    assert again.kind is Kind.REFORM
    halted = plan(20.0, state, seen(STEPS_41, **failed(9, 19.0, 4, settings.max_futile_reforms)), settings)
    assert halted.kind is Kind.HALT
    assert "fails every time" in halted.reason and "since step 41" in halted.reason
    assert "a0, a1, a2, a3" in halted.reason


def test_halt_event_carries_an_empty_final_topology() -> None:
    state = formed(
        FOUR, epoch=4, states={"a0": DEAD, "a1": DEAD, "a2": DEAD}, waiting_since=0.0, restore_step=33
    )
    settings = S(min_world_size=2, max_wait_s=5.0)
    decision = plan(5.0, state, seen(), settings)
    events = plan_events(5.0, state, decision, settings)

    assert decision.kind is Kind.HALT
    final = events[-1]
    assert final.type is EventType.JOB_HALTED and final.epoch == 5
    assert final.topology is not None
    assert final.topology.halted and final.topology.members == () and final.topology.restore_step == 33
    assert {e.host_id for e in events[:-1]} == set(FOUR)
    halted = replay(events, state)
    assert plan(1e9, halted, seen(), settings) == Decision(Kind.NONE, f"job halted: {decision.reason}")


def test_wait_then_halt_uses_time_since_waiting_began() -> None:
    settings = S(min_world_size=4, max_wait_s=10.0)
    state = formed(FOUR, states={"a3": DEAD})

    wait = plan(100.0, state, seen(), settings)
    assert wait.kind is Kind.WAIT
    state = replay(plan_events(100.0, state, wait, settings), state)
    assert state.waiting_since == 100.0

    # The clock, not the number of calls, decides: far from the start of the wait nothing happens...
    for now in (100.0, 105.0, 109.99):
        assert plan(now, state, seen(), settings).kind is Kind.NONE
    # ...and from max_wait_s on, the job halts.
    assert plan(110.0, state, seen(), settings).kind is Kind.HALT


def test_spare_after_wait_clears_the_wait() -> None:
    settings = S(min_world_size=4)
    state = formed(FOUR, states={"a3": DEAD}, waiting_since=100.0, others=spares("s0"))
    decision = plan(101.0, state, seen(), settings)
    after = replay(plan_events(101.0, state, decision, settings), state)
    assert decision.kind is Kind.REPLACE
    assert after.waiting_since is None


def test_plan_events_for_none_is_empty() -> None:
    state = formed(FOUR)
    assert plan_events(1.0, state, Decision(Kind.NONE, "topology healthy"), S()) == []


@pytest.mark.parametrize(
    ("ids", "ordered"),
    [
        (["h10", "h2", "h1"], ["h1", "h2", "h10"]),
        (["rack2-h10", "rack10-h1", "rack2-h9"], ["rack2-h9", "rack2-h10", "rack10-h1"]),
        (["b", "a", "a1"], ["a", "a1", "b"]),
    ],
)
def test_natural_key(ids: list[str], ordered: list[str]) -> None:
    assert sorted(ids, key=natural_key) == ordered


def _types(events: Sequence[Event]) -> list[EventType]:
    return [e.type for e in events]


def test_rejoined_spare_counts_as_lost_in_its_old_topology() -> None:
    """A dead member that registers again while the job waits is a new process: it needs a new epoch.

    It comes back as a spare (rank -1) but is still listed in the waiting topology, so the planner must
    not count it as a survivor; it may take a rank again, in a new epoch.
    """
    settings = S(world_size=2, min_world_size=2)
    state = formed(("a0", "a1"), states={"a1": DEAD})
    state = replay(plan_events(10.0, state, plan(10.0, state, seen(), settings), settings), state)
    assert state.waiting_since == 10.0

    back = member("a1", ALIVE, incarnation=2)  # what register + heartbeat leave behind
    state = ClusterState({**state.members, "a1": back}, state.topology, state.waiting_since, state.live_epoch)
    decision = plan(11.0, state, seen(), settings)
    events = plan_events(11.0, state, decision, settings)
    after = replay(events, state)

    assert decision.kind is Kind.REPLACE, decision.reason
    assert decision.hosts == ("a0", "a1")
    assert _types(events)[-1] is EventType.TOPOLOGY_CHANGED
    assert after.epoch == 2 and after.waiting_since is None
    assert (after.members["a1"].rank, after.members["a1"].role) == (1, Role.ACTIVE)


# ---- each rule on its own ------------------------------------------------------------------------
#
# A rule applies where its guard clauses say (a Decision), and nowhere else (None), whatever the
# rules before it would have decided: ``plan`` tries them in order, so their order is their precedence.

SUSPECT_A2 = {"a2": SUSPECT}


@dataclass(frozen=True)
class RuleCase:
    rule: str
    state: ClusterState
    kind: Kind | None
    seen: Observations = field(default_factory=Observations)
    now: float = 100.0
    settings: PlannerSettings = field(default_factory=S)
    reason_has: tuple[str, ...] = ()


def just_lost(state: ClusterState, at: float) -> ClusterState:
    """``state`` with its dead and suspect members changed at ``at``."""
    changed = {h: replace(m, updated_at=at) for h, m in state.members.items() if m.state in (DEAD, SUSPECT)}
    return replace(state, members={**state.members, **changed})


RULE_CASES = {
    "halted: a halted job stays halted": RuleCase(
        "halted", formed((), epoch=7, halted=True), Kind.NONE, reason_has=("job halted",)
    ),
    "halted: not a running job": RuleCase("halted", formed(FOUR), None),
    "finished: a finished job does nothing more": RuleCase(
        "finished", replace(formed(FOUR), finished_step=40), Kind.NONE, reason_has=("finished at step 40",)
    ),
    "finished: not a running job": RuleCase("finished", formed(FOUR), None),
    "state_lost: a member of the running epoch found no state": RuleCase(
        "state_lost",
        formed(FOUR, epoch=3, restore_step=17),
        Kind.HALT,
        seen(lost_state=StateLost(3, "a1", "no tier holds step 17")),
        reason_has=("no tier holds any step", "completed step 17", "a1 reported: no tier holds step 17"),
    ),
    "state_lost: of an older epoch": RuleCase(
        "state_lost", formed(FOUR, epoch=3), None, seen(lost_state=StateLost(2, "a1", "x"))
    ),
    "state_lost: nobody lost state": RuleCase("state_lost", formed(FOUR), None),
    "crash_loop: the same error again, past the budget, with no step since": RuleCase(
        "crash_loop",
        formed(FOUR, epoch=4, states={"a1": DEAD}, others=spares("s0"), restore_step=7),
        Kind.HALT,
        seen(
            STEPS_41,
            crash=Crash(4, "a1", "trainer_exited: exit code 1 (trainer-error: ValueError: bad)"),
            crash_loop=CrashLoop(
                "trainer_exited: exit code 1 (trainer-error: ValueError: bad)", 41, ("a2", "s1")
            ),
        ),
        reason_has=("3 trainer failures in a row", "a2, s1, a1", "ValueError: bad", "follows the job"),
    ),
    "crash_loop: within the budget": RuleCase(
        "crash_loop",
        formed(FOUR, epoch=4, states={"a1": DEAD}, others=spares("s0")),
        None,
        seen(STEPS_41, crash=Crash(4, "a1", "e"), crash_loop=CrashLoop("e", 41, ("a2",))),
    ),
    "crash_loop: a step completed since the row began": RuleCase(
        "crash_loop",
        formed(FOUR, epoch=4, states={"a1": DEAD}, others=spares("s0")),
        None,
        seen(STEPS_41, crash=Crash(4, "a1", "e"), crash_loop=CrashLoop("e", 30, ("a2", "s1"))),
    ),
    "crash_loop: another error": RuleCase(
        "crash_loop",
        formed(FOUR, epoch=4, states={"a1": DEAD}, others=spares("s0")),
        None,
        seen(STEPS_41, crash=Crash(4, "a1", "other"), crash_loop=CrashLoop("e", 41, ("a2", "s1"))),
    ),
    "crash_loop: a crash of an older epoch": RuleCase(
        "crash_loop",
        formed(FOUR, epoch=4, states={"a1": DEAD}, others=spares("s0")),
        None,
        seen(STEPS_41, crash=Crash(3, "a1", "e"), crash_loop=CrashLoop("e", 41, ("a2", "s1"))),
    ),
    "crash_loop: a budget of none halts at the first failure": RuleCase(
        "crash_loop",
        formed(FOUR, epoch=4, states={"a1": DEAD}, others=spares("s0")),
        Kind.HALT,
        seen(STEPS_41, crash=Crash(4, "a1", "e")),
        settings=replace(S(), max_repeated_crashes=0),
        reason_has=("1 trainer failure in a row", "on a1"),
    ),
    "form: below the world size": RuleCase(
        "form", unformed(*actives("a0", "a1", "a2")), Kind.NONE, reason_has=("3 of 4",)
    ),
    "form: the first epoch": RuleCase(
        "form", unformed(*actives(*FOUR), *spares("s0")), Kind.FORM, reason_has=("formed with 4 hosts",)
    ),
    "form: formed already": RuleCase("form", formed(FOUR), None),
    "readdress: the port was taken": RuleCase(
        "readdress", replace(formed(FOUR, epoch=5), address_refused_epoch=5), Kind.READDRESS
    ),
    "readdress: of an older epoch": RuleCase(
        "readdress", replace(formed(FOUR, epoch=5), address_refused_epoch=4), None
    ),
    "readdress: a member is lost": RuleCase(
        "readdress", replace(formed(FOUR, epoch=5, states={"a1": DEAD}), address_refused_epoch=5), None
    ),
    "reform: every member said so": RuleCase(
        "reform", formed(FOUR, epoch=3), Kind.REFORM, seen(STEPS_41, **failed(3, 99.9, 4))
    ),
    "reform: some said so, within the window": RuleCase(
        "reform",
        formed(FOUR, epoch=3),
        Kind.HOLD,
        seen(STEPS_41, **failed(3, 99.9, 3)),
        reason_has=("3 of 4",),
    ),
    "reform: some said so, and a suspect holds it longer": RuleCase(
        "reform",
        formed(FOUR, epoch=3, states=SUSPECT_A2),
        Kind.HOLD,
        seen(STEPS_41, **failed(3, 100.0 - S().reform_after_s, 3)),
    ),
    "reform: some said so, and the window passed": RuleCase(
        "reform",
        formed(FOUR, epoch=3),
        Kind.REFORM,
        seen(STEPS_41, **failed(3, 100.0 - S().reform_after_s, 3)),
        reason_has=("none was lost",),
    ),
    "reform: the same hosts failed too often": RuleCase(
        "reform",
        formed(FOUR, epoch=3),
        Kind.HALT,
        seen(STEPS_41, **failed(3, 99.9, 4, futile=S().max_futile_reforms)),
        reason_has=("fails every time",),
    ),
    "reform: of an older epoch": RuleCase("reform", formed(FOUR, epoch=3), None, seen(**failed(2, 99.0, 4))),
    "reform: a member is lost": RuleCase(
        "reform", formed(FOUR, epoch=3, states={"a1": DEAD}), None, seen(**failed(3, 99.0, 3))
    ),
    "grow: spares for a job below its size": RuleCase(
        "grow", formed(("a0", "a1"), others=spares("s0")), Kind.GROW, reason_has=("from 2 to 3",)
    ),
    "grow: healthy at its size": RuleCase("grow", formed(FOUR, others=spares("s0")), Kind.NONE),
    "grow: a member is lost": RuleCase("grow", formed(FOUR, states={"a1": DEAD}), None),
    "grow: not formed": RuleCase("grow", unformed(*actives(*FOUR)), None),
    "hold_burst: a loss a moment ago": RuleCase(
        "hold_burst",
        just_lost(formed(FOUR, states={"a1": DEAD}, others=spares("s0")), 99.95),
        Kind.HOLD,
        reason_has=("collecting the burst",),
    ),
    "hold_burst: a loss while another member is suspect": RuleCase(
        "hold_burst",
        just_lost(formed(FOUR, states={"a1": DEAD, "a2": SUSPECT}, others=spares("s0")), 99.7),
        Kind.HOLD,
        reason_has=("a2 suspect",),
    ),
    "hold_burst: the burst is over": RuleCase(
        "hold_burst", formed(FOUR, states={"a1": DEAD}, others=spares("s0")), None
    ),
    "hold_burst: the job waits already": RuleCase(
        "hold_burst", just_lost(formed(FOUR, states={"a1": DEAD}, waiting_since=99.0), 99.95), None
    ),
    "hold_burst: nothing lost": RuleCase("hold_burst", formed(FOUR), None),
    "replace_lost: a spare per lost member": RuleCase(
        "replace_lost",
        formed(FOUR, states={"a1": DEAD}, others=spares("s0")),
        Kind.REPLACE,
        reason_has=("s0 takes rank 1 of a1",),
    ),
    "replace_lost: too few spares": RuleCase(
        "replace_lost", formed(FOUR, states={"a1": DEAD, "a2": DEAD}, others=spares("s0")), None
    ),
    "replace_lost: nothing lost": RuleCase("replace_lost", formed(FOUR, others=spares("s0")), None),
    "shrink: survivors and spares above the minimum": RuleCase(
        "shrink", formed(FOUR, states={"a1": DEAD}), Kind.SHRINK, reason_has=("from 4 to 3",)
    ),
    "shrink: below the minimum": RuleCase(
        "shrink", formed(FOUR, states={"a1": DEAD}), None, settings=S(min_world_size=4)
    ),
    "shrink: nothing lost": RuleCase("shrink", formed(FOUR), None),
    "wait: below the minimum": RuleCase(
        "wait", formed(FOUR, states={"a1": DEAD}), Kind.WAIT, settings=S(min_world_size=4)
    ),
    "wait: within max_wait_s": RuleCase(
        "wait", formed(FOUR, states={"a1": DEAD}, waiting_since=90.0), Kind.NONE, settings=S(min_world_size=4)
    ),
    "wait: max_wait_s ran out": RuleCase(
        "wait",
        formed(FOUR, states={"a1": DEAD}, waiting_since=60.0),
        Kind.HALT,
        settings=S(min_world_size=4),
        reason_has=("waited 40.0s",),
    ),
    "wait: nothing lost": RuleCase("wait", formed(FOUR), None),
}


@pytest.mark.parametrize("case", RULE_CASES.values(), ids=RULE_CASES.keys())
def test_each_rule_applies_where_it_says_and_nowhere_else(case: RuleCase) -> None:
    (rule,) = [r for r in RULES if r.__name__ == case.rule]
    decision = rule(Situation(case.now, case.state, case.seen, case.settings))
    assert (decision.kind if decision is not None else None) is case.kind, decision
    for part in case.reason_has:
        assert decision is not None and part in decision.reason, decision.reason


def test_the_rules_are_tried_in_the_order_of_their_precedence() -> None:
    assert [r.__name__ for r in RULES] == [
        "halted",
        "finished",
        "state_lost",
        "crash_loop",
        "form",
        "readdress",
        "reform",
        "grow",
        "hold_burst",
        "replace_lost",
        "shrink",
        "wait",
    ]
    assert all(r.__doc__ for r in RULES)  # each says when it applies
    # A lost state halts the job before anything else is planned for it, a lost member included.
    state = formed(FOUR, epoch=3, states={"a1": DEAD}, others=spares("s0"))
    assert plan(100.0, state, seen(lost_state=StateLost(3, "a2", "gone")), S()).kind is Kind.HALT


def test_a_rule_added_to_the_list_decides_where_its_place_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new rule takes: one function and one entry."""
    import remesh.coordinator.planner as planner

    def halt_at_five(s: Situation) -> Decision | None:
        """Halts every job at time 5.0."""
        return Decision(Kind.HALT, "it is 5.0") if s.now == 5.0 else None

    monkeypatch.setattr(planner, "RULES", (*RULES[:3], halt_at_five, *RULES[3:]))
    state = formed(FOUR, states={"a1": DEAD}, others=spares("s0"))
    assert plan(5.0, state, seen(), S()) == Decision(Kind.HALT, "it is 5.0")
    assert plan(6.0, state, seen(), S()).kind is Kind.REPLACE
    assert plan(5.0, replace(state, finished_step=9), seen(), S()).kind is Kind.NONE  # after `finished`

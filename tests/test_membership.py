"""Tests of the member state machine (``membership``) and the failure detector (``detector.judge``).

Pure functions only: states are built in memory, the clock is a number, nothing sleeps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import pytest

from remesh.coordinator import membership, observations
from remesh.coordinator.detector import Liveness, judge
from remesh.coordinator.errors import CoordinatorError, InvalidRequest, NotFound, Rejected
from remesh.coordinator.membership import FaultKind
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
from remesh.coordinator.observations import Observations
from remesh.coordinator.planner import Kind, plan, plan_events
from remesh.coordinator.settings import DetectorSettings, PlannerSettings

ALIVE = MemberState.ALIVE
DEAD = MemberState.DEAD
SUSPECT = MemberState.SUSPECT
JOINING = MemberState.JOINING
LEFT = MemberState.LEFT
DRAINING = MemberState.DRAINING


def member(
    host: str, state: MemberState = ALIVE, *, role: Role = Role.ACTIVE, rank: int = -1, inc: int = 1
) -> Member:
    return Member(host, inc, role, state, device_count=2, address=f"{host}.local", rank=rank, reason="seeded")


def job(
    hosts: Sequence[str] = ("a0", "a1", "a2"),
    *,
    epoch: int = 3,
    states: Mapping[str, MemberState] | None = None,
    spares: Sequence[str] = ("s0",),
    incarnation: int = 1,
    acks: Mapping[str, int] | None = None,
    halted: bool = False,
) -> ClusterState:
    """A formed job: ``hosts`` at ranks 0.. in ``epoch``, plus alive spares."""
    states = states or {}
    ms = [member(h, states.get(h, ALIVE), rank=r, inc=incarnation) for r, h in enumerate(hosts)]
    ms += [member(s, role=Role.SPARE, inc=incarnation) for s in spares]
    topology = Topology(
        epoch=epoch,
        members=tuple(TopologyMember(h, r, 2, f"{h}.local") for r, h in enumerate(hosts)),
        mesh_shape=(len(hosts), 2),
        jax_coordinator_address="a0.local:47003",
        restore_step=-1,
        reason="seeded",
        created_at=0.0,
        halted=halted,
    )
    return ClusterState(
        members={m.host_id: m for m in ms}, topology=topology, live_epoch=epoch - 1, acks=dict(acks or {})
    )


NOW = 50.0
# Planner settings below plan a loss at the moment it happens (no burst window): these tests are about
# the transitions, the window has its own (tests/test_reliability_core.py).


def one(events: Sequence[Event]) -> Event:
    assert len(events) == 1, events
    return events[0]


# ---- guards shared by every input ------------------------------------------------------------------

Op = Callable[[ClusterState, str, int], object]

OPS: dict[str, Op] = {
    "register": lambda s, h, i: membership.register(NOW, s, h, Role.ACTIVE, 1, "addr"),
    "heartbeat": lambda s, h, i: membership.heartbeat(NOW, s, h, i),
    "leave": lambda s, h, i: membership.leave(NOW, s, h, i, "bye"),
    "drain": lambda s, h, i: membership.drain(NOW, s, h, "maintenance"),
    "report_fault": lambda s, h, i: membership.report_fault(NOW, s, h, i, FaultKind.TRAINER_EXITED, 3, 1, ""),
    "ack_epoch": lambda s, h, i: membership.ack_epoch(NOW, s, h, i, 3, 10, "memory", {}),
}

BAD_IDS = {
    "empty": "",
    "too long": "h" * 129,
    "space": "host 1",
    "slash": "rack/host",
    "leading dash": "-host",
    "leading dot": ".host",
    "non-ascii": "hôst",
    "newline": "host\n",
}


@pytest.mark.parametrize("op", OPS.values(), ids=OPS.keys())
@pytest.mark.parametrize("host_id", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_bad_host_id_is_invalid(op: Op, host_id: str) -> None:
    with pytest.raises(InvalidRequest):
        op(job(), host_id, 1)


@pytest.mark.parametrize("host_id", ["h", "host-1", "rack2.host_3:0", "A" * 128, "9"])
def test_good_host_ids_pass(host_id: str) -> None:
    membership.validate_host_id(host_id, 128)


def test_host_id_limit_is_a_setting() -> None:
    with pytest.raises(InvalidRequest, match="limit is 4"):
        membership.register(NOW, ClusterState(), "hosts", Role.ACTIVE, 1, "", max_length=4)


@pytest.mark.parametrize(
    "op", [v for k, v in OPS.items() if k != "register"], ids=[k for k in OPS if k != "register"]
)
def test_unknown_host_is_not_found(op: Op) -> None:
    with pytest.raises(NotFound, match="never registered"):
        op(job(), "nobody", 1)


INCARNATION_OPS = {k: OPS[k] for k in ("heartbeat", "leave", "report_fault", "ack_epoch")}


@pytest.mark.parametrize("op", INCARNATION_OPS.values(), ids=INCARNATION_OPS.keys())
@pytest.mark.parametrize(("incarnation", "match"), [(1, "stale incarnation"), (3, "never issued")])
def test_stale_or_future_incarnation_is_rejected(op: Op, incarnation: int, match: str) -> None:
    with pytest.raises(Rejected, match=match):
        op(job(incarnation=2), "a1", incarnation)


@pytest.mark.parametrize(
    ("device_count", "address", "match"),
    [
        (-1, "", "device_count"),
        (65537, "", "device_count"),
        (1, "x" * 256, "address"),
        (1, "10.0.0.1\x1b[2J", "address"),
        (1, "[red]host[/red]", "address"),
        (1, "host name", "address"),
    ],
)
def test_register_validates_its_fields(device_count: int, address: str, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        membership.register(NOW, ClusterState(), "h1", Role.ACTIVE, device_count, address)


@pytest.mark.parametrize(
    "call",
    [
        lambda s: membership.leave(NOW, s, "a1", 1, "r" * 1025),
        lambda s: membership.drain(NOW, s, "a1", "r" * 1025),
        lambda s: membership.report_fault(NOW, s, "a1", 1, FaultKind.HOST, 3, 1, "d" * 1025),
        lambda s: membership.ack_epoch(NOW, s, "a1", 1, 3, 0, "x" * 1025, {}),
    ],
    ids=["leave", "drain", "report_fault", "ack_epoch"],
)
def test_oversized_text_is_invalid(call: Callable[[ClusterState], object]) -> None:
    with pytest.raises(InvalidRequest, match="limit is 1024"):
        call(job())


@pytest.mark.parametrize(
    "call",
    [
        lambda s: membership.leave(NOW, s, "a1", 1, "bye\x1b]0;owned\x07"),
        lambda s: membership.drain(NOW, s, "a1", "line one\nline two"),
        lambda s: membership.report_fault(NOW, s, "a1", 1, FaultKind.HOST, 3, 1, "\x9b31m"),
    ],
    ids=["leave", "drain", "report_fault"],
)
def test_control_characters_in_text_are_invalid(call: Callable[[ClusterState], object]) -> None:
    with pytest.raises(InvalidRequest, match="control characters"):
        call(job())


@pytest.mark.parametrize(
    ("phases", "match"),
    [
        ({"restore": float("nan")}, "finite"),
        ({"restore": float("inf")}, "finite"),
        ({"restore": -1.0}, "non-negative"),
        ({"Restore Time": 1.0}, "snake_case"),
        ({f"p{i}": 1.0 for i in range(33)}, "limit is 32"),
    ],
)
def test_an_ack_with_unreasonable_phases_is_invalid(phases: dict[str, float], match: str) -> None:
    state = job(hosts=("a0", "a1"), spares=())
    with pytest.raises(InvalidRequest, match=match):
        membership.ack_epoch(NOW, state, "a1", 1, 3, 0, "memory", phases)


def test_a_host_that_keeps_coming_back_has_a_short_reason() -> None:
    """A reason quotes the one before it, never the whole history (it grew with every re-register)."""
    state = job()
    for i in range(200):
        (m,) = [m for m in state.members.values() if m.host_id == "a1"]
        state = replay(membership.declare(NOW + i, state, "a1", m.incarnation, DEAD, f"lost {i}"), state)
        events, _ = membership.register(NOW + i, state, "a1", Role.ACTIVE, 2, "a1.local")
        state = replay(events, state)
    reason = state.members["a1"].reason
    assert len(reason) < 200, reason
    assert reason.endswith("(was dead: lost 199)"), reason


# ---- register --------------------------------------------------------------------------------------


def test_first_register() -> None:
    events, m = membership.register(NOW, ClusterState(), "h1", Role.ACTIVE, 8, "10.0.0.1")
    e = one(events)
    assert e.type is EventType.MEMBER_JOINED
    assert e.member == m and e.host_id == "h1" and e.incarnation == 1 and e.epoch == 0 and e.time == NOW
    assert (m.incarnation, m.role, m.state, m.rank, m.device_count, m.address) == (
        1,
        Role.ACTIVE,
        JOINING,
        -1,
        8,
        "10.0.0.1",
    )
    assert m.updated_at == NOW


def test_register_keeps_role_before_the_job_forms() -> None:
    _, m = membership.register(NOW, ClusterState(), "s1", Role.SPARE, 1, "")
    assert m.role is Role.SPARE


def test_newcomer_after_forming_is_a_spare() -> None:
    events, m = membership.register(NOW, job(), "new", Role.ACTIVE, 2, "")
    assert one(events).type is EventType.MEMBER_JOINED
    assert (m.role, m.rank, m.state) == (Role.SPARE, -1, JOINING)


@pytest.mark.parametrize("state", [ALIVE, SUSPECT, JOINING])
def test_register_of_a_present_topology_member_keeps_its_rank(state: MemberState) -> None:
    before = job(states={"a1": state}, incarnation=4)
    events, m = membership.register(NOW, before, "a1", Role.SPARE, 8, "new-addr")
    e = one(events)

    assert e.type is EventType.MEMBER_REJOINED
    assert (m.incarnation, m.rank, m.role, m.state) == (5, 1, Role.ACTIVE, JOINING)
    assert (m.device_count, m.address) == (8, "new-addr")
    assert "keeps rank 1" in m.reason
    after = replay(events, before)
    assert after.topology == before.topology
    # Nothing for the planner to do: the epoch does not change.
    assert plan(NOW, after, Observations(), PlannerSettings(world_size=3, burst_window_s=0)).kind is Kind.NONE


def test_register_of_a_replaced_dead_host_comes_back_as_a_spare() -> None:
    settings = PlannerSettings(world_size=3, burst_window_s=0)
    state = job(spares=("s0",))
    # a1 dies; the planner gives its rank to s0.
    state = replay(membership.declare(NOW, state, "a1", 1, DEAD, "no heartbeat"), state)
    decision = plan(NOW, state, Observations(), settings)
    assert decision.kind is Kind.REPLACE
    state = replay(plan_events(NOW, state, decision, settings), state)
    assert state.topology is not None and "a1" not in state.topology.host_ids

    events, m = membership.register(NOW + 1, state, "a1", Role.ACTIVE, 2, "a1.local")
    e = one(events)
    assert e.type is EventType.MEMBER_REJOINED
    assert (m.incarnation, m.role, m.rank, m.state) == (2, Role.SPARE, -1, JOINING)
    assert "was dead" in m.reason
    after = replay(events, state)
    assert after.topology == state.topology


def test_dead_member_that_returns_while_the_job_waits_gets_a_new_epoch() -> None:
    """A member declared dead while the job waits that registers again is a new process: it takes a
    rank in a new epoch, and never counts as a survivor of the old one with a spare's record."""
    settings = PlannerSettings(world_size=2, min_world_size=2, max_wait_s=30.0, burst_window_s=0)
    state = job(("a0", "a1"), epoch=1, spares=())

    def change(now: float, events: list[Event]) -> Kind:
        nonlocal state
        after = replay(events, state)
        decision = plan(now, after, Observations(), settings)
        state = replay(plan_events(now, after, decision, settings), after)
        return decision.kind

    assert change(10.0, membership.declare(10.0, state, "a1", 1, DEAD, "gone")) is Kind.WAIT
    assert change(11.0, membership.register(11.0, state, "a1", Role.ACTIVE, 2, "a1.local")[0]) is Kind.NONE
    assert change(11.5, membership.heartbeat(11.5, state, "a1", 2)) is Kind.REPLACE

    assert state.epoch == 2 and state.waiting_since is None
    assert state.topology is not None and state.topology.host_ids == ("a0", "a1")
    assert (state.members["a1"].rank, state.members["a1"].role, state.members["a1"].incarnation) == (
        1,
        Role.ACTIVE,
        2,
    )
    # A later loss starts a fresh wait instead of halting on the old one.
    assert change(100.0, membership.declare(100.0, state, "a0", 1, DEAD, "gone")) is Kind.WAIT


@pytest.mark.parametrize("gone", [LEFT, DEAD])
def test_register_after_leaving_bumps_the_incarnation(gone: MemberState) -> None:
    state = job(states={"a2": gone}, incarnation=3)
    _, m = membership.register(NOW, state, "a2", Role.ACTIVE, 2, "")
    assert m.incarnation == 4 and m.role is Role.SPARE and m.rank == -1


def test_register_on_a_halted_job_is_rejected() -> None:
    with pytest.raises(Rejected, match="halted"):
        membership.register(NOW, job((), halted=True), "h9", Role.ACTIVE, 1, "")


# ---- heartbeat -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("state", "reason"), [(JOINING, "first heartbeat"), (SUSPECT, "refuted")])
def test_heartbeat_makes_alive(state: MemberState, reason: str) -> None:
    e = one(membership.heartbeat(NOW, job(states={"a0": state}), "a0", 1))
    assert e.type is EventType.MEMBER_ALIVE
    assert e.member is not None and e.member.state is ALIVE and e.member.rank == 0
    assert reason in e.reason


@pytest.mark.parametrize("state", [ALIVE, DRAINING])
def test_heartbeat_of_alive_or_draining_changes_nothing(state: MemberState) -> None:
    assert membership.heartbeat(NOW, job(states={"a0": state}), "a0", 1) == []


@pytest.mark.parametrize("state", [DEAD, LEFT])
def test_heartbeat_of_a_gone_member_is_rejected(state: MemberState) -> None:
    with pytest.raises(Rejected, match="register again"):
        membership.heartbeat(NOW, job(states={"a0": state}), "a0", 1)


# ---- declare (detector verdicts) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("was", "new", "type_"),
    [
        (ALIVE, SUSPECT, EventType.MEMBER_SUSPECT),
        (ALIVE, DEAD, EventType.MEMBER_DEAD),
        (SUSPECT, DEAD, EventType.MEMBER_DEAD),
        (JOINING, DEAD, EventType.MEMBER_DEAD),
        (DRAINING, DEAD, EventType.MEMBER_DEAD),
    ],
)
def test_declare(was: MemberState, new: MemberState, type_: EventType) -> None:
    e = one(membership.declare(NOW, job(states={"a1": was}), "a1", 1, new, "silent"))
    assert e.type is type_ and e.member is not None and e.member.state is new and e.member.reason == "silent"


@pytest.mark.parametrize(
    ("was", "new", "incarnation"),
    [
        (ALIVE, DEAD, 0),  # verdict about an older incarnation
        (ALIVE, DEAD, 2),
        (SUSPECT, SUSPECT, 1),  # already there
        (DEAD, DEAD, 1),
        (LEFT, DEAD, 1),
        (DEAD, SUSPECT, 1),
        (JOINING, SUSPECT, 1),  # only an alive member becomes suspect
        (DRAINING, SUSPECT, 1),
    ],
)
def test_declare_that_no_longer_applies_is_a_no_op(
    was: MemberState, new: MemberState, incarnation: int
) -> None:
    assert membership.declare(NOW, job(states={"a1": was}), "a1", incarnation, new, "x") == []


def test_declare_unknown_host_is_a_no_op() -> None:
    assert membership.declare(NOW, job(), "ghost", 1, DEAD, "x") == []


# ---- leave and drain -------------------------------------------------------------------------------


@pytest.mark.parametrize("was", [JOINING, ALIVE, SUSPECT, DRAINING])
def test_leave(was: MemberState) -> None:
    e = one(membership.leave(NOW, job(states={"a1": was}), "a1", 1, "done"))
    assert e.type is EventType.MEMBER_LEFT
    assert e.member is not None and e.member.state is LEFT and e.reason == "left: done"


def test_leave_without_reason_says_so() -> None:
    assert one(membership.leave(NOW, job(), "a1", 1, "")).reason == "left: no reason given"


@pytest.mark.parametrize("was", [LEFT, DEAD])
def test_leave_when_gone_is_a_no_op(was: MemberState) -> None:
    assert membership.leave(NOW, job(states={"a1": was}), "a1", 1, "again") == []


def test_leave_of_a_topology_member_is_replaced_by_the_planner() -> None:
    state = job()
    after = replay(membership.leave(NOW, state, "a2", 1, "bye"), state)
    decision = plan(NOW, after, Observations(), PlannerSettings(world_size=3, burst_window_s=0))
    assert decision.kind is Kind.REPLACE and decision.hosts == ("a0", "a1", "s0")
    assert "a2 left" in decision.reason


@pytest.mark.parametrize("was", [JOINING, ALIVE, SUSPECT])
def test_drain(was: MemberState) -> None:
    e = one(membership.drain(NOW, job(states={"a0": was}), "a0", "kernel upgrade"))
    assert e.type is EventType.MEMBER_DRAINING
    assert e.member is not None and e.member.state is DRAINING
    assert e.reason == "drained by an operator: kernel upgrade"


def test_drain_twice_is_a_no_op() -> None:
    assert membership.drain(NOW, job(states={"a0": DRAINING}), "a0", "again") == []


@pytest.mark.parametrize("was", [DEAD, LEFT])
def test_drain_of_a_gone_member_is_rejected(was: MemberState) -> None:
    with pytest.raises(Rejected, match="only a live member"):
        membership.drain(NOW, job(states={"a0": was}), "a0", "")


def test_drained_member_is_replaced_by_a_spare() -> None:
    state = job()
    after = replay(membership.drain(NOW, state, "a0", "upgrade"), state)
    decision = plan(NOW, after, Observations(), PlannerSettings(world_size=3, burst_window_s=0))
    assert decision.kind is Kind.REPLACE and decision.hosts == ("s0", "a1", "a2")


# ---- report_fault ----------------------------------------------------------------------------------


def fault(state: ClusterState, host: str = "a1", epoch: int = 3, detail: str = "") -> membership.FaultOutcome:
    return membership.report_fault(NOW, state, host, 1, FaultKind.TRAINER_EXITED, epoch, 134, detail)


def test_fault_of_a_healthy_epoch_is_charged_to_the_host() -> None:
    out = fault(job(), detail="segfault")
    assert out.member_dead
    assert [e.type for e in out.events] == [EventType.FAULT_REPORTED, EventType.MEMBER_DEAD]
    reported, dead = out.events
    assert reported.details == {
        "kind": "trainer_exited",
        "epoch": "3",
        "exit_code": "134",
        "detail": "segfault",
        "charged": "true",
    }
    assert dead.member is not None and dead.member.state is DEAD and "segfault" in dead.reason
    assert out.reason == reported.reason == dead.reason


def test_fault_without_detail_names_the_exit_code() -> None:
    assert "exit code 134" in fault(job()).reason


def test_fault_from_an_older_epoch_is_collateral() -> None:
    out = fault(job(epoch=3), epoch=2)
    assert not out.member_dead
    assert [e.type for e in out.events] == [EventType.FAULT_REPORTED]
    assert "collateral" in out.reason and "epoch 2" in out.reason


@pytest.mark.parametrize("other", [SUSPECT, DEAD, JOINING, DRAINING, LEFT])
def test_fault_while_another_member_is_failing_is_collateral(other: MemberState) -> None:
    out = fault(job(states={"a0": other}))
    assert not out.member_dead
    assert [e.type for e in out.events] == [EventType.FAULT_REPORTED]
    assert "collateral" in out.reason and "a0" in out.reason and "a2" not in out.reason
    # Whether or not a0 is lost in the end, a1's trainer left the running epoch (a refuted suspect
    # would otherwise leave it waiting for an epoch nobody forms).
    assert out.left_epoch


def test_a_failing_spare_does_not_make_a_fault_collateral() -> None:
    state = job()
    state = replay(membership.declare(NOW, state, "s0", 1, DEAD, "x"), state)
    assert fault(state).member_dead


@pytest.mark.parametrize("was", [DEAD, LEFT])
def test_fault_of_a_gone_member_changes_nothing_more(was: MemberState) -> None:
    out = fault(job(states={"a1": was}))
    assert not out.member_dead
    assert [e.type for e in out.events] == [EventType.FAULT_REPORTED]
    assert f"already {was.value}" in out.reason


def address_in_use(state: ClusterState, host: str = "a0", epoch: int = 3) -> membership.FaultOutcome:
    return membership.report_fault(NOW, state, host, 1, FaultKind.ADDRESS_IN_USE, epoch, 76, "")


def test_rank_0_finding_the_address_taken_refuses_the_epoch_without_blaming_the_host() -> None:
    state = job()
    out = address_in_use(state)
    assert not out.member_dead
    assert [e.type for e in out.events] == [EventType.FAULT_REPORTED]
    assert "a0.local:47003" in out.reason and "new address" in out.reason
    after = replay(out.events, state)
    assert after.address_refused_epoch == 3
    assert after.members == state.members  # nobody dead, nobody moved


@pytest.mark.parametrize(("host", "epoch"), [("a1", 3), ("a0", 2)], ids=["not rank 0", "older epoch"])
def test_address_in_use_from_another_member_or_epoch_is_ignored(host: str, epoch: int) -> None:
    state = job()
    out = address_in_use(state, host, epoch)
    assert not out.member_dead and "ignored" in out.reason
    assert replay(out.events, state).address_refused_epoch == 0


def test_a_lost_restore_step_halts_the_job_with_the_reason_and_blames_nobody() -> None:
    state = job()
    out = membership.report_fault(NOW, state, "a1", 1, FaultKind.STATE_LOST, 3, 65, "no tier holds step 17")
    assert not out.member_dead and [e.type for e in out.events] == [EventType.FAULT_REPORTED]
    # Noted with the fault (``Coordinator.report_fault``), it is what the plan of the same commit halts on.
    seen = observations.state_lost(Observations(), state, "a1", 1, 3, "no tier holds step 17")
    after_fault = replay(out.events, state)
    decision = plan(NOW, after_fault, seen, PlannerSettings())
    assert decision.kind is Kind.HALT
    assert "no tier holds any step" in decision.reason and "no tier holds step 17" in decision.reason
    halting = out.events + plan_events(NOW, after_fault, decision, PlannerSettings())
    after = replay(halting, state)
    assert after.topology is not None and after.topology.halted and after.topology.reason == decision.reason
    assert not [m for m in after.members.values() if m.state is MemberState.DEAD]


def test_a_lost_restore_step_reported_for_an_older_epoch_is_ignored() -> None:
    out = membership.report_fault(NOW, job(), "a1", 1, FaultKind.STATE_LOST, 2, 65, "")
    assert not out.member_dead and "ignored" in out.reason
    unchanged = Observations()
    assert observations.state_lost(unchanged, job(), "a1", 1, 2, "") is unchanged


@pytest.mark.parametrize(("epoch", "match"), [(-1, "negative"), (4, "never published")])
def test_fault_with_an_impossible_epoch_is_invalid(epoch: int, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        fault(job(epoch=3), epoch=epoch)


# ---- ack_epoch -------------------------------------------------------------------------------------


def ack(state: ClusterState, host: str, epoch: int = 3) -> tuple[list[Event], bool]:
    return membership.ack_epoch(NOW, state, host, 1, epoch, 17, "memory", {"restore": 0.25})


def test_epoch_goes_live_only_after_every_member_acked() -> None:
    state = job()
    for host in ("a0", "a2"):
        events, live = ack(state, host)
        assert not live
        e = one(events)
        assert e.type is EventType.EPOCH_ACKED and e.epoch == 3 and e.host_id == host
        assert e.details["restored_step"] == "17" and e.details["restore_source"] == "memory"
        state = replay(events, state)
        assert state.live_epoch == 2
    events, live = ack(state, "a1")
    assert live
    assert [e.type for e in events] == [EventType.EPOCH_ACKED, EventType.EPOCH_LIVE]
    state = replay(events, state)
    assert state.live_epoch == 3
    assert state.acks == {"a0": 3, "a1": 3, "a2": 3}


def test_an_ack_records_the_bytes_restored_per_tier() -> None:
    events, _ = membership.ack_epoch(
        NOW, job(), "a1", 1, 3, 17, "buddy+peer", {}, restored_bytes={"buddy": 900, "peer": 12}
    )
    assert one(events).details["restored_bytes"] == '{"buddy": 900, "peer": 12}'


def test_an_ack_records_how_far_the_member_got_before_the_epoch_where_it_knows() -> None:
    events, _ = membership.ack_epoch(NOW, job(), "a1", 1, 3, 17, "memory", {}, reached_step=19)
    assert one(events).details["reached_step"] == "19"
    events, _ = membership.ack_epoch(NOW, job(), "a1", 1, 3, 17, "peer", {}, reached_step=-1)  # a spare
    assert "reached_step" not in one(events).details


@pytest.mark.parametrize(
    ("tiers", "match"),
    [
        ({"buddy": -1}, "not a tier and a byte count"),
        ({"": 5}, "not a tier"),
        ({f"t{i}": 1 for i in range(17)}, "limit is 16"),
    ],
)
def test_an_ack_with_malformed_tier_bytes_is_invalid_and_changes_nothing(
    tiers: dict[str, int], match: str
) -> None:
    with pytest.raises(InvalidRequest, match=match):
        membership.ack_epoch(NOW, job(), "a1", 1, 3, 17, "memory", {}, restored_bytes=tiers)


def test_acks_of_an_older_epoch_do_not_count() -> None:
    """Every member acknowledged epoch 2; epoch 3 starts with none of them (the count of the
    acknowledgements so far is the count of the current epoch's)."""
    before = job(epoch=2, acks={"a0": 2, "a1": 2, "a2": 2})
    after = job(epoch=3)
    assert after.topology is not None
    changed = Event(EventType.TOPOLOGY_CHANGED, NOW, 3, "next", topology=after.topology)
    state = replay([changed], before)
    assert state.acks == {}
    for host in ("a0", "a2"):
        events, live = ack(state, host)
        assert not live and [e.type for e in events] == [EventType.EPOCH_ACKED]
        state = replay(events, state)
    assert ack(state, "a1")[1]


@pytest.mark.parametrize("already_live", [False, True])
def test_duplicate_ack_is_a_no_op(already_live: bool) -> None:
    state = job(acks={"a0": 3, "a1": 3, "a2": 3} if already_live else {"a0": 3})
    if already_live:
        state = replace(state, live_epoch=3)
    assert ack(state, "a0") == ([], already_live)


@pytest.mark.parametrize(("epoch", "match"), [(2, "stale epoch 2"), (4, "stale epoch 4")])
def test_ack_of_another_epoch_is_rejected(epoch: int, match: str) -> None:
    with pytest.raises(Rejected, match=match):
        ack(job(epoch=3), "a0", epoch)


def test_ack_of_a_non_member_is_rejected() -> None:
    with pytest.raises(Rejected, match="not a member"):
        ack(job(), "s0")


def test_ack_without_a_running_topology_is_rejected() -> None:
    state = ClusterState(members={"a0": member("a0")})
    with pytest.raises(Rejected, match="no running topology"):
        ack(state, "a0", 0)
    with pytest.raises(Rejected, match="no running topology"):
        ack(job((), epoch=3, halted=True, spares=("a0",)), "a0")


# ---- refused inputs never change anything ----------------------------------------------------------


def test_transitions_do_not_mutate_their_input() -> None:
    state = job(states={"a0": SUSPECT})
    snapshot = (dict(state.members), state.topology, dict(state.acks), state.live_epoch)
    membership.register(NOW, state, "a0", Role.ACTIVE, 1, "")
    membership.heartbeat(NOW, state, "a0", 1)
    membership.drain(NOW, state, "a1", "")
    membership.leave(NOW, state, "a2", 1, "")
    fault(state)
    ack(state, "a1")
    with pytest.raises(CoordinatorError):
        membership.heartbeat(NOW, state, "a0", 9)
    assert (dict(state.members), state.topology, dict(state.acks), state.live_epoch) == snapshot


# ---- detector --------------------------------------------------------------------------------------

# Binary-exact thresholds, so ``now - last_seen`` lands exactly on them.
DS = DetectorSettings(
    heartbeat_interval_s=0.125, suspect_after_s=0.25, heartbeat_timeout_s=0.5, stream_grace_s=0.125
)
T = 100.0


def verdicts(
    state: MemberState, seen: Liveness | None, *, inc: int = 1, now: float = T
) -> list[tuple[MemberState, str]]:
    cluster = ClusterState(members={"h": member("h", state, inc=inc)})
    out = judge(now, cluster, {"h": seen} if seen else {}, DS)
    for v in out:
        assert v.host_id == "h" and v.incarnation == inc
    return [(v.state, v.reason) for v in out]


@pytest.mark.parametrize(
    ("state", "silence", "expected"),
    [
        (ALIVE, 0.0, None),
        (ALIVE, 0.24, None),
        (ALIVE, 0.25, SUSPECT),
        (ALIVE, 0.49, SUSPECT),
        (ALIVE, 0.5, DEAD),
        (SUSPECT, 0.25, None),  # already suspect: nothing new until the timeout
        (SUSPECT, 0.5, DEAD),
        (JOINING, 0.25, None),  # not yet alive, so never suspect...
        (JOINING, 0.5, DEAD),  # ...but silent for the timeout is dead
        (DRAINING, 0.5, DEAD),
        (DEAD, 5.0, None),
        (LEFT, 5.0, None),
    ],
)
def test_silence(state: MemberState, silence: float, expected: MemberState | None) -> None:
    out = verdicts(state, Liveness(1, last_seen=T - silence))
    assert [s for s, _ in out] == ([expected] if expected else [])
    if expected is DEAD:
        assert "no heartbeat for 0.50s" in out[0][1]


@pytest.mark.parametrize(
    ("state", "broken_for", "expected"),
    [
        (ALIVE, 0.0, SUSPECT),  # a broken stream is suspicious at once...
        (ALIVE, 0.0625, SUSPECT),
        (ALIVE, 0.125, DEAD),  # ...and dead after the grace
        (JOINING, 0.0625, None),
        (JOINING, 0.125, DEAD),
        (SUSPECT, 0.0625, None),
        (SUSPECT, 0.125, DEAD),
    ],
)
def test_stream_broke(state: MemberState, broken_for: float, expected: MemberState | None) -> None:
    out = verdicts(state, Liveness(1, last_seen=T, stream_broken_at=T - broken_for))
    assert [s for s, _ in out] == ([expected] if expected else [])
    if out:
        assert "stream broke" in out[0][1]


def test_stream_verdict_reports_time_since_break() -> None:
    cluster = ClusterState(members={"h": member("h")})
    (v,) = judge(T, cluster, {"h": Liveness(1, last_seen=T - 0.0625, stream_broken_at=T - 0.25)}, DS)
    assert v.state is DEAD and v.silence_s == 0.25


def test_nobody_is_judged_before_not_before() -> None:
    seen = Liveness(1, last_seen=T - 10.0, not_before=T + 0.5, stream_broken_at=T - 10.0)
    assert verdicts(ALIVE, seen) == []
    assert [s for s, _ in verdicts(ALIVE, seen, now=T + 0.5)] == [DEAD]


@pytest.mark.parametrize("seen_inc", [1, 3])
def test_liveness_of_another_incarnation_is_ignored(seen_inc: int) -> None:
    seen = Liveness(seen_inc, last_seen=T - 10.0, stream_broken_at=T - 10.0)
    assert verdicts(ALIVE, seen, inc=2) == []


def test_member_without_liveness_is_not_judged() -> None:
    assert verdicts(ALIVE, None) == []


def test_judge_covers_every_member() -> None:
    cluster = job(states={"a1": SUSPECT})
    liveness = {
        "a0": Liveness(1, last_seen=T),
        "a1": Liveness(1, last_seen=T - 1.0),
        "a2": Liveness(1, last_seen=T - 0.25),
        "s0": Liveness(1, last_seen=T, stream_broken_at=T - 1.0),
    }
    out = {v.host_id: v.state for v in judge(T, cluster, liveness, DS)}
    assert out == {"a1": DEAD, "a2": SUSPECT, "s0": DEAD}

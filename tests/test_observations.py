"""The coordinator's observations, pure: each update function takes the current value and one input and
returns the next; a stale input (an older incarnation is refused, an older epoch changes nothing)
returns the very value it was given. No clock, no sockets."""

from __future__ import annotations

from dataclasses import replace

import pytest

from remesh.coordinator import observations
from remesh.coordinator.detector import Stall
from remesh.coordinator.errors import InvalidRequest, Rejected
from remesh.coordinator.frozen_map import FrozenMap
from remesh.coordinator.model import ClusterState, Event, EventType, FaultDetails, Topology
from remesh.coordinator.observations import (
    CollectiveFailureReport,
    CollectiveFailures,
    Observations,
    StallReport,
    StateLost,
)
from remesh.coordinator.planner import Kind
from tests.test_membership import DEAD, NOW, job, member

EMPTY = Observations()


def steps(**by_host: int) -> Observations:
    return Observations(steps=FrozenMap(by_host))


# ---- FrozenMap -----------------------------------------------------------------------------------


def test_a_frozen_map_changes_into_a_new_one_and_shares_the_rest() -> None:
    base = FrozenMap({f"host-{i}": i for i in range(1000)})
    grown = base.set("host-1000", 1000).set("host-5", 50)
    assert (len(base), len(grown)) == (1000, 1001)
    assert (base["host-5"], grown["host-5"], grown["host-1000"]) == (5, 50, 1000)
    assert "host-1000" not in base and grown.get("host-1000", -1) == 1000 and base.get("nobody") is None
    smaller = grown.without("host-0")
    assert len(smaller) == 1000 and "host-0" not in smaller and "host-0" in grown
    assert dict(smaller.items()) == {
        **{f"host-{i}": i for i in range(1, 1000)},
        "host-1000": 1000,
        "host-5": 50,
    }
    assert sorted(smaller) == sorted(dict(smaller.items()))
    # Nothing to change: the same mapping, which is what tells a caller nothing changed.
    assert base.set("host-5", 5) is base and base.without("nobody") is base
    assert FrozenMap({"a": 1}) == {"a": 1} and FrozenMap({"a": 1}) != FrozenMap({"a": 2})


# ---- heartbeats ----------------------------------------------------------------------------------


def test_a_heartbeat_records_the_step_and_whether_the_trainer_is_idle() -> None:
    state = job()
    seen = observations.heard(EMPTY, state, "a1", 1, 7, True, NOW)
    assert seen.steps == {"a1": 7} and seen.idle == {"a1": NOW}
    again = observations.heard(seen, state, "a1", 1, 7, True, NOW + 1)
    assert again is seen  # idle since the first beat that said so
    busy = observations.heard(seen, state, "a1", 1, 8, False, NOW + 2)
    assert busy.steps == {"a1": 8} and busy.idle == {}


@pytest.mark.parametrize(("host", "incarnation"), [("a1", 0), ("a1", 2), ("ghost", 1)])
def test_a_heartbeat_of_another_incarnation_or_host_changes_nothing(host: str, incarnation: int) -> None:
    seen = steps(a1=3)
    assert observations.heard(seen, job(), host, incarnation, 9, True, NOW) is seen


def test_the_epochs_furthest_step_counts_members_that_acknowledged_it_only() -> None:
    state = job(acks={"a0": 3})
    seen = observations.heard(EMPTY, state, "a0", 1, 12, False, NOW)
    assert seen.reached == 12
    assert observations.heard(seen, state, "a1", 1, 40, False, NOW).reached == 12  # not acknowledged
    assert observations.heard(seen, state, "a0", 1, 5, False, NOW).reached == 12  # only forward


def test_steps_are_final_once_the_job_finished_or_the_members_finish_is_on_its_way() -> None:
    seen = steps(a1=40)
    finished = replace(job(), finished_step=40)
    assert observations.heard(seen, finished, "a1", 1, 39, False, NOW) is seen
    assert observations.heard(seen, job(), "a1", 1, 39, False, NOW, finishing=True) is seen


def test_a_members_last_step_is_taken_whatever_a_beat_on_its_way_says() -> None:
    seen = steps(a1=39)
    assert observations.final_step(seen, job(), "a1", 1, 3, 40).steps == {"a1": 40}
    assert observations.final_step(seen, job(), "a1", 1, 3, 38) is seen  # older
    assert observations.final_step(seen, job(), "a1", 1, 2, 40) is seen  # another epoch
    assert observations.final_step(seen, job(), "a1", 2, 3, 40) is seen  # another incarnation
    assert observations.final_step(seen, replace(job(), finished_step=39), "a1", 1, 3, 40) is seen


def test_steps_loaded_from_the_store_replace_the_heard_ones() -> None:
    seen = replace(steps(a1=5, a2=6), reached=9)
    loaded = observations.loaded(seen, {"a1": 4})
    assert loaded.steps == {"a1": 4} and loaded.reached == -1


# ---- stalls --------------------------------------------------------------------------------------


def test_a_stall_is_noted_once_with_the_time_it_was_first_reported() -> None:
    seen, reason = observations.stalled(EMPTY, job(), "a1", 1, 3, StallReport(40), NOW)
    assert seen.stalls == {"a1": Stall(3, 40, NOW)} and "noted" in reason
    again, _ = observations.stalled(seen, job(), "a1", 1, 3, StallReport(40), NOW + 5)
    assert again is seen
    later, _ = observations.stalled(seen, job(), "a1", 1, 3, StallReport(41), NOW + 5)
    assert later.stalls == {"a1": Stall(3, 41, NOW + 5)}


def test_a_stall_of_an_older_epoch_changes_nothing() -> None:
    seen, reason = observations.stalled(EMPTY, job(), "a1", 1, 2, StallReport(40), NOW)
    assert seen is EMPTY and "ignored" in reason


def test_a_stall_from_an_old_incarnation_or_of_an_unpublished_epoch_is_refused() -> None:
    with pytest.raises(Rejected, match="stale incarnation"):
        observations.stalled(EMPTY, job(incarnation=2), "a1", 1, 3, StallReport(40), NOW)
    with pytest.raises(InvalidRequest, match="never published"):
        observations.stalled(EMPTY, job(), "a1", 1, 4, StallReport(40), NOW)


# ---- failed collectives --------------------------------------------------------------------------


def collective_failed(
    state: ClusterState, host: str = "a1", epoch: int = 3, seen: Observations = EMPTY, now: float = NOW
) -> tuple[Observations, str]:
    report = CollectiveFailureReport("Gloo AllReduce timed out")
    return observations.collective_failed(seen, state, host, 1, epoch, report, now)


def test_a_failed_collective_is_an_observation_for_the_planner_that_blames_nobody() -> None:
    seen, reason = collective_failed(job())
    assert seen.collective_failures == CollectiveFailures(3, NOW, FrozenMap({"a1": NOW}))
    assert "a1" in reason and "Gloo AllReduce timed out" in reason
    # Counted once per member (it says so again while it waits), the window from the first.
    again, _ = collective_failed(job(), seen=seen, now=NOW + 1)
    assert again is seen
    both, _ = collective_failed(job(), "a2", seen=seen, now=NOW + 2)
    assert both.collective_failures == CollectiveFailures(3, NOW, FrozenMap({"a1": NOW, "a2": NOW + 2}))
    assert set(both.failed_in(3)) == {"a1", "a2"} and not both.failed_in(2)


@pytest.mark.parametrize(
    ("state", "host", "epoch"),
    [
        (job(), "a1", 2),
        (job(), "s0", 3),
        (job(halted=True), "a1", 3),
        (replace(job(), finished_step=40), "a1", 3),
    ],
    ids=["older epoch", "not a member", "halted", "finished"],
)
def test_a_failed_collective_outside_the_running_epoch_is_ignored(
    state: ClusterState, host: str, epoch: int
) -> None:
    seen, reason = collective_failed(state, host, epoch)
    assert seen is EMPTY and "ignored" in reason


def test_a_failed_collective_from_an_old_incarnation_or_with_escapes_is_refused() -> None:
    with pytest.raises(Rejected, match="stale incarnation"):
        collective_failed(job(incarnation=2))
    with pytest.raises(InvalidRequest, match="control characters"):
        observations.collective_failed(EMPTY, job(), "a1", 1, 3, CollectiveFailureReport("\x1b[2J"), NOW)


# ---- lost state ----------------------------------------------------------------------------------


def test_lost_state_is_noted_for_the_running_epoch_only() -> None:
    seen = observations.state_lost(EMPTY, job(), "a1", 1, 3, "nothing")
    assert seen.lost_state == StateLost(3, "a1", "nothing")
    for stale in (
        observations.state_lost(EMPTY, job(), "a1", 1, 2, ""),  # an older epoch
        observations.state_lost(EMPTY, job(), "a1", 2, 3, ""),  # another incarnation
        observations.state_lost(EMPTY, job(), "s0", 1, 3, ""),  # no member of the epoch
        observations.state_lost(EMPTY, replace(job(), finished_step=9), "a1", 1, 3, ""),
    ):
        assert stale is EMPTY


# ---- what committed events change ----------------------------------------------------------------


def new_epoch(epoch: int, decision: str, restore_step: int) -> Event:
    topology = Topology(epoch, (), (), "", restore_step, "", 0.0)
    return Event(
        EventType.TOPOLOGY_CHANGED, NOW, epoch, "", topology=topology, details={"decision": decision}
    )


def test_a_new_epoch_clears_what_the_old_one_saw() -> None:
    seen = Observations(
        steps=FrozenMap({"a1": 40}),
        reached=41,
        stalls=FrozenMap({"a1": Stall(3, 40, NOW)}),
        collective_failures=CollectiveFailures(3, NOW, FrozenMap({"a1": NOW})),
        lost_state=StateLost(3, "a1", ""),
    )
    after = observations.recorded(seen, new_epoch(4, "replace", 40))
    assert after == Observations(steps=FrozenMap({"a1": 40}))


def test_re_forms_that_complete_no_step_are_counted_in_a_row() -> None:
    seen = EMPTY
    counts = []
    for event in (
        new_epoch(2, Kind.REFORM.value, 5),
        new_epoch(3, Kind.REFORM.value, 9),  # a step was completed between: the row starts again
        new_epoch(4, Kind.REFORM.value, 9),
        new_epoch(5, Kind.REFORM.value, 9),
        new_epoch(6, Kind.REPLACE.value, 9),  # any other epoch ends the row
    ):
        seen = observations.recorded(seen, event)
        counts.append(seen.futile_reforms)
    assert counts == [0, 0, 1, 2, 0]
    assert Kind.REFORM.value == observations.REFORM_DECISION  # the event log's word for it


def fault(epoch: int, host: str, detail: str, *, charged: bool = True, kind: str = "trainer_exited") -> Event:
    details = FaultDetails(kind, epoch, 1, detail, charged=charged).encode()
    return Event(EventType.FAULT_REPORTED, NOW, epoch, "", host_id=host, incarnation=1, details=details)


def test_trainer_failures_of_one_error_with_no_step_between_are_a_crash_loop() -> None:
    seen = EMPTY
    rows = []
    for event in (
        fault(1, "a1", "bug"),
        fault(1, "a2", "bug"),  # the epoch's first failure counts, the rest are the same recovery
        new_epoch(2, Kind.REPLACE.value, -1),
        fault(2, "s0", "bug"),
        new_epoch(3, Kind.REPLACE.value, -1),
        fault(3, "a2", "bug", charged=False),  # collateral damage counts for nothing
        fault(3, "a2", "bug", kind="address_in_use"),  # nor does a fault that is no trainer's own
        new_epoch(4, Kind.GROW.value, -1),  # no failure: the row stands while no step is completed
        fault(4, "s1", "bug"),
        new_epoch(5, Kind.REPLACE.value, -1),
        fault(5, "a1", "another bug"),  # another error starts a row of its own
        new_epoch(6, Kind.REPLACE.value, -1),
        new_epoch(7, Kind.GROW.value, 3),  # a step completed: the row ends
    ):
        seen = observations.recorded(seen, event)
        rows.append(None if seen.crash_loop is None else seen.crash_loop.hosts)
    assert rows == [
        None,
        None,
        ("a1",),
        ("a1",),
        ("a1", "s0"),
        ("a1", "s0"),
        ("a1", "s0"),
        ("a1", "s0"),
        ("a1", "s0"),
        ("a1", "s0", "s1"),
        ("a1", "s0", "s1"),
        ("a1",),
        None,
    ]
    assert seen.crash is None
    # The same event again (noted before its commit's plan, recorded after it) changes nothing.
    once = observations.crashed(EMPTY, fault(1, "a1", "bug"))
    assert observations.crashed(once, fault(1, "a1", "bug")) is once
    assert once.crash is not None and once.crash.error == "trainer_exited: bug"


def test_a_recorded_missing_tier_is_noted_for_its_incarnation() -> None:
    def missing(incarnation: int, tier: str) -> Event:
        return Event(
            EventType.TIER_MISSING, NOW, 3, "", host_id="a1", incarnation=incarnation, details={"tier": tier}
        )

    seen = observations.recorded(observations.recorded(EMPTY, missing(1, "host-shm")), missing(1, "buddy"))
    assert seen.tiers_noted_for("a1", 1) == {"host-shm", "buddy"}
    assert seen.tiers_noted_for("a1", 2) == frozenset()  # a new incarnation's news again
    assert observations.recorded(seen, missing(2, "buddy")).tiers_noted_for("a1", 2) == {"buddy"}


def test_a_member_gone_is_no_longer_idle_and_a_forgotten_one_leaves_nothing() -> None:
    seen = Observations(
        steps=FrozenMap({"a1": 4, "a2": 5}),
        idle=FrozenMap({"a1": NOW, "a2": NOW}),
        stalls=FrozenMap({"a1": Stall(3, 4, NOW)}),
        tiers_noted=FrozenMap({"a1": (1, frozenset({"buddy"}))}),
    )
    dead = member("a2", DEAD)
    gone = observations.recorded(seen, Event(EventType.MEMBER_DEAD, NOW, 3, "", host_id="a2", member=dead))
    assert gone.idle == {"a1": NOW} and gone.steps == seen.steps
    forgotten = observations.recorded(gone, Event(EventType.MEMBER_FORGOTTEN, NOW, 3, "", host_id="a1"))
    assert forgotten == Observations(steps=FrozenMap({"a2": 5}))
    assert observations.recorded(seen, Event(EventType.EPOCH_ACKED, NOW, 3, "", host_id="a1")) is seen


def test_a_trainer_that_waited_for_its_peers_says_since_when() -> None:
    blocked = Observations(steps=FrozenMap({"a1": 40}), stalls=FrozenMap({"a1": Stall(3, 40, 48.0)}))
    assert blocked.blocked_since("a1", 3) == 48.0
    assert blocked.blocked_since("a1", 2) is None
    assert replace(blocked, steps=FrozenMap({"a1": 41})).blocked_since("a1", 3) is None  # it stepped on
    failed = Observations(collective_failures=CollectiveFailures(3, 47.0, FrozenMap({"a2": 47.5})))
    assert failed.blocked_since("a2", 3) == 47.5 and failed.blocked_since("a1", 3) is None

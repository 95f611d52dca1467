"""The snapshot schedule (``remesh.elastic.schedule``) and injected faults (``remesh.elastic.faults``):
pure logic, the members' exchange of proposals stood in for by a dictionary."""

from __future__ import annotations

import pytest

from remesh.elastic import Faults, Policy, SnapshotSchedule
from remesh.elastic.agent_client import Assignment
from remesh.elastic.cadence import CALIBRATE_AFTER, FIRST_EVERY, PRIOR_MTBF_S
from remesh.elastic.faults import FailOnce


class Posted:
    """Every member's proposals, as the coordination service's key-value store would hold them."""

    def __init__(self, others: list[int]) -> None:
        self.others = others
        self.posted: dict[str, list[int]] = {}
        self.gathered: list[tuple[str, int, int]] = []

    def post(self, name: str, value: int) -> None:
        self.posted[name] = [value, *self.others]

    def gather(self, name: str, asked: int, at: int) -> list[int]:
        self.gathered.append((name, asked, at))
        return self.posted[name]


@pytest.mark.parametrize(
    ("every", "buddy_every", "due", "buddy"),
    [
        (5, None, [5, 10, 15], [5, 10, 15]),  # buddy copies with every snapshot, by default
        (5, 10, [5, 10, 15], [10]),
        (5, 0, [5, 10, 15], []),
        (1, 3, list(range(1, 16)), [3, 6, 9, 12, 15]),
    ],
)
def test_a_fixed_schedule_says_which_steps_are_snapshot_and_buddy_steps(
    every: int, buddy_every: int | None, due: list[int], buddy: list[int]
) -> None:
    schedule = SnapshotSchedule(every, buddy_every)
    posted = Posted([])
    assert [s for s in range(1, 16) if schedule.due(s, posted)] == due
    assert [s for s in range(1, 16) if schedule.buddy_step(s)] == buddy
    assert schedule.copies_buddies == (buddy_every != 0)
    assert posted.posted == {} and posted.gathered == []  # a fixed K is never agreed


def test_policy_snapshot_every_5_works_and_the_buddy_rule_follows_the_cadence() -> None:
    policy = Policy(snapshot_every=5)
    schedule = SnapshotSchedule.of(policy)
    assert schedule.buddy_every is None and schedule.buddy_step(10) and not schedule.buddy_step(7)
    # Own snapshots are kept as far back as a buddy copy can lag: 3 intervals, and one more.
    assert policy.own_snapshots_kept == 4
    assert Policy(snapshot_every=5, buddy_every=10).own_snapshots_kept == 7
    assert Policy(snapshot_every=5, buddy_every=0).own_snapshots_kept == Policy().snapshots_kept
    assert Policy(snapshots_kept=0).own_snapshots_kept == 0


@pytest.mark.parametrize(
    ("every", "buddy_every", "mtbf_s", "says"),
    [
        (3, 4, 3600.0, "multiple of snapshot_every"),
        (3, -3, 3600.0, "multiple of snapshot_every"),
        (0, None, 3600.0, "snapshot_every must be >= 1"),
        ("auto", 5, 3600.0, "with every snapshot"),
        ("auto", None, 0.0, "mtbf_s must be positive"),
    ],
)
def test_a_schedule_that_cannot_be_kept_is_refused_with_the_reason(
    every: object, buddy_every: int | None, mtbf_s: float, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        SnapshotSchedule(every, buddy_every, mtbf_s)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=says):
        Policy(snapshot_every=every, buddy_every=buddy_every, mtbf_s=mtbf_s)  # type: ignore[arg-type]


def test_an_automatic_schedule_proposes_then_agrees_on_the_median_interval_from_a_later_step() -> None:
    schedule = SnapshotSchedule("auto", mtbf_s=3 * 3600.0)
    schedule.begin(7)  # an epoch restored at step 7
    assert (schedule.every, schedule.since) == (FIRST_EVERY, 7)
    posted = Posted([40, 12])  # the other members' proposals (and, under cadence-fits-*, their fits)
    ask = 7 + CALIBRATE_AFTER * FIRST_EVERY
    due = [s for s in range(8, ask) if schedule.due(s, posted)]
    assert due == list(range(7 + FIRST_EVERY, ask, FIRST_EVERY)) and posted.posted == {}
    for step in range(8, ask):
        schedule.step_completed(step, 0.3)
    assert schedule.due(ask, posted) and list(posted.posted) == [f"cadence-{ask}", f"cadence-fits-{ask}"]
    # The new K counts from a later snapshot step: until it, the old K; there, the median of every
    # member's (this one proposed FIRST_EVERY: nothing measured its cost yet), never below the
    # largest fit (one member's 40 is both).
    at = next(s for s in range(ask + 1, ask + 50) if (schedule.due(s, posted) and posted.gathered))
    assert posted.gathered == [(f"cadence-{ask}", ask, at), (f"cadence-fits-{ask}", ask, at)]
    assert (schedule.every, schedule.since) == (40, at)
    assert schedule.buddy_step(at + 40) and not schedule.buddy_step(at + FIRST_EVERY)
    # A new epoch measures and agrees afresh.
    schedule.begin(at + 3)
    assert (schedule.every, schedule.since) == (FIRST_EVERY, at + 3)


def test_the_loops_waits_for_snapshots_are_left_out_of_the_step_they_fell_in() -> None:
    schedule = SnapshotSchedule("auto", mtbf_s=3600.0)
    schedule.observe_wait(0.2)
    schedule.step_completed(1, 0.5)
    schedule.step_completed(2, None)  # not a step to time (the first of an epoch, a checkpoint's)
    schedule.step_completed(3, 0.25)
    assert list(schedule.cadence.step_s) == [pytest.approx(0.3), 0.25]
    assert schedule.cadence.waited_s == pytest.approx(0.2)


def test_the_interval_kept_is_said_between_two_snapshots_on_the_cadence() -> None:
    schedule = SnapshotSchedule(2)
    assert schedule.snapshot_kept(2, 0.1) is None  # the first one: nothing to count from
    assert schedule.snapshot_kept(4, 0.1) == 2
    assert schedule.snapshot_kept(10, 0.1) == 6  # those due meanwhile were skipped
    assert schedule.snapshot_kept(11, 0.1) is None  # off the cadence (the last step's)


def test_faults_are_none_unless_named_and_the_collective_fault_fires_once() -> None:
    assert Faults.from_env({}) == Faults()
    faults = Faults.from_env(
        {
            "REMESH_FAULT_BUDDY_COPY_DELAY_S": "1.5",
            "REMESH_FAULT_COMPILE_DELAY_S": "",
            "REMESH_FAULT_SNAPSHOT_SHARD_DELAY_S": "0.03",
            "REMESH_FAULT_COLLECTIVE_AT_STEP": "15",
        }
    )
    assert faults == Faults(buddy_copy_delay_s=1.5, snapshot_shard_delay_s=0.03, collective_fails_at_step=15)
    assert Faults.from_env({"REMESH_FAULT_COLLECTIVE_AT_STEP": "-1"}).collective_fails_at_step is None
    once = FailOnce(faults.collective_fails_at_step)
    assert [s for s in range(30) if once.now(s)] == [15]
    assert not once.now(15)


def test_the_failure_interval_weighed_is_the_observed_one_once_there_is_one() -> None:
    observed: list[float | None] = [None]
    schedule = SnapshotSchedule("auto")
    schedule.observe_failures(lambda: observed[0])
    assert schedule.failure_interval() == (PRIOR_MTBF_S, "assumed until a failure is observed")
    assert SnapshotSchedule("auto", mtbf_s=600.0).failure_interval() == (600.0, "Policy.mtbf_s")
    observed[0] = 45.0
    assert schedule.failure_interval() == (45.0, "observed by the coordinator")
    # What a start-up line says: the steps a failure replays, and the interval weighed.
    schedule.begin(0)
    said = schedule.expected()
    assert said["replay_max_steps"] == FIRST_EVERY - 1 and said["mtbf_s"] == 45.0

    # Weighed at the proposal: a job that fails every 45 s snapshots more often than one assumed to
    # fail every 3 hours, for the same measured cost.
    def proposed(interval: float | None) -> int:
        observed[0] = interval
        s = SnapshotSchedule("auto")
        s.observe_failures(lambda: observed[0])
        s.begin(0)
        posted = Posted([])
        for step in range(1, CALIBRATE_AFTER * FIRST_EVERY + 1):
            s.step_completed(step, 0.4 if s.cadence.beside_snapshot(step) else 0.1)
            s.due(step, posted)
        return posted.posted[f"cadence-{CALIBRATE_AFTER * FIRST_EVERY}"][0]

    assert proposed(45.0) < proposed(None)


def test_the_coordinators_failure_interval_is_the_time_since_forming_over_the_recoveries() -> None:
    assert Assignment(1, "h", 0, 2, "", -1).failure_interval_s(1000.0) is None
    assert Assignment(3, "h", 0, 2, "", 5, formed_at=400.0, recoveries=0).failure_interval_s(1000.0) is None
    assert Assignment(3, "h", 0, 2, "", 5, formed_at=400.0, recoveries=2).failure_interval_s(1000.0) == 300.0


def test_what_a_failure_replays_is_said_from_the_interval_snapshots_fit_in_when_longer() -> None:
    """On an accelerator a 2 GB snapshot took 41 steps at K = 10: the replay said must be that, not 9."""
    schedule = SnapshotSchedule(10)
    schedule.begin(0)
    assert schedule.expected()["replay_max_steps"] == 9  # nothing timed yet: the interval asked
    for step in range(1, 12):
        schedule.step_completed(step, 0.06)
    schedule.snapshot_kept(10, 2.5)  # 2.5 s at 60 ms a step: fits in no fewer than 42 steps
    assert schedule.expected()["replay_max_steps"] == 41
    schedule.begin(40)  # a new epoch: the last one's timing still says what a failure replays
    assert schedule.expected()["replay_max_steps"] == 41

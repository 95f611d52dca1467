"""The pure core of three promises: commits fenced by the coordinator, a job that finishes, and one
epoch for a correlated failure. Table-driven, no clock, no sockets, no Redis."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest

from remesh.coordinator import membership
from remesh.coordinator.detector import Liveness, judge
from remesh.coordinator.errors import InvalidRequest, JobFinished, Rejected
from remesh.coordinator.membership import FaultKind
from remesh.coordinator.model import (
    COMMITS_KEPT,
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
NOW = 100.0


def job(
    hosts: Sequence[str] = ("a0", "a1", "a2"),
    *,
    epoch: int = 2,
    states: Mapping[str, MemberState] | None = None,
    changed_at: Mapping[str, float] | None = None,
    spares: Sequence[str] = ("s0",),
) -> ClusterState:
    states, changed_at = states or {}, changed_at or {}
    members = [
        Member(h, 1, Role.ACTIVE, states.get(h, ALIVE), 2, f"{h}.local", r, "seeded", changed_at.get(h, 1.0))
        for r, h in enumerate(hosts)
    ]
    members += [Member(s, 1, Role.SPARE, ALIVE, 2, f"{s}.local", -1, "seeded", 1.0) for s in spares]
    topology = Topology(
        epoch=epoch,
        members=tuple(TopologyMember(h, r, 2, f"{h}.local") for r, h in enumerate(hosts)),
        mesh_shape=(len(hosts), 2),
        jax_coordinator_address="a0.local:28001",
        restore_step=-1,
        reason="seeded",
        created_at=0.0,
    )
    return ClusterState(members={m.host_id: m for m in members}, topology=topology, live_epoch=epoch)


def commit(
    state: ClusterState, host: str = "a0", epoch: int = 2, step: int = 50, tier: str = "gcs"
) -> ClusterState:
    return replay(membership.commit_checkpoint(NOW, state, host, 1, epoch, step, tier), state)


# ---- the arbiter of commits ------------------------------------------------------------------------


def test_a_commit_of_the_current_epoch_is_recorded_with_its_step_and_tier() -> None:
    events = membership.commit_checkpoint(NOW, job(), "a1", 1, 2, 50, "local")
    (event,) = events
    assert event.type is EventType.CHECKPOINT_COMMITTED
    assert (event.epoch, event.host_id, dict(event.details)) == (2, "a1", {"step": "50", "tier": "local"})
    assert replay(events, job()).commits == ((50, 2),)


@pytest.mark.parametrize(
    ("state", "host", "epoch", "match"),
    [
        (job(epoch=3), "a0", 2, "stale epoch 2: epoch 3 is current"),
        (job(), "a0", 3, "stale epoch 3"),
        (job(), "s0", 2, "s0 is not a member of epoch 2"),
        (job(states={"a0": DEAD}), "a0", 2, "a0 is dead"),
        (ClusterState(members=job().members), "a0", 2, "no running topology"),
    ],
    ids=["older epoch", "unknown epoch", "a spare", "a dead member", "no topology"],
)
def test_a_commit_from_outside_the_current_epoch_is_refused(
    state: ClusterState, host: str, epoch: int, match: str
) -> None:
    with pytest.raises(Rejected, match=match):
        membership.commit_checkpoint(NOW, state, host, 1, epoch, 50, "gcs")


@pytest.mark.parametrize(
    ("step", "tier", "match"),
    [(-1, "gcs", "negative"), (5, "GCS bucket", "short lowercase name"), (5, "x" * 40, "short lowercase")],
)
def test_a_malformed_commit_is_invalid(step: int, tier: str, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        membership.commit_checkpoint(NOW, job(), "a0", 1, 2, step, tier)


def test_commits_are_kept_newest_first_and_bounded() -> None:
    state = job()
    for step in range(0, 20 * COMMITS_KEPT, 20):
        state = commit(state, step=step)
    state = commit(state, step=40, tier="local")  # an old step again changes nothing kept
    assert state.commits == tuple((s, 2) for s in range(20 * COMMITS_KEPT - 20, -1, -20))[:COMMITS_KEPT]


def test_the_next_epoch_carries_the_commits_accepted_before_it() -> None:
    state = commit(commit(job(), step=40), step=60)
    state = replace(state, members={**state.members, "a2": replace(state.members["a2"], state=DEAD)})
    settings = PlannerSettings(world_size=3)
    decision = plan(NOW, state, Observations(), settings)
    assert decision.kind is Kind.REPLACE
    after = replay(plan_events(NOW, state, decision, settings), state)
    assert after.topology is not None and after.topology.epoch == 3
    assert after.topology.commits == ((60, 2), (40, 2))
    # A writer of epoch 2 is refused from now on.
    with pytest.raises(Rejected, match="stale epoch 2"):
        membership.commit_checkpoint(NOW, after, "a0", 1, 2, 80, "gcs")


def test_an_event_log_with_commits_round_trips_through_json() -> None:
    state = commit(job(), step=30)
    settings = PlannerSettings(world_size=3)
    gone = replace(state, members={**state.members, "a1": replace(state.members["a1"], state=DEAD)})
    events = plan_events(NOW, gone, plan(NOW, gone, Observations(), settings), settings)
    topology_event = events[-1]
    assert topology_event.topology is not None and topology_event.topology.commits == ((30, 2),)
    assert Event.from_json(topology_event.to_json()) == topology_event


# ---- a job that finishes ---------------------------------------------------------------------------


def finished(state: ClusterState | None = None) -> ClusterState:
    state = state or job()
    return replay(membership.finish(NOW, state, "a1", 1, 2, 300), state)


def test_finishing_records_the_last_step_once() -> None:
    events = membership.finish(NOW, job(), "a1", 1, 2, 300)
    (event,) = events
    assert (event.type, event.epoch, dict(event.details)) == (EventType.JOB_FINISHED, 2, {"step": "300"})
    state = replay(events, job())
    assert state.finished and state.finished_step == 300
    assert membership.finish(NOW, state, "a0", 1, 2, 300) == []


def test_finishing_an_epoch_that_is_over_is_refused() -> None:
    with pytest.raises(Rejected, match="stale epoch 1"):
        membership.finish(NOW, job(), "a1", 1, 1, 300)


def test_after_the_job_finished_nobody_is_judged_replaced_or_charged() -> None:
    state = finished()
    gone = {h: replace(m, state=DEAD) for h, m in state.members.items() if h == "a2"}
    assert plan(
        NOW, replace(state, members={**state.members, **gone}), Observations(), PlannerSettings(world_size=3)
    ).kind is (Kind.NONE)
    assert membership.declare(NOW, state, "a2", 1, DEAD, "stream broke") == []
    silent = {h: Liveness(1, last_seen=0.0, stream_broken_at=0.0) for h in state.members}
    assert judge(NOW, state, silent, DetectorSettings()) == []
    outcome = membership.report_fault(NOW, state, "a2", 1, FaultKind.TRAINER_EXITED, 2, -6, "")
    assert (outcome.events, outcome.member_dead) == ([], False)
    assert "not a fault" in outcome.reason


def test_registering_with_a_finished_job_says_so_with_the_last_step() -> None:
    with pytest.raises(JobFinished, match="finished at step 300") as info:
        membership.register(NOW, finished(), "new-host", Role.SPARE, 2, "n.local")
    assert info.value.step == 300


# ---- one recovery per burst ------------------------------------------------------------------------

SETTINGS = PlannerSettings(world_size=3, suspect_hold_s=0.5, burst_window_s=0.1)


@pytest.mark.parametrize(
    ("states", "lost_at", "now", "kind", "hosts"),
    [
        # a2 died while a1's stream had just broken: wait for a1's verdict.
        ({"a2": DEAD, "a1": SUSPECT}, 99.9, NOW, Kind.HOLD, ()),
        # Its verdict came: both are planned at once (one spare: shrink to what is left).
        ({"a2": DEAD, "a1": DEAD}, 99.8, NOW, Kind.SHRINK, ("a0", "s0")),
        # The suspect refuted it (alive again): the spare replaces a2 alone.
        ({"a2": DEAD}, 99.8, NOW, Kind.REPLACE, ("a0", "a1", "s0")),
        # Just lost, nobody suspect: the rest of a burst may still be on its way.
        ({"a2": DEAD}, 99.95, NOW, Kind.HOLD, ()),
        # Still suspect after the bound: plan without waiting any longer.
        ({"a2": DEAD, "a1": SUSPECT}, 99.0, NOW, Kind.REPLACE, ("a0", "a1", "s0")),
    ],
    ids=["hold", "both dead", "refuted", "burst window", "bound ran out"],
)
def test_members_lost_while_others_are_suspect_are_planned_together(
    states: Mapping[str, MemberState], lost_at: float, now: float, kind: Kind, hosts: tuple[str, ...]
) -> None:
    state = job(states=states, changed_at=dict.fromkeys(states, lost_at))
    decision = plan(now, state, Observations(), SETTINGS)
    assert decision.kind is kind, decision.reason
    assert decision.hosts == hosts
    if kind is Kind.HOLD:
        assert plan_events(now, state, decision, SETTINGS) == []


def test_a_burst_of_three_is_one_epoch() -> None:
    """Three hosts of six lost within a detection window: the planner waits for the suspects and
    then publishes one epoch for all of them."""
    hosts = ("a0", "a1", "a2", "a3", "a4", "a5")
    settings = PlannerSettings(world_size=6, suspect_hold_s=0.5, burst_window_s=0.1)
    state = job(hosts, spares=("s0", "s1", "s2"))
    epochs = {state.epoch}
    for t, (host, verdict) in enumerate(
        [("a1", SUSPECT), ("a3", SUSPECT), ("a5", SUSPECT), ("a1", DEAD), ("a3", DEAD), ("a5", DEAD)]
    ):
        now = NOW + t * 0.02
        events = membership.declare(now, state, host, 1, verdict, "stream broke")
        state = replay(events, state)
        decision = plan(now, state, Observations(), settings)
        state = replay(plan_events(now, state, decision, settings), state)
        epochs.add(state.epoch)
    assert epochs == {2}  # held: the burst is still being collected
    later = NOW + 0.5  # the detector's next ticks re-plan once the window has passed
    state = replay(plan_events(later, state, plan(later, state, Observations(), settings), settings), state)
    assert state.epoch == 3
    assert state.topology is not None
    assert state.topology.host_ids == ("a0", "s0", "a2", "s1", "a4", "s2")


# ---- a frozen trainer: its peers report they wait for it ------------------------------------------

DETECT = DetectorSettings(stall_verdict_s=1.0)


@pytest.mark.parametrize(
    ("reporters", "steps", "at", "dead"),
    [
        # a0 and a2 blocked after step 40 for 1.2 s, a1 silent: a1 stopped taking part.
        (("a0", "a2"), {"a0": 40, "a1": 40, "a2": 40}, 98.8, ["a1"]),
        # Not long enough yet.
        (("a0", "a2"), {"a0": 40, "a1": 40, "a2": 40}, 99.5, []),
        # a0 moved on since it reported (a lagging peer finished its step): the report lapsed.
        (("a0", "a2"), {"a0": 41, "a1": 41, "a2": 40}, 98.8, []),
        # Everyone blocked: nobody to blame (a slow step, or a failure the collective will surface).
        (("a0", "a1", "a2"), {"a0": 40, "a1": 40, "a2": 40}, 98.8, []),
        # One reporter never blames a majority.
        (("a0",), {"a0": 40, "a1": 40, "a2": 40}, 98.8, []),
    ],
    ids=["frozen", "too soon", "lapsed", "all blocked", "minority"],
)
def test_the_member_every_other_member_waits_for_is_declared_dead(
    reporters: tuple[str, ...], steps: Mapping[str, int], at: float, dead: list[str]
) -> None:
    from remesh.coordinator.detector import Stall, judge_stalls

    stalls = {h: Stall(2, 40, at) for h in reporters}
    verdicts = judge_stalls(NOW, job(), stalls, steps, DETECT, idle={"a0", "a1", "a2"})
    assert [v.host_id for v in verdicts] == dead
    assert all(v.state is DEAD and "stopped taking part" in v.reason for v in verdicts)


def test_stall_reports_of_an_older_epoch_or_a_finished_job_blame_nobody() -> None:
    from remesh.coordinator.detector import Stall, judge_stalls

    stalls = {"a0": Stall(1, 40, 90.0), "a2": Stall(1, 40, 90.0)}
    assert judge_stalls(NOW, job(), stalls, {}, DETECT, idle={"a1"}) == []
    current = {"a0": Stall(2, 40, 90.0), "a2": Stall(2, 40, 90.0)}
    assert judge_stalls(NOW, finished(), current, {}, DETECT, idle={"a1"}) == []
    # A member that still computes (its agent saw CPU time move) is never blamed: it lags.
    assert judge_stalls(NOW, job(), current, {}, DETECT, idle=set()) == []


def test_the_member_whose_collective_failed_first_is_not_taken_for_a_frozen_one() -> None:
    """a1's collective failed and it left the epoch (idle, waiting for the next) while a0 and a2
    block in theirs until it times out: a1 said so, so it did not stop, and nobody is declared dead."""
    from remesh.coordinator.detector import Stall, judge_stalls

    stalls = {"a0": Stall(2, 40, 98.8), "a2": Stall(2, 40, 98.8)}
    steps = {"a0": 40, "a1": 40, "a2": 40}
    assert [v.host_id for v in judge_stalls(NOW, job(), stalls, steps, DETECT, idle={"a1"})] == ["a1"]
    assert judge_stalls(NOW, job(), stalls, steps, DETECT, idle={"a1"}, failed={"a1"}) == []


def test_a_trainer_that_was_blocked_waiting_for_its_peers_is_not_at_fault_when_it_aborts() -> None:
    outcome = membership.report_fault(
        NOW, job(), "a0", 1, FaultKind.TRAINER_EXITED, 2, -6, "", blocked_since=98.5
    )
    assert (outcome.member_dead, "blocked waiting for its peers" in outcome.reason) == (False, True)
    assert [e.type for e in outcome.events] == [EventType.FAULT_REPORTED]
    # Its peers may wait for it in turn: the epoch is to be re-formed unless a loss explains it.
    assert outcome.left_epoch
    alone = membership.report_fault(NOW, job(), "a0", 1, FaultKind.TRAINER_EXITED, 2, -6, "")
    assert alone.member_dead and not alone.left_epoch
    older = membership.report_fault(
        NOW, job(), "a0", 1, FaultKind.TRAINER_EXITED, 1, -6, "", blocked_since=98.5
    )
    assert not older.member_dead and not older.left_epoch  # its epoch was replaced already


def test_a_host_lost_a_moment_ago_is_not_preferred_to_a_real_spare() -> None:
    """a1's trainer crashed and its agent registered again within the burst window (alive, a spare
    now): the hot spare takes the rank, not the host that just failed."""
    state = job(spares=("z-spare",))
    back = replace(state.members["a1"], role=Role.SPARE, state=ALIVE, incarnation=2, updated_at=99.99)
    state = replace(state, members={**state.members, "a1": back})
    decision = plan(NOW + 1, state, Observations(), SETTINGS)
    assert decision.kind is Kind.REPLACE
    assert decision.hosts == ("a0", "z-spare", "a2")
    assert "a1 lost, registered again since as a spare" in decision.reason


def test_a_burst_that_reaches_the_coordinator_over_seconds_is_still_one_epoch() -> None:
    """Thousands of hosts lost at once reach the coordinator over seconds: 40 of 80 here, one every
    50 ms (2 s in all, four times the suspect hold). While the losses keep coming the burst is held;
    once burst_window_s passes without one, every loss goes into one epoch."""
    hosts = tuple(f"a{i}" for i in range(80))
    spares = tuple(f"s{i}" for i in range(40))
    settings = PlannerSettings(world_size=80, suspect_hold_s=0.5, burst_window_s=0.1, burst_max_s=5.0)
    state = job(hosts, spares=spares)
    first = state.epoch
    for i, host in enumerate(hosts[::2]):
        now = NOW + i * 0.05
        for verdict in (SUSPECT, DEAD):
            state = replay(membership.declare(now, state, host, 1, verdict, "stream broke"), state)
        decision = plan(now, state, Observations(), settings)
        assert decision.kind is Kind.HOLD, (i, decision.reason)
    quiet = NOW + 39 * 0.05 + 0.15  # a tick after the window passed without a loss
    state = replay(plan_events(quiet, state, plan(quiet, state, Observations(), settings), settings), state)
    assert state.epoch == first + 1
    assert state.topology is not None and not set(hosts[::2]) & set(state.topology.host_ids)


def test_a_burst_that_never_stops_is_planned_at_its_bound() -> None:
    """Losses every 50 ms without end: the plan waits burst_max_s from the first loss, no longer."""
    hosts = tuple(f"a{i}" for i in range(40))
    settings = PlannerSettings(world_size=40, suspect_hold_s=0.5, burst_window_s=0.1, burst_max_s=1.0)
    state = job(hosts, spares=tuple(f"s{i}" for i in range(40)))
    kinds = []
    for i, host in enumerate(hosts[:30]):
        now = NOW + i * 0.05
        state = replay(membership.declare(now, state, host, 1, DEAD, "stream broke"), state)
        kinds.append(plan(now, state, Observations(), settings).kind)
    assert kinds[:20] == [Kind.HOLD] * 20  # up to 0.95 s after the first loss
    assert kinds[20] is not Kind.HOLD  # 1.0 s: planned, the burst still going

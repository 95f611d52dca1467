"""Property tests of the pure core committed through the real ``RedisStore`` (a real redis-server).

A hypothesis state machine plays an agent fleet and a detector against one job: registers (active
or spare), heartbeats, detector verdicts, leaves, drains, trainer faults, epoch acks and clock ticks,
with stale, future and malformed inputs mixed in. Each input goes through the same path as
``Coordinator._commit``: transition, replay, plan, ``plan_events``, one ``commit``. After every step
the invariants of ARCHITECTURE.md are checked against what Redis holds:

- replaying the stored event log gives exactly the stored state (and the writer's in-memory state);
- topology epochs go 1, 2, 3, ...: strictly up, never repeated, one topology per epoch;
- the revision goes up by one per commit, and a refused input changes nothing;
- planning again from the stored state changes nothing (observe, plan, commit is idempotent).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Any, ClassVar, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from remesh.coordinator import membership
from remesh.coordinator.detector import Liveness, Verdict, judge
from remesh.coordinator.errors import Conflict, CoordinatorError
from remesh.coordinator.frozen_map import FrozenMap
from remesh.coordinator.membership import FaultKind
from remesh.coordinator.model import ClusterState, Event, EventType, MemberState, Role, replay, tally
from remesh.coordinator.observations import Observations
from remesh.coordinator.planner import Kind, plan, plan_events
from remesh.coordinator.settings import DetectorSettings, PlannerSettings
from remesh.coordinator.store import RedisStore
from remesh.embedded import RedisServer

T = TypeVar("T")
Transition = Callable[[ClusterState, float], list[Event]]

HOSTS = ("h1", "h2", "h3", "h4", "h5")
# Mostly real hosts; now and then a malformed id or one that never registered.
host_ids = st.sampled_from(HOSTS * 4 + ("", "bad id", "h" * 200, "nobody"))
# Mostly the current incarnation; sometimes a stale or a never-issued one.
incarnation_deltas = st.sampled_from((0, 0, 0, 0, -1, 1))
epoch_deltas = st.sampled_from((0, 0, 0, -1, 1))
# Small steps, and jumps long enough to run out a wait.
clock_steps = st.sampled_from((0.0, 0.05, 0.5, 2.0, 12.0))

PLANNERS = (
    PlannerSettings(world_size=3, min_world_size=2, max_wait_s=20.0),
    PlannerSettings(world_size=2, min_world_size=2, max_wait_s=20.0),
    PlannerSettings(world_size=4, min_world_size=1, world_size_must_divide=4, max_wait_s=20.0),
    PlannerSettings(world_size=3, min_world_size=3, max_wait_s=5.0),
)
DETECTOR = DetectorSettings(
    heartbeat_interval_s=0.25, suspect_after_s=0.5, heartbeat_timeout_s=1.0, stream_grace_s=0.25
)


class CoordinatorMachine(RuleBasedStateMachine):
    """One job: a writer that mirrors ``Coordinator._commit``, and checks of what Redis holds."""

    url: ClassVar[str] = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.job_id = f"prop-{uuid.uuid4().hex}"
        # A generous socket timeout: on a loaded machine a 1 s timeout fails this test, not the store.
        self.store = RedisStore(self.url, self.job_id, socket_timeout=10.0)
        self.planner = PLANNERS[0]
        self.state = ClusterState()
        # The members counted by state and role as the coordinator keeps them: commit by commit.
        self.tally = tally(self.state.members)
        self.rev = 0
        self.logged = 0
        self.now = 1_000.0
        # When the planner last ran: a refused input or a quiet detector tick plans nothing.
        self.planned_at = self.now
        self.steps: dict[str, int] = {}
        # Every checkpoint commit accepted so far, and the epoch current when the job finished.
        self.committed: set[tuple[int, int]] = set()
        self.finished_epoch = 0

    def teardown(self) -> None:
        self._run(self.store.close())
        self.loop.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def _incarnation(self, host: str, delta: int) -> int:
        m = self.state.members.get(host)
        return (m.incarnation if m else 1) + delta

    # ---- the write path, as in Coordinator._commit ------------------------------------------------

    def change(self, dt: float, transition: Transition) -> None:
        self.now += dt
        now = self.now
        try:
            events = transition(self.state, now)
        except CoordinatorError:
            # A refused input changes nothing: not the state, not the revision, not the log.
            assert self._run(self.store.load()) == (self.state, self.rev)
            assert len(self._run(self.store.read_events())) == self.logged
            return
        after = replay(events, self.state)
        ready = tally(after.members, self.tally, events).count(MemberState.ALIVE, Role.ACTIVE)
        decision = plan(now, after, Observations(steps=FrozenMap(self.steps)), self.planner, ready=ready)
        self.planned_at = now
        events = events + plan_events(now, after, decision, self.planner, self.job_id)
        if not events:
            return
        new_state = replay(events, self.state)
        stored = self._run(self.store.commit(self.rev, self.state, new_state, events))
        assert [replace(e, id="") for e in stored] == events
        assert all(e.id for e in stored)
        self.tally = tally(new_state.members, self.tally, stored)
        self.state = new_state
        self.rev += 1
        self.logged += len(events)

    # ---- inputs ------------------------------------------------------------------------------------

    @initialize(planner=st.sampled_from(PLANNERS), actives=st.integers(0, 4), spares=st.integers(0, 2))
    def boot(self, planner: PlannerSettings, actives: int, spares: int) -> None:
        """Choose the job's settings and start some agents (register, then a first heartbeat)."""
        self.planner = planner
        for i, host in enumerate(HOSTS[: actives + spares]):
            self.join(0.0, host, Role.ACTIVE if i < actives else Role.SPARE)

    @rule(
        dt=clock_steps,
        host=host_ids,
        role=st.sampled_from(Role),
        devices=st.sampled_from((1, 2, 8, -1)),
        limit=st.sampled_from((0, 0, 3)),
    )
    def register(self, dt: float, host: str, role: Role, devices: int, limit: int = 0) -> None:
        """A registration; with ``limit`` under a member limit (room made by forgetting, or refused)."""
        self.change(
            dt, lambda s, t: membership.register(t, s, host, role, devices, f"{host}.local", 128, limit)[0]
        )

    @rule(dt=clock_steps, host=st.sampled_from(HOSTS), role=st.sampled_from(Role))
    def join(self, dt: float, host: str, role: Role) -> None:
        """What an agent does on start: register, then heartbeat with the incarnation it got."""
        self.register(dt, host, role, 2)
        member = self.state.members.get(host)
        if member is not None:
            self.heartbeat(0.0, host, 0, -1)

    @precondition(lambda self: any(not m.state.is_up for m in self.state.members.values()))
    @rule(dt=clock_steps, data=st.data())
    def restart_gone(self, dt: float, data: st.DataObject) -> None:
        """An agent whose member is dead, left or draining registers again, as the coordinator asks it to."""
        gone = sorted(h for h, m in self.state.members.items() if not m.state.is_up)
        self.join(dt, data.draw(st.sampled_from(gone), label="host"), Role.ACTIVE)

    @rule(dt=clock_steps, host=host_ids, delta=incarnation_deltas, step=st.integers(-1, 50))
    def heartbeat(self, dt: float, host: str, delta: int, step: int) -> None:
        incarnation = self._incarnation(host, delta)

        def transition(s: ClusterState, t: float) -> list[Event]:
            events = membership.heartbeat(t, s, host, incarnation)
            if step >= 0:  # the coordinator records progress only from accepted heartbeats
                self.steps[host] = step
            return events

        self.change(dt, transition)

    @rule(
        dt=clock_steps,
        host=host_ids,
        delta=incarnation_deltas,
        verdict=st.sampled_from((MemberState.SUSPECT, MemberState.DEAD)),
    )
    def declare(self, dt: float, host: str, delta: int, verdict: MemberState) -> None:
        incarnation = self._incarnation(host, delta)
        self.change(dt, lambda s, t: membership.declare(t, s, host, incarnation, verdict, "detector verdict"))

    @rule(
        dt=clock_steps,
        silence=st.dictionaries(st.sampled_from(HOSTS), st.sampled_from((0.0, 0.5, 1.0, 3.0)), max_size=3),
        broken=st.sets(st.sampled_from(HOSTS), max_size=2),
    )
    def detect(self, dt: float, silence: Mapping[str, float], broken: set[str]) -> None:
        """One detector tick, as ``Coordinator.detect_once``: judge, then one change per verdict."""
        self.now += dt
        liveness = {
            m.host_id: Liveness(
                m.incarnation,
                last_seen=self.now - silence.get(m.host_id, 0.0),
                stream_broken_at=self.now - 1.0 if m.host_id in broken else None,
            )
            for m in self.state.members.values()
        }
        for verdict in judge(self.now, self.state, liveness, DETECTOR):
            self._verdict(verdict)

    def _verdict(self, v: Verdict) -> None:
        self.change(0.0, lambda s, t: membership.declare(t, s, v.host_id, v.incarnation, v.state, v.reason))

    @rule(dt=clock_steps, host=host_ids, delta=incarnation_deltas)
    def leave(self, dt: float, host: str, delta: int) -> None:
        incarnation = self._incarnation(host, delta)
        self.change(dt, lambda s, t: membership.leave(t, s, host, incarnation, "done"))

    @rule(dt=clock_steps, host=host_ids)
    def drain(self, dt: float, host: str) -> None:
        self.change(dt, lambda s, t: membership.drain(t, s, host, "maintenance"))

    @rule(
        dt=clock_steps,
        host=host_ids,
        delta=incarnation_deltas,
        kind=st.sampled_from(FaultKind),
        epoch_delta=epoch_deltas,
    )
    def fault(self, dt: float, host: str, delta: int, kind: FaultKind, epoch_delta: int) -> None:
        incarnation = self._incarnation(host, delta)
        epoch = self.state.epoch + epoch_delta

        def transition(s: ClusterState, t: float) -> list[Event]:
            return membership.report_fault(t, s, host, incarnation, kind, epoch, 134, "exited").events

        self.change(dt, transition)

    @rule(dt=clock_steps, host=host_ids, delta=incarnation_deltas, epoch_delta=epoch_deltas)
    def ack(self, dt: float, host: str, delta: int, epoch_delta: int) -> None:
        incarnation = self._incarnation(host, delta)
        epoch = self.state.epoch + epoch_delta

        def transition(s: ClusterState, t: float) -> list[Event]:
            return membership.ack_epoch(t, s, host, incarnation, epoch, 0, "memory", {"restore": 0.1})[0]

        self.change(dt, transition)

    @rule(
        dt=clock_steps,
        host=host_ids,
        delta=incarnation_deltas,
        epoch_delta=epoch_deltas,
        step=st.integers(-1, 60),
        tier=st.sampled_from(("local", "gcs", "Bad tier")),
    )
    def commit_checkpoint(
        self, dt: float, host: str, delta: int, epoch_delta: int, step: int, tier: str
    ) -> None:
        incarnation = self._incarnation(host, delta)
        epoch = self.state.epoch + epoch_delta
        before = self.state.epoch
        self.change(dt, lambda s, t: membership.commit_checkpoint(t, s, host, incarnation, epoch, step, tier))
        # Accepted only for the epoch current when it arrived: a stale writer never commits.
        assert all(e == before or (s_, e) in self.committed for s_, e in self.state.commits)
        self.committed |= set(self.state.commits)

    @rule(dt=clock_steps, host=host_ids, delta=incarnation_deltas, epoch_delta=epoch_deltas)
    def finish(self, dt: float, host: str, delta: int, epoch_delta: int) -> None:
        incarnation = self._incarnation(host, delta)
        epoch = self.state.epoch + epoch_delta
        self.change(dt, lambda s, t: membership.finish(t, s, host, incarnation, epoch, 60))

    @rule(dt=clock_steps, retention=st.sampled_from((0.0, 5.0)))
    def forget(self, dt: float, retention: float) -> None:
        """The housekeeping: members dead or left for ``retention`` are forgotten."""
        self.change(dt, lambda s, t: membership.expire(t, s, retention))

    @rule(dt=clock_steps)
    def compact(self, dt: float) -> None:
        """The log is cut behind an event that holds the state; the log still replays to it."""
        self.now += dt
        state = json.dumps(self.state.to_dict())
        event = Event(EventType.LOG_COMPACTED, self.now, self.state.epoch, "cut", details={"state": state})
        stored = self._run(self.store.compact(self.rev, event))
        assert stored.id
        self.rev += 1
        self.logged = 1

    @rule(dt=clock_steps)
    def tick(self, dt: float) -> None:
        """The detector loop's nudge: plan with no input (a wait may have run out)."""
        self.change(dt, lambda s, t: [])

    @rule(offset=st.sampled_from((-1, 1, 5)))
    def stale_writer(self, offset: int) -> None:
        """A writer that planned at another revision is refused and changes nothing."""
        before = self._run(self.store.load())
        event = Event(EventType.JOB_WAITING, self.now, self.state.epoch, "from a stale writer")
        with pytest.raises(Conflict):
            self._run(self.store.commit(self.rev + offset, self.state, replay([event], self.state), [event]))
        assert self._run(self.store.load()) == before
        assert len(self._run(self.store.read_events())) == self.logged

    # ---- invariants --------------------------------------------------------------------------------

    @invariant()
    def the_kept_tally_is_a_count_from_scratch(self) -> None:
        assert self.tally.of is self.state.members
        assert self.tally.counts == tally(self.state.members).counts

    @invariant()
    def log_replays_to_the_stored_state(self) -> None:
        stored, rev = self._run(self.store.load())
        log = self._run(self.store.read_events())
        assert rev == self.rev
        assert stored == self.state
        assert len(log) == self.logged
        assert replay(log) == stored

        ids = [tuple(map(int, e.id.split("-"))) for e in log]
        assert ids == sorted(set(ids))
        assert all(a.epoch <= b.epoch for a, b in itertools.pairwise(log))

        # Topology epochs go 1, 2, 3, ...: strictly up, so no two topologies share one (after a cut,
        # on from the epoch of the state the cut left).
        assert all(e.type is not EventType.LOG_COMPACTED for e in log[1:])
        first = log[0].epoch + 1 if log and log[0].type is EventType.LOG_COMPACTED else 1
        topologies = [e for e in log if e.topology is not None]
        assert all(e.type in (EventType.TOPOLOGY_CHANGED, EventType.JOB_HALTED) for e in topologies)
        assert [e.epoch for e in topologies] == list(range(first, first + len(topologies)))
        assert all(e.topology is not None and e.topology.epoch == e.epoch for e in topologies)
        assert all(not e.topology.halted for e in topologies[:-1] if e.topology is not None)

    @invariant()
    def member_records_agree_with_the_topology(self) -> None:
        topology = self.state.topology
        for h, m in self.state.members.items():
            rank = topology.rank_of(h) if topology else -1
            if rank < 0:
                assert m.rank == -1, m
            else:
                # A member keeps its rank, unless it died and registered again while the job waited:
                # then it is a spare until the planner places it in a new epoch.
                assert (m.role, m.rank) in ((Role.ACTIVE, rank), (Role.SPARE, -1)), m
                assert m.role is Role.ACTIVE or m.incarnation > 1
        if topology is not None and not topology.halted:
            assert topology.world_size <= self.planner.world_size
            assert (
                self.planner.is_valid_size(topology.world_size)
                or topology.world_size == self.planner.world_size
            )
        if self.state.acks:
            assert topology is not None
            assert set(self.state.acks) <= set(topology.host_ids)
            assert set(self.state.acks.values()) == {topology.epoch}
        assert self.state.live_epoch <= self.state.epoch

    @invariant()
    def a_finished_job_changes_no_more(self) -> None:
        if not self.state.finished:
            self.finished_epoch = self.state.epoch
            return
        # After the last step: no epoch, and nobody declared dead.
        assert self.state.epoch == self.finished_epoch
        events = self._run(self.store.read_events())
        # From the job_finished event on (from the start of the log when a cut folded it in).
        finished_at = next((i for i, e in enumerate(events) if e.type is EventType.JOB_FINISHED), 0)
        assert not [e for e in events[finished_at:] if e.type is EventType.MEMBER_DEAD]

    @invariant()
    def planning_again_changes_nothing(self) -> None:
        decision = plan(self.planned_at, self.state, Observations(steps=FrozenMap(self.steps)), self.planner)
        # A hold (members lost while others are suspect) commits nothing either: it waits.
        assert decision.kind in (Kind.NONE, Kind.HOLD), decision.reason
        assert not plan_events(self.planned_at, self.state, decision, self.planner)
        if self.state.waiting_since is not None and not self.state.finished:
            assert decision.reason.startswith("waiting for a replacement"), decision.reason


@pytest.mark.integration
@pytest.mark.timeout(600)  # passing takes seconds; shrinking a failure through Redis takes minutes
def test_store_matches_replayed_log(redis_server: RedisServer) -> None:
    machine = type("Machine", (CoordinatorMachine,), {"url": redis_server.url})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=40,
            stateful_step_count=40,
            deadline=None,
            # The explain phase traces every line: minutes per failure with Redis round trips.
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )


# ---- commit, directly ------------------------------------------------------------------------------


async def _stale_commit(url: str, job_id: str) -> None:
    store = RedisStore(url, job_id)
    try:
        assert await store.load() == (ClusterState(), 0)
        events, _ = membership.register(1.0, ClusterState(), "h1", Role.ACTIVE, 1, "h1.local")
        state = replay(events)
        stored = await store.commit(0, ClusterState(), state, events)
        assert state.members["h1"].state is MemberState.JOINING
        assert len(stored) == 1 and stored[0].id
        assert await store.load() == (state, 1)

        # Planned at revision 0, but the store is at 1 now: refused, and nothing is written.
        late, _ = membership.register(2.0, ClusterState(), "h2", Role.ACTIVE, 1, "h2.local")
        with pytest.raises(Conflict, match="revision 1"):
            await store.commit(0, ClusterState(), replay(late), late)
        assert await store.load() == (state, 1)
        assert [e.id for e in await store.read_events()] == [stored[0].id]

        # From the right revision the same change goes through.
        late, _ = membership.register(2.0, state, "h2", Role.ACTIVE, 1, "h2.local")
        state2 = replay(late, state)
        await store.commit(1, state, state2, late)
        assert await store.load() == (state2, 2)
        assert replay(await store.read_events()) == state2
    finally:
        await store.close()


@pytest.mark.integration
def test_commit_with_a_stale_revision_conflicts_and_changes_nothing(redis_server: RedisServer) -> None:
    asyncio.run(_stale_commit(redis_server.url, f"stale-{uuid.uuid4().hex}"))

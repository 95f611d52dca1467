"""The coordinator engine: a thin asyncio shell around the pure core.

It holds what must be fast in memory (liveness from heartbeats, open agent streams, topology
watchers, and ``observations``: what agents said that no event records, one immutable value replaced
by the pure functions of ``remesh.coordinator.observations``), and funnels every state change through
``_commit``: observe the current state, fold the events of a pure transition into it, plan once from
the state they fold to and the observations, commit all events in one atomic Redis step, then
publish. The gRPC layer (``servicer``) only translates requests into calls on this class.

With several replicas exactly one leads (``remesh.coordinator.leadership``). A follower mirrors the
stored state for reads and topology watches and answers every write with ``NotLeader`` naming the
leader. A replica that takes over grants every member a fresh deadline before judging anyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import structlog

from remesh.coordinator import goodput, membership, observations
from remesh.coordinator.agent_stream import AgentStream, Command
from remesh.coordinator.detector import Liveness, Verdict, judge, judge_stalls
from remesh.coordinator.doorbell import Doorbell
from remesh.coordinator.errors import (
    Conflict,
    CoordinatorError,
    Fenced,
    NotLeader,
    Rejected,
    StoreUnavailable,
)
from remesh.coordinator.leadership import Leadership
from remesh.coordinator.liveness import LivenessTable
from remesh.coordinator.metrics import Metrics
from remesh.coordinator.model import (
    ClusterState,
    Event,
    EventType,
    Fold,
    Member,
    MemberState,
    Role,
    Tally,
    Topology,
    tally,
)
from remesh.coordinator.observations import (
    CollectiveFailureReport,
    Observations,
    Report,
    StallReport,
    TierMissingReport,
)
from remesh.coordinator.planner import Kind, plan, plan_events
from remesh.coordinator.settings import Settings
from remesh.coordinator.store import RedisStore
from remesh.v1.contract import recovery_id

__all__ = ["Coordinator"]

log = structlog.get_logger("remesh.coordinator")

T = TypeVar("T")

# How often the coordinator's goodput gauges are refreshed.
_GOODPUT_EVERY_S = 5.0
# A failure belongs to the recovery that produces the next epoch; an epoch after the first, to the
# recovery that produced it (remesh.v1.contract.recovery_id).
_FAILURE_EVENTS = frozenset({EventType.MEMBER_SUSPECT, EventType.MEMBER_DEAD, EventType.FAULT_REPORTED})
_EPOCH_EVENTS = frozenset({EventType.TOPOLOGY_CHANGED, EventType.EPOCH_ACKED, EventType.EPOCH_LIVE})


def _recovery_of(job_id: str, event: Event) -> dict[str, str]:
    if event.type in _FAILURE_EVENTS:
        return {"recovery": recovery_id(job_id, event.epoch + 1)}
    if event.type in _EPOCH_EVENTS and event.epoch >= 2:
        return {"recovery": recovery_id(job_id, event.epoch)}
    return {}


Clock = Callable[[], float]


class _ChangeLogger:
    """Logs a message only when it differs from the previous one (a loop must not spam its reason)."""

    def __init__(self) -> None:
        self._last: str | None = None

    def __call__(self, message: str, **kw: object) -> None:
        if message != self._last:
            self._last = message
            log.info(message, **kw)


# A change as the write path (``Coordinator._commit``) runs it: it folds its events into the fold
# of the current state it is given (each transition of it sees the state the ones before produced),
# and returns them with what answers its caller.
_Change = Callable[[Fold, float], tuple[list[Event], T]]


def _folded(transition: Callable[[ClusterState, float], tuple[list[Event], T]]) -> _Change[T]:
    """One transition as a change."""

    def change(fold: Fold, now: float) -> tuple[list[Event], T]:
        events, answer = transition(fold.state, now)
        fold.add(events)
        return events, answer

    return change


def _declare_all(verdicts: list[Verdict]) -> _Change[None]:
    """The events of every verdict, each checked against the state the ones before it produced."""

    def change(fold: Fold, now: float) -> tuple[list[Event], None]:
        events: list[Event] = []
        for v in verdicts:
            found = membership.declare(now, fold.state, v.host_id, v.incarnation, v.state, v.reason)
            fold.add(found)
            events += found
        return events, None

    return change


@dataclass
class _Queued:
    """A change waiting for the next batch commit, and its caller's answer (what the transition
    returned beside its events, or its refusal)."""

    transition: Callable[[ClusterState, float], tuple[list[Event], Any]]
    answer: asyncio.Future[Any]


# Events that change nothing the planner reads (members, topology, faults, commits, the finish):
# a commit of only these after a settled plan is not planned again.
_PLAN_NEUTRAL = frozenset({EventType.EPOCH_ACKED, EventType.EPOCH_LIVE, EventType.TIER_MISSING})


class Coordinator:
    def __init__(self, settings: Settings, store: RedisStore, *, clock: Clock = time.time) -> None:
        self.settings = settings
        self.store = store
        self.metrics = Metrics()
        self._clock = clock
        self._lock = asyncio.Lock()
        self.state = ClusterState()
        self._rev = 0
        self._liveness = LivenessTable(settings.detector)
        # What the planner and the detector read beside the state: replaced, never changed in place.
        self.observations = Observations()
        # Steps heard since the last progress write (``_flush_progress``).
        self._dirty_steps: dict[str, int] = {}
        # One progress write at a time, landing in the order taken: a periodic flush of an older step
        # still on its way must not land after the flush of a member's last step (finish).
        self._flushing = asyncio.Lock()
        # Members whose Finish call is on its way: the step it names is final, and a beat still
        # carrying an older step (it raced the call) must not overwrite it.
        self._finishing: set[str] = set()
        # Every open heartbeat stream of each host, oldest first: an agent that reconnects has two for
        # a moment, and a second stream (a reconnect, or anyone with the incarnation) ending says
        # nothing about the host while another one still carries its heartbeats.
        self._streams: dict[str, list[AgentStream]] = {}
        # Whether the last plan was held or is waiting: the detector plans again each tick until not.
        # True at start: what was stored may be mid-burst.
        self._replan = True
        # Set by a change whose observations (not events) may change the plan: plan this change.
        self._plan_now = False
        # The state the planner last found nothing to do for (None: not planned yet). A commit of
        # only acknowledgements on it needs no plan: they change nothing a plan reads, and at 2000
        # hosts a new epoch is 2000 of them, each batch a sort of every member otherwise.
        self._settled: ClusterState | None = None
        # The members counted by state and role, kept up to date commit by commit (``_tally_of``).
        self._tally: Tally = tally({})
        # The members mapping the member gauges were last set from.
        self._gauged_members: Mapping[str, Member] | None = None
        # Changes waiting for the next batch commit, and the task that commits them (``_batched``).
        self._queue: list[_Queued] = []
        # The events goodput is computed from (and the log's first), kept as they are published; None
        # until this replica, leading, read them from the log (remesh.coordinator.goodput).
        self._goodput_log: goodput.Log | None = None
        self._goodput_at = 0.0
        self._queue_writer: asyncio.Task[None] | None = None
        # Rung when the topology may have changed: every topology watcher wakes at once (heartbeat
        # streams have doorbells of their own, rung with it).
        self._topology_changed = Doorbell()
        self._tasks: list[asyncio.Task[None]] = []
        self._store_down = False
        self._plan_log = _ChangeLogger()
        self._store_log = _ChangeLogger()
        # A single replica always leads; one of several leads while it holds the lease.
        self.leadership = Leadership(
            settings.ha,
            store,
            self.metrics,
            take_over=self._take_over,
            step_down=self._step_down,
            follow=self._mirror,
            on_store_error=self._lease_store_error,
        )

    @property
    def leading(self) -> bool:
        return self.leadership.leading

    @property
    def writable(self) -> bool:
        """Whether this replica can take writes now: it leads, and its store answers."""
        return self.leading and not self._store_down

    @property
    def advertise(self) -> str:
        return self.leadership.advertise

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self, advertise: str = "") -> None:
        self.leadership.advertise = self.leadership.advertise or advertise
        self.state, self._rev = await self.store.load()
        steps = await self.store.read_progress()
        self.observations = observations.loaded(self.observations, steps)
        self._grant_all(self._clock())
        self._update_gauges()
        log.info(
            "coordinator state loaded",
            job=self.settings.job_id,
            epoch=self.state.epoch,
            members=len(self.state.members),
            rev=self._rev,
        )
        self._tasks = [
            asyncio.create_task(self._detector_loop(), name="detector"),
            asyncio.create_task(self._progress_loop(), name="progress"),
        ]
        if self.settings.ha.enabled:
            self._tasks.append(asyncio.create_task(self.leadership.run(), name="lease"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.leading:
            with contextlib.suppress(CoordinatorError):
                await self._flush_progress()
            if self.settings.ha.enabled and self.store.fencing_token:
                # Hand over at once instead of making a follower wait for the lease to run out.
                with contextlib.suppress(StoreUnavailable):
                    await self.store.release_lease(self.store.fencing_token)
        await self.store.close()

    # ---- leadership (several replicas) -----------------------------------------------------------

    def not_leader(self, detail: str = "") -> NotLeader:
        return self.leadership.not_leader(detail)

    def _lease_store_error(self, exc: StoreUnavailable) -> None:
        self.metrics.store_errors.inc()
        self._store_log("store unavailable; cannot renew or take the lease", error=str(exc))

    async def _take_over(self, token: int) -> None:
        """Lead from the stored state, granting every member a fresh deadline before judging anyone."""
        async with self._lock:
            self.store.fencing_token = token
            try:
                self.state, self._rev = await self.store.load()
                steps = await self.store.read_progress()
            except StoreUnavailable:
                with contextlib.suppress(StoreUnavailable):
                    await self.store.release_lease(token)
                raise
            # The current epoch's furthest step is not known here: the planner takes the furthest of
            # the stored steps.
            self.observations = observations.loaded(self.observations, steps)
            self._grant_all(self._clock())
            self._dirty_steps = {}
            self._goodput_log = None  # read again from the log: another replica led meanwhile
            self.leadership.led(token)
        self._update_gauges()
        log.info(
            "role",
            role="leader",
            token=token,
            address=self.advertise,
            epoch=self.state.epoch,
            members=len(self.state.members),
            reason=f"took the lease; every member has {self.settings.detector.failover_grace_s}s "
            "to report before anyone is judged",
        )
        self._topology_may_have_changed()

    def _step_down(self, reason: str) -> None:
        if not self.leadership.stepped_down(reason):
            return
        self._liveness.clear()
        self._dirty_steps = {}
        # Agents streaming to this replica must find the new leader.
        for stream in self._every_stream():
            stream.command(Command.NOT_LEADER, reason)

    async def _mirror(self) -> None:
        """A follower's view of the stored state, for reads and topology watches."""
        epoch = self.state.epoch
        self.state, self._rev = await self.store.load()
        steps = await self.store.read_progress()
        self.observations = observations.loaded(self.observations, steps)
        self._update_gauges()
        if self.state.epoch != epoch:
            self._topology_may_have_changed()

    async def observe(self) -> ClusterState:
        """The state to answer a read with: a follower reads it from Redis, the leader has it."""
        if not self.leading:
            await self._mirror()
        return self.state

    def _grant_all(self, now: float) -> None:
        """Give every present member a fresh deadline: nobody is judged on silence we did not watch."""
        grace = self.settings.detector.failover_grace_s
        self._liveness.clear()
        for m in self.state.members.values():
            if m.state.is_up or m.state is MemberState.DRAINING:
                self._liveness.set(m.host_id, Liveness(m.incarnation, last_seen=now, not_before=now + grace))

    # ---- the one write path ----------------------------------------------------------------------

    async def _change(self, transition: Callable[[ClusterState, float], list[Event]]) -> list[Event]:
        """Run ``transition`` on the current state, plan, and commit the events in one atomic step."""
        stored, _ = await self._commit(_folded(lambda s, now: (transition(s, now), None)))
        return stored

    async def _commit(self, change: _Change[T]) -> tuple[list[Event], T]:
        """Run ``change`` on a fold of the current state, plan once from the state it folded to and the
        observations (as the change left them: a change that observes something replaces them here,
        under the lock, before the plan), and commit its events and the plan's in one atomic step:
        every event is folded once, here, and the store writes the state folded. Returns the events
        committed and what the change returned beside them (from its last run: a conflict runs it
        again)."""
        if not self.leading:
            raise self.not_leader()
        async with self._lock:
            for attempt in range(3):
                if not self.leading:
                    raise self.not_leader()
                now = self._clock()
                self._plan_now = False
                fold = Fold(self.state)
                events, answer = change(fold, now)
                planned: list[Event] = []
                # A change with no events on a settled state changes nothing a plan reads, held or
                # not (the clock is the detector's ticks' to watch): planned only when its
                # transition asks.
                if self._plan_now or not (
                    self.state is self._settled
                    and (not self._replan or not events)
                    and all(e.type in _PLAN_NEUTRAL for e in events)
                ):
                    after = fold.state
                    ready = self._ready(after, events)
                    decision = plan(now, after, self.observations, self.settings.planner, ready=ready)
                    # Held (a burst being collected) or waiting for a replacement: the clock alone
                    # will change the plan, so the detector asks again on every tick until it does.
                    self._replan = decision.kind in (Kind.HOLD, Kind.WAIT) or after.waiting_since is not None
                    self._plan_log(
                        "planner", decision=decision.kind.value, reason=decision.reason, epoch=after.epoch
                    )
                    planned = plan_events(now, after, decision, self.settings.planner, self.settings.job_id)
                    fold.add(planned)
                events = events + planned
                if not events:
                    self._settled = self.state
                    return [], answer
                try:
                    before, after = self.state, fold.state
                    stored = await self.store.commit(self._rev, before, after, events)
                    self.state = after
                    self._tally = self._tally_of(after, stored, before)
                except Conflict:
                    # Someone else wrote first: observe again and re-plan from what is stored.
                    log.warning("store changed under us; reloading", attempt=attempt)
                    self.state, self._rev = await self.store.load()
                    continue
                except Fenced as exc:
                    log.error("write refused by the store: this replica was deposed", error=str(exc))
                    self._step_down(str(exc))
                    raise self.not_leader(str(exc)) from exc
                except StoreUnavailable:
                    self.metrics.store_errors.inc()
                    raise
                self._rev += 1
                # A new topology is planned again by the next change; anything else was planned here.
                self._settled = None if planned else self.state
                await self._published(stored, now)
                return stored, answer
            raise Conflict("the store kept changing under the coordinator; retry")

    async def _published(self, events: list[Event], now: float) -> None:
        for event in events:
            self.metrics.events.labels(type=event.type.value).inc()
            if self._goodput_log is not None:
                self._goodput_log.add(event)
            # Applied to the observations as they are now: heartbeats went on during the commit.
            self.observations = observations.recorded(self.observations, event)
            topology = self.state.topology
            if event.type is EventType.EPOCH_LIVE and topology is not None and topology.epoch == event.epoch:
                self.metrics.epoch_live.observe(max(0.0, event.time - topology.created_at))
            # One acknowledgement per member per epoch: at a thousand hosts and more, a line each is
            # most of what the coordinator logs and ~30 us of its loop each, while the fan-out may
            # still be writing. At info, the epoch's `epoch_live` stands for them; at debug, each.
            (log.debug if event.type is EventType.EPOCH_ACKED else log.info)(
                event.type.value,
                host=event.host_id or None,
                incarnation=event.incarnation or None,
                epoch=event.epoch,
                reason=event.reason,
                **_recovery_of(self.settings.job_id, event),
            )
            if event.type is EventType.MEMBER_FORGOTTEN:
                self._liveness.pop(event.host_id)
                self._dirty_steps.pop(event.host_id, None)
                self._finishing.discard(event.host_id)
            member = event.member
            if member is not None and member.state is MemberState.JOINING:
                self._liveness.set(member.host_id, Liveness(member.incarnation, last_seen=now))
            if member is not None and member.state in (MemberState.DEAD, MemberState.LEFT):
                self._liveness.pop(member.host_id)
                self._send(member.host_id, member.incarnation, Command.REREGISTER, member.reason)
            if member is not None and member.state is MemberState.DRAINING:
                self._send(member.host_id, member.incarnation, Command.DRAIN, member.reason)
            if event.type in (EventType.TOPOLOGY_CHANGED, EventType.JOB_HALTED):
                self.metrics.epochs_published.inc()
            if event.type is EventType.JOB_FINISHED:
                for stream in self._every_stream():
                    stream.command(Command.FINISHED, event.reason)
        if any(e.type in (EventType.TOPOLOGY_CHANGED, EventType.JOB_HALTED) for e in events):
            self._topology_may_have_changed()
        self._update_gauges()

    def _send(self, host_id: str, incarnation: int, command: Command, reason: str) -> None:
        for stream in self._streams.get(host_id, ()):
            if stream.incarnation == incarnation:
                stream.command(command, reason)

    def _every_stream(self) -> list[AgentStream]:
        return [stream for streams in self._streams.values() for stream in streams]

    def _tally_of(
        self, state: ClusterState, events: Sequence[Event], since: ClusterState | None = None
    ) -> Tally:
        """``state``'s members counted by state and role, from the tally kept for ``since`` (the
        current state by default) that ``events`` turned into ``state``; the kept tally is counted
        afresh first when it is not ``since``'s (the state was loaded from the store)."""
        base = since if since is not None else self.state
        if self._tally.of is not base.members:
            self._tally = tally(base.members)
        return tally(state.members, self._tally, events)

    def _plan_again(self, state: ClusterState, now: float) -> list[Event]:
        """No change but the clock's: plan it."""
        self._plan_now = True
        return []

    def _ready(self, state: ClusterState, events: Sequence[Event]) -> int | None:
        """The alive active members of ``state`` for the planner, from the kept tally (``_tally_of``);
        None once the job has formed (only a forming job's plan reads it)."""
        if state.topology is not None:
            return None
        return self._tally_of(state, events).count(MemberState.ALIVE, Role.ACTIVE)

    def _update_gauges(self) -> None:
        if self.state.members is not self._gauged_members:  # acknowledgements change no member
            self._gauged_members = self.state.members
            counted = self._tally_of(self.state, ())
            self.metrics.set_members({state: counted.count(state) for state in MemberState})
        self.metrics.epoch.set(self.state.epoch)
        topology = self.state.topology
        self.metrics.world_size.set(topology.world_size if topology else 0)
        if topology is not None:
            self.metrics.set_epoch(topology.epoch, topology.reason, topology.created_at)

    # ---- detection -------------------------------------------------------------------------------

    async def _detector_loop(self) -> None:
        tick = self.settings.detector.tick_s
        last = self._clock()
        while True:
            await asyncio.sleep(tick)
            now = self._clock()
            stalled, last = now - last - tick, now
            if stalled > tick:
                self._credit_stall(stalled)
            try:
                await self.detect_once()
            except StoreUnavailable as exc:
                self._store_down = True
                self._store_log("store unavailable; nobody is judged until it is back", error=str(exc))
            except CoordinatorError as exc:
                log.warning("detector step refused", error=str(exc))

    def _credit_stall(self, seconds: float) -> None:
        """The coordinator itself did not run for ``seconds`` (CPU starvation, a GC pause): heartbeats
        may sit unread in its sockets, so silence it could not observe is not held against anyone."""
        log.warning(
            "detector stalled; not counting the stall as members' silence", stalled_s=round(seconds, 3)
        )
        self._liveness.shift(seconds)

    async def detect_once(self) -> None:
        if not self.leading:
            return
        if self._store_down:
            await self.store.ping()
            self._store_down = False
            # Heartbeats may have gone unanswered while the store was down: start every clock afresh.
            self._grant_all(self._clock())
            self._store_log("store reachable again; every member granted a fresh deadline")
        now = self._clock()
        # Only the members whose deadline came up are looked at (remesh.coordinator.liveness).
        due = self._liveness.due(now)
        silent = judge(now, self.state, self._liveness, self.settings.detector, hosts=due)
        judged = {v.host_id for v in silent}
        for host_id in due:
            self._liveness.reschedule(host_id, now, judged=host_id in judged)
        seen = self.observations
        verdicts = silent + judge_stalls(
            now,
            self.state,
            seen.stalls,
            seen.steps,
            self.settings.detector,
            seen.idle,
            seen.failed_in(self.state.epoch),
        )
        if verdicts:
            # Every verdict of this tick in one commit, planned together: hosts lost together (a rack,
            # a switch) make one new epoch, not one each.
            stored, _ = await self._commit(_declare_all(verdicts))
            declared = {e.host_id for e in stored if e.type is EventType.MEMBER_DEAD}
            for verdict in verdicts:
                if verdict.state is MemberState.DEAD and verdict.host_id in declared:
                    # From the first signal (the stream broke, or the last heartbeat) to the declaration.
                    self.metrics.detection.observe(verdict.silence_s)
            return
        # The planner's clock-driven decisions (a hold for suspects running out, waiting -> halted)
        # need a nudge without an event; only while one is pending (a plan sorts every member).
        # Planned once, in the write path: a decision to act is committed as it was made.
        if self._replan:
            await self._change(self._plan_again)

    async def _progress_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if not self.leading:
                continue
            try:
                await self._flush_progress()
                await self._keep_bounded()
                if self._clock() - self._goodput_at >= _GOODPUT_EVERY_S:
                    await self._refresh_goodput()
            except Fenced as exc:
                log.error("progress write refused by the store: this replica was deposed", error=str(exc))
                self._step_down(str(exc))
            except (NotLeader, Conflict):
                continue  # a newer writer, or a reload: the next round sees the new state
            except StoreUnavailable:
                self.metrics.store_errors.inc()

    async def _refresh_goodput(self) -> None:
        """The job's goodput so far, into the metrics. The first time (per leadership) the log is read
        whole, under the write lock so that no event is published meanwhile; then each event is
        folded in as it is published (``goodput.Log``), and a refresh walks epochs, not events."""
        if self._goodput_log is None:
            async with self._lock:
                log = goodput.Log()
                async for page in self.store.page_events():
                    for event in page:
                        log.add(event)
                self._goodput_log = log
        self._goodput_at = self._clock()
        step = self._furthest_step()
        self.metrics.set_goodput(self._goodput_log.goodput(self._goodput_at, step), step)

    def _furthest_step(self) -> int | None:
        """The furthest step a member of the current epoch reported: what the next topology will record
        as ``reached_step`` (the planner takes the same two figures)."""
        topology, seen = self.state.topology, self.observations
        steps = [seen.steps.get(h, -1) for h in (topology.host_ids if topology else ())]
        furthest = max([seen.reached, *steps])
        return furthest if furthest >= 0 else None

    async def _keep_bounded(self) -> None:
        """Forget members gone for longer than the retention, and cut the event log once it is longer
        than ``max_events`` (the state it folds to goes into the log first)."""
        now = self._clock()
        retention = self.settings.member_retention_s
        if any(now - m.updated_at >= retention for m in membership.forgettable(self.state)):
            await self._change(lambda s, t: membership.expire(t, s, retention))
        folded = await self.store.event_count()
        if folded <= self.settings.max_events:
            return
        async with self._lock:
            if not self.leading:
                return
            event = Event(
                EventType.LOG_COMPACTED,
                self._clock(),
                self.state.epoch,
                f"the event log was cut at {folded} events (--max-events {self.settings.max_events}): "
                "this event holds the state they fold to",
                details={"state": self.state.to_json()},
            )
            try:
                stored = await self.store.compact(self._rev, event)
            except Conflict:
                self.state, self._rev = await self.store.load()
                raise
            self._rev += 1
        await self._published([stored], now)

    async def _flush_progress(self) -> None:
        async with self._flushing:
            dirty, self._dirty_steps = self._dirty_steps, {}
            try:
                await self.store.write_progress(dirty)
            except StoreUnavailable:
                self._dirty_steps = {**dirty, **self._dirty_steps}
                raise

    # ---- API used by the gRPC layer --------------------------------------------------------------

    @property
    def _max_id(self) -> int:
        return self.settings.max_id_length

    async def register(self, host_id: str, role: Role, device_count: int, address: str) -> Member:
        def transition(s: ClusterState, now: float) -> tuple[list[Event], Member]:
            return membership.register(
                now, s, host_id, role, device_count, address, self._max_id, self.settings.max_members
            )

        member = await self._batched(transition)
        return self.state.members.get(host_id, member)

    async def heartbeat(self, host_id: str, incarnation: int, step: int, trainer_idle: bool = False) -> None:
        """Hot path: in memory unless the member changes state (joining or suspect -> alive)."""
        if not self.leading:
            raise self.not_leader()
        now = self._clock()
        self.metrics.heartbeats.inc()
        events = membership.heartbeat(now, self.state, host_id, incarnation, self._max_id)
        self._liveness.heard(host_id, incarnation, now)
        before = self.observations
        self.observations = observations.heard(
            before,
            self.state,
            host_id,
            incarnation,
            step,
            trainer_idle,
            now,
            finishing=host_id in self._finishing,
        )
        self._note_step(before, host_id)
        if events:
            await self._batched(
                lambda s, t: (membership.heartbeat(t, s, host_id, incarnation, self._max_id), None)
            )

    def attach_stream(self, host_id: str, incarnation: int) -> AgentStream:
        stream = AgentStream(host_id, incarnation)
        self._streams.setdefault(host_id, []).append(stream)
        seen = self._liveness.get(host_id)
        if seen is not None and seen.incarnation == incarnation:
            self._liveness.set(host_id, replace(seen, stream_broken_at=None))
        if self.state.finished:
            stream.command(Command.FINISHED, self._finished_reason())
        return stream

    def _finished_reason(self) -> str:
        return f"the job finished at step {self.state.finished_step}"

    def detach_stream(self, stream: AgentStream) -> None:
        # A stream ending is a signal only when it was the last one of the host's incarnation: while
        # another carries its heartbeats (a reconnect's old stream ending late, or a stream opened by
        # someone else and closed), the host is as alive as those heartbeats say.
        streams = self._streams.get(stream.host_id, [])
        if stream not in streams:
            return
        streams.remove(stream)
        if not streams:
            del self._streams[stream.host_id]
        if any(s.incarnation == stream.incarnation for s in streams):
            return
        seen = self._liveness.get(stream.host_id)
        if seen is not None and seen.incarnation == stream.incarnation and seen.stream_broken_at is None:
            self._liveness.set(stream.host_id, replace(seen, stream_broken_at=self._clock()))

    async def leave(self, host_id: str, incarnation: int, reason: str) -> Member:
        await self._change(lambda s, t: membership.leave(t, s, host_id, incarnation, reason, self._max_id))
        return self.state.members[host_id]

    async def drain(self, host_id: str, reason: str) -> Member:
        await self._change(lambda s, t: membership.drain(t, s, host_id, reason, self._max_id))
        return self.state.members[host_id]

    async def report_fault(
        self,
        host_id: str,
        incarnation: int,
        kind: membership.FaultKind,
        epoch: int,
        exit_code: int,
        detail: str,
    ) -> membership.FaultOutcome:
        """A member's trainer or host failed: charged to the host, or collateral damage (a trainer
        that waited for its peers when it exited is collateral of whatever stopped them)."""
        blocked_since = self.observations.blocked_since(host_id, epoch)

        def transition(s: ClusterState, now: float) -> tuple[list[Event], membership.FaultOutcome]:
            result = membership.report_fault(
                now, s, host_id, incarnation, kind, epoch, exit_code, detail, self._max_id, blocked_since
            )
            for event in result.events:
                if event.type is EventType.FAULT_REPORTED:
                    # Noted before this commit's plan, which may halt a crash loop with it
                    # (planner.crash_loop).
                    self.observations = observations.crashed(self.observations, event)
            if result.left_epoch:
                # Its peers may be waiting for it: the same members re-form unless a loss explains
                # the death within the detection window (planner.reform).
                self.observations, _ = observations.collective_failed(
                    self.observations,
                    s,
                    host_id,
                    incarnation,
                    epoch,
                    CollectiveFailureReport(f"its trainer exited while blocked ({kind.value})"),
                    now,
                    self._max_id,
                )
                self._plan_now = True
            if kind is membership.FaultKind.STATE_LOST:
                # Noted before this commit's plan, which halts the job with it (planner.state_lost).
                self.observations = observations.state_lost(
                    self.observations, s, host_id, incarnation, epoch, detail
                )
            return result.events, result

        _, outcome = await self._commit(_folded(transition))
        return outcome

    async def report_observation(self, host_id: str, incarnation: int, epoch: int, report: Report) -> str:
        """What a member's trainer observed in ``epoch`` (``observations.Report``): evidence to weigh,
        never a fault of its host by itself. Returns what the coordinator made of it."""
        if isinstance(report, StallReport):
            return self._stalled(host_id, incarnation, epoch, report)
        if isinstance(report, CollectiveFailureReport):
            return await self._collective_failed(host_id, incarnation, epoch, report)
        return await self._tier_missing(host_id, incarnation, epoch, report)

    def _stalled(self, host_id: str, incarnation: int, epoch: int, report: StallReport) -> str:
        """A member's trainer is blocked in a step: noted for the detector (``judge_stalls``), which
        decides whether a peer it waits for stopped. Nothing is committed."""
        if not self.leading:
            raise self.not_leader()
        before = self.observations
        self.observations, reason = observations.stalled(
            before, self.state, host_id, incarnation, epoch, report, self._clock(), self._max_id
        )
        if self.observations is not before:
            log.info("trainer blocked", host=host_id, epoch=epoch, step=report.step)
        return reason

    async def _collective_failed(
        self, host_id: str, incarnation: int, epoch: int, report: CollectiveFailureReport
    ) -> str:
        """A member's trainer said a collective of ``epoch`` failed. No event: the planner weighs the
        reports. Planned at once when they start its window and when the last member's completes
        them (a plan reads the whole fleet; the detector's ticks plan meanwhile, while it holds)."""

        def transition(s: ClusterState, now: float) -> tuple[list[Event], str]:
            before = self.observations
            self.observations, reason = observations.collective_failed(
                before, s, host_id, incarnation, epoch, report, now, self._max_id
            )
            failures = self.observations.collective_failures
            if self.observations is not before and failures is not None:
                self.metrics.collective_failures.inc()
                log.warning("collective failed", host=host_id, epoch=epoch, detail=report.detail)
                assert s.topology is not None  # noted for the running epoch only
                if len(failures.hosts) == 1 or len(failures.hosts) >= len(s.topology.host_ids):
                    self._plan_now = True
            return [], reason

        _, reason = await self._commit(_folded(transition))
        return reason

    async def _tier_missing(
        self, host_id: str, incarnation: int, epoch: int, report: TierMissingReport
    ) -> str:
        """A member's trainer says a tier cannot keep its snapshots: recorded once per member
        incarnation and tier (``membership.tier_missing``), never acted on."""

        def transition(s: ClusterState, now: float) -> tuple[list[Event], str]:
            noted = self.observations.tiers_noted_for(host_id, incarnation)
            return membership.tier_missing(
                now, s, host_id, incarnation, epoch, report.tier, report.detail, noted, self._max_id
            )

        _, reason = await self._commit(_folded(transition))
        return reason

    async def ack_epoch(
        self,
        host_id: str,
        incarnation: int,
        epoch: int,
        restored_step: int,
        restore_source: str,
        phases: Mapping[str, float],
        restored_bytes: Mapping[str, int] | None = None,
        reached_step: int = -1,
    ) -> bool:
        def transition(s: ClusterState, now: float) -> tuple[list[Event], bool]:
            return membership.ack_epoch(
                now,
                s,
                host_id,
                incarnation,
                epoch,
                restored_step,
                restore_source,
                phases,
                self._max_id,
                restored_bytes=restored_bytes,
                reached_step=reached_step,
            )

        await self._batched(transition)
        return self.state.live_epoch >= epoch

    async def _batched(self, transition: Callable[[ClusterState, float], tuple[list[Event], T]]) -> T:
        """``transition`` committed (``_commit``) together with every other change queued meanwhile;
        what it returned beside its events, or its refusal.

        Fleets do things together: a new epoch of N members is N acknowledgements at once, a job
        forming is N registrations and N first heartbeats. With one commit each, the last would wait
        for every other's round trip to Redis (and a plan each). Each transition still sees the
        state the ones before it produced, and a refusal answers its own caller only."""
        queued = _Queued(transition, asyncio.get_running_loop().create_future())
        self._queue.append(queued)
        if self._queue_writer is None or self._queue_writer.done():
            self._queue_writer = asyncio.create_task(self._commit_queued(), name="batched-changes")
        answer: T = await queued.answer
        return answer

    async def _commit_queued(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []

            def change(
                fold: Fold, now: float, batch: list[_Queued] = batch
            ) -> tuple[list[Event], list[tuple[bool, Any]]]:
                events: list[Event] = []
                answers: list[tuple[bool, Any]] = []
                for queued in batch:
                    if queued.answer.done():
                        # Its caller went away before the commit (a deadline ran out in a registration
                        # storm, a cancelled call): nothing is done on its behalf. A registration
                        # stored for nobody would wait for heartbeats that never come and be
                        # declared dead by silence.
                        answers.append((False, None))
                        continue
                    try:
                        found, answer = queued.transition(fold.state, now)
                    except CoordinatorError as exc:
                        answers.append((False, exc))
                        continue
                    answers.append((True, answer))
                    fold.add(found)
                    events += found
                return events, answers

            try:
                _, answers = await self._commit(change)
            except Exception as exc:  # the whole commit failed (Redis down, deposed): everyone hears it
                for queued in batch:
                    if not queued.answer.done():
                        queued.answer.set_exception(exc)
                continue
            for queued, (ok, answer) in zip(batch, answers, strict=True):
                if queued.answer.done():
                    continue  # the caller went away
                if ok:
                    queued.answer.set_result(answer)
                else:
                    queued.answer.set_exception(answer)

    async def commit_checkpoint(
        self, host_id: str, incarnation: int, epoch: int, step: int, tier: str
    ) -> None:
        try:
            await self._change(
                lambda s, t: membership.commit_checkpoint(
                    t, s, host_id, incarnation, epoch, step, tier, self._max_id
                )
            )
        except Rejected as exc:
            log.warning(
                "checkpoint commit refused", host=host_id, epoch=epoch, step=step, tier=tier, reason=str(exc)
            )
            raise

    async def finish(self, host_id: str, incarnation: int, epoch: int, step: int) -> None:
        """A member completed the job's last step. Its step is stored before the job is said finished:
        the heartbeat that carried it may still be on its way (it races this call), or it arrived and
        waits in memory for the next progress flush; whoever reads ``job_finished`` in the log must
        find the last step in the store too."""
        if not self.leading:
            raise self.not_leader()
        membership.current_member(self.state, host_id, incarnation, self._max_id)
        if not self.state.finished and epoch == self.state.epoch:
            self._finishing.add(host_id)
            before = self.observations
            self.observations = observations.final_step(before, self.state, host_id, incarnation, epoch, step)
            self._note_step(before, host_id)
        try:
            if not self.state.finished:
                try:
                    await self._flush_progress()
                except Fenced as exc:
                    self._step_down(str(exc))
                    raise self.not_leader(str(exc)) from exc
                except StoreUnavailable:
                    self.metrics.store_errors.inc()  # the finish below fails the same way; the agent retries
            await self._change(
                lambda s, t: membership.finish(t, s, host_id, incarnation, epoch, step, self._max_id)
            )
        finally:
            # Decided (the job finished: its steps are final anyway) or refused (a stale epoch: the
            # member goes on and its beats count again); a retry of a failed call says it again.
            self._finishing.discard(host_id)

    def _note_step(self, before: Observations, host_id: str) -> None:
        """A step of ``host_id`` that changed since ``before`` is written with the next progress flush."""
        steps = self.observations.steps
        if steps is not before.steps and steps.get(host_id, -1) != before.steps.get(host_id, -1):
            self._dirty_steps[host_id] = steps.get(host_id, -1)

    def member_step(self, host_id: str) -> int:
        return self.observations.steps.get(host_id, -1)

    def _topology_may_have_changed(self) -> None:
        self._topology_changed.ring()
        for stream in self._every_stream():
            stream.ring()

    async def _newer_topology(self, epoch: int) -> Topology:
        while True:
            topology = self.state.topology
            if topology is not None and topology.epoch > epoch:
                return topology
            await self._topology_changed.wait()

    async def watch_topology(self, after_epoch: int = 0) -> AsyncIterator[Topology]:
        """The current topology (if newer than ``after_epoch``), then the newest after each change.

        A slow watcher that misses an epoch gets the newest one next: a topology supersedes all before it.
        """
        sent = after_epoch
        while True:
            topology = await self._newer_topology(sent)
            sent = topology.epoch
            yield topology

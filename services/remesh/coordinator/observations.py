"""What the coordinator has observed beside its event log, as one immutable value. Pure.

The planner and the detector decide on two inputs: the stored state (``ClusterState``, the fold of
the event log) and ``Observations``: what the members' agents said that no event records. Each
member's newest step and whether its trainer is idle (heartbeats), trainers blocked in a step,
members whose collective failed, a member whose trainer found no state to restore, and what the
committed events of earlier epochs leave behind (re-forms in a row that completed no step, the
tiers already recorded missing).

The coordinator holds one ``Observations`` and replaces it, never changes it: every function below
takes the current value and one input and returns the next. Each opens with guard clauses, as the
member transitions do (``remesh.coordinator.membership``): a message from an incarnation that is not
the member's current one is refused (``Rejected``), or ignored where the call's own transition
refused it first (a heartbeat, a fault report, a Finish); one about an epoch that is not the running
one changes nothing. ``recorded`` folds in what a committed event says (a new epoch clears what the
old one saw).

In memory only, like liveness: a new leader starts from the steps the store holds
(``loaded``) and hears the rest again from the agents.

What a trainer reports through its agent's ``Observe`` call is one of the ``Report`` types; a report
is evidence for the coordinator to weigh, never a fault of the host by itself.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from remesh.coordinator.detector import Stall
from remesh.coordinator.frozen_map import FrozenMap
from remesh.coordinator.membership import (
    check_epoch,
    check_text,
    current_incarnation,
    current_member,
    of_running_epoch,
)
from remesh.coordinator.model import ClusterState, Event, EventType, FaultDetails, MemberState

__all__ = [
    "REFORM_DECISION",
    "CollectiveFailureReport",
    "CollectiveFailures",
    "Crash",
    "CrashLoop",
    "Observations",
    "Report",
    "StallReport",
    "StateLost",
    "TierMissingReport",
    "collective_failed",
    "crashed",
    "final_step",
    "heard",
    "loaded",
    "recorded",
    "repeats",
    "stalled",
    "state_lost",
]

# How a TOPOLOGY_CHANGED event records a re-form (details "decision": ``planner.Kind.REFORM``), in
# the event log's words: the planner reads these observations, so they cannot import it.
REFORM_DECISION = "reform"
# The fault kinds of a trainer that failed on its own (``membership.FaultKind``'s values): what a
# crash loop is made of.
_TRAINER_FAULTS = frozenset({"trainer_exited", "trainer_hung"})


@dataclass(frozen=True)
class StallReport:
    """The member's trainer has been blocked in the step after ``step`` (waiting in a collective)."""

    step: int


@dataclass(frozen=True)
class CollectiveFailureReport:
    """A collective of the epoch failed in the member's trainer, which left the epoch in-process and
    waits for the next (``detail``: the error)."""

    detail: str


@dataclass(frozen=True)
class TierMissingReport:
    """``tier`` cannot keep the member's trainer's snapshots (``detail``: the error). Recorded for
    operators as a TIER_MISSING event (``membership.tier_missing``), never weighed against the host."""

    tier: str
    detail: str


Report = StallReport | CollectiveFailureReport | TierMissingReport


@dataclass(frozen=True)
class CollectiveFailures:
    """Members of ``epoch`` whose trainer said a collective of it failed: they left the epoch and wait
    for the next. A lost member explains the failure and is replaced; otherwise the planner forms the
    same members again, once every member said so or once the detection window passed."""

    epoch: int
    # When the first of them said so.
    since: float
    # Each member that said so, and when it first did: every survivor of every failure says so, so a
    # look at one of them, or at how many they are, costs O(1), not O(fleet).
    hosts: FrozenMap[str, float]


@dataclass(frozen=True)
class StateLost:
    """A member of ``epoch`` found no tier holding any step of the job (no host-memory snapshot,
    surviving replica or buddy copy, and no readable committed checkpoint): the planner halts the job
    with the reason rather than let it start again from step 0."""

    epoch: int
    host_id: str
    detail: str


@dataclass(frozen=True)
class Crash:
    """A trainer failure in ``epoch`` charged to its host (declared dead for it): ``error`` is what
    its agent reported (the exit code or the hang, and the trainer's own error where its exit note
    gave one)."""

    epoch: int
    host_id: str
    error: str


@dataclass(frozen=True)
class CrashLoop:
    """Recoveries in a row from the same trainer error with no step completed between them: the
    failure follows the job (a bug in the training script, a setting every host shares), not a host.
    The planner grants ``PlannerSettings.max_repeated_crashes`` of them, then halts with the error."""

    error: str
    # The step the first recovery of the row restored: a later one that restores a newer step ends
    # the row (the job made progress between two failures).
    restore_step: int
    # The host whose trainer failed, for each recovery of the row (a host again counts again).
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Observations:
    """What the planner and the detector read beside the stored state; see the module docstring."""

    # Each member's newest completed step, from its heartbeats and its Finish call (-1, or no entry:
    # its trainer reported none). Flushed to the store in batches (``RedisStore.write_progress``).
    steps: FrozenMap[str, int] = field(default_factory=FrozenMap)
    # The furthest step a member that acknowledged the current epoch reported in it (-1: none): what
    # the next topology records as how far this epoch got. A member's own entry in ``steps`` falls
    # back to -1 when it registers again (every member does, in a whole-job restart).
    reached: int = -1
    # Members whose trainer used no CPU for a while (its agent said so in its last heartbeat), and
    # since when this coordinator heard so.
    idle: FrozenMap[str, float] = field(default_factory=FrozenMap)
    # Trainers their members reported blocked in a step of the current epoch
    # (``detector.judge_stalls``).
    stalls: FrozenMap[str, Stall] = field(default_factory=FrozenMap)
    # Members of the current epoch whose collective failed (None: none said so).
    collective_failures: CollectiveFailures | None = None
    # A member of the current epoch that found no state to restore (None: none did).
    lost_state: StateLost | None = None
    # The re-forms in a row whose epochs completed no step (the same hosts failing a collective each
    # time), and the restore step of the last re-form (None: the last new epoch was no re-form).
    futile_reforms: int = 0
    reformed_at_step: int | None = None
    # The first trainer failure charged to its host in the current epoch (None: none yet), and the
    # recoveries in a row from the same error that completed no step (None: the last recovery was
    # from something else, or the job made progress since).
    crash: Crash | None = None
    crash_loop: CrashLoop | None = None
    # The tiers recorded missing (TIER_MISSING) for each member: host -> (incarnation, tiers). What
    # bounds those events to one per member incarnation and tier.
    tiers_noted: FrozenMap[str, tuple[int, frozenset[str]]] = field(default_factory=FrozenMap)

    def failed_in(self, epoch: int) -> Collection[str]:
        """The members whose collective failed in ``epoch``."""
        failures = self.collective_failures
        return failures.hosts if failures is not None and failures.epoch == epoch else ()

    def blocked_since(self, host_id: str, epoch: int) -> float | None:
        """Since when ``host_id``'s trainer waited for its peers in ``epoch`` (None: it did not say
        so): blocked in a step it has not completed since, or left behind by a failed collective. A
        trainer that exits then is collateral damage of whatever stopped its peers."""
        stall = self.stalls.get(host_id)
        if stall is not None and stall.epoch == epoch and self.steps.get(host_id, -1) <= stall.step:
            return stall.at
        failures = self.collective_failures
        return failures.hosts.get(host_id) if failures is not None and failures.epoch == epoch else None

    def tiers_noted_for(self, host_id: str, incarnation: int) -> frozenset[str]:
        """The tiers recorded missing for this member incarnation."""
        noted = self.tiers_noted.get(host_id)
        return noted[1] if noted is not None and noted[0] == incarnation else frozenset()


def loaded(seen: Observations, steps: Mapping[str, int]) -> Observations:
    """The members' steps as the store holds them (the coordinator started, or leads again): they
    replace what this replica heard, and the current epoch's furthest step is not known."""
    return replace(seen, steps=FrozenMap(steps), reached=-1)


def heard(
    seen: Observations,
    state: ClusterState,
    host_id: str,
    incarnation: int,
    step: int,
    idle: bool,
    now: float,
    *,
    finishing: bool = False,
) -> Observations:
    """A heartbeat: its trainer's newest step (-1: none reported yet), and whether it is idle.

    ``finishing``: the member's Finish call is on its way, and the step it names is final (a beat
    still carrying an older step raced the call). Once the job finished, its steps are final too (an
    exiting agent's last beats change nothing)."""
    if not _is_current(state, host_id, incarnation):
        return seen  # refused by the heartbeat's own transition (membership.heartbeat) first
    if not idle:
        idled = seen.idle.without(host_id)
    else:
        idled = seen.idle if host_id in seen.idle else seen.idle.set(host_id, now)
    reached = seen.reached
    topology = state.topology
    if topology is not None and step > reached and state.acks.get(host_id) == topology.epoch:
        reached = step
    steps = seen.steps
    if steps.get(host_id, -1) != step and not state.finished and not finishing:
        # -1 comes from an agent whose trainer has reported nothing yet: a host that came back (a new
        # incarnation). Its old step is forgotten, else the next restore step (the oldest step of the
        # members) would send the job back to where that host left it.
        steps = steps.set(host_id, step)
    if idled is seen.idle and reached == seen.reached and steps is seen.steps:
        return seen
    return replace(seen, idle=idled, reached=reached, steps=steps)


def final_step(
    seen: Observations, state: ClusterState, host_id: str, incarnation: int, epoch: int, step: int
) -> Observations:
    """A member completed the job's last step, ``step``, in ``epoch`` (its Finish call): its newest
    step, whatever a heartbeat on its way says. A finished job's steps are final, and a call of
    another incarnation or epoch (refused by ``membership.finish``) or of an older step changes
    nothing."""
    if not _is_current(state, host_id, incarnation) or state.finished or epoch != state.epoch:
        return seen
    if step <= seen.steps.get(host_id, -1):
        return seen
    return replace(seen, steps=seen.steps.set(host_id, step))


def stalled(
    seen: Observations,
    state: ClusterState,
    host_id: str,
    incarnation: int,
    epoch: int,
    report: StallReport,
    now: float,
    max_length: int = 128,
) -> tuple[Observations, str]:
    """A member's trainer is blocked in the step after ``report.step`` of ``epoch``: noted for the
    detector (``judge_stalls``), which decides whether a peer it waits for stopped. The same report
    again keeps when it was first made. Returns the observations and the reason."""
    current_member(state, host_id, incarnation, max_length)
    check_epoch(state, epoch)
    if epoch != state.epoch:
        return seen, f"stall in epoch {epoch} ignored: epoch {state.epoch} is current"
    noted = f"{host_id} blocked in epoch {epoch} after step {report.step}: noted"
    old = seen.stalls.get(host_id)
    if old is not None and (old.epoch, old.step) == (epoch, report.step):
        return seen, noted
    return replace(seen, stalls=seen.stalls.set(host_id, Stall(epoch, report.step, now))), noted


def collective_failed(
    seen: Observations,
    state: ClusterState,
    host_id: str,
    incarnation: int,
    epoch: int,
    report: CollectiveFailureReport,
    now: float,
    max_length: int = 128,
) -> tuple[Observations, str]:
    """A member's trainer said a collective of ``epoch`` failed: counted for the planner once per
    member (it says so again while it waits), for the running epoch only. Returns the observations
    and the reason."""
    current_incarnation(state, host_id, incarnation, max_length)
    check_text("detail", report.detail)
    check_epoch(state, epoch)
    if not of_running_epoch(state, host_id, epoch) or state.finished:
        return seen, f"collective failure in epoch {epoch} from {host_id}: not of the running epoch, ignored"
    reason = f"{host_id} reported a failed collective in epoch {epoch}: {report.detail or 'no detail'}"
    failures = seen.collective_failures
    if failures is None or failures.epoch != epoch:
        failures = CollectiveFailures(epoch, now, FrozenMap())
    if host_id in failures.hosts:
        return seen, reason
    said = replace(failures, hosts=failures.hosts.set(host_id, now))
    return replace(seen, collective_failures=said), reason


def state_lost(
    seen: Observations, state: ClusterState, host_id: str, incarnation: int, epoch: int, detail: str
) -> Observations:
    """A member's trainer found no tier holding any step of the job (a STATE_LOST fault, which
    ``membership.report_fault`` records and checks first): for the running epoch, the planner halts
    the job. Any other such report changes nothing here."""
    if not _is_current(state, host_id, incarnation) or state.finished:
        return seen
    if not of_running_epoch(state, host_id, epoch):
        return seen
    return replace(seen, lost_state=StateLost(epoch, host_id, detail))


def _is_current(state: ClusterState, host_id: str, incarnation: int) -> bool:
    member = state.members.get(host_id)
    return member is not None and member.incarnation == incarnation


def recorded(seen: Observations, event: Event) -> Observations:
    """What a committed event changes here: a new epoch (or the halt) clears what the old one saw and
    counts re-forms in a row; a recorded missing tier is noted; a member gone or forgotten is no
    longer idle, and a forgotten one leaves nothing behind."""
    if event.type in (EventType.TOPOLOGY_CHANGED, EventType.JOB_HALTED):
        return _new_epoch(seen, event)
    if event.type is EventType.FAULT_REPORTED:
        return crashed(seen, event)
    if event.type is EventType.TIER_MISSING:
        noted = seen.tiers_noted_for(event.host_id, event.incarnation) | {event.details["tier"]}
        return replace(seen, tiers_noted=seen.tiers_noted.set(event.host_id, (event.incarnation, noted)))
    if event.type is EventType.MEMBER_FORGOTTEN:
        host = event.host_id
        return replace(
            seen,
            steps=seen.steps.without(host),
            idle=seen.idle.without(host),
            stalls=seen.stalls.without(host),
            tiers_noted=seen.tiers_noted.without(host),
        )
    member = event.member
    if (
        member is not None
        and member.state in (MemberState.DEAD, MemberState.LEFT)
        and member.host_id in seen.idle
    ):
        return replace(seen, idle=seen.idle.without(member.host_id))
    return seen


def crashed(seen: Observations, event: Event) -> Observations:
    """A fault report (a FAULT_REPORTED event): the epoch's first trainer failure charged to its host
    is noted, for the crash loop its recovery extends or starts (``_new_epoch``). The same event
    again changes nothing (the coordinator notes it before the plan of its own commit)."""
    fault = FaultDetails.decode(event.details)
    if not fault.charged or fault.kind not in _TRAINER_FAULTS:
        return seen
    if seen.crash is not None and seen.crash.epoch >= event.epoch:
        return seen
    error = f"{fault.kind}: {fault.detail or f'exit code {fault.exit_code}'}"
    return replace(seen, crash=Crash(event.epoch, event.host_id, error))


def repeats(loop: CrashLoop, crash: Crash, restore_step: int) -> bool:
    """Whether a recovery from ``crash`` that restores ``restore_step`` extends ``loop``: the same
    error, and no step completed since the row began."""
    return loop.error == crash.error and restore_step <= loop.restore_step


def _extended(loop: CrashLoop | None, crash: Crash, restore_step: int) -> CrashLoop:
    """The crash loop after a recovery from ``crash`` that restores ``restore_step``."""
    if loop is not None and repeats(loop, crash, restore_step):
        return replace(loop, hosts=(*loop.hosts, crash.host_id))
    return CrashLoop(crash.error, restore_step, (crash.host_id,))


def _new_epoch(seen: Observations, event: Event) -> Observations:
    """A new topology (or the halt): its own steps, stalls and failures from now on. A re-form counts
    as futile after another one when no step was completed between them (its restore step did not
    move on); any other new epoch ends the row. A recovery from a trainer failure extends the crash
    loop of the same error, or starts one; a new epoch past the loop's restore step ends it."""
    topology = event.topology
    crash, loop = seen.crash, seen.crash_loop
    if crash is not None and crash.epoch >= event.epoch:
        crash = None  # of an epoch this one does not replace (a late event)
    if topology is not None and not topology.halted:
        if crash is not None:
            loop = _extended(loop, crash, topology.restore_step)
        elif loop is not None and topology.restore_step > loop.restore_step:
            loop = None
    failures = seen.collective_failures
    lost = seen.lost_state
    if event.details.get("decision") != REFORM_DECISION or topology is None:
        futile, at_step = 0, None
    else:
        last = seen.reformed_at_step
        futile = seen.futile_reforms + 1 if last is not None and topology.restore_step <= last else 0
        at_step = topology.restore_step
    return replace(
        seen,
        reached=-1,
        stalls=FrozenMap(),
        collective_failures=failures if failures is not None and failures.epoch >= event.epoch else None,
        lost_state=lost if lost is not None and lost.epoch >= event.epoch else None,
        futile_reforms=futile,
        reformed_at_step=at_step,
        crash=seen.crash if seen.crash is not None and seen.crash.epoch >= event.epoch else None,
        crash_loop=loop,
    )

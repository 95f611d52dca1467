"""The member state machine: one pure transition function per input.

Each function takes the clock and the current ``ClusterState``, checks its guards first (unknown host,
stale incarnation, wrong state, stale epoch) and returns the events that record the change; it never
mutates anything. A refused input raises a ``CoordinatorError`` and so changes nothing.

::

    register ─> joining ──heartbeat──> alive ──silence/stream break──> suspect ──> dead
                                         ^                                │
                                         └────────────heartbeat──────────┘
    leave ─> left          drain ─> draining ─(replaced)─> leave ─> left
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from remesh.coordinator.errors import InvalidRequest, JobFinished, NotFound, Rejected, ResourceExhausted
from remesh.coordinator.model import (
    ClusterState,
    Event,
    EventType,
    FaultDetails,
    Member,
    MemberState,
    Role,
    replay,
)

__all__ = [
    "TIERS_NOTED",
    "FaultKind",
    "FaultOutcome",
    "ack_epoch",
    "check_epoch",
    "check_text",
    "commit_checkpoint",
    "current_incarnation",
    "current_member",
    "declare",
    "drain",
    "expire",
    "finish",
    "forgettable",
    "heartbeat",
    "leave",
    "of_running_epoch",
    "register",
    "report_fault",
    "tier_missing",
    "validate_host_id",
]

# fullmatch, not match with "$": "$" also matches before a trailing newline.
_HOST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
_MAX_DEVICES = 65536
# Free-form text from a client (reasons, details): it lands in events, logs and operators' terminals.
_MAX_TEXT = 1024
# Control characters (terminal escapes among them) have no place in any of it.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# Where peers reach a host: a DNS name or an address, optionally with a port ([v6]:port included).
_ADDRESS = re.compile(r"[A-Za-z0-9._:\[\]-]{0,255}")
# A recovery phase's name in an acknowledgement, and how many an acknowledgement may carry.
_PHASE = re.compile(r"[a-z][a-z0-9_]{0,39}")
_MAX_PHASES = 32
# A previous reason quoted in a new one: one level, never the whole history.
_QUOTED_REASON = 200
# A checkpoint tier's name ("local", "gcs"): it lands in events and logs.
_TIER = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# Tiers one member incarnation may say cannot keep its snapshots, each recorded once (``tier_missing``):
# a trainer has a few ("host-shm", "buddy"); the bound holds a host naming a new one in every report.
TIERS_NOTED = 8


class FaultKind(enum.StrEnum):
    """What a fault report says happened to a member's trainer or host. What a trainer merely
    observed (a stall, a failed collective, a missing tier) is no fault: ``observations``."""

    TRAINER_EXITED = "trainer_exited"
    TRAINER_HUNG = "trainer_hung"
    HOST = "host"
    ADDRESS_IN_USE = "address_in_use"
    STATE_LOST = "state_lost"
    TRAINER_RESTARTED = "trainer_restarted"


@dataclass(frozen=True)
class FaultOutcome:
    events: list[Event]
    member_dead: bool
    reason: str
    # The trainer died waiting for its peers in the running epoch, and nothing explains it yet: its
    # peers may wait for it in turn, so unless a loss comes in the detection window, the same members
    # must re-form (noted as a failed collective of the epoch, ``observations.collective_failed``).
    left_epoch: bool = False


def validate_host_id(host_id: str, max_length: int) -> None:
    if not host_id:
        raise InvalidRequest("host_id is empty: give every host a stable, unique id")
    if len(host_id) > max_length:
        raise InvalidRequest(f"host_id is {len(host_id)} characters long; the limit is {max_length}")
    if not _HOST_ID.fullmatch(host_id):
        raise InvalidRequest(
            f"host_id {host_id!r} has characters outside [A-Za-z0-9._:-] or does not start with a letter or digit"
        )


def check_text(name: str, value: str) -> None:
    """Free-form text from a client: bounded, and plain (no control characters)."""
    if len(value) > _MAX_TEXT:
        raise InvalidRequest(f"{name} is {len(value)} characters long; the limit is {_MAX_TEXT}")
    if _CONTROL.search(value):
        raise InvalidRequest(
            f"{name} contains control characters (terminal escapes, newlines): send plain text"
        )


def check_epoch(state: ClusterState, epoch: int) -> None:
    """An epoch a member's report names: one the coordinator published."""
    if epoch < 0:
        raise InvalidRequest(f"epoch {epoch} is negative")
    if epoch > state.epoch:
        raise InvalidRequest(f"epoch {epoch} was never published (current {state.epoch})")


def of_running_epoch(state: ClusterState, host_id: str, epoch: int) -> bool:
    """Whether a report of ``epoch`` from ``host_id`` is of the epoch that runs now, from one of its
    members."""
    topology = state.topology
    return (
        topology is not None
        and not topology.halted
        and epoch == topology.epoch
        and host_id in topology.host_set
    )


def _address(value: str) -> None:
    if not _ADDRESS.fullmatch(value):
        raise InvalidRequest(
            f"address {value[:40]!r} is not a host name or IP address (with an optional port), "
            "at most 255 characters"
        )


def _phases(phases: Mapping[str, float]) -> None:
    if len(phases) > _MAX_PHASES:
        raise InvalidRequest(f"phases names {len(phases)} phases; the limit is {_MAX_PHASES}")
    for name, seconds in phases.items():
        if not _PHASE.fullmatch(name):
            raise InvalidRequest(f"phase {name[:40]!r} is not a short snake_case name like 'restore'")
        # Durations, and a wall-clock start (``started_at``): non-negative, finite, before 2286.
        if not math.isfinite(seconds) or not 0 <= seconds <= 1e10:
            raise InvalidRequest(f"phase {name}: {seconds} is not a finite, non-negative number of seconds")


def _quoted(reason: str) -> str:
    """An earlier reason quoted in a new one: its own words only (not what it quoted), and short."""
    own = reason.split(" (was ", 1)[0]
    return own if len(own) <= _QUOTED_REASON else own[: _QUOTED_REASON - 3] + "..."


def _member(state: ClusterState, host_id: str, max_length: int) -> Member:
    validate_host_id(host_id, max_length)
    member = state.members.get(host_id)
    if member is None:
        raise NotFound(f"unknown host {host_id!r}: it never registered with this job")
    return member


def current_incarnation(state: ClusterState, host_id: str, incarnation: int, max_length: int = 128) -> Member:
    """The member, if ``incarnation`` is its current one; stale or future incarnations are refused."""
    member = _member(state, host_id, max_length)
    if incarnation < member.incarnation:
        raise Rejected(
            f"stale incarnation {incarnation} for {host_id}: the current one is {member.incarnation}; "
            "this message is from an older run of the agent and is ignored"
        )
    if incarnation > member.incarnation:
        raise Rejected(
            f"incarnation {incarnation} for {host_id} was never issued (current {member.incarnation}): register first"
        )
    return member


def _refuse_if_finished(state: ClusterState) -> None:
    if state.finished:
        raise JobFinished(
            f"the job finished at step {state.finished_step}: there is nothing left to join or run",
            state.finished_step,
        )


def current_member(state: ClusterState, host_id: str, incarnation: int, max_length: int = 128) -> Member:
    """The member, if ``incarnation`` is its current one and it is not gone; a refusal otherwise."""
    member = current_incarnation(state, host_id, incarnation, max_length)
    if member.state in (MemberState.DEAD, MemberState.LEFT):
        raise Rejected(f"{host_id} incarnation {incarnation} is {member.state.value} ({member.reason})")
    return member


def _event(type_: EventType, now: float, state: ClusterState, member: Member, reason: str) -> Event:
    return Event(
        type_, now, state.epoch, reason, host_id=member.host_id, incarnation=member.incarnation, member=member
    )


def forgettable(state: ClusterState) -> list[Member]:
    """Members the state may drop, oldest first: dead or left, and in no current topology."""
    in_topology = set(state.topology.host_ids) if state.topology is not None else set()
    gone = [
        m
        for m in state.members.values()
        if m.state in (MemberState.DEAD, MemberState.LEFT) and m.host_id not in in_topology
    ]
    return sorted(gone, key=lambda m: (m.updated_at, m.host_id))


def _forget(now: float, state: ClusterState, members: Sequence[Member], why: str) -> list[Event]:
    return [
        Event(
            EventType.MEMBER_FORGOTTEN,
            now,
            state.epoch,
            f"forgotten: {m.state.value} since {m.updated_at:.0f} ({why})",
            host_id=m.host_id,
            incarnation=m.incarnation,
        )
        for m in members
    ]


def expire(now: float, state: ClusterState, retention_s: float, limit: int = 1000) -> list[Event]:
    """Forget members dead or left for ``retention_s`` or longer (at most ``limit`` at once)."""
    old = [m for m in forgettable(state) if now - m.updated_at >= retention_s][:limit]
    return _forget(now, state, old, f"kept {retention_s:g}s")


def register(
    now: float,
    state: ClusterState,
    host_id: str,
    role: Role,
    device_count: int,
    address: str,
    max_length: int = 128,
    max_members: int = 0,
) -> tuple[list[Event], Member]:
    """A host joins (or rejoins with a new incarnation). With ``max_members`` a newcomer that finds
    the job full makes room by forgetting the oldest dead or left members; with none to forget it is
    refused (``ResourceExhausted``)."""
    validate_host_id(host_id, max_length)
    if not 0 <= device_count <= _MAX_DEVICES:
        raise InvalidRequest(f"device_count {device_count} is outside 0..{_MAX_DEVICES}")
    _address(address)
    _refuse_if_finished(state)
    if state.halted:
        raise Rejected(
            f"the job is halted ({state.topology.reason if state.topology else ''}): start a new job"
        )
    old = state.members.get(host_id)
    room: list[Event] = []
    if old is None and max_members and len(state.members) >= max_members:
        excess = len(state.members) - max_members + 1
        gone = forgettable(state)[:excess]
        if len(gone) < excess:
            raise ResourceExhausted(
                f"the job has {len(state.members)} members (the limit is {max_members}) and none is "
                "dead or left to make room: drain or remove hosts, or raise --max-members"
            )
        room = _forget(now, state, gone, f"room for {host_id} under the limit of {max_members} members")
        state = replay(room, state)
    incarnation = old.incarnation + 1 if old else state.incarnation_floor + 1
    in_topology = state.topology is not None and host_id in state.topology.host_set
    if old is not None and in_topology and old.state.is_up:
        # The same host came back before anyone judged it (a coordinator restart, a reconnect): it
        # keeps its rank, so the epoch does not change.
        member = replace(
            old,
            incarnation=incarnation,
            state=MemberState.JOINING,
            device_count=device_count,
            address=address,
            reason=f"re-registered with incarnation {incarnation}; keeps rank {old.rank}",
            updated_at=now,
        )
        return [_event(EventType.MEMBER_REJOINED, now, state, member, member.reason)], member
    # Once the job has formed every newcomer waits as a spare until the planner places it.
    new_role = role if state.topology is None else Role.SPARE
    reason = (
        f"registered as {new_role.value} with incarnation {incarnation}"
        if old is None
        else f"rejoined as {new_role.value} with incarnation {incarnation} (was {old.state.value}: {_quoted(old.reason)})"
    )
    member = Member(
        host_id=host_id,
        incarnation=incarnation,
        role=new_role,
        state=MemberState.JOINING,
        device_count=device_count,
        address=address,
        rank=-1,
        reason=reason,
        updated_at=now,
    )
    type_ = EventType.MEMBER_JOINED if old is None else EventType.MEMBER_REJOINED
    return [*room, _event(type_, now, state, member, reason)], member


def heartbeat(
    now: float, state: ClusterState, host_id: str, incarnation: int, max_length: int = 128
) -> list[Event]:
    """A heartbeat of the current incarnation: joining or suspect members become alive."""
    member = current_incarnation(state, host_id, incarnation, max_length)
    if member.state in (MemberState.DEAD, MemberState.LEFT):
        raise Rejected(
            f"{host_id} incarnation {incarnation} is {member.state.value} ({member.reason}): register again"
        )
    if member.state in (MemberState.ALIVE, MemberState.DRAINING):
        return []
    reason = "first heartbeat" if member.state is MemberState.JOINING else "heartbeat refuted the suspicion"
    alive = replace(member, state=MemberState.ALIVE, reason=reason, updated_at=now)
    return [_event(EventType.MEMBER_ALIVE, now, state, alive, reason)]


def declare(
    now: float, state: ClusterState, host_id: str, incarnation: int, new: MemberState, reason: str
) -> list[Event]:
    """A detector verdict (suspect or dead). Re-checks that the verdict still applies; after the job
    finished nobody is judged (agents leave it by closing their streams)."""
    if state.finished:
        return []
    member = state.members.get(host_id)
    if member is None or member.incarnation != incarnation or member.state is new:
        return []
    if not (member.state.is_up or member.state is MemberState.DRAINING):
        return []
    if new is MemberState.SUSPECT and member.state is not MemberState.ALIVE:
        return []
    type_ = EventType.MEMBER_DEAD if new is MemberState.DEAD else EventType.MEMBER_SUSPECT
    updated = replace(member, state=new, reason=reason, updated_at=now)
    return [_event(type_, now, state, updated, reason)]


def leave(
    now: float, state: ClusterState, host_id: str, incarnation: int, reason: str, max_length: int = 128
) -> list[Event]:
    member = current_incarnation(state, host_id, incarnation, max_length)
    check_text("reason", reason)
    if member.state in (MemberState.LEFT, MemberState.DEAD):
        return []
    why = f"left: {reason or 'no reason given'}"
    left = replace(member, state=MemberState.LEFT, reason=why, updated_at=now)
    return [_event(EventType.MEMBER_LEFT, now, state, left, why)]


def drain(now: float, state: ClusterState, host_id: str, reason: str, max_length: int = 128) -> list[Event]:
    member = _member(state, host_id, max_length)
    check_text("reason", reason)
    if member.state is MemberState.DRAINING:
        return []
    if not member.state.is_up:
        raise Rejected(f"{host_id} is {member.state.value}: only a live member can be drained")
    why = f"drained by an operator: {reason or 'no reason given'}"
    draining = replace(member, state=MemberState.DRAINING, reason=why, updated_at=now)
    return [_event(EventType.MEMBER_DRAINING, now, state, draining, why)]


def report_fault(
    now: float,
    state: ClusterState,
    host_id: str,
    incarnation: int,
    kind: FaultKind,
    epoch: int,
    exit_code: int,
    detail: str,
    max_length: int = 128,
    blocked_since: float | None = None,
) -> FaultOutcome:
    """Charge a trainer fault to its host (dead, replaced) unless it was collateral damage.

    A trainer that dies because a peer died (its collective broke, or the JAX runtime aborted when
    rank 0 went away) is not at fault: its host stays, and its agent restarts it on the new epoch.
    That is the case when the trainer ran an older epoch, another member of the same epoch is
    already failing, or it had reported being blocked in a step of this epoch (``blocked_since``:
    it waited for a peer until its collective gave up).
    """
    member = current_incarnation(state, host_id, incarnation, max_length)
    check_text("detail", detail)
    check_epoch(state, epoch)
    details = FaultDetails(kind.value, epoch, exit_code, detail)
    topology = state.topology
    in_topology = topology is not None and host_id in topology.host_set
    rank0 = topology.host_ids[0] if topology is not None and topology.host_ids else None
    failing = (
        [h for h in topology.host_ids if h != host_id and state.members[h].state is not MemberState.ALIVE]
        if topology is not None and in_topology
        else []
    )
    running = of_running_epoch(state, host_id, epoch)
    left = False
    if state.finished:
        # A trainer that aborts after the job's last step (JAX's shutdown with a peer already gone)
        # cost nothing: nothing is recorded.
        return FaultOutcome(
            [], False, f"the job finished at step {state.finished_step}: {kind.value} is not a fault"
        )
    if kind is FaultKind.STATE_LOST:
        # A member of the current epoch found no tier holding any step of the job: blamed on nobody.
        # The coordinator notes it (``observations.state_lost``) and the planner halts the job.
        if running:
            reason = f"state_lost: {detail or 'no tier holds the restore step'}"
        else:
            reason = f"state_lost for epoch {epoch} from {host_id}: not the current epoch, ignored"
        return FaultOutcome([_fault_event(now, state, host_id, incarnation, reason, details)], False, reason)
    if kind is FaultKind.TRAINER_RESTARTED:
        # The trainer could not recover in place and its agent started a fresh process on the same
        # topology: the reason is recorded for operators (why in-process recovery was not the path),
        # nobody is blamed and nothing is planned.
        reason = f"trainer_restarted on {host_id} in epoch {epoch}: {detail or 'no reason given'}"
        return FaultOutcome([_fault_event(now, state, host_id, incarnation, reason, details)], False, reason)
    if kind is FaultKind.ADDRESS_IN_USE:
        # Rank 0's trainer found the epoch's JAX coordination port taken by another process: no
        # fault of the host. For the current epoch, reported by its rank 0, the event marks the
        # epoch refused (``ClusterState.address_refused_epoch``) and the planner forms the same
        # members into a new epoch on another port; any other such report changes nothing.
        dead = False
        if topology is not None and running and rank0 == host_id:
            reason = (
                f"address_in_use: {topology.jax_coordinator_address} of epoch {epoch} is taken on "
                f"{host_id}; the same members move to a new address"
            )
            details = replace(details, address_refused=True)
        else:
            reason = (
                f"address_in_use for epoch {epoch} from {host_id}: not rank 0 of the current epoch, ignored"
            )
    elif not member.state.is_up:
        reason = f"{kind.value} reported for {host_id}, which is already {member.state.value}"
        dead = False
    elif topology is not None and epoch < topology.epoch:
        # Also for a host that is no longer in the topology (shrunk away): its trainer died with
        # the epoch it ran, not because of the host.
        reason = f"collateral: the trainer ran epoch {epoch}, the topology moved on to {topology.epoch}"
        dead = False
    elif failing:
        reason = f"collateral: {', '.join(failing)} failing in the same epoch"
        dead = False
        # A suspect may yet be refuted by its next heartbeat, and then nothing would replace the epoch.
        left = running
    elif blocked_since is not None:
        reason = (
            f"collateral: its trainer was blocked waiting for its peers since {blocked_since:.2f} "
            f"({kind.value}: {detail or f'exit code {exit_code}'})"
        )
        dead = False
        left = running
    else:
        reason = f"{kind.value}: {detail or f'exit code {exit_code}'}"
        dead = True
    events = [_fault_event(now, state, host_id, incarnation, reason, replace(details, charged=dead))]
    if dead:
        events += declare(now, state, host_id, incarnation, MemberState.DEAD, reason)
    return FaultOutcome(events, dead, reason, left_epoch=left)


def _fault_event(
    now: float, state: ClusterState, host_id: str, incarnation: int, reason: str, details: FaultDetails
) -> Event:
    return Event(
        EventType.FAULT_REPORTED,
        now,
        state.epoch,
        reason,
        host_id=host_id,
        incarnation=incarnation,
        details=details.encode(),
    )


def tier_missing(
    now: float,
    state: ClusterState,
    host_id: str,
    incarnation: int,
    epoch: int,
    tier: str,
    detail: str,
    noted: AbstractSet[str],
    max_length: int = 128,
) -> tuple[list[Event], str]:
    """A member's trainer says ``tier`` cannot keep its snapshots (``detail``: the error): they are
    kept in its process only. An observation for operators, never a fault: nobody is suspected,
    nothing is planned, and the event folds to no change. Recorded (TIER_MISSING) the first time
    this member incarnation says it of ``tier``; ``noted`` is the tiers recorded for it already, so
    a host repeating itself, or naming tier after tier, adds at most ``TIERS_NOTED`` events per
    incarnation. Returns the events and the reason."""
    current_member(state, host_id, incarnation, max_length)
    if not _TIER.fullmatch(tier):
        raise InvalidRequest(f"tier {tier[:40]!r} is not a short lowercase name like 'host-shm' or 'buddy'")
    check_text("detail", detail)
    check_epoch(state, epoch)
    if state.finished:
        return [], f"the job finished at step {state.finished_step}: {tier} on {host_id} keeps nothing more"
    if tier in noted:
        return [], f"{tier} missing on {host_id} incarnation {incarnation}: recorded already"
    if len(noted) >= TIERS_NOTED:
        return [], (
            f"{tier} missing on {host_id} not recorded: incarnation {incarnation} named {len(noted)} "
            f"missing tiers already, the limit"
        )
    reason = (
        f"{tier} cannot keep {host_id}'s snapshots ({detail or 'no detail'}): they are kept in its "
        "trainer process only, and a trainer restarted there finds none"
    )
    details = {"tier": tier, "detail": detail, "epoch": str(epoch)}
    event = Event(
        EventType.TIER_MISSING,
        now,
        state.epoch,
        reason,
        host_id=host_id,
        incarnation=incarnation,
        details=details,
    )
    return [event], reason


def ack_epoch(
    now: float,
    state: ClusterState,
    host_id: str,
    incarnation: int,
    epoch: int,
    restored_step: int,
    restore_source: str,
    phases: Mapping[str, float],
    max_length: int = 128,
    restored_bytes: Mapping[str, int] | None = None,
    reached_step: int = -1,
) -> tuple[list[Event], bool]:
    """A trainer runs ``epoch``; once all members of the epoch acknowledged it, the epoch is live.

    ``restored_bytes``: where its state came from, bytes per tier (recorded with the event).
    ``reached_step``: the newest step its trainer completed before ``epoch`` (-1: none it knows of),
    recorded where known: the progress reports the topology's reached_step came from may lag it."""
    member = current_incarnation(state, host_id, incarnation, max_length)
    if not member.state.is_up:
        raise Rejected(
            f"{host_id} is {member.state.value}: a member that is not up cannot acknowledge an epoch"
        )
    check_text("restore_source", restore_source)
    _phases(phases)
    tiers = dict(restored_bytes or {})
    if len(tiers) > 16:
        raise InvalidRequest(f"restored_bytes names {len(tiers)} tiers; the limit is 16")
    for tier, nbytes in tiers.items():
        check_text("restored_bytes tier", tier)
        if not tier or nbytes < 0:
            raise InvalidRequest(f"restored_bytes: {tier!r} -> {nbytes} is not a tier and a byte count")
    topology = state.topology
    if topology is None or topology.halted:
        raise Rejected("there is no running topology to acknowledge")
    if epoch != topology.epoch:
        raise Rejected(f"stale epoch {epoch}: the current epoch is {topology.epoch}; acknowledge that one")
    if host_id not in topology.host_set:
        raise Rejected(f"{host_id} is not a member of epoch {epoch}")
    if state.acks.get(host_id) == epoch:
        return [], state.live_epoch >= epoch
    details = {
        "restored_step": str(restored_step),
        "restore_source": restore_source,
        "phases": json.dumps(dict(phases), sort_keys=True),
    }
    if tiers:
        details["restored_bytes"] = json.dumps(tiers, sort_keys=True)
    if reached_step >= 0:
        details["reached_step"] = str(reached_step)
    events = [
        Event(
            EventType.EPOCH_ACKED,
            now,
            epoch,
            f"{host_id} runs epoch {epoch}, restored step {restored_step} from {restore_source or 'unknown'}",
            host_id=host_id,
            incarnation=incarnation,
            details=details,
        )
    ]
    # Only members of the epoch acknowledge it (above), each once, and a new epoch starts with none
    # (ClusterState.acks): it is live at the last of them.
    live = len(state.acks) + 1 == len(topology.host_set)
    if live:
        events.append(
            Event(EventType.EPOCH_LIVE, now, epoch, f"all {topology.world_size} members run epoch {epoch}")
        )
    return events, live


def _in_current_epoch(state: ClusterState, member: Member, epoch: int, what: str) -> None:
    """Guards for a message that acts for ``epoch``: it must be the running epoch, and the member in it."""
    if not member.state.is_up:
        raise Rejected(f"{member.host_id} is {member.state.value} ({member.reason}): it cannot {what}")
    topology = state.topology
    if topology is None or topology.halted:
        raise Rejected(f"there is no running topology: {member.host_id} cannot {what}")
    if epoch != topology.epoch:
        raise Rejected(
            f"stale epoch {epoch}: epoch {topology.epoch} is current; a member of an older epoch cannot {what}"
        )
    if member.host_id not in topology.host_set:
        raise Rejected(f"{member.host_id} is not a member of epoch {epoch}: it cannot {what}")


def commit_checkpoint(
    now: float,
    state: ClusterState,
    host_id: str,
    incarnation: int,
    epoch: int,
    step: int,
    tier: str,
    max_length: int = 128,
) -> list[Event]:
    """Accept a checkpoint commit only from a member of the current epoch: the arbiter of commits.

    The trainer writes its commit marker only after this accepted: a writer from an older epoch (a
    host paused or cut off through an epoch change) is refused however long it was away, because the
    epoch it names is no longer current here. An accepted commit is recorded once per tier.
    """
    member = current_incarnation(state, host_id, incarnation, max_length)
    if step < 0:
        raise InvalidRequest(f"step {step} is negative")
    if not _TIER.fullmatch(tier):
        raise InvalidRequest(f"tier {tier[:40]!r} is not a short lowercase name like 'local' or 'gcs'")
    _in_current_epoch(state, member, epoch, f"commit a checkpoint for epoch {epoch}")
    details = {"step": str(step), "tier": tier}
    return [
        Event(
            EventType.CHECKPOINT_COMMITTED,
            now,
            epoch,
            f"{host_id} committed step {step} to {tier} in epoch {epoch}",
            host_id=host_id,
            incarnation=incarnation,
            details=details,
        )
    ]


def finish(
    now: float,
    state: ClusterState,
    host_id: str,
    incarnation: int,
    epoch: int,
    step: int,
    max_length: int = 128,
) -> list[Event]:
    """A member of the current epoch completed the job's last step (after every member did: the
    trainer waits for all at a barrier first): the job is finished. Later reports change nothing."""
    member = current_incarnation(state, host_id, incarnation, max_length)
    if step < 0:
        raise InvalidRequest(f"step {step} is negative")
    if state.finished:
        return []
    _in_current_epoch(state, member, epoch, f"finish the job in epoch {epoch}")
    return [
        Event(
            EventType.JOB_FINISHED,
            now,
            epoch,
            f"the job finished: every member of epoch {epoch} completed step {step} ({host_id} reported)",
            host_id=host_id,
            incarnation=incarnation,
            details={"step": str(step)},
        )
    ]

"""The planner: from observed membership to the next topology, with a reason. Pure.

``plan(now, state, steps, settings)`` looks at the current topology and the members' states and
decides one of:

- FORM     no topology yet and enough eligible hosts: the first epoch.
- REPLACE  members of the topology are gone and enough spares are up: each spare takes a lost
           member's rank, every survivor keeps its own (same world size, same mesh).
- SHRINK   not enough spares: the largest valid world size from survivors and spares, survivors
           first in their old order.
- GROW     nothing lost, the job runs below its target size and spares are up.
- READDRESS nothing lost, but rank 0 found the epoch's JAX coordination port taken: the same
           members in a new epoch (whose port differs).
- REFORM   nothing lost, but members said a collective of the epoch failed (``Broken``; a network
           failure between healthy hosts): the same members in a new epoch, once every member said
           so, or once ``settings.reform_after_s`` passed without a loss (a lost member would
           have explained the failure and been replaced instead). Held until then.
- HOLD     members are lost: the plan waits until ``settings.burst_window_s`` passed without
           another loss or suspicion (at most ``settings.burst_max_s`` from the first), for the rest
           of a burst however long it spreads, and while others of the topology are suspect (their
           verdicts are near: dead, or refuted by a heartbeat) up to ``settings.suspect_hold_s``, so
           a correlated failure becomes one epoch instead of one per host.
- WAIT     below the minimum size: wait (a JOB_WAITING event marks the start) up to a bound.
- HALT     the wait ran out: a final, empty topology with the reason.
- NONE     nothing to do.

It reads no clock and does no I/O; ``plan_events`` turns a decision into the events to commit.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from remesh.coordinator.model import (
    ClusterState,
    Event,
    EventType,
    Member,
    MemberState,
    Role,
    Topology,
    TopologyMember,
    tally,
)
from remesh.coordinator.settings import PlannerSettings

__all__ = ["Broken", "Decision", "Kind", "natural_key", "plan", "plan_events"]


class Kind(enum.StrEnum):
    NONE = "none"
    FORM = "form"
    REPLACE = "replace"
    SHRINK = "shrink"
    GROW = "grow"
    READDRESS = "readdress"
    REFORM = "reform"
    HOLD = "hold"
    WAIT = "wait"
    HALT = "halt"


_DIGITS = re.compile(r"(\d+)")


@dataclass(frozen=True)
class Decision:
    kind: Kind
    reason: str
    # The new ordered active set (FORM, REPLACE, SHRINK, GROW).
    hosts: tuple[str, ...] = ()
    restore_step: int = -1
    details: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Broken:
    """Members of an epoch said a collective of it failed (``FAULT_KIND_COLLECTIVE_FAILED``): their
    trainers left it and wait for the next. Observations the coordinator keeps in memory, as it keeps
    stall reports: the event log records the new epoch they lead to, with its reason."""

    epoch: int
    # When the first of them said so.
    since: float
    # How many members of the epoch said so.
    reported: int
    # The re-forms in a row that led here whose epochs completed no step (the epoch's restore step
    # is the one before): the same hosts failing a collective each time.
    futile: int = 0


@functools.lru_cache(maxsize=65536)
def natural_key(host_id: str) -> tuple[object, ...]:
    """Sort ``host-2`` before ``host-10``. Cached: every plan sorts every live member by it."""
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(host_id))


def _restore_step(survivors: Sequence[str], steps: Mapping[str, int], fallback: int) -> int:
    """The newest step every survivor reported completing (``fallback`` where none did): in the event
    log, how far the job got; to the trainers, whether it completed a step at all. They restore the
    newest step they hold between them, which a report on its way may put past this one."""
    known = [steps[h] for h in survivors if h in steps and steps[h] >= 0]
    return min(known) if known else fallback


def _grown(hosts: Sequence[str], spares: Sequence[str], settings: PlannerSettings) -> tuple[str, ...]:
    """``hosts`` and, after them, as many ``spares`` as make the largest valid size (none where that
    is not larger)."""
    target = settings.largest_valid_size(len(hosts) + len(spares))
    return (*hosts, *spares[: max(0, target - len(hosts))])


def plan(
    now: float,
    state: ClusterState,
    steps: Mapping[str, int],
    settings: PlannerSettings,
    reached: int | None = None,
    ready: int | None = None,
    broken: Broken | None = None,
) -> Decision:
    """``reached``: the furthest step a member reported in the current epoch, where the caller tracked
    it (a member that registered again reports -1 in ``steps``); else the furthest of ``steps``.
    ``ready``: how many members are alive and active, where the caller keeps count
    (``model.tally``); else they are counted here. ``broken``: the members' reports of a failed
    collective, where any came."""
    topology = state.topology
    if topology is not None and topology.halted:
        return Decision(Kind.NONE, f"job halted: {topology.reason}")
    if state.finished:
        return Decision(Kind.NONE, f"job finished at step {state.finished_step}")
    if topology is None:
        # Counted before anything is sorted: a forming job of thousands is planned once per commit of
        # its registrations and first heartbeats, and only the last of those plans forms it.
        if ready is None:
            ready = tally(state.members).count(MemberState.ALIVE, Role.ACTIVE)
        if ready < settings.world_size:
            return Decision(
                Kind.NONE, f"forming: {ready} of {settings.world_size} hosts registered and alive"
            )
    up = sorted(
        (m for m in state.members.values() if m.state is MemberState.ALIVE),
        key=lambda m: natural_key(m.host_id),
    )

    if topology is None:
        eligible = [m.host_id for m in up if m.role is Role.ACTIVE]
        hosts = tuple(eligible[: settings.world_size])
        return Decision(Kind.FORM, f"formed with {len(hosts)} hosts", hosts=hosts, restore_step=-1)

    current = topology.host_ids
    # A member listed here that registered again as a spare (it died while the job waited, then came
    # back) is a new process: it lost its rank, and may take one again only in a new epoch.
    lost = [h for h in current if not state.members[h].state.is_up or state.members[h].role is Role.SPARE]
    gone = set(lost)
    survivors = [h for h in current if h not in gone]
    staying = set(survivors)
    # Spares that were never lost first: a host lost a moment ago that registered again within the
    # burst window (its trainer crashed, its agent is fine) goes back in only when no one else can.
    spares = sorted((m.host_id for m in up if m.host_id not in staying), key=lambda h: h in gone)
    # How far the epoch being replaced got (its furthest member): recorded with the new topology, so
    # the event log alone says how many steps a recovery threw away (remesh.coordinator.goodput).
    furthest = max((steps[h] for h in current if h in steps), default=-1)
    reached_step = max(furthest, reached if reached is not None else -1)
    details = {"reached_step": str(reached_step)}
    # Where no survivor reported a step (every member was lost: a job of one whose trainer died), the
    # steps the lost ones completed still count: -1 would tell the new members the job never
    # completed one, and they would start from scratch past every snapshot and checkpoint it kept.
    restore = _restore_step(survivors, steps, max(topology.restore_step, reached_step))

    if not lost and state.address_refused_epoch == topology.epoch:
        return Decision(
            Kind.READDRESS,
            f"{topology.jax_coordinator_address} was taken on {current[0]}: same hosts, new address",
            current,
            topology.restore_step,
            details,
        )
    if not lost and broken is not None and broken.epoch == topology.epoch:
        waited = now - broken.since
        suspects = [h for h in current if state.members[h].state is MemberState.SUSPECT]
        everyone = broken.reported >= len(current)
        # A member that stopped (its host silent, its trainer hung) reports nothing, and its verdict
        # comes within the detection window: until then the failure may be its doing.
        if not everyone and (
            waited < settings.reform_after_s
            or (suspects and waited < settings.reform_after_s + settings.suspect_hold_s)
        ):
            return Decision(
                Kind.HOLD,
                f"{broken.reported} of {len(current)} members said a collective of epoch {topology.epoch} "
                f"failed: waiting up to {settings.reform_after_s:g}s for the others or for a lost member",
            )
        if broken.futile >= settings.max_futile_reforms:
            return Decision(
                Kind.HALT,
                f"halted: a collective of epoch {topology.epoch} failed, as in each of the "
                f"{broken.futile} epochs these hosts were re-formed into before it, with no step "
                f"completed since step {topology.restore_step}: a link among {', '.join(current)} "
                "fails every time (check the network between them, or drain one), and forming them "
                "again would not end it",
            )
        hosts = _grown(current, spares, settings)
        why = (
            "every member"
            if everyone
            else f"{broken.reported} of {len(current)} members, and none was lost in {waited:.1f}s,"
        )
        grew = f"; grew to {len(hosts)} hosts" if len(hosts) > len(current) else ""
        return Decision(
            Kind.REFORM,
            f"{why} said a collective of epoch {topology.epoch} failed: the same hosts form a new epoch{grew}",
            hosts,
            restore,
            details,
        )
    if not lost:
        hosts = _grown(current, spares, settings)
        if len(hosts) > len(current):
            added = ", ".join(hosts[len(current) :])
            return Decision(
                Kind.GROW,
                f"grew from {len(current)} to {len(hosts)} hosts: added {added}",
                hosts,
                restore,
                details,
            )
        return Decision(Kind.NONE, "topology healthy")

    if lost and state.waiting_since is None:
        # Planned now, the epoch would list hosts that are probably gone too: one more recovery a
        # moment later. Every loss of a burst is collected for a short window, and while members of
        # the topology are suspect (their verdict is near) up to a longer bound.
        held = now - min(state.members[h].updated_at for h in lost)
        suspects = [h for h in survivors if state.members[h].state is MemberState.SUSPECT]
        # The burst's newest loss or suspicion: while they keep coming, the burst is not over.
        quiet = now - max(state.members[h].updated_at for h in (*lost, *suspects))
        if quiet < settings.burst_window_s and held < max(settings.burst_max_s, settings.burst_window_s):
            return Decision(
                Kind.HOLD,
                f"{', '.join(lost)} lost: collecting the burst until {settings.burst_window_s:g}s pass "
                f"without another loss (at most {settings.burst_max_s:g}s)",
            )
        if suspects and held < settings.suspect_hold_s:
            return Decision(
                Kind.HOLD,
                f"{', '.join(lost)} lost while {', '.join(suspects)} suspect: waiting up to "
                f"{settings.suspect_hold_s:g}s to plan them together",
            )

    why_lost = "; ".join(
        f"{h} lost, registered again since as a spare"
        if state.members[h].state.is_up
        else f"{h} {state.members[h].state.value} ({state.members[h].reason})"
        for h in lost
    )
    if len(spares) >= len(lost):
        replacement = dict(zip(lost, spares, strict=False))
        hosts = tuple(replacement.get(h, h) for h in current)
        swaps = ", ".join(
            f"{h} re-joins at rank {current.index(h)}"
            if s == h
            else f"hot spare {s} takes rank {current.index(h)} of {h}"
            for h, s in replacement.items()
        )
        # A job below its size (shrunk before) with spares left over grows in the same epoch: the
        # next plan would otherwise grow it at once, a second recovery for one event.
        grown = _grown(hosts, [h for h in spares if h not in replacement.values()], settings)
        if len(grown) > len(hosts):
            swaps += f"; grew from {len(hosts)} to {len(grown)} hosts: added {', '.join(grown[len(hosts) :])}"
        return Decision(Kind.REPLACE, f"{why_lost}: {swaps}", grown, restore, details)

    pool = [*survivors, *spares]
    size = settings.largest_valid_size(len(pool))
    if size >= max(1, settings.min_world_size):
        hosts = tuple(pool[:size])
        return Decision(
            Kind.SHRINK,
            f"{why_lost}: {len(spares)} spare(s) for {len(lost)} lost; shrank from {len(current)} to {size} hosts",
            hosts,
            restore,
            details,
        )

    if state.waiting_since is None:
        return Decision(
            Kind.WAIT,
            f"{why_lost}: {len(pool)} host(s) up, minimum is {settings.min_world_size}; "
            f"waiting up to {settings.max_wait_s:g}s for a replacement",
        )
    waited = now - state.waiting_since
    if waited >= settings.max_wait_s:
        return Decision(
            Kind.HALT,
            f"halted: waited {waited:.1f}s for a replacement, only {len(pool)} host(s) up, "
            f"minimum is {settings.min_world_size}",
        )
    return Decision(Kind.NONE, f"waiting for a replacement ({waited:.1f}s of {settings.max_wait_s:g}s)")


def _topology(
    now: float, state: ClusterState, decision: Decision, settings: PlannerSettings, job_id: str
) -> Topology:
    epoch = state.epoch + 1
    members = tuple(
        TopologyMember(
            host_id=h,
            rank=rank,
            device_count=state.members[h].device_count,
            address=state.members[h].address,
        )
        for rank, h in enumerate(decision.hosts)
    )
    port = settings.jax_port(job_id, epoch)
    devices = min(m.device_count for m in members) if members else 0
    return Topology(
        epoch=epoch,
        members=members,
        mesh_shape=(len(members), max(devices, 1)),
        jax_coordinator_address=f"{members[0].address or '127.0.0.1'}:{port}",
        restore_step=decision.restore_step,
        reason=decision.reason,
        created_at=now,
        job_id=job_id,
        commits=state.commits,
    )


def plan_events(
    now: float, state: ClusterState, decision: Decision, settings: PlannerSettings, job_id: str = ""
) -> list[Event]:
    """The events that carry out ``decision``: member rank/role updates, then the topology event."""
    if decision.kind in (Kind.NONE, Kind.HOLD):
        return []
    if decision.kind is Kind.WAIT:
        return [
            Event(EventType.JOB_WAITING, now, state.epoch, decision.reason, details=dict(decision.details))
        ]

    if decision.kind is Kind.HALT:
        topology = Topology(
            epoch=state.epoch + 1,
            members=(),
            mesh_shape=(),
            jax_coordinator_address="",
            restore_step=state.topology.restore_step if state.topology else -1,
            reason=decision.reason,
            created_at=now,
            halted=True,
            job_id=job_id,
        )
        hosts: tuple[str, ...] = ()
        final_type = EventType.JOB_HALTED
    else:
        topology = _topology(now, state, decision, settings, job_id)
        hosts = decision.hosts
        final_type = EventType.TOPOLOGY_CHANGED

    events: list[Event] = []
    # Each member's rank from one table: ``hosts.index`` per member was a walk of the new epoch's
    # hosts for each (0.23 s of a 5000-member epoch's publication, quadratic in the fleet).
    ranks = {host_id: rank for rank, host_id in enumerate(hosts)}
    for member in sorted(state.members.values(), key=lambda m: natural_key(m.host_id)):
        rank = ranks.get(member.host_id, -1)
        role = Role.ACTIVE if rank >= 0 else (Role.SPARE if state.topology is not None else member.role)
        if rank == member.rank and role is member.role:
            continue
        updated: Member = replace(member, rank=rank, role=role, updated_at=now)
        what = f"rank {rank} in epoch {topology.epoch}" if rank >= 0 else f"not in epoch {topology.epoch}"
        events.append(
            Event(
                EventType.MEMBER_ASSIGNED,
                now,
                state.epoch,
                f"{what} ({decision.kind.value})",
                host_id=member.host_id,
                incarnation=member.incarnation,
                member=updated,
            )
        )
    events.append(
        Event(
            final_type,
            now,
            topology.epoch,
            decision.reason,
            topology=topology,
            details={"decision": decision.kind.value, **decision.details},
        )
    )
    return events

"""Failure detection: which members are silent or gone, judged from liveness observed in memory. Pure.

Liveness is not stored in Redis per heartbeat: the leader keeps it in memory (``Liveness``) and calls
``judge`` on every tick. Signals, fastest first:

- the heartbeat stream broke (the agent's process died, its socket closed): suspect at once, dead
  after a short grace unless the agent registers again;
- no heartbeat for ``suspect_after_s``: suspect; for ``heartbeat_timeout_s``: dead;
- (agent-reported trainer faults are handled by ``membership.report_fault``;)
- every other member of the epoch reported its trainer blocked in the same step, and this one did
  not (``judge_stalls``): its trainer stopped taking part (frozen, hung), so its peers wait on it.

Nobody is judged before ``Liveness.not_before``: a new leader, or one whose store was down, first
grants every member a fresh deadline.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from remesh.coordinator.model import ClusterState, MemberState
from remesh.coordinator.settings import DetectorSettings

__all__ = ["Liveness", "Stall", "Verdict", "judge", "judge_stalls"]


@dataclass(frozen=True)
class Liveness:
    incarnation: int
    # Last heartbeat, or the moment liveness was granted (registration, coordinator start).
    last_seen: float
    not_before: float = 0.0
    stream_broken_at: float | None = None


class _Lookup(Protocol):
    def get(self, host_id: str, /) -> Liveness | None: ...


@dataclass(frozen=True)
class Stall:
    """A member's report that its trainer is blocked in a step (waiting in a collective)."""

    epoch: int
    # Steps completed when it became blocked: the report holds while the member reports no more.
    step: int
    at: float


@dataclass(frozen=True)
class Verdict:
    host_id: str
    incarnation: int
    state: MemberState
    reason: str
    # Seconds from the first signal to this verdict's threshold (for the detection histogram).
    silence_s: float


def judge(
    now: float,
    state: ClusterState,
    liveness: _Lookup,
    settings: DetectorSettings,
    hosts: Iterable[str] | None = None,
) -> list[Verdict]:
    """Verdicts on ``hosts`` (every member when None; the coordinator passes only those whose
    deadline came up, see ``remesh.coordinator.liveness``)."""
    verdicts: list[Verdict] = []
    if state.finished:
        return verdicts  # agents leave a finished job by closing their streams: nobody is judged
    members = (
        state.members.values()
        if hosts is None
        else [m for h in hosts if (m := state.members.get(h)) is not None]
    )
    for member in members:
        if not (member.state.is_up or member.state is MemberState.DRAINING):
            continue
        seen = liveness.get(member.host_id)
        if seen is None or seen.incarnation != member.incarnation or now < seen.not_before:
            continue
        silence = now - seen.last_seen
        broken = seen.stream_broken_at if settings.stream_break_signal else None
        if broken is not None and now - broken >= settings.stream_grace_s:
            verdicts.append(
                Verdict(
                    member.host_id,
                    member.incarnation,
                    MemberState.DEAD,
                    f"heartbeat stream broke {now - broken:.2f}s ago and the agent did not come back",
                    now - broken,
                )
            )
        elif silence >= settings.heartbeat_timeout_s:
            verdicts.append(
                Verdict(
                    member.host_id,
                    member.incarnation,
                    MemberState.DEAD,
                    f"no heartbeat for {silence:.2f}s (timeout {settings.heartbeat_timeout_s:g}s)",
                    silence,
                )
            )
        elif member.state is MemberState.ALIVE and (
            broken is not None or silence >= settings.suspect_after_s
        ):
            why = "heartbeat stream broke" if broken is not None else f"no heartbeat for {silence:.2f}s"
            verdicts.append(Verdict(member.host_id, member.incarnation, MemberState.SUSPECT, why, silence))
    return verdicts


def judge_stalls(
    now: float,
    state: ClusterState,
    stalls: Mapping[str, Stall],
    steps: Mapping[str, int],
    settings: DetectorSettings,
    idle: Collection[str],
    failed: Collection[str] = (),
) -> list[Verdict]:
    """Members every other member of the epoch is blocked waiting for, and whose trainer is idle
    (``idle``: its agent saw it use no CPU for a while): dead. Not a member in ``failed``: its trainer
    said a collective of the epoch failed and waits, idle, for the next epoch; it did not stop.

    A member whose trainer is frozen (stopped, hung) sends heartbeats as usual, but its peers block
    in the next collective and report it; it reports nothing. Once the reports have held for
    ``stall_verdict_s`` (a member that merely lags finishes its step first, and the reports lapse as
    its peers' steps advance), the members that did not report and whose trainers are idle are
    declared dead, provided they are no more than those that did: one confused reporter never blames
    a majority, and a member that still computes (starved of CPU, say) is never blamed.
    """
    topology = state.topology
    if topology is None or topology.halted or state.finished:
        return []
    blocked = {
        h: s
        for h, s in stalls.items()
        if h in topology.host_set and s.epoch == topology.epoch and steps.get(h, -1) <= s.step
    }
    if not blocked:
        return []
    members = topology.host_ids
    waited = now - min(s.at for s in blocked.values())
    if waited < settings.stall_verdict_s:
        return []
    waiting = [h for h in members if h not in blocked and h not in failed and state.members[h].state.is_up]
    if not waiting or len(waiting) > len(blocked) or not all(h in idle for h in waiting):
        return []
    reporters = ", ".join(sorted(blocked))
    return [
        Verdict(
            h,
            state.members[h].incarnation,
            MemberState.DEAD,
            f"its trainer stopped taking part in epoch {topology.epoch}: {reporters} blocked "
            f"{waited:.2f}s waiting for it",
            waited,
        )
        for h in waiting
    ]

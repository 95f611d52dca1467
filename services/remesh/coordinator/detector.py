"""Failure detection: which members are silent or gone, judged from liveness observed in memory. Pure.

Liveness is not stored in Redis per heartbeat: the leader keeps it in memory (``Liveness``) and calls
``judge`` on every tick. Signals, fastest first:

- the heartbeat stream broke (the agent's process died, its socket closed): suspect at once, dead
  after a short grace unless the agent registers again;
- no heartbeat for ``suspect_after_s``: suspect; for ``heartbeat_timeout_s``: dead;
- (agent-reported trainer faults are handled by ``membership.report_fault``.)

Nobody is judged before ``Liveness.not_before``: a new leader, or one whose store was down, first
grants every member a fresh deadline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from remesh.coordinator.model import ClusterState, MemberState
from remesh.coordinator.settings import DetectorSettings

__all__ = ["Liveness", "Verdict", "judge"]


@dataclass(frozen=True)
class Liveness:
    incarnation: int
    # Last heartbeat, or the moment liveness was granted (registration, coordinator start).
    last_seen: float
    not_before: float = 0.0
    stream_broken_at: float | None = None


@dataclass(frozen=True)
class Verdict:
    host_id: str
    incarnation: int
    state: MemberState
    reason: str
    # Seconds from the first signal to this verdict's threshold (for the detection histogram).
    silence_s: float


def judge(
    now: float, state: ClusterState, liveness: Mapping[str, Liveness], settings: DetectorSettings
) -> list[Verdict]:
    verdicts: list[Verdict] = []
    if state.finished:
        return verdicts  # agents leave a finished job by closing their streams: nobody is judged
    for member in state.members.values():
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

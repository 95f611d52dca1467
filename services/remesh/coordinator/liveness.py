"""Members' liveness as the leader observes it, with the next moment each one needs looking at. Pure.

A detector that looked at every member on every tick (every 25 ms) would make, at 10,000 members,
400,000 looks a second to find, most of the time, nobody. So the table keeps, beside each member's
``Liveness``, a heap of deadlines: the moment its silence would make it suspect or dead, its broken
stream's grace ends, or a grant runs out. ``due(now)`` hands the detector only the members whose
deadline passed; the detector judges them (``detector.judge`` with ``hosts``) and ``reschedule``
queues their next deadline. A heartbeat queues nothing: it only moves ``last_seen``, and a deadline
that comes up for a member that has been heard from since is simply moved on (lazy), so the heap
holds about one entry per member and the work per tick is the members actually due.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

from remesh.coordinator.detector import Liveness
from remesh.coordinator.settings import DetectorSettings

__all__ = ["LivenessTable"]


class LivenessTable:
    def __init__(self, settings: DetectorSettings) -> None:
        self.settings = settings
        # Each member's record; its ``last_seen`` is kept apart (``_last``), the hot path.
        self._entries: dict[str, Liveness] = {}
        # Last heartbeat per member, on a clock that stops while the observer stalls: the real time
        # minus ``_credit``, the stalls credited so far. A heartbeat is one float written here.
        self._last: dict[str, float] = {}
        self._credit = 0.0
        # (deadline, host): may hold stale entries for a host; ``due`` drops those.
        self._heap: list[tuple[float, str]] = []
        # The earliest deadline queued for each host (a later one is not queued again).
        self._queued: dict[str, float] = {}

    # ---- reading ---------------------------------------------------------------------------------

    def get(self, host_id: str) -> Liveness | None:
        seen = self._entries.get(host_id)
        if seen is None:
            return None
        return replace(seen, last_seen=self._last[host_id] + self._credit)

    def __contains__(self, host_id: object) -> bool:
        return host_id in self._entries

    def __getitem__(self, host_id: str) -> Liveness:
        seen = self.get(host_id)
        if seen is None:
            raise KeyError(host_id)
        return seen

    # ---- writing ---------------------------------------------------------------------------------

    def set(self, host_id: str, liveness: Liveness) -> None:
        """A new record (a grant, a new incarnation, a stream event): its deadlines are queued."""
        self._entries[host_id] = liveness
        self._last[host_id] = liveness.last_seen - self._credit
        self._queue(host_id, self._next(liveness, after=float("-inf")))

    def heard(self, host_id: str, incarnation: int, now: float) -> None:
        """A heartbeat of ``incarnation``: the fast path, one float written and no deadline queued
        (the queued one moves on when it comes up). Another incarnation starts a new record."""
        seen = self._entries.get(host_id)
        if seen is not None and seen.incarnation == incarnation:
            self._last[host_id] = now - self._credit
        else:
            self.set(host_id, Liveness(incarnation, last_seen=now))

    def pop(self, host_id: str) -> None:
        self._entries.pop(host_id, None)
        self._last.pop(host_id, None)
        self._queued.pop(host_id, None)

    def clear(self) -> None:
        self._entries.clear()
        self._last.clear()
        self._heap.clear()
        self._queued.clear()

    def shift(self, seconds: float) -> None:
        """The observer did not run for ``seconds``: nobody's silence in that time counts (every
        last heartbeat moves that much later, at the cost of one addition). Deadlines only move
        later, so those queued come up early and move on."""
        self._credit += seconds

    # ---- deadlines -------------------------------------------------------------------------------

    def due(self, now: float) -> list[str]:
        """The members whose deadline is ``now`` or earlier (each once), taken off the queue: judge
        them, then ``reschedule`` each."""
        hosts: list[str] = []
        while self._heap and self._heap[0][0] <= now:
            deadline, host = heapq.heappop(self._heap)
            if self._queued.get(host) != deadline:
                continue  # stale: the host was forgotten, or an earlier deadline of it came up already
            del self._queued[host]
            if host in self._entries:
                hosts.append(host)
        return hosts

    def reschedule(self, host_id: str, now: float, judged: bool) -> None:
        """Queue ``host_id``'s next deadline after ``now``. ``judged``: a verdict was just given (it
        may not be committed yet): look again on the next tick, until the member's record goes."""
        seen = self.get(host_id)
        if seen is None:
            return
        if judged:
            self._queue(host_id, now + self.settings.tick_s)
            return
        upcoming = self._next(seen, after=now)
        # Every threshold passed without a verdict (the job finished, the member is not up): look
        # again after a suspect interval rather than on every tick.
        self._queue(host_id, upcoming if upcoming is not None else now + self.settings.suspect_after_s)

    def _next(self, seen: Liveness, after: float) -> float | None:
        """The next moment a verdict on ``seen`` can change, after ``after``. A threshold counts as
        passed as the detector reckons it, ``after - since >= threshold``: in floating point that can
        fall short at ``since + threshold`` itself (0.95 - 0.65 < 0.3), and the look then comes on the
        next tick instead of a whole interval later."""
        s = self.settings
        thresholds = [(seen.last_seen, s.suspect_after_s), (seen.last_seen, s.heartbeat_timeout_s)]
        if seen.stream_broken_at is not None and s.stream_break_signal:
            thresholds += [(seen.stream_broken_at, 0.0), (seen.stream_broken_at, s.stream_grace_s)]
        ahead = [
            max(since + threshold, seen.not_before)
            for since, threshold in thresholds
            if after - since < threshold or after < seen.not_before
        ]
        return min(ahead) if ahead else None

    def _queue(self, host_id: str, deadline: float | None) -> None:
        if deadline is None:
            return
        queued = self._queued.get(host_id)
        if queued is not None and queued <= deadline:
            return  # an earlier look is queued already; it reschedules from there
        self._queued[host_id] = deadline
        heapq.heappush(self._heap, (deadline, host_id))

"""The moments this agent did not run, so that its own pause is never blamed on the coordinator.

A whole machine can stop for seconds: on the accelerator machine, every process there stalled for
6-7 s while another process opened the TPU chip (measured with an asyncio ticker beside it). When
the agent resumes, the timers it armed before the pause are long past: "the coordinator sent nothing
for 2 s" fires although the coordinator, paused too, or its keepalive, waiting unread in the socket,
was never silent. The agent would then break a healthy stream, the coordinator would take the broken
stream for a dead host, and the job would re-form around a host that never failed. The coordinator
already credits its own stalls to every member (``detector stalled``); this is the agent's side.

``Pauses`` is fed by a ticker on the agent's event loop: a tick that comes much later than asked is
a pause of the whole process. Silence and lease timers subtract what fell into their window.
"""

from __future__ import annotations

import asyncio
import collections
import time

__all__ = ["Pauses"]


class Pauses:
    """The pauses of this process, as the ticker saw them: (when it resumed, seconds it lost)."""

    def __init__(self, tick_s: float = 0.1, slack_s: float = 0.25) -> None:
        # A tick up to ``slack_s`` late is a busy loop, not a pause: the loop runs other callbacks.
        self.tick_s = tick_s
        self.slack_s = slack_s
        self._last = time.monotonic()
        self._seen: collections.deque[tuple[float, float]] = collections.deque(maxlen=64)

    def tick(self, now: float) -> None:
        """The ticker ran at ``now``: a gap past its interval and slack was a pause."""
        lost = now - self._last - self.tick_s
        if lost > self.slack_s:
            self._seen.append((now, lost))
        self._last = now

    def since(self, start: float, now: float) -> float:
        """Seconds this process did not run after ``start``: pauses it resumed from since then, and
        one still under way (the ticker has not run since it resumed, and ``now`` shows the gap)."""
        ended = sum(lost for resumed, lost in self._seen if resumed > start)
        ongoing = now - self._last - self.tick_s
        return ended + (ongoing if ongoing > self.slack_s else 0.0)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self.tick(time.monotonic())

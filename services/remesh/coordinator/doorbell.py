"""A doorbell: a stream's handler sleeps on it until something for its client arrives.

A new epoch reaches thousands of streams at once (heartbeat streams on the coordinator, followers on
a relay). Ringing each is setting one future: a task per stream watching for news, or a Condition
that wakes its waiters one after another (each taking its lock in turn), cost every stream task
switches per epoch. A handler that wakes looks at everything due before it waits again, so a ring
while nobody waits is not kept.
"""

from __future__ import annotations

import asyncio

__all__ = ["Doorbell"]


class Doorbell:
    """Wakes every handler waiting on it at once; each waits with a keepalive period of its own."""

    def __init__(self) -> None:
        self._waiting: set[asyncio.Future[bool]] = set()

    def ring(self) -> None:
        """Wake every handler waiting now (one that is not waiting looks before it waits again)."""
        waiting, self._waiting = self._waiting, set()
        for bell in waiting:
            if not bell.done():
                bell.set_result(True)

    async def wait(self, quiet_s: float | None = None) -> bool:
        """Until ``ring()`` (True), or ``quiet_s`` seconds with no ring (False; None: no limit). One
        future and one timer: cheaper than ``asyncio.timeout`` around a wait, per stream and keepalive."""
        loop = asyncio.get_running_loop()
        bell: asyncio.Future[bool] = loop.create_future()
        self._waiting.add(bell)
        timer = loop.call_later(quiet_s, _quiet, bell) if quiet_s is not None else None
        try:
            return await bell
        finally:
            if timer is not None:
                timer.cancel()
            self._waiting.discard(bell)


def _quiet(bell: asyncio.Future[bool]) -> None:
    if not bell.done():
        bell.set_result(False)

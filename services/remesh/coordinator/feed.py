"""One reader of the event log for every client that follows it.

``remesh events --follow``, the demo and dashboards each open a ``ReplayEvents(follow=True)`` stream;
without this, each would hold a Redis connection blocked in XREAD of its own. ``EventFeed`` runs one
XREAD loop while anyone follows and hands each batch to every subscriber's bounded queue. A
subscriber that falls that far behind is dropped with the id to resume from, so one slow client
never grows the coordinator's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog

from remesh.coordinator.errors import CoordinatorError, ResourceExhausted, StoreUnavailable
from remesh.coordinator.model import Event
from remesh.coordinator.store import RedisStore

__all__ = ["EventFeed", "Subscription", "event_id_key"]

log = structlog.get_logger("remesh.coordinator")


def event_id_key(event_id: str) -> tuple[int, int]:
    """A stream id ("1733150000000-3") as a sortable pair."""
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


class Subscription:
    def __init__(self, limit: int) -> None:
        self._queue: asyncio.Queue[list[Event] | CoordinatorError] = asyncio.Queue()
        self._limit = limit
        self._pending = 0
        self._failed = False

    def offer(self, batch: list[Event]) -> None:
        """New events for this follower (the feed's reader calls it); one batch too many for its
        limit ends the subscription instead."""
        if self._failed:
            return
        if self._pending + len(batch) > self._limit:
            self.fail(
                ResourceExhausted(
                    f"this follower fell {self._pending + len(batch)} events behind (the limit is "
                    f"{self._limit}): read faster, or follow again from the last event id you got (--after)"
                )
            )
            return
        self._pending += len(batch)
        self._queue.put_nowait(batch)

    def fail(self, error: CoordinatorError) -> None:
        """End the subscription with ``error`` (Redis lost, the follower too far behind)."""
        if not self._failed:
            self._failed = True
            self._queue.put_nowait(error)

    async def next(self) -> list[Event]:
        """The next batch of new events; raises what ended the feed (Redis lost, fell behind)."""
        item = await self._queue.get()
        if isinstance(item, CoordinatorError):
            raise item
        self._pending -= len(item)
        return item


class EventFeed:
    def __init__(self, store: RedisStore, *, limit: int = 10_000) -> None:
        self._store = store
        self._limit = limit
        self._subscribers: set[Subscription] = set()
        self._task: asyncio.Task[None] | None = None
        self._start = asyncio.Lock()

    @property
    def followers(self) -> int:
        return len(self._subscribers)

    @contextlib.asynccontextmanager
    async def subscribe(self) -> AsyncIterator[Subscription]:
        """Every batch of events committed from now on (a caller reads what came before from the log
        after subscribing, and skips what it already has: batches may repeat the newest of those)."""
        sub = Subscription(self._limit)
        async with self._start:
            if self._task is None or self._task.done():
                last = await self._store.last_event_id()
                self._task = asyncio.create_task(self._run(last), name="event-feed")
            self._subscribers.add(sub)
        try:
            yield sub
        finally:
            self._subscribers.discard(sub)
            if not self._subscribers and self._task is not None:
                self._task.cancel()
                self._task = None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None

    async def _run(self, after: str) -> None:
        try:
            async for batch in self._store.follow_events(after):
                if batch:
                    for sub in list(self._subscribers):
                        sub.offer(batch)
        except StoreUnavailable as exc:
            log.warning("event feed lost Redis; its followers are told", error=str(exc))
            for sub in list(self._subscribers):
                sub.fail(exc)

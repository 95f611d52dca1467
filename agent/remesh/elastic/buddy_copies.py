"""Copies of a peer's pieces this process keeps in RAM (its buddy's), made in the background.

Under plain FSDP a shard has one holder: a host lost takes its shards with it. Every host copies the
own pieces of the next rank (its buddy) at the steps the snapshot schedule names (the peer serves
its snapshot of the step), so a lost host's shards are restored from its buddy's copy without
storage. Every host copies at the same steps and never skips one: a restore needs one step that the
lost host's buddy copied and every survivor still holds.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import structlog
from jax.sharding import NamedSharding

from remesh.elastic.agent_client import AgentLink, Assignment
from remesh.elastic.cells import Cell, RestorePoint, cell_of
from remesh.elastic.errors import TopologyChanged
from remesh.elastic.exchange import FetchFailed, beside_training, fetch
from remesh.elastic.snapshots import Snapshots
from remesh.elastic.watchdog import Watchdog

__all__ = ["BuddyCopies"]

log = structlog.get_logger("remesh.elastic")


class BuddyCopies:
    """The buddy copies of one process, kept in ``store``.

    ``delay_s``: every copy first sleeps this long plus the loop's shortest recent interval between
    copies (``Faults.buddy_copy_delay_s``)."""

    def __init__(
        self,
        store: Snapshots,
        watchdog: Watchdog,
        agent: AgentLink,
        stats: dict[str, float],
        *,
        timeout_s: float,
        buddy_every: int | None,
        delay_s: float = 0.0,
    ) -> None:
        self.store = store
        self.watchdog = watchdog
        self.agent = agent
        self.stats = stats
        # A copy's peer that has not taken its snapshot of the step is asked again for this long.
        self.timeout_s = timeout_s
        self.buddy_every = buddy_every  # said in the warning when copies hold the loop back
        self.delay_s = delay_s
        self._pool = beside_training("remesh-buddy")
        # The buddy of this epoch: where it serves, and the keys of the pieces it alone holds; None:
        # no copies this epoch.
        self._buddy: tuple[str, list[tuple[int, Cell]]] | None = None
        # Copies on their way, oldest first.
        self._copying: collections.deque[Future[None]] = collections.deque()
        self._told_slow = False
        self._asked_at: tuple[int, float] | None = None  # (epoch, when)
        self._intervals: collections.deque[float] = collections.deque(maxlen=5)
        self._closed = False

    @property
    def active(self) -> bool:
        """Whether this process copies its buddy's pieces in the current epoch."""
        return self._buddy is not None

    def begin(
        self,
        assignment: Assignment,
        shardings: Sequence[NamedSharding],
        shapes: Sequence[tuple[tuple[int, ...], Any]],
        peers: Sequence[str],
        enabled: bool,
    ) -> None:
        """An epoch begins: its buddy is the next rank (serving at ``peers[rank]``), whose pieces no
        other member holds are copied; none where copies are off (``enabled``), in a world of one,
        or where every cell of the buddy is here already. Copies of an older epoch end on their own
        (the epoch changed)."""
        self._copying.clear()
        self._buddy = None
        if not enabled or assignment.world_size < 2:
            return
        buddy = (assignment.rank + 1) % assignment.world_size
        holders: dict[tuple[int, Cell], set[int]] = {}
        for i, (sharding, (shape, _)) in enumerate(zip(shardings, shapes, strict=True)):
            for device, index in sharding.devices_indices_map(shape).items():
                holders.setdefault((i, cell_of(index, shape)), set()).add(_process_of(device))
        # Only the cells the buddy alone holds: another replica group, or this process, has the rest.
        only_there = sorted(key for key, ranks in holders.items() if ranks == {buddy})
        if only_there:
            self._buddy = (peers[buddy], only_there)

    def copy_later(self, step: int, assignment: Assignment) -> None:
        """Copy the buddy's pieces of ``step`` in the background, never skipping it: with two copies
        still on their way, wait for the oldest first (copies slower than the buddy interval slow
        the loop down to their pace, and say so)."""
        assert self._buddy is not None
        while self._copying and self._copying[0].done():
            self._copying.popleft().result()
        waited = 0.0
        if len(self._copying) >= 2:
            waited = self._wait_oldest(assignment.epoch)
            self.stats["buddy_wait_s"] += waited
            if waited > 0.05 and not self._told_slow:
                self._told_slow = True
                log.warning(
                    "buddy copies take longer than the steps between them: the loop waits for them; "
                    "raise Policy(buddy_every=...) so that a copy fits",
                    step=step,
                    buddy_every=self.buddy_every,
                    waited_s=round(waited, 3),
                )
        address, keys = self._buddy
        delay = 0.0
        if self.delay_s:
            now = time.monotonic()
            # The loop's own pace: the time it waited for copies left out (it would feed back).
            last = self._asked_at
            if last is None or last[0] != assignment.epoch:
                self._intervals.clear()
            else:
                self._intervals.append(now - last[1] - waited)
            self._asked_at = (assignment.epoch, now)
            delay = self.delay_s + min(self._intervals, default=0.0)
        self._copying.append(self._pool.submit(self._copy, address, (step, assignment.epoch), keys, delay))

    def _wait_oldest(self, epoch: int) -> float:
        """Wait for the oldest copy, as the watchdog sees a step: it may wait for a step stuck in a
        collective with a dead peer. A newer epoch ends the wait (``TopologyChanged``). Returns the
        seconds waited."""
        t = time.monotonic()
        oldest = self._copying[0]
        self.watchdog.blocking(epoch, "step")
        try:
            while True:
                try:
                    oldest.result(timeout=0.05)
                    break
                except FutureTimeout:
                    latest = self.agent.latest.epoch
                    if latest > epoch:
                        raise TopologyChanged(epoch, latest) from None
        finally:
            self.watchdog.clear()
        self._copying.popleft()
        waited = time.monotonic() - t
        log.debug("waited for background work", what="buddy copy", waited_s=round(waited, 3))
        return waited

    def _copy(
        self, address: str, point: RestorePoint, keys: list[tuple[int, Cell]], delay_s: float = 0.0
    ) -> None:
        """Copy the buddy's own pieces of ``point``. The peer takes its snapshot of the step once the
        step is done there: until then it answers that it does not hold it, so ask again, until it
        does or the epoch ends (a peer that never has it is gone, or stuck: a new epoch follows)."""
        if delay_s:
            time.sleep(delay_s)
        deadline = time.monotonic() + max(self.timeout_s, 10.0)
        while True:
            try:
                pieces = fetch(address, point, keys, 10.0, pin=True)
            except FetchFailed as exc:
                if self._closed or self.agent.latest.epoch > point[1] or time.monotonic() > deadline:
                    self.stats["buddy_copies_failed"] += 1
                    log.info("buddy copy not made", step=point[0], error=str(exc))
                    return
                time.sleep(0.01)
                continue
            self.store.put(point[0], point[1], pieces)
            self.stats["buddy_copies"] += 1
            return

    def cancel(self) -> None:
        """The job finished: copies not begun are cancelled (they fetch from peers that may have
        left); one under way finds its directory gone and writes nothing."""
        while self._copying:
            self._copying.popleft().cancel()

    def stop(self) -> None:
        """A copy under way gives up at its next attempt."""
        self._closed = True

    def close(self) -> None:
        """A copy not begun is not made; the thread ends."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._copying.clear()


def _process_of(device: Any) -> int:
    return int(device.process_index)

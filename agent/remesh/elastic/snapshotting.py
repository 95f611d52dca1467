"""Taking this process's host-memory snapshots beside training, one at a time.

A snapshot is taken after its step is dispatched: a background thread copies the step's shards to
the host once the step is done (``SnapshotCopy``: each device buffer let go of as soon as it is
copied) and keeps them (``Snapshots``: in the process and in ``/dev/shm``). When they are due is the
``SnapshotSchedule``'s to say; what the loop waited for them, and the interval they were kept at, go
back to it.

One at a time: a snapshot holds its step's arrays on the device until each is copied, and the loop
has moved on to newer ones by then (two on their way would hold two more copies of the state).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path

import jax
import structlog

from remesh.elastic.agent_client import AgentLink
from remesh.elastic.cells import Cell, cell_of
from remesh.elastic.data import Gather
from remesh.elastic.errors import TopologyChanged
from remesh.elastic.exchange import Pieces, beside_training
from remesh.elastic.host_copies import SnapshotCopy
from remesh.elastic.schedule import Proposals, SnapshotSchedule
from remesh.elastic.snapshots import HOST_SHM, Snapshots, claim
from remesh.elastic.watchdog import Watchdog

__all__ = ["MissingTiers", "Snapshotter", "host_memory_tiers"]

log = structlog.get_logger("remesh.elastic")


@dataclass(eq=False)
class InFlight:
    """A snapshot on its way to the host: its step, the epoch whose mesh laid it out, its copy, how
    every host's input position after the step is gathered (None: none is kept), the background
    work keeping it, and when it was kept (None until then, and if it never is)."""

    step: int
    epoch: int
    copy: SnapshotCopy[tuple[int, Cell]]
    position: Gather | None = None
    future: Future[None] = field(init=False)
    kept_at: float | None = None


class Snapshotter:
    """Takes the snapshots of ``store`` in the background, on ``schedule``, one at a time.

    ``device_budget_bytes``: what a snapshot still on its way may hold on the device when the loop
    hands the next step back (``Policy.snapshot_device_budget_bytes``); ``shard_delay_s``: a pause
    before copying each shard (``Faults.snapshot_shard_delay_s``)."""

    def __init__(
        self,
        store: Snapshots,
        schedule: SnapshotSchedule,
        watchdog: Watchdog,
        agent: AgentLink,
        stats: dict[str, float],
        *,
        device_budget_bytes: int | None,
        shard_delay_s: float = 0.0,
    ) -> None:
        self.store = store
        self.schedule = schedule
        self.watchdog = watchdog
        self.agent = agent
        self.stats = stats
        self.device_budget_bytes = device_budget_bytes
        self.shard_delay_s = shard_delay_s
        self._pool = beside_training("remesh-snapshot")
        # The snapshot on its way to the host (``take``), and the pieces of the last one kept.
        self.in_flight: InFlight | None = None
        self.last_pieces: Pieces = {}
        self._told_schedule()

    def begin(self, since: int) -> None:
        """An epoch begins, restored at step ``since``: the schedule begins anew."""
        self.schedule.begin(since)
        self._told_schedule()

    def due(self, step: int, proposals: Proposals) -> bool:
        """Whether ``step`` is snapshotted (``SnapshotSchedule.due``)."""
        due = self.schedule.due(step, proposals)
        self._told_schedule()
        return due

    def _told_schedule(self) -> None:
        # Not totals: the cadence in use, snapshots every snapshot_every steps from snapshot_since.
        self.stats["snapshot_every"], self.stats["snapshot_since"] = self.schedule.every, self.schedule.since

    def take(
        self,
        step: int,
        epoch: int,
        leaves: Sequence[jax.Array],
        wait: bool = False,
        alone: bool = False,
        position: Gather | None = None,
    ) -> None:
        """Copy this process's own shards of ``step`` to the host in the background and keep them as
        a snapshot once whole.

        A process ``alone`` in its epoch skips one due while the last is still on its way, not
        queued, so a slow host stretches the interval instead of piling up copies (and says so:
        ``SnapshotSchedule.snapshot_kept``). With other members the loop waits instead: a restore
        needs one step that every member holds, and skips decided by each member's own timing would
        leave them holding different steps (an HSDP job lost every step that way). Waits are a cost
        the schedule counts, so an automatic cadence moves to an interval the snapshots fit in.
        ``wait``: until this one is kept (the last step's). ``position``: gathers every host's input
        position after the step, kept with it (``InputPositions``).
        """
        if self.harvest() is not None:
            # Alone, no buddy copies are made: none of them waits for this snapshot either.
            if alone and not wait:
                log.debug("snapshot skipped: the last one is still on its way", step=step)
                self.stats["snapshots_skipped"] += 1
                return
            self.wait(epoch)
        # Nothing is read from the devices here, not even copy_to_host_async: on CPU it waits for the
        # step to finish, and a step stuck in a collective with a frozen peer would hold the loop
        # where the watchdog cannot see it. On CPU ``np.asarray`` is a view of the device buffer,
        # which the runtime frees when it is torn down: a snapshot kept as it is must be copied;
        # one the snapshot store writes to its /dev/shm file (and keeps that, mapped) need not be.
        copy = SnapshotCopy(
            _own_shards(leaves), owned=self.store.directory is None, shard_delay_s=self.shard_delay_s
        )
        snap = InFlight(step, epoch, copy, position)
        snap.future = self._pool.submit(self._keep, snap)
        self.in_flight = snap
        if wait:
            self.wait(epoch)

    def harvest(self) -> InFlight | None:
        """The snapshot on its way, or None once there is none; one that ended is counted here, on
        the loop's thread (what it took, and the interval kept, go to the schedule)."""
        snap = self.in_flight
        if snap is None or not snap.future.done():
            return snap
        self.in_flight = None
        if (exc := snap.future.exception()) is not None:
            log.error(
                "snapshot not kept: taking it failed", step=snap.step, error=f"{type(exc).__name__}: {exc}"
            )
        elif snap.kept_at is not None:
            kept = self.schedule.snapshot_kept(snap.step, snap.kept_at - snap.copy.created)
            if kept is not None:
                self.stats["snapshot_every_kept"] = kept
        return None

    def wait(self, epoch: int, enough: Callable[[], bool] | None = None) -> None:
        """Wait for the snapshot on its way to end (or, with ``enough``, until that holds). While it
        waits for its step the watchdog sees a step (it may be stuck in a collective with a dead
        peer); while it copies, nothing is blocked (its own work, progressing). A newer epoch ends
        the wait (``TopologyChanged``). The time goes to ``stats["snapshot_wait_s"]`` and the
        schedule (a cost of snapshots the step times do not show)."""
        snap = self.in_flight
        assert snap is not None
        t = time.monotonic()
        try:
            while not snap.future.done() and not (enough is not None and enough()):
                if snap.copy.phase == "step":
                    self.watchdog.blocking(epoch, "step", since=t)
                else:
                    self.watchdog.clear()
                futures_wait([snap.future], timeout=0.01 if enough is not None else 0.05)
                latest = self.agent.latest.epoch
                if latest > epoch:
                    raise TopologyChanged(epoch, latest)
        finally:
            self.watchdog.clear()
            waited = time.monotonic() - t
            self.stats["snapshot_wait_s"] += waited
            self.schedule.observe_wait(waited)
        self.harvest()
        log.debug("waited for a snapshot", step=snap.step, waited_s=round(waited, 3))

    def within_device_budget(self, step: int, epoch: int) -> None:
        """The loop hands ``step`` back: a snapshot of an earlier step still on its way holds device
        memory beside the live state; with a device budget the loop waits until it holds no more
        than that. The most it held then is ``stats["snapshot_held_bytes_peak"]``."""
        snap = self.harvest()
        if snap is None or snap.step >= step:  # none, or this step's own (the live state)
            return
        budget = self.device_budget_bytes
        if budget is not None and snap.copy.held_bytes > budget:
            self.wait(epoch, lambda: snap.copy.held_bytes <= budget)
        peak = self.stats["snapshot_held_bytes_peak"]
        self.stats["snapshot_held_bytes_peak"] = max(peak, snap.copy.held_bytes)

    def let_go(self) -> None:
        """The epoch is being left: the snapshot on its way stops at its next shard and is dropped
        (the restore takes the newest snapshot kept; a copy of gigabytes would hold the recovery for
        seconds). It is waited for only until it lets go of the epoch's arrays (the runtime goes
        next): a shard, or its step where it still waits for that, watched as the caller set it up
        (a step stuck with a dead peer ends the process after its grace); its own copying or writing
        is no dead peer, and is not watched. One already being written is written whole."""
        snap = self.in_flight
        if snap is None:
            return
        snap.copy.stop()
        while not futures_wait([snap.future], timeout=0.01).done:
            if snap.copy.phase != "step":
                self.watchdog.clear()
        self.harvest()

    def finish(self) -> None:
        """The job finished: the snapshot still being written (from this process's devices) is
        waited for."""
        if self.in_flight is not None:
            futures_wait([self.in_flight.future])
            self.harvest()

    def close(self) -> None:
        """The snapshot on its way stops at its next shard; the thread ends."""
        if self.in_flight is not None:
            self.in_flight.copy.stop()
        self._pool.shutdown(wait=True)
        self.in_flight = None
        self.last_pieces = {}

    def _keep(self, snap: InFlight) -> None:
        """The background half of ``take``: copy, then keep (unless stopped meanwhile)."""
        try:
            pieces = snap.copy.run()
        except Exception as exc:  # the step itself failed (a peer died): there is nothing to keep
            snap.copy.release()
            log.info("snapshot not taken: its step failed", step=snap.step, error=str(exc).splitlines()[0])
            return
        if pieces is None or snap.copy.stopped:
            self.stats["snapshots_abandoned"] += 1
            log.info("snapshot dropped unfinished: its epoch is being left", step=snap.step)
            return
        t = time.monotonic()
        try:
            # Every host posted its position at the step before its own snapshot of it: by now,
            # after the step's copy, the others' are in (or their epoch is being left).
            found = snap.position(lambda: snap.copy.stopped) if snap.position is not None else None
            data = None if found is None else found.to_json()
            self.last_pieces = self.store.put(snap.step, snap.epoch, pieces, data)
        finally:
            snap.copy.release()
        snap.kept_at = time.monotonic()
        self.stats["snapshots"] += 1
        self.stats["snapshot_bytes"] += sum(int(p.nbytes) for p in pieces.values())
        self.stats["snapshot_s"] += snap.copy.copy_s + snap.kept_at - t


class MissingTiers:
    """The tiers that could not keep a snapshot of this process (tier -> the last error): told by
    ``Snapshots`` (its ``on_not_kept``, on a background thread), counted, logged once per problem
    and reported to the agent."""

    def __init__(self, agent: AgentLink, stats: dict[str, float], shm_dir: str | None) -> None:
        self.agent = agent
        self.stats = stats
        self.shm_dir = shm_dir
        self.missing: dict[str, str] = {}
        # The problems already logged and told to the agent.
        self._problems: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def not_kept(self, step: int, tier: str, error: str) -> None:
        """A snapshot of ``step`` could not be written where ``tier`` keeps it: it is kept in this
        process only, and a trainer the agent restarts will not find it. Counted by tier (``stats``,
        and the agent's remesh_trainer_snapshot_failures_total); a new problem is logged as an error,
        saying what to do, and the tier reported missing to the agent, which records it in the job's
        event log. Nothing waits: the report goes with the next progress report."""
        # Errors that differ only in their numbers (the step in a file's name) are one problem.
        problem = (tier, re.sub(r"\d+", "N", error))
        with self._lock:
            self.stats["snapshot_failures"] += 1
            per_tier = f"snapshot_failures.{tier}"
            self.stats[per_tier] = self.stats.get(per_tier, 0) + 1
            self.missing[tier] = error
            missing = dict(self.missing)
            new = problem not in self._problems
            self._problems.add(problem)
        if not new:
            return
        log.error(
            "the snapshot tier cannot keep this process's snapshots: they are kept in the process only, "
            "so a trainer restarted on this host finds none and the job falls back to its peers or a "
            "checkpoint. Make Policy.shm_dir a writable directory with room for the snapshots kept (a "
            "tmpfs such as /dev/shm; see df -h), or set shm_dir=None to keep them in the process on purpose",
            tier=tier,
            step=step,
            shm_dir=self.shm_dir,
            error=error,
        )
        self.agent.report_tiers_missing(missing)


def host_memory_tiers(
    shm_dir: str | None, name: str, owner: str | None, kept: int, missing: MissingTiers
) -> tuple[Snapshots, Snapshots]:
    """This process's own snapshots (the newest ``kept``) and its buddy copies, in memory and, with
    ``shm_dir``, in its directory ``name`` there (claimed for agent process ``owner``: what another
    agent's trainers left is deleted). What a tier cannot keep is told to ``missing``."""
    shm = Path(shm_dir) / name if shm_dir else None
    unusable: str | None = None
    try:
        if shm is not None and owner:
            claim(shm, owner)
        snapshots = Snapshots(kept, shm, on_not_kept=missing.not_kept)
    except OSError as exc:
        # A snapshot directory that cannot be made is a tier that keeps nothing, said as such
        # (counted, logged, an event): a trainer that refused to start over it would fail the same
        # way on every host, and the job would go round its spares. Snapshots stay in the process.
        unusable, shm = f"{type(exc).__name__}: {exc}", None
        snapshots = Snapshots(kept, None, on_not_kept=missing.not_kept)
    # The copies this process keeps of its buddy's own pieces: in memory and in /dev/shm like its
    # own snapshots, since a survivor's trainer is often restarted (stuck in a collective with the
    # dead peer) and the copy must outlive it. The newest two: one may be a moment old. Their files
    # are the buddy tier's, whatever directory they are in.
    buddies = Snapshots(
        2,
        shm / "buddy" if shm is not None else None,
        on_not_kept=lambda step, _tier, error: missing.not_kept(step, "buddy", error),
    )
    if unusable is not None:
        missing.not_kept(0, HOST_SHM, unusable)
    return snapshots, buddies


def _own_shards(leaves: Sequence[jax.Array]) -> dict[tuple[int, Cell], jax.Array]:
    """This process's distinct shards of every leaf, on its devices."""
    shards: dict[tuple[int, Cell], jax.Array] = {}
    for i, x in enumerate(leaves):
        for shard in x.addressable_shards:
            shards.setdefault((i, cell_of(shard.index, x.shape)), shard.data)
    return shards

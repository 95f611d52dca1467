"""The steps a trainer completes: waited for, timed, and told to the agent; an epoch's acknowledgement.

The loop dispatches a step and hands it back before the one before is waited for (the devices never
idle), so a step is completed one step late: ``Progress.completed`` waits for it, times it from the
step before (what the snapshot schedule measures snapshots by) and reports it to the agent without
waiting.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np
import structlog

from remesh.elastic.agent_client import AgentLink, Assignment
from remesh.elastic.errors import AgentUnreachable, RestartProcess
from remesh.elastic.exits import Why
from remesh.elastic.runtime import peer_failures
from remesh.elastic.schedule import SnapshotSchedule
from remesh.elastic.watchdog import Watchdog

__all__ = ["Progress", "StepResult", "running_totals"]


@dataclass(frozen=True)
class StepResult:
    step: int
    epoch: int
    world_size: int
    metrics: Mapping[str, float]


class Progress:
    """Where the training loop is: steps completed, when, and what the agent was told.
    ``checkpoint_every``: the steps whose times measure a checkpoint rather than a step."""

    def __init__(
        self,
        agent: AgentLink,
        watchdog: Watchdog,
        schedule: SnapshotSchedule,
        stats: dict[str, float],
        checkpoint_every: int,
    ) -> None:
        self.agent = agent
        self.watchdog = watchdog
        self.schedule = schedule
        self.stats = stats
        self.checkpoint_every = checkpoint_every
        # Steps completed in the current epoch (what a stall report names).
        self.step = 0
        # When the step the loop last waited for was done (monotonic).
        self.done_at = 0.0
        # (epoch, step, when) of the last step completed: the next one is timed from it.
        self.last: tuple[int, int, float] | None = None

    def begin(self, step: int) -> None:
        """An epoch begins, restored at ``step``."""
        self.step = step

    def first_done(self) -> None:
        """An epoch's first step is done (waited for by its acknowledgement)."""
        self.done_at = time.monotonic()

    def completed(
        self,
        assignment: Assignment,
        step: int,
        metrics: Mapping[str, jax.Array],
        marker: jax.Array,
        since: float,
    ) -> StepResult:
        """Wait for ``step`` (the next one is already dispatched; ``marker``: one of its outputs;
        ``since``: when it could start) and report it, without waiting."""
        self.watchdog.blocking(assignment.epoch, "step", since)
        with peer_failures():
            jax.block_until_ready(marker)
            host_metrics = {k: float(_scalar(v)) for k, v in metrics.items()}
        self.watchdog.clear()
        self.done_at = time.monotonic()
        self.step = step
        last = self.last
        took: float | None = None
        if last is not None and last[:2] == (assignment.epoch, step - 1):
            self.stats["steps"] += 1
            self.stats["step_s"] += self.done_at - last[2]
            every = self.checkpoint_every
            if not (every and step % every in (0, 1)):  # a checkpoint's steps measure the checkpoint
                took = self.done_at - last[2]
        self.schedule.step_completed(step, took)
        self.last = (assignment.epoch, step, self.done_at)
        self.agent.report_progress_later(step, assignment.epoch, self.stats)
        return StepResult(step, assignment.epoch, assignment.world_size, host_metrics)

    def ack(
        self,
        assignment: Assignment,
        restored: int,
        source: str,
        phases: Mapping[str, float],
        restored_bytes: Mapping[str, int],
    ) -> None:
        """Acknowledge the epoch. A refusal means a newer epoch began (``EpochSuperseded``: move on);
        no answer at all, even after the agent's own retries, asks for a fresh process rather than
        train in an epoch that can never go live."""
        last = self.last
        reached = last[1] if last is not None and last[0] < assignment.epoch else -1
        try:
            self.agent.ack(assignment.epoch, restored, source, phases, restored_bytes, reached)
        except AgentUnreachable as exc:
            raise RestartProcess(str(exc), Why.AGENT_UNREACHABLE) from exc
        finally:
            structlog.contextvars.unbind_contextvars("recovery")


def _scalar(x: jax.Array) -> np.ndarray:
    """A replicated metric's value, from this process's own copy (no cross-process fetch)."""
    return np.asarray(x.addressable_shards[0].data)


def running_totals() -> dict[str, float]:
    """A session's running totals (``Session.stats``), all zero: for goodput accounting, and sent to
    the agent with each progress report (its remesh_trainer_* metrics)."""
    return {
        "steps": 0,  # steps completed, each timed from its predecessor (not an epoch's first)
        "step_s": 0.0,
        "checkpoints": 0,  # checkpoint saves finished
        "checkpoint_bytes": 0,  # bytes this process wrote in them
        "checkpoint_wait_s": 0.0,
        "checkpoint_save_s": 0.0,
        "snapshots": 0,
        "snapshot_bytes": 0,
        "snapshot_s": 0.0,  # seconds spent taking snapshots, in the background
        "snapshots_skipped": 0,
        # Snapshots cut short and dropped because their epoch was being left (the restore takes
        # the newest one kept).
        "snapshots_abandoned": 0,
        "snapshot_wait_s": 0.0,  # seconds the loop waited for snapshots (budget, buddy steps, the end)
        # Not totals: the most device bytes a snapshot of an earlier step still held when the
        # loop handed a step back (the extra device memory snapshots cost), and the steps
        # between the last two snapshots kept.
        "snapshot_held_bytes_peak": 0,
        "snapshot_every_kept": 0,
        # Snapshots not kept where they were meant to be (kept in the process only); by tier as
        # snapshot_failures.TIER ("host-shm", "buddy").
        "snapshot_failures": 0,
        "peer_failures": 0,  # epochs left because a peer failed (a collective timed out or broke)
        "buddy_copies": 0,
        "buddy_copies_failed": 0,
        "buddy_wait_s": 0.0,  # seconds the loop waited for buddy copies to catch up
        # Not totals: the cadence in use, snapshots every snapshot_every steps from snapshot_since.
        "snapshot_every": 0,
        "snapshot_since": 0,
    }

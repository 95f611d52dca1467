"""A one-host job with no agent and no coordinator: what a ``Session`` talks to when it runs alone.

A training script under ``remesh agent`` learns its place in the job from the agent's local API
(``AgentClient``). Started on its own (``python train.py`` while writing or debugging the loop, or a
benchmark that drives several sessions in one process), there is nobody to ask: ``SoloAgent`` answers
the same questions from memory. The job is one epoch of one host (rank 0 of a world of one), every
acknowledgement makes it live, and every checkpoint commit is accepted, since no other writer can
exist. Nothing is sent anywhere; progress and stall reports are dropped.

It keeps the session's contract whole rather than adding a second code path to ``Session``: the
restore still looks for snapshots and committed checkpoints first (restore step 0: "the job may have
completed steps"), so a script run again resumes from its newest checkpoint. ``agent_from_env`` is
how a ``Session`` finds its agent: the agent's local API where ``REMESH_AGENT_ADDRESS`` names one,
else a ``SoloAgent``, said in one line of the log. The host-memory snapshots of a job run alone are
this process's (``SoloAgent.session``): what an earlier run left in ``/dev/shm`` is deleted, never
restored, and a second run of the same job id on the host at the same time is refused.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping

import structlog

from remesh.elastic.agent_client import PROGRESS_EVERY_S, AgentClient, AgentLink, Assignment
from remesh.v1.contract import Env

__all__ = ["SOLO_HOST", "SoloAgent", "agent_from_env"]

log = structlog.get_logger("remesh.elastic")

# The host id of a job run alone: it names the host's snapshot directory (remesh-JOB-solo).
SOLO_HOST = "solo"


class SoloAgent:
    """The part of ``AgentClient`` a ``Session`` uses, answered in-process for a world of one."""

    def __init__(self, job_id: str = "default") -> None:
        self.job_id = job_id
        # This process's run of the job, in the place of an agent's session id: the host-memory
        # snapshots it finds under any other were left by an earlier run.
        self.session = f"solo-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._latest = Assignment(
            epoch=1,
            host_id=SOLO_HOST,
            rank=0,
            world_size=1,
            jax_coordinator="",
            restore_step=0,
            hosts=(SOLO_HOST,),
        )
        self.changed_at = time.monotonic()
        self._changed = threading.Condition()
        self._closed = False
        # Accepted checkpoint commits, (step, epoch): the only writer there is, so every one is.
        self.commits: list[tuple[int, int]] = []
        self.finished_step: int | None = None
        self.acked: dict[int, bool] = {}

    @property
    def latest(self) -> Assignment:
        return self._latest

    def lost_a_member(self, epoch: int, newer: Assignment) -> bool:
        return False  # one member, and no newer epoch ever comes

    def wait_newer(self, epoch: int, timeout: float) -> Assignment | None:
        return self.wait_until(lambda a: a.epoch > epoch, timeout)

    def wait_until(self, predicate: Callable[[Assignment], bool], timeout: float) -> Assignment | None:
        with self._changed:
            self._changed.wait_for(lambda: self._closed or predicate(self._latest), timeout)
            return self._latest if predicate(self._latest) else None

    def report_progress_later(self, step: int, epoch: int, totals: Mapping[str, float] | None = None) -> None:
        pass  # nobody reads progress of a job run alone

    def flush_progress(self, timeout: float = 10.0) -> bool:
        return True

    def report_stall(self, epoch: int, step: int, blocked_s: float) -> None:
        log.warning(
            "step blocked (running alone: nobody to tell)", epoch=epoch, step=step, blocked_s=blocked_s
        )

    def report_collective_failure(self, epoch: int, step: int, detail: str) -> None:
        log.warning(
            "collective failed (running alone: nobody to tell)", epoch=epoch, step=step, detail=detail
        )

    def report_tiers_missing(self, missing: Mapping[str, str]) -> None:
        pass  # the session logged it as an error already, and there is no event log to record it in

    def ack(
        self,
        epoch: int,
        restored_step: int,
        source: str,
        phases: Mapping[str, float],
        restored_bytes: Mapping[str, int] | None = None,
        reached_step: int = -1,
    ) -> bool:
        self.acked[epoch] = True
        return True

    def commit(self, epoch: int, step: int, tier: str) -> None:
        self.commits.append((step, epoch))

    def finish(self, epoch: int, step: int) -> None:
        self.finished_step = step

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def agent_from_env(
    job_id: str, env: Mapping[str, str] | None = None, progress_every_s: float = PROGRESS_EVERY_S
) -> AgentLink:
    """The agent of a trainer process: its local API where ``REMESH_AGENT_ADDRESS`` names one (the
    process runs under ``remesh agent``), else a ``SoloAgent``: the script runs as a job of one host."""
    env = os.environ if env is None else env
    if env.get(Env.AGENT_ADDRESS):
        return AgentClient.from_env(env, progress_every_s)
    log.info(
        "running alone: no remesh agent started this process (REMESH_AGENT_ADDRESS is not set), so it "
        "is a job of one host with no coordinator; snapshots stay on this host and checkpoints go where "
        "configured (run it again to resume from the newest). To survive host failures, run it on every "
        "host under an agent: remesh agent --coordinator HOST:PORT --host-id NAME -- python SCRIPT",
        job=job_id,
    )
    return SoloAgent(job_id)

"""The trainer's side of the agent's local API: assignments in, progress and acknowledgements out.

A background thread keeps a WatchAssignments stream open, so checking for a new epoch at a step
boundary is a memory read, not an RPC.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
import structlog

from remesh.elastic.errors import AgentUnreachable, EpochSuperseded
from remesh.v1 import agent_pb2 as apb
from remesh.v1 import agent_pb2_grpc as apb_grpc

__all__ = ["AgentClient", "Assignment"]

log = structlog.get_logger("remesh.elastic")


@dataclass(frozen=True)
class Assignment:
    """This host's place in one epoch."""

    epoch: int
    host_id: str
    rank: int
    world_size: int
    jax_coordinator: str
    restore_step: int
    halted: bool = False
    hosts: tuple[str, ...] = ()
    # Checkpoint commits the coordinator accepted before this epoch, (step, epoch): the only ones
    # this epoch may restore from.
    commits: frozenset[tuple[int, int]] = frozenset()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Assignment:
        return cls(
            epoch=int(env["REMESH_EPOCH"]),
            host_id=env.get("REMESH_HOST_ID", ""),
            rank=int(env["REMESH_RANK"]),
            world_size=int(env["REMESH_WORLD_SIZE"]),
            jax_coordinator=env.get("REMESH_JAX_COORDINATOR", ""),
            restore_step=int(env.get("REMESH_RESTORE_STEP", "-1")),
            commits=frozenset(
                (int(step), int(epoch))
                for step, _, epoch in (
                    c.partition(":") for c in env.get("REMESH_COMMITS", "").split(",") if c
                )
            ),
        )

    @classmethod
    def from_pb(cls, msg: apb.Assignment) -> Assignment:
        t = msg.topology
        return cls(
            epoch=t.epoch,
            host_id=msg.host_id,
            rank=msg.rank,
            world_size=msg.world_size,
            jax_coordinator=t.jax_coordinator_address,
            restore_step=t.restore_step,
            halted=t.halted,
            hosts=tuple(m.host_id for m in t.members),
            commits=frozenset((c.step, c.epoch) for c in t.commits),
        )


class AgentClient:
    def __init__(self, address: str, first: Assignment, slot: int = 0) -> None:
        self.address = address
        self.slot = slot
        self._channel = grpc.insecure_channel(address)
        self._stub = apb_grpc.AgentLocalStub(self._channel)
        self._latest = first
        self.changed_at = time.monotonic()
        self._changed = threading.Condition()
        self._closed = False
        self._watch = threading.Thread(target=self._follow, name="remesh-assignments", daemon=True)
        self._watch.start()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AgentClient:
        env = os.environ if env is None else env
        if "REMESH_AGENT_ADDRESS" not in env:
            raise RuntimeError(
                "REMESH_AGENT_ADDRESS is not set: run the trainer under `remesh agent ... -- COMMAND`"
            )
        return cls(
            env["REMESH_AGENT_ADDRESS"], Assignment.from_env(env), int(env.get("REMESH_TRAINER_SLOT", "0"))
        )

    def _follow(self) -> None:
        backoff = 0.05
        while not self._closed:
            try:
                request = apb.WatchAssignmentsRequest(after_epoch=0, slot=self.slot)
                for msg in self._stub.WatchAssignments(request):
                    self._publish(Assignment.from_pb(msg))
                    backoff = 0.05
            except grpc.RpcError as exc:
                if self._closed:
                    return
                log.warning("assignment stream lost; retrying", code=exc.code().name, retry_in_s=backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def _publish(self, assignment: Assignment) -> None:
        with self._changed:
            latest = self._latest
            # A newer epoch, or this process promoted from warm standby within the same epoch.
            if assignment.epoch > latest.epoch or (
                assignment.epoch == latest.epoch and assignment.rank != latest.rank
            ):
                self._latest = assignment
                self.changed_at = time.monotonic()
                self._changed.notify_all()

    @property
    def latest(self) -> Assignment:
        return self._latest

    def wait_newer(self, epoch: int, timeout: float) -> Assignment | None:
        """The first assignment newer than ``epoch``, or None after ``timeout`` seconds."""
        return self.wait_until(lambda a: a.epoch > epoch, timeout)

    def wait_until(self, predicate: Callable[[Assignment], bool], timeout: float) -> Assignment | None:
        """The latest assignment once ``predicate`` holds for it, or None after ``timeout`` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: predicate(self._latest), timeout)
            return self._latest if predicate(self._latest) else None

    def report_progress(self, step: int, epoch: int) -> int:
        """Tell the agent a step completed; returns the newest epoch it knows (-1 when the agent did
        not answer: progress is advisory, and the next step reports again)."""
        try:
            reply = self._stub.ReportProgress(apb.ReportProgressRequest(step=step, epoch=epoch), timeout=5)
        except grpc.RpcError as exc:
            log.warning("progress report not delivered", step=step, error=str(_refusal(exc, "progress")))
            return -1
        return int(reply.current_epoch)

    def ack(
        self,
        epoch: int,
        restored_step: int,
        source: str,
        phases: Mapping[str, float],
        restored_bytes: Mapping[str, int] | None = None,
    ) -> bool:
        """Acknowledge ``epoch`` to the coordinator (through the agent, which retries through a leader
        change). Raises ``EpochSuperseded`` when the coordinator refuses (a newer epoch began) and
        ``AgentUnreachable`` when no answer came."""
        try:
            reply = self._stub.AckEpoch(
                apb.LocalAckRequest(
                    epoch=epoch,
                    restored_step=restored_step,
                    restore_source=source,
                    phases=dict(phases),
                    restored_bytes=dict(restored_bytes or {}),
                ),
                timeout=15,
            )
        except grpc.RpcError as exc:
            raise _refusal(exc, f"acknowledging epoch {epoch}") from exc
        return bool(reply.live)

    def commit(self, epoch: int, step: int, tier: str) -> None:
        """Ask the coordinator (through the agent) to accept a checkpoint commit of ``epoch``.

        Raises ``EpochSuperseded`` when it refuses (the epoch is no longer current), and
        ``AgentUnreachable`` when no answer came: either way the checkpoint is not committed.
        """
        try:
            self._stub.CommitCheckpoint(apb.LocalCommitRequest(epoch=epoch, step=step, tier=tier), timeout=10)
        except grpc.RpcError as exc:
            raise _refusal(exc, f"commit of step {step} to {tier} in epoch {epoch}") from exc

    def report_stall(self, epoch: int, step: int, blocked_s: float) -> None:
        """Tell the agent this trainer has been blocked for ``blocked_s`` in the step after ``step``
        (it waits for a peer). Best effort: a report that does not arrive changes nothing here."""
        try:
            self._stub.ReportStall(
                apb.LocalStallRequest(epoch=epoch, step=step, blocked_s=blocked_s), timeout=5
            )
        except grpc.RpcError as exc:
            log.warning(
                "stall report not delivered", epoch=epoch, step=step, error=str(_refusal(exc, "stall"))
            )

    def finish(self, epoch: int, step: int) -> None:
        """Tell the agent (and the coordinator) this member completed the job's last step.

        Raises ``EpochSuperseded`` when the coordinator refuses (a newer epoch began: the job is not
        finished), ``AgentUnreachable`` when no answer came.
        """
        try:
            self._stub.Finish(apb.LocalFinishRequest(epoch=epoch, step=step), timeout=10)
        except grpc.RpcError as exc:
            raise _refusal(exc, f"finishing the job at step {step} in epoch {epoch}") from exc

    def close(self) -> None:
        self._closed = True
        self._channel.close()


def _refusal(exc: grpc.RpcError, what: str) -> Exception:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return EpochSuperseded(f"{what} refused by the coordinator: {detail}")
    return AgentUnreachable(f"{what}: no answer from the agent or the coordinator ({detail})")

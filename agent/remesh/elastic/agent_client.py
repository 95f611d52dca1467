"""The trainer's side of the agent's local API: assignments in, progress and acknowledgements out.

A background thread keeps a WatchAssignments stream open, so checking for a new epoch at a step
boundary is a memory read, not an RPC.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog

from remesh.elastic.errors import AgentUnreachable, EpochSuperseded
from remesh.v1 import agent_pb2 as apb
from remesh.v1 import agent_pb2_grpc as apb_grpc
from remesh.v1.contract import Env, TrainerAssignment

__all__ = ["AgentClient", "AgentLink", "Assignment", "trainer_totals"]


# The session counts the snapshots each tier could not keep as ``stats["snapshot_failures.TIER"]``.
_FAILURES_OF = "snapshot_failures."


def trainer_totals(stats: Mapping[str, float]) -> apb.TrainerTotals:
    """The session's running totals (``Session.stats``) as the agent takes them."""
    return apb.TrainerTotals(
        steps=int(stats.get("steps", 0)),
        step_seconds=float(stats.get("step_s", 0.0)),
        snapshots=int(stats.get("snapshots", 0)),
        snapshot_seconds=float(stats.get("snapshot_s", 0.0)),
        snapshot_bytes=int(stats.get("snapshot_bytes", 0)),
        checkpoints=int(stats.get("checkpoints", 0)),
        checkpoint_bytes=int(stats.get("checkpoint_bytes", 0)),
        checkpoint_save_seconds=float(stats.get("checkpoint_save_s", 0.0)),
        checkpoint_wait_seconds=float(stats.get("checkpoint_wait_s", 0.0)),
        peer_failures=int(stats.get("peer_failures", 0)),
        snapshot_every=int(stats.get("snapshot_every", 0)),
        snapshot_every_kept=int(stats.get("snapshot_every_kept", 0)),
        snapshot_failures={
            key.removeprefix(_FAILURES_OF): int(count)
            for key, count in stats.items()
            if key.startswith(_FAILURES_OF)
        },
    )


log = structlog.get_logger("remesh.elastic")

# A failed collective's detail, as sent on: the first line of the runtime's error, cut to this many
# characters (the coordinator refuses a detail over 1024).
_DETAIL_CHARS = 300

# A trainer tells its agent its newest completed step at most this often (the agent relays it on its
# next heartbeat). Every step would be a local gRPC call and a wake-up of two more processes beside
# the step (on this 2-core machine, several percent of a step of benchmarks/overhead.py); a second
# is far below anything that reads the step (the agent's hang timeout, the operators' views).
PROGRESS_EVERY_S = 1.0


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
    # When the job formed (Unix seconds; 0: not said) and the epochs since that recovered from a
    # failure: the failure rate the coordinator observes (``failure_interval_s``).
    formed_at: float = 0.0
    recoveries: int = 0

    def failure_interval_s(self, now: float) -> float | None:
        """Seconds between the job's failures as the coordinator observed them up to ``now``: the time
        since the job formed over its recoveries (None: it observed none)."""
        if self.recoveries <= 0 or self.formed_at <= 0:
            return None
        return max(now - self.formed_at, 1.0) / self.recoveries

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Assignment:
        return cls.of(TrainerAssignment.from_env(env))

    @classmethod
    def of(cls, given: TrainerAssignment) -> Assignment:
        return cls(
            epoch=given.epoch,
            host_id=given.host_id,
            rank=given.rank,
            world_size=given.world_size,
            jax_coordinator=given.jax_coordinator,
            restore_step=given.restore_step,
            commits=frozenset(given.commits),
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
            formed_at=t.formed_at,
            recoveries=t.recoveries,
        )


class AgentLink(Protocol):
    """What a ``Session`` needs of its agent: ``AgentClient`` (the agent's local API), or
    ``remesh.elastic.solo.SoloAgent`` for a job run alone."""

    changed_at: float

    @property
    def latest(self) -> Assignment: ...

    def lost_a_member(self, epoch: int, newer: Assignment) -> bool: ...

    def wait_newer(self, epoch: int, timeout: float) -> Assignment | None: ...

    def wait_until(self, predicate: Callable[[Assignment], bool], timeout: float) -> Assignment | None: ...

    def report_progress_later(
        self, step: int, epoch: int, totals: Mapping[str, float] | None = None
    ) -> None: ...

    def report_tiers_missing(self, missing: Mapping[str, str]) -> None: ...

    def flush_progress(self, timeout: float = 10.0) -> bool: ...

    def report_stall(self, epoch: int, step: int, blocked_s: float) -> None: ...

    def report_collective_failure(self, epoch: int, step: int, detail: str) -> None: ...

    def ack(
        self,
        epoch: int,
        restored_step: int,
        source: str,
        phases: Mapping[str, float],
        restored_bytes: Mapping[str, int] | None = None,
        reached_step: int = -1,
    ) -> bool: ...

    def commit(self, epoch: int, step: int, tier: str) -> None: ...

    def finish(self, epoch: int, step: int) -> None: ...

    def close(self) -> None: ...


class AgentClient:
    def __init__(
        self, address: str, first: Assignment, slot: int = 0, progress_every_s: float = PROGRESS_EVERY_S
    ) -> None:
        self.address = address
        self.slot = slot
        self.progress_every_s = progress_every_s
        self._channel = grpc.insecure_channel(address)
        self._stub = apb_grpc.AgentLocalStub(self._channel)
        self._latest = first
        self._hosts: dict[int, tuple[str, ...]] = {first.epoch: first.hosts} if first.hosts else {}
        self.changed_at = time.monotonic()
        self._changed = threading.Condition()
        self._closed = False
        self._watch = threading.Thread(target=self._follow, name="remesh-assignments", daemon=True)
        self._watch.start()
        # The newest (step, epoch) to report and not yet sent, and whether a report is on its way:
        # progress goes out from a background thread, coalesced, so no step waits for an RPC.
        self._progress: tuple[int, int, dict[str, float] | None] | None = None
        self._sending = False
        # When the last report went out, and whether the next one goes at once (after a stall
        # report: the coordinator holds the stall against this member until it hears of a newer step;
        # and on a flush).
        self._last_sent = -float("inf")
        self._urgent = False
        self._progress_due = threading.Condition()
        self._reporter: threading.Thread | None = None
        # The last report asked for (sent again to carry news of a tier when none is pending), and
        # the tiers that cannot keep this process's snapshots, sent with every report.
        self._last_asked: tuple[int, int, dict[str, float] | None] | None = None
        self._tiers_missing: dict[str, str] = {}

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, progress_every_s: float = PROGRESS_EVERY_S
    ) -> AgentClient:
        env = os.environ if env is None else env
        if Env.AGENT_ADDRESS not in env:
            raise RuntimeError(
                f"{Env.AGENT_ADDRESS} is not set: run the trainer under `remesh agent ... -- COMMAND`"
            )
        given = TrainerAssignment.from_env(env)
        return cls(given.agent_address, Assignment.of(given), given.slot, progress_every_s)

    def _follow(self) -> None:
        backoff = 0.05
        while not self._closed:
            try:
                request = apb.WatchAssignmentsRequest(after_epoch=0, slot=self.slot)
                for msg in self._stub.WatchAssignments(request):
                    self._publish(Assignment.from_pb(msg))
                    backoff = 0.05
            except (grpc.RpcError, ValueError) as exc:  # ValueError: the channel closed meanwhile
                if self._closed:
                    return
                if not isinstance(exc, grpc.RpcError):
                    raise
                log.warning("assignment stream lost; retrying", code=exc.code().name, retry_in_s=backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def _publish(self, assignment: Assignment) -> None:
        with self._changed:
            if assignment.hosts:
                # Every epoch's members as the agent's stream told them (the environment a trainer
                # starts with does not carry them): the two newest are all anyone compares.
                self._hosts[assignment.epoch] = assignment.hosts
                for old in sorted(self._hosts)[:-2]:
                    del self._hosts[old]
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

    def lost_a_member(self, epoch: int, newer: Assignment) -> bool:
        """Whether ``newer`` leaves out a host of ``epoch``: a step of ``epoch`` still running then
        waits for a process that is gone (every step of an epoch is one program over all of its
        processes) and can never end. False where this process does not know ``epoch``'s members."""
        with self._changed:
            before = self._hosts.get(epoch, ())
        return lost_a_member(before, newer.hosts)

    def wait_newer(self, epoch: int, timeout: float) -> Assignment | None:
        """The first assignment newer than ``epoch``, or None after ``timeout`` seconds."""
        return self.wait_until(lambda a: a.epoch > epoch, timeout)

    def wait_until(self, predicate: Callable[[Assignment], bool], timeout: float) -> Assignment | None:
        """The latest assignment once ``predicate`` holds for it, or None after ``timeout`` seconds
        (or once the client is closed)."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or predicate(self._latest), timeout)
            return self._latest if predicate(self._latest) else None

    def report_progress(self, step: int, epoch: int, totals: Mapping[str, float] | None = None) -> int:
        """Tell the agent a step completed (and, with ``totals``, the session's running totals: see
        ``trainer_totals``); returns the newest epoch it knows (-1 when the agent did not answer:
        progress is advisory, and the next step reports again)."""
        request = apb.ReportProgressRequest(step=step, epoch=epoch, tiers_missing=self._tiers_missing)
        if totals is not None:
            request.totals.CopyFrom(trainer_totals(totals))
        try:
            reply = self._stub.ReportProgress(request, timeout=5)
        except grpc.RpcError as exc:
            log.warning("progress report not delivered", step=step, error=str(_refusal(exc, "progress")))
            return -1
        return int(reply.current_epoch)

    def report_progress_later(self, step: int, epoch: int, totals: Mapping[str, float] | None = None) -> None:
        """Report a completed step from the background and return at once. At most one report goes
        out every ``progress_every_s``; those asked for meanwhile are coalesced into the newest: the
        coordinator needs only the last step, and the totals are running totals (copied now: the
        caller goes on counting)."""
        with self._progress_due:
            idle = self._progress is None
            self._progress = self._last_asked = (step, epoch, dict(totals) if totals is not None else None)
            if idle or self._urgent:
                # The reporter sleeps until there is a report, or until the interval is up with one
                # pending (it sends the newest then): a step wakes it only where it must go now.
                self._progress_due.notify_all()
            if self._reporter is None:
                self._reporter = threading.Thread(target=self._report, name="remesh-progress", daemon=True)
                self._reporter.start()

    def report_tiers_missing(self, missing: Mapping[str, str]) -> None:
        """The tiers that cannot keep this process's snapshots, each with its last error: sent with
        every progress report from now on (the agent tells the coordinator of each tier once).
        Returns at once: the next progress report carries it, or where none is pending, the last one
        again (a step reported twice changes nothing), so that news after the last step is heard too."""
        with self._progress_due:
            self._tiers_missing = {tier: _plain(error) for tier, error in missing.items()}
            if self._progress is None and self._last_asked is not None:
                self._progress = self._last_asked
                self._progress_due.notify_all()

    def flush_progress(self, timeout: float = 10.0) -> bool:
        """Wait until every progress report asked for has been sent (or tried); False on timeout."""
        with self._progress_due:
            if self._progress is not None:
                self._urgent = True
                self._progress_due.notify_all()
            return self._progress_due.wait_for(lambda: self._progress is None and not self._sending, timeout)

    def _report(self) -> None:
        def due() -> bool:
            if self._closed:
                return True
            return self._progress is not None and (
                self._urgent or time.monotonic() >= self._last_sent + self.progress_every_s
            )

        while True:
            with self._progress_due:
                while not due():
                    wait = None if self._progress is None else self._last_sent + self.progress_every_s
                    self._progress_due.wait(None if wait is None else max(0.0, wait - time.monotonic()))
                if self._closed:
                    return
                report, self._progress, self._sending = self._progress, None, True
                self._urgent = False
                self._last_sent = time.monotonic()
            try:
                if report is not None:
                    self.report_progress(*report)
            finally:
                with self._progress_due:
                    self._sending = False
                    self._progress_due.notify_all()

    def ack(
        self,
        epoch: int,
        restored_step: int,
        source: str,
        phases: Mapping[str, float],
        restored_bytes: Mapping[str, int] | None = None,
        reached_step: int = -1,
    ) -> bool:
        """Acknowledge ``epoch`` to the coordinator (through the agent, which retries through a leader
        change). ``reached_step``: the newest step this process completed before ``epoch``. Raises
        ``EpochSuperseded`` when the coordinator refuses (a newer epoch began) and
        ``AgentUnreachable`` when no answer came."""
        try:
            reply = self._stub.AckEpoch(
                apb.LocalAckRequest(
                    epoch=epoch,
                    restored_step=restored_step,
                    restore_source=source,
                    phases=dict(phases),
                    restored_bytes=dict(restored_bytes or {}),
                    reached_step=reached_step,
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
        (it waits for a peer). Best effort: a report that does not arrive changes nothing here. The
        next progress report goes at once: the coordinator counts this member as blocked until then."""
        with self._progress_due:
            self._urgent = True
        try:
            self._stub.ReportStall(
                apb.LocalStallRequest(epoch=epoch, step=step, blocked_s=blocked_s), timeout=5
            )
        except grpc.RpcError as exc:
            log.warning(
                "stall report not delivered", epoch=epoch, step=step, error=str(_refusal(exc, "stall"))
            )

    def report_collective_failure(self, epoch: int, step: int, detail: str) -> None:
        """Tell the agent (and through it the coordinator) that a collective of ``epoch`` failed
        after ``step`` steps, and this trainer waits for the next epoch. Best effort: without it the
        coordinator still replaces a lost member; only a failure with every member alive waits
        longer for its new epoch."""
        try:
            self._stub.ReportCollectiveFailure(
                apb.LocalCollectiveFailureRequest(epoch=epoch, step=step, detail=_plain(detail)), timeout=5
            )
        except grpc.RpcError as exc:
            log.warning(
                "collective failure report not delivered",
                epoch=epoch,
                step=step,
                error=str(_refusal(exc, "collective failure")),
            )

    def finish(self, epoch: int, step: int) -> None:
        """Tell the agent (and the coordinator) this member completed the job's last step.

        Raises ``EpochSuperseded`` when the coordinator refuses (a newer epoch began: the job is not
        finished), ``AgentUnreachable`` when no answer came.
        """
        self.flush_progress()  # the last step's progress first, then the end
        try:
            self._stub.Finish(apb.LocalFinishRequest(epoch=epoch, step=step), timeout=10)
        except grpc.RpcError as exc:
            raise _refusal(exc, f"finishing the job at step {step} in epoch {epoch}") from exc

    def close(self) -> None:
        """Stop following assignments and reporting (a report on its way is let go), wake whoever
        waits for an assignment, and wait for the client's threads to end."""
        with self._progress_due:
            self._closed = True
            self._progress_due.notify_all()
        with self._changed:
            self._changed.notify_all()
        self._channel.close()  # ends the assignment stream, and the thread that follows it
        for thread in (self._watch, self._reporter):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=10.0)


def _plain(detail: str) -> str:
    """The first line of an error, as plain text within the coordinator's bound on a detail."""
    line = detail.splitlines()[0] if detail else ""
    return "".join(c if c.isprintable() else " " for c in line)[:_DETAIL_CHARS]


def lost_a_member(before: Sequence[str], after: Sequence[str]) -> bool:
    """Whether the members ``after`` leave out one of ``before`` (either unknown, empty: no)."""
    return bool(before) and bool(after) and not set(before) <= set(after)


def _refusal(exc: grpc.RpcError, what: str) -> Exception:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return EpochSuperseded(f"{what} refused by the coordinator: {detail}")
    return AgentUnreachable(f"{what}: no answer from the agent or the coordinator ({detail})")

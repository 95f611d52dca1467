"""The elastic training session: the user's JAX loop, with failures handled by remesh.

The user hands over an ``init_state`` function, a ``train_step(state, batch) -> (state, metrics)``
and ``batch_for_step(step) -> global batch`` (a pure function of the step, so a recovered run sees
exactly the data a clean run would), and iterates ``Session.run(num_steps)``. For every epoch the
agent assigns, the session

1. joins the JAX distributed runtime for the epoch (rank, world size, coordination address),
2. builds a data-parallel mesh over every device of every host,
3. restores the epoch's ``restore_step``: from a host-memory snapshot where any member has one
   (broadcast to the members that do not), else from the newest committed checkpoint at or below it
   (local, then GCS), else from ``init_state``,
4. compiles the step, waits for every member, trains, acknowledges the epoch after the first step,

and when a new epoch arrives (``TopologyChanged`` at a step boundary) or a collective fails
(``PeerFailure``, a dead peer) it tears the runtime down and goes round again in the same process.
Where that is impossible it exits with ``RESTART_EXIT_CODE`` and the agent starts a fresh process.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol

import jax
import numpy as np
import structlog
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from remesh.elastic.agent_client import AgentClient, Assignment
from remesh.elastic.checkpoints import Approve, CheckpointError, StaleEpoch, Trusted
from remesh.elastic.errors import (
    AddressInUse,
    AgentUnreachable,
    EpochSuperseded,
    Recoverable,
    RestartProcess,
    TopologyChanged,
)
from remesh.elastic.runtime import Runtime, configure_cpu, peer_failures
from remesh.elastic.snapshots import Snapshots

__all__ = [
    "ADDRESS_IN_USE_EXIT_CODE",
    "RESTART_EXIT_CODE",
    "CheckpointStore",
    "Policy",
    "Session",
    "StepResult",
]

log = structlog.get_logger("remesh.elastic")

PyTree = Any
# Same code as remesh.agent.RESTART_EXIT_CODE (EX_TEMPFAIL); the trainer library never imports the agent.
RESTART_EXIT_CODE = 75
# Same code as remesh.agent.ADDRESS_IN_USE_EXIT_CODE (errno EADDRINUSE).
ADDRESS_IN_USE_EXIT_CODE = 98


class CheckpointStore(Protocol):
    """A checkpoint tier (``remesh.elastic.checkpoints``): local directory or GCS."""

    name: str

    def save(
        self, step: int, epoch: int, state: PyTree, extra: Mapping[str, Any], approve: Approve | None = None
    ) -> None: ...

    def latest_viable(self, max_step: int | None = None, trusted: Trusted = None) -> int | None: ...

    def restore_state(self, step: int, template: PyTree, trusted: Trusted = None) -> PyTree: ...

    def fence(self, epoch: int) -> None: ...


@dataclass(frozen=True)
class Policy:
    """How the session recovers. Passed in as a value; every default says why."""

    # A collective with a dead peer raises after this long. Each step is short and every member
    # waits at a barrier before the first collective, so healthy members are never this far apart.
    collective_timeout_s: float = 2.0
    # Every member of an epoch must join the JAX runtime within this (a spare's process is already
    # warm: it waits in standby with JAX imported).
    init_timeout_s: float = 60.0
    # After a failed collective, how long to wait for the agent to announce the new epoch before
    # asking the agent for a fresh process.
    epoch_wait_s: float = 30.0
    # Host-memory snapshots kept: the restore step is the oldest step all survivors completed, and
    # a survivor may be one step ahead of another.
    snapshots_kept: int = 3
    # Save a checkpoint every N steps from rank 0 (0: never).
    checkpoint_every: int = 0
    # A step blocked this long reports it (the agent tells the coordinator): when every other member
    # is blocked like this and one is not, that one stopped taking part and is replaced, before the
    # collective times out. None: half the collective timeout (a healthy step here takes tens of ms).
    stall_report_s: float | None = None
    # A step still running this long after a new epoch was announced is stuck in a collective with a
    # dead peer (it would wait for the collective timeout, then often abort inside gloo): the process
    # exits for the agent's warm standby process to take over at once. None: always wait it out.
    stuck_step_exit_s: float | None = 0.2
    # Joining an epoch (runtime, restore, compile, the barrier) still blocked this long after a newer
    # epoch was announced: a member of the joined epoch died or never came (the coordination service
    # would wait init_timeout_s for it). The process exits for the warm standby to join the new one.
    # Longer than a step's grace: a healthy join of a doomed epoch finishes, then leaves in-process.
    stuck_join_exit_s: float | None = 2.0
    # A state up to this size goes from the member that holds it to the others through the JAX
    # coordination service's key-value store (no program to compile); larger ones by a collective.
    kv_broadcast_max_bytes: int = 256 * 1024 * 1024
    # In-process recoveries before the session asks for a fresh process instead.
    max_in_process_recoveries: int = 50
    # Persistent XLA compilation cache: a re-initialised process compiles from it.
    compilation_cache_dir: str | None = field(
        default_factory=lambda: os.path.join(tempfile.gettempdir(), "remesh-jax-cache")
    )
    # Host-memory snapshots that survive the trainer process (tmpfs); None keeps them in-process only.
    shm_dir: str | None = "/dev/shm" if os.path.isdir("/dev/shm") else None


@dataclass(frozen=True)
class StepResult:
    step: int
    epoch: int
    world_size: int
    metrics: Mapping[str, float]


class Session:
    def __init__(
        self,
        *,
        init_state: Callable[[], PyTree],
        train_step: Callable[[PyTree, jax.Array], tuple[PyTree, Mapping[str, jax.Array]]],
        batch_for_step: Callable[[int], np.ndarray],
        devices_per_host: int,
        policy: Policy | None = None,
        checkpoints: Sequence[CheckpointStore] = (),
        agent: AgentClient | None = None,
        job_id: str | None = None,
    ) -> None:
        self.policy = policy or Policy()
        self._init_state = init_state
        self._train_step = train_step
        self._batch_for_step = batch_for_step
        self.devices_per_host = devices_per_host
        self.checkpoints = list(checkpoints)
        self.agent = agent or AgentClient.from_env()
        job = job_id or os.environ.get("REMESH_JOB", "default")
        shm = (
            Path(self.policy.shm_dir) / f"remesh-{job}-{self.agent.latest.host_id or 'host'}"
            if self.policy.shm_dir
            else None
        )
        self.snapshots = Snapshots(self.policy.snapshots_kept, shm)
        self.runtime = Runtime(self.policy.init_timeout_s)
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remesh-ckpt")
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remesh-compile")
        self._saving: Future[None] | None = None
        self._treedef: Any = None
        self._template: list[np.ndarray] | None = None
        self._last_leaves: list[np.ndarray] = []
        self._pretraced = False
        # Timings of the recovery that led into the next epoch (teardown, waiting for the epoch).
        self._recovery: dict[str, float] = {}
        self.rank = -1
        # Steps completed in the current epoch (what a stall report names).
        self._step = 0
        # Seconds the training loop waited for a checkpoint save to finish, and seconds spent saving
        # (in the background); for goodput accounting.
        self.stats: dict[str, float] = {"checkpoint_wait_s": 0.0, "checkpoint_save_s": 0.0}
        # (epoch, since, grace, what) of the blocking work running now (joining an epoch, or a
        # step): the watchdog's view of the training loop.
        self._blocked: tuple[int, float, float, str] | None = None
        if self.policy.stuck_step_exit_s is not None or self.policy.stuck_join_exit_s is not None:
            threading.Thread(target=self._watchdog, name="remesh-watchdog", daemon=True).start()
        configure_cpu(devices_per_host, self.policy.collective_timeout_s, self.policy.compilation_cache_dir)

    # ---- the loop --------------------------------------------------------------------------------

    def run(self, num_steps: int) -> Iterator[StepResult]:
        """Train to ``num_steps``, across every epoch the agent assigns. Ends when done or halted."""
        assignment = self.agent.latest
        recoveries = 0
        while True:
            placed = self._until_placed(assignment)
            if placed is None:
                return
            assignment = placed
            try:
                yield from self._epoch(assignment, num_steps)
                return
            except Recoverable as exc:
                recoveries += 1
                t_fail = time.monotonic()
                log.warning("leaving epoch", epoch=assignment.epoch, reason=str(exc), recovery=recoveries)
                self._wait_for_save()  # Orbax calls JAX: it must finish before the runtime goes
                teardown = self.runtime.stop()
                if recoveries > self.policy.max_in_process_recoveries:
                    self._restart_process(f"{recoveries} in-process recoveries; asking for a fresh process")
                newer = self.agent.wait_newer(assignment.epoch, self.policy.epoch_wait_s)
                if newer is None:
                    self._restart_process(f"no new epoch within {self.policy.epoch_wait_s:g}s after: {exc}")
                self._recovery = {"teardown": teardown, "wait_epoch": time.monotonic() - t_fail - teardown}
                assignment = newer
            except AddressInUse as exc:
                self._exit(ADDRESS_IN_USE_EXIT_CODE, str(exc))
            except RestartProcess as exc:
                self._restart_process(str(exc))

    def _until_placed(self, assignment: Assignment) -> Assignment | None:
        """Standby until this host holds a rank (a spare, or shrunk away); None when the job halted."""
        while assignment.halted or assignment.rank < 0:
            if assignment.halted:
                log.info("job halted; the trainer stops", epoch=assignment.epoch)
                return None
            log.info("standby: no rank for this process yet", epoch=assignment.epoch)
            self._pretrace()
            placed = self.agent.wait_until(lambda a: a.halted or a.rank >= 0, 3600.0)
            assignment = placed or assignment
        return assignment

    def _watchdog(self) -> None:
        stall_after = self.policy.stall_report_s or self.policy.collective_timeout_s / 2
        reported: tuple[int, float] | None = None
        while True:
            time.sleep(0.05)
            blocked = self._blocked
            if blocked is None:
                continue
            epoch, since, grace, what = blocked
            if what == "step" and reported != (epoch, since) and time.monotonic() - since >= stall_after:
                reported = (epoch, since)
                # In the background: the agent may retry through a leader change, and this thread
                # must stay free to notice a new epoch.
                threading.Thread(
                    target=self.agent.report_stall,
                    args=(epoch, self._step, time.monotonic() - since),
                    name="remesh-stall",
                    daemon=True,
                ).start()
            latest = self.agent.latest
            if latest.epoch <= epoch:
                continue
            stuck = time.monotonic() - max(since, self.agent.changed_at)
            if stuck >= grace:
                self._restart_process(
                    f"{what} of epoch {epoch} still blocked {stuck:.2f}s after epoch {latest.epoch} "
                    "was announced: it waits for a dead peer"
                )

    def _blocking(self, epoch: int, grace: float | None, what: str) -> None:
        self._blocked = None if grace is None else (epoch, time.monotonic(), grace, what)

    def _restart_process(self, reason: str) -> NoReturn:
        self._exit(RESTART_EXIT_CODE, reason)

    def _exit(self, code: int, reason: str) -> NoReturn:
        log.error(
            "in-process recovery impossible; exiting for the agent to restart us", reason=reason, code=code
        )
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit: JAX's exit hooks would wait on a runtime whose peers are gone.
        os._exit(code)

    def _epoch(self, assignment: Assignment, num_steps: int) -> Iterator[StepResult]:
        phases, self._recovery = dict(self._recovery), {}
        # Wall-clock time this member began the epoch (a time, not a duration): with the epoch's
        # publication time it gives how long the epoch took to reach the trainer.
        phases["started_at"] = time.time()
        t = time.monotonic()
        self._blocking(assignment.epoch, self.policy.stuck_join_exit_s, "joining")
        mesh = self.runtime.start(assignment, lambda: self.agent.latest.epoch)
        self.rank = assignment.rank
        phases["reinit"] = time.monotonic() - t
        replicated = NamedSharding(mesh, P())
        by_rows = NamedSharding(mesh, P("data"))

        # Compile (from shapes alone) while the state is being restored: the two take about as long.
        self._template_leaves()  # traced once, here, before two threads need it
        compiling = self._compiler.submit(self._compile, assignment, replicated, by_rows)
        t = time.monotonic()
        leaves, step, source = self._restore(assignment)
        state = jax.tree_util.tree_unflatten(self._treedef, [jax.device_put(x, replicated) for x in leaves])
        phases["restore"] = time.monotonic() - t
        compiled, phases["compile"] = compiling.result()
        if assignment.rank == 0 and self.checkpoints:
            # From now on a writer of an older epoch (a host cut off from the coordinator that has
            # not noticed yet) is refused by every tier. In the background, before any save.
            self._saver.submit(self._fence_all, assignment.epoch)
        self.runtime.barrier("compiled", self.policy.init_timeout_s)
        self._blocked = None
        log.info("epoch ready", epoch=assignment.epoch, step=step, source=source, **_rounded(phases))

        acked = False
        self._step = step
        while step < num_steps:
            latest = self.agent.latest
            if latest.epoch > assignment.epoch:
                raise TopologyChanged(assignment.epoch, latest.epoch)
            t = time.monotonic()
            batch = self._local_batch(self._batch_for_step(step), assignment, by_rows)
            self._blocking(assignment.epoch, self.policy.stuck_step_exit_s, "step")
            with peer_failures():
                state, metrics = compiled(state, batch)
                host_leaves = [_to_host(x) for x in jax.tree_util.tree_leaves(state)]
                host_metrics = {k: float(_to_host(v)) for k, v in metrics.items()}
            self._blocked = None
            step += 1
            self._step = step
            self._last_leaves = host_leaves
            self.snapshots.put(step, host_leaves)
            if not acked:
                phases["first_step"] = time.monotonic() - t
                self._ack(assignment, step - 1, source, phases)
                acked = True
            self.agent.report_progress(step, assignment.epoch)
            self._maybe_checkpoint(step, assignment, host_leaves)
            yield StepResult(step, assignment.epoch, assignment.world_size, host_metrics)
        self._wait_for_save()
        if not acked:  # restored at the last step (a peer died at the end): the epoch still goes live
            self._ack(assignment, step, source, phases)
        self._finish(assignment, step)

    def _ack(self, assignment: Assignment, restored: int, source: str, phases: Mapping[str, float]) -> None:
        """Acknowledge the epoch. A refusal means a newer epoch began (``EpochSuperseded``: move on);
        no answer at all, even after the agent's own retries, asks for a fresh process rather than
        train in an epoch that can never go live."""
        try:
            self.agent.ack(assignment.epoch, restored, source, phases)
        except AgentUnreachable as exc:
            raise RestartProcess(str(exc)) from exc

    def _finish(self, assignment: Assignment, step: int) -> None:
        """The job's last step is done here: once every member has done it, report the job finished
        and leave the JAX runtime together (rank 0 last), so that no exit on the way out is a fault."""
        self._blocking(assignment.epoch, self.policy.stuck_join_exit_s, "finishing")
        self.runtime.barrier("finished", self.policy.init_timeout_s)
        self._blocked = None
        for attempt in range(3):
            try:
                self.agent.finish(assignment.epoch, step)
                break
            except AgentUnreachable as exc:
                log.warning("could not report the job finished; retrying", error=str(exc), attempt=attempt)
        else:
            raise RestartProcess("the agent did not take the report that the job finished")
        log.info("job finished", step=step, epoch=assignment.epoch)
        try:
            self.runtime.leave_together(self.policy.init_timeout_s)
        except Exception as exc:  # the job is finished; a peer that left early changes nothing
            log.warning(
                "leaving the JAX runtime at the end reported an error", error=str(exc).splitlines()[0]
            )

    def _pretrace(self) -> None:
        """Trace the state's shapes and the step function while idle, not during a recovery.

        Tracing is the Python half of compiling; JAX caches the traced program by argument shapes,
        so the lowering for the real mesh later skips it.
        """
        if self._pretraced:
            return
        template = self._template_leaves()
        sample = self._batch_for_step(0)
        state = jax.tree_util.tree_unflatten(
            self._treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in template]
        )
        jax.jit(self._train_step).trace(state, jax.ShapeDtypeStruct(sample.shape, sample.dtype))
        self._pretraced = True

    def _compile(
        self, assignment: Assignment, replicated: NamedSharding, by_rows: NamedSharding
    ) -> tuple[Any, float]:
        t = time.monotonic()
        template = self._template_leaves()
        state = jax.tree_util.tree_unflatten(
            self._treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated) for x in template]
        )
        # Any step's batch has the shape of every step's batch.
        sample = self._batch_for_step(max(assignment.restore_step, 0))
        batch = jax.ShapeDtypeStruct(sample.shape, sample.dtype, sharding=by_rows)
        step_fn = jax.jit(
            self._train_step, in_shardings=(replicated, by_rows), out_shardings=(replicated, replicated)
        )
        return step_fn.lower(state, batch).compile(), time.monotonic() - t

    # ---- state -----------------------------------------------------------------------------------

    def _template_leaves(self) -> list[np.ndarray]:
        if self._template is None:
            shapes = jax.eval_shape(self._init_state)
            leaves, self._treedef = jax.tree_util.tree_flatten(shapes)
            self._template = [np.zeros(s.shape, s.dtype) for s in leaves]
        return self._template

    def _restore(self, assignment: Assignment) -> tuple[list[np.ndarray], int, str]:
        """Agree with every member on the state of ``restore_step`` and return it (host leaves)."""
        template = self._template_leaves()
        target = assignment.restore_step
        mine = self.snapshots.get(target, template) if target >= 0 else None
        holders = self.runtime.allgather_int("snapshot", 1 if mine else 0, self.policy.init_timeout_s)
        if any(holders):
            source_rank = holders.index(1)
            is_source = assignment.rank == source_rank
            size = sum(x.nbytes for x in template)
            if size <= self.policy.kv_broadcast_max_bytes:
                payload = _pack(mine[0]) if is_source and mine else None
                leaves = _unpack(
                    self.runtime.share_bytes("state", payload, source_rank, self.policy.init_timeout_s)
                )
            else:
                with peer_failures():
                    leaves = multihost_utils.broadcast_one_to_all(
                        mine[0] if mine else template, is_source=is_source
                    )
                leaves = [np.asarray(x) for x in leaves]
            source = mine[1] if mine else f"peer:rank{source_rank}"
            return leaves, target, source
        # No member holds it in memory: the newest committed checkpoint at or below it, chosen by
        # rank 0 so every member loads the same one.
        candidate = self._newest_checkpoint(target, assignment.commits) if assignment.rank == 0 else -1
        chosen = self.runtime.allgather_int("checkpoint", candidate, self.policy.init_timeout_s)[0]
        if chosen < 0:
            log.info(
                "no snapshot or checkpoint to restore: starting from scratch",
                target=target,
                snapshots_here=self.snapshots.steps(),
            )
            self.snapshots.clear()
            init = jax.jit(self._init_state)()
            return [np.asarray(x) for x in jax.tree_util.tree_leaves(init)], 0, "scratch"
        for store in self.checkpoints:
            if (store.latest_viable(chosen, assignment.commits) or -1) == chosen:
                self.snapshots.clear()
                tree = store.restore_state(
                    chosen, jax.tree_util.tree_unflatten(self._treedef, template), assignment.commits
                )
                return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)], chosen, store.name
        raise RestartProcess(f"checkpoint of step {chosen} chosen by rank 0 is not readable here")

    def _newest_checkpoint(self, target: int, trusted: Trusted) -> int:
        """The newest checkpoint at or below ``target`` whose commit the coordinator accepted."""
        best = -1
        for store in self.checkpoints:
            step = store.latest_viable(None if target < 0 else target, trusted)
            if step is not None and step > best:
                best = step
        return best

    def _maybe_checkpoint(self, step: int, assignment: Assignment, leaves: list[np.ndarray]) -> None:
        every = self.policy.checkpoint_every
        if not every or step % every or assignment.rank != 0 or not self.checkpoints:
            return
        if self._saving is not None and not self._saving.done():
            log.warning("previous checkpoint still writing; skipping this one", step=step)
            return
        tree = jax.tree_util.tree_unflatten(self._treedef, leaves)
        self._saving = self._saver.submit(self._save_all, step, assignment.epoch, tree)

    def _wait_for_save(self) -> None:
        if self._saving is not None:
            t = time.monotonic()
            self._saving.result()
            self.stats["checkpoint_wait_s"] += time.monotonic() - t

    def _fence_all(self, epoch: int) -> None:
        for store in self.checkpoints:
            try:
                store.fence(epoch)
            except Exception as exc:  # a newer epoch already wrote (StaleEpoch), or the tier is down
                log.warning(
                    "could not raise the checkpoint fence", store=store.name, epoch=epoch, error=str(exc)
                )

    def _save_all(self, step: int, epoch: int, tree: PyTree) -> None:
        t = time.monotonic()
        try:
            self._save_each(step, epoch, tree)
        finally:
            self.stats["checkpoint_save_s"] += time.monotonic() - t

    def _save_each(self, step: int, epoch: int, tree: PyTree) -> None:
        for store in self.checkpoints:
            if self.agent.latest.epoch != epoch:
                log.warning(
                    "epoch moved on; not writing a checkpoint for the old one", step=step, epoch=epoch
                )
                return
            try:
                store.save(step, epoch, tree, {"step": step}, approve=self._approve)
            except StaleEpoch as exc:
                log.warning(
                    "checkpoint not committed: its epoch is over", store=store.name, step=step, error=str(exc)
                )
                return
            except Exception as exc:  # a failed save loses nothing committed; training goes on
                log.warning("checkpoint save failed", store=store.name, step=step, error=str(exc))

    def _approve(self, step: int, epoch: int, tier: str) -> None:
        """The coordinator, through the agent, accepts the commit only while ``epoch`` is current."""
        try:
            self.agent.commit(epoch, step, tier)
        except EpochSuperseded as exc:
            raise StaleEpoch(str(exc)) from exc
        except AgentUnreachable as exc:
            raise CheckpointError(f"not committed: {exc}") from exc

    def _local_batch(
        self, global_batch: np.ndarray, assignment: Assignment, sharding: NamedSharding
    ) -> jax.Array:
        rows = global_batch.shape[0]
        if rows % (assignment.world_size * self.devices_per_host):
            raise ValueError(
                f"global batch of {rows} rows does not split over {assignment.world_size} hosts x "
                f"{self.devices_per_host} devices: choose a batch size every world size divides"
            )
        per_host = rows // assignment.world_size
        local = global_batch[assignment.rank * per_host : (assignment.rank + 1) * per_host]
        return jax.make_array_from_process_local_data(sharding, local, global_batch.shape)

    def final_leaves(self) -> list[np.ndarray]:
        """The state after the last completed step, as host arrays in tree-flatten order."""
        return list(self._last_leaves)

    def final_state(self) -> PyTree:
        return jax.tree_util.tree_unflatten(self._treedef, self._last_leaves)

    def close(self) -> None:
        self._saver.shutdown(wait=True)
        self._compiler.shutdown(wait=True)
        self.agent.close()


def _pack(leaves: list[np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, *leaves)
    return buffer.getvalue()


def _unpack(data: bytes) -> list[np.ndarray]:
    with np.load(io.BytesIO(data)) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def _to_host(x: jax.Array) -> np.ndarray:
    """A replicated array's value, from this process's own copy (no cross-process fetch).

    Copied: on CPU ``np.asarray`` may alias the device buffer, which the runtime frees when it is
    torn down, and this copy is exactly what must outlive the runtime.
    """
    return np.array(x.addressable_shards[0].data, copy=True)


def _rounded(phases: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in phases.items()}

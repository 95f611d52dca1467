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

import json
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from remesh.elastic.agent_client import AgentClient, Assignment
from remesh.elastic.checkpoints import Approve, CheckpointError, StaleEpoch, Trusted
from remesh.elastic.errors import (
    AddressInUse,
    AgentUnreachable,
    EpochSuperseded,
    PeerFailure,
    Recoverable,
    RestartProcess,
    StateLost,
    TopologyChanged,
)
from remesh.elastic.exchange import (
    FetchFailed,
    Pieces,
    PieceServer,
    RestorePoint,
    advertised_host,
    decode_key,
    encode_key,
    fetch,
)
from remesh.elastic.runtime import Runtime, configure_backend, peer_failures
from remesh.elastic.sharding import (
    AXES,
    Cell,
    Layout,
    Offer,
    Uncovered,
    assemble,
    build_mesh,
    cell_of,
    needed_cells,
    plan_fetch,
    whole,
)
from remesh.elastic.snapshots import Snapshots

__all__ = [
    "ADDRESS_IN_USE_EXIT_CODE",
    "RESTART_EXIT_CODE",
    "STATE_LOST_EXIT_CODE",
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
# Same code as remesh.agent.STATE_LOST_EXIT_CODE (EX_DATAERR): no tier holds the restore step.
STATE_LOST_EXIT_CODE = 65


class CheckpointStore(Protocol):
    """A checkpoint tier (``remesh.elastic.checkpoints``): local directory or GCS."""

    name: str

    def save(
        self, step: int, epoch: int, state: PyTree, extra: Mapping[str, Any], approve: Approve | None = None
    ) -> None: ...

    def latest_viable(self, max_step: int | None = None, trusted: Trusted = None) -> int | None: ...

    def restore_state(self, step: int, template: PyTree, trusted: Trusted = None) -> PyTree: ...

    def fence(self, epoch: int) -> None: ...

    # A sharded state: every process writes its own shards (tiers with ``sharded_saves``).
    sharded_saves: bool

    def prepare_global(self, step: int, epoch: int) -> bool: ...

    def write_global(self, step: int, state: PyTree) -> None: ...

    def commit_global(
        self, step: int, epoch: int, extra: Mapping[str, Any] | None = None, approve: Approve | None = None
    ) -> None: ...

    def restore_global(self, step: int, target: PyTree, trusted: Trusted = None) -> PyTree: ...


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
    # Every K steps each host copies one peer's own shards into its RAM (a buddy copy), in the
    # background, so a host lost under plain FSDP (no second replica) is restored without storage.
    # 1: at most one step lost; a refresh still running when the next is due is skipped, so a slow
    # network stretches K rather than queueing copies. 0: never. Only where a shard has one holder.
    buddy_every: int = 1
    # At the end of the run, gather the whole state onto every process (a collective) so that
    # ``final_leaves`` holds it even when it is sharded.
    gather_final: bool = False
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
        layout: Layout | None = None,
    ) -> None:
        self.policy = policy or Policy()
        self.layout = layout or Layout()
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
        # The copies this process keeps of its buddy's own pieces: in memory and in /dev/shm like its
        # own snapshots, since a survivor's trainer is often restarted (stuck in a collective with
        # the dead peer) and the copy must outlive it. The newest two: one may be a moment old.
        self.buddies = Snapshots(2, shm / "buddy" if shm is not None else None)
        # Every piece this process offered for the restore under way, by restore point: what its
        # piece server hands to the members that fetch from it.
        self._offered: dict[RestorePoint, Pieces] = {}
        self._server = PieceServer(self._serve, on_copied=self.snapshots.pin)
        self._peers: list[str] = []
        self.runtime = Runtime(self.policy.init_timeout_s)
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remesh-ckpt")
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remesh-compile")
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remesh-buddy")
        self._saving: Future[None] | None = None
        self._copying: Future[None] | None = None
        self._treedef: Any = None
        self._template: list[jax.ShapeDtypeStruct] | None = None
        self._last_pieces: Pieces = {}
        # Where the last restore's time went: agreeing on the restore point, fetching, building.
        self._restore_phases: dict[str, float] = {}
        self._final: list[np.ndarray] | None = None
        self._pretraced = False
        # The cells of the buddy this process copies, in the current epoch; None: no buddy copies.
        self._buddy: tuple[int, list[tuple[int, Cell]]] | None = None
        # Timings of the recovery that led into the next epoch (teardown, waiting for the epoch).
        self._recovery: dict[str, float] = {}
        self.rank = -1
        # Steps completed in the current epoch (what a stall report names).
        self._step = 0
        # Seconds the training loop waited for a checkpoint save to finish, and seconds spent saving
        # (in the background); for goodput accounting.
        self.stats: dict[str, float] = {"checkpoint_wait_s": 0.0, "checkpoint_save_s": 0.0}
        # Where the last restore took its state from: bytes per tier, and the step.
        self.last_restore: dict[str, Any] = {}
        # (epoch, since, grace, what) of the blocking work running now (joining an epoch, or a
        # step): the watchdog's view of the training loop.
        self._blocked: tuple[int, float, float, str] | None = None
        if self.policy.stuck_step_exit_s is not None or self.policy.stuck_join_exit_s is not None:
            threading.Thread(target=self._watchdog, name="remesh-watchdog", daemon=True).start()
        configure_backend(
            devices_per_host, self.policy.collective_timeout_s, self.policy.compilation_cache_dir
        )

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
            except StateLost as exc:
                self._exit(STATE_LOST_EXIT_CODE, str(exc))
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
        self.runtime.start(assignment, lambda: self.agent.latest.epoch)
        self.rank = assignment.rank
        mesh = build_mesh(jax.devices(), assignment.world_size, self.layout.replicas(assignment.world_size))
        phases["reinit"] = time.monotonic() - t
        shardings = self._shardings(mesh)
        by_rows = NamedSharding(mesh, P(AXES))
        replicated = NamedSharding(mesh, P())

        # Compile (from shapes alone) while the state is being restored: the two take about as long.
        compiling = self._compiler.submit(self._compile, assignment, shardings, by_rows, replicated)
        t = time.monotonic()
        leaves, step, source, tiers = self._restore(assignment, shardings)
        state = jax.tree_util.tree_unflatten(self._treedef, leaves)
        phases["restore"] = time.monotonic() - t
        phases.update(self._restore_phases)
        self.last_restore = {"step": step, "source": source, "bytes": dict(tiers)}
        compiled, phases["compile"] = compiling.result()
        if assignment.rank == 0 and self.checkpoints:
            # From now on a writer of an older epoch (a host cut off from the coordinator that has
            # not noticed yet) is refused by every tier. In the background, before any save.
            self._saver.submit(self._fence_all, assignment.epoch)
        self._buddy = self._buddy_of(assignment, shardings)
        self.runtime.barrier("compiled", self.policy.init_timeout_s)
        self._blocked = None
        log.info(
            "epoch ready",
            epoch=assignment.epoch,
            step=step,
            source=source,
            mesh=dict(mesh.shape),
            restored_bytes=tiers,
            **_rounded(phases),
        )

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
                leaves = jax.tree_util.tree_leaves(state)
                pieces = _own_pieces(leaves)
                host_metrics = {k: float(_scalar(v)) for k, v in metrics.items()}
            self._blocked = None
            step += 1
            self._step = step
            self._last_pieces = pieces
            if not acked:
                # The epoch runs here from now on: said before the snapshot is written, which only
                # the progress report below must wait for.
                phases["first_step"] = time.monotonic() - t
                self._ack(assignment, step - 1, source, phases, tiers)
                acked = True
            self.snapshots.put(step, assignment.epoch, pieces)
            self._maybe_copy_buddy(step, assignment)
            self.agent.report_progress(step, assignment.epoch)
            self._maybe_checkpoint(step, assignment, leaves, pieces)
            yield StepResult(step, assignment.epoch, assignment.world_size, host_metrics)
        self._wait_for_save()
        if not acked:  # restored at the last step (a peer died at the end): the epoch still goes live
            self._ack(assignment, step, source, phases, tiers)
        if self.policy.gather_final:
            with peer_failures():
                self._final = [
                    np.asarray(multihost_utils.process_allgather(x, tiled=True))
                    for x in jax.tree_util.tree_leaves(state)
                ]
        self._finish(assignment, step)

    def _ack(
        self,
        assignment: Assignment,
        restored: int,
        source: str,
        phases: Mapping[str, float],
        tiers: Mapping[str, int],
    ) -> None:
        """Acknowledge the epoch. A refusal means a newer epoch began (``EpochSuperseded``: move on);
        no answer at all, even after the agent's own retries, asks for a fresh process rather than
        train in an epoch that can never go live."""
        try:
            self.agent.ack(assignment.epoch, restored, source, phases, tiers)
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
        state = jax.tree_util.tree_unflatten(self._treedef, template)
        jax.jit(self._train_step).trace(state, jax.ShapeDtypeStruct(sample.shape, sample.dtype))
        self._pretraced = True

    def _shardings(self, mesh: Mesh) -> list[NamedSharding]:
        """Each leaf's sharding on ``mesh``, from the layout (asked again for every mesh)."""
        template = self._template_leaves()  # sets the tree structure
        shapes = jax.tree_util.tree_unflatten(self._treedef, template)
        specs = self._treedef.flatten_up_to(self.layout.specs(mesh, shapes))
        return [NamedSharding(mesh, spec) for spec in specs]

    def _compile(
        self,
        assignment: Assignment,
        shardings: list[NamedSharding],
        by_rows: NamedSharding,
        replicated: NamedSharding,
    ) -> tuple[Any, float]:
        t = time.monotonic()
        template = self._template_leaves()
        state = jax.tree_util.tree_unflatten(
            self._treedef,
            [
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                for x, s in zip(template, shardings, strict=True)
            ],
        )
        tree_shardings = jax.tree_util.tree_unflatten(self._treedef, shardings)
        # Any step's batch has the shape of every step's batch.
        sample = self._batch_for_step(max(assignment.restore_step, 0))
        batch = jax.ShapeDtypeStruct(sample.shape, sample.dtype, sharding=by_rows)
        step_fn = jax.jit(
            self._train_step,
            in_shardings=(tree_shardings, by_rows),
            out_shardings=(tree_shardings, replicated),
        )
        return step_fn.lower(state, batch).compile(), time.monotonic() - t

    # ---- state -----------------------------------------------------------------------------------

    def _template_leaves(self) -> list[jax.ShapeDtypeStruct]:
        if self._template is None:
            shapes = jax.eval_shape(self._init_state)
            leaves, self._treedef = jax.tree_util.tree_flatten(shapes)
            self._template = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in leaves]
        return self._template

    def _shapes(self) -> list[tuple[tuple[int, ...], Any]]:
        return [(tuple(x.shape), np.dtype(x.dtype)) for x in self._template_leaves()]

    def _serve(self, point: RestorePoint) -> Mapping[tuple[int, Cell], np.ndarray]:
        """What this process's piece server hands out for ``point``."""
        return {**self.buddies.held(*point), **self.snapshots.held(*point), **self._offered.get(point, {})}

    def _restore(
        self, assignment: Assignment, shardings: list[NamedSharding]
    ) -> tuple[list[jax.Array], int, str, dict[str, int]]:
        """Agree with every member on the state to start the epoch from, and build it on the mesh.

        In order: the newest step at or below the epoch's ``restore_step`` whose pieces the members
        hold between them (own snapshots, a surviving replica group, buddy copies), moving only the
        cells each process lacks, host to host; else the newest committed checkpoint; else, only if
        the job never completed a step, ``init_state``. Returns the leaves, the step, a source
        label, and the bytes per tier.
        """
        target = assignment.restore_step
        t = time.monotonic()
        offer = self._offer(target)
        with peer_failures():
            gathered = self.runtime.allgather_text("offers", json.dumps(offer), self.policy.init_timeout_s)
        offers = [json.loads(g) for g in gathered]
        self._restore_phases = {"restore_agree": time.monotonic() - t}
        self._peers = [o["addr"] for o in offers]
        if target >= 0:
            found = self._restore_from_members(assignment, offers, shardings)
            if found is not None:
                return found
        return self._restore_from_storage(assignment, shardings)

    def _offer(self, target: int) -> dict[str, Any]:
        """This process's pieces at every restore point up to ``target``, as it tells the others."""
        self._offered = {}
        points: dict[RestorePoint, dict[str, Any]] = {}
        if target >= 0:
            for snap in self.snapshots.all(target, self._shapes()):
                point = (snap.step, snap.layout)
                self._offered[point] = snap.pieces
                points[point] = {"tier": snap.tier, "own": [encode_key(k) for k in snap.pieces], "buddy": []}
            for copy in self.buddies.all(target, self._shapes()):
                point = (copy.step, copy.layout)
                self._offered[point] = {**copy.pieces, **self._offered.get(point, {})}
                entry = points.setdefault(point, {"tier": "memory", "own": [], "buddy": []})
                entry["buddy"] = [encode_key(k) for k in copy.pieces]
        host = advertised_host(self.agent.latest.jax_coordinator or "127.0.0.1:0")
        return {
            "addr": f"{host}:{self._server.port}",
            "points": [[s, e, v["tier"], v["own"], v["buddy"]] for (s, e), v in sorted(points.items())],
        }

    def _restore_from_members(
        self, assignment: Assignment, offers: list[dict[str, Any]], shardings: list[NamedSharding]
    ) -> tuple[list[jax.Array], int, str, dict[str, int]] | None:
        shapes = self._shapes()
        needed = {
            i: needed_cells(s, shape) for i, (s, (shape, _)) in enumerate(zip(shardings, shapes, strict=True))
        }
        points = sorted({(int(p[0]), int(p[1])) for o in offers for p in o["points"]}, reverse=True)
        for point in points:
            members = [
                Offer(
                    rank,
                    frozenset(decode_key(k) for k in p[3]),
                    frozenset(decode_key(k) for k in p[4]),
                    str(p[2]),
                )
                for rank, o in enumerate(offers)
                for p in o["points"]
                if (int(p[0]), int(p[1])) == point
            ]
            try:
                plan = plan_fetch(
                    assignment.rank, needed, members, [s for s, _ in shapes], [d.itemsize for _, d in shapes]
                )
            except Uncovered:
                log.info("the members do not hold every piece of this step", step=point[0], layout=point[1])
                continue
            t = time.monotonic()
            pieces = self._gather(assignment.rank, point, plan.sources)
            self._restore_phases["restore_fetch"] = time.monotonic() - t
            t = time.monotonic()
            leaves = self._build(pieces, shardings)
            self._restore_phases["restore_build"] = time.monotonic() - t
            self.snapshots.drop_after(point[0])
            self.buddies.drop_after(point[0])
            source = "+".join(sorted(plan.bytes_by_tier)) or "memory"
            return leaves, point[0], source, plan.bytes_by_tier
        return None

    def _gather(
        self, me: int, point: RestorePoint, sources: Mapping[tuple[int, Cell], tuple[int, str]]
    ) -> Pieces:
        """The pieces of ``sources``: this process's own from memory, the rest from their holders,
        every holder at once."""
        local = self._offered.get(point, {})
        pieces: Pieces = {k: local[k] for k, (rank, _) in sources.items() if rank == me}
        wanted: dict[int, list[tuple[int, Cell]]] = {}
        for key, (rank, _) in sources.items():
            if rank != me:
                wanted.setdefault(rank, []).append(key)
        if not wanted:
            return pieces
        with ThreadPoolExecutor(max_workers=len(wanted), thread_name_prefix="remesh-fetch") as pool:
            futures = {
                rank: pool.submit(fetch, self._peers[rank], point, keys, self.policy.init_timeout_s)
                for rank, keys in wanted.items()
            }
            for rank, future in futures.items():
                try:
                    pieces.update(future.result())
                except FetchFailed as exc:
                    raise PeerFailure(
                        f"rank {rank} could not serve its pieces of step {point[0]}: {exc}"
                    ) from exc
        return pieces

    def _build(self, pieces: Pieces, shardings: list[NamedSharding]) -> list[jax.Array]:
        """The state's leaves on the new mesh, each device's part assembled from ``pieces``."""
        by_leaf: dict[int, list[tuple[Cell, np.ndarray]]] = {}
        for (leaf, cell), values in pieces.items():
            by_leaf.setdefault(leaf, []).append((cell, values))
        leaves: list[jax.Array] = []
        for i, (sharding, (shape, dtype)) in enumerate(zip(shardings, self._shapes(), strict=True)):
            parts: dict[Cell, np.ndarray] = {}

            def part(
                index: tuple[slice, ...] | None,
                i: int = i,
                shape: tuple[int, ...] = shape,
                dtype: Any = dtype,
                parts: dict[Cell, np.ndarray] = parts,
            ) -> np.ndarray:
                cell = cell_of(index, shape)
                if cell not in parts:
                    parts[cell] = assemble(cell, by_leaf.get(i, []), dtype)
                return parts[cell]

            leaves.append(jax.make_array_from_callback(shape, sharding, part))
        return leaves

    def _restore_from_storage(
        self, assignment: Assignment, shardings: list[NamedSharding]
    ) -> tuple[list[jax.Array], int, str, dict[str, int]]:
        """The newest committed checkpoint at or below the restore step, chosen by rank 0 so every
        member loads the same one; ``init_state`` only where the job never completed a step."""
        target = assignment.restore_step
        # The commits the coordinator accepted in this job. None where it accepted none yet: a job
        # launched again (the full restart) resumes from what an earlier run committed, guarded by
        # the epoch fence only; once this job commits, only its own accepted commits count.
        trusted: Trusted = assignment.commits or None
        candidate = self._newest_checkpoint(target, trusted) if assignment.rank == 0 else -1
        chosen = self.runtime.allgather_int("checkpoint", candidate, self.policy.init_timeout_s)[0]
        if chosen < 0:
            if target > 0:
                raise StateLost(
                    assignment.epoch,
                    target,
                    f"no member holds step {target} or an earlier one in memory, and no committed "
                    f"checkpoint at or below it is readable (tiers: "
                    f"{', '.join(s.name for s in self.checkpoints) or 'none configured'})",
                )
            log.info("starting from scratch: the job has not completed a step", target=target)
            self.snapshots.clear()
            self.buddies.clear()
            tree_shardings = jax.tree_util.tree_unflatten(self._treedef, shardings)
            init = jax.jit(self._init_state, out_shardings=tree_shardings)()
            return jax.tree_util.tree_leaves(init), 0, "scratch", {}
        for store in self.checkpoints:
            if (store.latest_viable(chosen, trusted) or -1) != chosen:
                continue
            self.snapshots.clear()
            self.buddies.clear()
            template = self._template_leaves()
            if self._sharded(shardings):
                abstract = jax.tree_util.tree_unflatten(
                    self._treedef,
                    [
                        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                        for x, s in zip(template, shardings, strict=True)
                    ],
                )
                with peer_failures():
                    tree = store.restore_global(chosen, abstract, trusted)
                leaves = jax.tree_util.tree_leaves(tree)
            else:
                tree = store.restore_state(
                    chosen, jax.tree_util.tree_unflatten(self._treedef, template), trusted
                )
                host = jax.tree_util.tree_leaves(tree)
                leaves = self._build(
                    {(i, whole(x.shape)): np.asarray(x) for i, x in enumerate(host)}, shardings
                )
            nbytes = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.replica_id == 0)
            return leaves, chosen, store.name, {store.name: int(nbytes)}
        raise RestartProcess(f"checkpoint of step {chosen} chosen by rank 0 is not readable here")

    @staticmethod
    def _sharded(shardings: Sequence[NamedSharding]) -> bool:
        return any(not s.is_fully_replicated for s in shardings)

    def _newest_checkpoint(self, target: int, trusted: Trusted) -> int:
        """The newest checkpoint at or below ``target`` whose commit the coordinator accepted."""
        best = -1
        for store in self.checkpoints:
            step = store.latest_viable(None if target < 0 else target, trusted)
            if step is not None and step > best:
                best = step
        return best

    # ---- buddy copies ----------------------------------------------------------------------------

    def _buddy_of(
        self, assignment: Assignment, shardings: list[NamedSharding]
    ) -> tuple[int, list[tuple[int, Cell]]] | None:
        """The peer whose own pieces this process copies (the next rank) and their keys; None where
        no copy is needed (every cell of the peer is here already, or copies are off)."""
        if not self.policy.buddy_every or assignment.world_size < 2 or self.policy.snapshots_kept <= 0:
            return None
        buddy = (assignment.rank + 1) % assignment.world_size
        holders: dict[tuple[int, Cell], set[int]] = {}
        for i, (sharding, (shape, _)) in enumerate(zip(shardings, self._shapes(), strict=True)):
            for device, index in sharding.devices_indices_map(shape).items():
                holders.setdefault((i, cell_of(index, shape)), set()).add(_process_of(device))
        # Only the cells the buddy alone holds: another replica group, or this process, has the rest.
        only_there = sorted(key for key, ranks in holders.items() if ranks == {buddy})
        return (buddy, only_there) if only_there else None

    def _maybe_copy_buddy(self, step: int, assignment: Assignment) -> None:
        if self._buddy is None or step % self.policy.buddy_every:
            return
        if self._copying is not None and not self._copying.done():
            return  # the previous copy is still on its way: this one is skipped, not queued
        buddy, keys = self._buddy
        self._copying = self._copier.submit(
            self._copy_buddy, self._peers[buddy], (step, assignment.epoch), keys
        )

    def _copy_buddy(self, address: str, point: RestorePoint, keys: list[tuple[int, Cell]]) -> None:
        """Copy the buddy's own pieces of ``point``; it may be a moment behind, so retry briefly."""
        deadline = time.monotonic() + 2.0
        while True:
            try:
                pieces = fetch(address, point, keys, self.policy.init_timeout_s, pin=True)
            except FetchFailed as exc:
                if time.monotonic() > deadline or self.agent.latest.epoch > point[1]:
                    log.debug("buddy copy skipped", step=point[0], error=str(exc))
                    return
                time.sleep(0.01)
                continue
            self.buddies.put(point[0], point[1], pieces)
            return

    # ---- checkpoints -----------------------------------------------------------------------------

    def _maybe_checkpoint(
        self, step: int, assignment: Assignment, leaves: list[jax.Array], pieces: Pieces
    ) -> None:
        every = self.policy.checkpoint_every
        if not every or step % every or not self.checkpoints:
            return
        sharded = any(not x.sharding.is_fully_replicated for x in leaves)
        if not sharded and assignment.rank != 0:
            return
        if self._saving is not None and not self._saving.done():
            if sharded:  # every process takes part in a sharded save: none may go ahead alone
                self._wait_for_save()
            else:
                log.warning("previous checkpoint still writing; skipping this one", step=step)
                return
        if sharded:
            tree = jax.tree_util.tree_unflatten(self._treedef, leaves)
            self._saving = self._saver.submit(self._save_sharded, step, assignment, tree)
        else:
            host = [pieces[(i, whole(x.shape))] for i, x in enumerate(leaves)]
            tree = jax.tree_util.tree_unflatten(self._treedef, host)
            self._saving = self._saver.submit(self._save_all, step, assignment.epoch, tree)

    def _save_sharded(self, step: int, assignment: Assignment, tree: PyTree) -> None:
        """Every process writes its own shards (Orbax), rank 0 commits; tiers that can take a
        sharded state only (a directory every host reaches)."""
        t = time.monotonic()
        try:
            for store in self.checkpoints:
                if not store.sharded_saves:
                    continue
                ok = 1 if assignment.rank != 0 else self._prepare_sharded(store, step, assignment.epoch)
                if not self.runtime.allgather_int(
                    f"ckpt-{store.name}-{step}", ok, self.policy.init_timeout_s
                )[0]:
                    continue
                store.write_global(step, tree)
                if assignment.rank == 0:
                    try:
                        store.commit_global(step, assignment.epoch, {"step": step}, approve=self._approve)
                    except StaleEpoch as exc:
                        log.warning("checkpoint not committed: its epoch is over", step=step, error=str(exc))
        except Exception as exc:  # a failed save loses nothing committed; training goes on
            log.warning("sharded checkpoint save failed", step=step, error=str(exc).splitlines()[0])
        finally:
            self.stats["checkpoint_save_s"] += time.monotonic() - t

    @staticmethod
    def _prepare_sharded(store: CheckpointStore, step: int, epoch: int) -> int:
        """Rank 0's go (1) or no-go (0) for a sharded save; a failure is a no-go, said at once, so
        the others do not wait for an answer that never comes."""
        try:
            return int(store.prepare_global(step, epoch))
        except Exception as exc:
            log.warning("sharded checkpoint not written", store=store.name, step=step, error=str(exc))
            return 0

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
        """The state after the last completed step, as host arrays in tree-flatten order: whole
        leaves where this process holds them whole (replicated), else what ``gather_final`` gathered."""
        if self._final is not None:
            return list(self._final)
        out = []
        for i, (shape, _) in enumerate(self._shapes()):
            piece = self._last_pieces.get((i, whole(shape)))
            if piece is None:
                raise ValueError("the state is sharded: set Policy(gather_final=True) to get it whole")
            out.append(piece)
        return out

    def final_state(self) -> PyTree:
        return jax.tree_util.tree_unflatten(self._treedef, self.final_leaves())

    def close(self) -> None:
        self._saver.shutdown(wait=True)
        self._compiler.shutdown(wait=True)
        self._copier.shutdown(wait=False)
        self._server.close()
        self.agent.close()


def _own_pieces(leaves: Sequence[jax.Array]) -> Pieces:
    """This process's distinct shards of every leaf, copied to host memory.

    Copied: on CPU ``np.asarray`` may alias the device buffer, which the runtime frees when it is
    torn down (and while a view lives, donation is silently skipped); the copy must outlive both.
    """
    pieces: Pieces = {}
    for i, x in enumerate(leaves):
        for shard in x.addressable_shards:
            key = (i, cell_of(shard.index, x.shape))
            if key not in pieces:
                pieces[key] = np.array(shard.data, copy=True)
    return pieces


def _process_of(device: Any) -> int:
    return int(device.process_index)


def _scalar(x: jax.Array) -> np.ndarray:
    """A replicated metric's value, from this process's own copy (no cross-process fetch)."""
    return np.asarray(x.addressable_shards[0].data)


def _rounded(phases: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in phases.items()}

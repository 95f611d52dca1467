"""The elastic training session: the user's JAX loop, with failures handled by remesh.

The user hands over an ``init_state`` function, a ``train_step(state, batch) -> (state, metrics)``
and its data addressed by step (``data``: a ``StepData`` such as ``GrainData``, each host reading
only its own rows; or ``batch_for_step(step) -> global batch``), so a recovered run sees exactly the
data a clean run would, and iterates ``Session.run(num_steps)``. For every epoch the
agent assigns, the session

1. joins the JAX distributed runtime for the epoch (rank, world size, coordination address),
2. builds a data-parallel mesh over every device of every host,
3. restores the newest step its members hold between them in host memory (each fetching the pieces
   it lacks from the others), or the newest committed checkpoint (local, then GCS) where that is
   newer or the members hold none, else ``init_state`` (the order: ``restore_plan.choose``),
4. compiles the step, waits for every member, trains, acknowledges the epoch after the first step,

and when a new epoch arrives (``TopologyChanged`` at a step boundary) or a collective fails
(``PeerFailure``, a dead peer) it tears the runtime down and goes round again in the same process.
Where that is impossible it exits with ``RESTART_EXIT_CODE`` and the agent starts a fresh process;
the reason is named, with its fix, in the log and in the exit note the agent reads
(``remesh.elastic.exits``). Started without an agent (no ``REMESH_AGENT_ADDRESS``), the session is a
job of one host (``remesh.elastic.solo``).

The session is this loop over its parts, each a module of its own: ``restore`` (with the pure
``restore_plan``), ``schedule`` (when snapshots and buddy copies are due), ``snapshotting``,
``buddy_copies``, ``checkpointing``, ``compiling``, ``progress``, ``watchdog``, ``input_positions``
(every host's iterator position, for ``IteratorData``) and ``epoch`` (what happens between two
steps). Faults are injected only as a value (``faults.Faults``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jax
import numpy as np
import structlog
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from remesh.elastic.agent_client import AgentLink, Assignment
from remesh.elastic.buddy_copies import BuddyCopies
from remesh.elastic.checkpointing import CheckpointSaver, CheckpointStore
from remesh.elastic.compiling import StepCompiler
from remesh.elastic.data import StepData
from remesh.elastic.epoch import Epoch, EpochParts
from remesh.elastic.errors import (
    AddressInUse,
    AgentUnreachable,
    PeerFailure,
    Recoverable,
    RestartProcess,
    StateLost,
)
from remesh.elastic.exits import FIXES, ExitNote, Why, note_uncaught, write_note
from remesh.elastic.faults import FailOnce, Faults
from remesh.elastic.input_positions import InputPositions
from remesh.elastic.policy import Policy
from remesh.elastic.progress import Progress, StepResult, running_totals
from remesh.elastic.restore import Restorer
from remesh.elastic.runtime import Runtime, configure_backend
from remesh.elastic.schedule import SnapshotSchedule
from remesh.elastic.sharding import AXES, Layout, build_mesh, whole
from remesh.elastic.snapshots import hold_alone, release
from remesh.elastic.snapshotting import MissingTiers, Snapshotter, host_memory_tiers
from remesh.elastic.solo import SoloAgent, agent_from_env
from remesh.elastic.template import StateTemplate
from remesh.elastic.watchdog import Watchdog
from remesh.v1.contract import (
    ADDRESS_IN_USE_EXIT_CODE,
    RESTART_EXIT_CODE,
    STATE_LOST_EXIT_CODE,
    Env,
    recovery_id,
    snapshot_dir_name,
)

__all__ = [
    "ADDRESS_IN_USE_EXIT_CODE",
    "RESTART_EXIT_CODE",
    "STATE_LOST_EXIT_CODE",
    "CheckpointStore",
    "Epoch",
    "Faults",
    "Policy",
    "Session",
    "SnapshotSchedule",
    "StepResult",
    "wait_after",
]

log = structlog.get_logger("remesh.elastic")

# A trainer waiting for the epoch after a failed collective says so again this often (``wait_after``):
# a coordinator that took over meanwhile hears every member within this, and re-forms the epoch.
COLLECTIVE_REPORT_AGAIN_S = 5.0

PyTree = Any


class Session:
    """Trains through every epoch the agent assigns this host (see the module's docstring); started
    without an agent (``REMESH_AGENT_ADDRESS`` unset) it runs as a job of one host.

    ``init_state``: a function of no arguments that builds the state, a pytree of JAX arrays. It is
    traced with ``jax.eval_shape`` first (for the state's shapes and dtypes, before any device is
    used) and called under ``jax.jit`` only where no saved step is restored, so it must build its
    arrays with ``jax.numpy``/``jax.random``, not NumPy (``np.asarray`` of a traced array raises).
    ``devices_per_host``: the devices of each host (on CPU, XLA is given that many). ``train_step``
    and ``batch_for_step`` or ``data``: for ``run``; ``epochs`` leaves the loop to you.
    ``checkpoints``: where checkpoints are committed (``LocalCheckpoints``, GCS), if anywhere.
    ``policy``: how it recovers; ``schedule``: when snapshots and buddy copies are taken (by default
    ``SnapshotSchedule.of(policy)``); ``faults``: faults to inject, for tests and benchmarks only
    (none by default; built at the entry point, e.g. ``Faults.from_env()``)."""

    def __init__(
        self,
        *,
        init_state: Callable[[], PyTree],
        devices_per_host: int,
        train_step: Callable[[PyTree, PyTree], tuple[PyTree, Mapping[str, jax.Array]]] | None = None,
        batch_for_step: Callable[[int], np.ndarray] | None = None,
        data: StepData | None = None,
        policy: Policy | None = None,
        schedule: SnapshotSchedule | None = None,
        checkpoints: Sequence[CheckpointStore] = (),
        agent: AgentLink | None = None,
        job_id: str | None = None,
        layout: Layout | None = None,
        faults: Faults | None = None,
    ) -> None:
        # An exception that escapes the script from here on leaves an exit note naming it: the
        # coordinator tells a bug that fails on every host from a host that failed.
        note_uncaught()
        policy = self.policy = policy or Policy()
        # "cpu", "gpu", "tpu": the platform the backend will be made for (none is made here).
        self.platform = configure_backend(
            devices_per_host, policy.collective_timeout_s, policy.compilation_cache_dir
        )
        self.layout = layout or Layout()
        self.schedule = schedule or SnapshotSchedule.of(policy)
        faults = faults or Faults()
        if batch_for_step is not None and data is not None:
            raise TypeError("give the session batch_for_step or data, not both")
        if data is not None and not isinstance(data, StepData):
            raise TypeError(
                f"Session(data=...) takes a source addressed by step (GrainData, StepData), not "
                f"{type(data).__name__}: read an IteratorData in your own loop (Session.epochs, epoch.data)"
            )
        self._train_step = train_step
        self._batch_for_step = batch_for_step
        self._data = data
        self.devices_per_host = devices_per_host
        self.checkpoints = list(checkpoints)
        job = job_id or os.environ.get(Env.JOB, "default")
        self.job_id = job
        # Without an agent (REMESH_AGENT_ADDRESS unset) the script runs as a job of one host.
        self.agent: AgentLink = agent or agent_from_env(job, progress_every_s=policy.progress_every_s)
        self.template = StateTemplate(init_state)
        # The automatic cadence weighs the failure interval the coordinator observes, once it has.
        link = self.agent
        self.schedule.observe_failures(lambda: link.latest.failure_interval_s(time.time()))
        self.stats = running_totals()
        # The tiers that could not keep a snapshot of this process, counted and told to the agent.
        self._missing = MissingTiers(self.agent, self.stats, policy.shm_dir)
        shm_name = snapshot_dir_name(job, self.agent.latest.host_id)
        owner = os.environ.get(Env.AGENT_SESSION)
        # A job run alone holds its snapshot directory for as long as the process runs (see solo).
        self._alone: int | None = None
        if isinstance(self.agent, SoloAgent):
            owner = self.agent.session
            if policy.shm_dir:
                self._alone = _hold_alone(os.path.join(policy.shm_dir, shm_name))
        self.snapshots, self.buddies = host_memory_tiers(
            policy.shm_dir,
            shm_name,
            owner,
            self.schedule.own_snapshots_kept(policy.snapshots_kept),
            self._missing,
        )
        self.runtime = Runtime(policy.init_timeout_s)
        step_grace_s = policy.step_exit_after_s(self.platform)
        self.watchdog = Watchdog(
            self.agent,
            stall_after_s=policy.stall_report_after_s,
            step_grace_s=step_grace_s,
            join_grace_s=policy.stuck_join_exit_s,
            steps_done=lambda: self.progress.step,
            on_stuck=self._restart_process,
            # On CPU a collective waiting for a dead peer fails by itself: the process recovers in place.
            collectives_end=self.platform == "cpu",
        )
        self.progress = Progress(
            self.agent, self.watchdog, self.schedule, self.stats, policy.checkpoint_every
        )
        self.restorer = Restorer(
            self.runtime,
            self.template,
            init_state,
            self.snapshots,
            self.buddies,
            self.checkpoints,
            timeout_s=policy.init_timeout_s,
            peer_host=policy.peer_host,
        )
        self.snapshotter = Snapshotter(
            self.snapshots,
            self.schedule,
            self.watchdog,
            self.agent,
            self.stats,
            device_budget_bytes=policy.snapshot_device_budget_bytes,
            shard_delay_s=faults.snapshot_shard_delay_s,
        )
        self.buddy_copies = BuddyCopies(
            self.buddies,
            self.watchdog,
            self.agent,
            self.stats,
            timeout_s=policy.init_timeout_s,
            buddy_every=self.schedule.buddy_every,
            delay_s=faults.buddy_copy_delay_s,
        )
        self.saver = CheckpointSaver(
            self.checkpoints,
            self.runtime,
            self.agent,
            self.template,
            self.stats,
            every=policy.checkpoint_every,
            timeout_s=policy.init_timeout_s,
        )
        self.compiler = (
            StepCompiler(self.template, train_step, data, batch_for_step) if train_step is not None else None
        )
        # Every host's input position at the steps whose state is kept (IteratorData).
        self.positions = InputPositions(self.runtime, policy.init_timeout_s)
        # What every epoch works with: the parts above, and the faults injected into them.
        self._parts = EpochParts(
            policy, devices_per_host, self.agent, self.runtime, self.watchdog, self.progress, self.schedule,
            self.snapshotter, self.buddy_copies, self.saver, self.positions,
            FailOnce(faults.collective_fails_at_step), faults.compile_delay_s, self._finish,
        )  # fmt: skip
        self.rank = -1
        self._final: list[np.ndarray] | None = None
        # Timings of the recovery that led into the next epoch (teardown, waiting for the epoch).
        self._recovery: dict[str, float] = {}
        # Where the last restore took its state from: the step, a source label, bytes per source.
        self.last_restore: dict[str, Any] = {}
        # Set by ``close``: the threads of the session end.
        self._closed = False
        if step_grace_s is not None or policy.stuck_join_exit_s is not None:
            self.watchdog.start()

    @property
    def tiers_missing(self) -> dict[str, str]:
        """The tiers that could not keep a snapshot of this process (tier -> the last error)."""
        return self._missing.missing

    # ---- the loop --------------------------------------------------------------------------------

    def run(self, num_steps: int) -> Iterator[StepResult]:
        """Train to ``num_steps`` with the session's own loop, across every epoch the agent assigns:
        the step is compiled for each epoch's mesh while the state is restored. Ends when done or
        halted. Needs ``train_step``, and ``data`` (each host reads its own rows) or ``batch_for_step``
        (every host makes the whole global batch); ``epochs`` keeps the loop in your hands."""
        if self._train_step is None or (self._batch_for_step is None and self._data is None):
            raise TypeError(
                "Session.run needs train_step, and data or batch_for_step; or loop over Session.epochs"
            )
        for epoch in self._epochs(num_steps, compile=True):
            with epoch:
                assert epoch.compiled is not None
                state = epoch.state
                batches = epoch.data(self._data) if self._data is not None else None
                for step in epoch.steps():
                    if batches is not None:
                        batch = epoch.batch(next(batches))
                    else:
                        assert self._batch_for_step is not None
                        whole = self._batch_for_step(step)
                        batch = epoch.batch(whole[epoch.host_rows(whole.shape[0])])
                    # On CPU a dispatch may run the step (or wait for the one before) inline: a
                    # failed collective raises here, and ``with epoch`` ends the epoch on it.
                    state, metrics = epoch.compiled(state, batch)
                    result = epoch.done(state, metrics)
                    if result is not None:
                        yield result
            if epoch.last is not None:
                yield epoch.last

    def epochs(self, num_steps: int) -> Iterator[Epoch]:
        """Train to ``num_steps`` in your own loop: one ``Epoch`` per topology this host takes part in,
        its state restored onto the epoch's mesh. Use each inside ``with epoch:``, where a failure
        ends the epoch and the next one (re-meshed, restored) comes round::

            for epoch in session.epochs(num_steps):
                with epoch:
                    step_fn = epoch.jit(train_step, out_shardings=(epoch.shardings, None))
                    state = epoch.state
                    for step in epoch.steps():
                        state, metrics = step_fn(state, epoch.batch(my_rows(step)))
                        epoch.done(state, metrics)

        Ends when the last step is done everywhere, or the job halted.
        """
        return self._epochs(num_steps, compile=False)

    def _epochs(self, num_steps: int, compile: bool) -> Iterator[Epoch]:
        assignment = self.agent.latest
        recoveries = 0
        while True:
            placed = self._until_placed(assignment)
            if placed is None:
                return
            assignment = placed
            try:
                epoch = self._join(assignment, num_steps, compile)
                yield epoch
                if epoch.failure is not None:
                    raise epoch.failure
                if not epoch.finished:
                    raise RuntimeError(
                        f"the loop left epoch {assignment.epoch} at step {epoch.step} of {num_steps}: "
                        "iterate epoch.steps() to the end, inside `with epoch:`"
                    )
                return
            except Recoverable as exc:
                recoveries += 1
                if isinstance(exc, PeerFailure):
                    self.stats["peer_failures"] += 1
                    # Said at once, while the runtime is torn down: when no member is lost (a network
                    # failure between healthy hosts), the coordinator forms the same members into a
                    # new epoch once every member said so.
                    say_collective_failed(self.agent, assignment.epoch, self.progress.step, exc)
                t_fail = time.monotonic()
                log.warning(
                    "leaving epoch",
                    epoch=assignment.epoch,
                    reason=str(exc),
                    recoveries=recoveries,
                    recovery=recovery_id(self.job_id, assignment.epoch + 1),
                )
                # Orbax and the snapshot copies read from the devices: they must be done with them
                # before the runtime goes. Watched like a step while they wait for one (it may be
                # stuck in a collective with the dead peer until the collective timeout): still
                # waiting stuck_step_exit_s after the new epoch is out ends the process for the
                # warm standby, which restores from /dev/shm. A snapshot being copied stops at its
                # next shard and is dropped (``Snapshotter.let_go``): the library's own work is
                # never taken for a dead peer.
                self.watchdog.blocking(assignment.epoch, "leaving")
                self.saver.wait()
                self.snapshotter.let_go()
                self.watchdog.clear()
                teardown = self.runtime.stop()
                if recoveries > self.policy.max_in_process_recoveries:
                    self._restart_process(
                        Why.RECOVERIES_EXHAUSTED,
                        f"{recoveries} in-process recoveries; asking for a fresh process",
                    )
                newer = wait_after(
                    self.agent, assignment.epoch, exc, self.policy.epoch_wait_s, lambda: self.progress.step
                )
                if newer is None:
                    self._restart_process(
                        Why.NO_NEW_EPOCH, f"no new epoch within {self.policy.epoch_wait_s:g}s after: {exc}"
                    )
                self._recovery = {"teardown": teardown, "wait_epoch": time.monotonic() - t_fail - teardown}
                assignment = newer
            except AddressInUse as exc:
                self._exit(ADDRESS_IN_USE_EXIT_CODE, exc.why, str(exc))
            except StateLost as exc:
                self._exit(STATE_LOST_EXIT_CODE, exc.why, str(exc))
            except RestartProcess as exc:
                self._restart_process(exc.why, str(exc))

    def _until_placed(self, assignment: Assignment) -> Assignment | None:
        """Standby until this host holds a rank (a spare, or shrunk away); None when the job halted."""
        while assignment.halted or assignment.rank < 0:
            if assignment.halted:
                log.info("job halted; the trainer stops", epoch=assignment.epoch)
                return None
            log.info("standby: no rank for this process yet", epoch=assignment.epoch)
            if self.compiler is not None and self.platform == "cpu":
                # Traced while idle, not during the recovery that places it. Only on CPU: tracing may
                # make a backend (a constant the step creates), and an accelerator's devices belong
                # to the process that trains (a TPU chip opens in one process at a time).
                self.compiler.program()
            placed = self.agent.wait_until(lambda a: a.halted or a.rank >= 0, 3600.0)
            assignment = placed or assignment
        return assignment

    def _restart_process(self, why: Why, reason: str) -> NoReturn:
        self._exit(RESTART_EXIT_CODE, why, reason)

    def _exit(self, code: int, why: Why, reason: str) -> NoReturn:
        """End the process for a fresh one (the agent starts it), saying why: in the log, with the
        fix, and in the exit note the agent reads (``remesh.elastic.exits``)."""
        log.error(
            "in-process recovery impossible; exiting for the agent to start a fresh process",
            why=why.value,
            reason=reason,
            fix=FIXES[why],
            code=code,
        )
        write_note(ExitNote(why, reason, FIXES[why], code))
        # The newest step still waiting for its report (they go out at most once a second): the
        # agent tells the coordinator how far this process got when its successor acknowledges.
        self.agent.flush_progress(timeout=0.5)
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit: JAX's exit hooks would wait on a runtime whose peers are gone.
        os._exit(code)

    def _join(self, assignment: Assignment, num_steps: int, compile: bool) -> Epoch:
        """Take part in ``assignment``'s epoch: join its runtime, build its mesh, restore the state
        onto it (compiling the session's step meanwhile, with ``compile``), and meet every member."""
        phases, self._recovery = dict(self._recovery), {}
        if assignment.epoch >= 2:
            # Every line logged while joining (runtime, restore, compile, first step) names the
            # recovery it is part of, as the coordinator's and the agents' lines do; unbound on ack.
            structlog.contextvars.bind_contextvars(recovery=recovery_id(self.job_id, assignment.epoch))
        # Wall-clock time this member began the epoch (a time, not a duration): with the epoch's
        # publication time it gives how long the epoch took to reach the trainer.
        phases["started_at"] = time.time()
        t = time.monotonic()
        self.watchdog.blocking(assignment.epoch, "joining")
        self.runtime.start(assignment, lambda: self.agent.latest.epoch)
        self.rank = assignment.rank
        mesh = build_mesh(jax.devices(), assignment.world_size, self.layout.replicas(assignment.world_size))
        phases["reinit"] = time.monotonic() - t
        shardings = self._shardings(mesh)
        by_rows = NamedSharding(mesh, P(AXES))
        replicated = NamedSharding(mesh, P())

        # Compile (from shapes alone) while the state is being restored: the two take about as long.
        compiling = (
            self.compiler.compile_later(assignment, shardings, by_rows, replicated)
            if compile and self.compiler is not None
            else None
        )
        t = time.monotonic()
        restored = self.restorer.restore(assignment, shardings)
        state = self.template.tree(restored.leaves)
        phases["restore"] = time.monotonic() - t
        phases.update(restored.phases)
        step, source, restored_bytes = restored.step, restored.source, restored.restored_bytes
        self.last_restore = {"step": step, "source": source, "bytes": dict(restored_bytes)}
        compiled = None
        if compiling is not None:
            compiled, compile_parts = compiling.result()
            phases["compile"] = sum(compile_parts.values())
            phases.update(compile_parts)
        if assignment.rank == 0 and self.checkpoints:
            self.saver.fence_later(assignment.epoch)
        self.buddy_copies.begin(
            assignment,
            shardings,
            self.template.shapes(),
            self.restorer.peers,
            enabled=self.schedule.copies_buddies and self.policy.snapshots_kept > 0,
        )
        self.runtime.barrier("compiled", self.policy.init_timeout_s)
        self.watchdog.clear()
        log.info(
            "epoch ready",
            epoch=assignment.epoch,
            step=step,
            source=source,
            # The same pid in every epoch: the process recovered in place.
            pid=os.getpid(),
            mesh=dict(mesh.shape),
            restored_bytes=restored_bytes,
            **_rounded(phases),
        )
        self.progress.begin(step)
        self.snapshotter.begin(step)
        self.positions.begin()
        return Epoch(
            self._parts,
            assignment,
            num_steps,
            mesh=mesh,
            shardings=self.template.tree(shardings),
            state=state,
            step=step,
            source=source,
            restored_bytes=restored_bytes,
            phases=phases,
            compiled=compiled,
            restored_data=restored.data,
        )

    def _shardings(self, mesh: Mesh) -> list[NamedSharding]:
        """Each leaf's sharding on ``mesh``, from the layout (asked again for every mesh)."""
        shapes = self.template.tree(self.template.leaves())
        specs = self.template.flatten(self.layout.specs(mesh, shapes))
        return [NamedSharding(mesh, spec) for spec in specs]

    def _finish(self, assignment: Assignment, step: int, gathered: list[np.ndarray] | None) -> None:
        """The job's last step is done here: once every member has done it, report the job finished
        and leave the JAX runtime together (rank 0 last), so that no exit on the way out is a fault.
        ``gathered``: the state gathered whole (``Policy.gather_final``), for ``final_leaves``."""
        if gathered is not None:
            self._final = gathered
        self.watchdog.blocking(assignment.epoch, "finishing")
        self.runtime.barrier("finished", self.policy.init_timeout_s)
        self.watchdog.clear()
        for attempt in range(3):
            try:
                self.agent.finish(assignment.epoch, step)
                break
            except AgentUnreachable as exc:
                log.warning("could not report the job finished; retrying", error=str(exc), attempt=attempt)
        else:
            raise RestartProcess(
                "the agent did not take the report that the job finished", Why.AGENT_UNREACHABLE
            )
        log.info("job finished", step=step, epoch=assignment.epoch)
        self._release_host_memory()
        try:
            self.runtime.leave_together(self.policy.init_timeout_s)
        except Exception as exc:  # the job is finished; a peer that left early changes nothing
            log.warning(
                "leaving the JAX runtime at the end reported an error", error=str(exc).splitlines()[0]
            )

    def _release_host_memory(self) -> None:
        """The job finished: nothing restores from host memory any more, and this host's
        ``/dev/shm`` directory goes (tmpfs is RAM, and would hold the job's last snapshots long after
        it). Snapshots still being written (from this process's devices) are waited for; buddy
        copies are not (they fetch from peers that may have left)."""
        self.snapshotter.finish()
        self.buddy_copies.cancel()
        self.snapshots.clear()
        self.buddies.clear()
        if self.snapshots.directory is not None:  # the host's directory; the buddy copies' is in it
            release(self.snapshots.directory)

    # ---- the result ------------------------------------------------------------------------------

    def final_leaves(self) -> list[np.ndarray]:
        """The state after the last completed step, as host arrays in tree-flatten order: whole
        leaves where this process holds them whole (replicated), else what ``gather_final`` gathered."""
        if self._final is not None:
            return list(self._final)
        if self._closed:
            raise RuntimeError("the session is closed: take final_leaves() before close()")
        out = []
        last = self.snapshotter.last_pieces
        for i, (shape, _) in enumerate(self.template.shapes()):
            piece = last.get((i, whole(shape)))
            if piece is None:
                raise ValueError("the state is sharded: set Policy(gather_final=True) to get it whole")
            out.append(piece)
        return out

    def final_state(self) -> PyTree:
        return self.template.tree(self.final_leaves())

    def close(self) -> None:
        """End the session: every thread it started ends (the watchdog, its background work, the
        agent client's), and it lets go of every snapshot it holds in the process, so that no file of
        /dev/shm stays mapped (a file deleted since, as at the end of the job, gives its memory back
        then; one still there stays, for a trainer started next on this host). A checkpoint being
        saved is waited for; a snapshot on its way stops at its next shard. ``final_leaves`` comes
        before this. Closing twice does nothing; ``with Session(...) as session:`` closes it."""
        if self._closed:
            return
        self._closed = True
        self.watchdog.stop()
        self.buddy_copies.stop()
        self.snapshotter.close()
        self.saver.close()
        if self.compiler is not None:
            self.compiler.close()
        # A buddy copy not begun is not made; one under way gives up at its next attempt (stopped).
        self.buddy_copies.close()
        self.restorer.close()
        self.agent.close()  # wakes the watchdog, which sees itself stopped
        self.watchdog.join()
        if self.runtime.assignment is not None:  # left in the middle of an epoch
            self.runtime.stop()
        self.runtime.close()
        self.snapshots.let_go()
        self.buddies.let_go()
        if self._alone is not None:
            os.close(self._alone)
            self._alone = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close()


def say_collective_failed(agent: AgentLink, epoch: int, step: int, failure: PeerFailure) -> None:
    """Tell the agent a collective of ``epoch`` failed (at ``step``: the steps completed), in the
    background (it may wait for a coordinator)."""
    threading.Thread(
        target=agent.report_collective_failure,
        args=(epoch, step, str(failure)),
        name="remesh-collective-failed",
        daemon=True,
    ).start()


def wait_after(
    agent: AgentLink, epoch: int, failure: Recoverable, wait_s: float, steps_done: Callable[[], int]
) -> Assignment | None:
    """The first assignment after ``epoch``, or None after ``wait_s`` (``Policy.epoch_wait_s``). After
    a failed collective the report is said again every ``COLLECTIVE_REPORT_AGAIN_S`` meanwhile: the
    coordinator keeps such reports in memory, so one that was lost on its way, or held by a
    coordinator that another one took over from since, would leave every member waiting for an
    epoch nobody plans."""
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        newer = agent.wait_newer(epoch, max(0.0, min(left, COLLECTIVE_REPORT_AGAIN_S)))
        if newer is not None or left <= COLLECTIVE_REPORT_AGAIN_S:
            return newer
        if isinstance(failure, PeerFailure):
            say_collective_failed(agent, epoch, steps_done(), failure)


def _hold_alone(directory: str) -> int | None:
    """``snapshots.hold_alone`` on a job run alone's snapshot directory; None where the directory
    cannot be made (the snapshot tier then says so itself, ``host_memory_tiers``)."""
    try:
        return hold_alone(Path(directory))
    except OSError:
        return None


def _rounded(phases: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in phases.items()}

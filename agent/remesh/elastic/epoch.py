"""One topology epoch of the training loop, and what it works with: the session's parts.

``Session.epochs`` hands the loop one ``Epoch`` per topology this host takes part in. Between two
steps the epoch drives the session's parts (``EpochParts``), in this order: the watchdog watches the
step; once it is handed back, the first one acknowledges the epoch; a snapshot is taken where the
schedule says one is due, a buddy copy where it says so too, a checkpoint where one is due; and the
step before is waited for and reported.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import structlog
from jax.errors import JaxRuntimeError
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from remesh.elastic.agent_client import AgentLink, Assignment
from remesh.elastic.buddy_copies import BuddyCopies
from remesh.elastic.checkpointing import CheckpointSaver
from remesh.elastic.data import DataPosition, HostBatches, IteratorBatches, IteratorData, NotCarried, StepData
from remesh.elastic.errors import ElasticError, PeerFailure, StateLost, TopologyChanged
from remesh.elastic.exits import Why
from remesh.elastic.faults import FailOnce
from remesh.elastic.input_positions import InputPositions
from remesh.elastic.policy import Policy
from remesh.elastic.progress import Progress, StepResult
from remesh.elastic.runtime import Runtime, as_peer_failure, peer_failures
from remesh.elastic.schedule import SnapshotSchedule
from remesh.elastic.sharding import AXES
from remesh.elastic.snapshotting import Snapshotter
from remesh.elastic.watchdog import Watchdog

__all__ = ["Epoch", "EpochParts", "MemberProposals"]

log = structlog.get_logger("remesh.elastic")

PyTree = Any
# Compile a jitted function for (args, kwargs) and meet every member of the epoch: (jitted, name, args, kwargs).
Meet = Callable[[Any, str, tuple[Any, ...], dict[str, Any]], None]


@dataclass(frozen=True)
class EpochParts:
    """What an epoch works with: the session's parts, built once by ``Session`` for all its epochs."""

    policy: Policy
    devices_per_host: int
    agent: AgentLink
    runtime: Runtime
    watchdog: Watchdog
    progress: Progress
    schedule: SnapshotSchedule
    snapshotter: Snapshotter
    buddies: BuddyCopies
    saver: CheckpointSaver
    # Every host's input position at the steps whose state is kept (``IteratorData``).
    positions: InputPositions
    # Injected faults (``Faults``): a collective that fails once, a slower compile.
    collective_fault: FailOnce
    compile_delay_s: float
    # The job's last step is done here: (assignment, step, the state gathered whole or None).
    finish: Callable[[Assignment, int, list[np.ndarray] | None], None]


class MemberProposals:
    """How the members of one epoch agree on a snapshot interval (``schedule.Proposals``): posted to
    the coordination service's key-value store, no collective."""

    def __init__(self, parts: EpochParts, epoch: int) -> None:
        self._parts = parts
        self._epoch = epoch

    def post(self, name: str, value: int) -> None:
        self._parts.runtime.post_int(name, value)

    def gather(self, name: str, asked: int, at: int) -> list[int]:
        """Every member posted at step ``asked``, steps ago: one that has not is as far behind as a
        collective allows only a dead or stuck one to be, and is treated the same way (the watchdog
        sees a step; after the collective timeout it is a failed collective)."""
        p, epoch = self._parts, self._epoch
        proposals = p.runtime.posted_ints(name)
        if proposals is not None:
            return proposals
        p.watchdog.blocking(epoch, "step")
        deadline = time.monotonic() + p.policy.collective_timeout_s
        try:
            while proposals is None:
                if (latest := p.agent.latest.epoch) > epoch:
                    raise TopologyChanged(epoch, latest)
                if time.monotonic() > deadline:
                    raise PeerFailure(
                        f"a member did not post its snapshot interval of step {asked} within "
                        f"{p.policy.collective_timeout_s:g}s of step {at}: a peer is probably gone"
                    )
                time.sleep(0.005)
                proposals = p.runtime.posted_ints(name)
        finally:
            p.watchdog.clear()
        return proposals


class Epoch:
    """One topology epoch of a loop you write yourself (``Session.epochs``).

    The state arrives restored onto the epoch's mesh (``state``, at step ``step``); ``steps()``
    yields the steps left to train here; after dispatching each, hand the new state back with
    ``done(state, metrics)``: remesh snapshots it in the background, copies a buddy's shards,
    checkpoints and reports progress, and waits for the step before (never for the one just
    dispatched). A failure (a peer lost, a new topology) surfaces as an exception inside the epoch;
    ``with epoch:`` ends the epoch there and ``Session.epochs`` comes round with the next one.

    What the loop must keep to: the step is a function of the state and a batch only, and the batch
    is a function of the step (the data position is the step: ``StepData``) or comes from an
    iterator whose position remesh keeps (``IteratorData``, through ``data``), so a replayed step
    computes what it computed before; the state keeps its tree structure, shapes and dtypes; it is
    not donated to the next step (its snapshot is copied after that step is dispatched); every host
    feeds ``batch`` the same number of rows, a multiple of its devices.

    Steps are counted as steps done: ``step`` (and ``StepResult.step``, a checkpoint's step) is how
    many steps the state has taken; ``steps()`` yields, for each step it runs, the steps done before
    it (0 for the first step of a job), so ``epoch.step`` is one more once ``done`` took it back.

    Attributes:
        state: the state, restored onto this epoch's mesh (the pytree ``init_state`` describes).
        step: steps done: where this epoch starts, one more after each step ``done`` took back.
        mesh: the epoch's ``jax.sharding.Mesh`` over every device of every member.
        shardings: the state's shardings on that mesh, shaped like the state (``jit``'s
            ``out_shardings`` for the state).
        batch_sharding: the batch's: rows split over every device of every member.
        replicated: a sharding that replicates (for metrics).
        last: the ``StepResult`` of the job's last step once the epoch finished it (``done``
            returns the others); None before.
        assignment: this host's place in the epoch (``epoch``, ``rank``, ``world_size``, ``hosts``).
        num_steps: the step the job trains to.
        restored_from: where the state came from, a label (``memory``, ``host-shm``,
            ``peer+buddy``, a checkpoint store's name, or ``scratch`` for a job that starts).
    """

    def __init__(
        self,
        parts: EpochParts,
        assignment: Assignment,
        num_steps: int,
        *,
        mesh: Mesh,
        shardings: PyTree,
        state: PyTree,
        step: int,
        source: str,
        restored_bytes: Mapping[str, int],
        phases: dict[str, float],
        compiled: Callable[[PyTree, PyTree], tuple[PyTree, Any]] | None = None,
        restored_data: DataPosition | None = None,
    ) -> None:
        self._parts = parts
        self.assignment = assignment
        self.num_steps = num_steps
        self.mesh = mesh
        # The state's shardings on this mesh, shaped like the state (for jit's out_shardings).
        self.shardings: PyTree = shardings
        # The batch: rows split over every device of every host; metrics: replicated.
        self.batch_sharding = NamedSharding(mesh, P(AXES))
        self.replicated = NamedSharding(mesh, P())
        self.state = state
        # The next step to train (the restored step: steps done so far).
        self.step = step
        self.restored_from = source
        self.compiled = compiled
        # The last step's result, once the epoch finished (``done`` returns the others).
        self.last: StepResult | None = None
        self.failure: ElasticError | None = None
        self.finished = False
        self._restored_bytes = dict(restored_bytes)
        self._leaf_count = len(jax.tree_util.tree_leaves(state))
        self._phases = phases
        # How the members agree on a new snapshot interval in this epoch.
        self._proposals = MemberProposals(parts, assignment.epoch)
        self._acked = False
        self._handed_back = True
        self._started = 0.0
        # The step dispatched last, not yet waited for: (step, its metrics, a leaf of its state, when
        # it could start). Waited for once the next one is dispatched, so the devices never idle.
        self._pending: tuple[int, Mapping[str, jax.Array], jax.Array, float] | None = None
        # The input this epoch reads (``data``), kept in step with the steps handed back.
        self._batches: HostBatches | IteratorBatches | None = None
        # Every host's input position after the restored step, where one was kept with it.
        self._restored_data = restored_data
        # Functions made by ``jit`` so far: each one's meeting has its own name.
        self._jitted = 0

    @property
    def rank(self) -> int:
        return self.assignment.rank

    @property
    def phases(self) -> Mapping[str, float]:
        """Seconds this member spent joining the epoch, by phase (``reinit``, ``restore`` and its
        parts, ``compile``, ``first_step`` once the first step is done): what it acknowledges."""
        return dict(self._phases)

    @property
    def world_size(self) -> int:
        return self.assignment.world_size

    @property
    def epoch(self) -> int:
        return self.assignment.epoch

    def host_rows(self, global_rows: int) -> slice:
        """The rows of a global batch of ``global_rows`` this host feeds: the contiguous block at its
        rank. After a shrink the same global batch splits over fewer hosts (more rows each)."""
        per = global_rows // self.world_size
        devices = self._parts.devices_per_host
        if global_rows % (self.world_size * devices):
            raise ValueError(
                f"a global batch of {global_rows} rows does not split over {self.world_size} hosts x "
                f"{devices} devices: choose a batch size every world size divides"
            )
        return slice(self.rank * per, (self.rank + 1) * per)

    def batch(self, rows: PyTree) -> PyTree:
        """This host's rows of the global batch (``host_rows``; an array or a tree of arrays) as the
        global arrays the step takes."""

        def whole(leaf: Any) -> jax.Array:
            leaf = np.asarray(leaf)
            shape = (leaf.shape[0] * self.world_size, *leaf.shape[1:])
            self.host_rows(shape[0])  # the divisibility rule, said the same way everywhere
            return jax.make_array_from_process_local_data(self.batch_sharding, leaf, shape)

        return jax.tree.map(whole, rows)

    def data(self, source: StepData | IteratorData) -> HostBatches | IteratorBatches:
        """This host's batches from the restored step on: ``next()`` once per step.

        From a ``StepData`` (a ``GrainData``: read ahead in the background), this host's rows of
        every global batch: the data position is the step, so the input resumes exactly where the
        restored state left it, on any number of hosts. From an ``IteratorData``, this host's
        iterator with the position it had after the restored step (``remesh.elastic.data`` says
        which on another number of hosts; where none can be had, the epoch ends with ``StateLost``
        and the job halts with the reason); remesh keeps its position with every snapshot and
        checkpoint from here on."""
        if self._batches is not None:
            self._batches.close()
        if isinstance(source, IteratorData):
            return self._iterator(source)
        rows = self.host_rows(source.global_batch_size)
        self._batches = HostBatches.of(source, self.step, self.num_steps, rows)
        log.info(
            "input resumes",
            step=self.step,
            record=self.step * source.global_batch_size + rows.start,
            rows=rows.stop - rows.start,
            world_size=self.world_size,
        )
        return self._batches

    def _iterator(self, source: IteratorData) -> IteratorBatches:
        try:
            batches, how = source.open(
                self.rank, self.world_size, self.step, self.num_steps, self._restored_data
            )
        except NotCarried as exc:
            raise StateLost(self.epoch, self.step, str(exc), Why.DATA_POSITION_LOST) from exc
        self._batches = batches
        log.info(
            "input resumes from its iterator's position",
            step=self.step,
            position=how,
            rank=self.rank,
            world_size=self.world_size,
        )
        return batches

    def jit(self, fun: Callable[..., Any], /, **jit_kwargs: Any) -> Callable[..., Any]:
        """``jax.jit(fun, **jit_kwargs)`` for this epoch, with one difference: its first call compiles
        ahead of running (``lower``, ``compile``) and then waits for every member of the epoch, so that
        no member enters the step's first collective while another is still compiling.

        On CPU a collective gives up after the policy's ``collective_timeout_s`` (2 s by default: a
        dead peer is noticed that soon), and hosts compile the same step at different speeds (a busy
        host, a cold compilation cache): with plain ``jax.jit`` the first step of an epoch fails
        whenever one member compiles that much later than another. Later calls are ``jax.jit``'s own;
        a call with new shapes compiles there as ``jax.jit`` does, without a meeting.
        """
        self._jitted += 1
        return _MeetsOnFirstCall(
            self._compile_and_meet, jax.jit(fun, **jit_kwargs), f"compiled-{self._jitted}"
        )

    def _compile_and_meet(
        self, jitted: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Compile ``jitted`` for ``args`` and wait for every member to have compiled it too (the meeting
        of ``_MeetsOnFirstCall``)."""
        p = self._parts
        # Compiling is not a step blocked on its peers: nothing to report as a stall.
        p.watchdog.blocking(self.epoch, "joining")
        t = time.monotonic()
        if p.compile_delay_s:
            time.sleep(p.compile_delay_s)
        jitted.lower(*args, **kwargs).compile()
        compiled = time.monotonic()
        p.runtime.barrier(name, p.policy.init_timeout_s)
        waited = time.monotonic() - compiled
        # Phases of the epoch's acknowledgement: the first step's compile is part of the recovery.
        self._phases["compile"] = self._phases.get("compile", 0.0) + compiled - t
        self._phases["compile_wait"] = self._phases.get("compile_wait", 0.0) + waited
        log.info(
            "step compiled; every member has",
            name=name,
            seconds=round(compiled - t, 3),
            waited=round(waited, 3),
        )
        p.watchdog.blocking(self.epoch, "step")

    def steps(self) -> Iterator[int]:
        """The steps left to train in this epoch, each the number of steps done before it. Raises
        ``TopologyChanged`` at a step boundary once a newer epoch is announced. After the last one:
        waits for it, and for every member, then leaves the runtime (the job is finished)."""
        p = self._parts
        while self.step < self.num_steps:
            if not self._handed_back:
                raise RuntimeError(f"step {self.step}: hand the new state back with epoch.done(state) first")
            latest = p.agent.latest
            if latest.epoch > self.epoch:
                raise TopologyChanged(self.epoch, latest.epoch)
            if p.collective_fault.now(self.step):
                raise PeerFailure(
                    f"a collective failed (injected: Faults.collective_fails_at_step={self.step})"
                )
            self._handed_back = False
            self._started = time.monotonic()
            # The watchdog watches the step from here: on CPU its dispatch may wait in a collective.
            p.watchdog.blocking(self.epoch, "step")
            yield self.step
        if not self._handed_back:
            raise RuntimeError(f"step {self.step}: hand the new state back with epoch.done(state) first")
        self._end()

    def done(self, state: PyTree, metrics: Mapping[str, jax.Array] | None = None) -> StepResult | None:
        """The step is dispatched and ``state`` is its result: snapshot, copy, checkpoint and report
        in the background. Returns the step before, once done (scalar ``metrics`` as floats); with
        ``Policy.snapshot_device_budget_bytes``, once a snapshot of an earlier step still on its way
        holds no more device memory than that."""
        p = self._parts
        p.watchdog.clear()
        dispatched = time.monotonic()
        leaves = jax.tree_util.tree_leaves(state)
        if len(leaves) != self._leaf_count:
            raise TypeError("the state handed back is not shaped like the state the epoch began with")
        if self._pending is not None and self._pending[2].is_deleted():
            raise RuntimeError(
                "the state of the step before was donated to this one (donate_argnums): remesh "
                "snapshots it in the background while this step runs; do not donate the state"
            )
        metrics = {} if metrics is None else metrics
        self.state = state
        self.step += 1
        self._handed_back = True
        step = self.step
        if self._batches is not None and self._batches.step != step:
            raise RuntimeError(
                f"step {step - 1} took the batches of steps {step - 1} to {self._batches.step - 1} of "
                "epoch.data: take exactly one batch (next()) per step"
            )
        if not self._acked:
            # The epoch runs here from now on once its first step is done: said before anything
            # else, and waited for this once.
            p.watchdog.blocking(self.epoch, "step")
            with peer_failures():
                jax.block_until_ready((leaves[0], metrics))
            p.watchdog.clear()
            p.progress.first_done()
            self._phases["first_step"] = time.monotonic() - self._started
            p.progress.ack(self.assignment, step - 1, self.restored_from, self._phases, self._restored_bytes)
            self._acked = True
        # What keeps the state beside training: a snapshot where one is due (and the last step's),
        # a buddy copy of it where this is a buddy step, a checkpoint where one is due; each with
        # every host's input position after the step, where the input keeps its own.
        snapshot = p.snapshotter.due(step, self._proposals) or step == self.num_steps
        position = None
        if isinstance(self._batches, IteratorBatches) and (snapshot or p.saver.due(step)):
            p.positions.post(step, self._batches.state())
            position = functools.partial(p.positions.gather, step)
        if snapshot:
            p.snapshotter.take(
                step,
                self.epoch,
                leaves,
                wait=step == self.num_steps,
                alone=self.world_size == 1,
                position=position,
            )
            if p.buddies.active and p.schedule.buddy_step(step):
                p.buddies.copy_later(step, self.assignment)
        p.snapshotter.within_device_budget(step, self.epoch)
        p.saver.maybe_save(step, self.assignment, leaves, position)
        result = p.progress.completed(self.assignment, *self._pending) if self._pending is not None else None
        self._pending = (step, metrics, leaves[0], max(dispatched, p.progress.done_at))
        return result

    def _close_input(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None

    def _end(self) -> None:
        p = self._parts
        self._close_input()
        if self._pending is not None:
            self.last = p.progress.completed(self.assignment, *self._pending)
            self._pending = None
        p.saver.wait()
        if not self._acked:  # restored at the last step (a peer died at the end): the epoch still goes live
            p.progress.ack(self.assignment, self.step, self.restored_from, self._phases, self._restored_bytes)
            self._acked = True
        gathered = None
        if p.policy.gather_final:
            with peer_failures():
                gathered = [
                    np.asarray(multihost_utils.process_allgather(x, tiled=True))
                    for x in jax.tree_util.tree_leaves(self.state)
                ]
        p.finish(self.assignment, self.step, gathered)
        self.finished = True

    def __enter__(self) -> Epoch:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        """A failure of the epoch (a peer lost, a new topology, a fresh process needed) ends it here
        for ``Session.epochs`` to handle; anything else is the loop's own and goes on up."""
        self._close_input()
        if isinstance(exc, JaxRuntimeError):
            exc = as_peer_failure(exc)
        if isinstance(exc, ElasticError):
            self.failure = exc
            return True
        return False


class _MeetsOnFirstCall:
    """A jitted function (``Epoch.jit``) whose first call compiles it and meets every member of the
    epoch before running it (``meet``); its other attributes (``lower``, ``trace``, ...) are the
    function's."""

    def __init__(self, meet: Meet, jitted: Any, name: str) -> None:
        self._meet: Meet | None = meet
        self._jitted = jitted
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._meet is not None:
            self._meet(self._jitted, self._name, args, kwargs)
            self._meet = None
        return self._jitted(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)

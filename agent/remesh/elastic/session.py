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
   newer or the members hold none, else ``init_state``,
4. compiles the step, waits for every member, trains, acknowledges the epoch after the first step,

and when a new epoch arrives (``TopologyChanged`` at a step boundary) or a collective fails
(``PeerFailure``, a dead peer) it tears the runtime down and goes round again in the same process.
Where that is impossible it exits with ``RESTART_EXIT_CODE`` and the agent starts a fresh process.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn, Protocol

import jax
import numpy as np
import structlog
from jax.errors import JaxRuntimeError
from jax.experimental import multihost_utils
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from remesh.elastic.agent_client import PROGRESS_EVERY_S, AgentClient, AgentLink, Assignment
from remesh.elastic.cadence import Cadence
from remesh.elastic.checkpoints import Approve, CheckpointError, StaleEpoch, Trusted
from remesh.elastic.data import HostBatches, StepData
from remesh.elastic.errors import (
    AddressInUse,
    AgentUnreachable,
    ElasticError,
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
    lower_priority,
)
from remesh.elastic.host_copies import SnapshotCopy, copies_of
from remesh.elastic.runtime import Runtime, as_peer_failure, configure_backend, peer_failures
from remesh.elastic.sharding import (
    AXES,
    Cell,
    Fetch,
    Layout,
    Offer,
    Uncovered,
    build,
    build_mesh,
    cell_of,
    first_replicas,
    needed_cells,
    plan_fetch,
    whole,
)
from remesh.elastic.snapshots import HOST_SHM, Snapshots, claim, release
from remesh.v1.contract import (
    ADDRESS_IN_USE_EXIT_CODE,
    COMPILATION_CACHE_ENV,
    RESTART_EXIT_CODE,
    STATE_LOST_EXIT_CODE,
    Env,
    recovery_id,
)

__all__ = [
    "ADDRESS_IN_USE_EXIT_CODE",
    "RESTART_EXIT_CODE",
    "STATE_LOST_EXIT_CODE",
    "CheckpointStore",
    "Epoch",
    "Policy",
    "Session",
    "StepResult",
]

log = structlog.get_logger("remesh.elastic")

# A trainer waiting for the epoch after a failed collective says so again this often (``_wait_after``):
# a coordinator that took over meanwhile hears every member within this, and re-forms the epoch.
COLLECTIVE_REPORT_AGAIN_S = 5.0

PyTree = Any


class CheckpointStore(Protocol):
    """A checkpoint tier (``remesh.elastic.checkpoints``): local directory or GCS."""

    name: str

    def save(
        self, step: int, epoch: int, state: PyTree, extra: Mapping[str, Any], approve: Approve | None = None
    ) -> None: ...

    def latest_present(
        self, max_step: int | None = None, trusted: Trusted = None, above: int | None = None
    ) -> int | None: ...

    def verify_share(self, step: int, rank: int, world_size: int, trusted: Trusted = None) -> bool: ...

    def restore_state(self, step: int, template: PyTree, trusted: Trusted = None) -> PyTree: ...

    def fence(self, epoch: int) -> None: ...

    # A sharded state: every process writes its own shards (tiers with ``sharded_saves``).
    sharded_saves: bool

    def prepare_global(self, step: int, epoch: int) -> bool: ...

    def write_global(self, step: int, state: PyTree) -> None: ...

    # ... as one plain file of its pieces per process (``write_pieces``) rather than with Orbax.
    writes_pieces: bool
    # Whether ``write_global`` tells the digests of what it wrote (rank 0 commits once all did).
    tells_digests: bool

    def write_pieces(self, step: int, rank: int, layout: int, pieces: Pieces) -> int: ...

    def commit_global(
        self, step: int, epoch: int, extra: Mapping[str, Any] | None = None, approve: Approve | None = None
    ) -> None: ...

    def restore_global(
        self, step: int, target: PyTree, trusted: Trusted = None, verified: bool = False
    ) -> PyTree: ...


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
    # Host-memory snapshots kept: the restore is the newest step whose pieces the members hold
    # between them, and one member's newest snapshot may be a step or two ahead of another's.
    snapshots_kept: int = 3
    # Take a host-memory snapshot (this process's own shards, into RAM and /dev/shm) every K steps,
    # in the background: a thread copies them once the step is done, beside the steps after it, so
    # no step waits for it. One at a time (each holds device memory until copied): with one still
    # on its way, a job of one host skips the next one due (a snapshot slower than K steps thus
    # stretches the interval kept: stats["snapshot_every_kept"], and a warning that says which K it
    # fits in); with several hosts the loop waits for it instead (every member must hold the same
    # steps, and each one's skips would follow its own timing). A failure loses at most the K - 1
    # steps after the newest snapshot every member holds, and they are replayed (the batch is a
    # function of the step).
    # "auto" (the default): K is Young's interval, sqrt(2 x cost x mtbf_s), from what a snapshot
    # costs the loop, measured on its own step times and its waits for snapshots, and never fewer
    # steps than a snapshot takes; agreed by every member (the largest proposal: the slowest member
    # sets everyone's pace); 5 until the first agreement, after 30 steps (remesh.elastic.cadence).
    # A snapshot that costs nothing is taken every 3 steps (on a GPU or TPU the copy is DMA beside
    # the compute) or as often as it fits; one that costs much (on CPU the copy shares the cores
    # with the step, benchmarks/overhead.py) is taken rarely. Buddy copies then go with every
    # snapshot (buddy_every 1) or never (0). A number: every K steps, fixed (1: nothing is ever
    # replayed, whatever it costs).
    snapshot_every: int | Literal["auto"] = "auto"
    # The device memory a snapshot may still hold, in bytes, when the loop hands the next step back
    # (Epoch.done). A snapshot keeps its step's arrays alive on the device until each is copied to
    # the host (released one by one as copied), and the loop has moved on to newer ones meanwhile:
    # on a device nearly full that is an out-of-memory error, not an overhead. None: one snapshot
    # of this process's own shards at most (one is on its way at a time), and the loop never waits.
    # A number: the loop waits (stats["snapshot_wait_s"], a cost the cadence counts) until the
    # snapshot on its way holds no more than this (0: none of an earlier step is left on the device
    # when a step is handed back).
    snapshot_device_budget_bytes: int | None = None
    # The expected time between failures of the whole job, for snapshot_every="auto": the rarer
    # failures are, the more steps a snapshot may be apart (a failure replays half of them, on
    # average). Three hours: a 16,000-GPU job saw one unexpected interruption every 3.1 hours
    # (Llama 3's 54-day pre-training run); smaller jobs fail more rarely and may say so.
    mtbf_s: float = 3 * 3600.0
    # Save a checkpoint every N steps from rank 0 (0: never).
    checkpoint_every: int = 0
    # A step blocked this long reports it (the agent tells the coordinator): when every other member
    # is blocked like this and one is not, that one stopped taking part and is replaced, before the
    # collective times out. None: half the collective timeout (a healthy step here takes tens of ms).
    stall_report_s: float | None = None
    # A step still running this long after a new epoch was announced is stuck in a collective with a
    # dead peer (it would wait for the collective timeout, then often abort inside gloo): the process
    # exits for the agent's warm standby process to take over at once. A new epoch that leaves out a
    # member of the step's epoch ends it at once: the step waits for a process that is gone. None:
    # always wait it out.
    stuck_step_exit_s: float | None = 0.2
    # Joining an epoch (runtime, restore, compile, the barrier) still blocked this long after a newer
    # epoch was announced: a member of the joined epoch died or never came (the coordination service
    # would wait init_timeout_s for it). The process exits for the warm standby to join the new one.
    # Longer than a step's grace: a healthy join of a doomed epoch finishes, then leaves in-process.
    stuck_join_exit_s: float | None = 2.0
    # Every K steps each host copies one peer's own shards into its RAM (a buddy copy), in the
    # background, so a host lost under plain FSDP (no second replica) is restored without storage.
    # A multiple of snapshot_every (the peer serves its snapshot of the step). Every host copies at
    # the same steps, never skipping one: a restore needs one step that the lost host's buddy copied
    # and every survivor still holds. A copy still running when the next is due runs beside it;
    # with two on their way, the loop waits (stats["buddy_wait_s"]) and says to raise K. 1: at most
    # one step lost. 0: never. Only where a shard has one holder.
    buddy_every: int = 1
    # At the end of the run, gather the whole state onto every process (a collective) so that
    # ``final_leaves`` holds it even when it is sharded.
    gather_final: bool = False
    # Tell the agent the newest completed step at most this often (remesh.elastic.agent_client); a
    # step that follows a stall report is told at once.
    progress_every_s: float = PROGRESS_EVERY_S
    # In-process recoveries before the session asks for a fresh process instead.
    max_in_process_recoveries: int = 50
    # Persistent XLA compilation cache: a re-initialised process compiles from it. By default
    # $REMESH_COMPILATION_CACHE_DIR, else remesh-jax-cache in the temporary directory (kept across
    # runs: a job started again finds its programs compiled).
    compilation_cache_dir: str | None = field(
        default_factory=lambda: (
            os.environ.get(COMPILATION_CACHE_ENV) or os.path.join(tempfile.gettempdir(), "remesh-jax-cache")
        )
    )
    # Host-memory snapshots that survive the trainer process (tmpfs); None keeps them in-process only.
    shm_dir: str | None = "/dev/shm" if os.path.isdir("/dev/shm") else None

    @property
    def own_snapshots_kept(self) -> int:
        """Own snapshots kept: ``snapshots_kept``, and with buddy copies on, every snapshot of the last
        3 x buddy_every steps. A host's newest whole buddy copy may be that far behind the step a
        survivor reached (two copies on their way, and the survivor a step ahead), and every
        survivor must still hold its own shards of that step for the restore to find it whole."""
        if self.snapshots_kept <= 0:
            return 0
        if self.snapshot_every == "auto":  # a copy with every snapshot
            return max(self.snapshots_kept, 3 + 1)
        return max(self.snapshots_kept, 3 * self.buddy_every // self.snapshot_every + 1)

    def __post_init__(self) -> None:
        if self.progress_every_s < 0:
            raise ValueError(f"progress_every_s must be >= 0, not {self.progress_every_s}")
        if self.snapshot_device_budget_bytes is not None and self.snapshot_device_budget_bytes < 0:
            raise ValueError(
                f"snapshot_device_budget_bytes must be None or >= 0, not {self.snapshot_device_budget_bytes}"
            )
        if self.snapshot_every == "auto":
            if self.buddy_every not in (0, 1):
                raise ValueError(
                    f'with snapshot_every="auto" a buddy copy goes with every snapshot (buddy_every 1) '
                    f"or with none (0), not every {self.buddy_every} steps"
                )
            if self.mtbf_s <= 0:
                raise ValueError(f"mtbf_s must be positive, not {self.mtbf_s}")
            return
        if not isinstance(self.snapshot_every, int) or self.snapshot_every < 1:
            raise ValueError(f'snapshot_every must be >= 1 or "auto", not {self.snapshot_every!r}')
        if self.buddy_every < 0 or (self.buddy_every and self.buddy_every % self.snapshot_every):
            raise ValueError(
                f"buddy_every ({self.buddy_every}) must be 0 or a multiple of snapshot_every "
                f"({self.snapshot_every}): a buddy copies the snapshot its peer took at that step"
            )


@dataclass(frozen=True)
class StepResult:
    step: int
    epoch: int
    world_size: int
    metrics: Mapping[str, float]


class Epoch:
    """One topology epoch of a loop you write yourself (``Session.epochs``).

    The state arrives restored onto the epoch's mesh (``state``, at step ``step``); ``steps()``
    yields the steps left to train here; after dispatching each, hand the new state back with
    ``done(state, metrics)``: remesh snapshots it in the background, copies a buddy's shards,
    checkpoints and reports progress, and waits for the step before (never for the one just
    dispatched). A failure (a peer lost, a new topology) surfaces as an exception inside the epoch;
    ``with epoch:`` ends the epoch there and ``Session.epochs`` comes round with the next one.

    What the loop must keep to: the step is a function of the state and a batch only, and the batch
    is a function of the step (the data position is the step), so a replayed step computes what it
    computed before; the state keeps its tree structure, shapes and dtypes; it is not donated to the
    next step (its snapshot is copied after that step is dispatched); every host feeds ``batch``
    the same number of rows, a multiple of its devices.
    """

    def __init__(
        self,
        session: Session,
        assignment: Assignment,
        num_steps: int,
        *,
        mesh: Mesh,
        shardings: list[NamedSharding],
        state: PyTree,
        step: int,
        source: str,
        tiers: Mapping[str, int],
        phases: dict[str, float],
        compiled: Callable[[PyTree, PyTree], tuple[PyTree, Any]] | None = None,
    ) -> None:
        self._session = session
        self.assignment = assignment
        self.num_steps = num_steps
        self.mesh = mesh
        # The state's shardings on this mesh, shaped like the state (for jit's out_shardings).
        self.shardings: PyTree = jax.tree_util.tree_unflatten(session._treedef, shardings)
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
        self._tiers = dict(tiers)
        self._phases = phases
        self._acked = False
        self._handed_back = True
        self._started = 0.0
        # The step dispatched last, not yet waited for: (step, its metrics, a leaf of its state, when
        # it could start). Waited for once the next one is dispatched, so the devices never idle.
        self._pending: tuple[int, Mapping[str, jax.Array], jax.Array, float] | None = None
        # The input this epoch reads (``data``), kept in step with the steps handed back.
        self._batches: HostBatches | None = None
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
        if global_rows % (self.world_size * self._session.devices_per_host):
            raise ValueError(
                f"a global batch of {global_rows} rows does not split over {self.world_size} hosts x "
                f"{self._session.devices_per_host} devices: choose a batch size every world size divides"
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

    def data(self, source: StepData) -> HostBatches:
        """This host's rows of every global batch of ``source`` from the restored step on (read ahead
        in the background for a ``GrainData``): ``next()`` once per step. The data position is the
        step, so the input resumes exactly where the restored state left it, on any number of hosts."""
        if self._batches is not None:
            self._batches.close()
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
        return _MeetsOnFirstCall(self, jax.jit(fun, **jit_kwargs), f"compiled-{self._jitted}")

    def _compile_and_meet(
        self, jitted: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Compile ``jitted`` for ``args`` and wait for every member to have compiled it too."""
        s = self._session
        # Compiling is not a step blocked on its peers: nothing to report as a stall.
        s._blocking(self.epoch, s.policy.stuck_join_exit_s, "joining")
        t = time.monotonic()
        if s._compile_delay_s:
            time.sleep(s._compile_delay_s)
        jitted.lower(*args, **kwargs).compile()
        compiled = time.monotonic()
        s.runtime.barrier(name, s.policy.init_timeout_s)
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
        s._blocking(self.epoch, s.policy.stuck_step_exit_s, "step")

    def steps(self) -> Iterator[int]:
        """The steps left to train in this epoch, each the number of steps done before it. Raises
        ``TopologyChanged`` at a step boundary once a newer epoch is announced. After the last one:
        waits for it, and for every member, then leaves the runtime (the job is finished)."""
        s = self._session
        while self.step < self.num_steps:
            if not self._handed_back:
                raise RuntimeError(f"step {self.step}: hand the new state back with epoch.done(state) first")
            latest = s.agent.latest
            if latest.epoch > self.epoch:
                raise TopologyChanged(self.epoch, latest.epoch)
            if self.step == s._fail_collective_at:
                s._fail_collective_at = -1
                raise PeerFailure(f"a collective failed (REMESH_FAULT_COLLECTIVE_AT_STEP={self.step})")
            self._handed_back = False
            self._started = time.monotonic()
            # The watchdog watches the step from here: on CPU its dispatch may wait in a collective.
            s._blocking(self.epoch, s.policy.stuck_step_exit_s, "step")
            yield self.step
        if not self._handed_back:
            raise RuntimeError(f"step {self.step}: hand the new state back with epoch.done(state) first")
        self._end()

    def done(self, state: PyTree, metrics: Mapping[str, jax.Array] | None = None) -> StepResult | None:
        """The step is dispatched and ``state`` is its result: snapshot, copy, checkpoint and report
        in the background. Returns the step before, once done (scalar ``metrics`` as floats); with
        ``Policy.snapshot_device_budget_bytes``, once a snapshot of an earlier step still on its way
        holds no more device memory than that."""
        s = self._session
        s._blocked = None
        dispatched = time.monotonic()
        leaves = jax.tree_util.tree_leaves(state)
        if len(leaves) != len(s._template_leaves()):
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
            s._blocking(self.epoch, s.policy.stuck_step_exit_s, "step")
            with peer_failures():
                jax.block_until_ready((leaves[0], metrics))
            s._blocked = None
            s._done_at = time.monotonic()
            self._phases["first_step"] = time.monotonic() - self._started
            s._ack(self.assignment, step - 1, self.restored_from, self._phases, self._tiers)
            self._acked = True
        if s._snapshot_due(step, self.epoch) or step == self.num_steps:
            s._snapshot(step, self.epoch, leaves, wait=step == self.num_steps, alone=self.world_size == 1)
            if s._buddy_step(step):
                s._copy_buddy_later(step, self.assignment)
        s._within_device_budget(step, self.epoch)
        s._maybe_checkpoint(step, self.assignment, leaves)
        result = s._completed(self.assignment, *self._pending) if self._pending is not None else None
        self._pending = (step, metrics, leaves[0], max(dispatched, s._done_at))
        return result

    def _close_input(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None

    def _end(self) -> None:
        s = self._session
        self._close_input()
        if self._pending is not None:
            self.last = s._completed(self.assignment, *self._pending)
            self._pending = None
        s._wait_for_save()
        if not self._acked:  # restored at the last step (a peer died at the end): the epoch still goes live
            s._ack(self.assignment, self.step, self.restored_from, self._phases, self._tiers)
            self._acked = True
        if s.policy.gather_final:
            with peer_failures():
                s._final = [
                    np.asarray(multihost_utils.process_allgather(x, tiled=True))
                    for x in jax.tree_util.tree_leaves(self.state)
                ]
        s._finish(self.assignment, self.step)
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
    epoch before running it; its other attributes (``lower``, ``trace``, ...) are the function's."""

    def __init__(self, epoch: Epoch, jitted: Any, name: str) -> None:
        self._epoch: Epoch | None = epoch
        self._jitted = jitted
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._epoch is not None:
            self._epoch._compile_and_meet(self._jitted, self._name, args, kwargs)
            self._epoch = None
        return self._jitted(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


class Session:
    def __init__(
        self,
        *,
        init_state: Callable[[], PyTree],
        devices_per_host: int,
        train_step: Callable[[PyTree, PyTree], tuple[PyTree, Mapping[str, jax.Array]]] | None = None,
        batch_for_step: Callable[[int], np.ndarray] | None = None,
        data: StepData | None = None,
        policy: Policy | None = None,
        checkpoints: Sequence[CheckpointStore] = (),
        agent: AgentLink | None = None,
        job_id: str | None = None,
        layout: Layout | None = None,
    ) -> None:
        self.policy = policy or Policy()
        self.layout = layout or Layout()
        self._init_state = init_state
        self._train_step = train_step
        if batch_for_step is not None and data is not None:
            raise TypeError("give the session batch_for_step or data, not both")
        self._batch_for_step = batch_for_step
        self._data = data
        self.devices_per_host = devices_per_host
        self.checkpoints = list(checkpoints)
        self.agent: AgentLink = agent or AgentClient.from_env(progress_every_s=self.policy.progress_every_s)
        job = job_id or os.environ.get(Env.JOB, "default")
        self.job_id = job
        shm = (
            Path(self.policy.shm_dir) / f"remesh-{job}-{self.agent.latest.host_id or 'host'}"
            if self.policy.shm_dir
            else None
        )
        owner = os.environ.get(Env.AGENT_SESSION)
        # The tiers that could not keep a snapshot of this process (tier -> the last error), and the
        # problems already logged and told to the agent (``_not_kept``).
        self.tiers_missing: dict[str, str] = {}
        self._problems: set[tuple[str, str]] = set()
        self._not_kept_lock = threading.Lock()
        unusable: str | None = None
        try:
            if shm is not None and owner:
                claim(shm, owner)
            self.snapshots = Snapshots(self.policy.own_snapshots_kept, shm, on_not_kept=self._not_kept)
        except OSError as exc:
            # A snapshot directory that cannot be made is a tier that keeps nothing, said as such
            # (counted, logged, an event) once the session can count: a trainer that refused to
            # start over it would fail the same way on every host, and the job would go round its
            # spares. Snapshots stay in the process.
            unusable, shm = f"{type(exc).__name__}: {exc}", None
            self.snapshots = Snapshots(self.policy.own_snapshots_kept, None, on_not_kept=self._not_kept)
        # The copies this process keeps of its buddy's own pieces: in memory and in /dev/shm like its
        # own snapshots, since a survivor's trainer is often restarted (stuck in a collective with
        # the dead peer) and the copy must outlive it. The newest two: one may be a moment old.
        # Their files are the buddy tier's, whatever directory they are in.
        self.buddies = Snapshots(
            2,
            shm / "buddy" if shm is not None else None,
            on_not_kept=lambda step, _tier, error: self._not_kept(step, "buddy", error),
        )
        # Every piece this process offered for the restore under way, by restore point: what its
        # piece server hands to the members that fetch from it.
        self._offered: dict[RestorePoint, Pieces] = {}
        # Started by the first epoch of more than one process (``_piece_address``): a world of one
        # fetches nothing, and its host may allow no TCP socket.
        self._server: PieceServer | None = None
        self._peers: list[str] = []
        self.runtime = Runtime(self.policy.init_timeout_s)
        # Work beside training runs at a lower CPU priority than the loop (lower_priority); not the
        # compiler, which a recovery waits for.
        self._saver = ThreadPoolExecutor(1, "remesh-ckpt", initializer=lower_priority)
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remesh-compile")
        self._copier = ThreadPoolExecutor(1, "remesh-buddy", initializer=lower_priority)
        self._snapshotter = ThreadPoolExecutor(1, "remesh-snapshot", initializer=lower_priority)
        # The snapshot on its way to the host (one at a time: ``_snapshot``), and the seconds the loop
        # waited for one since the last step it timed (left out of the step times the cadence reads).
        self._in_flight: _InFlight | None = None
        self._snapshot_waited = 0.0
        # The (asked, kept) snapshot intervals warned of (``_interval_kept``).
        self._told_intervals: set[tuple[int, int]] = set()
        self._saving: Future[None] | None = None
        # Buddy copies on their way, oldest first.
        self._copying: collections.deque[Future[None]] = collections.deque()
        # Fault injection (tests, benchmarks): every buddy copy first sleeps this long plus the
        # loop's own shortest recent interval between copies (its waits for copies left out): a
        # copy is slower than a step by this much however fast or slow the machine runs the loop,
        # so the loop waits about this long per copy, and no longer (its peers wait as long in the
        # next collective, which must not time out).
        self._told_slow_copies = False
        self._copy_delay_s = float(os.environ.get("REMESH_FAULT_BUDDY_COPY_DELAY_S", "0") or 0)
        self._copy_asked_at: tuple[int, float] | None = None  # (epoch, when)
        self._copy_intervals: collections.deque[float] = collections.deque(maxlen=5)
        # ... and compiling a step of the user's loop (``Epoch.jit``) first sleeps this long, as on a
        # slower or busier host.
        self._compile_delay_s = float(os.environ.get("REMESH_FAULT_COMPILE_DELAY_S", "0") or 0)
        # ... and a snapshot's copy to the host pauses this long before each shard, as a state of
        # gigabytes takes seconds to copy.
        self._snapshot_delay_s = float(os.environ.get("REMESH_FAULT_SNAPSHOT_SHARD_DELAY_S", "0") or 0)
        # ... and the step after this many steps fails here once, as a collective does when the
        # network between healthy hosts fails for a moment (its peers' collectives then time out).
        self._fail_collective_at = int(os.environ.get("REMESH_FAULT_COLLECTIVE_AT_STEP", "-1") or -1)
        self._treedef: Any = None
        self._template: list[jax.ShapeDtypeStruct] | None = None
        self._last_pieces: Pieces = {}
        # Where the last restore's time went: agreeing on the restore point, fetching, building.
        self._restore_phases: dict[str, float] = {}
        self._final: list[np.ndarray] | None = None
        self._program: tuple[ClosedJaxpr, Any] | None = None
        # The cells of the buddy this process copies, in the current epoch; None: no buddy copies.
        self._buddy: tuple[int, list[tuple[int, Cell]]] | None = None
        # Timings of the recovery that led into the next epoch (teardown, waiting for the epoch).
        self._recovery: dict[str, float] = {}
        self.rank = -1
        # Steps completed in the current epoch (what a stall report names).
        self._step = 0
        # When the step the loop last waited for was done (monotonic).
        self._done_at = 0.0
        # Seconds the training loop waited for a checkpoint save to finish, and seconds spent saving
        # (in the background); for goodput accounting.
        # Also sent to the agent with each progress report (its remesh_trainer_* metrics).
        self.stats: dict[str, float] = {
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
        if unusable is not None:
            self._not_kept(0, HOST_SHM, unusable)
        # When snapshots are due: every snapshot_every steps, or a cadence the members agree on
        # from what snapshots cost ("auto"); begun anew at every epoch.
        self._cadence = self._new_cadence(0)
        # Where the last restore took its state from: bytes per tier, and the step.
        self.last_restore: dict[str, Any] = {}
        # (epoch, step, when) of the last step completed: the next one is timed from it.
        self._last_completed: tuple[int, int, float] | None = None
        # (epoch, since, grace, what) of the blocking work running now (joining an epoch, or a
        # step): the watchdog's view of the training loop.
        self._blocked: tuple[int, float, float, str] | None = None
        # Set by ``close``: the threads of the session end.
        self._closed = False
        self._watching: threading.Thread | None = None
        if self.policy.stuck_step_exit_s is not None or self.policy.stuck_join_exit_s is not None:
            self._watching = threading.Thread(target=self._watchdog, name="remesh-watchdog", daemon=True)
            self._watching.start()
        # "cpu", "gpu", "tpu": the platform the backend will be made for (none is made here).
        self.platform = configure_backend(
            devices_per_host, self.policy.collective_timeout_s, self.policy.compilation_cache_dir
        )

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
                    self._say_collective_failed(assignment.epoch, exc)
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
                # next shard and is dropped (``_let_go_of_snapshot``): the library's own work is
                # never taken for a dead peer.
                self._blocking(assignment.epoch, self.policy.stuck_step_exit_s, "leaving")
                self._wait_for_save()
                self._let_go_of_snapshot()
                self._blocked = None
                teardown = self.runtime.stop()
                if recoveries > self.policy.max_in_process_recoveries:
                    self._restart_process(f"{recoveries} in-process recoveries; asking for a fresh process")
                newer = self._wait_after(assignment.epoch, exc)
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

    def _say_collective_failed(self, epoch: int, failure: PeerFailure) -> None:
        """Tell the agent a collective of ``epoch`` failed, in the background (it may wait for a
        coordinator)."""
        threading.Thread(
            target=self.agent.report_collective_failure,
            args=(epoch, self._step, str(failure)),
            name="remesh-collective-failed",
            daemon=True,
        ).start()

    def _wait_after(self, epoch: int, failure: Recoverable) -> Assignment | None:
        """The first assignment after ``epoch``, or None after ``policy.epoch_wait_s``. After a failed
        collective the report is said again every ``COLLECTIVE_REPORT_AGAIN_S`` meanwhile: the
        coordinator keeps such reports in memory, so one that was lost on its way, or held by a
        coordinator that another one took over from since, would leave every member waiting for
        an epoch nobody plans."""
        deadline = time.monotonic() + self.policy.epoch_wait_s
        while True:
            left = deadline - time.monotonic()
            newer = self.agent.wait_newer(epoch, max(0.0, min(left, COLLECTIVE_REPORT_AGAIN_S)))
            if newer is not None or left <= COLLECTIVE_REPORT_AGAIN_S:
                return newer
            if isinstance(failure, PeerFailure):
                self._say_collective_failed(epoch, failure)

    def _until_placed(self, assignment: Assignment) -> Assignment | None:
        """Standby until this host holds a rank (a spare, or shrunk away); None when the job halted."""
        while assignment.halted or assignment.rank < 0:
            if assignment.halted:
                log.info("job halted; the trainer stops", epoch=assignment.epoch)
                return None
            log.info("standby: no rank for this process yet", epoch=assignment.epoch)
            if self._train_step is not None and self.platform == "cpu":
                # Traced while idle, not during the recovery that places it. Only on CPU: tracing may
                # make a backend (a constant the step creates), and an accelerator's devices belong
                # to the process that trains (a TPU chip opens in one process at a time).
                self._step_program()
            placed = self.agent.wait_until(lambda a: a.halted or a.rank >= 0, 3600.0)
            assignment = placed or assignment
        return assignment

    def _watchdog(self) -> None:
        """Report a step blocked past ``stall_after``; end the process when blocking work outlives a
        new epoch by its grace. Sleeps until the nearest of those moments (at most the shortest
        threshold: work that begins meanwhile is due no sooner), or until the agent's assignment
        changes: a few wake-ups a second beside a healthy step, not twenty."""
        stall_after = self.policy.stall_report_s or self.policy.collective_timeout_s / 2
        graces = [g for g in (self.policy.stuck_step_exit_s, self.policy.stuck_join_exit_s) if g is not None]
        # Nothing blocked: work that begins now is due no sooner than this.
        idle_wait = min([stall_after, *graces])
        reported: tuple[int, float] | None = None
        while not self._closed:
            seen = self.agent.latest
            wait = idle_wait
            blocked = self._blocked
            if blocked is not None:
                epoch, since, grace, what = blocked
                now = time.monotonic()
                due = []
                if what == "step" and reported != (epoch, since):
                    if now - since >= stall_after:
                        reported = (epoch, since)
                        # In the background: the agent may retry through a leader change, and this
                        # thread must stay free to notice a new epoch.
                        threading.Thread(
                            target=self.agent.report_stall,
                            args=(epoch, self._step, now - since),
                            name="remesh-stall",
                            daemon=True,
                        ).start()
                    else:
                        due.append(since + stall_after)
                if seen.epoch > epoch:
                    stuck = now - max(since, self.agent.changed_at)
                    if what == "step" and self.agent.lost_a_member(epoch, seen):
                        # The step needs a process the new epoch left out: it cannot end, and the
                        # grace would only be waited out.
                        self._restart_process(
                            f"{what} of epoch {epoch} still blocked when epoch {seen.epoch} left out "
                            "a member of it: it waits for a process that is gone"
                        )
                    if stuck >= grace:
                        self._restart_process(
                            f"{what} of epoch {epoch} still blocked {stuck:.2f}s after epoch {seen.epoch} "
                            "was announced: it waits for a dead peer"
                        )
                    due.append(now + grace - stuck)
                # Blocking work that ends and begins again is due later than what is due now.
                wait = min([idle_wait, *(d - now for d in due)])
            # A new assignment wakes it; so does ``close`` (the agent's close wakes its waiters).
            self.agent.wait_until(functools.partial(self._moved_on, seen), max(wait, 0.005))

    def _moved_on(self, seen: Assignment, latest: Assignment) -> bool:
        """Whether the watchdog has something new to look at: a new assignment, or the session closed."""
        return latest is not seen or self._closed

    def _blocking(self, epoch: int, grace: float | None, what: str, since: float | None = None) -> None:
        """Blocking work begins (``since``: when it began, now by default) for the watchdog to judge."""
        began = time.monotonic() if since is None else since
        self._blocked = None if grace is None else (epoch, began, grace, what)

    def _restart_process(self, reason: str) -> NoReturn:
        self._exit(RESTART_EXIT_CODE, reason)

    def _exit(self, code: int, reason: str) -> NoReturn:
        log.error(
            "in-process recovery impossible; exiting for the agent to restart us", reason=reason, code=code
        )
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
        self._blocking(assignment.epoch, self.policy.stuck_join_exit_s, "joining")
        self.runtime.start(assignment, lambda: self.agent.latest.epoch)
        self.rank = assignment.rank
        mesh = build_mesh(jax.devices(), assignment.world_size, self.layout.replicas(assignment.world_size))
        phases["reinit"] = time.monotonic() - t
        shardings = self._shardings(mesh)
        by_rows = NamedSharding(mesh, P(AXES))
        replicated = NamedSharding(mesh, P())

        # Compile (from shapes alone) while the state is being restored: the two take about as long.
        compiling = (
            self._compiler.submit(self._compile, assignment, shardings, by_rows, replicated)
            if compile
            else None
        )
        t = time.monotonic()
        leaves, step, source, tiers = self._restore(assignment, shardings)
        state = jax.tree_util.tree_unflatten(self._treedef, leaves)
        phases["restore"] = time.monotonic() - t
        phases.update(self._restore_phases)
        self.last_restore = {"step": step, "source": source, "bytes": dict(tiers)}
        compiled = None
        if compiling is not None:
            compiled, compile_parts = compiling.result()
            phases["compile"] = sum(compile_parts.values())
            phases.update(compile_parts)
        if assignment.rank == 0 and self.checkpoints:
            # From now on a writer of an older epoch (a host cut off from the coordinator that has
            # not noticed yet) is refused by every tier. In the background, before any save.
            self._saver.submit(self._fence_all, assignment.epoch)
        self._buddy = self._buddy_of(assignment, shardings)
        self._copying.clear()  # copies of an older epoch end on their own (the epoch changed)
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
        self._step = step
        self._cadence = self._new_cadence(step)
        return Epoch(
            self,
            assignment,
            num_steps,
            mesh=mesh,
            shardings=shardings,
            state=state,
            step=step,
            source=source,
            tiers=tiers,
            phases=phases,
            compiled=compiled,
        )

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
        last = self._last_completed
        reached = last[1] if last is not None and last[0] < assignment.epoch else -1
        try:
            self.agent.ack(assignment.epoch, restored, source, phases, tiers, reached)
        except AgentUnreachable as exc:
            raise RestartProcess(str(exc)) from exc
        finally:
            structlog.contextvars.unbind_contextvars("recovery")

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
        self._release_host_memory()
        try:
            self.runtime.leave_together(self.policy.init_timeout_s)
        except Exception as exc:  # the job is finished; a peer that left early changes nothing
            log.warning(
                "leaving the JAX runtime at the end reported an error", error=str(exc).splitlines()[0]
            )

    def _completed(
        self,
        assignment: Assignment,
        step: int,
        metrics: Mapping[str, jax.Array],
        marker: jax.Array,
        since: float,
    ) -> StepResult:
        """Wait for ``step`` (the next one is already dispatched; ``marker``: one of its outputs;
        ``since``: when it could start) and report it, without waiting."""
        self._blocking(assignment.epoch, self.policy.stuck_step_exit_s, "step", since)
        with peer_failures():
            jax.block_until_ready(marker)
            host_metrics = {k: float(_scalar(v)) for k, v in metrics.items()}
        self._blocked = None
        self._done_at = time.monotonic()
        self._step = step
        last = self._last_completed
        if last is not None and last[:2] == (assignment.epoch, step - 1):
            self.stats["steps"] += 1
            self.stats["step_s"] += self._done_at - last[2]
            every = self.policy.checkpoint_every
            if not (every and step % every in (0, 1)):  # a checkpoint's steps measure the checkpoint
                # The loop's waits for snapshots are told to the cadence as such (``observe_wait``).
                took = self._done_at - last[2] - self._snapshot_waited
                self._cadence.observe(step, max(took, 0.0))
        self._snapshot_waited = 0.0
        self._last_completed = (assignment.epoch, step, self._done_at)
        self.agent.report_progress_later(step, assignment.epoch, self.stats)
        return StepResult(step, assignment.epoch, assignment.world_size, host_metrics)

    # ---- snapshots -------------------------------------------------------------------------------

    def _snapshot(
        self, step: int, epoch: int, leaves: Sequence[jax.Array], wait: bool = False, alone: bool = False
    ) -> None:
        """Copy this process's own shards of ``step`` to the host in the background
        (``SnapshotCopy``: each shard's device buffer let go of once copied) and keep them as a
        snapshot once whole.

        One at a time: a snapshot holds its step's arrays on the device until each is copied, and
        the loop has moved on to newer ones by then (two on their way would hold two more copies of
        the state). A process ``alone`` in its epoch skips one due while the last is still on its
        way, not queued, so a slow host stretches the interval instead of piling up copies (and says
        so: ``_interval_kept``). With other members the loop waits instead: a restore needs one step
        that every member holds, and skips decided by each member's own timing would leave them
        holding different steps (an HSDP job lost every step that way). Waits are a cost the
        cadence counts, so an automatic one moves to an interval the snapshots fit in.
        """
        if self._harvest_snapshot() is not None:
            if alone and not (wait or self._buddy_step(step)):
                log.debug("snapshot skipped: the last one is still on its way", step=step)
                self.stats["snapshots_skipped"] += 1
                return
            self._wait_for_snapshot(epoch)
        # Nothing is read from the devices here, not even copy_to_host_async: on CPU it waits for the
        # step to finish, and a step stuck in a collective with a frozen peer would hold the loop
        # where the watchdog cannot see it. On CPU ``np.asarray`` is a view of the device buffer,
        # which the runtime frees when it is torn down: a snapshot kept as it is must be copied;
        # one the snapshot store writes to its /dev/shm file (and keeps that, mapped) need not be.
        copy = SnapshotCopy(
            _own_shards(leaves), owned=self.snapshots.directory is None, shard_delay_s=self._snapshot_delay_s
        )
        snap = _InFlight(step, epoch, copy)
        snap.future = self._snapshotter.submit(self._keep_snapshot, snap)
        self._in_flight = snap
        if wait:
            self._wait_for_snapshot(epoch)

    def _harvest_snapshot(self) -> _InFlight | None:
        """The snapshot on its way, or None once there is none; one that ended is counted here, on
        the loop's thread (what it took, for the cadence; the interval kept)."""
        snap = self._in_flight
        if snap is None or not snap.future.done():
            return snap
        self._in_flight = None
        if (exc := snap.future.exception()) is not None:
            log.error(
                "snapshot not kept: taking it failed", step=snap.step, error=f"{type(exc).__name__}: {exc}"
            )
        elif snap.kept_at is not None:
            self._cadence.observe_snapshot(snap.kept_at - snap.copy.created)
            self._interval_kept(snap.step)
        return None

    def _wait_for_snapshot(self, epoch: int, enough: Callable[[], bool] | None = None) -> None:
        """Wait for the snapshot on its way to end (or, with ``enough``, until that holds). While it
        waits for its step the watchdog sees a step (it may be stuck in a collective with a dead
        peer); while it copies, nothing is blocked (its own work, progressing). A newer epoch ends
        the wait (``TopologyChanged``). The time goes to ``stats["snapshot_wait_s"]`` and the cadence
        (a cost of snapshots the step times do not show)."""
        snap = self._in_flight
        assert snap is not None
        t = time.monotonic()
        try:
            while not snap.future.done() and not (enough is not None and enough()):
                if snap.copy.phase == "step":
                    self._blocking(epoch, self.policy.stuck_step_exit_s, "step", since=t)
                else:
                    self._blocked = None
                futures_wait([snap.future], timeout=0.01 if enough is not None else 0.05)
                latest = self.agent.latest.epoch
                if latest > epoch:
                    raise TopologyChanged(epoch, latest)
        finally:
            self._blocked = None
            waited = time.monotonic() - t
            self.stats["snapshot_wait_s"] += waited
            self._snapshot_waited += waited
            self._cadence.observe_wait(waited)
        self._harvest_snapshot()
        log.debug("waited for a snapshot", step=snap.step, waited_s=round(waited, 3))

    def _interval_kept(self, step: int) -> None:
        """A snapshot of ``step`` was kept: the steps since the one before (both on the cadence) are
        the interval kept (``stats["snapshot_every_kept"]``). One longer than asked (a snapshot took
        longer than the steps between them: the ones due meanwhile were skipped) is said once for
        each interval asked and kept, with one that snapshots fit in."""
        cadence = self._cadence
        kept = cadence.kept(step)
        if kept is None:
            return
        self.stats["snapshot_every_kept"] = kept
        asked = cadence.every
        if kept == asked or (asked, kept) in self._told_intervals:
            return
        self._told_intervals.add((asked, kept))
        # What the recent snapshots fit in; where that is no more than asked (this one was slower
        # than the others), what was kept.
        fits = cadence.fits_every() or kept
        fix = fits if fits > asked else kept
        adapts = self.policy.snapshot_every == "auto" and fits > asked
        log.warning(
            "snapshots are kept further apart than asked: one took longer than the steps between "
            "them, and one due while the last is still on its way is skipped"
            + (
                f"; the automatic cadence moves to at least {fits} steps when its members next agree"
                if adapts
                else f"; ask for an interval they fit in: Policy(snapshot_every={fix})"
            ),
            asked_every=asked,
            kept_every=kept,
            snapshot_s=round(max(cadence.snapshot_s, default=0.0), 3),
            step_s=round(statistics.median(cadence.step_s), 4) if cadence.step_s else None,
            fix=f"Policy(snapshot_every={fix})",
        )

    def _within_device_budget(self, step: int, epoch: int) -> None:
        """The loop hands ``step`` back: a snapshot of an earlier step still on its way holds device
        memory beside the live state; with ``Policy.snapshot_device_budget_bytes`` the loop waits
        until it holds no more than that. The most it held then is ``stats["snapshot_held_bytes_peak"]``."""
        snap = self._harvest_snapshot()
        if snap is None or snap.step >= step:  # none, or this step's own (the live state)
            return
        budget = self.policy.snapshot_device_budget_bytes
        if budget is not None and snap.copy.held_bytes > budget:
            self._wait_for_snapshot(epoch, lambda: snap.copy.held_bytes <= budget)
        peak = self.stats["snapshot_held_bytes_peak"]
        self.stats["snapshot_held_bytes_peak"] = max(peak, snap.copy.held_bytes)

    def _let_go_of_snapshot(self) -> None:
        """The epoch is being left: the snapshot on its way stops at its next shard and is dropped
        (the restore takes the newest snapshot kept; a copy of gigabytes would hold the recovery for
        seconds). It is waited for only until it lets go of the epoch's arrays (the runtime goes
        next): a shard, or its step where it still waits for that, watched as the caller set it up
        (a step stuck with a dead peer ends the process after its grace); its own copying or writing
        is no dead peer, and is not watched. One already being written is written whole."""
        snap = self._in_flight
        if snap is None:
            return
        snap.copy.stop()
        while not futures_wait([snap.future], timeout=0.01).done:
            if snap.copy.phase != "step":
                self._blocked = None
        self._harvest_snapshot()

    def _wait_for(self, futures: collections.deque[Future[None]], epoch: int, what: str) -> float:
        """Wait for the oldest of ``futures`` (background work of ``epoch``), as the watchdog sees a
        step: it may wait for a step stuck in a collective with a dead peer. A newer epoch ends the
        wait (``TopologyChanged``). Returns the seconds waited."""
        t = time.monotonic()
        oldest = futures[0]
        self._blocking(epoch, self.policy.stuck_step_exit_s, "step")
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
            self._blocked = None
        futures.popleft()
        waited = time.monotonic() - t
        log.debug("waited for background work", what=what, waited_s=round(waited, 3))
        return waited

    def _keep_snapshot(self, snap: _InFlight) -> None:
        """The background half of ``_snapshot``: copy, then keep (unless stopped meanwhile)."""
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
            self._last_pieces = self.snapshots.put(snap.step, snap.epoch, pieces)
        finally:
            snap.copy.release()
        snap.kept_at = time.monotonic()
        self.stats["snapshots"] += 1
        self.stats["snapshot_bytes"] += sum(int(p.nbytes) for p in pieces.values())
        self.stats["snapshot_s"] += snap.copy.copy_s + snap.kept_at - t

    def _not_kept(self, step: int, tier: str, error: str) -> None:
        """A snapshot of ``step`` could not be written where ``tier`` keeps it (``Snapshots``'
        on_not_kept, on a background thread): it is kept in this process only, and a trainer the
        agent restarts will not find it. Counted by tier (``stats``, and the agent's
        remesh_trainer_snapshot_failures_total); a new problem is logged as an error, saying what to
        do, and the tier reported missing to the agent, which records it in the job's event log.
        Nothing waits: the report goes with the next progress report."""
        # Errors that differ only in their numbers (the step in a file's name) are one problem.
        problem = (tier, re.sub(r"\d+", "N", error))
        with self._not_kept_lock:
            self.stats["snapshot_failures"] += 1
            per_tier = f"snapshot_failures.{tier}"
            self.stats[per_tier] = self.stats.get(per_tier, 0) + 1
            self.tiers_missing[tier] = error
            missing = dict(self.tiers_missing)
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
            shm_dir=self.policy.shm_dir,
            error=error,
        )
        self.agent.report_tiers_missing(missing)

    def _release_host_memory(self) -> None:
        """The job finished: nothing restores from host memory any more, and this host's
        ``/dev/shm`` directory goes (tmpfs is RAM, and would hold the job's last snapshots long after
        it). Snapshots still being written (from this process's devices) are waited for; buddy
        copies are not (they fetch from peers that may have left): one not begun is cancelled, and
        one under way finds its directory gone and writes nothing."""
        if self._in_flight is not None:
            futures_wait([self._in_flight.future])
            self._harvest_snapshot()
        while self._copying:
            self._copying.popleft().cancel()
        self.snapshots.clear()
        self.buddies.clear()
        if self.snapshots.directory is not None:  # the host's directory; the buddy copies' is in it
            release(self.snapshots.directory)

    def _step_program(self) -> tuple[ClosedJaxpr, Any]:
        """The step function traced once per process, from shapes alone: its program and the tree of
        its outputs.

        Tracing is the Python half of compiling (autodiff included) and does not depend on the mesh,
        but JAX's own trace cache goes with the runtime at every re-mesh. Kept here, every later
        epoch only replays the program for its mesh, a fraction of tracing the user's function.
        """
        if self._program is None:
            template = self._template_leaves()
            state = jax.tree_util.tree_unflatten(self._treedef, template)
            assert self._train_step is not None
            traced = jax.jit(self._train_step).trace(state, self._batch_shapes(0))
            out_tree = traced.out_tree
            children = out_tree.children()
            returned = children[0] if len(children) == 2 else None
            if returned != self._treedef:
                raise TypeError(
                    "train_step must return (state, metrics) with the state shaped like its input; "
                    f"it returned {out_tree}"
                )
            closed = traced.jaxpr
            # Constants on this runtime's devices would not survive the re-mesh: keep them on the host.
            consts = [np.asarray(c) if isinstance(c, jax.Array) else c for c in closed.consts]
            self._program = (ClosedJaxpr(closed.jaxpr, consts), out_tree)
        return self._program

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
    ) -> tuple[Callable[[PyTree, PyTree], tuple[PyTree, Any]], dict[str, float]]:
        """The step for this epoch's mesh, and where compiling it went (trace, lower, XLA)."""
        t = time.monotonic()
        program, out_tree = self._step_program()
        timings = {"compile_trace": time.monotonic() - t}
        template = self._template_leaves()
        # Any step's batch has the shapes of every step's batch.
        batch_leaves = jax.tree.leaves(self._batch_shapes(max(assignment.restore_step, 0)))
        args = [
            *(
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                for x, s in zip(template, shardings, strict=True)
            ),
            *(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=by_rows) for x in batch_leaves),
        ]
        metrics = out_tree.num_leaves - len(shardings)
        step_fn = jax.jit(
            jaxpr_as_fun(program),
            in_shardings=(*shardings, *[by_rows] * len(batch_leaves)),
            out_shardings=[*shardings, *[replicated] * metrics],  # the program returns a list
        )
        t = time.monotonic()
        traced = step_fn.trace(*args)
        timings["compile_trace"] += time.monotonic() - t
        t = time.monotonic()
        lowered = traced.lower()
        timings["compile_lower"] = time.monotonic() - t
        t = time.monotonic()
        compiled = lowered.compile()
        timings["compile_xla"] = time.monotonic() - t
        treedef = self._treedef

        def step(state: PyTree, batch: PyTree) -> tuple[PyTree, Any]:
            flat = compiled(*treedef.flatten_up_to(state), *jax.tree.leaves(batch))
            return jax.tree_util.tree_unflatten(out_tree, flat)

        return step, timings

    def _batch_shapes(self, step: int) -> PyTree:
        """The shapes of a global batch: from ``batch_for_step``, or from one row of ``data`` (a
        host reads only its own rows, even to learn the shapes)."""
        if self._data is not None:
            one = self._data.rows(step, slice(0, 1))
            size = self._data.global_batch_size
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *np.shape(x)[1:]), x.dtype), one)
        assert self._batch_for_step is not None
        sample = self._batch_for_step(step)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), sample)

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

        The members choose from what they hold between them, the same choice on each (from the
        offers they all gathered and the commits the epoch's assignment lists): the newest step whose
        pieces they hold (own snapshots, a surviving replica group, buddy copies), moving only the
        cells each process lacks, host to host; unless the coordinator accepted a commit of a newer
        step: then the newest readable committed checkpoint newer than that step, and that step
        where none of them is readable; with neither, the newest committed checkpoint; else, only if
        the job never completed a step, ``init_state``. Returns the leaves, the step, a source label,
        and the bytes per tier.

        The epoch's ``restore_step`` (the newest step every survivor had reported to the coordinator
        when it planned) bounds nothing: reports go out at most once a second, and every step a
        member holds is a state of the job's one timeline. It says only whether the job has
        completed a step at all (-1: start from scratch).
        """
        target = assignment.restore_step
        t = time.monotonic()
        offer = self._offer(target >= 0)
        with peer_failures():
            gathered = self.runtime.allgather_text("offers", json.dumps(offer), self.policy.init_timeout_s)
        offers = [json.loads(g) for g in gathered]
        self._restore_phases = {"restore_agree": time.monotonic() - t}
        self._peers = [o["addr"] for o in offers]
        held = self._held_by_members(assignment, offers, shardings) if target >= 0 else None
        held_step = held[0][0] if held is not None else None
        newest_commit = max((step for step, _ in assignment.commits), default=-1)
        if held_step is None or held_step < newest_commit:
            if held_step is not None:
                # Replaying the steps between them would cost more than reading the checkpoint.
                log.info(
                    "a committed checkpoint is newer than the newest step the members hold",
                    held=held_step,
                    commit=newest_commit,
                )
            found = self._restore_from_storage(assignment, shardings, above=held_step)
            if found is not None:
                return found
        assert held is not None  # storage returns None only where the members hold a step
        return self._restore_from_members(*held, rank=assignment.rank, shardings=shardings)

    def _offer(self, any_step: bool) -> dict[str, Any]:
        """This process's pieces at every restore point it holds (none unless ``any_step``), as it
        tells the others."""
        self._offered = {}
        points: dict[RestorePoint, dict[str, Any]] = {}
        if any_step:
            for snap in self.snapshots.all(self._shapes()):
                point = (snap.step, snap.layout)
                self._offered[point] = snap.pieces
                points[point] = {"tier": snap.tier, "own": [encode_key(k) for k in snap.pieces], "buddy": []}
            for copy in self.buddies.all(self._shapes()):
                point = (copy.step, copy.layout)
                self._offered[point] = {**copy.pieces, **self._offered.get(point, {})}
                entry = points.setdefault(point, {"tier": "memory", "own": [], "buddy": []})
                entry["buddy"] = [encode_key(k) for k in copy.pieces]
        return {
            "addr": self._piece_address(),
            "points": [[s, e, v["tier"], v["own"], v["buddy"]] for (s, e), v in sorted(points.items())],
        }

    def _piece_address(self) -> str:
        """Where the other members of this epoch fetch this process's pieces ("" in a world of one,
        which fetches nothing): its piece server, started by the first epoch that has others."""
        assignment = self.runtime.assignment
        if assignment is None or assignment.world_size < 2:
            return ""
        if self._server is None:
            self._server = PieceServer(self._serve, on_copied=self.snapshots.pin)
        host = advertised_host(assignment.jax_coordinator or "127.0.0.1:0")
        return f"{host}:{self._server.port}"

    def _held_by_members(
        self, assignment: Assignment, offers: list[dict[str, Any]], shardings: list[NamedSharding]
    ) -> tuple[RestorePoint, Fetch] | None:
        """The newest restore point whose pieces the members hold between them, and where this
        process fetches each piece it lacks from; None where they hold no step whole."""
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
            return point, plan
        return None

    def _restore_from_members(
        self, point: RestorePoint, plan: Fetch, *, rank: int, shardings: list[NamedSharding]
    ) -> tuple[list[jax.Array], int, str, dict[str, int]]:
        """The state of ``point`` on the new mesh: this process's pieces from memory, the rest
        fetched as ``plan`` says."""
        t = time.monotonic()
        pieces = self._gather(rank, point, plan.sources)
        self._restore_phases["restore_fetch"] = time.monotonic() - t
        t = time.monotonic()
        leaves = self._build(pieces, shardings)
        self._restore_phases["restore_build"] = time.monotonic() - t
        self.snapshots.drop_after(point[0])
        self.buddies.drop_after(point[0])
        source = "+".join(sorted(plan.bytes_by_tier)) or "memory"
        return leaves, point[0], source, plan.bytes_by_tier

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
        """The state's leaves on the new mesh, each device's part assembled from ``pieces``, once
        they are on the devices."""
        leaves = build(pieces, self._shapes(), shardings)
        self._on_device(leaves)
        return leaves

    def _on_device(self, leaves: list[jax.Array]) -> None:
        """Wait until ``leaves`` are on their devices. Host-to-device copies are asynchronous: a
        restore's phase timed without this ends before the data arrives (2.2 GB onto a TPU: 7 ms
        timed, 2 s in truth), and the first step pays for it unseen."""
        with peer_failures():
            jax.block_until_ready(leaves)

    def _restore_from_storage(
        self, assignment: Assignment, shardings: list[NamedSharding], above: int | None = None
    ) -> tuple[list[jax.Array], int, str, dict[str, int]] | None:
        """The newest committed checkpoint, chosen by rank 0 so every member loads the same one;
        ``init_state`` only where the job never completed a step. ``above``: a step the members hold
        in memory; only a checkpoint newer than it is restored, and None is returned where no such
        one is readable (the caller restores that step)."""
        target = assignment.restore_step
        # The commits the coordinator accepted in this job. None where it accepted none yet: a job
        # launched again (the full restart) resumes from what an earlier run committed, guarded by
        # the epoch fence only; once this job commits, only its own accepted commits count.
        trusted: Trusted = assignment.commits or None
        sharded = self._sharded(shardings)
        bound: int | None = None
        template = self._template_leaves()
        replicated: tuple[PyTree, CheckpointStore] | None = None
        for attempt in itertools.count():
            # Rank 0 chooses, so that every member loads the same step. A sharded state's files are
            # checked by every member, a share each, before anyone restores; a replicated state is
            # read by each member from the first tier it reaches that holds it. One member that
            # cannot sends every member to the step before it (past ``above`` only: a step the
            # members hold is not read from storage, and is restored where none newer is readable).
            candidate, tier = (
                self._newest_checkpoint(bound, trusted, above=above)
                if assignment.rank == 0 and (bound is None or bound >= 0)
                else (-1, -1)
            )
            chosen = self.runtime.allgather_int(
                f"checkpoint-{attempt}", candidate, self.policy.init_timeout_s
            )[0]
            if chosen < 0:
                break
            if sharded:
                tier = self.runtime.allgather_int(
                    f"checkpoint-tier-{attempt}", tier, self.policy.init_timeout_s
                )[0]
                ok = self.checkpoints[tier].verify_share(
                    chosen, assignment.rank, assignment.world_size, trusted
                )
            else:
                replicated = self._read_replicated(chosen, template, trusted)
                ok = replicated is not None
            verdicts = self.runtime.allgather_int(
                f"checkpoint-verified-{attempt}", int(ok), self.policy.init_timeout_s
            )
            if all(verdicts):
                break
            log.warning(
                "checkpoint not readable by every member: every member falls back to an earlier one",
                step=chosen,
                source=self.checkpoints[tier].name if sharded else "any tier",
                found_by=[rank for rank, v in enumerate(verdicts) if not v],
            )
            replicated = None
            bound = chosen - 1
        if chosen < 0:
            if above is not None:
                log.info("no newer checkpoint is readable: restoring the step held in memory", step=above)
                return None
            if target > 0:
                raise StateLost(
                    assignment.epoch,
                    target,
                    f"no member holds any step of the job in memory, and no committed checkpoint is "
                    f"readable (tiers: "
                    f"{', '.join(s.name for s in self.checkpoints) or 'none configured'})",
                )
            log.info("starting from scratch: the job has not completed a step", target=target)
            self.snapshots.clear()
            self.buddies.clear()
            tree_shardings = jax.tree_util.tree_unflatten(self._treedef, shardings)
            init = jax.tree_util.tree_leaves(jax.jit(self._init_state, out_shardings=tree_shardings)())
            self._on_device(init)
            return init, 0, "scratch", {}
        if sharded:
            # A sharded state is in a tier every host reaches (the one rank 0 chose it from), its
            # files checked against the marker already, a share by each member.
            store = self.checkpoints[tier]
            self.snapshots.clear()
            self.buddies.clear()
            abstract = jax.tree_util.tree_unflatten(
                self._treedef,
                [
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                    for x, s in zip(template, shardings, strict=True)
                ],
            )
            t = time.monotonic()
            try:
                with peer_failures():
                    tree = store.restore_global(chosen, abstract, trusted, verified=True)
            except CheckpointError as exc:  # gone or cut short since the members checked it
                raise RestartProcess(f"checkpoint of step {chosen} chosen by rank 0: {exc}") from exc
            leaves = jax.tree_util.tree_leaves(tree)
            self._on_device(leaves)
            self._restore_phases["restore_read"] = time.monotonic() - t
        else:
            assert replicated is not None  # every member read the chosen step
            tree, store = replicated
            self.snapshots.clear()
            self.buddies.clear()
            host = jax.tree_util.tree_leaves(tree)
            t = time.monotonic()
            leaves = self._build({(i, whole(x.shape)): np.asarray(x) for i, x in enumerate(host)}, shardings)
            self._restore_phases["restore_build"] = time.monotonic() - t
        nbytes = sum(int(x.nbytes) for x in first_replicas(leaves).values())
        return leaves, chosen, store.name, {store.name: nbytes}

    def _read_replicated(
        self, step: int, template: list[Any], trusted: Trusted
    ) -> tuple[PyTree, CheckpointStore] | None:
        """Committed step ``step`` of a replicated state from the first tier this host reaches whose
        files of it are all there (restoring reads them against the marker, once); one that differs
        here sends this host to the next tier. None where no tier it reaches holds a readable copy."""
        structure = jax.tree_util.tree_unflatten(self._treedef, template)
        for store in (s for s in self.checkpoints if s.latest_present(step, trusted) == step):
            try:
                return store.restore_state(step, structure, trusted), store
            except CheckpointError as exc:
                log.warning("checkpoint not readable here", step=step, source=store.name, error=str(exc))
        return None

    @staticmethod
    def _sharded(shardings: Sequence[NamedSharding]) -> bool:
        return any(not s.is_fully_replicated for s in shardings)

    def _newest_checkpoint(
        self, bound: int | None, trusted: Trusted, above: int | None = None
    ) -> tuple[int, int]:
        """The newest checkpoint at or below ``bound`` (None: any) and past ``above`` whose commit the
        coordinator accepted and whose files are all there at the sizes its marker says (the members
        then read them against its digests: each its share of a sharded state, each the whole of a
        replicated one), and the index of the tier holding it (-1, -1: none)."""
        best, tier = -1, -1
        for i, store in enumerate(self.checkpoints):
            step = store.latest_present(bound, trusted, above)
            if step is not None and step > best:
                best, tier = step, i
        return best, tier

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

    def _buddy_step(self, step: int) -> bool:
        """Whether every host copies its buddy's pieces of ``step`` (the same steps on every host)."""
        if self._buddy is None:
            return False
        if self.policy.snapshot_every == "auto":  # with every snapshot
            return self._cadence.due(step)
        return step % self.policy.buddy_every == 0

    # ---- the snapshot cadence ----------------------------------------------------------------------

    def _new_cadence(self, since: int) -> Cadence:
        every = self.policy.snapshot_every
        cadence = Cadence.automatic(since, self.policy.mtbf_s) if every == "auto" else Cadence(every)
        self.stats["snapshot_every"], self.stats["snapshot_since"] = cadence.every, cadence.since
        return cadence

    def _snapshot_due(self, step: int, epoch: int) -> bool:
        """Whether ``step`` is snapshotted. With an automatic cadence: at an agreed step every member
        posts its interval (to the coordination service's key-value store, no collective), and the
        largest counts from an agreed later step; that step reads every member's, there already
        unless a member lags several steps behind (then it waits, as for a step)."""
        cadence = self._cadence
        if cadence.agreeing is not None and step >= cadence.agreeing[1]:
            self._adopt_cadence(epoch)
        due = cadence.due(step)
        if due and (at := cadence.calibrates_at(step)) is not None:
            proposal = cadence.proposal()
            cadence.agreeing = (step, at)
            self.runtime.post_int(f"cadence-{step}", proposal)
            log.debug("snapshot cadence proposed", step=step, every=proposal, cost_s=cadence.cost_s())
        return due

    def _adopt_cadence(self, epoch: int) -> None:
        cadence = self._cadence
        assert cadence.agreeing is not None
        asked, at = cadence.agreeing
        proposals = self.runtime.posted_ints(f"cadence-{asked}")
        if proposals is None:
            # Every member posted at step ``asked``, steps ago: one that has not is as far behind as
            # a collective allows only a dead or stuck one to be, and is treated the same way.
            self._blocking(epoch, self.policy.stuck_step_exit_s, "step")
            deadline = time.monotonic() + self.policy.collective_timeout_s
            try:
                while proposals is None:
                    if (latest := self.agent.latest.epoch) > epoch:
                        raise TopologyChanged(epoch, latest)
                    if time.monotonic() > deadline:
                        raise PeerFailure(
                            f"a member did not post its snapshot interval of step {asked} within "
                            f"{self.policy.collective_timeout_s:g}s of step {at}: a peer is probably gone"
                        )
                    time.sleep(0.005)
                    proposals = self.runtime.posted_ints(f"cadence-{asked}")
            finally:
                self._blocked = None
        cost, before = cadence.cost_s(), cadence.every
        cadence.agree(at, proposals)
        self.stats["snapshot_every"], self.stats["snapshot_since"] = cadence.every, cadence.since
        log.info(
            "snapshot cadence agreed",
            asked_at=asked,
            from_step=at,
            every=cadence.every,
            was=before,
            cost_s=None if cost is None else round(cost, 4),
            proposals=proposals,
        )

    def _copy_buddy_later(self, step: int, assignment: Assignment) -> None:
        """Copy the buddy's pieces of ``step`` in the background, never skipping it: with two copies
        still on their way, wait for the oldest first (copies slower than ``buddy_every`` steps slow
        the loop down to their pace, and say so)."""
        assert self._buddy is not None
        while self._copying and self._copying[0].done():
            self._copying.popleft().result()
        waited = 0.0
        if len(self._copying) >= 2:
            waited = self._wait_for(self._copying, assignment.epoch, "buddy copy")
            self.stats["buddy_wait_s"] += waited
            if waited > 0.05 and not self._told_slow_copies:
                self._told_slow_copies = True
                log.warning(
                    "buddy copies take longer than the steps between them: the loop waits for them; "
                    "raise buddy_every (--buddy-every) so that a copy fits",
                    step=step,
                    buddy_every=self.policy.buddy_every,
                    waited_s=round(waited, 3),
                )
        buddy, keys = self._buddy
        delay = 0.0
        if self._copy_delay_s:
            now = time.monotonic()
            # The loop's own pace: the time it waited for copies left out (it would feed back).
            last = self._copy_asked_at
            if last is None or last[0] != assignment.epoch:
                self._copy_intervals.clear()
            else:
                self._copy_intervals.append(now - last[1] - waited)
            self._copy_asked_at = (assignment.epoch, now)
            delay = self._copy_delay_s + min(self._copy_intervals, default=0.0)
        self._copying.append(
            self._copier.submit(self._copy_buddy, self._peers[buddy], (step, assignment.epoch), keys, delay)
        )

    def _copy_buddy(
        self, address: str, point: RestorePoint, keys: list[tuple[int, Cell]], delay_s: float = 0.0
    ) -> None:
        """Copy the buddy's own pieces of ``point``. The peer takes its snapshot of the step once the
        step is done there: until then it answers that it does not hold it, so ask again, until it
        does or the epoch ends (a peer that never has it is gone, or stuck: a new epoch follows)."""
        if delay_s:
            time.sleep(delay_s)
        deadline = time.monotonic() + max(self.policy.init_timeout_s, 10.0)
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
            self.buddies.put(point[0], point[1], pieces)
            self.stats["buddy_copies"] += 1
            return

    # ---- checkpoints -----------------------------------------------------------------------------

    def _maybe_checkpoint(self, step: int, assignment: Assignment, leaves: list[jax.Array]) -> None:
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
            self._saving = self._saver.submit(self._save_all, step, assignment.epoch, leaves)

    def _save_sharded(self, step: int, assignment: Assignment, tree: PyTree) -> None:
        """Every process writes its own shards (Orbax), rank 0 commits; tiers that can take a
        sharded state only (a directory every host reaches)."""
        t = time.monotonic()
        try:
            # The loop is already steps ahead: Orbax must find these arrays computed, or what it
            # does with them queues on the devices among the next steps' collectives, in an order
            # that differs between processes (the step's gloo collectives then time out).
            jax.block_until_ready(tree)
            # This process writes the shards it holds the first replica of.
            firsts = first_replicas(jax.tree_util.tree_leaves(tree))
            nbytes = sum(int(x.nbytes) for x in firsts.values())
            pieces: Pieces | None = None  # host arrays, made only for a tier that writes pieces
            for store in self.checkpoints:
                if not store.sharded_saves:
                    continue
                ok = 1 if assignment.rank != 0 else self._prepare_sharded(store, step, assignment.epoch)
                if not self.runtime.allgather_int(
                    f"ckpt-{store.name}-{step}", ok, self.policy.init_timeout_s
                )[0]:
                    continue
                if store.writes_pieces:
                    # No barrier inside a plain write, unlike Orbax's: every process says it wrote
                    # (1) or failed (0) before rank 0 commits.
                    if pieces is None:
                        pieces = {key: np.asarray(data) for key, data in firsts.items()}
                    written = self._write_pieces(store, step, assignment, pieces)
                    if not all(
                        self.runtime.allgather_int(
                            f"ckpt-{store.name}-{step}-written", written, self.policy.init_timeout_s
                        )
                    ):
                        log.warning("sharded checkpoint not committed: a process could not write", step=step)
                        continue
                else:
                    store.write_global(step, tree)
                    if store.tells_digests:
                        # Every process told the digests of its files before rank 0 commits: it
                        # then reads only its own, not every host's state.
                        self.runtime.allgather_int(
                            f"ckpt-{store.name}-{step}-told", 1, self.policy.init_timeout_s
                        )
                self.stats["checkpoints"] += 1
                self.stats["checkpoint_bytes"] += nbytes
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
    def _write_pieces(store: CheckpointStore, step: int, assignment: Assignment, pieces: Pieces) -> int:
        try:
            store.write_pieces(step, assignment.rank, assignment.epoch, pieces)
            return 1
        except Exception as exc:  # said to the others, who then do not wait for a commit
            log.warning("sharded checkpoint not written", store=store.name, step=step, error=str(exc))
            return 0

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

    def _save_all(self, step: int, epoch: int, leaves: list[jax.Array]) -> None:
        """Rank 0 saves the replicated state: copied to the host here, in the background."""
        t = time.monotonic()
        try:
            try:
                # Copies that outlive the device buffers (the loop is steps ahead), made once: on an
                # accelerator np.asarray is one already, on CPU it is a view (``host_copies``).
                copies = copies_of({i: x.addressable_shards[0].data for i, x in enumerate(leaves)})
                host = [copies[i] for i in range(len(leaves))]
            except Exception as exc:  # the step failed (a peer died): nothing to save
                log.info("checkpoint not taken: its step failed", step=step, error=str(exc).splitlines()[0])
                return
            self._save_each(step, epoch, jax.tree_util.tree_unflatten(self._treedef, host))
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
                self.stats["checkpoints"] += 1
                self.stats["checkpoint_bytes"] += sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree))
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

    def final_leaves(self) -> list[np.ndarray]:
        """The state after the last completed step, as host arrays in tree-flatten order: whole
        leaves where this process holds them whole (replicated), else what ``gather_final`` gathered."""
        if self._final is not None:
            return list(self._final)
        if self._closed:
            raise RuntimeError("the session is closed: take final_leaves() before close()")
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
        """End the session: every thread it started ends (the watchdog, its background work, the
        agent client's), and it lets go of every snapshot it holds in the process, so that no file of
        /dev/shm stays mapped (a file deleted since, as at the end of the job, gives its memory back
        then; one still there stays, for a trainer started next on this host). A checkpoint being
        saved is waited for; a snapshot on its way stops at its next shard. ``final_leaves`` comes
        before this. Closing twice does nothing; ``with Session(...) as session:`` closes it."""
        if self._closed:
            return
        self._closed = True
        if self._in_flight is not None:
            self._in_flight.copy.stop()
        self._snapshotter.shutdown(wait=True)
        self._in_flight = None
        self._saver.shutdown(wait=True)
        self._compiler.shutdown(wait=True)
        # A buddy copy not begun is not made; one under way gives up at its next attempt (closed).
        self._copier.shutdown(wait=True, cancel_futures=True)
        self._copying.clear()
        if self._server is not None:
            self._server.close()
        self.agent.close()  # wakes the watchdog, which sees the session closed
        if self._watching is not None:
            self._watching.join()
        if self.runtime.assignment is not None:  # left in the middle of an epoch
            self.runtime.stop()
        self._last_pieces = {}
        self._offered = {}
        self.snapshots.let_go()
        self.buddies.let_go()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close()


@dataclass(eq=False)
class _InFlight:
    """A snapshot on its way to the host: its step, the epoch whose mesh laid it out, its copy, the
    background work keeping it, and when it was kept (None until then, and if it never is)."""

    step: int
    epoch: int
    copy: SnapshotCopy[tuple[int, Cell]]
    future: Future[None] = field(init=False)
    kept_at: float | None = None


def _own_shards(leaves: Sequence[jax.Array]) -> dict[tuple[int, Cell], jax.Array]:
    """This process's distinct shards of every leaf, on its devices."""
    shards: dict[tuple[int, Cell], jax.Array] = {}
    for i, x in enumerate(leaves):
        for shard in x.addressable_shards:
            shards.setdefault((i, cell_of(shard.index, x.shape)), shard.data)
    return shards


def _process_of(device: Any) -> int:
    return int(device.process_index)


def _scalar(x: jax.Array) -> np.ndarray:
    """A replicated metric's value, from this process's own copy (no cross-process fetch)."""
    return np.asarray(x.addressable_shards[0].data)


def _rounded(phases: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in phases.items()}

"""Per-host input with a position that survives a recovery and a shrink.

The data position of a remesh job is the step: global batch ``s`` is records ``s * G`` to
``(s + 1) * G - 1`` of one deterministic, randomly addressable sequence of records (``G`` the global
batch size), and each host reads only its own contiguous block of those rows (``Epoch.host_rows``).
So what a restore brings back (the step) is also where the data resumes, and a global batch is
re-split over however many hosts the epoch has: after a shrink from 3 hosts to 2 each host reads
``G / 2`` rows of the same ``G`` records instead of ``G / 3``, and no record is skipped or read twice.

``StepData`` is the whole protocol: ``rows(step, rows)``. ``GrainData`` satisfies it over a Grain
``MapDataset`` of records (Grain's random-access datasets are exactly such a sequence: ``shuffle``
is a deterministic permutation that draws a new one for every pass over the data, ``map`` is
applied per record), and reads ahead on Grain's own prefetch threads.

**Iterators that keep their own position** (a Grain ``IterDataset``'s ``DatasetIterator`` with a
shuffle buffer, packing, a filter; any iterator with ``get_state() -> state`` and
``set_state(state)``, the protocol Grain's iterators and Orbax's checkpointing of them use) are read
through ``IteratorData``: ``make_iterator(rank, world_size)`` builds this host's iterator for an
epoch, and remesh carries its position. At every step whose state is kept (a snapshot, a
checkpoint, the last step) each host's ``get_state()``, taken after exactly that many batches, is
shared among the epoch's members and kept with the snapshot of that step (and in the checkpoint's
commit marker, every rank's); a restore brings back the positions of the step it restores, so a
replay reads what the steps read the first time. Which state a host of the new epoch takes:

- **the same number of hosts** (a spare took a lost host's place; the coordinator keeps ranks):
  rank ``r`` takes the state of rank ``r``, whose data shard it reads (``make_iterator(r, n)``);
- **another number of hosts** (a shrink or a grow): one host's position in its own shard means
  nothing in another shard, so per-host states are not re-split. Where the iterator's state is the
  same on every host and holds for any sharding (``shared_state=True``: Grain's ``ElasticIterator``,
  whose state is the global index of the next batch), every rank takes it. Otherwise, where
  ``rebuild_at(rank, world_size, step)`` is given, each host builds its iterator at the restored
  step itself (a source that can be re-addressed); else the epoch refuses (``StateLost``, the job
  halts with the reason): nothing would make the new hosts read, between them, exactly what the old
  ones would have, and a silently different data order is worse than a halt. Whether a state is
  shared is the user's to say, not remesh's to guess: a per-host iterator's state (the index in its
  own shard) is often the same number on every host, and still means another window in each shard.

That is the rule Grain's own elasticity keeps: a ``DatasetIterator``'s state restores the iterator
it came from, and only ``ElasticIterator``'s state restores any sharding of the same data.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
import numpy as np
import structlog

if TYPE_CHECKING:
    import grain

__all__ = [
    "Checkpointable",
    "DataPosition",
    "Gather",
    "GrainData",
    "HostBatches",
    "IteratorBatches",
    "IteratorData",
    "NotCarried",
    "StepData",
]

log = structlog.get_logger("remesh.elastic.data")

PyTree = Any


@runtime_checkable
class StepData(Protocol):
    """Training data addressed by step: what remesh needs to resume input anywhere."""

    # Rows of every step's global batch, the same on every host and in every epoch.
    global_batch_size: int

    def rows(self, step: int, rows: slice) -> PyTree:
        """The ``rows`` of global batch ``step``: a tree of numpy arrays with one leading row axis,
        the same values wherever and whenever it is asked (a replayed step reads what it read)."""
        ...


class GrainData:
    """A Grain ``MapDataset`` of records read as global batches of ``global_batch_size`` rows.

    Batch ``s`` is records ``s * global_batch_size ...`` of ``dataset`` (indices past its length go on
    into Grain's next pass, reshuffled when the dataset was shuffled), each record a tree of arrays
    of the same shapes; the rows are stacked along a new leading axis. ``read_options`` sets Grain's
    prefetch threads and buffer for ``HostBatches`` (one thread and two batches ahead by default:
    the step loop already runs a step ahead of the host).
    """

    def __init__(
        self,
        dataset: grain.MapDataset,
        global_batch_size: int,
        *,
        read_options: grain.ReadOptions | None = None,
    ) -> None:
        import grain

        if not isinstance(dataset, grain.MapDataset):
            raise TypeError(
                f"GrainData reads a grain.MapDataset (random access by index), got "
                f"{type(dataset).__name__}: an IterDataset's position cannot be re-split over another "
                "number of hosts; build the pipeline up to the records as a MapDataset"
            )
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.read_options = read_options or grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)

    def rows(self, step: int, rows: slice) -> PyTree:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start, stop, stride = rows.indices(self.global_batch_size)
        base = step * self.global_batch_size
        records = [self.dataset[base + r] for r in range(start, stop, stride)]
        if any(record is None for record in records):
            raise ValueError(
                f"step {step}: the dataset gave no record at some index (a MapDataset.filter leaves "
                "holes): filter before the records are indexed, or map rejected records to a default"
            )
        return jax.tree.map(lambda *leaves: np.stack(leaves), *records)

    def host_batches(self, start_step: int, stop_step: int, rows: slice) -> HostBatches:
        """This host's ``rows`` of every global batch from ``start_step`` up to ``stop_step``, read
        ahead on Grain's prefetch threads."""
        import grain

        steps = grain.MapDataset.range(start_step, stop_step).map(lambda step: self.rows(step, rows))
        return HostBatches(iter(steps.to_iter_dataset(self.read_options)), start_step, stop_step, rows)


class _StepBatches(Iterator[PyTree]):
    """Batches in step order: ``next()`` gives the batch of step ``step`` and moves on, up to
    ``stop_step``; the epoch checks, as each step is handed back, that the loop took exactly one
    batch per step."""

    def __init__(self, batches: Iterator[PyTree], start_step: int, stop_step: int) -> None:
        self._batches = batches
        self.step = start_step  # the step whose batch ``next()`` gives
        self.stop_step = stop_step

    def __next__(self) -> PyTree:
        if self.step >= self.stop_step:
            raise StopIteration
        batch = next(self._batches)
        self.step += 1
        return batch

    def close(self) -> None:
        """Stop reading ahead (Grain's threads)."""
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


class HostBatches(_StepBatches):
    """This host's rows of each step's global batch, in step order (``Epoch.data``).
    ``records(step)`` says which records of the sequence a step's rows are here."""

    def __init__(self, batches: Iterator[PyTree], start_step: int, stop_step: int, rows: slice) -> None:
        super().__init__(batches, start_step, stop_step)
        self.host_rows = rows

    @classmethod
    def of(cls, data: StepData, start_step: int, stop_step: int, rows: slice) -> HostBatches:
        """Read ``data`` from ``start_step``: through its own prefetching when it has it."""
        if isinstance(data, GrainData):
            return data.host_batches(start_step, stop_step, rows)
        steps = (data.rows(step, rows) for step in range(start_step, stop_step))
        return cls(steps, start_step, stop_step, rows)

    def records(self, step: int, global_batch_size: int) -> range:
        """The positions in the record sequence of this host's rows of ``step``."""
        start, stop, _ = self.host_rows.indices(global_batch_size)
        return range(step * global_batch_size + start, step * global_batch_size + stop)


@runtime_checkable
class Checkpointable(Protocol):
    """An iterator that keeps its own position: Grain's ``DatasetIterator`` protocol. The state is
    what JSON carries (Grain's are dicts of numbers; numpy scalars and arrays are taken as numbers
    and lists), and restores the iterator it came from to exactly where it was."""

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


@dataclass(frozen=True)
class DataPosition:
    """Every host's input position after one step: each rank's iterator state (as JSON text) in an
    epoch of ``world_size`` hosts. ``whole`` once it holds every rank's."""

    world_size: int
    states: Mapping[int, str]

    @property
    def whole(self) -> bool:
        return set(self.states) == set(range(self.world_size))

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "states": {str(r): t for r, t in sorted(self.states.items())}}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DataPosition:
        return cls(int(raw["world_size"]), {int(r): str(t) for r, t in raw["states"].items()})

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> DataPosition:
        return cls.from_dict(json.loads(text))


def state_text(state: Any) -> str:
    """An iterator's state as JSON text (numpy scalars and arrays as numbers and lists)."""
    try:
        return json.dumps(state, default=_plain, sort_keys=True)
    except TypeError as exc:
        raise TypeError(
            f"the iterator's get_state() gave a state JSON cannot carry ({exc}): remesh keeps it with "
            "the snapshots and checkpoints as JSON; return dicts, lists, strings and numbers"
        ) from exc


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


# Gathers every host's input position after a step, until the members all posted theirs or the
# callable it is given says to stop (``InputPositions.gather``, for one step).
Gather = Callable[[Callable[[], bool]], DataPosition | None]


class NotCarried(Exception):
    """The restored step's input position cannot be carried to this epoch (the message says why
    and what to do); the epoch turns it into ``StateLost``."""


class IteratorData:
    """Input from per-host iterators that keep their own position (``Checkpointable``), read in your
    own loop through ``Epoch.data``: ``make_iterator(rank, world_size)`` builds this host's iterator
    for an epoch of ``world_size`` hosts, from the start of the data; remesh sets its state to the
    restored step's. See the module's docstring for which state a host takes when the number of hosts
    changed: ``shared_state`` (every host's state is the same and holds for any sharding, as Grain's
    ``ElasticIterator``'s), or ``rebuild_at(rank, world_size, step)`` (an iterator built at the
    restored step); without either, a changed number of hosts is refused.

    With Grain::

        def make_iterator(rank, world_size):
            ds = records.shuffle(seed=0)[rank::world_size].to_iter_dataset().batch(GLOBAL // world_size)
            return iter(ds)

        source = IteratorData(make_iterator)
        ...
            batches = epoch.data(source)   # inside `with epoch:`, its position restored
            for step in epoch.steps():
                state, metrics = step_fn(state, epoch.batch(next(batches)))
    """

    def __init__(
        self,
        make_iterator: Callable[[int, int], Iterator[PyTree]],
        *,
        shared_state: bool = False,
        rebuild_at: Callable[[int, int, int], Iterator[PyTree]] | None = None,
    ) -> None:
        self.make_iterator = make_iterator
        self.shared_state = shared_state
        self.rebuild_at = rebuild_at

    def open(
        self, rank: int, world_size: int, step: int, stop_step: int, position: DataPosition | None
    ) -> tuple[IteratorBatches, str]:
        """This host's iterator for an epoch restored at ``step`` with ``position`` (the restored
        step's), and how its position was had (for the log). ``NotCarried`` where it cannot be."""
        how, state = carried(position, rank, world_size, step, self.shared_state, self.rebuild_at is not None)
        if how == "rebuilt":
            assert self.rebuild_at is not None
            iterator = self.rebuild_at(rank, world_size, step)
        else:
            iterator = self.make_iterator(rank, world_size)
        if not isinstance(iterator, Checkpointable):
            raise TypeError(
                f"IteratorData's iterator ({type(iterator).__name__}) has no get_state/set_state: give "
                "an iterator that keeps its position (a Grain DatasetIterator: iter(an IterDataset)), "
                "or a step-addressable source (GrainData, StepData)"
            )
        if state is not None:
            iterator.set_state(json.loads(state))
        return IteratorBatches(iterator, step, stop_step), how


def carried(
    position: DataPosition | None, rank: int, world_size: int, step: int, shared: bool, rebuildable: bool
) -> tuple[str, str | None]:
    """The rule of the module's docstring: how rank ``rank`` of ``world_size`` hosts has its input
    position at restored step ``step`` ("fresh", "rank R", "shared", "rebuilt") and the state it
    sets (JSON text, or None). ``NotCarried`` where the position cannot be carried."""
    if step == 0:
        return "fresh", None
    if position is None or not position.whole:
        raise NotCarried(
            f"the restored step {step} kept no input position of every host (its snapshot or checkpoint "
            "was taken without this iterator, or without every host's): hand the iterator to "
            "epoch.data() from the first step on, or start the job again from a checkpoint that has it"
        )
    if position.world_size == world_size:
        return f"rank {rank}", position.states[rank]
    if shared:
        states = set(position.states.values())
        if len(states) != 1:
            raise NotCarried(
                f"IteratorData(shared_state=True), but the {position.world_size} hosts' states at step "
                f"{step} differ: an iterator whose state is per host (each its own shard's position) is "
                "not shared; use grain's ElasticIterator, or rebuild_at"
            )
        return "shared", states.pop()
    if rebuildable:
        return "rebuilt", None
    raise NotCarried(
        f"the input position of step {step} is per host ({position.world_size} hosts, each its own shard) "
        f"and cannot be re-split over {world_size}: read the data with grain's ElasticIterator "
        "(IteratorData(..., shared_state=True)), give IteratorData(..., rebuild_at=...) to build each "
        "host's iterator at a step, or use a step-addressable source (GrainData, StepData)"
    )


class IteratorBatches(_StepBatches):
    """This host's batches from its iterator, in step order (``Epoch.data``): ``next()`` once per
    step; ``state()`` its position, after the batches taken so far."""

    def state(self) -> str:
        """The iterator's position as JSON text (``get_state``)."""
        assert isinstance(self._batches, Checkpointable)
        return state_text(self._batches.get_state())

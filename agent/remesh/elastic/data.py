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
applied per record), and reads ahead on Grain's own prefetch threads. A Grain ``IterDataset`` (or any
iterator that only goes forward) keeps a position per host that cannot be re-split over a different
number of hosts, so it is not accepted: build the pipeline up to the records as a ``MapDataset`` and let
remesh batch it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
import numpy as np
import structlog

if TYPE_CHECKING:
    import grain

__all__ = ["GrainData", "HostBatches", "StepData"]

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


class HostBatches(Iterator[PyTree]):
    """This host's rows of each step's global batch, in step order (``Epoch.data``).

    ``next()`` gives the batch of step ``step`` and moves on; the epoch checks, as each step is handed
    back, that the loop took exactly one batch per step. ``records(step)`` says which records of the
    sequence a step's rows are here.
    """

    def __init__(self, batches: Iterator[PyTree], start_step: int, stop_step: int, rows: slice) -> None:
        self._batches = batches
        self.step = start_step  # the step whose batch ``next()`` gives
        self.stop_step = stop_step
        self.host_rows = rows

    @classmethod
    def of(cls, data: StepData, start_step: int, stop_step: int, rows: slice) -> HostBatches:
        """Read ``data`` from ``start_step``: through its own prefetching when it has it."""
        if isinstance(data, GrainData):
            return data.host_batches(start_step, stop_step, rows)
        steps = (data.rows(step, rows) for step in range(start_step, stop_step))
        return cls(steps, start_step, stop_step, rows)

    def __next__(self) -> PyTree:
        if self.step >= self.stop_step:
            raise StopIteration
        batch = next(self._batches)
        self.step += 1
        return batch

    def records(self, step: int, global_batch_size: int) -> range:
        """The positions in the record sequence of this host's rows of ``step``."""
        start, stop, _ = self.host_rows.indices(global_batch_size)
        return range(step * global_batch_size + start, step * global_batch_size + stop)

    def close(self) -> None:
        """Stop reading ahead (Grain's threads)."""
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()

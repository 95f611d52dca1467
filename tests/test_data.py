"""remesh.elastic.data: per-host input whose position is the step, over Grain datasets."""

from __future__ import annotations

import threading
import time
from collections import Counter

import grain
import numpy as np
import pytest

from examples.tinylm import data as tinylm
from remesh.elastic import GrainData, HostBatches, StepData

RECORDS = 1000


def ids(seed: int = 7) -> grain.MapDataset:
    """Records that say which they are: {"id": i} for a shuffled i, with a second leaf."""
    return (
        grain.MapDataset.range(RECORDS)
        .shuffle(seed=seed)
        .map(lambda i: {"id": np.int64(i), "twice": np.full((3,), 2 * i, np.int32)})
    )


def host_rows(global_rows: int, rank: int, world_size: int) -> slice:
    per = global_rows // world_size
    return slice(rank * per, (rank + 1) * per)


def read(source: GrainData, start: int, stop: int, world_size: int) -> dict[int, list[int]]:
    """Step -> record ids, every host of ``world_size`` reading its own rows from ``start``."""
    steps: dict[int, list[int]] = {}
    for rank in range(world_size):
        batches = source.host_batches(start, stop, host_rows(source.global_batch_size, rank, world_size))
        try:
            for step, batch in zip(range(start, stop), batches, strict=True):
                assert batch["id"].shape == (source.global_batch_size // world_size,)
                assert batch["twice"].shape == (source.global_batch_size // world_size, 3)
                steps.setdefault(step, []).extend(int(i) for i in batch["id"])
        finally:
            batches.close()
    return steps


def test_a_shrink_resplits_each_global_batch_so_no_record_is_skipped_or_read_twice() -> None:
    """3 hosts train steps 0-9, then the job shrinks to 2 and restores step 6 (steps 6-9 replayed):
    the trajectory the job keeps reads, at every step, the same 24 records a clean run does, and
    over the whole run each record once."""
    source = GrainData(ids(), 24)
    before = read(source, 0, 10, world_size=3)
    after = read(source, 6, 20, world_size=2)
    clean = read(source, 0, 20, world_size=1)
    kept = {**{s: r for s, r in before.items() if s < 6}, **after}
    for step in range(20):
        assert sorted(kept[step]) == sorted(clean[step]), step
        assert len(set(kept[step])) == 24
    counts = Counter(i for step in range(20) for i in kept[step])
    assert len(counts) == 20 * 24 and max(counts.values()) == 1  # 480 of the 1000 records, each once
    # The replayed steps read what they read before the shrink, row for row in rank order.
    assert all(before[s] == after[s] for s in range(6, 10))


def test_the_rows_are_the_global_batch_a_clean_run_reads() -> None:
    """tinylm's hosts under remesh read, through GrainData, the rows of the batch its plain scripts
    read with global_batch; the first batch of a resumed reader is the resumed step's."""
    source = GrainData(tinylm.records(32, 0), 24)
    whole = tinylm.global_batch(5, 24, 32, 0)
    for world_size in (1, 2, 3, 4):
        parts = [source.rows(5, host_rows(24, r, world_size)) for r in range(world_size)]
        assert np.array_equal(np.concatenate(parts), whole)
    batches = source.host_batches(5, 9, slice(8, 16))
    try:
        assert np.array_equal(next(batches), whole[8:16]) and batches.step == 6
        assert list(batches.records(5, 24)) == list(range(5 * 24 + 8, 5 * 24 + 16))
    finally:
        batches.close()


def test_past_the_end_of_the_dataset_the_next_pass_is_another_permutation() -> None:
    source = GrainData(ids(), 100)
    first = source.rows(0, slice(None))["id"]
    second = source.rows(RECORDS // 100, slice(None))["id"]  # the first batch of the second pass
    assert not np.array_equal(first, second)
    assert len({int(i) for s in range(RECORDS // 100) for i in source.rows(s, slice(None))["id"]}) == RECORDS


def test_reading_ahead_runs_on_grain_threads_and_stops_when_closed() -> None:
    """The batches after the one the loop asked for are read before it asks for them (on Grain's
    threads), the loop is then served what was read ahead, and close() ends those threads."""
    reads: Counter[int] = Counter()
    lock = threading.Lock()

    def record(i: int) -> np.int64:
        with lock:
            reads[int(i)] += 1
        return np.int64(i)

    def read_ahead() -> set[int]:
        with lock:
            return set(reads)

    source = GrainData(
        grain.MapDataset.range(RECORDS).map(record),
        4,
        read_options=grain.ReadOptions(num_threads=2, prefetch_buffer_size=3),
    )
    before = threading.active_count()
    batches = source.host_batches(0, 50, slice(None))
    assert list(next(batches)) == [0, 1, 2, 3]
    # Grain's two threads may take the records in any order, so wait for all of steps 1 and 2.
    ahead = set(range(4, 12))
    deadline = time.monotonic() + 10
    while not ahead <= read_ahead() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ahead <= read_ahead(), f"steps 1 and 2 were not read ahead: {sorted(read_ahead())}"
    assert [list(next(batches)), list(next(batches))] == [[4, 5, 6, 7], [8, 9, 10, 11]]
    with lock:
        assert all(reads[i] == 1 for i in range(12)), "a batch read ahead was read again when asked for"
    assert threading.active_count() > before
    batches.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert threading.active_count() == before


def test_any_step_addressed_source_is_read_without_grain() -> None:
    class Squares:
        global_batch_size = 4

        def rows(self, step: int, rows: slice) -> np.ndarray:
            return (np.arange(4)[rows] + 4 * step) ** 2

    assert isinstance(Squares(), StepData)
    batches = HostBatches.of(Squares(), 3, 5, slice(2, 4))
    assert [list(b) for b in batches] == [[14**2, 15**2], [18**2, 19**2]]
    assert batches.step == 5


def test_an_iterator_only_dataset_or_a_filtered_one_is_refused_with_what_to_do() -> None:
    with pytest.raises(TypeError, match="IterDataset's position cannot be re-split"):
        GrainData(ids().to_iter_dataset(), 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="global_batch_size"):
        GrainData(ids(), 0)
    holes = GrainData(grain.MapDataset.range(100).filter(lambda i: i % 2 == 0), 4)
    with pytest.raises(ValueError, match="filter leaves holes"):
        holes.rows(0, slice(None))
    with pytest.raises(ValueError, match="step must be >= 0"):
        GrainData(ids(), 4).rows(-1, slice(None))

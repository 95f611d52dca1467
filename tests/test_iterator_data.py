"""Input from iterators that keep their own position (``IteratorData``), with real Grain iterators.

The rule first (pure): which state a host of a new epoch takes, the same number of hosts or not.
Then Grain's own iterators, as a recovery sees them: per-host ``DatasetIterator``s read k steps, every
host's position is kept, and the iterator a host (or the spare in a lost host's place) builds for the
next epoch gives exactly the batches an uninterrupted run reads next; Grain's ``ElasticIterator``
carried from 3 hosts to 2 reads each step's windows once between them; a per-host position is not
re-split. Where positions are kept: a snapshot's file and memory, a member's offer, and the restore
choice, which takes no step whose positions no member holds whole. Last, a script run alone with a
Grain iterator and local checkpoints, SIGKILLed and run again, resumes at exactly the window it
would have read (the position committed with the checkpoint) and ends on the uninterrupted run's
state, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from examples.tinylm import data as tinylm
from remesh.elastic.cells import whole
from remesh.elastic.data import DataPosition, IteratorData, NotCarried, carried, state_text
from remesh.elastic.restore_plan import ALL_DATA, NO_DATA, SOME_DATA, Held, MemberOffer, Need, choose
from remesh.elastic.snapshots import Snapshots
from tests.test_run_alone import committed, env_without_agent, leaves
from tests.test_solo_runtime import NO_NETWORK

SEQ, SEED, GLOBAL = 16, 3, 24


def offsets(batch: Any) -> list[int]:
    return [int(o) for o in batch["offset"]]


def position_after(iterators: list[Iterator[Any]]) -> DataPosition:
    """Every host's position now, as the members keep it."""
    return DataPosition(
        len(iterators),
        {r: state_text(it.get_state()) for r, it in enumerate(iterators)},  # type: ignore[attr-defined]
    )


def per_host() -> IteratorData:
    return IteratorData(lambda rank, n: tinylm.host_iterator(SEQ, SEED, GLOBAL, rank, n))


def test_the_rule_for_which_state_a_host_takes() -> None:
    same = DataPosition(3, {0: '{"i": 4}', 1: '{"i": 4}', 2: '{"i": 4}'})
    assert carried(None, 1, 3, 0, shared=False, rebuildable=False) == ("fresh", None)
    # The same number of hosts: each rank its own rank's state (a spare takes the lost host's).
    assert carried(DataPosition(3, {0: "a", 1: "b", 2: "c"}), 1, 3, 9, False, False) == ("rank 1", "b")
    # Another number of hosts: shared states carry over, rebuilt iterators start at the step, and a
    # per-host state (even one that happens to be the same number everywhere) is refused.
    assert carried(same, 0, 2, 9, shared=True, rebuildable=False) == ("shared", '{"i": 4}')
    assert carried(same, 0, 2, 9, shared=False, rebuildable=True) == ("rebuilt", None)
    with pytest.raises(NotCarried, match="cannot be re-split over 2"):
        carried(same, 0, 2, 9, shared=False, rebuildable=False)
    with pytest.raises(NotCarried, match="states at step 9 differ"):
        carried(DataPosition(3, {0: "a", 1: "b", 2: "c"}), 0, 2, 9, shared=True, rebuildable=False)
    # A step past 0 with no position of every host is never restored as if it had one.
    for missing in (None, DataPosition(3, {0: "a", 2: "c"})):
        with pytest.raises(NotCarried, match="kept no input position of every host"):
            carried(missing, 0, 3, 9, shared=False, rebuildable=False)


def test_grain_dataset_iterators_resume_at_exactly_the_next_window_on_the_same_hosts_or_a_spare() -> None:
    """Three hosts read 5 steps from their own shards; the position after step 5 (each host's
    ``get_state``) opens the iterators of the next epoch: rank 1 (the spare, in a lost host's place)
    and the survivors read the windows an uninterrupted run reads at steps 5 to 9."""
    source = per_host()
    clean = [tinylm.host_iterator(SEQ, SEED, GLOBAL, r, 3) for r in range(3)]
    first = [tinylm.host_iterator(SEQ, SEED, GLOBAL, r, 3) for r in range(3)]
    for _ in range(5):
        for it in (*clean, *first):
            next(it)
    position = DataPosition.from_json(position_after(first).to_json())  # as kept and read back
    for rank in range(3):
        batches, how = source.open(rank, 3, 5, 10, position)
        assert how == f"rank {rank}" and batches.step == 5
        for step in range(5, 10):
            assert offsets(next(batches)) == offsets(next(clean[rank])), (rank, step)
        assert batches.step == 10
        with pytest.raises(StopIteration):
            next(batches)  # the epoch's last step was taken
        assert json.loads(batches.state()) == clean[rank].get_state()  # type: ignore[attr-defined]


def test_an_elastic_iterator_carried_from_three_hosts_to_two_reads_every_window_once() -> None:
    """Grain's ElasticIterator through 6 steps on 3 hosts, its shared position carried to 2 hosts: at
    every step the 2 hosts read, between them, the windows the 3 would have (a shrink loses none and
    reads none twice)."""
    source = IteratorData(
        lambda rank, n: tinylm.elastic_iterator(SEQ, SEED, GLOBAL, rank, n), shared_state=True
    )
    three = [tinylm.elastic_iterator(SEQ, SEED, GLOBAL, r, 3) for r in range(3)]
    for _ in range(6):
        for it in three:
            next(it)
    position = position_after(three)
    two = [source.open(rank, 2, 6, 12, position) for rank in range(2)]
    assert {how for _, how in two} == {"shared"}
    reference = [tinylm.elastic_iterator(SEQ, SEED, GLOBAL, r, 3) for r in range(3)]
    read: Counter[int] = Counter()
    for step in range(12):
        expected = sorted(o for it in reference for o in offsets(next(it)))
        if step >= 6:
            got = sorted(o for batches, _ in two for o in offsets(next(batches)))
            assert got == expected, step
            read.update(got)
    assert len(read) == 6 * GLOBAL and max(read.values()) == 1


def test_a_per_host_iterator_is_not_re_split_and_rebuild_at_builds_at_the_step() -> None:
    three = [tinylm.host_iterator(SEQ, SEED, GLOBAL, r, 3) for r in range(3)]
    for it in three:
        next(it)
    position = position_after(three)
    with pytest.raises(NotCarried, match="is per host"):
        per_host().open(0, 2, 1, 5, position)
    built: list[tuple[int, int, int]] = []

    def rebuild_at(rank: int, n: int, step: int) -> Iterator[Any]:
        built.append((rank, n, step))
        it = tinylm.host_iterator(SEQ, SEED, GLOBAL, rank, n)
        for _ in range(step):
            next(it)
        return it

    source = IteratorData(
        lambda rank, n: tinylm.host_iterator(SEQ, SEED, GLOBAL, rank, n), rebuild_at=rebuild_at
    )
    batches, how = source.open(1, 2, 1, 5, position)
    assert how == "rebuilt" and built == [(1, 2, 1)]
    assert len(offsets(next(batches))) == GLOBAL // 2
    # An iterator that keeps no position is refused with what to use instead.
    with pytest.raises(TypeError, match="no get_state/set_state"):
        IteratorData(lambda rank, n: iter([1, 2, 3])).open(0, 1, 0, 3, None)


def test_positions_are_kept_with_a_snapshot_in_memory_and_in_its_file(tmp_path: Path) -> None:
    position = DataPosition(2, {0: '{"next_index": 8}', 1: '{"next_index": 8}'})
    pieces = {(0, whole((4,))): np.arange(4, dtype=np.float32)}
    Snapshots(2, None).put(3, 1, pieces, position.to_json())
    in_memory = Snapshots(2, None)
    in_memory.put(3, 1, pieces, position.to_json())
    in_memory.put(4, 1, pieces)  # a step with no position kept
    shapes = [((4,), np.float32)]
    assert [(s.step, s.data) for s in in_memory.all(shapes)] == [(4, None), (3, position.to_json())]
    Snapshots(2, tmp_path).put(3, 1, pieces, position.to_json())
    found = Snapshots(2, tmp_path).get(3, shapes)  # a process restarted on the host reads the file
    assert found is not None and found.tier == "host-shm"
    assert found.data is not None and DataPosition.from_json(found.data) == position


def test_the_restore_choice_takes_no_step_whose_positions_no_member_holds_whole() -> None:
    """Two members hold steps 10 and 5 whole (each a replica of the one leaf); at step 10 neither
    gathered every host's position (a host died before it posted), so step 5 is restored, its
    positions from the lowest rank that holds them all. Where no position was kept at all (input
    addressed by step), the newest step is restored as always."""
    need = Need(0, {0: [whole((4,))]}, [(4,)], [4])
    mine = frozenset({(0, whole((4,)))})

    def offers(at_10: str, at_5: tuple[str, str]) -> list[MemberOffer]:
        return [
            MemberOffer("", (Held((5, 1), own=mine, data=at_5[rank]), Held((10, 1), own=mine, data=at_10)))
            for rank in range(2)
        ]

    plan = choose(offers(SOME_DATA, (SOME_DATA, ALL_DATA)), need, 10, [])
    assert plan.otherwise.step == 5 and plan.otherwise.data_from == 1  # type: ignore[union-attr]
    assert plan.incomplete == ((10, 1),)
    plain = choose(offers(NO_DATA, (NO_DATA, NO_DATA)), need, 10, [])
    assert plain.otherwise.step == 10 and plain.otherwise.data_from is None  # type: ignore[union-attr]
    # What a member offers goes through the coordination service as JSON, positions included.
    offer = offers(ALL_DATA, (SOME_DATA, SOME_DATA))[0]
    assert MemberOffer.from_json(offer.to_json()) == offer


# ---- a script run alone, killed and run again ------------------------------------------------------

STEPS, EVERY = 30, 5

ITERATOR_LOOP = NO_NETWORK + textwrap.dedent(
    """
    import functools, json, sys, time
    import numpy as np
    from examples.tinylm import data, model
    from remesh.elastic import IteratorData, LocalCheckpoints, Policy, Session

    final, ckpt, shm, read, pause = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
    config = model.Config(seq_len=16, d_model=32, n_layers=1, d_mlp=128)
    session = Session(
        init_state=functools.partial(model.init_state, 0, config),
        devices_per_host=2,
        policy=Policy(checkpoint_every=EVERY, snapshot_every=4, shm_dir=shm),
        checkpoints=[LocalCheckpoints(ckpt)],
        job_id="iterator-alone",
    )
    source = IteratorData(lambda rank, n: data.host_iterator(16, 3, 4, rank, n))
    with open(read, "a", buffering=1) as log:
        for epoch in session.epochs(STEPS):
            with epoch:
                step_fn = epoch.jit(functools.partial(model.train_step, config=config))
                state = epoch.state
                batches = epoch.data(source)
                for step in epoch.steps():
                    rows = next(batches)
                    log.write(json.dumps({"step": step, "offsets": rows["offset"].tolist()}) + "\\n")
                    state, metrics = step_fn(state, epoch.batch(rows["tokens"]))
                    epoch.done(state, metrics)
                    time.sleep(pause)
    np.savez(final, *session.final_leaves())
    session.close()
    print("TRAINED", flush=True)
    """
).replace("EVERY", str(EVERY)).replace("STEPS", str(STEPS))


def iterator_loop(work: Path, pause: float) -> list[str]:
    script = work / "train.py"
    script.write_text(ITERATOR_LOOP)
    args = [work / "final.npz", work / "ckpt", work / "shm", work / "read.jsonl"]
    return [sys.executable, str(script), *map(str, args), str(pause)]


def kept_reads(path: Path) -> dict[int, list[int]]:
    """The windows each step read, the later run's where a step ran twice."""
    steps: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        steps[row["step"]] = row["offsets"]
    return steps


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_grain_iterator_run_alone_resumes_from_the_position_committed_with_its_checkpoint(
    tmp_path: Path,
) -> None:
    clean, work = tmp_path / "clean", tmp_path / "killed"
    clean.mkdir()
    work.mkdir()
    done = subprocess.run(
        iterator_loop(clean, 0.0), capture_output=True, text=True, timeout=200, env=env_without_agent()
    )
    assert done.returncode == 0 and "TRAINED" in done.stdout, (done.stdout + done.stderr)[-4000:]

    killed = subprocess.Popen(
        iterator_loop(work, 0.1),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env_without_agent(),
    )
    try:
        deadline = time.monotonic() + 150
        while len(committed(work / "ckpt")) < 2:
            assert killed.poll() is None and time.monotonic() < deadline, "no second checkpoint"
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
    newest = committed(work / "ckpt")[-1]
    marker = json.loads((work / "ckpt" / f"step_{newest:010d}" / "COMMITTED").read_text())
    assert DataPosition.from_dict(marker["extra"]["input"]).whole  # every rank's position, committed

    again = subprocess.run(
        iterator_loop(work, 0.0), capture_output=True, text=True, timeout=200, env=env_without_agent()
    )
    out = again.stdout + again.stderr
    assert again.returncode == 0 and "TRAINED" in out, out[-4000:]
    assert f"position='rank 0' rank=0 step={newest}" in out, out[-3000:]
    ran = kept_reads(work / "read.jsonl")
    assert ran == kept_reads(clean / "read.jsonl") and sorted(ran) == list(range(STEPS))
    read = Counter(o for step in ran.values() for o in step)
    assert max(read.values()) == 1  # every window once
    for a, b in zip(leaves(work / "final.npz"), leaves(clean / "final.npz"), strict=True):
        assert a.tobytes() == b.tobytes(), "differs from the uninterrupted run"

"""The pure core of sharded state: partition rules, cells, who serves which piece; host snapshots of
pieces (and their failure modes); the piece server over real loopback sockets."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from remesh.elastic.cells import Offer, Uncovered, cell_of, covered, plan_fetch, whole
from remesh.elastic.exchange import FetchFailed, PieceServer, fetch
from remesh.elastic.sharding import Layout, assemble, fit, fsdp_partition
from remesh.elastic.snapshots import Snapshots, claim, release


def mesh_of(replica: int, fsdp: int) -> SimpleNamespace:
    """What the partition rules read of a mesh: its axis sizes."""
    return SimpleNamespace(shape={"replica": replica, "fsdp": fsdp})


def shapes(*dims: tuple[int, ...]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(d, np.float32) for d in dims]


def test_fsdp_partition_shards_the_largest_dividing_dimension_and_leaves_small_leaves_whole() -> None:
    specs = fsdp_partition(mesh_of(1, 6), shapes((96, 384), (384, 96), (100, 96), (96,), (7, 7)))
    assert specs == [P(None, "fsdp"), P("fsdp"), P(None, "fsdp"), P(), P()]


def test_fsdp_partition_replicates_a_leaf_no_dimension_of_which_divides() -> None:
    assert fsdp_partition(mesh_of(1, 5), shapes((64, 256))) == [P()]
    assert fsdp_partition(mesh_of(2, 1), shapes((64, 256))) == [P()]  # nothing to shard over


def test_fit_replicates_a_dimension_that_does_not_divide_and_keeps_the_rest() -> None:
    mesh = mesh_of(2, 3)
    assert fit(P("fsdp", None), (9, 4), mesh) == P("fsdp")
    assert fit(P("fsdp", "replica"), (8, 4), mesh) == P(None, "replica")
    assert fit(P(("replica", "fsdp")), (12,), mesh) == P(("replica", "fsdp"))
    assert fit(P(("replica", "fsdp")), (8,), mesh) == P()


def test_layout_uses_whole_replica_groups_or_one_group() -> None:
    hsdp = Layout(partition=fsdp_partition, hosts_per_replica=2)
    assert [hsdp.replicas(w) for w in (1, 2, 3, 4, 6)] == [1, 1, 1, 2, 3]
    assert Layout().replicas(4) == 1


def test_cells_and_assembly_rebuild_any_box_from_the_pieces_of_another_layout() -> None:
    full = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    # Old layout: 3 row blocks; new: 2 column blocks, and a box straddling the old blocks.
    old = {cell_of((slice(r, r + 2), slice(None)), full.shape): full[r : r + 2] for r in (0, 2, 4)}
    for box in (((0, 6), (0, 4)), ((0, 6), (4, 8)), ((1, 5), (2, 7))):
        got = assemble(box, old.items(), np.float32)
        assert np.array_equal(got, full[box[0][0] : box[0][1], box[1][0] : box[1][1]])
    assert assemble(whole(()), [((), np.array(3, np.int32))], np.int32) == 3
    assert cell_of(None, (4, 2)) == ((0, 4), (0, 2))


ROWS = [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((4, 6), (0, 4))]
SHAPES = [(6, 4)]


def offer(rank: int, own: Sequence[int], buddy: Sequence[int] = (), tier: str = "memory") -> Offer:
    return Offer(rank, frozenset((0, ROWS[i]) for i in own), frozenset((0, ROWS[i]) for i in buddy), tier)


def test_plan_takes_own_pieces_first_then_a_peers_own_then_a_buddy_copy() -> None:
    # Rank 1 died; the spare (rank 1 again) needs rows 2:4: rank 0 holds them as a buddy copy only.
    offers = [offer(0, [0], buddy=[1]), offer(1, []), offer(2, [2], buddy=[0])]
    plan = plan_fetch(1, {0: [ROWS[1]]}, offers, SHAPES, [4])
    assert plan.holders == {(0, ROWS[1]): (0, "buddy")}
    assert plan.bytes_by_source == {"buddy": 2 * 4 * 4}
    # Rank 0 needs its own rows (local) and, re-split to 2 rows of 3, part of rank 2's.
    plan = plan_fetch(0, {0: [((0, 3), (0, 4))]}, offers, SHAPES, [4])
    assert plan.holders == {(0, ROWS[0]): (0, "memory"), (0, ROWS[1]): (0, "buddy")}
    # Where a peer holds a cell as its own, that wins over another peer's buddy copy.
    offers = [offer(0, [0], buddy=[1]), offer(1, []), offer(2, [2, 1])]
    plan = plan_fetch(1, {0: [ROWS[1]]}, offers, SHAPES, [4])
    assert plan.holders == {(0, ROWS[1]): (2, "peer")}


def test_plan_spreads_the_bytes_over_the_peers_that_hold_the_same_cells() -> None:
    offers = [offer(0, [0, 1, 2]), offer(1, [0, 1, 2]), offer(2, [])]
    plan = plan_fetch(2, {0: ROWS}, offers, SHAPES, [4])
    assert sorted(rank for rank, _ in plan.holders.values()) == [0, 0, 1] or sorted(
        rank for rank, _ in plan.holders.values()
    ) == [0, 1, 1]


def test_a_cell_nobody_holds_is_uncovered() -> None:
    offers = [offer(0, [0]), offer(2, [2])]
    assert not covered(offers, SHAPES)
    with pytest.raises(Uncovered):
        plan_fetch(0, {0: [ROWS[0]]}, offers, SHAPES, [4])


def pieces(step: float) -> dict[tuple[int, tuple[tuple[int, int], ...]], np.ndarray]:
    return {(0, ((0, 2), (0, 3))): np.full((2, 3), step, np.float32), (1, ()): np.array(step, np.float32)}


SNAPSHOT_SHAPES = [((4, 3), np.dtype(np.float32)), ((), np.dtype(np.float32))]


def test_snapshots_survive_the_process_in_shm_and_keep_a_pinned_step(tmp_path: Path) -> None:
    snaps = Snapshots(2, tmp_path)
    for step in (1, 2, 3):
        snaps.put(step, 7, pieces(step))
    assert snaps.steps() == [2, 3]
    again = Snapshots(2, tmp_path)  # a restarted trainer: only /dev/shm is left
    found = again.get(3, SNAPSHOT_SHAPES)
    assert found is not None and (found.tier, found.layout) == ("host-shm", 7)
    assert all(np.array_equal(found.pieces[k], v) for k, v in pieces(3).items())
    snaps.pin(2)  # a buddy copied step 2: kept in memory past the window of two
    snaps.put(4, 7, pieces(4))
    assert snaps.held(2, 7) and not snaps.held(2, 8)
    assert snaps.held(3, 7) and snaps.held(4, 7)


def test_snapshots_another_agent_left_are_deleted_and_its_own_kept(tmp_path: Path) -> None:
    """A host's snapshot directory belongs to the agent process whose trainers wrote it: a trainer
    of another agent (the job launched again under the same id) finds none of them; a restarted
    trainer of the same agent finds all of them; and the job's end deletes the directory."""
    shm = tmp_path / "remesh-job-host-0"
    claim(shm, "earlier")
    Snapshots(2, shm).put(30, 2, pieces(30))
    Snapshots(2, shm / "buddy").put(30, 2, pieces(31))

    claim(shm, "earlier")  # a trainer the same agent restarted
    assert Snapshots(2, shm).get(30, SNAPSHOT_SHAPES) is not None

    claim(shm, "this-run")
    assert Snapshots(2, shm).steps() == [] and Snapshots(2, shm / "buddy").steps() == []
    assert Snapshots(2, shm).get(30, SNAPSHOT_SHAPES) is None
    Snapshots(2, shm).put(5, 1, pieces(5))
    claim(shm, "this-run")  # its warm standby
    assert Snapshots(2, shm).steps() == [5]

    release(shm)
    assert not shm.exists()


def test_a_retired_snapshot_file_is_written_over_only_once_nothing_maps_it(tmp_path: Path) -> None:
    snaps = Snapshots(2, tmp_path)
    for step in (1, 2, 3):
        snaps.put(step, 7, pieces(step))
    spares = {p.stat().st_ino for p in tmp_path.glob(".spare_*")}
    assert len(spares) == 1  # step 1's file, out of the window: kept to be written over
    snaps.put(4, 7, pieces(4))
    assert (tmp_path / "step_0000000004.snap").stat().st_ino in spares  # no new file in tmpfs
    # A piece of step 3 still in use (a peer being served from it) when step 3 leaves the window:
    # its file is never written over while it is.
    matrix = (0, ((0, 2), (0, 3)))
    in_use = snaps.held(3, 7)[matrix]
    for step in range(5, 12):
        snaps.put(step, 7, pieces(step))
    assert np.array_equal(in_use, pieces(3)[matrix])
    assert len(list(tmp_path.glob(".spare_*"))) <= 2 and snaps.steps() == [10, 11]
    again = Snapshots(2, tmp_path)  # what a restarted trainer reads back is what was written
    for step in (10, 11):
        found = again.get(step, SNAPSHOT_SHAPES)
        assert found is not None and all(np.array_equal(found.pieces[k], v) for k, v in pieces(step).items())


def test_a_truncated_or_foreign_snapshot_falls_back_to_the_next_tier(tmp_path: Path) -> None:
    Snapshots(3, tmp_path).put(5, 1, pieces(5))
    path = tmp_path / "step_0000000005.snap"
    path.write_bytes(path.read_bytes()[:-10])  # truncated: the writer died, or the file was cut
    assert Snapshots(3, tmp_path).get(5, SNAPSHOT_SHAPES) is None
    path.write_bytes(b"PK\x03\x04" + bytes(100))  # not a snapshot at all
    assert Snapshots(3, tmp_path).get(5, SNAPSHOT_SHAPES) is None
    Snapshots(3, tmp_path).put(6, 1, pieces(6))
    wrong = [((4, 2), np.dtype(np.float32)), ((), np.dtype(np.float32))]
    assert Snapshots(3, tmp_path).get(6, wrong) is None  # does not fit this model
    assert [s.step for s in Snapshots(3, tmp_path).all(SNAPSHOT_SHAPES)] == [6]


def test_the_piece_server_serves_exactly_what_it_holds() -> None:
    held = {(7, 1): pieces(1.5)}
    pinned: list[int] = []
    server = PieceServer(lambda point: held.get(point, {}), on_copied=pinned.append)
    try:
        address = f"127.0.0.1:{server.port}"
        got = fetch(address, (7, 1), list(pieces(0)), 5.0, pin=True)
        assert got.keys() == pieces(0).keys()
        assert all(np.array_equal(got[k], v) and got[k].shape == v.shape for k, v in pieces(1.5).items())
        assert pinned == [7]
        with pytest.raises(FetchFailed, match="not held"):
            fetch(address, (8, 1), list(pieces(0)), 5.0)
    finally:
        server.close()
    with pytest.raises(FetchFailed):
        fetch(address, (7, 1), list(pieces(0)), 1.0)  # nobody listens any more


def test_a_snapshot_file_is_a_json_header_and_the_raw_bytes(tmp_path: Path) -> None:
    Snapshots(1, tmp_path).put(3, 2, pieces(3))
    data = (tmp_path / "step_0000000003.snap").read_bytes()
    magic, rest = data.split(b"\n", 1)
    header = json.loads(rest[8 : 8 + int.from_bytes(rest[:8], "little")])
    assert magic == b"remesh-snapshot-1"
    assert (header["step"], header["layout"]) == (3, 2)
    assert [p[0] for p in header["pieces"]] == [[0, [[0, 2], [0, 3]]], [1, []]]

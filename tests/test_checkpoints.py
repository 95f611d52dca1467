"""Checkpoint tiers against a real directory and a real fake-gcs-server; Orbax for real.

The last test runs two real JAX processes joined by ``jax.distributed.initialize`` to prove that a
save or restore by one process alone neither waits for nor disturbs the other.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
from google.api_core import exceptions as gexc
from structlog.testing import capture_logs

from remesh.elastic.checkpoints import (
    AlreadyCommitted,
    CheckpointError,
    Checkpoints,
    GcsCheckpoints,
    LocalCheckpoints,
    NoViableCheckpoint,
    StaleEpoch,
)
from remesh.embedded import FakeGcsServer, free_port

pytestmark = pytest.mark.integration


def make_state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": rng.standard_normal((4, 6)).astype(np.float32),
            "b": rng.standard_normal(6).astype(np.float64),
        },
        "opt": [rng.integers(-100, 100, 5).astype(np.int8), rng.integers(0, 2**31, 3).astype(np.uint32)],
        "count": np.asarray(seed, dtype=np.int64),
    }


def assert_bitwise_equal(a: Any, b: Any) -> None:
    import jax

    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert str(tree_a) == str(tree_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert isinstance(y, np.ndarray)
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert x.tobytes() == y.tobytes()


def warnings_about(logs: list[MutableMapping[str, Any]], words: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["log_level"] == "warning" and words in e["event"]]


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gcs() -> Iterator[FakeGcsServer]:
    with FakeGcsServer() as server:
        yield server


@pytest.fixture
def bucket(gcs: FakeGcsServer) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    gcs.create_bucket(name)
    return name


def gcs_tier(gcs: FakeGcsServer, bucket: str, staging: Path, prefix: str = "job/ckpt") -> GcsCheckpoints:
    return GcsCheckpoints(bucket, prefix, gcs.client(), staging)


@pytest.fixture(params=["local", "gcs"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Checkpoints:
    if request.param == "local":
        return LocalCheckpoints(tmp_path / "local")
    server: FakeGcsServer = request.getfixturevalue("gcs")
    return gcs_tier(server, request.getfixturevalue("bucket"), tmp_path / "staging")


# ---- round trips ---------------------------------------------------------------------------------


def test_round_trip_is_bitwise(tier: Checkpoints) -> None:
    tier.save(5, 2, make_state(5), {"data_position": 640, "shard": "a"})
    tier.save(9, 3, make_state(9), {"data_position": 1152})

    restored = tier.restore()
    assert (restored.step, restored.epoch, restored.source) == (9, 3, tier.name)
    assert restored.extra == {"data_position": 1152}
    assert_bitwise_equal(make_state(9), restored.state)

    older = tier.restore(step=8, target=make_state(0))  # newest at or below 8, in target's structure
    assert (older.step, older.epoch, older.extra) == (5, 2, {"data_position": 640, "shard": "a"})
    assert_bitwise_equal(make_state(5), older.state)
    assert_bitwise_equal(make_state(5), tier.restore_state(5, make_state(0)))
    assert tier.committed_steps() == [5, 9]
    assert tier.latest_viable() == 9
    assert tier.latest_viable(max_step=6) == 5
    # Past a step held elsewhere (the members' memory) only: nothing at or below it counts.
    assert tier.latest_viable(above=5) == 9 and tier.latest_present(above=5) == 9
    assert tier.latest_viable(above=9) is None and tier.latest_present(max_step=8, above=5) is None
    with pytest.raises(NoViableCheckpoint):
        tier.restore(step=4)
    with pytest.raises(NoViableCheckpoint):
        tier.restore_state(7, make_state(0))


def test_restore_from_gcs_without_a_local_copy(gcs: FakeGcsServer, bucket: str, tmp_path: Path) -> None:
    gcs_tier(gcs, bucket, tmp_path / "writer").save(12, 4, make_state(12), {"data_position": 3})
    assert not list((tmp_path / "writer").rglob("*.ocdbt"))  # nothing kept locally after upload

    fresh = gcs_tier(gcs, bucket, tmp_path / "reader")  # e.g. a spare host that never saw the job
    restored = fresh.restore()
    assert (restored.step, restored.epoch, restored.source, restored.extra) == (
        12,
        4,
        "gcs",
        {"data_position": 3},
    )
    assert_bitwise_equal(make_state(12), restored.state)


def test_a_gcs_step_is_found_by_listing_and_read_once_when_restored(
    gcs: FakeGcsServer, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replicated restore picks its tier with latest_present (sizes from one listing) and lets
    restore_state download and check the step: each file is hashed once, not three times."""
    from remesh.elastic.checkpoints import _base

    writer = gcs_tier(gcs, bucket, tmp_path / "writer")
    writer.save(3, 1, make_state(3))
    writer.save(6, 1, make_state(6))
    hashed: list[str] = []
    digest_like = _base._digest_like

    def counted(path: Path, digest: str) -> str:
        hashed.append(path.name)
        return digest_like(path, digest)

    monkeypatch.setattr(_base, "_digest_like", counted)
    reader = gcs_tier(gcs, bucket, tmp_path / "reader")
    assert reader.latest_present() == 6
    assert hashed == [] and not (tmp_path / "reader" / "restore").exists()  # nothing downloaded
    assert_bitwise_equal(make_state(6), reader.restore_state(6, make_state(0)))
    files = [f.rsplit("/", 1)[-1] for f in step_files(writer, 6) if not f.endswith("COMMITTED")]
    assert files and sorted(hashed) == sorted(files)

    # An object cut short is told by its listed size, still without a download.
    blobs = {b.name: b for b in gcs.client().list_blobs(bucket, prefix="job/ckpt/step_0000000006/")}
    victim = max((b for b in blobs.values() if "COMMITTED" not in b.name), key=lambda b: b.size)
    victim.upload_from_string(victim.download_as_bytes()[:-4])
    hashed.clear()
    with capture_logs() as logs:
        assert reader.latest_present() == 3
    assert hashed == []
    assert [e["step"] for e in warnings_about(logs, "corrupt")] == [6]


# ---- incomplete and corrupt steps ----------------------------------------------------------------


def test_incomplete_local_step_is_ignored_then_replaced(tmp_path: Path) -> None:
    local = LocalCheckpoints(tmp_path / "ckpt")
    local.save(1, 1, make_state(1))
    # A writer killed before its marker: the step's files are all there, the marker is not.
    scratch = LocalCheckpoints(tmp_path / "scratch")
    scratch.save(2, 1, make_state(2))
    shutil.copytree(tmp_path / "scratch" / "step_0000000002", tmp_path / "ckpt" / "step_0000000002")
    (tmp_path / "ckpt" / "step_0000000002" / "COMMITTED").unlink()

    with capture_logs() as logs:
        restored = local.restore()
    assert restored.step == 1
    assert [e["step"] for e in warnings_about(logs, "incomplete")] == [2]
    assert local.committed_steps() == [1]

    local.save(2, 1, make_state(2))  # the leftover of the dead writer is replaced
    assert_bitwise_equal(make_state(2), local.restore().state)


def test_writer_killed_mid_upload_is_ignored(gcs: FakeGcsServer, bucket: str, tmp_path: Path) -> None:
    tier = gcs_tier(gcs, bucket, tmp_path / "staging")
    tier.save(1, 1, make_state(1))
    # A writer killed mid-upload: half of step 2's objects arrived, the marker never did.
    gcs_tier(gcs, bucket, tmp_path / "scratch", prefix="scratch").save(2, 1, make_state(2))
    client = gcs.client()
    source = client.bucket(bucket)
    blobs = [
        b for b in client.list_blobs(bucket, prefix="scratch/step_0000000002/") if "COMMITTED" not in b.name
    ]
    assert len(blobs) > 2
    for blob in blobs[: len(blobs) // 2]:
        source.copy_blob(blob, source, blob.name.replace("scratch/", "job/ckpt/", 1))

    with capture_logs() as logs:
        restored = gcs_tier(gcs, bucket, tmp_path / "reader").restore()
    assert restored.step == 1
    assert_bitwise_equal(make_state(1), restored.state)
    assert [e["step"] for e in warnings_about(logs, "incomplete")] == [2]

    tier.save(2, 1, make_state(2))  # a retry of the step overwrites the partial upload
    assert_bitwise_equal(make_state(2), gcs_tier(gcs, bucket, tmp_path / "reader2").restore().state)


def flip_bytes(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 4]) + data[middle + 4 :]


def largest_file(step_dir: Path) -> Path:
    return max(
        (p for p in step_dir.rglob("*") if p.is_file() and p.name != "COMMITTED"),
        key=lambda p: p.stat().st_size,
    )


def test_corrupt_local_step_falls_back(tmp_path: Path) -> None:
    local = LocalCheckpoints(tmp_path / "ckpt")
    local.save(1, 1, make_state(1))
    local.save(2, 1, make_state(2))
    victim = largest_file(tmp_path / "ckpt" / "step_0000000002")
    victim.write_bytes(flip_bytes(victim.read_bytes()))

    with capture_logs() as logs:
        restored = local.restore()
    assert restored.step == 1
    assert_bitwise_equal(make_state(1), restored.state)
    assert [e["step"] for e in warnings_about(logs, "corrupt")] == [2]
    assert local.latest_viable() == 1
    assert local.committed_steps() == [1, 2]  # still committed: never silently deleted


def test_checkpoints_are_not_compressed_unless_asked(tmp_path: Path) -> None:
    """zstd costs a quarter of a save's CPU for little on float weights: off unless a tier asks."""
    zeros = {"w": np.zeros((256, 1024), np.float32)}  # 1 MiB that compresses to almost nothing

    def written(compress: bool) -> int:
        tier = LocalCheckpoints(tmp_path / f"ckpt-{compress}", compress=compress)
        tier.save(1, 1, zeros)
        return sum(p.stat().st_size for p in (tmp_path / f"ckpt-{compress}").rglob("*") if p.is_file())

    assert written(compress=False) > zeros["w"].nbytes
    assert written(compress=True) < zeros["w"].nbytes // 10
    assert_bitwise_equal(zeros, LocalCheckpoints(tmp_path / "ckpt-True").restore().state)


def test_sharded_save_lists_crc32c_digests_and_a_corrupt_one_falls_back(tmp_path: Path) -> None:
    """A sharded state's marker lists a CRC32C per file (rank 0 reads them back while training goes
    on); a file that no longer matches its CRC32C makes the step unviable, and the one before it is
    restored whole."""
    import jax

    def state(seed: int) -> dict[str, Any]:  # dtypes JAX keeps as they are (no 64-bit ones)
        whole = make_state(seed)
        return {"w": whole["params"]["w"], "opt": whole["opt"]}

    local = LocalCheckpoints(tmp_path / "ckpt")
    for step in (1, 2):
        assert local.prepare_global(step, 1)
        local.write_global(step, jax.tree.map(jax.numpy.asarray, state(step)))
        local.commit_global(step, 1, {"step": step})
    marker = json.loads((tmp_path / "ckpt" / "step_0000000002" / "COMMITTED").read_text())
    assert all(f["digest"].startswith("crc32c:") for f in marker["files"].values())
    # The largest file the marker vouches for (the writers' told digests beside the state are not
    # state, and at this size one can be the largest file of the step).
    step_dir = tmp_path / "ckpt" / "step_0000000002"
    victim = max((step_dir / name for name in marker["files"]), key=lambda p: p.stat().st_size)
    victim.write_bytes(flip_bytes(victim.read_bytes()))  # same size: only the digest can tell

    with capture_logs() as logs:
        assert local.latest_viable() == 1
    assert [e["step"] for e in warnings_about(logs, "corrupt")] == [2]
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state(1))
    assert_bitwise_equal(state(1), jax.tree.map(np.asarray, local.restore_global(1, target)))


def test_each_writer_tells_its_files_digests_and_the_commit_reads_only_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an Orbax save of a sharded state each process reads back the files it wrote (those
    Orbax names for its process index) and tells their digests beside the state; rank 0's commit
    takes them and reads only the files nobody told it about, not every host's state. A told digest
    whose size no longer matches, or a told file that does not parse, is not taken: the commit reads
    the file itself. Here one process, and a second one's files and digests laid out beside them."""
    import jax

    from remesh.elastic.checkpoints import _base

    def crc(path: Path) -> str:
        return "crc32c:" + base64.b64encode(google_crc32c.Checksum(path.read_bytes()).digest()).decode()

    read: list[str] = []
    real_crc32c = _base._crc32c

    def counting(path: Path) -> str:
        read.append(path.relative_to(tmp_path / "ckpt").as_posix())
        return real_crc32c(path)

    monkeypatch.setattr(_base, "_crc32c", counting)
    local = LocalCheckpoints(tmp_path / "ckpt")
    state = {"w": jax.numpy.asarray(make_state(1)["params"]["w"])}
    step_dir = tmp_path / "ckpt" / "step_0000000001"

    assert local.prepare_global(1, 1)
    local.write_global(1, state)
    told = json.loads((step_dir / "digests.process_00000.json").read_text())
    every = sorted(p.relative_to(step_dir).as_posix() for p in (step_dir / "state").rglob("*") if p.is_file())
    own = [rel for rel in every if "process_0" in rel]
    assert own and sorted(told) == own  # its own files, each once, and nothing else
    assert all(
        told[rel] == {"size": (step_dir / rel).stat().st_size, "digest": crc(step_dir / rel)} for rel in own
    )
    # Another process's files, and what it told: process 0 never enters its directory.
    other = step_dir / "state" / "ocdbt.process_1" / "d" / "data"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"shards of process 1")
    (step_dir / "digests.process_00001.json").write_text(
        json.dumps({"state/ocdbt.process_1/d/data": {"size": other.stat().st_size, "digest": crc(other)}})
    )
    assert sorted(p.relative_to(step_dir).as_posix() for p in _base._own_files(step_dir / "state", 0)) == own

    read.clear()
    local.commit_global(1, 1, {"step": 1})
    marker = json.loads((step_dir / "COMMITTED").read_text())["files"]
    assert sorted(marker) == sorted([*every, "state/ocdbt.process_1/d/data"])
    assert all(entry["digest"] == crc(step_dir / rel) for rel, entry in marker.items())
    # Rank 0 read exactly the files nobody told it about: the primary's metadata.
    assert sorted(r.removeprefix("step_0000000001/") for r in read) == [r for r in every if r not in own]

    # A told size that no longer matches, and a told file that does not parse: those files are read.
    assert local.prepare_global(2, 1)
    local.write_global(2, state)
    step_dir = tmp_path / "ckpt" / "step_0000000002"
    told = json.loads((step_dir / "digests.process_00000.json").read_text())
    stale = sorted(told)[0]
    told[stale]["size"] += 1
    (step_dir / "digests.process_00000.json").write_text(json.dumps(told))
    (step_dir / "digests.process_00002.json").write_text("{not json")
    read.clear()
    with capture_logs() as logs:
        local.commit_global(2, 1, {"step": 2})
    assert f"step_0000000002/{stale}" in read
    assert [e["file"] for e in logs if "unreadable" in e["event"]] == ["digests.process_00002.json"]
    marker = json.loads((step_dir / "COMMITTED").read_text())["files"]
    assert all(entry["digest"] == crc(step_dir / rel) for rel, entry in marker.items())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    assert_bitwise_equal(
        jax.tree.map(np.asarray, state), jax.tree.map(np.asarray, local.restore_global(2, target))
    )


def test_a_sharded_state_written_as_pieces_is_restored_onto_another_layout(tmp_path: Path) -> None:
    """Each process writes the pieces it holds the first replica of, one plain file each; a restore
    assembles every leaf from them onto the shardings it asks for (here one device: whole leaves).
    A file cut short, or a process's file missing (the state not covered), is refused as corrupt and
    the step before it is restored."""
    import jax

    def halves(seed: int) -> tuple[dict[str, np.ndarray], list[dict[tuple[int, Any], np.ndarray]]]:
        rng = np.random.default_rng(seed)
        w = rng.standard_normal((4, 6)).astype(np.float32)
        count = np.asarray(seed, dtype=np.int32)
        # Two "processes": w split in rows between them, the scalar held (first replica) by one.
        return {"count": count, "w": w}, [
            {(1, ((0, 2), (0, 6))): w[:2], (0, ()): count},
            {(1, ((2, 4), (0, 6))): w[2:]},
        ]

    local = LocalCheckpoints(tmp_path / "ckpt", pieces=True)
    for step in (1, 2, 3):
        assert local.prepare_global(step, 1)
        for rank, pieces in enumerate(halves(step)[1]):
            local.write_pieces(step, rank, 1, pieces)
        local.commit_global(step, 1, {"step": step})
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), halves(1)[0])
    restored = local.restore_global(3, target)
    assert_bitwise_equal(halves(3)[0], jax.tree.map(np.asarray, restored))

    state = tmp_path / "ckpt" / "step_0000000003" / "state"
    files = sorted(state.glob("*.pieces"))
    assert [f.name for f in files] == ["process_00000.pieces", "process_00001.pieces"]
    # The commit took each file's digest from its writer (rank 0 read none of them): the right one.
    marker = json.loads((state.parent / "COMMITTED").read_text())
    for f in files:
        entry = marker["files"][f"state/{f.name}"]
        crc = base64.b64encode(google_crc32c.Checksum(f.read_bytes()).digest()).decode()
        assert (entry["size"], entry["digest"]) == (f.stat().st_size, f"crc32c:{crc}")
    # Checked already (rank 0 chose it): only presence and sizes are looked at, and they match.
    assert_bitwise_equal(
        halves(3)[0], jax.tree.map(np.asarray, local.restore_global(3, target, verified=True))
    )
    # Cut short after its commit: the manifest's size no longer matches, checked or not.
    files[1].write_bytes(files[1].read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="not of the size the marker says"):
        local.restore_global(3, target, verified=True)
    with capture_logs() as logs:
        assert local.latest_viable() == 2
    assert [e["step"] for e in warnings_about(logs, "corrupt")] == [3]
    # A commit listing one process's file only: rank 0 would not commit it, but a reader must not
    # build a state with a hole in it either.
    assert local.prepare_global(4, 1)
    local.write_pieces(4, 0, 1, halves(4)[1][0])
    local.commit_global(4, 1, {"step": 4})
    with pytest.raises(CheckpointError, match="leaf 1 is not covered"):
        local.restore_global(4, target)
    assert_bitwise_equal(halves(2)[0], jax.tree.map(np.asarray, local.restore_global(2, target)))


def test_the_processes_of_a_job_check_a_sharded_step_a_share_each(tmp_path: Path) -> None:
    """Without reading a file, a tier names the newest step whose files are all there at their
    sizes; reading them is shared: each of N processes checks every N-th file, so exactly the one
    whose share holds a damaged file finds it, and together they read each file once."""
    local = LocalCheckpoints(tmp_path / "ckpt", pieces=True)
    rng = np.random.default_rng(0)
    for step in (1, 2):
        assert local.prepare_global(step, 1)
        for rank in range(4):
            local.write_pieces(step, rank, 1, {(rank, ()): rng.standard_normal(64).astype(np.float32)})
        local.commit_global(step, 1, {"step": step})
    state = tmp_path / "ckpt" / "step_0000000002" / "state"
    files = sorted(state.glob("*.pieces"))
    files[2].write_bytes(flip_bytes(files[2].read_bytes()))  # same size: only reading can tell

    listed = sorted(json.loads((state.parent / "COMMITTED").read_text())["files"])
    damaged = listed.index(f"state/{files[2].name}")

    assert local.latest_present() == 2
    for n in (4, 3, 2):
        with capture_logs() as logs:
            verdicts = [local.verify_share(2, rank, n) for rank in range(n)]
        assert verdicts == [rank != damaged % n for rank in range(n)], n
        assert [e["step"] for e in warnings_about(logs, "corrupt")] == [2]
        assert [local.verify_share(1, rank, n) for rank in range(n)] == [True] * n
    assert not local.verify_share(7, 0, 1)  # never committed
    # Cut short: the sizes tell, without reading.
    files[0].write_bytes(files[0].read_bytes()[:-4])
    with capture_logs() as logs:
        assert local.latest_present() == 1
    assert [e["step"] for e in warnings_about(logs, "corrupt")] == [2]


def test_corrupt_gcs_step_falls_back(gcs: FakeGcsServer, bucket: str, tmp_path: Path) -> None:
    tier = gcs_tier(gcs, bucket, tmp_path / "staging")
    tier.save(1, 1, make_state(1))
    tier.save(2, 1, make_state(2))
    client = gcs.client()
    blobs = [
        b for b in client.list_blobs(bucket, prefix="job/ckpt/step_0000000002/") if "COMMITTED" not in b.name
    ]
    victim = max(blobs, key=lambda b: b.size)
    victim.upload_from_string(flip_bytes(victim.download_as_bytes()))  # a fresh, self-consistent object

    with capture_logs() as logs:
        restored = gcs_tier(gcs, bucket, tmp_path / "reader").restore()
    assert (restored.step, restored.source) == (1, "gcs")
    assert_bitwise_equal(make_state(1), restored.state)
    assert [e["step"] for e in warnings_about(logs, "corrupt")] == [2]


def test_step_orbax_cannot_read_falls_back(tmp_path: Path) -> None:
    local = LocalCheckpoints(tmp_path / "ckpt")
    local.save(1, 1, make_state(1))
    local.save(2, 1, make_state(2))
    # Files that match their marker but are not a checkpoint (a writer bug): Orbax must fail.
    step_dir = tmp_path / "ckpt" / "step_0000000002"
    (step_dir / "state" / "_METADATA").write_text("{not json")
    marker = json.loads((step_dir / "COMMITTED").read_text())
    data = (step_dir / "state" / "_METADATA").read_bytes()
    marker["files"]["state/_METADATA"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / "COMMITTED").write_text(json.dumps(marker))

    assert local.latest_viable() == 2  # the files match; only reading finds the problem
    with capture_logs() as logs:
        restored = local.restore()
    assert restored.step == 1
    assert any("orbax" in e["reason"] for e in warnings_about(logs, "corrupt"))


# ---- epochs and commit markers -------------------------------------------------------------------


def step_files(tier: Checkpoints, step: int) -> list[str]:
    name = f"step_{step:010d}"
    if isinstance(tier, LocalCheckpoints):
        return [str(p) for p in (tier.directory / name).rglob("*")]
    assert isinstance(tier, GcsCheckpoints)
    return [b.name for b in tier.bucket.client.list_blobs(tier.bucket, prefix=f"{tier.prefix}/{name}/")]


def test_stale_epoch_writer_is_refused(tier: Checkpoints) -> None:
    tier.save(10, 3, make_state(10), {"data_position": 10})

    with pytest.raises(StaleEpoch):
        tier.save(11, 2, make_state(99))  # a writer left over from epoch 2
    assert step_files(tier, 11) == []  # refused before writing anything
    assert tier.committed_steps() == [10]
    with pytest.raises((StaleEpoch, AlreadyCommitted)):
        tier.save(10, 2, make_state(99))

    restored = tier.restore()
    assert (restored.step, restored.epoch, restored.extra) == (10, 3, {"data_position": 10})
    assert_bitwise_equal(make_state(10), restored.state)
    tier.save(11, 3, make_state(11))  # the current epoch goes on writing
    tier.fence(5)  # a session entering epoch 5 fences out epoch 3 before it writes anything
    with pytest.raises(StaleEpoch):
        tier.save(12, 3, make_state(12))


def test_resaving_a_committed_step_raises(tier: Checkpoints) -> None:
    tier.save(10, 1, make_state(10))
    with pytest.raises(AlreadyCommitted):
        tier.save(10, 1, make_state(99))
    with pytest.raises(AlreadyCommitted):
        tier.save(10, 2, make_state(99))  # not even from a newer epoch
    assert_bitwise_equal(make_state(10), tier.restore().state)


def test_marker_creation_is_create_only(tier: Checkpoints) -> None:
    """The final guard, below save's own check: two writers racing for one step, one wins."""
    tier.save(10, 1, make_state(10))
    with pytest.raises(AlreadyCommitted):
        tier._create_marker(10, b'{"someone": "else"}')
    assert tier.restore().step == 10


def test_emulator_honours_create_only_preconditions(gcs: FakeGcsServer, bucket: str) -> None:
    blob = gcs.client().bucket(bucket).blob("marker")
    blob.upload_from_string(b"first", if_generation_match=0)
    with pytest.raises(gexc.PreconditionFailed):
        gcs.client().bucket(bucket).blob("marker").upload_from_string(b"second", if_generation_match=0)
    assert blob.download_as_bytes() == b"first"


def test_a_stale_commit_after_a_newer_epoch_is_not_restored(tmp_path: Path) -> None:
    """A stale writer that passed the fence just before a newer epoch raised it, and committed."""
    local = LocalCheckpoints(tmp_path / "ckpt")
    local.save(100, 4, make_state(100))
    local.save(110, 5, make_state(110))  # epoch 5 went back to step 100 and moved on
    LocalCheckpoints(tmp_path / "stale").save(120, 4, make_state(120))  # epoch 4 kept going
    shutil.copytree(tmp_path / "stale" / "step_0000000120", tmp_path / "ckpt" / "step_0000000120")

    with capture_logs() as logs:
        restored = local.restore()
    assert (restored.step, restored.epoch) == (110, 5)
    assert [e["step"] for e in warnings_about(logs, "stale")] == [120]


# ---- two real JAX processes ----------------------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid, port, work, bucket = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    assert (jax.process_count(), jax.process_index(), len(jax.devices())) == (2, pid, 4)

    from google.cloud import storage
    from remesh.elastic.checkpoints import GcsCheckpoints, LocalCheckpoints, NotProcessZero

    def wait_for(name):
        while not (work / name).exists():
            time.sleep(0.02)

    state = {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "n": np.asarray(7, dtype=np.int64)}
    # storage.Client() from the environment the test passes (FakeGcsServer.env()).
    tiers = [LocalCheckpoints(work / "ckpt"), GcsCheckpoints(bucket, "mp", storage.Client(), work / f"staging{pid}")]

    def check(restored):
        assert (restored.step, restored.epoch, restored.extra) == (7, 1, {"pos": 7}), restored
        assert all(restored.state[k].tobytes() == state[k].tobytes() for k in state)

    if pid == 0:  # rank 0 saves and restores alone; process 1 sits in a Python loop meanwhile
        for tier in tiers:
            tier.save(7, 1, state, {"pos": 7})
            check(tier.restore())
        (work / "saved").touch()
        wait_for("restored")
    else:  # then process 1 restores alone while process 0 waits
        wait_for("saved")
        for tier in tiers:
            check(tier.restore())
        try:
            tiers[0].save(8, 1, state)
            sys.exit("process 1 saved")
        except NotProcessZero:
            pass
        (work / "restored").touch()
    jax.distributed.shutdown()
    print("worker", pid, "ok", flush=True)
    """
)


def test_save_and_restore_by_one_process_of_a_distributed_job(
    gcs: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    env = {**os.environ, **gcs.env(), "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for pid in (0, 1):
            out = (tmp_path / f"worker{pid}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(pid), str(port), str(tmp_path), bucket],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
            out.close()
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:  # SIGKILL: JAX's preemption notifier swallows SIGTERM
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    logs = [(tmp_path / f"worker{pid}.log").read_text() for pid in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "worker 0 ok" in logs[0] and "worker 1 ok" in logs[1]

    # And this process, which never initialised jax.distributed, reads what rank 0 wrote.
    restored = LocalCheckpoints(tmp_path / "ckpt").restore()
    assert restored.step == 7
    assert restored.state["w"].tobytes() == np.arange(24, dtype=np.float32).reshape(4, 6).tobytes()


def test_logs_carry_step_and_epoch(tmp_path: Path) -> None:
    with capture_logs() as logs:
        LocalCheckpoints(tmp_path / "ckpt").save(3, 2, make_state(3))
    committed = [e for e in logs if e["event"] == "checkpoint committed"]
    assert committed and committed[0]["step"] == 3 and committed[0]["epoch"] == 2


# ---- retention -----------------------------------------------------------------------------------


def test_only_the_newest_max_to_keep_steps_remain_and_a_save_in_flight_is_left_alone(
    tier: Checkpoints,
) -> None:
    tier.max_to_keep = 2
    tier.save(1, 1, make_state(1))
    # A writer that died before its marker, older than what will be kept: its leftovers go too.
    tier.max_to_keep = 0
    tier.save(2, 1, make_state(2))
    tier.max_to_keep = 2
    if isinstance(tier, LocalCheckpoints):
        (tier.directory / "step_0000000002" / "COMMITTED").unlink()
    else:
        assert isinstance(tier, GcsCheckpoints)
        tier.bucket.blob(f"{tier.prefix}/step_0000000002/COMMITTED").delete()
    for step in (3, 4, 5):
        tier.save(step, 1, make_state(step))
    assert tier.committed_steps() == [4, 5]
    assert [s for s in range(1, 4) if step_files(tier, s)] == []
    # A save on its way (files, no marker yet) newer than every kept step is not touched by a prune.
    scratch_step = 7
    if isinstance(tier, LocalCheckpoints):
        staged = tier.directory / f"step_{scratch_step:010d}"
        staged.mkdir()
        (staged / "partial").write_bytes(b"x")
    else:
        assert isinstance(tier, GcsCheckpoints)
        tier.bucket.blob(f"{tier.prefix}/step_{scratch_step:010d}/state/partial").upload_from_string(b"x")
    tier.save(6, 1, make_state(6))
    assert tier.committed_steps() == [5, 6]
    assert step_files(tier, scratch_step)
    assert_bitwise_equal(make_state(5), tier.restore_state(5, make_state(0)))
    assert tier.restore().step == 6


def test_a_failed_prune_is_logged_and_the_commit_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = LocalCheckpoints(tmp_path / "ckpt", max_to_keep=1)
    local.save(1, 1, make_state(1))

    def storage_refuses(step: int, committed: bool) -> None:
        raise PermissionError(f"cannot delete step {step}")

    monkeypatch.setattr(local, "_delete_step", storage_refuses)
    with capture_logs() as logs:
        local.save(2, 1, make_state(2))
    assert [e["error"] for e in warnings_about(logs, "not deleted")] == ["cannot delete step 1"]
    assert local.committed_steps() == [1, 2] and local.restore().step == 2


def test_every_checkpoint_refusal_is_an_elastic_error() -> None:
    """One exception tree: a user's ``except ElasticError`` sees the checkpoint tiers' refusals too."""
    from remesh.elastic import ElasticError
    from remesh.elastic.checkpoints import AlreadyCommitted, CheckpointError, NoViableCheckpoint, StaleEpoch

    assert all(issubclass(e, CheckpointError) for e in (StaleEpoch, AlreadyCommitted, NoViableCheckpoint))
    assert issubclass(CheckpointError, ElasticError)

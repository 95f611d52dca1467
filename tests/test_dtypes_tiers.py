"""Every leaf dtype JAX uses survives every tier bit for bit, with its dtype recorded by name.

Each dtype's arrays are random bits viewed as that dtype (all 256 encodings of the one-byte floats,
NaN payloads and signalling NaNs of the wider ones, so that a path converting values would show),
0-d, empty and 2-D, through: this process's memory; ``/dev/shm``-style files that a fresh store
reads back (as a restarted trainer does); a real piece server on 127.0.0.1 (buddy and peer copies);
the local checkpoint tier's three paths (replicated Orbax, sharded Orbax, pieces); GCS through a
real fake-gcs-server (replicated and sharded). Then a snapshot that cannot be written: reported,
kept in the process, and no temporary file left.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from structlog.testing import capture_logs

from remesh.elastic.checkpoints import CheckpointError, Checkpoints, GcsCheckpoints, LocalCheckpoints
from remesh.elastic.dtypes import as_bytes, dtype_name, dtype_of
from remesh.elastic.exchange import FetchFailed, Pieces, PieceServer, fetch
from remesh.elastic.sharding import assemble, whole
from remesh.elastic.snapshots import Snapshots, fits
from remesh.embedded import FakeGcsServer

pytestmark = pytest.mark.integration

# What the issue names, then the other kinds JAX has (jax.numpy exports each of them).
DTYPES = [
    "float32",
    "bfloat16",
    "float16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "int8",
    "int4",
    "uint8",
    "int32",
    "bool",
    "complex64",
    "float8_e4m3b11fnuz",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e8m0fnu",
    "float4_e2m1fn",
    "int2",
    "uint4",
    "uint2",
]
# Dtypes tensorstore 0.1.86 (what Orbax writes through) has no type for: Orbax saves of them are
# refused, before anything is written, with an error naming the leaf.
ORBAX_CANNOT = {"float8_e4m3", "uint4", "uint2"}
# Types of fewer than 8 bits (one value a byte): their values are the low bits, the rest zero.
VALUE_BITS = {"bool": 1, "int2": 2, "uint2": 2, "int4": 4, "uint4": 4, "float4_e2m1fn": 4}
# Floats' special encodings, by item size: signalling and quiet NaNs with payloads, -0.0, the
# smallest denormal. (complex64 takes the float32 ones, as its halves.)
SPECIALS = {
    2: [0x7C01, 0x7E01, 0x7F81, 0x7FC1, 0xFFFF, 0x8000, 0x0001],
    4: [0x7F800001, 0x7FC00001, 0xFFFFFFFF, 0x80000000, 0x00000001],
}
SHAPES = [(), (0, 3), (16, 24)]  # 0-d, empty, and 384 elements: every byte value of a 1-byte kind


def make(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bits viewed as dtype ``name``."""
    dtype = dtype_of(name)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), len(shape)])
    raw = rng.integers(0, 256, math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    if name in VALUE_BITS:
        raw &= (1 << VALUE_BITS[name]) - 1
    elif dtype.itemsize == 1 and raw.size >= 256:
        raw[:256] = rng.permutation(256)
    elif dtype.kind in "fc" or name == "bfloat16":
        word = np.uint16 if dtype.itemsize == 2 else np.uint32
        specials = np.array(SPECIALS[np.dtype(word).itemsize], word)
        if raw.size >= specials.nbytes:
            raw[: specials.nbytes] = specials.view(np.uint8)
    return raw.view(dtype).reshape(shape)


def leaves(name: str, seed: int = 0) -> list[np.ndarray]:
    return [make(name, shape, seed) for shape in SHAPES]


def shapes_of(name: str) -> list[tuple[tuple[int, ...], Any]]:
    return [(shape, dtype_of(name)) for shape in SHAPES]


def pieces_of(name: str, seed: int = 0) -> Pieces:
    """The leaves cut as shards would be: the matrix in three cells, one a non-contiguous view."""
    scalar, empty, matrix = leaves(name, seed)
    return {
        (0, ()): scalar,
        (1, whole(empty.shape)): empty,
        (2, ((0, 8), (0, 24))): matrix[:8],
        (2, ((8, 16), (0, 12))): matrix[8:, :12],
        (2, ((8, 16), (12, 24))): matrix[8:, 12:],
    }


def raw(a: Any) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8).tobytes()


def assert_same(expected: np.ndarray, got: Any) -> None:
    """Bit for bit, and of the same dtype by name."""
    got = np.asarray(got)
    assert (dtype_name(got.dtype), got.shape) == (dtype_name(expected.dtype), expected.shape)
    assert got.dtype == expected.dtype
    assert raw(got) == raw(expected)


def assert_same_pieces(expected: Pieces, got: Pieces) -> None:
    assert got.keys() == expected.keys()
    for key, values in expected.items():
        assert_same(values, got[key])


def no_temporary_files(directory: Path) -> bool:
    return not [p for p in directory.rglob("*") if p.name.endswith(".tmp")]


@pytest.fixture(params=DTYPES)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# ---- the names -----------------------------------------------------------------------------------


def test_dtype_names_read_back_as_the_same_dtype_and_bytes_are_viewed_in_place() -> None:
    for n in DTYPES:
        assert dtype_name(dtype_of(n)) == n
        assert dtype_of(n) == jax.numpy.dtype(getattr(jax.numpy, n))  # the dtype JAX's arrays carry
    assert dtype_of("<f4") == np.float32 and dtype_of("|b1") == np.bool_  # files written before names
    with pytest.raises(ValueError, match="'float9_e9'"):
        dtype_of("float9_e9")
    with pytest.raises(ValueError, match="not an array of values"):
        dtype_of("<V2")  # bfloat16 as numpy's dtype.str names it: untyped bytes, not bfloat16
    with pytest.raises(ValueError, match="not an array of values"):
        dtype_of("object")
    with pytest.raises(ValueError, match="byte order"):
        dtype_name(">f4")
    # 0-d, empty, non-contiguous; a C-contiguous array's view is the array's memory.
    assert bytes(as_bytes(make("bfloat16", ()))) == raw(make("bfloat16", ()))
    assert len(as_bytes(make("int4", (0, 3)))) == 0
    matrix = make("float8_e4m3fn", (16, 24))
    assert bytes(as_bytes(matrix[:, 3:5])) == raw(matrix[:, 3:5])
    filled = np.zeros((2, 3), dtype_of("bfloat16"))
    as_bytes(filled)[:] = as_bytes(make("bfloat16", (2, 3)))
    assert_same(make("bfloat16", (2, 3)), filled)


def test_fits_compares_the_dtypes_of_ml_dtypes_types() -> None:
    pieces = {(0, ((0, 2),)): make("bfloat16", (2,)), (1, ((0, 0), (0, 3))): make("bfloat16", (0, 3))}
    for spelled in ("bfloat16", dtype_of("bfloat16"), jax.numpy.bfloat16):
        assert fits(pieces, [((2,), spelled), ((0, 3), spelled)])
    for other in (dtype_of("float16"), dtype_of("float8_e5m2"), dtype_of("int4"), np.dtype("V2")):
        assert not fits(pieces, [((2,), other), ((0, 3), other)])


# ---- host memory -----------------------------------------------------------------------------------


def test_memory_tier(name: str, tmp_path: Path) -> None:
    in_process = Snapshots(2, None)
    in_process.put(1, 3, pieces_of(name))
    found = in_process.get(1, shapes_of(name))
    assert found is not None and found.tier == "memory"
    assert_same_pieces(pieces_of(name), found.pieces)
    # With a directory, what the process keeps is the file, mapped.
    mapped = Snapshots(2, tmp_path)
    kept = mapped.put(1, 3, pieces_of(name))
    assert_same_pieces(pieces_of(name), kept)
    found = mapped.get(1, shapes_of(name))
    assert found is not None and found.tier == "memory"
    assert_same_pieces(pieces_of(name), found.pieces)


def test_host_shm_tier_read_by_a_restarted_trainer(name: str, tmp_path: Path) -> None:
    Snapshots(2, tmp_path).put(1, 3, pieces_of(name))
    Snapshots(2, tmp_path).put(2, 3, pieces_of(name, seed=2))
    restarted = Snapshots(2, tmp_path)
    found = restarted.get(2, shapes_of(name))
    assert found is not None and (found.tier, found.layout) == ("host-shm", 3)
    assert_same_pieces(pieces_of(name, seed=2), found.pieces)
    for leaf, shape in enumerate(SHAPES):
        cells = [(cell, v) for (i, cell), v in found.pieces.items() if i == leaf]
        assert_same(leaves(name, seed=2)[leaf], assemble(whole(shape), cells, dtype_of(name)))
    header = _header(tmp_path / "step_0000000002.snap")
    assert {entry[1] for entry in header["pieces"]} == {name}  # by name, not '<V1'
    assert no_temporary_files(tmp_path)


def test_a_snapshot_directory_given_as_text_works_like_a_path(tmp_path: Path) -> None:
    """As ``Policy.shm_dir`` names it (a string): made, written and read back by a fresh store."""
    directory = str(tmp_path / "shm" / "job")
    Snapshots(2, directory).put(1, 3, pieces_of("bfloat16"))
    found = Snapshots(2, directory).get(1, shapes_of("bfloat16"))
    assert found is not None and found.tier == "host-shm"
    assert_same_pieces(pieces_of("bfloat16"), found.pieces)


def _header(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    rest = data.split(b"\n", 1)[1]
    return dict(json.loads(rest[8 : 8 + int.from_bytes(rest[:8], "little")]))


def test_a_file_written_with_numpy_type_strings_still_reads(tmp_path: Path) -> None:
    """Snapshot files from before dtypes were named hold '<f4' (numpy's type string): still read."""
    Snapshots(1, tmp_path).put(4, 1, pieces_of("float32"))
    path = tmp_path / "step_0000000004.snap"
    # Same length, so every offset stays: JSON allows the spaces.
    path.write_bytes(path.read_bytes().replace(b'"float32"', b'"<f4"    '))
    assert _header(path)["pieces"][0][1] == "<f4"
    found = Snapshots(1, tmp_path).get(4, shapes_of("float32"))
    assert found is not None and found.tier == "host-shm"
    assert_same_pieces(pieces_of("float32"), found.pieces)


# ---- buddy and peer copies ---------------------------------------------------------------------------


def test_buddy_and_peer_copies_over_a_real_socket(name: str, tmp_path: Path) -> None:
    own = Snapshots(2, tmp_path / "own")
    own.put(1, 3, pieces_of(name))  # served from the mapped file
    in_process = Snapshots(2, None)
    in_process.put(2, 3, pieces_of(name, seed=2))  # served from the arrays themselves
    pinned: list[int] = []
    server = PieceServer(lambda point: {**own.held(*point), **in_process.held(*point)}, pinned.append)
    try:
        address = f"127.0.0.1:{server.port}"
        keys = list(pieces_of(name))
        # A buddy copy: kept in the buddy's own directory, read back by a restarted trainer.
        buddies = Snapshots(2, tmp_path / "buddy")
        buddies.put(1, 3, fetch(address, (1, 3), keys, 5.0, pin=True))
        assert pinned == [1]
        found = Snapshots(2, tmp_path / "buddy").get(1, shapes_of(name))
        assert found is not None and found.tier == "host-shm"
        assert_same_pieces(pieces_of(name), found.pieces)
        # A peer's pieces fetched by a restore.
        assert_same_pieces(pieces_of(name, seed=2), fetch(address, (2, 3), keys, 5.0))
    finally:
        server.close()


def test_a_piece_whose_dtype_has_no_name_is_refused_by_the_server_with_the_reason() -> None:
    server = PieceServer(lambda point: {(0, ((0, 2),)): np.arange(2, dtype=">f4")})
    try:
        with pytest.raises(FetchFailed, match="byte order"):
            fetch(f"127.0.0.1:{server.port}", (1, 1), [(0, ((0, 2),))], 5.0)
    finally:
        server.close()


# ---- checkpoints -------------------------------------------------------------------------------------


def orbax_state(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    scalar, _, matrix = leaves(name, seed)  # Orbax refuses arrays with no elements (tested below)
    return {"scalar": scalar, "matrix": matrix}


def check_replicated(tier: Checkpoints, name: str) -> None:
    """save, then restore with and without a target: bitwise, or refused before anything is written."""
    state = orbax_state(name)
    if name in ORBAX_CANNOT:
        with pytest.raises(CheckpointError, match=f"no data type '{name}'.*nothing was written"):
            tier.save(1, 1, state)
        assert tier.committed_steps() == [] and tier._listing() == (set(), set())
        return
    tier.save(1, 1, state)
    for restored in (
        tier.restore().state,
        tier.restore(target=orbax_state(name, seed=9)).state,
        tier.restore_state(1, orbax_state(name, seed=9)),
    ):
        for key, expected in state.items():
            assert_same(expected, restored[key])


def check_sharded(tier: Checkpoints, name: str) -> None:
    """write_global of device arrays, then restore_global onto a sharding: bitwise, or refused."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state = {key: jax.device_put(x, device) for key, x in orbax_state(name).items()}
    assert tier.prepare_global(2, 1)
    if name in ORBAX_CANNOT:
        with pytest.raises(CheckpointError, match=f"no data type '{name}'.*nothing was written"):
            tier.write_global(2, state)
        return
    tier.write_global(2, state)
    tier.commit_global(2, 1, {"step": 2})
    target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device) for k, x in state.items()}
    restored = tier.restore_global(2, target)
    for key, expected in orbax_state(name).items():
        assert_same(expected, restored[key])


def test_local_checkpoints_replicated_and_sharded(name: str, tmp_path: Path) -> None:
    check_replicated(LocalCheckpoints(tmp_path / "replicated"), name)
    check_sharded(LocalCheckpoints(tmp_path / "sharded"), name)


def test_local_checkpoint_pieces_keep_every_dtype_and_shape(name: str, tmp_path: Path) -> None:
    """Two processes' pieces (one holds the scalar and half the matrix, the other the rest)."""
    local = LocalCheckpoints(tmp_path / "ckpt", pieces=True)
    assert local.prepare_global(3, 1)
    pieces = list(pieces_of(name).items())
    local.write_pieces(3, 0, 1, dict(pieces[:3]))
    local.write_pieces(3, 1, 1, dict(pieces[3:]))
    local.commit_global(3, 1, {"step": 3})
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = [jax.ShapeDtypeStruct(shape, dtype, sharding=device) for shape, dtype in shapes_of(name)]
    for expected, got in zip(leaves(name), local.restore_global(3, target), strict=True):
        assert_same(expected, got)
    assert no_temporary_files(tmp_path)


def test_orbax_refuses_an_empty_leaf_before_writing_anything(tmp_path: Path) -> None:
    local = LocalCheckpoints(tmp_path / "ckpt")
    state = {"empty": make("bfloat16", (0, 3)), "w": make("bfloat16", (2, 2))}
    with pytest.raises(CheckpointError, match=r"\['empty'\] \(bfloat16, shape \[0, 3\]\).*no elements"):
        local.save(1, 1, state)
    assert local._listing() == (set(), set())


@pytest.fixture(scope="module")
def gcs() -> Iterator[FakeGcsServer]:
    """The emulator, and the environment that points tensorstore (sharded saves write gs://
    straight from this process) and gcsfs at it."""
    import gcsfs

    with FakeGcsServer() as server, pytest.MonkeyPatch.context() as env:
        for key, value in server.env().items():
            env.setenv(key, value)
        gcsfs.GCSFileSystem.clear_instance_cache()  # one made for another endpoint is not reused
        yield server
        gcsfs.GCSFileSystem.clear_instance_cache()


def test_gcs_checkpoints_replicated_and_sharded(name: str, gcs: FakeGcsServer, tmp_path: Path) -> None:
    bucket = f"dtypes-{uuid.uuid4().hex[:12]}"
    gcs.create_bucket(bucket)
    check_replicated(GcsCheckpoints(bucket, "replicated", gcs.client(), tmp_path / "a"), name)
    check_sharded(GcsCheckpoints(bucket, "sharded", gcs.client(), tmp_path / "b"), name)


# ---- a snapshot that cannot be written -------------------------------------------------------------


class _NoSpace(np.ndarray):
    """A piece whose bytes cannot be written: as if the disk filled up while it was."""

    def reshape(self, *args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")


def reporter() -> tuple[list[tuple[int, str, str]], Callable[[int, str, str], None]]:
    calls: list[tuple[int, str, str]] = []
    return calls, lambda step, tier, error: calls.append((step, tier, error))


def test_a_write_that_fails_midway_is_reported_kept_in_memory_and_leaves_no_temporary_file(
    tmp_path: Path,
) -> None:
    calls, on_not_kept = reporter()
    snaps = Snapshots(1, tmp_path, on_not_kept)
    snaps.put(1, 1, pieces_of("bfloat16", seed=1))
    snaps.put(2, 1, pieces_of("bfloat16", seed=2))  # step 1's file retired: the next write goes over it
    assert list(tmp_path.glob(".spare_*"))
    failing = pieces_of("bfloat16", seed=3)
    failing[(2, ((8, 16), (12, 24)))] = failing[(2, ((8, 16), (12, 24)))].copy().view(_NoSpace)
    with capture_logs() as logs:
        kept = snaps.put(3, 1, failing)
    assert calls == [(3, "host-shm", "OSError: [Errno 28] No space left on device")]
    errors = [e for e in logs if e["log_level"] == "error" and "free space" in e["event"]]
    assert [e["tier"] for e in errors] == ["host-shm"]
    assert no_temporary_files(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_0000000002.snap"]
    found = snaps.get(3, shapes_of("bfloat16"))  # kept in the process all the same
    assert found is not None and found.tier == "memory"
    assert_same_pieces(pieces_of("bfloat16", seed=3), found.pieces)
    assert all(type(v) is np.ndarray for v in kept.values())  # a copy the store owns


def test_a_directory_removed_under_the_store_is_reported(tmp_path: Path) -> None:
    calls, on_not_kept = reporter()
    snaps = Snapshots(2, tmp_path / "shm", on_not_kept)
    (tmp_path / "shm").rmdir()
    snaps.put(5, 1, pieces_of("int4"))
    assert [(step, tier) for step, tier, _ in calls] == [(5, "host-shm")]
    assert "FileNotFoundError" in calls[0][2]
    found = snaps.get(5, shapes_of("int4"))
    assert found is not None and found.tier == "memory"
    assert_same_pieces(pieces_of("int4"), found.pieces)


_FILE_TOO_LARGE = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path

    import numpy as np
    from remesh.elastic.snapshots import Snapshots

    calls = []
    snaps = Snapshots(2, Path(sys.argv[1]), lambda *call: calls.append(call))
    key = (0, ((0, 4096),))
    values = np.arange(4096, dtype=np.float32)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))  # the file stops halfway
    snaps.put(7, 1, {key: values})
    held = snaps.held(7, 1)
    print(json.dumps({"calls": calls, "held": bool(np.array_equal(held[key], values))}))
    """
)


def test_a_write_the_kernel_refuses_leaves_no_temporary_file(tmp_path: Path) -> None:
    """A real failed write: the file size limit (as a full tmpfs would) stops it halfway."""
    out = subprocess.run(
        [sys.executable, "-c", _FILE_TOO_LARGE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["held"] is True
    assert [(step, tier) for step, tier, _ in result["calls"]] == [(7, "host-shm")]
    assert "File too large" in result["calls"][0][2]
    assert [p.name for p in tmp_path.iterdir()] == []


def test_clear_and_drop_after_remove_stray_temporary_files(tmp_path: Path) -> None:
    """A trainer killed in the middle of a write leaves its temporary file; the next one's clear (or
    drop_after) deletes it, with the snapshots."""
    snaps = Snapshots(2, tmp_path)
    snaps.put(4, 1, pieces_of("float16"))
    stray = tmp_path / ".step_0000000005.snap.tmp"
    stray.write_bytes(b"half a snapshot")
    snaps.drop_after(4)
    assert not stray.exists() and snaps.steps() == [4]
    stray.write_bytes(b"half a snapshot")
    Snapshots(2, tmp_path).clear()
    assert [p.name for p in tmp_path.iterdir()] == []

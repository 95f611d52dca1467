"""What both tiers share: the commit marker, the fence, the Orbax calls, and ``Checkpoints``, the
protocol (save, commit, restore, prune) over a storage each tier implements (see the package's
docstring)."""

from __future__ import annotations

import abc
import base64
import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import google_crc32c
import jax
import numpy as np
import orbax.checkpoint as ocp
import structlog
import tensorstore as ts

from remesh.elastic.errors import (
    AlreadyCommitted,
    CheckpointError,
    NotProcessZero,
    NoViableCheckpoint,
    StaleEpoch,
)
from remesh.elastic.exchange import Pieces, demote_threads
from remesh.elastic.sharding import build, covers
from remesh.elastic.snapshots import fits, read_pieces

log = structlog.get_logger("remesh.elastic.checkpoints")


PyTree = Any
# Asks the arbiter of commits to accept (step, epoch) for a tier; raises StaleEpoch when it refuses.
Approve = Callable[[int, int, str], None]
# The commits the arbiter accepted, (step, epoch); None trusts every marker (no arbiter).
Trusted = Collection[tuple[int, int]] | None
STATE = "state"
# A sharded state's file of one process's pieces (``write_pieces``), in the step's STATE directory.
PIECES_SUFFIX = ".pieces"
# Beside each, the size and CRC32C its writer read back from it (the commit's manifest takes them).
DIGEST_SUFFIX = ".crc32c"
# Beside a sharded step's state, one per process: the size and CRC32C of every file that process
# wrote with Orbax, read back by the writer (``_tell_digests``), so that rank 0's commit reads only the
# files nobody told it about, not the whole state of every host.
TOLD_PREFIX = "digests.process_"
# Orbax names what each process writes of a sharded state by its JAX process index: the directory
# "ocdbt.process_<n>" (its OCDBT data) and the file "array_metadatas/process_<n>".
_WRITER_PART = re.compile(r"^(?:.*\.)?process_(\d+)$")
MARKER = "COMMITTED"
FENCE = "EPOCH_FENCE"
_STEP_DIR = re.compile(r"^step_(\d{10})$")
# A marker's digest of a file of a sharded state: its CRC32C, base64 as GCS lists it (GCS: from the
# listing; a local directory: computed, in hardware, a fifth of sha256's time). Otherwise sha256 (hex).
_CRC32C = "crc32c:"
# Compare-and-swap rounds on the GCS fence before giving up; epochs change rarely, so a few suffice.
_FENCE_ATTEMPTS = 20
# Parallel uploads/downloads (threads: JAX dislikes fork); an Orbax step has a handful of files.
_TRANSFER_WORKERS = 8


class _Corrupt(Exception):
    """A committed step that cannot be restored (files differ from the marker, or unreadable)."""


@dataclass(frozen=True)
class Restored:
    step: int
    epoch: int
    state: PyTree
    extra: dict[str, Any]
    source: str


@dataclass(frozen=True)
class _Marker:
    step: int
    epoch: int
    time: float
    extra: dict[str, Any]
    files: dict[str, tuple[int, str]]  # path relative to the step dir -> (size, digest)

    def encode(self) -> bytes:
        files = {rel: {"size": size, "digest": digest} for rel, (size, digest) in sorted(self.files.items())}
        body = {"step": self.step, "epoch": self.epoch, "time": self.time, "extra": self.extra}
        return json.dumps({**body, "files": files}, indent=1).encode()

    @classmethod
    def decode(cls, data: bytes) -> _Marker:
        """The marker in ``data``; ValueError/KeyError/TypeError if it is not a well-formed one."""
        raw = json.loads(data)
        # "sha256": the key of markers written before CRC32C digests (their values are sha256).
        files = {
            str(rel): (int(f["size"]), str(f["digest"] if "digest" in f else f["sha256"]))
            for rel, f in raw["files"].items()
        }
        if not files or not isinstance(raw["extra"], dict):
            raise ValueError("marker lists no files")
        return cls(int(raw["step"]), int(raw["epoch"]), float(raw["time"]), raw["extra"], files)


def _told(path: Path) -> tuple[int, str] | None:
    """The (size, CRC32C) the writer of a pieces file recorded beside it, if it did and the size
    still matches; None: the file is read for its digest."""
    if not path.name.endswith(PIECES_SUFFIX):
        return None
    try:
        told = json.loads(path.with_name(path.name + DIGEST_SUFFIX).read_text())
        size, digest = int(told["size"]), str(told["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (size, digest) if size == path.stat().st_size and digest.startswith(_CRC32C) else None


def _writer_of(part: str) -> int | None:
    """The JAX process a path part names as its writer (``_WRITER_PART``), or None."""
    m = _WRITER_PART.match(part)
    return int(m.group(1)) if m else None


def _own_files(state_dir: Path, me: int) -> Iterator[Path]:
    """The files under ``state_dir`` that process ``me`` wrote: those with a path part naming it.
    Other processes' directories are not entered (on N hosts, N times as many files)."""
    for root, dirs, files in os.walk(state_dir):
        mine = any(_writer_of(part) == me for part in Path(root).relative_to(state_dir).parts)
        dirs[:] = [d for d in dirs if _writer_of(d) in (None, me)]
        yield from (Path(root, f) for f in sorted(files) if mine or _writer_of(f) == me)


def _read_told(step_dir: Path) -> dict[str, tuple[int, str]]:
    """Every process's told digests of ``step_dir`` (``TOLD_PREFIX`` files): path relative to the
    step -> (size, digest). A file that does not parse tells nothing: its files are read instead."""
    told: dict[str, tuple[int, str]] = {}
    for path in sorted(step_dir.glob(f"{TOLD_PREFIX}*.json")):
        try:
            entries = json.loads(path.read_text())
            parsed = {str(rel): (int(e["size"]), str(e["digest"])) for rel, e in entries.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning(
                "digests a writer told are unreadable; reading its files", file=path.name, error=str(exc)
            )
            continue
        told.update({rel: entry for rel, entry in parsed.items() if entry[1].startswith(_CRC32C)})
    return told


def _step_name(step: int) -> str:
    return f"step_{step:010d}"


def _read_through(path: Path, update: Callable[[bytes], object]) -> None:
    """Feed every byte of ``path`` to ``update``, a megabyte at a time."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            update(chunk)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    _read_through(path, digest.update)
    return digest.hexdigest()


def _crc32c(path: Path) -> str:
    checksum = google_crc32c.Checksum()
    _read_through(path, checksum.update)
    return _CRC32C + base64.b64encode(checksum.digest()).decode()


def _digest_like(path: Path, digest: str) -> str:
    """The digest of ``path`` of the kind ``digest`` is."""
    return _crc32c(path) if digest.startswith(_CRC32C) else _sha256(path)


def _manifest(step_dir: Path, digest: Callable[[Path], str] = _sha256) -> dict[str, tuple[int, str]]:
    files = sorted(p for p in (step_dir / STATE).rglob("*") if p.is_file())
    return {p.relative_to(step_dir).as_posix(): (p.stat().st_size, digest(p)) for p in files}


def _mismatches(step_dir: Path, files: Mapping[str, tuple[int, str]]) -> list[str]:
    """The files of ``files`` that are missing under ``step_dir`` or differ in size or digest."""
    bad = []
    for rel, (size, digest) in files.items():
        path = step_dir / rel
        if not path.is_file() or path.stat().st_size != size or _digest_like(path, digest) != digest:
            bad.append(rel)
    return bad


def _must_raise_fence(current: int | None, epoch: int) -> bool:
    """Whether the fence must move up to ``epoch``; StaleEpoch if a newer epoch has written."""
    if current is not None and current > epoch:
        raise StaleEpoch(f"epoch {current} has written here; a writer of epoch {epoch} is stale")
    return current is None or current < epoch


def _encode_fence(epoch: int) -> bytes:
    return json.dumps({"epoch": epoch}).encode()


def _decode_fence(data: bytes) -> int:
    return int(json.loads(data)["epoch"])


def _orbax(compress: bool = False) -> Any:
    """A checkpointer in which only this process takes part (see the module docstring).

    Built per call: the process index changes when the trainer re-joins a new topology.
    """
    me = jax.process_index()
    options = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=options, use_compression=compress)
    return ocp.Checkpointer(handler, multiprocessing_options=options)


# The name tensorstore (Orbax's I/O) gives the workers of its thread pool.
_TENSORSTORE_WORKERS = "ts_pool_worker"


@contextlib.contextmanager
def _at_callers_priority() -> Iterator[None]:
    """Tensorstore's workers at (at most) the calling thread's priority while it writes: a save in
    the background writes at the background's priority, whoever started the workers. Again after,
    for any a worker started meanwhile."""
    demote_threads(_TENSORSTORE_WORKERS)
    try:
        yield
    finally:
        demote_threads(_TENSORSTORE_WORKERS)


def _orbax_can_write(state: PyTree) -> None:
    """CheckpointError, before anything is written, naming the first leaf of ``state`` that Orbax
    cannot store: one of a dtype tensorstore (the storage Orbax writes through) has no type for
    (tensorstore 0.1.86: float8_e4m3, uint4, uint2), or one with no elements (Orbax refuses
    those). Orbax would otherwise fail on it halfway through a save."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            continue
        name, shape = np.dtype(dtype).name, tuple(np.shape(leaf))
        try:
            ts.dtype(name)
        except (ValueError, TypeError):
            why = f"tensorstore, which Orbax writes through, has no data type {name!r}"
        else:
            if 0 not in shape:
                continue
            why = "Orbax refuses arrays with no elements"
        raise CheckpointError(
            f"leaf {jax.tree_util.keystr(path) or '(root)'} ({name}, shape {list(shape)}) cannot be "
            f"checkpointed with Orbax: {why}; nothing was written. Host-memory snapshots and a sharded "
            "state written as pieces (LocalCheckpoints(pieces=True)) keep it bit for bit; for an Orbax "
            "checkpoint, hold that leaf in a dtype tensorstore stores, with at least one element."
        )


def _orbax_save(path: Path, state: PyTree, compress: bool) -> None:
    with _at_callers_priority(), _orbax(compress) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(state))


def _orbax_restore(path: Path, target: PyTree | None) -> PyTree:
    """The state at ``path`` as host numpy arrays, in the structure (and dtypes) of ``target``."""

    def as_numpy(leaf: Any) -> Any:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not hasattr(leaf, "shape"):
            return ocp.RestoreArgs()
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)

    with _orbax() as checkpointer:
        if target is None:
            return checkpointer.restore(path, args=ocp.args.PyTreeRestore())
        restore_args = jax.tree.map(as_numpy, target)
        return checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))


def _orbax_global(compress: bool = False) -> Any:
    """A checkpointer in which every process of the job takes part, each writing or reading its own
    shards; its barriers go through the JAX coordination service (not device collectives), so a
    save may run on a background thread while the training loop runs steps."""
    everyone = set(range(jax.process_count()))
    options = ocp.options.MultiprocessingOptions(primary_host=0, active_processes=everyone)
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=options, use_compression=compress)
    return ocp.Checkpointer(handler, multiprocessing_options=options)


class Checkpoints(abc.ABC):
    """One checkpoint tier. Subclasses supply storage primitives; the protocol lives here."""

    name: str
    # Whether every process can write its own shards of a sharded state here (``write_global``):
    # the tier must be a place every host reaches.
    sharded_saves = False
    # Whether a sharded state is written here as each process's pieces, one plain file per process
    # (``write_pieces``), instead of by Orbax: a sixth of the CPU (see ``write_pieces``).
    writes_pieces = False
    # Whether each process tells the digests of the files it wrote with Orbax (``write_global``):
    # where the tier's storage cannot tell them itself (GCS lists every object's CRC32C).
    tells_digests = False

    def __init__(
        self, clock: Callable[[], float] = time.time, max_to_keep: int | None = 3, compress: bool = False
    ) -> None:
        self._clock = clock
        # Committed steps kept: after each commit the older ones go (None or 0: every one is kept).
        self.max_to_keep = max_to_keep
        # zstd over every array (Orbax's default, on): off by default. Float weights barely compress
        # (a random-normal float32 state: 8% smaller) and the CPU it takes (a quarter of a save's)
        # is taken from the training step on a host whose cores the step uses; worth it only for
        # a tier whose bytes cost more than the host's cores.
        self.compress = compress

    # ---- the interface -------------------------------------------------------------------------

    def save(
        self,
        step: int,
        epoch: int,
        state: PyTree,
        extra: Mapping[str, Any] | None = None,
        approve: Approve | None = None,
    ) -> None:
        """Write ``state`` as committed step ``step`` of ``epoch``; the marker goes last, once
        ``approve`` (when given) accepted the commit.

        Raises StaleEpoch or AlreadyCommitted (no marker written) and NotProcessZero.
        """
        if step < 0 or epoch < 0:
            raise ValueError(f"step and epoch must be >= 0, got step={step} epoch={epoch}")
        extra = dict(extra or {})
        json.dumps(extra)  # fail before writing anything if it is not JSON-able
        _orbax_can_write(state)
        if jax.process_index() != 0:
            raise NotProcessZero(
                f"save called from JAX process {jax.process_index()}: Orbax writes host arrays "
                "only from process 0 (the state is replicated: save from rank 0)"
            )
        bound = log.bind(step=step, epoch=epoch, source=self.name)
        started = time.monotonic()
        with self._writing():
            if self._marker_exists(step):
                raise AlreadyCommitted(f"step {step} is committed in {self.name} already")
            self.fence(epoch)
            staged = self._staging_dir(step)
            _orbax_save(staged / STATE, state, self.compress)
            files = _manifest(staged)
            self._publish(step, staged, files)
            # A newer epoch may have begun while we wrote: then this step must not become committed.
            self.fence(epoch)
            if approve is not None:
                approve(step, epoch, self.name)
            marker = _Marker(step, epoch, self._clock(), extra, files)
            self._create_marker(step, marker.encode())
            self._committed(step, staged)
        bound.info(
            "checkpoint committed",
            files=len(files),
            bytes=sum(size for size, _ in files.values()),
            seconds=round(time.monotonic() - started, 3),
        )
        self.prune()

    # ---- sharded state: every process writes its own shards, rank 0 commits ----------------------

    def prepare_global(self, step: int, epoch: int) -> bool:
        """Rank 0, before a sharded save: whether to write ``step`` (not committed yet, ``epoch`` not
        fenced out); leftovers of a dead writer are removed. The other processes wait for this."""
        if self._marker_exists(step):
            log.info("checkpoint already committed; not writing it again", step=step, source=self.name)
            return False
        try:
            self.fence(epoch)
        except StaleEpoch as exc:
            log.warning("sharded checkpoint not written: its epoch is over", step=step, error=str(exc))
            return False
        self._staging_dir(step)
        return True

    def write_global(self, step: int, state: PyTree) -> None:
        """Every process: write its own shards of ``state`` (``jax.Array`` leaves) into the step;
        where the tier ``tells_digests``, then the digests of the files it wrote (for rank 0's
        commit, once every process returned from this: it reads the files nobody told it about)."""
        _orbax_can_write(state)  # on every process alike, before any of them writes
        path = self._global_dir(step) / STATE
        with _at_callers_priority(), _orbax_global(self.compress) as checkpointer:
            checkpointer.save(path, args=ocp.args.PyTreeSave(state))
        if self.tells_digests:
            self._tell_digests(step, jax.process_index())

    def _tell_digests(self, step: int, me: int) -> None:
        """Read back the files process ``me`` wrote of ``step`` (from this host's page cache) and
        write their sizes and digests beside the state. Never raises: a commit without them reads
        the files itself."""
        step_dir = self._global_dir(step)
        try:
            told = {
                path.relative_to(step_dir).as_posix(): {"size": path.stat().st_size, "digest": _crc32c(path)}
                for path in _own_files(step_dir / STATE, me)
            }
            self._write_told(step_dir / f"{TOLD_PREFIX}{me:05d}.json", json.dumps(told).encode())
        except OSError as exc:
            log.warning(
                "digests of the files written not told; the commit reads them", step=step, error=str(exc)
            )

    def _write_told(self, path: Any, data: bytes) -> None:
        raise CheckpointError(f"the {self.name} tier takes no digests from the writers")

    def write_pieces(self, step: int, rank: int, layout: int, pieces: Pieces) -> int:
        """Every process: its pieces of ``step`` (the distinct shards it holds the first replica of,
        as host arrays: (leaf, cell) -> values, laid out by epoch ``layout``'s mesh) as one file of
        the step; returns its size. One plain write of the bytes, the interpreter lock released: a
        save of 64 MiB in 81 arrays, with its commit, takes 0.036 CPU seconds this way and 0.216
        with Orbax (benchmarks/checkpoint_cpu.py), and on a host whose cores run the step that CPU
        is taken from the step beside it."""
        raise CheckpointError(f"the {self.name} tier writes a sharded state with Orbax (write_global)")

    def commit_global(
        self, step: int, epoch: int, extra: Mapping[str, Any] | None = None, approve: Approve | None = None
    ) -> None:
        """Rank 0, after every process wrote: the marker, once the epoch is still current."""
        started = time.monotonic()
        files = self._global_manifest(step)
        self.fence(epoch)
        if approve is not None:
            approve(step, epoch, self.name)
        self._create_marker(step, _Marker(step, epoch, self._clock(), dict(extra or {}), files).encode())
        log.info(
            "sharded checkpoint committed",
            step=step,
            epoch=epoch,
            source=self.name,
            files=len(files),
            bytes=sum(size for size, _ in files.values()),
            seconds=round(time.monotonic() - started, 3),
        )
        self.prune()

    def prune(self) -> list[int]:
        """Delete the committed steps older than the newest ``max_to_keep``, and the leftovers of
        writers that died before them; never a step newer than the oldest kept (a save on its way).
        Each step's marker goes first: a deletion cut short leaves an incomplete step, which is never
        restored. A failure is logged, not raised (the commit before it stands). The steps deleted."""
        if not self.max_to_keep:
            return []
        try:
            steps, marked = self._listing()
            kept = sorted(marked)[-self.max_to_keep :]
            if not kept:
                return []
            doomed = sorted(s for s in steps if s < kept[0])
            for step in doomed:
                self._delete_step(step, step in marked)
        except Exception as exc:
            log.warning("old checkpoints not deleted", source=self.name, error=str(exc))
            return []
        if doomed:
            log.info("old checkpoints deleted", source=self.name, steps=doomed, kept=kept)
        return doomed

    def _global_manifest(self, step: int) -> dict[str, tuple[int, str]]:
        """What every process wrote for ``step``: path relative to the step -> (size, digest). A
        file's digest is its writer's where the writer told it (``_tell_digests``; a pieces file's
        digest file) and the size still matches: rank 0 reads no other process's state (on N
        hosts, N times its own). The rest (the primary's metadata, or a writer that told nothing)
        rank 0 reads for their CRC32C, while the loop trains."""
        step_dir = self._global_dir(step)
        told = _read_told(step_dir) if self.tells_digests else {}
        files: dict[str, tuple[int, str]] = {}
        for path in sorted(p for p in (step_dir / STATE).rglob("*") if p.is_file()):
            rel = path.relative_to(step_dir).as_posix()
            size = path.stat().st_size
            entry = told.get(rel)
            files[rel] = entry if entry and entry[0] == size else _told(path) or (size, _crc32c(path))
        return files

    def restore_global(
        self, step: int, target: PyTree, trusted: Trusted = None, verified: bool = False
    ) -> PyTree:
        """Every process: exactly step ``step`` onto the shardings of ``target`` (``jax.ShapeDtypeStruct``
        leaves with shardings), each process reading the shards its devices hold. ``verified``: the
        step's files were checked against its marker already (``verify_share``: every process a
        share), so only their presence and sizes are checked here; else every file is read for its
        digest, which on N hosts is N times what each restores."""
        marker = self._exact(step, trusted)
        if marker is None:
            raise NoViableCheckpoint(f"step {step} is not committed in {self.name}")
        try:
            directory = self._present(marker) if verified else self._fetch(marker)
        except _Corrupt as exc:
            raise CheckpointError(f"step {step} in {self.name} is not whole: {exc}") from exc
        if isinstance(directory, Path) and any((directory / STATE).glob(f"*{PIECES_SUFFIX}")):
            return self._restore_pieces(step, directory / STATE, target)
        args = ocp.checkpoint_utils.construct_restore_args(target)
        with _orbax_global() as checkpointer:
            state = checkpointer.restore(
                directory / STATE, args=ocp.args.PyTreeRestore(item=target, restore_args=args)
            )
        log.info("sharded checkpoint restored", step=step, source=self.name)
        return state

    def _restore_pieces(self, step: int, state_dir: Path, target: PyTree) -> PyTree:
        """The pieces every process wrote, read where this process's devices need them, onto the
        shardings of ``target``. Files that do not fit the target, or leave part of it uncovered,
        are corrupt: ``CheckpointError``, the restore falls back as for an unreadable Orbax step."""
        leaves, treedef = jax.tree_util.tree_flatten(target)
        shapes = [(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]
        pieces: Pieces = {}
        try:
            for path in sorted(state_dir.glob(f"*{PIECES_SUFFIX}")):
                pieces.update(read_pieces(path)[1])
            if not fits(pieces, shapes):
                raise ValueError("pieces that do not fit the state's shapes and dtypes")
            gaps = [
                i
                for i, (shape, _) in enumerate(shapes)
                if not covers((c for j, c in pieces if j == i), shape)
            ]
            if gaps:
                raise ValueError(f"leaf {gaps[0]} is not covered by the pieces written")
            state = build(pieces, shapes, [x.sharding for x in leaves])
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"step {step} in {self.name} is unreadable: {exc}") from exc
        log.info("sharded checkpoint restored", step=step, source=self.name, pieces=len(pieces))
        return jax.tree_util.tree_unflatten(treedef, state)

    def _global_dir(self, step: int) -> Any:
        """Where every process writes its shards of ``step`` (a ``Path``, or an ``epath.Path``)."""
        raise CheckpointError(f"the {self.name} tier cannot hold a sharded state")

    def committed_steps(self) -> list[int]:
        """Every step with a commit marker, ascending (intact or not)."""
        return sorted(self._listing()[1])

    def restore(
        self, step: int | None = None, target: PyTree | None = None, trusted: Trusted = None
    ) -> Restored:
        """The newest viable committed step (at or below ``step`` when given), as host arrays.

        ``target`` (a pytree of arrays or ``jax.ShapeDtypeStruct``) gives the structure and dtypes.
        """
        return self._restore_first(self._candidates(step, trusted), target)

    def restore_state(self, step: int, template: PyTree, trusted: Trusted = None) -> PyTree:
        """Exactly step ``step`` in the structure of ``template``; NoViableCheckpoint otherwise."""
        marker = self._exact(step, trusted)
        return self._restore_first([] if marker is None else [marker], template).state

    def latest_viable(
        self, max_step: int | None = None, trusted: Trusted = None, above: int | None = None
    ) -> int | None:
        """The newest committed step (at or below ``max_step``, and past ``above``) whose files match
        its marker; steps at or below ``above`` are not read at all.

        Restore falls back further only if Orbax then cannot read that step.
        """
        return self._newest(max_step, trusted, self._fetch, above)

    def latest_present(
        self, max_step: int | None = None, trusted: Trusted = None, above: int | None = None
    ) -> int | None:
        """The newest committed step (at or below ``max_step``, and past ``above``) whose files are
        all there, of the sizes its marker says: what a tier tells without reading them. For a
        sharded state, whose files every process checks a share of (``verify_share``) instead of one
        reading them all."""
        return self._newest(max_step, trusted, self._present, above)

    def _newest(
        self,
        max_step: int | None,
        trusted: Trusted,
        check: Callable[[_Marker], object],
        above: int | None = None,
    ) -> int | None:
        """The newest candidate step past ``above`` that ``check`` does not find corrupt (warning of
        each it does)."""
        for marker in self._candidates(max_step, trusted):
            if above is not None and marker.step <= above:
                return None
            try:
                check(marker)
            except _Corrupt as exc:
                self._warn_corrupt(marker, exc)
                continue
            return marker.step
        return None

    def verify_share(self, step: int, rank: int, world_size: int, trusted: Trusted = None) -> bool:
        """Process ``rank``'s share of checking the files of committed step ``step`` against its
        marker: every ``world_size``-th file, from the ``rank``-th in name order, so that the
        processes of a job read the step once between them (one process checking every file reads
        the whole state: on N hosts, N times what it restores). False, with a warning, where a
        file of the share differs or the step is not committed."""
        marker = self._exact(step, trusted)
        if marker is None:
            return False
        share = {
            rel: entry
            for i, (rel, entry) in enumerate(sorted(marker.files.items()))
            if i % world_size == rank
        }
        try:
            self._fetch(replace(marker, files=share))
        except _Corrupt as exc:
            self._warn_corrupt(marker, exc)
            return False
        return True

    def extra_of(self, step: int, trusted: Trusted = None) -> dict[str, Any]:
        """The ``extra`` committed with step ``step`` (its marker's; empty where it is no candidate)."""
        marker = self._exact(step, trusted)
        return {} if marker is None else dict(marker.extra)

    def _exact(self, step: int, trusted: Trusted) -> _Marker | None:
        """The marker of committed step ``step``, if it is a candidate (``_candidates``)."""
        return next((m for m in self._candidates(step, trusted) if m.step == step), None)

    def fence(self, epoch: int) -> None:
        """Raise the fence to ``epoch``: writers of older epochs are refused from now on.

        ``save`` does this itself; a session may call it when it enters an epoch.
        """
        self._raise_fence(epoch)

    # ---- the protocol --------------------------------------------------------------------------

    def _candidates(self, max_step: int | None, trusted: Trusted = None) -> list[_Marker]:
        """Committed steps worth trying, newest first; warns about every step it skips."""
        step_dirs, marked = self._listing()
        for step in sorted(step_dirs - marked):
            if max_step is None or step <= max_step:
                log.warning(
                    "incomplete checkpoint ignored: no commit marker",
                    step=step,
                    source=self.name,
                )
        markers: list[_Marker] = []
        for step in sorted(marked):
            data = self._read_marker(step)
            if data is None:
                continue
            try:
                marker = _Marker.decode(data)
                if marker.step != step:
                    raise ValueError(f"marker of step {step} names step {marker.step}")
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning(
                    "corrupt checkpoint ignored: bad marker", step=step, source=self.name, reason=str(exc)
                )
                continue
            if trusted is not None and (marker.step, marker.epoch) not in trusted:
                if max_step is None or step <= max_step:
                    log.warning(
                        "checkpoint ignored: the coordinator never accepted its commit",
                        step=step,
                        epoch=marker.epoch,
                        source=self.name,
                    )
                continue
            markers.append(marker)
        viable: list[_Marker] = []
        newest_epoch = -1
        for marker in markers:
            if marker.epoch < newest_epoch:
                log.warning(
                    "stale checkpoint ignored: an earlier step has a newer epoch",
                    step=marker.step,
                    epoch=marker.epoch,
                    newer_epoch=newest_epoch,
                    source=self.name,
                )
                continue
            newest_epoch = marker.epoch
            viable.append(marker)
        return [m for m in reversed(viable) if max_step is None or m.step <= max_step]

    def _restore_first(self, candidates: list[_Marker], target: PyTree | None) -> Restored:
        for marker in candidates:
            try:
                directory = self._fetch(marker)
                try:
                    state = _orbax_restore(directory / STATE, target)
                except Exception as exc:  # any Orbax failure: the step is unreadable here
                    raise _Corrupt(f"orbax cannot read it: {exc!r}") from exc
            except _Corrupt as exc:
                self._warn_corrupt(marker, exc)
                continue
            log.info("checkpoint restored", step=marker.step, epoch=marker.epoch, source=self.name)
            return Restored(marker.step, marker.epoch, state, dict(marker.extra), self.name)
        raise NoViableCheckpoint(f"no viable committed checkpoint in {self.name}")

    def _warn_corrupt(self, marker: _Marker, exc: _Corrupt) -> None:
        log.warning(
            "corrupt checkpoint: falling back to the previous one",
            step=marker.step,
            epoch=marker.epoch,
            source=self.name,
            reason=str(exc),
        )

    # ---- storage primitives --------------------------------------------------------------------

    def _writing(self) -> contextlib.AbstractContextManager[None]:
        """Held for a whole save; where saves replace leftovers in place, it serialises writers."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def _listing(self) -> tuple[set[int], set[int]]:
        """(steps with any file, steps with a marker)."""

    @abc.abstractmethod
    def _marker_exists(self, step: int) -> bool: ...

    @abc.abstractmethod
    def _read_marker(self, step: int) -> bytes | None: ...

    @abc.abstractmethod
    def _raise_fence(self, epoch: int) -> None:
        """Compare-and-swap the fence up to ``epoch`` with ``_must_raise_fence``."""

    @abc.abstractmethod
    def _staging_dir(self, step: int) -> Path:
        """A fresh local step directory for Orbax to write into (leftovers removed)."""

    @abc.abstractmethod
    def _publish(self, step: int, staged: Path, files: Mapping[str, tuple[int, str]]) -> None:
        """Make the staged files the step's files (a no-op where staging is in place)."""

    @abc.abstractmethod
    def _create_marker(self, step: int, data: bytes) -> None:
        """Create the marker only if none exists; AlreadyCommitted otherwise."""

    @abc.abstractmethod
    def _committed(self, step: int, staged: Path) -> None:
        """Clean up after a commit."""

    def _present(self, marker: _Marker) -> Any:
        """``_fetch`` for a step whose files were checked against ``marker`` already: where a tier
        can tell presence and size without reading, only those."""
        return self._fetch(marker)

    @abc.abstractmethod
    def _fetch(self, marker: _Marker) -> Path:
        """A local step directory whose files match ``marker``; _Corrupt if they cannot."""

    @abc.abstractmethod
    def _delete_step(self, step: int, committed: bool) -> None:
        """Delete the step: its marker first (where ``committed``), then every file of it."""

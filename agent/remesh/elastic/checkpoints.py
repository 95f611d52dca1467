"""Checkpoint tiers of the elastic trainer: a local directory and a GCS bucket, one interface.

The session restores from a host-memory snapshot where one survives; these tiers are the fallback
(the newest committed checkpoint, local then GCS) and what survives losing every host. A state is a
pytree of host numpy arrays (``jax.device_get(state)``) with its step, epoch and a small JSON
``extra`` dict (e.g. the data position). Both tiers share one layout::

    {root}/EPOCH_FENCE                  the highest epoch that has written here (JSON)
    {root}/step_0000000120/state/...    an Orbax PyTree checkpoint of the state
    {root}/step_0000000120/COMMITTED    the commit marker, written last: step, epoch, time, extra,
                                        and the size and sha256 of every file of the step

A step without a marker is incomplete (a writer died): it is never restored, and a later save of
that step replaces it. A committed step whose files do not match its marker, or that Orbax cannot
read, is corrupt: restore warns and falls back to the previous committed step. A committed step is
never replaced: the marker is created exclusively (local: a hard link, which fails if the name
exists; GCS: ``if_generation_match=0``).

The arbiter of commits: in a job under remesh the coordinator decides whether a checkpoint counts.
``save(..., approve=...)`` asks it (``approve(step, epoch, tier)``, through the agent) after the
files are written and before the marker: it accepts only while ``epoch`` is current, so a writer
paused or cut off through an epoch change never commits, however long it was away. Readers given
``trusted`` (the commits the coordinator accepted, from the epoch's topology) restore nothing else.

Epoch fencing (also where no coordinator is asked): a writer from an older epoch never writes over a
newer epoch's work. ``save`` at
epoch E raises the fence to E by compare-and-swap (local: under an fcntl lock; GCS: generation
preconditions) and is refused with ``StaleEpoch`` if the fence is already higher; it checks again
just before the marker. For the sliver of time between that check and the marker, restore also
skips a committed step whose epoch is older than that of a committed step before it: such a step
continues a timeline a newer epoch has abandoned.

Orbax runs process-locally: in a multi-process JAX job only rank 0 saves (the state is
replicated), and any process may restore on its own, so every Orbax call takes part alone
(``MultiprocessingOptions(primary_host=me, active_processes={me})``: Orbax skips its cross-process
barriers when the only active process is the caller). Orbax writes host numpy arrays only from
JAX process 0, hence ``NotProcessZero``.

Errors::

    CheckpointError
    ├── StaleEpoch           a newer epoch has written here: this writer is stale; stop, do not retry
    ├── AlreadyCommitted     the step is committed already; skip this save (nothing was written)
    ├── NotProcessZero       save called from a JAX process other than 0; a programming error
    └── NoViableCheckpoint   nothing committed and intact at or below the step: start from scratch

Storage errors (``OSError``, ``google.api_core`` exceptions) pass through unchanged: a failed save
is safe to retry, since it left at most an incomplete step.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import structlog

if TYPE_CHECKING:
    from google.cloud import storage

__all__ = [
    "AlreadyCommitted",
    "Approve",
    "CheckpointError",
    "Checkpoints",
    "GcsCheckpoints",
    "LocalCheckpoints",
    "NoViableCheckpoint",
    "NotProcessZero",
    "Restored",
    "StaleEpoch",
]

log = structlog.get_logger("remesh.elastic.checkpoints")

PyTree = Any
# Asks the arbiter of commits to accept (step, epoch) for a tier; raises StaleEpoch when it refuses.
Approve = Callable[[int, int, str], None]
# The commits the arbiter accepted, (step, epoch); None trusts every marker (no arbiter).
Trusted = Collection[tuple[int, int]] | None
STATE = "state"
MARKER = "COMMITTED"
FENCE = "EPOCH_FENCE"
_STEP_DIR = re.compile(r"^step_(\d{10})$")
# A marker's digest of an object written straight to GCS: its CRC32C as GCS lists it (base64).
_CRC32C = "crc32c:"
# Compare-and-swap rounds on the GCS fence before giving up; epochs change rarely, so a few suffice.
_FENCE_ATTEMPTS = 20
# Parallel uploads/downloads (threads: JAX dislikes fork); an Orbax step has a handful of files.
_TRANSFER_WORKERS = 8


class CheckpointError(Exception):
    """Root of every error the checkpoint tiers raise on purpose."""


class StaleEpoch(CheckpointError):
    pass


class AlreadyCommitted(CheckpointError):
    pass


class NotProcessZero(CheckpointError):
    pass


class NoViableCheckpoint(CheckpointError):
    pass


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
    files: dict[str, tuple[int, str]]  # path relative to the step dir -> (size, sha256)

    def encode(self) -> bytes:
        files = {rel: {"size": size, "sha256": digest} for rel, (size, digest) in sorted(self.files.items())}
        body = {"step": self.step, "epoch": self.epoch, "time": self.time, "extra": self.extra}
        return json.dumps({**body, "files": files}, indent=1).encode()

    @classmethod
    def decode(cls, data: bytes) -> _Marker:
        """The marker in ``data``; ValueError/KeyError/TypeError if it is not a well-formed one."""
        raw = json.loads(data)
        files = {str(rel): (int(f["size"]), str(f["sha256"])) for rel, f in raw["files"].items()}
        if not files or not isinstance(raw["extra"], dict):
            raise ValueError("marker lists no files")
        return cls(int(raw["step"]), int(raw["epoch"]), float(raw["time"]), raw["extra"], files)


def _step_name(step: int) -> str:
    return f"step_{step:010d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(step_dir: Path) -> dict[str, tuple[int, str]]:
    files = sorted(p for p in (step_dir / STATE).rglob("*") if p.is_file())
    return {p.relative_to(step_dir).as_posix(): (p.stat().st_size, _sha256(p)) for p in files}


def _mismatches(step_dir: Path, files: Mapping[str, tuple[int, str]]) -> list[str]:
    """The files of ``files`` that are missing under ``step_dir`` or differ in size or sha256."""
    bad = []
    for rel, (size, digest) in files.items():
        path = step_dir / rel
        if not path.is_file() or path.stat().st_size != size or _sha256(path) != digest:
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


def _orbax() -> Any:
    """A checkpointer in which only this process takes part (see the module docstring).

    Built per call: the process index changes when the trainer re-joins a new topology.
    """
    me = jax.process_index()
    options = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=options)
    return ocp.Checkpointer(handler, multiprocessing_options=options)


def _orbax_save(path: Path, state: PyTree) -> None:
    with _orbax() as checkpointer:
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


def _orbax_global() -> Any:
    """A checkpointer in which every process of the job takes part, each writing or reading its own
    shards; its barriers go through the JAX coordination service (not device collectives), so a
    save may run on a background thread while the training loop runs steps."""
    everyone = set(range(jax.process_count()))
    options = ocp.options.MultiprocessingOptions(primary_host=0, active_processes=everyone)
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=options)
    return ocp.Checkpointer(handler, multiprocessing_options=options)


class Checkpoints(abc.ABC):
    """One checkpoint tier. Subclasses supply storage primitives; the protocol lives here."""

    name: str
    # Whether every process can write its own shards of a sharded state here (``write_global``):
    # the tier must be a place every host reaches.
    sharded_saves = False

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock

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
            _orbax_save(staged / STATE, state)
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
        """Every process: write its own shards of ``state`` (``jax.Array`` leaves) into the step."""
        path = self._global_dir(step) / STATE
        with _orbax_global() as checkpointer:
            checkpointer.save(path, args=ocp.args.PyTreeSave(state))

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

    def _global_manifest(self, step: int) -> dict[str, tuple[int, str]]:
        """What every process wrote for ``step``: path relative to the step -> (size, digest)."""
        return _manifest(self._global_dir(step))

    def restore_global(self, step: int, target: PyTree, trusted: Trusted = None) -> PyTree:
        """Every process: exactly step ``step`` onto the shardings of ``target`` (``jax.ShapeDtypeStruct``
        leaves with shardings), each process reading the shards its devices hold."""
        exact = [m for m in self._candidates(step, trusted) if m.step == step]
        if not exact:
            raise NoViableCheckpoint(f"step {step} is not committed in {self.name}")
        directory = self._fetch(exact[0])
        args = ocp.checkpoint_utils.construct_restore_args(target)
        with _orbax_global() as checkpointer:
            state = checkpointer.restore(
                directory / STATE, args=ocp.args.PyTreeRestore(item=target, restore_args=args)
            )
        log.info("sharded checkpoint restored", step=step, source=self.name)
        return state

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
        exact = [m for m in self._candidates(step, trusted) if m.step == step]
        return self._restore_first(exact, template).state

    def latest_viable(self, max_step: int | None = None, trusted: Trusted = None) -> int | None:
        """The newest committed step (at or below ``max_step``) whose files match its marker.

        Restore falls back further only if Orbax then cannot read that step.
        """
        for marker in self._candidates(max_step, trusted):
            try:
                self._fetch(marker)
            except _Corrupt as exc:
                self._warn_corrupt(marker, exc)
                continue
            return marker.step
        return None

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

    @abc.abstractmethod
    def _fetch(self, marker: _Marker) -> Path:
        """A local step directory whose files match ``marker``; _Corrupt if they cannot."""


class LocalCheckpoints(Checkpoints):
    """Checkpoints in a local (or shared POSIX) directory.

    A sharded state is written here by every process for its own shards: the directory must be one
    every host of the job reaches (a shared filesystem; on one machine, any directory).
    """

    sharded_saves = True

    def __init__(self, directory: str | os.PathLike[str], clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self.name = "local"
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _marker_path(self, step: int) -> Path:
        return self.directory / _step_name(step) / MARKER

    def _global_dir(self, step: int) -> Path:
        return self.directory / _step_name(step)

    def _listing(self) -> tuple[set[int], set[int]]:
        steps = {
            int(m.group(1)) for p in self.directory.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
        }
        return steps, {s for s in steps if self._marker_path(s).is_file()}

    def _marker_exists(self, step: int) -> bool:
        return self._marker_path(step).exists()

    def _read_marker(self, step: int) -> bytes | None:
        try:
            return self._marker_path(step).read_bytes()
        except FileNotFoundError:
            return None

    def _writing(self) -> contextlib.AbstractContextManager[None]:
        # One local writer at a time: between a writer's "no marker yet" and its removal of the
        # step's leftovers, no other writer may commit that step.
        return _flocked(self.directory / ".WRITER.lock")

    def _raise_fence(self, epoch: int) -> None:
        path = self.directory / FENCE
        with _flocked(self.directory / f".{FENCE}.lock"):
            current = _decode_fence(path.read_bytes()) if path.exists() else None
            if _must_raise_fence(current, epoch):
                _write_atomically(path, _encode_fence(epoch))

    def _staging_dir(self, step: int) -> Path:
        staged = self.directory / _step_name(step)
        if staged.exists():  # no marker (checked under the writer lock): a dead writer's leftovers
            log.info("replacing an incomplete checkpoint", step=step, source=self.name)
            shutil.rmtree(staged)
        staged.mkdir()
        return staged

    def _publish(self, step: int, staged: Path, files: Mapping[str, tuple[int, str]]) -> None:
        pass  # Orbax wrote in place and synced its files

    def _create_marker(self, step: int, data: bytes) -> None:
        # Written whole under a temporary name, then hard-linked: the link fails if the marker
        # exists (like O_EXCL), and no reader ever sees a half-written marker.
        marker = self._marker_path(step)
        temporary = marker.with_name(f".{MARKER}.{os.getpid()}.tmp")
        _write_synced(temporary, data)
        try:
            os.link(temporary, marker)
        except FileExistsError:
            raise AlreadyCommitted(f"step {step} is committed in {self.name} already") from None
        finally:
            temporary.unlink()
        _sync_dir(marker.parent)

    def _committed(self, step: int, staged: Path) -> None:
        pass

    def _fetch(self, marker: _Marker) -> Path:
        step_dir = self.directory / _step_name(marker.step)
        bad = _mismatches(step_dir, marker.files)
        if bad:
            raise _Corrupt(f"{len(bad)} file(s) differ from the marker, e.g. {bad[0]}")
        return step_dir


class GcsCheckpoints(Checkpoints):
    """Checkpoints in a GCS bucket under ``prefix``, written through a local staging directory.

    Orbax writes into ``staging_dir`` (private to this object); the files are uploaded with
    threads, then the marker is created with ``if_generation_match=0``. Restore downloads into
    ``staging_dir`` and checks every file against the marker before Orbax reads it.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str,
        client: storage.Client,
        staging_dir: str | os.PathLike[str],
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(clock)
        self.name = "gcs"
        self.bucket = client.bucket(bucket)
        self.prefix = prefix.strip("/")
        self.staging_dir = Path(staging_dir)

    def _object(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    # ---- sharded state: every host writes its own shards straight to the bucket (Orbax) --------
    # The marker lists each object's size and CRC32C (from the listing: no byte is read back), and a
    # restore checks them the same way, then every process reads only its own shards from GCS.

    sharded_saves = True

    def _global_dir(self, step: int) -> Any:
        from etils import epath  # type: ignore[import-untyped]  # Orbax's path type; no stubs

        return epath.Path(f"gs://{self.bucket.name}/{self._object(_step_name(step))}")

    def _blobs(self, step: int) -> dict[str, Any]:
        root = self._object(f"{_step_name(step)}/")
        return {
            blob.name[len(root) :]: blob
            for blob in self.bucket.client.list_blobs(self.bucket, prefix=root)
            if not blob.name.endswith("/")
        }

    def prepare_global(self, step: int, epoch: int) -> bool:
        if not super().prepare_global(step, epoch):
            return False
        for blob in self._blobs(step).values():  # an incomplete step of a dead writer
            blob.delete()
        return True

    def _global_manifest(self, step: int) -> dict[str, tuple[int, str]]:
        return {
            rel: (int(blob.size), f"{_CRC32C}{blob.crc32c}")
            for rel, blob in self._blobs(step).items()
            if rel.startswith(f"{STATE}/")
        }

    def _marker_object(self, step: int) -> str:
        return self._object(f"{_step_name(step)}/{MARKER}")

    def _listing(self) -> tuple[set[int], set[int]]:
        # One listing of every object: fake-gcs-server ignores match_glob, and a job keeps a
        # handful of steps of a dozen files each.
        root = self._object("")
        steps: set[int] = set()
        marked: set[int] = set()
        for blob in self.bucket.client.list_blobs(self.bucket, prefix=root):
            head, _, rest = blob.name[len(root) :].partition("/")
            if m := _STEP_DIR.match(head):
                steps.add(int(m.group(1)))
                if rest == MARKER:
                    marked.add(int(m.group(1)))
        return steps, marked

    def _marker_exists(self, step: int) -> bool:
        return bool(self.bucket.blob(self._marker_object(step)).exists())

    def _read_marker(self, step: int) -> bytes | None:
        from google.api_core import exceptions as gexc

        try:
            return bytes(self.bucket.blob(self._marker_object(step)).download_as_bytes())
        except gexc.NotFound:
            return None

    def _raise_fence(self, epoch: int) -> None:
        from google.api_core import exceptions as gexc

        name = self._object(FENCE)
        for _ in range(_FENCE_ATTEMPTS):
            blob = self.bucket.blob(name)
            try:
                current: int | None = _decode_fence(blob.download_as_bytes())
                generation = int(blob.generation)
            except gexc.NotFound:
                current, generation = None, 0  # generation 0: "create only if absent"
            if not _must_raise_fence(current, epoch):
                return
            try:
                self.bucket.blob(name).upload_from_string(
                    _encode_fence(epoch), content_type="application/json", if_generation_match=generation
                )
                return
            except gexc.PreconditionFailed:
                continue  # another writer moved the fence between our read and write: read again
        raise CheckpointError(f"epoch fence {name} still contended after {_FENCE_ATTEMPTS} attempts")

    def _staging_dir(self, step: int) -> Path:
        staged = self.staging_dir / "save" / _step_name(step)
        shutil.rmtree(staged.parent, ignore_errors=True)
        staged.mkdir(parents=True)
        return staged

    def _publish(self, step: int, staged: Path, files: Mapping[str, tuple[int, str]]) -> None:
        from google.cloud.storage import transfer_manager

        # Objects of an incomplete step from a crashed writer are overwritten here; any it had
        # that this step lacks are never read (restore reads only what the marker lists).
        transfer_manager.upload_many_from_filenames(
            self.bucket,
            sorted(files),
            source_directory=str(staged),
            blob_name_prefix=self._object(f"{_step_name(step)}/"),
            worker_type=transfer_manager.THREAD,
            max_workers=_TRANSFER_WORKERS,
            raise_exception=True,
        )

    def _create_marker(self, step: int, data: bytes) -> None:
        from google.api_core import exceptions as gexc

        try:
            self.bucket.blob(self._marker_object(step)).upload_from_string(
                data, content_type="application/json", if_generation_match=0
            )
        except gexc.PreconditionFailed:
            # A retried request whose first attempt landed reads back our own marker: committed.
            if self._read_marker(step) != data:
                raise AlreadyCommitted(f"step {step} is committed in {self.name} already") from None

    def _committed(self, step: int, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def _fetch(self, marker: _Marker) -> Path:
        from google.api_core import exceptions as gexc
        from google.cloud.storage import transfer_manager
        from google.cloud.storage.exceptions import DataCorruption

        if all(digest.startswith(_CRC32C) for _, digest in marker.files.values()):
            # A sharded state: checked in place (sizes and CRC32C of the listing), read from GCS.
            listed = self._global_manifest(marker.step)
            bad = [rel for rel, entry in marker.files.items() if listed.get(rel) != entry]
            if bad:
                raise _Corrupt(f"{len(bad)} object(s) differ from the marker, e.g. {bad[0]}")
            return self._global_dir(marker.step)

        local = self.staging_dir / "restore" / _step_name(marker.step)
        for other in local.parent.glob("step_*"):  # keep one downloaded step at most
            if other != local:
                shutil.rmtree(other, ignore_errors=True)
        missing = _mismatches(local, marker.files)  # files a previous call verified are kept
        if missing:
            try:
                transfer_manager.download_many_to_path(
                    self.bucket,
                    missing,
                    destination_directory=str(local),
                    blob_name_prefix=self._object(f"{_step_name(marker.step)}/"),
                    worker_type=transfer_manager.THREAD,
                    max_workers=_TRANSFER_WORKERS,
                    raise_exception=True,
                )
            except (gexc.NotFound, DataCorruption) as exc:
                raise _Corrupt(f"download failed: {exc}") from exc
        bad = _mismatches(local, marker.files)
        if bad:
            raise _Corrupt(f"{len(bad)} file(s) differ from the marker, e.g. {bad[0]}")
        return local


@contextlib.contextmanager
def _flocked(path: Path) -> Iterator[None]:
    """An exclusive fcntl lock on ``path``, shared with other processes; released on exit."""
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _write_synced(temporary, data)
    os.replace(temporary, path)
    _sync_dir(path.parent)

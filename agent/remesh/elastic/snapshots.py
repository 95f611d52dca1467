"""Host-memory snapshots of this process's own pieces of the training state: the fastest tier.

A snapshot is what this process's devices held after a step: one piece per distinct shard of each
leaf (``exchange.Pieces``: (leaf, cell) -> values), tagged with the epoch whose mesh laid them out.
A replicated leaf is one piece covering all of it. Two copies of the last few steps: in the process
(survivors of an in-process recovery restore from it, and serve it to peers) and in ``/dev/shm`` (a
tmpfs, so still host memory, which survives the trainer process: a trainer the agent restarts after
a JAX abort restores from it).

A snapshot file is a JSON header (every piece's dtype by name, ``remesh.elastic.dtypes``) and the
raw bytes of every piece, whatever its dtype; reading one maps it into memory, so learning what a
restarted process holds costs nothing until a piece is used. A file that is not whole (truncated,
or not ours) is reported and skipped: the restore falls back to the next tier, it never fails on it.

A snapshot that cannot be written to its directory (the directory full or gone) is kept in the
process only, and that is an error the user sees: logged as one, and reported to ``on_not_kept``
(the session counts it and records an event). A file half written is deleted before the error goes
on: ``/dev/shm`` is memory, and a stray temporary file would hold it for as long as the host runs.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import shutil
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import structlog

from remesh.elastic.cells import decode_key, encode_key, volume
from remesh.elastic.dtypes import as_bytes, dtype_name, dtype_of
from remesh.elastic.exchange import Pieces
from remesh.v1.contract import SNAPSHOT_OWNER_FILE

__all__ = [
    "HOST_SHM",
    "NotKept",
    "Snapshot",
    "Snapshots",
    "claim",
    "fits",
    "hold_alone",
    "read_pieces",
    "release",
    "write_pieces",
]

log = structlog.get_logger("remesh.elastic")

_MAGIC = b"remesh-snapshot-1\n"
_SUFFIX = ".snap"
# A snapshot file being written: renamed to its final name once whole.
_TEMPORARY = f"{_SUFFIX}.tmp"
_ALIGN = 64
_HEADER_MAX = 64 << 20
# Retired snapshot files kept to be written over.
_SPARES = 2


# In a host's snapshot directory: the agent process whose trainers wrote what it holds.
_OWNER = SNAPSHOT_OWNER_FILE
# In the snapshot directory of a job run alone (no agent): locked by the process that runs it.
_ALONE = "ALONE"


def claim(directory: Path, owner: str) -> None:
    """Make ``directory`` (a host's ``/dev/shm`` snapshots of one job) the snapshots of agent process
    ``owner``'s trainers. What another agent's trainers left there was written before this agent
    started (an earlier run of the same job id on this host, perhaps one rolled back since): it is
    no state of this run, and would be offered as one; it is deleted. The active trainer and the
    warm standby of one agent share what they find."""
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / _OWNER
    try:
        found: str | None = marker.read_text()
    except FileNotFoundError:
        found = None
    if found == owner:
        return
    stale = [p for p in directory.iterdir() if p.name not in (_OWNER, _ALONE)]
    if stale:
        log.info(
            "host-memory snapshots of an earlier agent deleted",
            directory=str(directory),
            files=len(stale),
            owner=found,
        )
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    tmp = directory / f".{_OWNER}.{uuid.uuid4().hex}"
    tmp.write_text(owner)
    os.replace(tmp, marker)


def hold_alone(directory: Path) -> int:
    """Lock ``directory`` for this process, which runs its job alone (no agent, so no agent session
    to tell its snapshots from another run's): a second run of the same job id on this host at the
    same time would otherwise delete this one's snapshots, or restore them as its own. Returns the
    descriptor holding the lock (it goes with the process, however that ends; ``os.close`` lets it
    go sooner). RuntimeError, saying what to do, where another live process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / _ALONE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"another process runs this job alone on this host (its snapshots are in {directory}): "
            "give this run another job id (Session(job_id=...) or REMESH_JOB), or stop the other"
        ) from None
    except OSError:
        os.close(fd)
        raise
    return fd


def release(directory: Path) -> None:
    """Delete ``directory`` and every snapshot in it: the job finished, and nothing restores from
    host memory any more (tmpfs is RAM: a host's snapshots would otherwise outlive the job)."""
    shutil.rmtree(directory, ignore_errors=True)


class Snapshot:
    """The pieces of one step, the epoch whose mesh laid them out, where they were found, and the
    input position kept with them (``DataPosition`` as JSON text; None: none was)."""

    __slots__ = ("data", "layout", "pieces", "step", "tier")

    def __init__(self, step: int, layout: int, pieces: Pieces, tier: str, data: str | None = None) -> None:
        self.step, self.layout, self.pieces, self.tier, self.data = step, layout, pieces, tier, data


# The tier of a snapshot read from, or meant for, a snapshot directory (as ``Snapshot.tier`` says).
HOST_SHM = "host-shm"
# Called as (step, tier, error) when a snapshot could not be kept in that tier.
NotKept = Callable[[int, str, str], None]


class Snapshots:
    """The last ``keep`` snapshots of one process: in memory, and in ``directory`` where given.

    ``on_not_kept(step, tier, error)``: told of every snapshot that could not be written to
    ``directory`` (tier ``"host-shm"``); it is kept in the process all the same."""

    def __init__(
        self, keep: int, directory: str | os.PathLike[str] | None, on_not_kept: NotKept | None = None
    ) -> None:
        self.keep = keep
        self.directory = None if directory is None else Path(directory)
        self.on_not_kept = on_not_kept
        # step -> (layout, pieces, input position as JSON text or None)
        self._memory: collections.OrderedDict[int, tuple[int, Pieces, str | None]] = collections.OrderedDict()
        # Steps a peer copied (its buddy copy of ours): kept past the window until newer ones are.
        self._pinned: collections.deque[int] = collections.deque(maxlen=2)
        self._lock = threading.Lock()
        # The mapping of every file this process mapped, by inode: alive while any piece of it is
        # (a snapshot held, a peer being served, a restore under way). Only a file whose mapping is
        # gone is written over.
        self._maps: dict[int, weakref.ref[np.ndarray]] = {}
        # Temporary files this object is writing now: any other one in the directory is a stray
        # (a write cut short by a kill) that ``clear`` and ``drop_after`` delete.
        self._writing: set[Path] = set()
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def put(self, step: int, layout: int, pieces: Pieces, data: str | None = None) -> Pieces:
        """Keep ``pieces`` (and ``data``, the input position after the step, where given) as the
        snapshot of ``step``; returns what is kept. With a directory the
        pieces are written to a file there and what is kept in memory is that file, mapped: one
        copy of the bytes in all, and ``pieces`` may be views the caller does not own (a device
        buffer's). Without one, ``pieces`` themselves: the caller hands over pieces it owns. Where
        the file cannot be written, a copy of ``pieces``, and ``on_not_kept`` is told."""
        if self.keep <= 0:
            return pieces
        kept = pieces
        failed: str | None = None
        if self.directory is not None:
            # In /dev/shm, so that a trainer process the agent restarts finds it too. Written whole
            # under a temporary name first: a restore never reads half a snapshot.
            try:
                kept = self._map(self._write(step, layout, pieces, data))[1]
            except Exception as exc:  # whatever it was, the snapshot is not where it was meant to be
                failed = f"{type(exc).__name__}: {exc}"
                log.error(
                    "snapshot not written to its directory: kept in this process only, so a trainer "
                    "the agent restarts will not find it; check that the directory exists, is "
                    "writable and has free space (df -h on it; /dev/shm is sized by the host's RAM)",
                    step=step,
                    tier=HOST_SHM,
                    directory=str(self.directory),
                    error=failed,
                )
                kept = {key: np.array(values, copy=True) for key, values in pieces.items()}
        with self._lock:
            self._memory[step] = (layout, kept, data)
            self._memory.move_to_end(step)
            self._trim()
        if failed is not None and self.on_not_kept is not None:
            self.on_not_kept(step, HOST_SHM, failed)
        return kept

    def pin(self, step: int) -> None:
        """A peer holds a copy of this step's pieces: keep it until two newer steps are pinned."""
        with self._lock:
            if step in self._memory and step not in self._pinned:
                self._pinned.append(step)
                self._trim()

    def _trim(self) -> None:
        newest = sorted(self._memory)[-self.keep :]
        for step in list(self._memory):
            if step not in newest and step not in self._pinned:
                del self._memory[step]

    def held(self, step: int, layout: int) -> Pieces:
        """The in-memory pieces of (step, layout), for peers; empty if not held."""
        with self._lock:
            found = self._memory.get(step)
        return found[1] if found is not None and found[0] == layout else {}

    def _write(self, step: int, layout: int, pieces: Pieces, data: str | None = None) -> Path:
        """One file per step: a JSON header (restore point, and dtype, shape and offset of every
        piece), then the raw bytes of each piece; written whole under a temporary name, then renamed."""
        assert self.directory is not None
        where = _layout(step, layout, pieces, data)
        tmp = self.directory / f".step_{step:010d}{_TEMPORARY}"
        final = self.directory / f"step_{step:010d}{_SUFFIX}"
        with self._lock:
            self._writing.add(tmp)
        try:
            with _removed_if_failed(tmp):
                # Written over a retired file of the same size where one is free: its pages are
                # allocated already (a new file of tens of megabytes in tmpfs costs three times the
                # copy, in faults).
                spare = self._take_spare(where.size)
                if spare is not None:
                    os.replace(spare, tmp)
                with open(tmp, "r+b" if spare is not None else "wb") as f:
                    _dump(f, where, pieces)
                os.replace(tmp, final)
        finally:
            with self._lock:
                self._writing.discard(tmp)
        # Keep the steps held in memory (the newest, and those a buddy copied); any "newer" ones
        # left by an abandoned timeline (a run that went further before restoring an older step) go.
        # A file still mapped by a snapshot dropped meanwhile stays readable until it is let go.
        with self._lock:
            newest = sorted({*self._memory, step})[-self.keep :]
            keep = set(newest) | set(self._pinned)
        for path in self.directory.glob(f"step_*{_SUFFIX}"):
            if _step_of(path) not in keep:
                self._retire(path)
        return final

    def _retire(self, path: Path) -> None:
        """A snapshot file no longer kept: a spare to write the next one over (two at most)."""
        assert self.directory is not None
        spares = sorted(self.directory.glob(f".spare_*{_SUFFIX}"))
        if len(spares) >= _SPARES:
            path.unlink(missing_ok=True)
            return
        names = {p.name for p in spares}
        name = next(f".spare_{i}{_SUFFIX}" for i in range(_SPARES + 1) if f".spare_{i}{_SUFFIX}" not in names)
        with contextlib.suppress(FileNotFoundError):
            os.replace(path, self.directory / name)

    def _take_spare(self, size: int) -> Path | None:
        """A spare file of ``size`` bytes that nothing maps any more, if there is one."""
        assert self.directory is not None
        for spare in sorted(self.directory.glob(f".spare_*{_SUFFIX}")):
            try:
                info = spare.stat()
            except FileNotFoundError:
                continue
            mapped = self._maps.get(info.st_ino)
            if info.st_size == size and (mapped is None or mapped() is None):
                self._maps.pop(info.st_ino, None)
                return spare
        return None

    def _map(self, path: Path) -> tuple[int, Pieces, str | None]:
        """``_read``, remembering the mapping so that the file is not written over while in use."""
        layout, pieces, mapped, data = _read(path)
        if mapped is not None:
            ino = os.stat(path).st_ino
            with self._lock:
                self._maps = {k: r for k, r in self._maps.items() if r() is not None}
                self._maps[ino] = weakref.ref(mapped)
        return layout, pieces, data

    def clear(self) -> None:
        """Forget every snapshot: the run restarted its timeline from a checkpoint or from scratch."""
        with self._lock:
            self._memory.clear()
            self._pinned.clear()
        if self.directory is not None:
            for path in [
                *self.directory.glob(f"step_*{_SUFFIX}"),
                *self.directory.glob(f".spare_*{_SUFFIX}"),
            ]:
                path.unlink(missing_ok=True)
            self._remove_strays()

    def let_go(self) -> None:
        """Drop every snapshot held in the process (and so its file's mapping: a file deleted since
        gives its memory back once nothing maps it). The files stay, for a process that comes next."""
        with self._lock:
            self._memory.clear()
            self._pinned.clear()
            self._maps.clear()

    def drop_after(self, step: int) -> None:
        """Forget steps past ``step``: the job restored ``step`` and abandoned what came after."""
        with self._lock:
            for s in [s for s in self._memory if s > step]:
                del self._memory[s]
        if self.directory is not None:
            for path in self.directory.glob(f"step_*{_SUFFIX}"):
                if _step_of(path) > step:
                    path.unlink(missing_ok=True)
            self._remove_strays()

    def _remove_strays(self) -> None:
        """Delete the temporary files in the directory that this object is not writing: writes cut
        short by a kill (a failed write deletes its own)."""
        assert self.directory is not None
        with self._lock:
            writing = set(self._writing)
        for path in self.directory.glob(f".step_*{_TEMPORARY}"):
            if path not in writing:
                path.unlink(missing_ok=True)

    def steps(self) -> list[int]:
        found = set(self._memory)
        if self.directory is not None:
            found |= {_step_of(p) for p in self.directory.glob(f"step_*{_SUFFIX}")}
        return sorted(found)

    def all(self, shapes: Sequence[tuple[tuple[int, ...], Any]]) -> list[Snapshot]:
        """Every snapshot that fits ``shapes`` ((shape, dtype) per leaf), newest first: memory where
        held, else the ``/dev/shm`` file."""
        out = []
        for step in reversed(self.steps()):
            if (found := self.get(step, shapes)) is not None:
                out.append(found)
        return out

    def get(self, step: int, shapes: Sequence[tuple[tuple[int, ...], Any]]) -> Snapshot | None:
        """The snapshot of ``step``, checked against ``shapes``; None if absent or unusable."""
        with self._lock:
            found = self._memory.get(step)
        if found is not None:
            return Snapshot(step, found[0], found[1], "memory", found[2])
        if self.directory is None:
            return None
        path = self.directory / f"step_{step:010d}{_SUFFIX}"
        if not path.exists():
            return None
        try:
            layout, pieces, data = self._map(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning(
                "host snapshot unreadable; falling back to the next tier",
                step=step,
                path=str(path),
                error=f"{type(exc).__name__}: {exc}",
            )
            return None
        if not fits(pieces, shapes):
            log.warning("host snapshot does not fit this model; ignoring it", step=step, path=str(path))
            return None
        return Snapshot(step, layout, pieces, HOST_SHM, data)


def write_pieces(path: Path, step: int, layout: int, pieces: Pieces) -> int:
    """``pieces`` in the snapshot file format at ``path``, synced to its disk: written under a
    temporary name, then renamed (a reader never finds half a file). Returns its size in bytes.
    Each write of a piece's bytes releases the interpreter lock."""
    where = _layout(step, layout, pieces)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _removed_if_failed(tmp):
        with open(tmp, "wb") as f:
            _dump(f, where, pieces)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return where.size


@contextlib.contextmanager
def _removed_if_failed(tmp: Path) -> Iterator[None]:
    """Delete ``tmp`` if the block raises (then the error goes on): a file half written is never
    left behind, whatever stopped it (a full disk, a piece that cannot be written, an interrupt)."""
    try:
        yield
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_pieces(path: Path) -> tuple[int, Pieces]:
    """The layout and pieces of a file ``write_pieces`` (or a snapshot) wrote, mapped into memory:
    a piece's bytes are read when used. ValueError if it is not whole."""
    layout, pieces, _, _ = _read(path)
    return layout, pieces


class _Layout(NamedTuple):
    """Where everything of a file goes: its header (magic, length, JSON: restore point, and dtype,
    shape and offset of every piece) padded to where the pieces start, each piece's offset in the
    file, and the file's size."""

    head: bytes
    offsets: list[int]
    size: int


def _layout(step: int, layout: int, pieces: Pieces, data: str | None = None) -> _Layout:
    entries: list[list[Any]] = []
    offset = 0
    for key, values in pieces.items():
        offset = -(-offset // _ALIGN) * _ALIGN
        entries.append([encode_key(key), dtype_name(values.dtype), list(values.shape), offset, values.nbytes])
        offset += values.nbytes
    described: dict[str, Any] = {"step": step, "layout": layout, "pieces": entries, "size": offset}
    if data is not None:
        described["data"] = data
    header = json.dumps(described).encode()
    head = _MAGIC + len(header).to_bytes(8, "little") + header
    start = -(-len(head) // _ALIGN) * _ALIGN
    return _Layout(head.ljust(start, b"\0"), [start + e[3] for e in entries], start + offset)


def _dump(f: Any, where: _Layout, pieces: Pieces) -> None:
    """Write a file ``_layout`` described: the header, then each piece at its offset."""
    f.write(where.head)
    for at, values in zip(where.offsets, pieces.values(), strict=True):
        f.seek(at)
        f.write(as_bytes(values))
    f.truncate(where.size)


def fits(pieces: Pieces, shapes: Sequence[tuple[tuple[int, ...], Any]]) -> bool:
    """Whether every piece lies inside its leaf of ``shapes`` ((shape, dtype) per leaf; a dtype, a
    scalar type, or a name ``dtype_of`` knows), holds that leaf's dtype and fills its cell. A leaf
    with no elements has empty cells."""
    for (leaf, cell), values in pieces.items():
        if not 0 <= leaf < len(shapes):
            return False
        shape, dtype = shapes[leaf]
        inside = len(cell) == len(shape) and all(
            0 <= a <= b <= n for (a, b), n in zip(cell, shape, strict=True)
        )
        if not inside:
            return False
        if values.dtype != _as_dtype(dtype) or values.size != volume(cell):
            return False
    return True


def _as_dtype(dtype: Any) -> np.dtype[Any]:
    return dtype_of(dtype) if isinstance(dtype, str) else np.dtype(dtype)


def _read(path: Path) -> tuple[int, Pieces, np.ndarray | None, str | None]:
    """The layout and pieces of a snapshot file, as read-only views of it mapped into memory (no
    byte is read until used), the mapping they are views of (None: an empty file), and the input
    position kept with them (None: none). ValueError if the file is not a whole snapshot."""
    with open(path, "rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise ValueError("not a remesh snapshot")
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= _HEADER_MAX:
            raise ValueError(f"header length {length} is out of range")
        header = json.loads(f.read(length))
    start = -(-(len(_MAGIC) + 8 + length) // _ALIGN) * _ALIGN
    size = path.stat().st_size
    if size != start + int(header["size"]):
        raise ValueError(f"truncated: {size} bytes, the header describes {start + int(header['size'])}")
    mapped = np.memmap(path, dtype=np.uint8, mode="r") if header["size"] else None
    pieces: Pieces = {}
    for raw_key, dtype, shape, at, nbytes in header["pieces"]:
        flat = (
            mapped[start + at : start + at + nbytes]
            if nbytes and mapped is not None
            else np.zeros(0, np.uint8)
        )
        pieces[decode_key(raw_key)] = flat.view(dtype_of(dtype)).reshape(shape)
    data = header.get("data")
    return int(header["layout"]), pieces, mapped, None if data is None else str(data)


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_").removesuffix(_SUFFIX))

"""Host-memory snapshots of this process's own pieces of the training state: the fastest tier.

A snapshot is what this process's devices held after a step: one piece per distinct shard of each
leaf (``exchange.Pieces``: (leaf, cell) -> values), tagged with the epoch whose mesh laid them out.
A replicated leaf is one piece covering all of it. Two copies of the last few steps: in the process
(survivors of an in-process recovery restore from it, and serve it to peers) and in ``/dev/shm`` (a
tmpfs, so still host memory, which survives the trainer process: a trainer the agent restarts after
a JAX abort restores from it).

A snapshot file is a JSON header and the raw bytes of every piece; reading one maps it into memory,
so learning what a restarted process holds costs nothing until a piece is used. A file that is not
whole (truncated, or not ours) is reported and skipped: the restore falls back to the next tier, it
never fails on it.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from remesh.elastic.exchange import Pieces, decode_key, encode_key
from remesh.elastic.sharding import volume

__all__ = ["Snapshot", "Snapshots"]

log = structlog.get_logger("remesh.elastic")

_MAGIC = b"remesh-snapshot-1\n"
_SUFFIX = ".snap"
_ALIGN = 64
_HEADER_MAX = 64 << 20


class Snapshot:
    """The pieces of one step, the epoch whose mesh laid them out, and where they were found."""

    __slots__ = ("layout", "pieces", "step", "tier")

    def __init__(self, step: int, layout: int, pieces: Pieces, tier: str) -> None:
        self.step, self.layout, self.pieces, self.tier = step, layout, pieces, tier


class Snapshots:
    def __init__(self, keep: int, directory: Path | None) -> None:
        self.keep = keep
        self.directory = directory
        self._memory: collections.OrderedDict[int, tuple[int, Pieces]] = collections.OrderedDict()
        # Steps a peer copied (its buddy copy of ours): kept past the window until newer ones are.
        self._pinned: collections.deque[int] = collections.deque(maxlen=2)
        self._lock = threading.Lock()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def put(self, step: int, layout: int, pieces: Pieces) -> None:
        if self.keep <= 0:
            return
        with self._lock:
            self._memory[step] = (layout, pieces)
            self._memory.move_to_end(step)
            self._trim()
        if self.directory is not None:
            # Written before the step is reported as done: the coordinator picks the restore step from
            # reported steps, so a reported step must be restorable even if this process dies next.
            self._write(step, layout, pieces)

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

    def _write(self, step: int, layout: int, pieces: Pieces) -> None:
        """One file per step: a JSON header (restore point, and dtype, shape and offset of every
        piece), then the raw bytes of each piece; written whole under a temporary name, then renamed."""
        assert self.directory is not None
        entries: list[list[Any]] = []
        offsets: list[int] = []
        offset = 0
        for key, values in pieces.items():
            offset = -(-offset // _ALIGN) * _ALIGN
            entries.append([encode_key(key), values.dtype.str, list(values.shape), offset, values.nbytes])
            offsets.append(offset)
            offset += values.nbytes
        header = json.dumps({"step": step, "layout": layout, "pieces": entries, "size": offset}).encode()
        start = -(-(len(_MAGIC) + 8 + len(header)) // _ALIGN) * _ALIGN
        tmp = self.directory / f".step_{step:010d}{_SUFFIX}.tmp"
        with open(tmp, "wb") as f:
            f.write(_MAGIC + len(header).to_bytes(8, "little") + header)
            for at, values in zip(offsets, pieces.values(), strict=True):
                f.seek(start + at)
                f.write(np.require(values, requirements="C").data.cast("B"))
            f.truncate(start + offset)
        os.replace(tmp, self.directory / f"step_{step:010d}{_SUFFIX}")
        # Keep the steps held in memory (the newest, and those a buddy copied); any "newer" ones
        # left by an abandoned timeline (a run that went further before restoring an older step) go.
        with self._lock:
            keep = set(self._memory) | {step}
        for path in self.directory.glob(f"step_*{_SUFFIX}"):
            if _step_of(path) not in keep:
                path.unlink(missing_ok=True)

    def clear(self) -> None:
        """Forget every snapshot: the run restarted its timeline from a checkpoint or from scratch."""
        with self._lock:
            self._memory.clear()
            self._pinned.clear()
        if self.directory is not None:
            for path in self.directory.glob(f"step_*{_SUFFIX}"):
                path.unlink(missing_ok=True)

    def drop_after(self, step: int) -> None:
        """Forget steps past ``step``: the job restored ``step`` and abandoned what came after."""
        with self._lock:
            for s in [s for s in self._memory if s > step]:
                del self._memory[s]
        if self.directory is not None:
            for path in self.directory.glob(f"step_*{_SUFFIX}"):
                if _step_of(path) > step:
                    path.unlink(missing_ok=True)

    def steps(self) -> list[int]:
        found = set(self._memory)
        if self.directory is not None:
            found |= {_step_of(p) for p in self.directory.glob(f"step_*{_SUFFIX}")}
        return sorted(found)

    def all(self, max_step: int, shapes: Sequence[tuple[tuple[int, ...], Any]]) -> list[Snapshot]:
        """Every snapshot at or below ``max_step`` that fits ``shapes`` ((shape, dtype) per leaf),
        newest first: memory where held, else the ``/dev/shm`` file."""
        out = []
        for step in reversed(self.steps()):
            if step <= max_step and (found := self.get(step, shapes)) is not None:
                out.append(found)
        return out

    def get(self, step: int, shapes: Sequence[tuple[tuple[int, ...], Any]]) -> Snapshot | None:
        """The snapshot of ``step``, checked against ``shapes``; None if absent or unusable."""
        with self._lock:
            found = self._memory.get(step)
        if found is not None:
            return Snapshot(step, found[0], found[1], "memory")
        if self.directory is None:
            return None
        path = self.directory / f"step_{step:010d}{_SUFFIX}"
        if not path.exists():
            return None
        try:
            layout, pieces = _read(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning(
                "host snapshot unreadable; falling back to the next tier",
                step=step,
                path=str(path),
                error=f"{type(exc).__name__}: {exc}",
            )
            return None
        if not _fits(pieces, shapes):
            log.warning("host snapshot does not fit this model; ignoring it", step=step, path=str(path))
            return None
        return Snapshot(step, layout, pieces, "host-shm")


def _fits(pieces: Pieces, shapes: Sequence[tuple[tuple[int, ...], Any]]) -> bool:
    for (leaf, cell), values in pieces.items():
        if not 0 <= leaf < len(shapes):
            return False
        shape, dtype = shapes[leaf]
        if len(cell) != len(shape) or any(not 0 <= a < b <= n for (a, b), n in zip(cell, shape, strict=True)):
            return False
        if values.dtype != np.dtype(dtype) or values.size != volume(cell):
            return False
    return True


def _read(path: Path) -> tuple[int, Pieces]:
    """The layout and pieces of a snapshot file, as read-only views of it mapped into memory (no
    byte is read until used). ValueError if the file is not a whole snapshot."""
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
    mapped = np.memmap(path, dtype=np.uint8, mode="r") if header["size"] else np.zeros(0, np.uint8)
    pieces: Pieces = {}
    for raw_key, dtype, shape, at, nbytes in header["pieces"]:
        flat = mapped[start + at : start + at + nbytes] if nbytes else np.zeros(0, np.uint8)
        pieces[decode_key(raw_key)] = flat.view(np.dtype(dtype)).reshape(shape)
    return int(header["layout"]), pieces


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_").removesuffix(_SUFFIX))

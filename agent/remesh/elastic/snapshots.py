"""Host-memory snapshots of this process's own pieces of the training state: the fastest tier.

A snapshot is what this process's devices held after a step: one piece per distinct shard of each
leaf (``exchange.Pieces``: (leaf, cell) -> values), tagged with the epoch whose mesh laid them out.
A replicated leaf is one piece covering all of it. Two copies of the last few steps: in the process
(survivors of an in-process recovery restore from it, and serve it to peers) and in ``/dev/shm`` (a
tmpfs, so still host memory, which survives the trainer process: a trainer the agent restarts after
a JAX abort restores from it).

A snapshot file that cannot be read whole (truncated, or not ours) is reported and skipped: the
restore falls back to the next tier, it never fails on it.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from remesh.elastic.exchange import Pieces, decode_key, encode_key
from remesh.elastic.sharding import volume

__all__ = ["Snapshot", "Snapshots"]

log = structlog.get_logger("remesh.elastic")

_META = "meta"


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
        assert self.directory is not None
        keys = list(pieces)
        arrays = {f"a{i}": pieces[k] for i, k in enumerate(keys)}
        meta = json.dumps({"step": step, "layout": layout, "keys": [encode_key(k) for k in keys]})
        tmp = self.directory / f".step_{step:010d}.npz.tmp"
        with open(tmp, "wb") as f:
            arrays[_META] = np.frombuffer(meta.encode(), dtype=np.uint8)
            _savez(f, arrays)
        os.replace(tmp, self.directory / f"step_{step:010d}.npz")
        # Keep exactly the window that ends here: older steps, and any "newer" ones left by an
        # abandoned timeline (a run that went further before restoring an older step), go.
        for path in self.directory.glob("step_*.npz"):
            if not step - self.keep < _step_of(path) <= step:
                path.unlink(missing_ok=True)

    def clear(self) -> None:
        """Forget every snapshot: the run restarted its timeline from a checkpoint or from scratch."""
        with self._lock:
            self._memory.clear()
            self._pinned.clear()
        if self.directory is not None:
            for path in self.directory.glob("step_*.npz"):
                path.unlink(missing_ok=True)

    def drop_after(self, step: int) -> None:
        """Forget steps past ``step``: the job restored ``step`` and abandoned what came after."""
        with self._lock:
            for s in [s for s in self._memory if s > step]:
                del self._memory[s]
        if self.directory is not None:
            for path in self.directory.glob("step_*.npz"):
                if _step_of(path) > step:
                    path.unlink(missing_ok=True)

    def steps(self) -> list[int]:
        found = set(self._memory)
        if self.directory is not None:
            found |= {_step_of(p) for p in self.directory.glob("step_*.npz")}
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
        path = self.directory / f"step_{step:010d}.npz"
        if not path.exists():
            return None
        try:
            with np.load(path) as data:
                meta = json.loads(bytes(data[_META]).decode())
                keys = [decode_key(k) for k in meta["keys"]]
                pieces = {k: data[f"a{i}"] for i, k in enumerate(keys)}
                layout = int(meta["layout"])
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
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


def _savez(f: Any, arrays: dict[str, np.ndarray]) -> None:
    np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as its bool flag


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_").removesuffix(".npz"))

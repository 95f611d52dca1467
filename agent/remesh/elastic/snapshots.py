"""Host-memory snapshots of the replicated training state: the fastest restore tier.

Two copies of the last few steps: in the process (survivors of an in-process recovery restore from
it without touching storage) and in ``/dev/shm`` (a tmpfs, so still host memory, which survives the
trainer process: a trainer the agent restarts after a JAX abort restores from it). Each snapshot is a
flat list of numpy arrays; the tree structure comes from the caller's template.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import structlog

__all__ = ["Snapshots"]

log = structlog.get_logger("remesh.elastic")

PyTree = Any


class Snapshots:
    def __init__(self, keep: int, directory: Path | None) -> None:
        self.keep = keep
        self.directory = directory
        self._memory: collections.OrderedDict[int, list[np.ndarray]] = collections.OrderedDict()
        self._lock = threading.Lock()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def put(self, step: int, leaves: list[np.ndarray]) -> None:
        with self._lock:
            self._memory[step] = leaves
            while len(self._memory) > self.keep:
                self._memory.popitem(last=False)
        if self.directory is not None:
            # Written before the step is reported as done: the coordinator picks the restore step from
            # reported steps, so a reported step must be restorable even if this process dies next.
            # (tmpfs: a few milliseconds for a small model.)
            self._write(step, leaves)

    def _write(self, step: int, leaves: list[np.ndarray]) -> None:
        assert self.directory is not None
        tmp = self.directory / f".step_{step:010d}.npz.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, *leaves)
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
        if self.directory is not None:
            for path in self.directory.glob("step_*.npz"):
                path.unlink(missing_ok=True)

    def steps(self) -> list[int]:
        found = set(self._memory)
        if self.directory is not None:
            found |= {_step_of(p) for p in self.directory.glob("step_*.npz")}
        return sorted(found)

    def get(self, step: int, template: list[np.ndarray]) -> tuple[list[np.ndarray], str] | None:
        """The snapshot of ``step`` (checked against the template's shapes) and where it came from."""
        with self._lock:
            leaves = self._memory.get(step)
        if leaves is not None:
            return leaves, "memory"
        if self.directory is None:
            return None
        path = self.directory / f"step_{step:010d}.npz"
        if not path.exists():
            return None
        try:
            with np.load(path) as data:
                leaves = [data[f"arr_{i}"] for i in range(len(data.files))]
        except (OSError, ValueError, KeyError) as exc:
            log.warning("host snapshot unreadable; ignoring it", step=step, path=str(path), error=str(exc))
            return None
        if [(a.shape, a.dtype) for a in leaves] != [(t.shape, t.dtype) for t in template]:
            log.warning("host snapshot does not fit this model; ignoring it", step=step, path=str(path))
            return None
        return leaves, "host-shm"


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_").removesuffix(".npz"))

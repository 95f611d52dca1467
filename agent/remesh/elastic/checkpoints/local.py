"""The local tier: a directory on this host, or a shared POSIX filesystem every host mounts."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import structlog

from remesh.elastic.checkpoints._base import (
    _STEP_DIR,
    DIGEST_SUFFIX,
    FENCE,
    MARKER,
    PIECES_SUFFIX,
    STATE,
    Checkpoints,
    _Corrupt,
    _crc32c,
    _decode_fence,
    _encode_fence,
    _Marker,
    _mismatches,
    _must_raise_fence,
    _step_name,
)
from remesh.elastic.errors import AlreadyCommitted
from remesh.elastic.exchange import Pieces
from remesh.elastic.snapshots import write_pieces

log = structlog.get_logger("remesh.elastic.checkpoints")


class LocalCheckpoints(Checkpoints):
    """Checkpoints in a local (or shared POSIX) directory.

    A sharded state is written here by every process for its own shards: the directory must be one
    every host of the job reaches (a shared filesystem; on one machine, any directory).
    """

    sharded_saves = True

    def __init__(
        self,
        directory: str | os.PathLike[str],
        clock: Callable[[], float] = time.time,
        max_to_keep: int | None = 3,
        compress: bool = False,
        pieces: bool = False,
    ) -> None:
        super().__init__(clock, max_to_keep, compress)
        self.name = "local"
        self.directory = Path(directory)
        # A sharded state as one plain file per process (``write_pieces``): a sixth of an Orbax
        # save's CPU, for a frequent tier; readable by remesh only, so off by default (an Orbax
        # checkpoint opens in any Orbax program, onto any mesh). A restore reads either layout.
        self.writes_pieces = pieces
        self.directory.mkdir(parents=True, exist_ok=True)

    # The directory every host reaches tells no digests: each writer tells its own (``write_global``).
    tells_digests = True

    def _marker_path(self, step: int) -> Path:
        return self.directory / _step_name(step) / MARKER

    def _write_told(self, path: Path, data: bytes) -> None:
        _write_atomically(path, data)

    def _global_dir(self, step: int) -> Path:
        return self.directory / _step_name(step)

    def write_pieces(self, step: int, rank: int, layout: int, pieces: Pieces) -> int:
        state = self._global_dir(step) / STATE
        state.mkdir(parents=True, exist_ok=True)
        path = state / f"process_{rank:05d}{PIECES_SUFFIX}"
        size = write_pieces(path, step, layout, pieces)
        # Read back here, from this host's page cache, so that rank 0's commit does not read it.
        told = json.dumps({"size": size, "digest": _crc32c(path)}).encode()
        _write_atomically(path.with_name(path.name + DIGEST_SUFFIX), told)
        return size

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
        try:
            _write_synced(temporary, data)
            os.link(temporary, marker)
        except FileExistsError:
            raise AlreadyCommitted(f"step {step} is committed in {self.name} already") from None
        finally:
            temporary.unlink(missing_ok=True)  # written or not, linked or not
        _sync_dir(marker.parent)

    def _committed(self, step: int, staged: Path) -> None:
        pass

    def _delete_step(self, step: int, committed: bool) -> None:
        if committed:
            self._marker_path(step).unlink(missing_ok=True)
            _sync_dir(self._marker_path(step).parent)
        shutil.rmtree(self.directory / _step_name(step), ignore_errors=True)

    def _present(self, marker: _Marker) -> Path:
        step_dir = self.directory / _step_name(marker.step)
        bad = [rel for rel, (size, _) in marker.files.items() if _size(step_dir / rel) != size]
        if bad:
            raise _Corrupt(f"{len(bad)} file(s) missing or not of the size the marker says, e.g. {bad[0]}")
        return step_dir

    def _fetch(self, marker: _Marker) -> Path:
        step_dir = self.directory / _step_name(marker.step)
        bad = _mismatches(step_dir, marker.files)
        if bad:
            raise _Corrupt(f"{len(bad)} file(s) differ from the marker, e.g. {bad[0]}")
        return step_dir


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


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
    try:
        _write_synced(temporary, data)
        os.replace(temporary, path)
    except BaseException:  # a failed write leaves no temporary file behind (a full disk, say)
        temporary.unlink(missing_ok=True)
        raise
    _sync_dir(path.parent)

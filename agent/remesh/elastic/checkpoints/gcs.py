"""The GCS tier: a bucket under a prefix, written through a local staging directory or straight
into the bucket (a sharded state, every host its own shards)."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from remesh.elastic.checkpoints._base import (
    _CRC32C,
    _FENCE_ATTEMPTS,
    _STEP_DIR,
    _TRANSFER_WORKERS,
    FENCE,
    MARKER,
    STATE,
    Checkpoints,
    _Corrupt,
    _decode_fence,
    _encode_fence,
    _Marker,
    _mismatches,
    _must_raise_fence,
    _step_name,
)
from remesh.elastic.errors import AlreadyCommitted, CheckpointError

if TYPE_CHECKING:
    from google.cloud import storage

log = structlog.get_logger("remesh.elastic.checkpoints")


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
        max_to_keep: int | None = 3,
        compress: bool = False,
    ) -> None:
        super().__init__(clock, max_to_keep, compress)
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

    def _delete_step(self, step: int, committed: bool) -> None:
        from google.api_core import exceptions as gexc

        if committed:
            with contextlib.suppress(gexc.NotFound):
                self.bucket.blob(self._marker_object(step)).delete()
        for blob in self._blobs(step).values():
            with contextlib.suppress(gexc.NotFound):
                blob.delete()

    def _present(self, marker: _Marker) -> Any:
        """Every object of the step listed at the size its marker says: one listing, no download
        (a replicated step is downloaded and hashed once, when it is restored)."""
        if all(digest.startswith(_CRC32C) for _, digest in marker.files.values()):
            return self._fetch(marker)  # a sharded state: its check is a listing already
        listed = {rel: int(blob.size) for rel, blob in self._blobs(marker.step).items()}
        bad = [rel for rel, (size, _) in marker.files.items() if listed.get(rel) != size]
        if bad:
            raise _Corrupt(f"{len(bad)} object(s) missing or not of the size the marker says, e.g. {bad[0]}")
        return None

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
        # The files kept matched their digests just now: only the ones downloaded are read again.
        bad = _mismatches(local, {rel: marker.files[rel] for rel in missing})
        if bad:
            raise _Corrupt(f"{len(bad)} file(s) differ from the marker, e.g. {bad[0]}")
        return local

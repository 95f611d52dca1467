"""Checkpoint tiers of the elastic trainer: a local directory and a GCS bucket, one interface.

The session restores from a host-memory snapshot where one survives; these tiers are the fallback
(the newest committed checkpoint, local then GCS) and what survives losing every host. A state is a
pytree of host numpy arrays (``jax.device_get(state)``) with its step, epoch and a small JSON
``extra`` dict (e.g. the data position). Both tiers share one layout::

    {root}/EPOCH_FENCE                  the highest epoch that has written here (JSON)
    {root}/step_0000000120/state/...    an Orbax PyTree checkpoint of the state
    {root}/step_0000000120/COMMITTED    the commit marker, written last: step, epoch, time, extra,
                                        and the size and digest of every file of the step
                                        (sha256; CRC32C for a sharded state's, which every host
                                        wrote and rank 0 reads back while training goes on)

Retention: after each commit, the committed steps older than the newest ``max_to_keep`` (3) are
deleted, marker first, with the leftovers of dead writers older than them; a save on its way (newer,
no marker yet) is never touched. Why not ``orbax.checkpoint.CheckpointManager``: its step directories,
finalisation and retention are its own, and a commit here must be accepted by the coordinator for
the current epoch, fenced, and marked create-only with a digest of every file, on two kinds of
storage with one protocol; Orbax still writes and reads every step (``PyTreeCheckpointer``), and
what the manager would add is the ``max_to_keep`` above.

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

Dtypes: every leaf comes back bit for bit and of its own dtype (bfloat16, the float8 kinds, int4,
bool, complex: Orbax stores their bytes through tensorstore, and a pieces file names each dtype and
holds its raw bytes, ``remesh.elastic.dtypes``). Orbax cannot store a dtype tensorstore has no type
for (float8_e4m3, uint4 and uint2 with tensorstore 0.1.86), nor an array with no elements: a save
or ``write_global`` of such a state raises ``CheckpointError`` naming the leaf, before anything is
written. A sharded state written as pieces (``LocalCheckpoints(pieces=True)``) keeps those too.
"""

from remesh.elastic.checkpoints._base import Approve, Checkpoints, Restored, Trusted
from remesh.elastic.checkpoints.gcs import GcsCheckpoints
from remesh.elastic.checkpoints.local import LocalCheckpoints
from remesh.elastic.errors import (
    AlreadyCommitted,
    CheckpointError,
    NotProcessZero,
    NoViableCheckpoint,
    StaleEpoch,
)

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
    "Trusted",
]

"""remesh.elastic: what a JAX training script imports to survive host failures.

::

    session = Session(init_state=..., train_step=..., batch_for_step=..., devices_per_host=2,
                      policy=Policy(checkpoint_every=50), checkpoints=[LocalCheckpoints(dir)])
    for result in session.run(num_steps):
        ...

or, keeping your own loop (``Session.epochs``; ``train_step`` and ``batch_for_step`` not needed)::

    for epoch in session.epochs(num_steps):
        with epoch:                      # a failure ends the epoch; the next one is re-meshed
            step_fn = epoch.jit(train_step)  # jax.jit, meeting every member once compiled
            state = epoch.state          # restored onto this epoch's mesh
            for step in epoch.steps():
                state, metrics = step_fn(state, epoch.batch(my_rows(step)))
                epoch.done(state, metrics)

Run the script under ``remesh agent``; the session takes its place in every epoch the coordinator
publishes. Run alone (``python train.py``) it is a job of one host (``solo``). Input addressed by
step (``GrainData``, ``StepData``) or from iterators that keep their own position (``IteratorData``:
Grain's ``DatasetIterator``), whose positions remesh keeps with the state. Pieces: ``session`` (the loop over epochs) and ``epoch`` (what happens between two
steps), ``policy`` (how it recovers), ``restore_plan`` (the restore order, a pure choice) and
``restore`` (carrying it out), ``schedule`` (when snapshots and buddy copies are due), ``snapshotting``
and ``buddy_copies`` (taking them), ``checkpointing`` (saving beside training), ``watchdog``,
``faults`` (faults injected on purpose, as a value), ``runtime`` (the JAX distributed runtime of one
epoch), ``snapshots`` (the host-memory tiers), ``checkpoints`` (the local and GCS tiers),
``agent_client`` (the agent's local API), ``solo`` (no agent), ``exits`` (why a process leaves for a
fresh one). It never imports the coordinator or the agent.

Words: a **tier** is a place that keeps copies of the state (the snapshot tiers "memory", "host-shm"
and "buddy"; the checkpoint tiers "local" and "gcs"); a **source** is where a restore's bytes came
from (a tier of this process, "peer" for a peer's own pieces, "buddy" for a buddy copy, a checkpoint
tier, or "scratch").
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from remesh.elastic.agent_client import AgentClient, Assignment
from remesh.elastic.checkpoints import (
    AlreadyCommitted,
    CheckpointError,
    Checkpoints,
    GcsCheckpoints,
    LocalCheckpoints,
    NoViableCheckpoint,
    StaleEpoch,
)
from remesh.elastic.data import GrainData, HostBatches, IteratorData, StepData
from remesh.elastic.epoch import Epoch
from remesh.elastic.errors import (
    AddressInUse,
    ElasticError,
    PeerFailure,
    Recoverable,
    RestartProcess,
    StateLost,
    TopologyChanged,
)
from remesh.elastic.faults import Faults
from remesh.elastic.logs import configure_logging
from remesh.elastic.policy import Policy
from remesh.elastic.progress import StepResult
from remesh.elastic.schedule import SnapshotSchedule
from remesh.elastic.session import ADDRESS_IN_USE_EXIT_CODE, RESTART_EXIT_CODE, STATE_LOST_EXIT_CODE, Session
from remesh.elastic.sharding import Layout, fsdp_partition, replicated_partition

__all__ = [
    "ADDRESS_IN_USE_EXIT_CODE",
    "RESTART_EXIT_CODE",
    "STATE_LOST_EXIT_CODE",
    "AddressInUse",
    "AgentClient",
    "AlreadyCommitted",
    "Assignment",
    "CheckpointError",
    "Checkpoints",
    "ElasticError",
    "Epoch",
    "Faults",
    "GcsCheckpoints",
    "GrainData",
    "HostBatches",
    "IteratorData",
    "Layout",
    "LocalCheckpoints",
    "NoViableCheckpoint",
    "PeerFailure",
    "Policy",
    "Recoverable",
    "RestartProcess",
    "Session",
    "SnapshotSchedule",
    "StaleEpoch",
    "StateLost",
    "StepData",
    "StepResult",
    "TopologyChanged",
    "configure_logging",
    "fsdp_partition",
    "gcs_checkpoints_from_url",
    "replicated_partition",
]


def gcs_checkpoints_from_url(
    url: str, staging_dir: str | None = None, max_to_keep: int | None = 3
) -> GcsCheckpoints:
    """``GcsCheckpoints`` for ``gs://BUCKET/PREFIX``, keeping the newest ``max_to_keep`` steps.

    With ``STORAGE_EMULATOR_HOST`` set (a GCS emulator) the client is anonymous; otherwise it uses
    the machine's default Google credentials.
    """
    from google.cloud import storage

    if not url.startswith("gs://") or len(url) <= len("gs://"):
        raise ValueError(f"{url!r} is not a gs://BUCKET/PREFIX address")
    bucket, _, prefix = url.removeprefix("gs://").partition("/")
    client: Any
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        client = storage.Client(project="remesh-emulator", credentials=AnonymousCredentials())
    else:
        client = storage.Client()
    staging = staging_dir or tempfile.mkdtemp(prefix="remesh-gcs-staging-")
    return GcsCheckpoints(bucket, prefix, client, staging, max_to_keep=max_to_keep)

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
publishes. Pieces: ``session`` (the loop), ``runtime`` (the JAX distributed runtime of one epoch),
``snapshots`` (host-memory restore tier), ``checkpoints`` (local and GCS tiers), ``agent_client``
(the agent's local API). It never imports the coordinator or the agent.
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
from remesh.elastic.data import GrainData, HostBatches, StepData
from remesh.elastic.errors import (
    AddressInUse,
    ElasticError,
    PeerFailure,
    Recoverable,
    RestartProcess,
    StateLost,
    TopologyChanged,
)
from remesh.elastic.logs import configure_logging
from remesh.elastic.session import (
    ADDRESS_IN_USE_EXIT_CODE,
    RESTART_EXIT_CODE,
    STATE_LOST_EXIT_CODE,
    Epoch,
    Policy,
    Session,
    StepResult,
)
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
    "GcsCheckpoints",
    "GrainData",
    "HostBatches",
    "Layout",
    "LocalCheckpoints",
    "NoViableCheckpoint",
    "PeerFailure",
    "Policy",
    "Recoverable",
    "RestartProcess",
    "Session",
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

"""The trainer library's errors: one root, split by what the session does about them.

::

    ElasticError
    ├── Recoverable            the session tears JAX down and enters the next epoch in-process
    │   ├── TopologyChanged      a new epoch arrived (raised at a step boundary)
    │   ├── PeerFailure          a collective failed or timed out (a peer died): JaxRuntimeError, translated
    │   └── EpochSuperseded      the coordinator refused an act of this epoch (a checkpoint commit,
    │                            finishing the job): a newer epoch began; nothing was committed
    ├── AgentUnreachable       neither the agent nor, through it, the coordinator answered a call
    │                          (nothing was committed); retried, or the process restarts
    ├── CheckpointError        a checkpoint tier refused on purpose (remesh.elastic.checkpoints)
    │   ├── StaleEpoch           a newer epoch already fenced the storage: this one may not write
    │   ├── AlreadyCommitted     the step is committed already
    │   ├── NotProcessZero       only process 0 commits
    │   └── NoViableCheckpoint   no committed step could be read back (all missing or corrupt)
    ├── StateLost              the job completed steps, but no member holds one in memory and no
    │                          committed checkpoint is readable (or the input position of the step
    │                          cannot be carried over): exit with STATE_LOST_EXIT_CODE; the agent
    │                          reports it and the coordinator halts the job with the reason (never
    │                          a silent step 0)
    └── RestartProcess         in-process recovery is impossible: exit with RESTART_EXIT_CODE so the
        │                      agent starts a fresh process on the current topology
        └── AddressInUse         rank 0 found the epoch's JAX coordination port taken by another
                                 process: exit with ADDRESS_IN_USE_EXIT_CODE; the agent reports it
                                 and the coordinator moves the same members to a new address

The three that end the process carry ``why`` (``remesh.elastic.exits.Why``): the reason's code for
the log and the exit note. JAX runtime errors are translated into these in one place,
``remesh.elastic.runtime``.
"""

from __future__ import annotations

from remesh.elastic.exits import Why

__all__ = [
    "AddressInUse",
    "AgentUnreachable",
    "AlreadyCommitted",
    "CheckpointError",
    "ElasticError",
    "EpochSuperseded",
    "NoViableCheckpoint",
    "NotProcessZero",
    "PeerFailure",
    "Recoverable",
    "RestartProcess",
    "StaleEpoch",
    "StateLost",
    "TopologyChanged",
]


class ElasticError(Exception):
    """Root of every error the trainer library raises on purpose."""


class Recoverable(ElasticError):
    pass


class TopologyChanged(Recoverable):
    def __init__(self, old_epoch: int, new_epoch: int) -> None:
        super().__init__(f"topology changed from epoch {old_epoch} to {new_epoch}")
        self.old_epoch = old_epoch
        self.new_epoch = new_epoch


class PeerFailure(Recoverable):
    pass


class EpochSuperseded(Recoverable):
    pass


class AgentUnreachable(ElasticError):
    pass


class RestartProcess(ElasticError):
    def __init__(self, reason: str, why: Why) -> None:
        super().__init__(reason)
        self.why = why


class StateLost(ElasticError):
    def __init__(self, epoch: int, step: int, reason: str, why: Why = Why.STATE_LOST) -> None:
        super().__init__(f"epoch {epoch} found its survivors at step {step}, but {reason}")
        self.epoch = epoch
        self.step = step
        self.why = why


class AddressInUse(RestartProcess):
    def __init__(self, address: str, epoch: int) -> None:
        super().__init__(
            f"the JAX coordination address {address} of epoch {epoch} is taken by another process on "
            "this host; the coordinator will move the job to another port",
            Why.ADDRESS_IN_USE,
        )
        self.address = address
        self.epoch = epoch


class CheckpointError(ElasticError):
    """Root of every error the checkpoint tiers raise on purpose."""


class StaleEpoch(CheckpointError):
    pass


class AlreadyCommitted(CheckpointError):
    pass


class NotProcessZero(CheckpointError):
    pass


class NoViableCheckpoint(CheckpointError):
    pass

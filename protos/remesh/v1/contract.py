"""What the coordinator, the agent and the trainer agree on besides the messages of the protos.

Each side imports these from here; none spells them out itself:

- the **exit codes** a trainer process uses to tell its agent why it stopped, and the **exit note**
  (``ExitNote``) in which it says so in words;
- the **environment** the agent gives each trainer process it starts (its assignment for the epoch it
  was started on; the local API tells it about later ones);
- the **trailing metadata keys** with which the coordinator explains a refusal;
- the **rank** of a host in a topology message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only the types: the agent's pure core imports this module
    from remesh.v1 import coordinator_pb2 as pb

__all__ = [
    "ADDRESS_IN_USE_EXIT_CODE",
    "COMPILATION_CACHE_ENV",
    "FINISHED_METADATA",
    "LEADER_METADATA",
    "RESTART_EXIT_CODE",
    "SNAPSHOT_OWNER_FILE",
    "STATE_LOST_EXIT_CODE",
    "Env",
    "ExitNote",
    "TrainerAssignment",
    "one_line",
    "rank_of",
    "recovery_id",
    "snapshot_dir_name",
]

# The trainer cannot recover in-process (its JAX runtime is beyond repair, say): the agent restarts it
# at once on the current topology, and its host keeps its rank (EX_TEMPFAIL).
RESTART_EXIT_CODE = 75
# Rank 0's trainer found the epoch's JAX coordination port taken by another process (errno
# EADDRINUSE): the agent reports it and the coordinator moves the same members to a new port.
ADDRESS_IN_USE_EXIT_CODE = 98
# No tier holds the epoch's restore step (EX_DATAERR): reported, never retried; the job halts.
STATE_LOST_EXIT_CODE = 65

# A host's host-memory snapshots of one job live in a directory of this name under the trainer's
# Policy.shm_dir (/dev/shm by default); the file SNAPSHOT_OWNER_FILE in it names the agent session
# (Env.AGENT_SESSION) whose trainers wrote them. The agent deletes the directory it owns when the job
# finished (a spare's standby trainer, stopped, never does).
SNAPSHOT_OWNER_FILE = "AGENT"


def snapshot_dir_name(job_id: str, host_id: str) -> str:
    return f"remesh-{job_id}-{host_id or 'host'}"


# A follower coordinator refuses with UNAVAILABLE and names the leader's address under this key
# ("" when it knows none).
LEADER_METADATA = "remesh-leader"
# A refusal because the job finished carries its last step under this key.
FINISHED_METADATA = "remesh-finished"


# Where the trainer library keeps its persistent XLA compilation cache, when set in a trainer's
# environment (by whoever starts the trainers: the demo gives each goodput run its own).
COMPILATION_CACHE_ENV = "REMESH_COMPILATION_CACHE_DIR"


class Env:
    """The names of the environment variables the agent sets for every trainer process."""

    # The agent's local API (remesh.v1.AgentLocal), host:port on loopback.
    AGENT_ADDRESS = "REMESH_AGENT_ADDRESS"
    # Tells the active trainer from the warm standby on the local API.
    TRAINER_SLOT = "REMESH_TRAINER_SLOT"
    HOST_ID = "REMESH_HOST_ID"
    JOB = "REMESH_JOB"
    EPOCH = "REMESH_EPOCH"
    # -1: no rank (a standby process, waiting for one).
    RANK = "REMESH_RANK"
    WORLD_SIZE = "REMESH_WORLD_SIZE"
    JAX_COORDINATOR = "REMESH_JAX_COORDINATOR"
    RESTORE_STEP = "REMESH_RESTORE_STEP"
    DEVICE_COUNT = "REMESH_DEVICE_COUNT"
    # The checkpoint commits the coordinator accepted, "step:epoch" joined by commas.
    COMMITS = "REMESH_COMMITS"
    # "json" when the agent logs JSON lines (its --log-json): the trainer should too, into the same
    # stream (remesh.elastic.configure_logging reads it); "console" otherwise.
    LOG_FORMAT = "REMESH_LOG_FORMAT"
    # A fresh id for each agent process: host-memory state found under another one's was written
    # before this agent started (an earlier run of the job on this host), never by this run.
    AGENT_SESSION = "REMESH_AGENT_SESSION"
    # A file of the agent's, one per trainer process, where the process leaves an ``ExitNote`` before
    # it exits asking for a fresh process (or for the job to halt): why, in words a user can act on.
    EXIT_NOTE = "REMESH_EXIT_NOTE"


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def one_line(text: str, limit: int) -> str:
    """``text`` as one plain line (control characters, newlines included, become a space) of at most
    ``limit`` characters: what a trainer's reason may be in a report the coordinator takes."""
    line = _CONTROL.sub(" ", text).strip()
    return line if len(line) <= limit else line[: limit - 1] + "…"


@dataclass(frozen=True)
class ExitNote:
    """What a trainer process that gives up on recovering in place tells its agent (``Env.EXIT_NOTE``):
    a short code (``remesh.elastic.exits.Why``), the reason in full, the fix, and its exit code. The
    agent logs it and puts the reason into what it reports; it never decides on the code."""

    why: str
    reason: str
    fix: str
    exit_code: int

    def to_json(self) -> str:
        return json.dumps(
            {"why": str(self.why), "reason": self.reason, "fix": self.fix, "exit_code": self.exit_code}
        )

    @classmethod
    def from_json(cls, text: str) -> ExitNote:
        """ValueError (or KeyError, TypeError) where ``text`` is not a whole note."""
        raw = json.loads(text)
        return cls(str(raw["why"]), str(raw["reason"]), str(raw["fix"]), int(raw["exit_code"]))


@dataclass(frozen=True)
class TrainerAssignment:
    """A trainer process's assignment for the epoch it was started on, as its environment carries it."""

    agent_address: str
    slot: int
    host_id: str
    job_id: str
    epoch: int
    rank: int
    world_size: int
    jax_coordinator: str
    restore_step: int
    device_count: int
    commits: tuple[tuple[int, int], ...]  # (step, epoch) of each accepted checkpoint commit

    def to_env(self) -> dict[str, str]:
        return {
            Env.AGENT_ADDRESS: self.agent_address,
            Env.TRAINER_SLOT: str(self.slot),
            Env.HOST_ID: self.host_id,
            Env.JOB: self.job_id,
            Env.EPOCH: str(self.epoch),
            Env.RANK: str(self.rank),
            Env.WORLD_SIZE: str(self.world_size),
            Env.JAX_COORDINATOR: self.jax_coordinator,
            Env.RESTORE_STEP: str(self.restore_step),
            Env.DEVICE_COUNT: str(self.device_count),
            Env.COMMITS: ",".join(f"{step}:{epoch}" for step, epoch in self.commits),
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TrainerAssignment:
        """Read back what ``to_env`` wrote; KeyError names a variable that must be there and is not."""
        return cls(
            agent_address=env[Env.AGENT_ADDRESS],
            slot=int(env.get(Env.TRAINER_SLOT, "0")),
            host_id=env.get(Env.HOST_ID, ""),
            job_id=env.get(Env.JOB, "default"),
            epoch=int(env[Env.EPOCH]),
            rank=int(env[Env.RANK]),
            world_size=int(env[Env.WORLD_SIZE]),
            jax_coordinator=env.get(Env.JAX_COORDINATOR, ""),
            restore_step=int(env.get(Env.RESTORE_STEP, "-1")),
            device_count=int(env.get(Env.DEVICE_COUNT, "0")),
            commits=parse_commits(env.get(Env.COMMITS, "")),
        )


def parse_commits(text: str) -> tuple[tuple[int, int], ...]:
    pairs = (c.partition(":") for c in text.split(",") if c)
    return tuple((int(step), int(epoch)) for step, _, epoch in pairs)


def commits_of(commits: Iterable[pb.CheckpointCommit]) -> tuple[tuple[int, int], ...]:
    return tuple((int(c.step), int(c.epoch)) for c in commits)


def recovery_id(job_id: str, epoch: int) -> str:
    """The id every component logs a recovery under (``recovery=``): the job, and the epoch the
    recovery produces. A failure while epoch N runs belongs to the recovery that produces N + 1; the
    coordinator's verdict, the agents' restarts and the trainers' restores all say so, so one query
    for the id shows the recovery's whole path."""
    return f"{job_id}#{epoch}"


def rank_of(topology: pb.Topology, host_id: str) -> int:
    """``host_id``'s rank in ``topology``, -1 when it holds none."""
    for m in topology.members:
        if m.host_id == host_id:
            return int(m.rank)
    return -1

"""The contract the agent and the trainer share (remesh.v1.contract): what one side writes, the other
reads back the same."""

from __future__ import annotations

import pytest

from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.contract import Env, TrainerAssignment, commits_of, rank_of

GIVEN = TrainerAssignment(
    agent_address="127.0.0.1:4000",
    slot=3,
    host_id="host-1",
    job_id="job-a",
    epoch=7,
    rank=1,
    world_size=4,
    jax_coordinator="127.0.0.1:28007",
    restore_step=120,
    device_count=2,
    commits=((100, 5), (110, 6)),
)


def test_an_assignment_written_to_the_environment_reads_back_the_same() -> None:
    env = GIVEN.to_env()
    assert all(name.startswith("REMESH_") for name in env)
    assert TrainerAssignment.from_env(env) == GIVEN
    # What a user's process sees, spelled out once here: the names are the contract.
    assert env[Env.RANK] == "1" and env[Env.COMMITS] == "100:5,110:6"


def test_a_standby_has_no_rank_and_no_commits_read_back_as_none() -> None:
    standby = TrainerAssignment.from_env({**GIVEN.to_env(), Env.RANK: "-1", Env.COMMITS: ""})
    assert (standby.rank, standby.commits) == (-1, ())


@pytest.mark.parametrize("missing", [Env.AGENT_ADDRESS, Env.EPOCH, Env.RANK, Env.WORLD_SIZE])
def test_a_missing_variable_a_trainer_needs_is_named(missing: str) -> None:
    env = GIVEN.to_env()
    del env[missing]
    with pytest.raises(KeyError, match=missing):
        TrainerAssignment.from_env(env)


def test_rank_and_commits_of_a_topology_message() -> None:
    topology = pb.Topology(
        epoch=3,
        members=[pb.TopologyMember(host_id="a", rank=0), pb.TopologyMember(host_id="b", rank=1)],
        commits=[pb.CheckpointCommit(step=10, epoch=2)],
    )
    assert (rank_of(topology, "b"), rank_of(topology, "zz")) == (1, -1)
    assert commits_of(topology.commits) == ((10, 2),)

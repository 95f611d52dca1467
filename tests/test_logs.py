"""One log format per pod: an agent started with --log-json tells its trainers, and a training script
that calls remesh.elastic.configure_logging writes JSON lines too."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import structlog

from remesh.agent.daemon import Agent
from remesh.agent.settings import AgentSettings
from remesh.elastic import configure_logging
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.contract import Env, recovery_id
from tests.procs import Cluster, wait_for


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.mark.parametrize("log_json, expected", [(True, "json"), (False, "console")])
def test_the_agent_tells_its_trainer_how_it_logs(log_json: bool, expected: str) -> None:
    agent = Agent(
        AgentSettings(coordinators=("127.0.0.1:1",), host_id="h", trainer_command=("x",), log_json=log_json)
    )
    env = agent.trainer_env(pb.Topology(epoch=4), rank=0, slot=1)
    assert env[Env.LOG_FORMAT] == expected
    assert env[Env.EPOCH] == "4"  # beside the assignment, not instead of it


def test_a_trainer_told_json_writes_json_lines_and_otherwise_console_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging(env={Env.LOG_FORMAT: "json"})
    structlog.get_logger("trainer").info("step done", step=3)
    (line,) = capsys.readouterr().err.splitlines()
    doc = json.loads(line)
    assert (doc["event"], doc["step"], doc["level"]) == ("step done", 3, "info") and doc["timestamp"]

    configure_logging(env={})
    structlog.get_logger("trainer").info("step done", step=4)
    (line,) = capsys.readouterr().err.splitlines()
    assert "step done" in line and "step=4" in line
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)

    configure_logging(level="warning", env={Env.LOG_FORMAT: "json"})
    structlog.get_logger("trainer").info("not shown")
    assert capsys.readouterr().err == ""


@pytest.mark.integration
def test_one_recovery_id_runs_through_the_coordinator_and_the_agents_logs(cluster: Cluster) -> None:
    """host-1 is SIGKILLed: the coordinator's verdict, the new epoch and its going live, and the
    surviving and the spare agents' lines about epoch 2 all carry recovery=<job>#2."""
    cluster.start_coordinator("--world-size", "2")
    for host in ("host-0", "host-1"):
        cluster.start_agent(host)
    cluster.start_agent("spare-0", spare=True)
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")
    cluster.agents["host-1"].kill()
    wait_for(
        lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE and e.epoch == 2 for e in cluster.events()),
        30,
        "epoch 2",
    )
    tag = f"recovery={recovery_id(cluster.job, 2)}"
    assert cluster.coordinator is not None

    def tagged(text: str) -> list[str]:
        return [line for line in text.splitlines() if tag in line]

    coordinator = tagged(cluster.coordinator.output())
    for event in ("member_dead", "topology_changed", "epoch_live"):
        assert any(event in line for line in coordinator), (event, coordinator)
    assert any("member_dead" in line and "host=host-1" in line for line in coordinator)
    for host in ("host-0", "spare-0"):
        lines = tagged(cluster.agents[host].output())
        assert any("topology" in line for line in lines), (host, cluster.agents[host].output()[-2000:])
    # Epoch 1 was the job forming, not a recovery: nothing carries an id for it.
    assert f"recovery={recovery_id(cluster.job, 1)}" not in cluster.coordinator.output()

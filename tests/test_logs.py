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
from remesh.v1.contract import Env


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

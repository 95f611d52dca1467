"""A trainer's progress reports are coalesced in time: a fast loop makes one local call per
``progress_every_s``, not one per step; the step after a stall report and a flush go at once.

The trainer's side (``AgentClient``) talks to a real gRPC server on port 0 that records each
report, as the agent's local API would receive it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from structlog.testing import capture_logs

from remesh.agent.daemon import Agent
from remesh.agent.settings import AgentSettings
from remesh.elastic import Policy
from remesh.elastic.agent_client import AgentClient, Assignment
from remesh.v1 import agent_pb2 as apb
from remesh.v1 import agent_pb2_grpc as apb_grpc
from remesh.v1 import coordinator_pb2 as pb


class RecordingAgent(apb_grpc.AgentLocalServicer):
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.progress: list[int] = []  # steps, in the order received
        self.stalls: list[int] = []
        self.failures: list[tuple[int, int, str]] = []

    def WatchAssignments(
        self, request: apb.WatchAssignmentsRequest, context: grpc.ServicerContext
    ) -> Iterator[apb.Assignment]:
        while context.is_active():  # no new epoch, ever: the stream stays open
            time.sleep(0.05)
        yield from ()

    def ReportProgress(
        self, request: apb.ReportProgressRequest, context: grpc.ServicerContext
    ) -> apb.ReportProgressResponse:
        with self.lock:
            self.progress.append(request.step)
            self.lock.notify_all()
        return apb.ReportProgressResponse(current_epoch=request.epoch)

    def ReportStall(
        self, request: apb.LocalStallRequest, context: grpc.ServicerContext
    ) -> apb.LocalStallResponse:
        with self.lock:
            self.stalls.append(request.step)
        return apb.LocalStallResponse()

    def ReportCollectiveFailure(
        self, request: apb.LocalCollectiveFailureRequest, context: grpc.ServicerContext
    ) -> apb.LocalCollectiveFailureResponse:
        with self.lock:
            self.failures.append((request.epoch, request.step, request.detail))
        return apb.LocalCollectiveFailureResponse()

    def received(self, step: int, timeout: float) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: step in self.progress, timeout)


@pytest.fixture
def agent() -> Iterator[tuple[RecordingAgent, str]]:
    recording = RecordingAgent()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    apb_grpc.add_AgentLocalServicer_to_server(recording, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield recording, f"127.0.0.1:{port}"
    server.stop(0)


class CountingCondition(threading.Condition):
    """A condition that counts how often a waiter woke."""

    wakes = 0

    def wait(self, timeout: float | None = None) -> bool:
        woke = super().wait(timeout)
        self.wakes += 1
        return woke


def client(address: str, every: float) -> AgentClient:
    first = Assignment(epoch=1, host_id="host-0", rank=0, world_size=1, jax_coordinator="", restore_step=-1)
    return AgentClient(address, first, progress_every_s=every)


def test_a_fast_loop_sends_one_report_per_interval_and_the_newest_step(
    agent: tuple[RecordingAgent, str],
) -> None:
    recording, address = agent
    every = 0.2
    trainer = client(address, every)
    trainer._progress_due = counting = CountingCondition()  # before the reporter thread starts
    try:
        started = time.monotonic()
        for step in range(1, 201):  # a step every 2 ms: 100 steps per interval
            trainer.report_progress_later(step, 1)
            time.sleep(0.002)
        elapsed = time.monotonic() - started
        assert trainer.flush_progress(timeout=5)
    finally:
        trainer.close()
    steps = recording.progress
    # The first step goes at once; then at most one report per interval, and the flush.
    assert steps[0] == 1
    assert len(steps) <= elapsed / every + 3, (len(steps), elapsed)
    assert len(steps) < 50
    assert steps == sorted(steps) and steps[-1] == 200
    # Nor does each step wake the reporter: it wakes to send, not to look (200 steps).
    assert counting.wakes < 50, counting.wakes


def test_the_step_after_a_stall_report_is_reported_at_once(agent: tuple[RecordingAgent, str]) -> None:
    recording, address = agent
    trainer = client(address, every=300.0)  # nothing else would go out during the test
    try:
        trainer.report_progress_later(1, 1)
        assert recording.received(1, timeout=5)  # the first goes at once
        trainer.report_progress_later(2, 1)
        assert not recording.received(2, timeout=0.3)  # held: the interval has not passed
        trainer.report_stall(1, 2, blocked_s=1.5)
        trainer.report_progress_later(3, 1)
        assert recording.received(3, timeout=5)
        assert recording.stalls == [2]
        assert recording.progress == [1, 3]  # step 2 was coalesced into step 3
    finally:
        trainer.close()


def test_a_failed_collective_is_reported_as_one_line_of_plain_text(agent: tuple[RecordingAgent, str]) -> None:
    """The runtime's error goes on as its first line, without the control characters the coordinator
    refuses, and within its bound on a detail."""
    recording, address = agent
    trainer = client(address, every=300.0)
    try:
        trainer.report_collective_failure(1, 15, "Gloo AllReduce\x1b[31m timed out" + "x" * 2000 + "\nstack")
    finally:
        trainer.close()
    [(epoch, step, detail)] = recording.failures
    assert (epoch, step) == (1, 15)
    assert detail.startswith("Gloo AllReduce [31m timed out") and len(detail) <= 1024
    assert "stack" not in detail


def test_a_collective_failure_report_nobody_receives_is_logged_not_raised() -> None:
    trainer = client("127.0.0.1:1", every=300.0)  # nothing listens there
    try:
        with capture_logs() as logs:
            trainer.report_collective_failure(1, 15, "timed out")  # the trainer goes on waiting
    finally:
        trainer.close()
    [warning] = [e for e in logs if e["event"] == "collective failure report not delivered"]
    assert (warning["epoch"], warning["step"], warning["log_level"]) == (1, 15, "warning")


def test_a_negative_progress_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="progress_every_s"):
        Policy(progress_every_s=-1)


def test_a_step_of_the_epoch_before_reported_after_the_new_one_came_is_no_step_of_it() -> None:
    """A report waits up to ``progress_every_s``, a new epoch does not: a step of epoch 1 reported
    after epoch 2 came must not count as the trainer's first step of epoch 2 (the hang clock would
    then give its join, restore and compile the step limit, not the start-up one), and once the
    trainer reported a step of epoch 2 a late report of epoch 1 changes nothing."""
    agent = Agent(AgentSettings(coordinators=("127.0.0.1:1",), host_id="h", trainer_command=("x",)))
    agent.topology = pb.Topology(epoch=1)
    agent.report_progress(5, 1)
    assert agent.stepped and agent.last_step == 5

    # What a new epoch in which the host holds a rank does to the hang clock (Agent._on_topology).
    agent.topology, agent.stepped = pb.Topology(epoch=2), False
    agent.report_progress(7, 1)
    assert not agent.stepped, "a late step of epoch 1 was counted as the first step of epoch 2"
    assert agent.last_step == 7  # still the furthest the job got: the acknowledgement carries it

    agent.report_progress(8, 2)
    assert agent.stepped and agent.last_step == 8
    agent.report_progress(6, 1)
    assert agent.last_step == 8

"""The stand-in trainer survives a local API that fails the way an agent's does under stress.

The stand-in runs as a real process against a scripted agent local API (a real gRPC server on
port 0): AckEpoch answers UNAVAILABLE twice, as an agent does while it forwards the acknowledgement
to a coordinator whose leader is failing over; ReportProgress once runs past its deadline; the
acknowledgement of a superseded epoch is refused. A stand-in that exited on any of them would be
reported as a trainer fault and its healthy host evicted (the failover benchmark's false eviction).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from remesh.v1 import agent_pb2 as apb
from remesh.v1 import agent_pb2_grpc as apb_grpc
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.contract import TrainerAssignment

pytestmark = pytest.mark.integration


class ScriptedAgent(apb_grpc.AgentLocalServicer):
    """Epoch 1 until step 6, then epoch 2 (restore step 3) until step 8, then the job halts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.epoch = 1
        self.halted = False
        self.changed = threading.Condition(self.lock)
        self.ack_calls: list[tuple[int, str]] = []  # (epoch, outcome)
        self.progress: list[tuple[int, int]] = []  # (epoch, step) accepted
        self.progress_calls = 0

    def WatchAssignments(
        self, request: apb.WatchAssignmentsRequest, context: grpc.ServicerContext
    ) -> Iterator[apb.Assignment]:
        with self.changed:
            self.changed.wait_for(lambda: self.epoch > request.after_epoch or not context.is_active(), 10)
            epoch, halted = self.epoch, self.halted
        topology = pb.Topology(epoch=epoch, restore_step=3 if epoch == 2 else -1, halted=halted)
        yield apb.Assignment(topology=topology, host_id="host-0", rank=0, world_size=1)

    def AckEpoch(self, request: apb.LocalAckRequest, context: grpc.ServicerContext) -> apb.LocalAckResponse:
        with self.lock:
            attempts = sum(1 for e, _ in self.ack_calls if e == request.epoch)
            if request.epoch == 1 and attempts < 2:
                self.ack_calls.append((request.epoch, "unavailable"))
                context.abort(
                    grpc.StatusCode.UNAVAILABLE, "this coordinator is a follower: the leader is at ..."
                )
            if request.epoch == 2:
                self.ack_calls.append((request.epoch, "refused"))
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "stale epoch 2: the current epoch is 3")
            self.ack_calls.append((request.epoch, f"acked step {request.restored_step}"))
        return apb.LocalAckResponse(live=True)

    def ReportProgress(
        self, request: apb.ReportProgressRequest, context: grpc.ServicerContext
    ) -> apb.ReportProgressResponse:
        with self.changed:
            self.progress_calls += 1
            if self.progress_calls == 2:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self.progress.append((request.epoch, request.step))
            if request.epoch == 1 and request.step >= 6 and self.epoch == 1:
                self.epoch = 2
            elif request.epoch == 2 and request.step >= 8 and self.epoch == 2:
                self.epoch, self.halted = 3, True
            self.changed.notify_all()
            return apb.ReportProgressResponse(current_epoch=self.epoch)


def test_the_stand_in_retries_transient_local_api_errors_and_never_exits_on_them() -> None:
    agent = ScriptedAgent()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    apb_grpc.add_AgentLocalServicer_to_server(agent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    given = TrainerAssignment(
        agent_address=f"127.0.0.1:{port}",
        slot=1,
        host_id="host-0",
        job_id="stand-in",
        epoch=1,
        rank=0,
        world_size=1,
        jax_coordinator="",
        restore_step=-1,
        device_count=1,
        commits=(),
    )
    env = {**os.environ, **given.to_env(), "STAND_IN_STEP_S": "0.01"}
    env.pop("STAND_IN_FAIL_AT", None)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "remesh.embedded.standin"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        server.stop(0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - started < 20
    assert agent.ack_calls == [(1, "unavailable"), (1, "unavailable"), (1, "acked step 0"), (2, "refused")]
    # The step whose report ran past its deadline was reported again; epoch 2 resumed after step 3.
    assert [s for e, s in agent.progress if e == 1] == list(range(1, 7))
    assert [s for e, s in agent.progress if e == 2] == [4, 5, 6, 7, 8]
    assert "AckEpoch(1) failed (UNAVAILABLE" in done.stderr
    assert "ReportProgress(2) failed (DEADLINE_EXCEEDED" in done.stderr
    assert "AckEpoch(2) not delivered (FAILED_PRECONDITION" in done.stderr

"""An agent's local API stood in for one trainer: a real gRPC server on a Unix socket that assigns
epochs of a world of one, records what the trainer says (acknowledgements with their phases,
progress, the end of the job) and announces a new epoch when told to (``publish``).

What drives the ``Session`` is the real trainer library (``AgentClient`` over gRPC); only the agent
and the coordinator behind it are stood in, for tests of the session itself (tests/test_session_memory.py).
Used from a test process and from trainer scripts alike (``python -c``, PYTHONPATH at the checkout).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from remesh.elastic.agent_client import AgentClient, Assignment
from remesh.v1 import agent_pb2 as apb
from remesh.v1 import agent_pb2_grpc as apb_grpc
from remesh.v1 import coordinator_pb2 as pb

HOST = "host-0"


class LocalAgent(apb_grpc.AgentLocalServicer):
    """Epoch 1 from step -1 (nothing done yet) until ``publish`` announces another."""

    def __init__(self, socket_path: Path) -> None:
        self.changed = threading.Condition()
        self.epoch = 1
        self.restore_step = -1
        self.acks: list[dict[str, Any]] = []
        self.progress: list[tuple[int, int]] = []  # (epoch, step)
        self.finished: list[tuple[int, int]] = []  # (epoch, step)
        self.stalls: list[tuple[int, int]] = []
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="local-agent")
        )
        apb_grpc.add_AgentLocalServicer_to_server(self, self._server)
        self.address = f"unix:{socket_path}"
        self._server.add_insecure_port(self.address)
        self._server.start()

    def first(self) -> Assignment:
        """The assignment a trainer started now is given (what its environment would carry)."""
        with self.changed:
            return Assignment(self.epoch, HOST, 0, 1, "", self.restore_step, hosts=(HOST,))

    def client(self, progress_every_s: float = 0.0) -> AgentClient:
        return AgentClient(self.address, self.first(), progress_every_s=progress_every_s)

    def publish(self, epoch: int, restore_step: int) -> None:
        with self.changed:
            self.epoch, self.restore_step = epoch, restore_step
            self.changed.notify_all()

    def close(self) -> None:
        self._server.stop(0).wait()

    def _assignment(self) -> apb.Assignment:
        member = pb.TopologyMember(host_id=HOST, rank=0, device_count=1)
        topology = pb.Topology(epoch=self.epoch, restore_step=self.restore_step, members=[member])
        return apb.Assignment(topology=topology, host_id=HOST, rank=0, world_size=1)

    def WatchAssignments(
        self, request: apb.WatchAssignmentsRequest, context: grpc.ServicerContext
    ) -> Iterator[apb.Assignment]:
        sent = 0
        while context.is_active():
            with self.changed:
                if self.epoch == sent or self.epoch <= request.after_epoch:
                    self.changed.wait(0.2)
                    continue
                sent = self.epoch
                message = self._assignment()
            yield message

    def ReportProgress(
        self, request: apb.ReportProgressRequest, context: grpc.ServicerContext
    ) -> apb.ReportProgressResponse:
        with self.changed:
            self.progress.append((request.epoch, request.step))
            self.changed.notify_all()
            return apb.ReportProgressResponse(current_epoch=self.epoch)

    def AckEpoch(self, request: apb.LocalAckRequest, context: grpc.ServicerContext) -> apb.LocalAckResponse:
        with self.changed:
            self.acks.append(
                {
                    "epoch": request.epoch,
                    "restored_step": request.restored_step,
                    "source": request.restore_source,
                    "phases": dict(request.phases),
                }
            )
            self.changed.notify_all()
        return apb.LocalAckResponse(live=True)

    def CommitCheckpoint(
        self, request: apb.LocalCommitRequest, context: grpc.ServicerContext
    ) -> apb.LocalCommitResponse:
        return apb.LocalCommitResponse()

    def ReportStall(
        self, request: apb.LocalStallRequest, context: grpc.ServicerContext
    ) -> apb.LocalStallResponse:
        with self.changed:
            self.stalls.append((request.epoch, request.step))
        return apb.LocalStallResponse()

    def ReportCollectiveFailure(
        self, request: apb.LocalCollectiveFailureRequest, context: grpc.ServicerContext
    ) -> apb.LocalCollectiveFailureResponse:
        return apb.LocalCollectiveFailureResponse()

    def Finish(
        self, request: apb.LocalFinishRequest, context: grpc.ServicerContext
    ) -> apb.LocalFinishResponse:
        with self.changed:
            self.finished.append((request.epoch, request.step))
            self.changed.notify_all()
        return apb.LocalFinishResponse()


def socket_path(directory: Path) -> Path:
    """A Unix socket path under ``directory`` short enough for the kernel (108 bytes at most)."""
    path = directory / "agent.sock"
    if len(str(path)) < 100:
        return path
    return Path("/tmp") / f"remesh-agent-{os.getpid()}-{time.monotonic_ns()}.sock"

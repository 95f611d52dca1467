"""The agent relays the trainer's calls (acknowledge, commit, finish, stall) to the coordinator: what
it sends again and what it hands back at once, against a real gRPC server that answers as told."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from remesh.agent.daemon import Agent
from remesh.agent.settings import AgentSettings
from remesh.v1 import agent_pb2 as apb
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc


class _Answers(pb_grpc.CoordinatorServicer):
    """Fails the first ``len(failures)`` AckEpoch calls with the given codes, then accepts."""

    def __init__(self, failures: list[grpc.StatusCode]) -> None:
        self.failures = failures
        self.calls: list[pb.AckEpochRequest] = []

    async def AckEpoch(
        self, request: pb.AckEpochRequest, context: grpc.aio.ServicerContext
    ) -> pb.AckEpochResponse:
        self.calls.append(request)
        if len(self.calls) <= len(self.failures):
            await context.abort(self.failures[len(self.calls) - 1], "as the test says")
        return pb.AckEpochResponse(live=True)


async def _ack(failures: list[grpc.StatusCode]) -> tuple[bool | BaseException, int]:
    servicer = _Answers(failures)
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    agent = Agent(
        AgentSettings(
            coordinators=(f"127.0.0.1:{port}",), host_id="h0", trainer_command=("true",), warm_standby=False
        )
    )
    try:
        answer: bool | BaseException = await agent.ack_epoch(apb.LocalAckRequest(epoch=3, restored_step=7))
    except grpc.aio.AioRpcError as exc:
        answer = exc
    finally:
        await agent.link.close(rotate=False)
        await server.stop(None)
    return answer, len(servicer.calls)


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED]
)
def test_a_call_shed_or_cut_off_is_sent_again_and_its_answer_reaches_the_trainer(
    code: grpc.StatusCode,
) -> None:
    # CANCELLED: what a coordinator under load answers to some calls of a burst (2000 hosts acknowledging
    # one epoch), and what a call gets when the agent closes its channel to reconnect.
    assert asyncio.run(_ack([code, code])) == (True, 3)


def test_a_refusal_goes_back_to_the_trainer_at_once() -> None:
    answer, calls = asyncio.run(_ack([grpc.StatusCode.FAILED_PRECONDITION]))
    assert isinstance(answer, grpc.aio.AioRpcError)
    assert answer.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert answer.details() == "as the test says"
    assert calls == 1

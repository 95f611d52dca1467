"""The agent relays the trainer's calls (acknowledge, commit, finish, stall) to the coordinator: what
it sends again and what it hands back at once, against a real gRPC server that answers as told."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

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


@contextlib.asynccontextmanager
async def _agent_of(servicer: pb_grpc.CoordinatorServicer) -> AsyncIterator[Agent]:
    """An agent (host h0) whose coordinator is ``servicer``, on a real gRPC server."""
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
        yield agent
    finally:
        await agent.link.close(rotate=False)
        await server.stop(None)


async def _acknowledged(agent: Agent) -> bool | BaseException:
    """What the trainer's acknowledgement of epoch 3 (restored step 7) gets back: live, or the refusal."""
    try:
        return await agent.ack_epoch(apb.LocalAckRequest(epoch=3, restored_step=7))
    except grpc.aio.AioRpcError as exc:
        return exc


async def _ack(failures: list[grpc.StatusCode]) -> tuple[bool | BaseException, int]:
    servicer = _Answers(failures)
    async with _agent_of(servicer) as agent:
        answer = await _acknowledged(agent)
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


class _StreamAnswers(_Answers):
    """Offers acknowledgements on the heartbeat stream and answers each there with ``answer(ack)``;
    None ends the stream without an answer. AckEpoch calls are accepted (and counted)."""

    def __init__(self, answer: Callable[[pb.AckEpochRequest], pb.AckReply | None]) -> None:
        super().__init__([])
        self.answer = answer
        self.on_stream: list[pb.HeartbeatRequest] = []
        self.streaming = asyncio.Event()  # the agent's first heartbeat came

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        return pb.RegisterResponse(
            member=pb.Member(host_id=request.host_id, incarnation=4, role=pb.ROLE_ACTIVE),
            heartbeat_interval_s=0.1,
            keepalive_s=0.5,
            acks_on_stream=True,
        )

    async def Heartbeat(
        self, request_iterator: AsyncIterator[pb.HeartbeatRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        async for request in request_iterator:
            self.streaming.set()
            if request.HasField("ack"):
                self.on_stream.append(request)
                reply = self.answer(request.ack)
                if reply is None:
                    return
                yield pb.HeartbeatResponse(ack_reply=reply)


async def _ack_on_stream(servicer: _StreamAnswers) -> bool | BaseException:
    async with _agent_of(servicer) as agent:
        session = asyncio.create_task(agent._session())  # registered, then its heartbeat stream
        try:
            await asyncio.wait_for(servicer.streaming.wait(), 10)
            return await _acknowledged(agent)
        finally:
            session.cancel()
            await asyncio.gather(session, return_exceptions=True)


def test_an_acknowledgement_goes_on_the_heartbeat_stream_and_its_answer_reaches_the_trainer() -> None:
    servicer = _StreamAnswers(lambda ack: pb.AckReply(epoch=ack.epoch, live=True))
    assert asyncio.run(_ack_on_stream(servicer)) is True
    assert servicer.calls == []
    [sent] = servicer.on_stream
    # The stream is the agent's identity: the acknowledgement itself names no host or incarnation.
    assert (sent.host_id, sent.incarnation, sent.ack.host_id, sent.ack.incarnation) == ("h0", 4, "", 0)
    assert (sent.ack.epoch, sent.ack.restored_step) == (3, 7)


def test_a_refusal_on_the_stream_goes_back_to_the_trainer_at_once() -> None:
    code = grpc.StatusCode.FAILED_PRECONDITION
    servicer = _StreamAnswers(
        lambda ack: pb.AckReply(epoch=ack.epoch, code=code.value[0], details="stale epoch 3")
    )
    answer = asyncio.run(_ack_on_stream(servicer))
    assert isinstance(answer, grpc.aio.AioRpcError)
    assert (answer.code(), answer.details()) == (code, "stale epoch 3")
    assert servicer.calls == []


@pytest.mark.parametrize("ended", [True, False], ids=["stream ended", "coordinator unavailable"])
def test_an_acknowledgement_the_stream_could_not_answer_is_sent_again_as_a_call(ended: bool) -> None:
    unavailable = pb.AckReply(epoch=3, code=grpc.StatusCode.UNAVAILABLE.value[0], details="not the leader")
    servicer = _StreamAnswers(lambda ack: None if ended else unavailable)
    assert asyncio.run(_ack_on_stream(servicer)) is True
    assert len(servicer.on_stream) == 1
    [call] = servicer.calls
    assert (call.host_id, call.incarnation, call.epoch, call.restored_step) == ("h0", 4, 3, 7)

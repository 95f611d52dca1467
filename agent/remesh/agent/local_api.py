"""The agent's local API (``remesh.v1.AgentLocal``), on loopback, for its trainer processes: their
assignment for each epoch (a stream), progress reports, and the calls the agent relays to the
coordinator (epoch acknowledgements, checkpoint commits, stall reports, the job's end). A refusal of a
relayed call reaches the trainer with the coordinator's status and message."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, TypeVar

import grpc

from remesh.v1 import agent_pb2 as apb
from remesh.v1 import agent_pb2_grpc as apb_grpc

if TYPE_CHECKING:
    from remesh.agent.daemon import Agent

__all__ = ["LocalApi"]

T = TypeVar("T")


class LocalApi(apb_grpc.AgentLocalServicer):
    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    async def WatchAssignments(
        self, request: apb.WatchAssignmentsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[apb.Assignment]:
        async for assignment in self._agent.assignment_changes(request.slot, request.after_epoch):
            yield assignment

    async def ReportProgress(
        self, request: apb.ReportProgressRequest, context: grpc.aio.ServicerContext
    ) -> apb.ReportProgressResponse:
        return apb.ReportProgressResponse(
            current_epoch=self._agent.report_progress(
                request.step,
                request.epoch,
                request.totals if request.HasField("totals") else None,
                request.tiers_missing,
            )
        )

    async def AckEpoch(
        self, request: apb.LocalAckRequest, context: grpc.aio.ServicerContext
    ) -> apb.LocalAckResponse:
        live = await _relayed(context, self._agent.ack_epoch(request))
        return apb.LocalAckResponse(live=live)

    async def CommitCheckpoint(
        self, request: apb.LocalCommitRequest, context: grpc.aio.ServicerContext
    ) -> apb.LocalCommitResponse:
        await _relayed(context, self._agent.commit_checkpoint(request))
        return apb.LocalCommitResponse()

    async def ReportStall(
        self, request: apb.LocalStallRequest, context: grpc.aio.ServicerContext
    ) -> apb.LocalStallResponse:
        await _relayed(context, self._agent.report_stall(request))
        return apb.LocalStallResponse()

    async def ReportCollectiveFailure(
        self, request: apb.LocalCollectiveFailureRequest, context: grpc.aio.ServicerContext
    ) -> apb.LocalCollectiveFailureResponse:
        await _relayed(context, self._agent.report_collective_failure(request))
        return apb.LocalCollectiveFailureResponse()

    async def Finish(
        self, request: apb.LocalFinishRequest, context: grpc.aio.ServicerContext
    ) -> apb.LocalFinishResponse:
        await _relayed(context, self._agent.finish(request))
        return apb.LocalFinishResponse()


async def _relayed(context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
    """The coordinator's answer to a relayed call; its refusal goes to the trainer with its status."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        await context.abort(exc.code(), exc.details() or "")
        raise AssertionError("unreachable") from exc

"""The agent's link to the coordinator: which replica it talks to, and the channel to it.

With several coordinator replicas the agent finds the leader itself: a follower refuses with
UNAVAILABLE and names the leader in the trailing metadata ``remesh-leader``
(``remesh.v1.contract.LEADER_METADATA``); the agent goes there at once, unless that address just
failed (a dead leader is named until its lease runs out); otherwise it tries the configured addresses
in turn, backing off after each failure.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any

import grpc

from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.contract import LEADER_METADATA
from remesh.v1.security import Tls, aio_channel

__all__ = ["CoordinatorLink", "StreamAcks", "StreamClosed", "leader_hint", "metadata"]


def metadata(exc: grpc.aio.AioRpcError, key: str) -> str | None:
    """The value of ``key`` in a refusal's trailing metadata, None where it has none."""
    pairs: Any = exc.trailing_metadata() or ()  # grpc.aio.Metadata: (key, value) pairs
    for k, value in pairs:
        if k == key:
            return value if isinstance(value, str) else value.decode()
    return None


def leader_hint(exc: grpc.aio.AioRpcError) -> str | None:
    """The leader a follower named in its refusal ("" if it knows none); None if it was no follower's."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    return metadata(exc, LEADER_METADATA)


class CoordinatorLink:
    def __init__(
        self,
        coordinators: Sequence[str],
        *,
        keepalive_s: float,
        reconnect_initial_s: float,
        reconnect_max_s: float,
        register_timeout_s: float = 2.0,
        register_timeout_max_s: float = 30.0,
        tls: Tls | None = None,
    ) -> None:
        self.coordinators = list(coordinators)
        self.keepalive_s = keepalive_s
        self.reconnect_initial_s = reconnect_initial_s
        self.reconnect_max_s = reconnect_max_s
        self.register_timeout_initial_s = register_timeout_s
        self.register_timeout_max_s = register_timeout_max_s
        # The deadline of the next registration: doubles after each one that ran out of time.
        self.register_timeout_s = register_timeout_s
        # With TLS every channel checks the server holds a coordinator certificate of the job's CA,
        # so a leader hint naming any other server leads nowhere.
        self.tls = tls
        # The pause before the next attempt after a failure: doubles up to reconnect_max_s.
        self.backoff = reconnect_initial_s
        # The address of the current (or last) channel.
        self.address = ""
        # The leader a follower named, tried before the configured addresses; and the address that
        # last failed to answer (a hint naming it is stale: the dead leader's lease has not run out).
        self._leader: str | None = None
        self._unreachable = ""
        self._index = 0
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.CoordinatorStub | None = None

    def stub(self) -> pb_grpc.CoordinatorStub:
        """The stub of the current channel, opening one (to the named leader, else the next address)."""
        if self._stub is None:
            self.address = self._leader or self.coordinators[self._index % len(self.coordinators)]
            ping_ms = int(self.keepalive_s * 1000)
            self._channel = aio_channel(
                self.address,
                self.tls,
                options=[
                    ("grpc.keepalive_time_ms", ping_ms),
                    ("grpc.keepalive_timeout_ms", ping_ms),
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_pings_without_data", 0),
                ],
            )
            self._stub = pb_grpc.CoordinatorStub(self._channel)
        return self._stub

    async def close(self, *, rotate: bool) -> None:
        """Close the channel; with ``rotate`` the next one goes elsewhere (the next address)."""
        if self._channel is not None:
            await self._channel.close(grace=None)
        self._channel, self._stub = None, None
        if rotate:
            if self._leader is None:
                self._index += 1
            self._leader = None

    def registered(self) -> None:
        """A coordinator accepted this agent: failures start counting afresh."""
        self.backoff = self.reconnect_initial_s
        self.register_timeout_s = self.register_timeout_initial_s
        self._unreachable = ""

    def registration_timed_out(self) -> None:
        """A registration ran out of time. A coordinator that thousands of agents register with at
        once answers each later than a lone one: with the same short deadline every time, an agent
        would give up on every answer it was about to get (the coordinator stores nothing for a
        caller that left), and a whole fleet could retry forever. The next registration gets twice as
        long, up to the cap; a dead coordinator costs the short deadline only once per address."""
        self.register_timeout_s = min(self.register_timeout_s * 2, self.register_timeout_max_s)

    def failed(self) -> float:
        """The current address did not answer: remember it, and return the pause before the next try."""
        self._unreachable = self.address
        pause, self.backoff = self.backoff, min(self.backoff * 2, self.reconnect_max_s)
        return pause

    def usable(self, leader: str) -> bool:
        """Whether a follower's hint is worth following now (not empty, not where we are, not the
        address that just failed)."""
        return bool(leader) and leader != self._unreachable and leader != self.address

    def follow(self, leader: str) -> None:
        """The next channel goes to ``leader`` (call after ``close(rotate=False)``)."""
        self._leader = leader


class StreamClosed(Exception):
    """The heartbeat stream that carried an acknowledgement ended before its answer came."""


class StreamAcks:
    """Acknowledgements that go on one heartbeat stream, and the answers they wait for.

    At thousands of hosts a new epoch's acknowledgements all reach the coordinator within seconds; as
    an ``AckEpoch`` call each, they cost it several times what the same message costs on the stream
    each agent holds open anyway (``benchmarks/fanout_floor.py --acks``). The stream's request
    generator takes what is queued here; its reader hands back each ``ack_reply``, matched by epoch,
    first sent first answered."""

    def __init__(self) -> None:
        self.outbox: collections.deque[pb.AckEpochRequest] = collections.deque()
        self._waiting: dict[int, collections.deque[asyncio.Future[pb.AckReply]]] = {}
        self.closed = False

    def send(self, ack: pb.AckEpochRequest) -> asyncio.Future[pb.AckReply]:
        """Queue ``ack`` for the stream; its answer, or ``StreamClosed`` once the stream ends."""
        future: asyncio.Future[pb.AckReply] = asyncio.get_running_loop().create_future()
        if self.closed:
            future.set_exception(StreamClosed("the heartbeat stream has ended"))
            return future
        self.outbox.append(ack)
        self._waiting.setdefault(ack.epoch, collections.deque()).append(future)
        return future

    def answered(self, reply: pb.AckReply) -> None:
        """The coordinator's answer to the oldest acknowledgement of ``reply.epoch`` still waiting."""
        waiting = self._waiting.get(reply.epoch)
        while waiting:
            future = waiting.popleft()
            if not future.done():  # its caller may have stopped waiting
                future.set_result(reply)
                break
        if waiting is not None and not waiting:
            del self._waiting[reply.epoch]

    def close(self) -> None:
        """The stream ended: every acknowledgement still waiting goes another way."""
        self.closed = True
        self.outbox.clear()
        for waiting in self._waiting.values():
            for future in waiting:
                if not future.done():
                    future.set_exception(StreamClosed("the heartbeat stream ended before the answer came"))
        self._waiting.clear()

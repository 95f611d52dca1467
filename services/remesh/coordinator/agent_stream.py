"""One agent's heartbeat stream as the coordinator's engine sees it, and the commands it carries.

The engine (``service``) queues commands and acknowledgement answers on a stream and rings its
doorbell; the stream's handler (``servicer``) wakes, writes them in order, and sleeps again. Commands
go on the wire through ``convert.command_to_pb``.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Any

from remesh.coordinator.doorbell import Doorbell

__all__ = ["AgentStream", "Command"]


class Command(enum.Enum):
    """What the coordinator tells one agent on its heartbeat stream.

    - REREGISTER: this incarnation no longer counts (declared dead, or it left): stop the trainer and
      register again.
    - DRAIN: the member is draining: stop the trainer and leave.
    - FINISHED: the job finished its last step: let the trainer exit, and exit 0.
    - NOT_LEADER: this replica stepped down. Not sent as a command: the stream ends UNAVAILABLE
      naming the leader, after every command queued before it.
    """

    REREGISTER = "reregister"
    DRAIN = "drain"
    FINISHED = "finished"
    NOT_LEADER = "not_leader"

    @property
    def ends_stream(self) -> bool:
        """Whether nothing more is written to the stream after it. A drained agent's stream stays
        open until the agent, stopping, closes it."""
        return self is not Command.DRAIN


@dataclass(eq=False)  # one stream is itself only: two of the same host are never equal
class AgentStream:
    """One open heartbeat stream: the commands queued for its agent, the answers to the
    acknowledgements it carried, and the doorbell its handler waits on for them, a new topology, or
    its agent's end."""

    host_id: str
    incarnation: int
    commands: collections.deque[tuple[Command, str]] = field(default_factory=collections.deque)
    # Answers to the acknowledgements the stream carried, encoded by the server, to write in order.
    replies: collections.deque[Any] = field(default_factory=collections.deque)
    # Its agent takes topologies from a relay (HeartbeatRequest.topology_from_relay): none written here.
    from_relay: bool = False
    _bell: Doorbell = field(default_factory=Doorbell)

    def command(self, command: Command, reason: str) -> None:
        self.commands.append((command, reason))
        self.ring()

    def reply(self, message: Any) -> None:
        self.replies.append(message)
        self.ring()

    def ring(self) -> None:
        """Wake the handler if it waits (if not, it looks at everything before it waits again)."""
        self._bell.ring()

    async def wait(self, quiet_s: float) -> bool:
        """Until ``ring()`` (True), or ``quiet_s`` seconds with nothing (False)."""
        return await self._bell.wait(quiet_s)

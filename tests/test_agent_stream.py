"""The coordinator's side of one heartbeat stream (``AgentStream``): its handler sleeps on a doorbell
until a command, a new topology or its agent's end rings it, or its keepalive comes due; the commands
it carries reach the agent as the proto's ``Command`` values. Pure asyncio: no server, no Redis."""

from __future__ import annotations

import asyncio

import pytest

from remesh.coordinator import convert
from remesh.coordinator.agent_stream import AgentStream, Command
from remesh.v1 import coordinator_pb2 as pb


def test_a_quiet_stream_wakes_for_its_keepalive() -> None:
    async def main() -> tuple[bool, float]:
        stream = AgentStream("h1", 1)
        loop = asyncio.get_running_loop()
        t = loop.time()
        rung = await stream.wait(0.05)
        return rung, loop.time() - t

    rung, waited = asyncio.run(main())
    assert rung is False and waited >= 0.05


def test_a_command_wakes_the_handler_at_once_and_stays_queued_until_taken() -> None:
    async def main() -> tuple[bool, list[tuple[Command, str]], bool]:
        stream = AgentStream("h1", 1)
        waiting = asyncio.create_task(stream.wait(30.0))
        await asyncio.sleep(0)  # the handler is asleep on its doorbell
        stream.command(Command.DRAIN, "operator")
        stream.command(Command.REREGISTER, "declared dead")
        rung = await asyncio.wait_for(waiting, 1.0)
        queued = list(stream.commands)
        # A ring with nobody waiting is not kept: the handler looks at what is queued before it waits.
        stream.ring()
        again = await stream.wait(0.01)
        return rung, queued, again

    rung, queued, again = asyncio.run(main())
    assert rung is True
    assert queued == [(Command.DRAIN, "operator"), (Command.REREGISTER, "declared dead")]
    assert again is False


def test_a_ring_after_the_keepalive_came_due_changes_nothing() -> None:
    async def main() -> bool:
        stream = AgentStream("h1", 1)
        rung = await stream.wait(0.01)
        stream.ring()  # the bell is gone: nothing to set, nothing raised
        return rung

    assert asyncio.run(main()) is False


def test_every_command_sent_is_one_of_the_protos_and_every_one_of_the_protos_is_sent() -> None:
    """Each command an agent is sent has a wire value of its own, and the proto has no command the
    coordinator never sends (a new one in the .proto needs a Command here)."""
    sent = {c: convert.command_to_pb(c) for c in Command if c is not Command.NOT_LEADER}
    assert sent == {
        Command.REREGISTER: pb.COMMAND_REREGISTER,
        Command.DRAIN: pb.COMMAND_DRAIN,
        Command.FINISHED: pb.COMMAND_FINISHED,
    }
    assert set(sent.values()) == set(pb.Command.values()) - {pb.COMMAND_UNSPECIFIED}


def test_not_leader_is_no_command_on_the_wire() -> None:
    """A replica that stepped down ends its streams with a status naming the leader instead."""
    with pytest.raises(ValueError, match="ends the stream"):
        convert.command_to_pb(Command.NOT_LEADER)

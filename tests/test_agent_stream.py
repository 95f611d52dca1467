"""The coordinator's side of one heartbeat stream (``AgentStream``): its handler sleeps on a doorbell
until a command, a new topology or its agent's end rings it, or its keepalive comes due. Pure
asyncio: no server, no Redis."""

from __future__ import annotations

import asyncio

from remesh.coordinator.service import AgentStream


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
    async def main() -> tuple[bool, list[tuple[str, str]], bool]:
        stream = AgentStream("h1", 1)
        waiting = asyncio.create_task(stream.wait(30.0))
        await asyncio.sleep(0)  # the handler is asleep on its doorbell
        stream.command("drain", "operator")
        stream.command("reregister", "declared dead")
        rung = await asyncio.wait_for(waiting, 1.0)
        queued = list(stream.commands)
        # A ring with nobody waiting is not kept: the handler looks at what is queued before it waits.
        stream.ring()
        again = await stream.wait(0.01)
        return rung, queued, again

    rung, queued, again = asyncio.run(main())
    assert rung is True
    assert queued == [("drain", "operator"), ("reregister", "declared dead")]
    assert again is False


def test_a_ring_after_the_keepalive_came_due_changes_nothing() -> None:
    async def main() -> bool:
        stream = AgentStream("h1", 1)
        rung = await stream.wait(0.01)
        stream.ring()  # the bell is gone: nothing to set, nothing raised
        return rung

    assert asyncio.run(main()) is False

"""The doorbell every stream handler sleeps on (the coordinator's heartbeat streams and topology
watchers, a relay's followers): one ring wakes every waiter at once, a waiter's keepalive wakes it
alone, and a ring while nobody waits is not kept. Pure asyncio: no server, no Redis."""

from __future__ import annotations

import asyncio

from remesh.coordinator.doorbell import Doorbell


def test_one_ring_wakes_every_waiter_at_once() -> None:
    async def main() -> list[bool]:
        bell = Doorbell()
        waiters = [asyncio.create_task(bell.wait(30.0)) for _ in range(100)]
        forever = asyncio.create_task(bell.wait())  # no keepalive: a topology watcher
        await asyncio.sleep(0)  # every one asleep on the bell
        bell.ring()
        return await asyncio.wait_for(asyncio.gather(*waiters, forever), 5.0)

    assert asyncio.run(main()) == [True] * 101


def test_a_keepalive_wakes_its_own_waiter_only() -> None:
    async def main() -> tuple[bool, bool, float]:
        bell = Doorbell()
        loop = asyncio.get_running_loop()
        patient = asyncio.create_task(bell.wait(30.0))
        t = loop.time()
        quick = await bell.wait(0.05)
        waited = loop.time() - t
        assert not patient.done()
        bell.ring()
        return quick, await asyncio.wait_for(patient, 5.0), waited

    quick, patient, waited = asyncio.run(main())
    assert quick is False and waited >= 0.05
    assert patient is True


def test_a_ring_while_nobody_waits_is_not_kept() -> None:
    """A handler looks at everything due before it waits again: a ring it missed owes it nothing."""

    async def main() -> bool:
        bell = Doorbell()
        bell.ring()
        return await bell.wait(0.01)

    assert asyncio.run(main()) is False


def test_a_waiter_cancelled_does_not_hold_up_the_others() -> None:
    """A stream whose client went away is cancelled in its wait; a later ring still wakes the others."""

    async def main() -> tuple[bool, bool]:
        bell = Doorbell()
        gone = asyncio.create_task(bell.wait(30.0))
        staying = asyncio.create_task(bell.wait(30.0))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        bell.ring()
        return gone.cancelled(), await asyncio.wait_for(staying, 5.0)

    assert asyncio.run(main()) == (True, True)

"""Which coordinator replica the agent talks to (remesh.agent.connection.CoordinatorLink): no server
is needed, a channel connects only when called."""

from __future__ import annotations

import asyncio

from remesh.agent.connection import CoordinatorLink


def link() -> CoordinatorLink:
    return CoordinatorLink(["a:1", "b:2"], keepalive_s=0.5, reconnect_initial_s=0.05, reconnect_max_s=0.3)


def test_addresses_in_turn_a_named_leader_first_and_a_stale_hint_ignored() -> None:
    async def go() -> list[object]:
        seen: list[object] = []
        c = link()
        c.stub()
        seen.append(c.address)  # the first configured address
        c.failed()
        await c.close(rotate=True)
        c.stub()
        seen.append(c.address)  # the next one
        # b is a follower naming c:3: followed at once, and the next failure rotates on from there.
        seen.append(c.usable("c:3"))
        await c.close(rotate=False)
        c.follow("c:3")
        c.stub()
        seen.append(c.address)
        c.failed()
        # A follower still naming the leader that just failed (its lease has not run out) is not followed.
        seen.append(c.usable("c:3"))
        seen.append(c.usable(""))  # no leader known yet
        await c.close(rotate=True)
        c.stub()
        seen.append(c.address)  # back to the configured addresses
        await c.close(rotate=False)
        return seen

    assert asyncio.run(go()) == ["a:1", "b:2", True, "c:3", False, False, "b:2"]


def test_the_pause_doubles_up_to_its_cap_and_a_registration_resets_it() -> None:
    c = link()
    assert [round(c.failed(), 3) for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    c.registered()
    assert c.failed() == 0.05


def test_a_registration_that_ran_out_of_time_gets_twice_as_long_next_time_up_to_its_cap() -> None:
    """A busy coordinator (a fleet registering at once) answers late: the deadline grows instead of
    giving up on every answer; a registration brings it back to the short one."""
    c = CoordinatorLink(
        ["a:1"], keepalive_s=0.5, reconnect_initial_s=0.05, reconnect_max_s=0.3,
        register_timeout_s=2.0, register_timeout_max_s=30.0,
    )  # fmt: skip
    deadlines = [c.register_timeout_s]
    for _ in range(5):
        c.registration_timed_out()
        deadlines.append(c.register_timeout_s)
    assert deadlines == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    c.registered()
    assert c.register_timeout_s == 2.0

"""The coordinator's one write path folds every event once: the state its transitions produced is
the state the planner reads and the store writes, not folded again for each of them (at thousands of
members, each fold of a commit's events copies the members). Real redis-server, the engine in process."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable

import pytest

from remesh.coordinator.model import ClusterState, Event, EventType, Fold
from remesh.coordinator.settings import PlannerSettings
from remesh.embedded import RedisServer
from tests.in_process import live_job, until

pytestmark = pytest.mark.integration


def test_every_committed_event_is_folded_once(
    redis_server: RedisServer, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folded: list[Event] = []
    fold_add = Fold.add

    def counted(self: Fold, events: Iterable[Event]) -> ClusterState:
        events = list(events)
        folded.extend(events)
        return fold_add(self, events)

    monkeypatch.setattr(Fold, "add", counted)

    async def scenario() -> list[Event]:
        # Registrations and acknowledgements are batched (each checked against the state the ones
        # before it produced), a drain is a change of its own, and plans add events to the commits
        # they are planned in: every kind of commit the write path makes.
        async with live_job(redis_server.url, job_id, ["h1", "h2", "h3"], PlannerSettings(world_size=2)) as (
            coordinator,
            _,
        ):
            epoch = coordinator.state.epoch
            topology = coordinator.state.topology
            assert topology is not None
            await coordinator.drain(topology.host_ids[0], "operator")
            await until(lambda: coordinator.state.epoch > epoch)
            return await coordinator.store.read_events()

    stored = asyncio.run(scenario())
    kinds = {e.type for e in stored}
    assert {EventType.MEMBER_JOINED, EventType.EPOCH_LIVE, EventType.MEMBER_DRAINING} <= kinds
    assert sum(e.type is EventType.TOPOLOGY_CHANGED for e in stored) == 2
    assert Counter(e.to_json() for e in folded) == Counter(e.to_json() for e in stored)

"""The coordinator's count of its members by state and role (``model.tally``), kept commit by commit:
pure, no Redis."""

from __future__ import annotations

import json
from collections.abc import Callable

from remesh.coordinator import membership
from remesh.coordinator.model import ClusterState, Event, EventType, MemberState, Role, replay, tally

NOW = 100.0


def test_a_tally_kept_from_the_events_equals_a_count_from_scratch() -> None:
    """``model.tally`` looks only at the hosts a commit's events name: registrations, first beats,
    deaths, forgetting and a compaction leave it equal to counting every member again."""
    state = ClusterState()
    kept = tally(state.members)
    steps: list[Callable[[ClusterState], list[Event]]] = [
        *(
            lambda s, h=h: membership.register(NOW, s, h, Role.ACTIVE, 1, "10.0.0.1")[0]
            for h in ("a", "b", "c")
        ),
        lambda s: membership.register(NOW, s, "s", Role.SPARE, 1, "10.0.0.9")[0],
        *(lambda s, h=h: membership.heartbeat(NOW, s, h, 1) for h in ("a", "b", "s")),
        lambda s: membership.declare(NOW, s, "b", 1, MemberState.DEAD, "no heartbeat"),
        lambda s: membership.expire(NOW + 10, s, retention_s=1.0),  # forgets b
        lambda s: [
            Event(EventType.LOG_COMPACTED, NOW, s.epoch, "cut", details={"state": json.dumps(s.to_dict())})
        ],
    ]
    for step in steps:
        events = step(state)
        state = replay(events, state)
        kept = tally(state.members, kept, events)
        assert kept.of is state.members
        assert kept.counts == tally(state.members).counts
    assert "b" not in state.members
    assert kept.count(MemberState.ALIVE) == 2 and kept.count(MemberState.ALIVE, Role.ACTIVE) == 1
    assert kept.count(MemberState.JOINING, Role.ACTIVE) == 1  # c registered, never beat

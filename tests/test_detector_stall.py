"""A stall of the coordinator itself is not held against the members (pure parts, no I/O)."""

from __future__ import annotations

from remesh.coordinator.detector import Liveness, judge
from remesh.coordinator.model import ClusterState, Member, MemberState, Role
from remesh.coordinator.service import Coordinator
from remesh.coordinator.settings import Settings
from remesh.coordinator.store import RedisStore


def test_silence_the_coordinator_could_not_observe_is_credited() -> None:
    settings = Settings.local()
    state = ClusterState(members={"h": Member("h", 1, Role.ACTIVE, MemberState.ALIVE)})
    coordinator = Coordinator(settings, RedisStore("redis://127.0.0.1:9/0", "stall"), clock=lambda: 100.0)
    coordinator._liveness.set("h", Liveness(1, last_seen=99.9))
    # The event loop did not run for 2 s: without the credit the member looks 2.1 s silent.
    assert [v.state for v in judge(102.0, state, coordinator._liveness, settings.detector)] == [
        MemberState.DEAD
    ]
    coordinator._credit_stall(2.0)
    assert judge(102.0, state, coordinator._liveness, settings.detector) == []
    # Real silence after the stall still counts.
    later = 102.0 + settings.detector.heartbeat_timeout_s
    assert [v.state for v in judge(later, state, coordinator._liveness, settings.detector)] == [
        MemberState.DEAD
    ]

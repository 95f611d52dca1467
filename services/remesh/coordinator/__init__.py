"""The remesh coordinator: membership in Redis, failure detection, topology epochs, the event log.

Layers, inner to outer (an inner one never imports an outer one):

- ``model``, ``membership``, ``detector``, ``planner``: the pure core — data, transitions, verdicts,
  decisions. No I/O, no clock.
- ``store``: Redis (atomic commits, the event stream).
- ``service``: the asyncio engine that runs the core against the store and keeps liveness in memory.
- ``convert``, ``server``: the gRPC adapter.
"""

from remesh.coordinator.model import (
    ClusterState,
    Event,
    EventType,
    Member,
    MemberState,
    Role,
    Topology,
    replay,
)
from remesh.coordinator.server import RunningCoordinator, serve
from remesh.coordinator.settings import DetectorSettings, PlannerSettings, Settings

__all__ = [
    "ClusterState",
    "DetectorSettings",
    "Event",
    "EventType",
    "Member",
    "MemberState",
    "PlannerSettings",
    "Role",
    "RunningCoordinator",
    "Settings",
    "Topology",
    "replay",
    "serve",
]

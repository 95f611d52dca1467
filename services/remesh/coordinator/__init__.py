"""The remesh coordinator: membership in Redis, failure detection, topology epochs, the event log.

Layers, inner to outer (an inner one never imports an outer one):

- ``model``, ``membership``, ``detector``, ``observations``, ``planner``: the pure core — data,
  transitions, verdicts, what agents said beside the event log, decisions. No I/O, no clock.
- ``store``, ``state_codec``: Redis (atomic commits, the event stream; the state's layout in it).
- ``service``, ``agent_stream``, ``doorbell``: the asyncio engine that runs the core against the
  store, keeps liveness in memory and queues commands on agents' streams.
- ``convert``, ``fanout``, ``rpc``: gRPC building blocks (protobuf translation, topologies encoded
  once for many streams; admission, statuses, binding, server options). A topology relay
  (``relay``) is built from these alone.
- ``servicer``: the Coordinator service's handlers, on the engine.
- ``server``: the coordinator process wired together (``serve``).
"""

from typing import TYPE_CHECKING, Any

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
from remesh.coordinator.settings import DetectorSettings, PlannerSettings, Settings

if TYPE_CHECKING:
    from remesh.coordinator.server import RunningCoordinator, serve

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


def __getattr__(name: str) -> Any:
    # The server pulls in grpc.aio and Redis; the operator commands, which need only the model, skip it.
    if name in ("serve", "RunningCoordinator"):
        from remesh.coordinator import server

        return getattr(server, name)
    raise AttributeError(name)

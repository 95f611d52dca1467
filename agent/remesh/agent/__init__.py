"""The remesh agent: the per-host daemon that registers with the coordinator, heartbeats, supervises
the trainer process and serves it the local API (``remesh.v1.AgentLocal``).

It imports only the protos, never the coordinator.
"""

from remesh.agent.daemon import Agent, AgentExit
from remesh.agent.settings import AgentSettings
from remesh.v1.contract import RESTART_EXIT_CODE

__all__ = ["RESTART_EXIT_CODE", "Agent", "AgentExit", "AgentSettings"]

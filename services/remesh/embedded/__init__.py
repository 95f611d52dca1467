"""Real servers started on this machine for the demo and the tests (never fakes)."""

from remesh.embedded._process import bound_to_parent, free_port, stop_on_sigterm
from remesh.embedded.gcs_server import FakeGcsServer
from remesh.embedded.redis_server import RedisExited, RedisServer, find_redis_server

__all__ = [
    "FakeGcsServer",
    "RedisExited",
    "RedisServer",
    "bound_to_parent",
    "find_redis_server",
    "free_port",
    "stop_on_sigterm",
]

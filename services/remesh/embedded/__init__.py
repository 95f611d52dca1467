"""Real servers started on this machine for the demo and the tests (never fakes)."""

from remesh.embedded._process import free_port
from remesh.embedded.gcs_server import FakeGcsServer
from remesh.embedded.redis_server import RedisServer, find_redis_server

__all__ = ["FakeGcsServer", "RedisServer", "find_redis_server", "free_port"]

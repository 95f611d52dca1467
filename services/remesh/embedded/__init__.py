"""Real servers started on this machine for the demo and the tests (never fakes)."""

from remesh.embedded._process import free_port
from remesh.embedded.gcs_server import FakeGcsServer
from remesh.embedded.redis_server import RedisExited, RedisServer, find_redis_server

__all__ = ["FakeGcsServer", "RedisExited", "RedisServer", "find_redis_server", "free_port"]

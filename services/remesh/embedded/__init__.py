"""A job's surroundings made on this machine, never fakes: real servers (Redis, a GCS emulator), a
development CA (``certs``) and a job of real processes (``cluster``), for ``remesh demo``,
``remesh coordinator --redis embedded``, ``remesh certs``, the tests and the benchmarks.
"""

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

"""Fixtures: a real redis-server per session (and private ones for tests that stop it), real processes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from remesh.embedded import RedisServer
from tests.procs import Cluster, jax_port_base_of_worker
from tests.redis_cluster import RedisClusterServers

# Every coordinator a test starts (the tests', the demo's, the soak's) derives its JAX coordination
# ports from this: the suite's parallel workers each get a range of their own, below Linux's
# ephemeral ports, so two jobs on two workers never pick the same port for an epoch (a collision
# re-forms the job once more, which tests that count epochs would read as a failure).
os.environ["REMESH_JAX_PORT_BASE"] = str(jax_port_base_of_worker(os.environ.get("PYTEST_XDIST_WORKER", "")))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer(appendonly=False) as server:
        yield server


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own, with AOF, so the test may stop and restart it."""
    with RedisServer(appendonly=True) as server:
        yield server


@pytest.fixture
def job_id() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def cluster(tmp_path: Path, redis_server: RedisServer, job_id: str) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis_server.url, job_id)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="session")
def redis_cluster_servers() -> Iterator[RedisClusterServers]:
    """A real 3-master Redis Cluster (redis-cli --cluster create), shared by the session."""
    with RedisClusterServers(masters=3) as servers:
        yield servers


@pytest.fixture(params=["redis", "redis-cluster"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """The same test against one redis-server and against a 3-master Redis Cluster."""
    if request.param == "redis-cluster":
        return str(request.getfixturevalue("redis_cluster_servers").url)
    return str(request.getfixturevalue("redis_server").url)


@pytest.fixture
def any_cluster(tmp_path: Path, redis_url: str, job_id: str) -> Iterator[Cluster]:
    """A job on one redis-server, then on a Redis Cluster (``redis+cluster://``)."""
    c = Cluster(tmp_path, redis_url, job_id)
    try:
        yield c
    finally:
        c.close()

"""Fixtures: a real redis-server per session (and private ones for tests that stop it), real processes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from remesh.embedded import RedisServer
from remesh.embedded.redis_cluster import RedisClusterServers
from tests.procs import Cluster


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


# Modules whose tests run JAX trainer processes (a job of 3-4 of them, each compiling and training
# on 2 virtual CPU devices). Under pytest-xdist (`make test`: two workers) they all go to one worker,
# one test at a time, as a test of them was written for a 2-core machine of its own; the control
# plane's tests, whose processes are few and mostly wait, run on the other worker beside them.
TRAINER_MODULES = frozenset(
    {
        "test_checkpoints",
        "test_demo_e2e",
        "test_elastic_e2e",
        "test_reliability_e2e",
        "test_sharded_e2e",
        "test_soak",
        "test_steady_state",
        "test_tinylm",
    }
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in TRAINER_MODULES:
            item.add_marker(pytest.mark.xdist_group("trainers"))

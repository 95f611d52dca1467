"""The elastic trainer end to end: real coordinator, agents and JAX trainer processes (tinylm,
3 hosts x 2 CPU devices joined by jax.distributed and gloo), hosts killed with SIGKILL mid-run."""

from __future__ import annotations

import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from remesh.coordinator.settings import PlannerSettings
from remesh.embedded import RedisServer
from remesh.v1 import coordinator_pb2 as pb
from tests.procs import Cluster, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
KILL_AT = 15
ENV = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def trainer(final: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "examples.tinylm.train_elastic",
        "--steps", str(STEPS), "--d-model", "64", "--layers", "1", "--seq-len", "32",
        "--log-every", "5", "--step-sleep", "0.05", "--save-final", str(final), *extra,
    ]  # fmt: skip


def run_job(
    tmp: Path,
    redis_url: str,
    *,
    spares: int,
    victim: str | None,
    coordinator_args: tuple[str, ...] = (),
    job: str | None = None,
) -> tuple[Path, Cluster]:
    """Run a 3-host tinylm job to STEPS, SIGKILLing ``victim`` once it passed step KILL_AT."""
    tmp.mkdir(parents=True, exist_ok=True)
    final = tmp / "final.npz"
    cluster = Cluster(tmp, redis_url, job or new_job_id())
    try:
        cluster.start_coordinator("--world-size", "3", *coordinator_args)
        warm = () if victim else ("--no-warm-standby",)  # a run without failures needs no standby
        for h in ("host-0", "host-1", "host-2"):
            cluster.start_agent(h, trainer=trainer(final), env=ENV, extra=warm)
        for i in range(spares):
            cluster.start_agent(f"spare-{i}", spare=True, trainer=trainer(final), env=ENV, extra=warm)
        if victim:

            def reached() -> bool:
                member = cluster.members().get(victim)
                return member is not None and member.last_step >= KILL_AT

            wait_for(reached, 180, f"{victim} to reach step {KILL_AT}")
            cluster.agents[victim].kill()
        wait_for(final.exists, 240, "the job to finish")
    except BaseException:
        cluster.close()
        raise
    return final, cluster


def new_job_id() -> str:
    return f"e2e-{uuid.uuid4().hex[:8]}"


def leaves(path: Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer(appendonly=False) as server:
        yield server


@pytest.fixture(scope="module")
def clean_final(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Path]:
    final, cluster = run_job(tmp_path_factory.mktemp("clean"), redis.url, spares=0, victim=None)
    cluster.close()
    yield final


def steps_logged(cluster: Cluster) -> list[tuple[int, float, int]]:
    """(step, loss, world size) lines the trainers logged, across every agent log."""
    import re

    rows = set()
    for log in cluster.tmp.glob("agent-*.log"):
        for m in re.finditer(r"\] step\s+.*?loss=([\d.]+).*?step=(\d+) world_size=(\d+)", log.read_text()):
            rows.add((int(m.group(2)), float(m.group(1)), int(m.group(3))))
    return sorted(rows)


def test_a_killed_host_is_replaced_by_the_spare_and_the_result_is_bitwise_equal(
    tmp_path: Path, redis: RedisServer, clean_final: Path
) -> None:
    final, cluster = run_job(tmp_path, redis.url, spares=1, victim="host-1")
    try:
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "spare-0", "host-2"]
        events = cluster.events()
        acks = [e for e in events if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 2]
        assert sorted(e.host_id for e in acks) == ["host-0", "host-2", "spare-0"]
        # Every member resumed at the epoch's restore step, from host memory or from a peer that had it.
        assert {int(e.details["restored_step"]) for e in acks} == {after.restore_step}
        assert after.restore_step >= KILL_AT
        assert all(
            e.details["restore_source"] in ("memory", "host-shm") or "peer" in e.details["restore_source"]
            for e in acks
        )
        for a, b in zip(leaves(final), leaves(clean_final), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.array_equal(a, b), "parameters differ from the run without failure"
    finally:
        cluster.close()


def test_killing_the_host_of_process_0_is_recovered_and_bitwise_equal(
    tmp_path: Path, redis: RedisServer, clean_final: Path
) -> None:
    final, cluster = run_job(tmp_path, redis.url, spares=1, victim="host-0")
    try:
        after = cluster.topology()
        assert after.members[0].host_id == "spare-0"
        for a, b in zip(leaves(final), leaves(clean_final), strict=True):
            assert np.array_equal(a, b)
    finally:
        cluster.close()


def test_without_a_spare_the_job_shrinks_and_the_loss_keeps_falling(
    tmp_path: Path, redis: RedisServer
) -> None:
    final, cluster = run_job(
        tmp_path, redis.url, spares=0, victim="host-2", coordinator_args=("--min-world-size", "2")
    )
    try:
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "host-1"]
        rows = steps_logged(cluster)
        assert {ws for _, _, ws in rows} == {3, 2}
        shrunk = [(s, loss) for s, loss, ws in rows if ws == 2]
        assert shrunk and shrunk[-1][0] == STEPS
        assert shrunk[-1][1] < rows[0][1], f"loss did not fall: {rows}"
        assert final.exists()
    finally:
        cluster.close()


def test_a_taken_jax_port_moves_the_job_to_a_new_address_and_blames_no_host(
    tmp_path: Path, redis: RedisServer, clean_final: Path
) -> None:
    """Another process listens on the port of epoch 1 (accepting connections, answering nothing)."""
    job = new_job_id()
    port = PlannerSettings().jax_port(job, 1)
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("::", port))
        squatter.listen()
        final, cluster = run_job(tmp_path, redis.url, spares=0, victim=None, job=job)
    try:
        events = cluster.events()
        refused = [e for e in events if e.type == pb.EVENT_TYPE_FAULT_REPORTED]
        assert [(e.host_id, e.details["kind"], e.details["epoch"]) for e in refused] == [
            ("host-0", "address_in_use", "1")
        ], [e.reason for e in refused]
        assert f":{port}" in refused[0].reason
        assert not [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD]
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "host-1", "host-2"]
        assert not after.jax_coordinator_address.endswith(f":{port}")
        # Nobody trained in the refused epoch: the run is the clean one.
        for a, b in zip(leaves(final), leaves(clean_final), strict=True):
            assert np.array_equal(a, b)
    finally:
        cluster.close()

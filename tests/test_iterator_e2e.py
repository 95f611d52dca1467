"""Grain iterators that keep their own position, end to end: real coordinator, agents and JAX trainers
(examples/tinylm/train_own_loop.py, 3 hosts x 2 CPU devices), a host SIGKILLed mid-run.

Every trainer logs the windows each step read. After the kill, the trajectory the job kept (each
step as it last ran) read at every step exactly the windows the run without the kill read:

- per-host ``DatasetIterator``s with a spare: the spare takes the position of the host it replaces,
  the survivors their own, and the run ends on the clean run's state, bit for bit;
- Grain's ``ElasticIterator`` (``shared_state=True``) when the job shrinks from 3 hosts to 2: its
  position holds for any number of hosts, and the 2 read each step's windows between them;
- per-host ``DatasetIterator``s when the job shrinks: their positions are not re-split, so the job
  halts, every trainer naming ``data-position-lost`` and what to use instead.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from remesh.embedded import RedisServer
from remesh.v1 import coordinator_pb2 as pb
from tests import test_elastic_e2e
from tests.procs import Cluster, wait_for
from tests.test_elastic_e2e import ENV, KILL_AT, STEPS, leaves, new_job_id, run_job

# The Redis server of test_elastic_e2e's jobs, one per module: a fixture shared by name.
redis = test_elastic_e2e.redis

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GLOBAL = 24


def own_loop(tmp: Path, given: str) -> list[str]:
    return [
        sys.executable, "-m", "examples.tinylm.train_own_loop", "--steps", str(STEPS),
        "--d-model", "64", "--layers", "1", "--seq-len", "32", "--batch", str(GLOBAL),
        "--step-sleep", "0.05", "--save-final", str(tmp / "final.npz"),
        "--input", given, "--input-log", str(tmp / "read.jsonl"),
    ]  # fmt: skip


def kept(tmp: Path) -> dict[int, list[int]]:
    """Step -> the windows it read (every rank's, sorted), in the newest epoch that ran it: the
    trajectory the job kept."""
    rows = [json.loads(line) for line in (tmp / "read.jsonl").read_text().splitlines()]
    newest = epochs_of(tmp)
    steps: dict[int, list[int]] = {}
    for row in rows:
        if row["epoch"] == newest[row["step"]]:
            steps.setdefault(row["step"], []).extend(row["offsets"])
    return {step: sorted(windows) for step, windows in sorted(steps.items())}


def epochs_of(tmp: Path) -> dict[int, int]:
    """Step -> the newest epoch that read it (the trajectory kept)."""
    newest: dict[int, int] = {}
    for line in (tmp / "read.jsonl").read_text().splitlines():
        row = json.loads(line)
        newest[row["step"]] = max(newest.get(row["step"], 0), row["epoch"])
    return newest


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Path]:
    tmp = tmp_path_factory.mktemp("clean")
    _, cluster = run_job(tmp, redis.url, spares=0, victim=None, command=own_loop(tmp, "iterator"))
    cluster.close()
    read = kept(tmp)
    assert sorted(read) == list(range(STEPS)) and all(len(w) == GLOBAL for w in read.values())
    assert max(Counter(w for ws in read.values() for w in ws).values()) == 1  # every window once
    yield tmp


def positions_logged(cluster: Cluster, epoch: int) -> set[str]:
    """How each trainer of ``epoch`` had its iterator's position ("rank 1", "shared", ...)."""
    found = set()
    for agent in cluster.agents.values():
        for m in re.finditer(
            r"input resumes from its iterator's position position=(\S+(?: \d)?)\S* .*", agent.output()
        ):
            if f"recovery={cluster.job}#{epoch}" in m.group(0):
                found.add(m.group(1).strip("'"))
    return found


def kill_host_1(tmp: Path, redis: RedisServer, given: str, spares: int) -> tuple[Path, Cluster]:
    """The own loop reading ``given`` (--input) on 3 hosts and ``spares`` spares, host-1 SIGKILLed."""
    return run_job(tmp, redis.url, spares=spares, victim="host-1", command=own_loop(tmp, given))


def test_per_host_grain_iterators_resume_at_exactly_the_right_window_when_a_spare_replaces_a_host(
    tmp_path: Path, redis: RedisServer, clean: Path
) -> None:
    final, cluster = kill_host_1(tmp_path, redis, "iterator", spares=1)
    try:
        assert [m.host_id for m in cluster.topology().members] == ["host-0", "spare-0", "host-2"]
        assert positions_logged(cluster, 2) == {"rank 0", "rank 1", "rank 2"}
        assert max(epochs_of(tmp_path).values()) == 2  # steps were replayed in epoch 2
        assert kept(tmp_path) == kept(clean)
        for a, b in zip(leaves(final), leaves(clean / "final.npz"), strict=True):
            assert a.tobytes() == b.tobytes(), "the state differs from the run without the kill"
    finally:
        cluster.close()


def test_an_elastic_iterator_carries_its_position_when_the_job_shrinks(
    tmp_path: Path, redis: RedisServer, clean: Path
) -> None:
    _, cluster = kill_host_1(tmp_path, redis, "elastic", spares=0)
    try:
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "host-2"]
        assert positions_logged(cluster, 2) == {"shared"}
        # ElasticIterator's global batch s is windows s*G to (s+1)*G-1 of the same shuffled order as
        # the per-host iterators' of the clean run: the same windows at every step, on 3 hosts or 2.
        assert kept(tmp_path) == kept(clean)
    finally:
        cluster.close()


def test_per_host_iterators_are_not_re_split_when_the_job_shrinks_it_halts_naming_why(
    tmp_path: Path, redis: RedisServer
) -> None:
    job = new_job_id()
    tmp_path.mkdir(exist_ok=True)
    cluster = Cluster(tmp_path, redis.url, job)
    command = own_loop(tmp_path, "iterator")
    try:
        cluster.start_coordinator("--world-size", "3")
        for h in ("host-0", "host-1", "host-2"):
            cluster.start_agent(h, trainer=command, env=ENV)
        wait_for(
            lambda: (m := cluster.members().get("host-1")) is not None and m.last_step >= KILL_AT, 120, "step"
        )
        cluster.agents["host-1"].kill()
        wait_for(lambda: cluster.topology().halted, 120, "the job to halt")
        events = cluster.events()
        assert any(e.type == pb.EVENT_TYPE_JOB_HALTED for e in events)
        said = "".join(cluster.agents[h].output() for h in ("host-0", "host-2"))
        assert "why=data-position-lost" in said
        assert "cannot be re-split over 2" in said and "ElasticIterator" in said
        assert not (tmp_path / "final.npz").exists()
    finally:
        cluster.close()

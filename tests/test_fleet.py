"""Hundreds of simulated agents (benchmarks/fleet.py) against a real coordinator with mutual TLS: a
correlated failure of a tenth of them is one recovery, not many."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest

from benchmarks.fleet import Fleet, host_ids
from remesh.v1 import coordinator_pb2 as pb
from tests.procs import Cluster, hold, wait_for

pytestmark = pytest.mark.integration

ACTIVE, SPARES = 180, 20


@pytest.fixture
def fleet(cluster: Cluster) -> Iterator[Fleet]:
    cluster.start_coordinator(
        "--world-size", str(ACTIVE), "--heartbeat-interval", "0.5", "--jax-port-span", "5000"
    )  # fmt: skip
    fleet = Fleet(cluster.address, host_ids(ACTIVE), host_ids(SPARES, "spare"), processes=2, pki=cluster.pki)
    try:
        fleet.start(timeout=120)
        cluster.wait_epoch(1, timeout=60)
        wait_for(
            lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 60, "epoch 1 live"
        )
        yield fleet
    finally:
        fleet.close()


def topology_changes(cluster: Cluster, after_epoch: int) -> list[pb.Event]:
    return [e for e in cluster.events() if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED and e.epoch > after_epoch]


@pytest.mark.timeout(300)
def test_a_tenth_of_the_fleet_killed_at_once_is_one_epoch_every_survivor_receives(
    cluster: Cluster, fleet: Fleet
) -> None:
    before = cluster.topology().epoch
    victims = random.Random(13).sample(list(fleet.hosts), ACTIVE // 10)
    fleet.command("crash", victims)
    wait_for(lambda: topology_changes(cluster, before), 30, "a new epoch")
    # Past detection (stream grace) and the planner's burst window several times over: no second one.
    hold(3.0, lambda: _one(topology_changes(cluster, before)))
    (change,) = topology_changes(cluster, before)
    new = change.topology
    assert not set(victims) & {m.host_id for m in new.members}
    assert len(new.members) == ACTIVE  # every victim replaced by a spare
    dead = {e.host_id for e in cluster.events() if e.type == pb.EVENT_TYPE_MEMBER_DEAD}
    assert dead == set(victims)
    survivors = set(fleet.hosts) | set(fleet.spares)
    survivors -= set(victims)
    wait_for(lambda: survivors <= set(fleet.received(new.epoch)), 30, "every survivor to receive the epoch")
    # A tenth of the members changed: each survivor's stream carried the epoch as a delta from the
    # one before, and every delta applied to the topology that stream held.
    assert survivors <= fleet.as_delta.get(new.epoch, set())
    assert not [t for t in fleet.trouble if "delta" in t], fleet.trouble
    replayed = subprocess.run(
        [sys.executable, "-m", "remesh.cli", "replay", "--coordinator", cluster.address],
        capture_output=True, text=True, timeout=60, env={**os.environ, **cluster.client_env()},
    )  # fmt: skip
    assert replayed.stdout.startswith("replay matches the live state"), replayed.stdout + replayed.stderr


def _one(changes: list[pb.Event]) -> None:
    assert len(changes) == 1, [(e.epoch, e.reason) for e in changes]

"""A host cut off by the network, for real: its agent runs in a network namespace of its own, joined to
the coordinator by a veth pair that the test takes down and brings back up.

The coordinator declares the host dead and replaces it with the spare; the cut-off agent, having had
no coordinator for its lease, stops its trainer (which no longer holds its rank); when the link
returns the host rejoins as a spare and no epoch changes. Where the kernel refuses namespaces the test
is skipped with the reason; the same scenario with SIGSTOP instead of a cut link always runs in
test_control_plane.py (test_silent_host_is_declared_dead_and_rejoins_as_a_spare).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from remesh.embedded import RedisServer
from remesh.embedded.cluster import LocalCluster, Proc, wait_for
from remesh.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.integration

LEASE_S = 2.0


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@dataclass
class Link:
    """A namespace ``ns`` joined to this one by veth ``outside`` (here) / ``inside`` (in ``ns``)."""

    ns: str
    outside: str
    here_ip: str
    there_ip: str

    def set(self, up: bool) -> None:
        result = ip("link", "set", self.outside, "up" if up else "down")
        assert result.returncode == 0, result.stderr


@pytest.fixture
def link() -> Iterator[Link]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN); the SIGSTOP variant runs instead")
    tag = uuid.uuid4().hex[:6]
    ns, outside, inside = f"remesh-{tag}", f"rmo{tag}", f"rmi{tag}"
    subnet = random.randrange(1, 250)
    here, there = f"10.251.{subnet}.1", f"10.251.{subnet}.2"
    made = ip("netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(
            f"the kernel refused a network namespace ({made.stderr.strip()}); SIGSTOP variant runs instead"
        )
    try:
        for args in (
            ("link", "add", outside, "type", "veth", "peer", "name", inside),
            ("link", "set", inside, "netns", ns),
            ("addr", "add", f"{here}/30", "dev", outside),
            ("link", "set", outside, "up"),
            ("netns", "exec", ns, "ip", "addr", "add", f"{there}/30", "dev", inside),
            ("netns", "exec", ns, "ip", "link", "set", inside, "up"),
            ("netns", "exec", ns, "ip", "link", "set", "lo", "up"),
        ):
            result = ip(*args)
            if result.returncode != 0:
                pytest.skip(f"could not build the veth link (ip {' '.join(args)}: {result.stderr.strip()})")
        yield Link(ns, outside, here, there)
    finally:
        ip("link", "del", outside)  # removes its peer too
        ip("netns", "del", ns)


class LinkedCluster(LocalCluster):
    """A job whose coordinator listens on the veth address, reachable from here and from the namespace."""

    def __init__(self, tmp: Path, redis_url: str, job: str, link: Link) -> None:
        super().__init__(tmp, redis_url, job)
        self.link = link

    @property
    def address(self) -> str:
        return f"{self.link.here_ip}:{self.port}"

    def start_cut_off_agent(self, host_id: str) -> Proc:
        args = [
            "ip", "netns", "exec", self.link.ns,
            sys.executable, "-m", "remesh.cli", "agent", "--coordinator", self.address,
            "--host-id", host_id, "--address", self.link.there_ip, "--job", self.job,
            "--lease", str(LEASE_S), "--", sys.executable, "-m", "remesh.agent.standin",
        ]  # fmt: skip
        proc = Proc(args, self.tmp / f"agent-{host_id}.log")
        self.procs.append(proc)
        self.agents[host_id] = proc
        return proc


def test_a_host_cut_off_by_the_network_is_replaced_stops_its_trainer_and_rejoins_as_a_spare(
    tmp_path: Path, redis_server: RedisServer, link: Link
) -> None:
    with LinkedCluster(tmp_path, redis_server.url, f"part-{uuid.uuid4().hex[:8]}", link) as cluster:
        cluster.start_coordinator("--world-size", "3", "--listen", f"{link.here_ip}:0")
        for h in ("host-0", "host-1"):
            cluster.start_agent(h, extra=["--lease", str(LEASE_S)])
        victim = cluster.start_cut_off_agent("host-2")
        cluster.start_agent("spare-0", spare=True)
        cluster.wait_epoch(1)
        wait_for(
            lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live"
        )
        before = cluster.members()["host-2"]
        assert before.rank == 2

        link.set(up=False)
        topology = cluster.wait_epoch(2, timeout=10)
        assert [m.host_id for m in sorted(topology.members, key=lambda m: m.rank)] == [
            "host-0",
            "host-1",
            "spare-0",
        ]
        dead = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_MEMBER_DEAD and e.host_id == "host-2"]
        assert dead, "the cut-off host was never declared dead"
        # Cut off, the agent cannot know it was replaced; its lease running out tells it.
        wait_for(
            lambda: "lease lost" in victim.output(), LEASE_S + 10, "the cut-off agent's lease to run out"
        )
        log = victim.output()
        assert "stopping trainer" in log.split("lease lost", 1)[1], log[-2000:]

        link.set(up=True)

        def rejoined() -> pb.Member | None:
            m = cluster.members()["host-2"]
            return m if m.incarnation > before.incarnation and m.state == pb.MEMBER_STATE_ALIVE else None

        member = wait_for(rejoined, 30, "the host to rejoin once the link is back")
        assert member.role == pb.ROLE_SPARE and member.rank == -1  # type: ignore[union-attr]
        assert cluster.topology().epoch == 2, "its return changed no topology"
        epochs = [e.epoch for e in cluster.events() if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED]
        assert epochs == sorted(set(epochs)) == [1, 2]

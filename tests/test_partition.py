"""A host cut off by the network: the coordinator declares it dead and gives its rank to the spare; the
cut-off agent, having had no coordinator for its lease, stops its trainer (which no longer holds its
rank); when the link returns the host rejoins as a spare and no epoch changes.

Two ways to cut the link, one scenario:

- a TCP proxy (``benchmarks/connect_proxy.py``, the soak's: the agent reaches the coordinator
  through it by ``grpc_proxy``) cut and restored by the test: needs no privilege, always runs. Cut
  "reset", the connections end at once (the coordinator sees the stream break); cut "silent", they
  stay open and carry nothing (only heartbeat deadlines and keepalives notice, as behind a pulled
  cable).
- the agent in a network namespace of its own, joined to the coordinator by a veth pair that the test
  takes down and brings back up: the kernel's own link. Needs root (CAP_NET_ADMIN); without it the
  test is skipped, and says so in pytest's summary (``-ra``), naming the proxy test that covers it.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.connect_proxy import ConnectProxy, CutMode
from remesh.embedded import RedisServer
from remesh.embedded.cluster import LocalCluster, Proc
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.security import Role
from tests.procs import wait_for
from tests.test_metrics import metrics_port, scrape, value

pytestmark = pytest.mark.integration

LEASE_S = 2.0
# What a skip of the namespace test says (pytest -ra prints it in the summary of every run).
NO_NAMESPACE = (
    "PARTITION BY A REAL LINK NOT TESTED: {why}; the unprivileged TCP-proxy variant "
    "test_a_host_cut_off_by_a_tcp_proxy_is_replaced_stops_its_trainer_and_rejoins_as_a_spare covers "
    "the same scenario"
)


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
        pytest.skip(NO_NAMESPACE.format(why="network namespaces need root (CAP_NET_ADMIN)"))
    if shutil.which("ip") is None:
        pytest.skip(NO_NAMESPACE.format(why="no `ip` command (iproute2) on PATH"))
    tag = uuid.uuid4().hex[:6]
    ns, outside, inside = f"remesh-{tag}", f"rmo{tag}", f"rmi{tag}"
    subnet = random.randrange(1, 250)
    here, there = f"10.251.{subnet}.1", f"10.251.{subnet}.2"
    made = ip("netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(
            NO_NAMESPACE.format(why=f"the kernel refused a network namespace ({made.stderr.strip()})")
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
                pytest.skip(
                    NO_NAMESPACE.format(
                        why=f"could not build the veth link (ip {' '.join(args)}: {result.stderr.strip()})"
                    )
                )
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
            "--lease", str(LEASE_S), *self.tls_args(Role.HOST, host_id),
            "--", sys.executable, "-m", "remesh.embedded.standin",
        ]  # fmt: skip
        proc = Proc(args, self.tmp / f"agent-{host_id}.log")
        self.procs.append(proc)
        self.agents[host_id] = proc
        return proc


def form_job(cluster: LocalCluster, start_victim: Callable[[], Proc]) -> Proc:
    """host-0 and host-1 linked directly, host-2 (the one to cut off) started by ``start_victim``, and a
    spare; every agent with a short lease. Returns host-2's agent once epoch 1 is live."""
    for h in ("host-0", "host-1"):
        cluster.start_agent(h, extra=["--lease", str(LEASE_S)])
    victim = start_victim()
    cluster.start_agent("spare-0", spare=True)
    cluster.wait_epoch(1)
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")
    return victim


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie (exited, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def cut_off_and_rejoin(
    cluster: LocalCluster,
    victim: Proc,
    cut: Callable[[], None],
    heal: Callable[[], None],
    dead_reason: str | None = None,
    metrics_port: int | None = None,
) -> None:
    """The scenario: cut host-2 off, see it replaced and its trainer fenced by its lease, heal the link,
    see it rejoin as a spare with no new epoch. ``metrics_port``: host-2's agent's /metrics, read
    while it is cut off and after it rejoined."""
    before = cluster.members()["host-2"]
    assert before.rank == 2
    # The trainer that holds rank 2: the agent's first (a warm standby starts only after it acked).
    first = re.search(r"\] trainer started\s.*?pid=(\d+)", victim.output())
    assert first, victim.output()[-2000:]
    trainer_pid = int(first.group(1))

    cut()
    topology = cluster.wait_epoch(2, timeout=10)
    assert [m.host_id for m in sorted(topology.members, key=lambda m: m.rank)] == [
        "host-0",
        "host-1",
        "spare-0",
    ]
    assert "hot spare spare-0 takes rank 2 of host-2" in topology.reason, topology.reason
    events = cluster.events()
    dead = [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD]
    assert [e.host_id for e in dead] == ["host-2"], "the cut-off host, and nobody else, was declared dead"
    if dead_reason is not None:
        assert dead_reason in dead[0].reason, dead[0].reason
    # Cut off, the agent cannot know it was replaced; its lease running out tells it.
    wait_for(lambda: "lease lost" in victim.output(), LEASE_S + 10, "the cut-off agent's lease to run out")
    after_lease = victim.output().split("lease lost", 1)[1]
    stopped = re.search(r"stopping trainer\s.*?pid=(\d+)", after_lease)
    assert stopped and int(stopped.group(1)) == trainer_pid, after_lease[-2000:]
    wait_for(lambda: process_gone(trainer_pid), 15, "the fenced trainer to exit")
    assert victim.alive(), "the agent outlives its fenced trainer"
    me = {"host": "host-2", "job_id": cluster.job}
    if metrics_port is not None:
        cut_off = scrape(metrics_port)
        assert value(cut_off, "remesh_agent_lease_expiries_total", **me) == 1
        assert value(cut_off, "remesh_agent_connected", **me) == 0
        assert (value(cut_off, "remesh_agent_cut_off_seconds", **me) or 0) >= LEASE_S

    heal()

    def rejoined() -> pb.Member | None:
        m = cluster.members()["host-2"]
        return m if m.incarnation > before.incarnation and m.state == pb.MEMBER_STATE_ALIVE else None

    member = wait_for(rejoined, 30, "the host to rejoin once the link is back")
    assert member.role == pb.ROLE_SPARE and member.rank == -1
    if metrics_port is not None:
        back = scrape(metrics_port)
        assert value(back, "remesh_agent_cut_off_seconds", **me) == 0
        assert (value(back, "remesh_agent_registrations_total", **me) or 0) >= 2
        assert value(back, "remesh_agent_lease_expiries_total", **me) == 1
    assert cluster.topology().epoch == 2, "its return changed no topology"
    later = cluster.events()
    assert later[: len(events)] == events, "the event log only grows"
    epochs = [e.epoch for e in later if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED]
    assert epochs == [1, 2]
    # After its declaration nothing was recorded for the old incarnation: only the new one shows up.
    assert all(e.incarnation != before.incarnation for e in later[len(events) :] if e.host_id == "host-2")


@pytest.mark.parametrize("mode", ["reset", "silent"])
def test_a_host_cut_off_by_a_tcp_proxy_is_replaced_stops_its_trainer_and_rejoins_as_a_spare(
    tmp_path: Path, redis_server: RedisServer, job_id: str, mode: CutMode
) -> None:
    with LocalCluster(tmp_path, redis_server.url, job_id) as cluster:
        cluster.start_coordinator("--world-size", "3")
        with ConnectProxy([cluster.address]) as proxy:
            # Every connection host-2's agent opens goes through the proxy; its trainer's own do not.
            victim = form_job(
                cluster,
                lambda: cluster.start_agent(
                    "host-2",
                    trainer=["env", "-u", "grpc_proxy", sys.executable, "-m", "remesh.embedded.standin"],
                    extra=["--lease", str(LEASE_S), "--metrics-port", "0"],
                    env={"grpc_proxy": f"http://{proxy.address}"},
                ),
            )
            assert proxy.opened >= 1, "host-2 joined through the proxy"
            cut_off_and_rejoin(
                cluster,
                victim,
                cut=lambda: proxy.cut(mode),
                heal=proxy.restore,
                # Reset: its stream breaks at once; silent: only its heartbeats' absence gives it away.
                dead_reason="heartbeat stream broke" if mode == "reset" else "no heartbeat",
                metrics_port=metrics_port(victim),
            )
            if mode == "reset":
                # Its connection closed, the agent connected again during the cut and got no answer.
                # (Cut silently, it may instead retry on the connection it still holds, which the
                # proxy keeps open and mute: nothing new to count then.)
                assert proxy.held >= 1, "the agent did not try to reconnect during the cut"


def test_a_host_cut_off_by_the_network_is_replaced_stops_its_trainer_and_rejoins_as_a_spare(
    tmp_path: Path, redis_server: RedisServer, link: Link
) -> None:
    cluster = LinkedCluster(tmp_path, redis_server.url, f"part-{uuid.uuid4().hex[:8]}", link)
    with cluster:
        cluster.start_coordinator("--world-size", "3", "--listen", f"{link.here_ip}:0")
        victim = form_job(cluster, lambda: cluster.start_cut_off_agent("host-2"))
        cut_off_and_rejoin(cluster, victim, cut=lambda: link.set(up=False), heal=lambda: link.set(up=True))

"""Coordinator high availability: several replicas on one real Redis, one leader through a lease.

Real redis-server, real coordinator replica processes and real agents, killed and stopped with real
signals; and, in-process, two ``Coordinator`` objects on a real Redis to show the fencing token at
work: a deposed leader's write reaches Redis and is refused there.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from remesh.coordinator.errors import NotLeader
from remesh.coordinator.model import Role
from remesh.coordinator.service import Coordinator
from remesh.coordinator.settings import DetectorSettings, HaSettings, Settings
from remesh.coordinator.store import RedisStore
from remesh.embedded import RedisServer
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1 import security
from tests.procs import Cluster, Proc, assert_no_events, assert_quiet_takeover, wait_for
from tests.sockets import unread_bytes_from_me

pytestmark = pytest.mark.integration

ACTIVE = ["host-0", "host-1"]
# Stand-in trainers need no warm standby here: fewer processes on a 2-core machine.
AGENT_ARGS = ["--no-warm-standby"]
# The coordinator's detector timings (the local preset every replica here runs with).
DETECTOR = DetectorSettings()


def stub(
    cluster: Cluster, address: str, role: security.Role = security.Role.OPERATOR, name: str = "operator"
) -> pb_grpc.CoordinatorStub:
    """A stub of the replica at ``address``, as ``role/name`` (the cluster's CA)."""
    return pb_grpc.CoordinatorStub(cluster.channel(role, name, address))


def coordinator_health(cluster: Cluster, address: str) -> int:
    """The replica's gRPC health of the ``remesh.v1.Coordinator`` service (SERVING while it leads)."""
    channel = cluster.channel(security.Role.OPERATOR, "operator", address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="remesh.v1.Coordinator"), timeout=5)
        return int(reply.status)
    finally:
        channel.close()


def trailing(exc: grpc.RpcError) -> dict[str, str]:
    """A refusal's trailing metadata (where a follower names the leader)."""
    pairs: Any = exc.trailing_metadata() or ()  # (key, value) tuples at run time, whatever the stubs say
    return {str(k): str(v) for k, v in pairs}


def probe(cluster: Cluster, address: str) -> str:
    """What a replica says to a write: 'leader', 'follower:<leader named>', or 'down'."""
    try:
        stub(cluster, address, security.Role.HOST, "probe-nobody").Leave(
            pb.LeaveRequest(host_id="probe-nobody", incarnation=1), timeout=1
        )
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return "leader"  # it handled the write (and found no such host)
        metadata = trailing(exc)
        if exc.code() == grpc.StatusCode.UNAVAILABLE and "remesh-leader" in metadata:
            return f"follower:{metadata['remesh-leader']}"
    return "down"


def leader_among(cluster: Cluster, addresses: list[str]) -> str | None:
    leaders = [a for a in addresses if probe(cluster, a) == "leader"]
    assert len(leaders) <= 1, f"two replicas lead at once: {leaders}"
    return leaders[0] if leaders else None


class Replicas:
    """N coordinator replicas (--ha) of one job, and the agents given all their addresses."""

    def __init__(self, cluster: Cluster, n: int, *extra: str) -> None:
        self.cluster = cluster
        self.procs: dict[str, Proc] = {}
        for _ in range(n):
            proc = cluster.start_coordinator("--ha", "--world-size", str(len(ACTIVE)), *extra)
            self.procs[cluster.address] = proc
        cluster.addresses = list(self.procs)

    def leader(self, timeout: float = 10) -> str:
        return wait_for(lambda: leader_among(self.cluster, self.live()), timeout, "a leader")

    def live(self) -> list[str]:
        return [a for a, p in self.procs.items() if p.alive()]

    def use(self, address: str) -> None:
        """Point the cluster's read helpers (topology, members, events) at this replica."""
        self.cluster.reset_channel()
        self.cluster.port = int(address.rsplit(":", 1)[1])


def start_ha_job(cluster: Cluster, replicas: int = 3) -> Replicas:
    r = Replicas(cluster, replicas)
    leader = r.leader()
    r.use(leader)
    # Followers first: every agent starts at a follower and must follow its hint to the leader.
    cluster.addresses = [a for a in r.procs if a != leader] + [leader]
    for h in ACTIVE:
        cluster.start_agent(h, extra=AGENT_ARGS)
    cluster.start_agent("spare-0", spare=True, extra=AGENT_ARGS)
    cluster.wait_epoch(1)
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")
    return r


def all_reregistered(cluster: Cluster, before: dict[str, pb.Member]) -> bool:
    try:
        members = cluster.members()
    except grpc.RpcError:
        return False
    return all(
        members[h].state == pb.MEMBER_STATE_ALIVE and members[h].incarnation > before[h].incarnation
        for h in before
    )


def epochs_strictly_increase(events: list[pb.Event]) -> bool:
    epochs = [e.epoch for e in events if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED]
    return all(a < b for a, b in itertools.pairwise(epochs))


def test_followers_serve_reads_then_sigkill_of_the_leader_a_follower_leads_evicting_nobody(
    cluster: Cluster,
) -> None:
    """How fast a follower takes over is benchmarks' to measure; here: that one does, and whom it evicts."""
    r = start_ha_job(cluster)
    old = r.leader()
    before = cluster.members()
    for follower in [a for a in r.procs if a != old]:
        # Reads are served from Redis by every replica, and agree.
        assert stub(cluster, follower).GetTopology(pb.GetTopologyRequest(), timeout=5) == cluster.topology()
        listed = stub(cluster, follower).ListMembers(pb.ListMembersRequest(), timeout=5)
        assert {m.host_id for m in listed.members} == {*ACTIVE, "spare-0"}
        # A write is refused with UNAVAILABLE, the leader's address in the trailing metadata and the text.
        with pytest.raises(grpc.RpcError) as refused:
            stub(cluster, follower, security.Role.HOST, "late-host").Register(
                pb.RegisterRequest(host_id="late-host", device_count=1), timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert trailing(refused.value)["remesh-leader"] == old
        assert f"the leader is at {old}" in (refused.value.details() or "")
    assert "late-host" not in cluster.members(), "a refused write changes nothing"
    # What a load balancer asks: the Coordinator service is SERVING on the leader alone. The
    # health service's own "" stays SERVING on every replica while its process serves.
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    wait_for(
        lambda: (
            {a: coordinator_health(cluster, a) for a in r.procs}
            == {a: SERVING if a == old else NOT_SERVING for a in r.procs}
        ),
        10,
        "the Coordinator service SERVING on the leader only",
    )
    for host in cluster.agents:
        log = cluster.agents[host].output()
        assert "coordinator is a follower" in log and "following=True" in log, log[-2000:]
    events_before = cluster.events()

    r.procs[old].kill()  # SIGKILL
    new = r.leader(timeout=10)  # the timeout only guards against a hang
    led_at = time.monotonic()  # it took the lease, and granted every member a fresh deadline, before this
    assert new != old
    r.use(new)
    wait_for(lambda: all_reregistered(cluster, before), 10, "every agent to register with the new leader")

    # Past the grace the new leader granted plus a heartbeat timeout, nothing at all is recorded
    # (anyone it would wrongly evict has been evicted by then).
    assert_quiet_takeover(
        cluster, before, events_before, led_at + DETECTOR.failover_grace_s, DETECTOR.heartbeat_timeout_s
    )
    assert "role=leader" in r.procs[new].output()
    wait_for(
        lambda: (
            {a: coordinator_health(cluster, a) for a in r.live()}
            == {a: SERVING if a == new else NOT_SERVING for a in r.live()}
        ),
        10,
        "the new leader SERVING, the rest not",
    )

    # The new leader recovers a host failure as usual: the spare takes its rank in epoch 2, and a
    # topology watch on the remaining follower (which mirrors Redis) sees it too.
    follower = next(a for a in r.live() if a != new)
    watch = stub(cluster, follower).WatchTopology(pb.WatchTopologyRequest(after_epoch=1), timeout=20)
    ranks = {m.host_id: m.rank for m in cluster.topology().members}
    cluster.agents["host-1"].kill()
    after = cluster.wait_epoch(2, timeout=10)
    assert next(iter(watch)) == after
    assert {m.host_id: m.rank for m in after.members}["spare-0"] == ranks["host-1"]
    assert epochs_strictly_increase(cluster.events())


def test_split_brain_a_stopped_leader_is_fenced_and_steps_down(cluster: Cluster) -> None:
    r = start_ha_job(cluster)
    old = r.leader()
    before = cluster.members()
    # A connection to the leader, set up now (HTTP/2 handshake done): a request sent on it while the
    # leader is stopped goes straight into its socket. (A new connection would wait for the server's
    # SETTINGS frame before sending the request, i.e. until it wakes.)
    old_port = int(old.rsplit(":", 1)[1])
    old_channel = cluster.channel(address=old)
    old_stub = pb_grpc.CoordinatorStub(old_channel)
    old_stub.GetTopology(pb.GetTopologyRequest(), timeout=5)
    r.procs[old].signal_group(signal.SIGSTOP)
    new = wait_for(lambda: leader_among(cluster, [a for a in r.procs if a != old]), 5, "a follower to lead")
    r.use(new)
    # Agents notice the silent leader (no keepalive) and move to the new one before its grace ends.
    wait_for(lambda: all_reregistered(cluster, before), 10, "every agent to register with the new leader")

    # A write sent to the stopped leader waits in its socket; it must not be applied when it wakes.
    answer: list[grpc.RpcError | pb.DrainResponse] = []

    def drain() -> None:
        try:
            answer.append(old_stub.Drain(pb.DrainRequest(host_id="host-0", reason="split"), timeout=15))
        except grpc.RpcError as exc:
            answer.append(exc)

    unread = unread_bytes_from_me(old_port)
    sender = threading.Thread(target=drain)
    sender.start()
    wait_for(
        lambda: unread_bytes_from_me(old_port) > unread,
        5,
        "the drain request to sit in the stopped leader's socket",
    )
    r.procs[old].signal_group(signal.SIGCONT)
    sender.join(20)
    old_channel.close()
    assert isinstance(answer[0], grpc.RpcError), answer
    assert answer[0].code() == grpc.StatusCode.UNAVAILABLE
    assert trailing(answer[0])["remesh-leader"] in ("", new)

    wait_for(lambda: probe(cluster, old) == f"follower:{new}", 5, "the old leader to follow the new one")
    log = r.procs[old].output()
    assert "role=follower" in log
    # It stepped down on waking: a write refused by Redis (fencing token), a renewal that found the
    # lease held by another, or a renewal that failed with the lease's TTL long past.
    assert any(
        why in log for why in ("write refused by the store", "lease lost", "could not renew the lease")
    ), log[-3000:]

    def drain_not_applied() -> None:
        assert cluster.members()["host-0"].state == pb.MEMBER_STATE_ALIVE, (
            "the deposed leader's drain was applied"
        )

    # Observation window of a heartbeat timeout and more after the deposed leader woke: nothing at all
    # is recorded (no drain, no verdict).
    events = assert_no_events(cluster, 2 * DETECTOR.heartbeat_timeout_s, drain_not_applied)
    assert not [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD]
    assert not [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DRAINING]
    assert cluster.topology().epoch == 1
    cluster.agents["host-0"].kill()
    assert cluster.wait_epoch(2, timeout=10).epoch == 2
    assert epochs_strictly_increase(cluster.events())


def test_replica_bad_input_unknown_leader_and_redis_down(tmp_path: Path, job_id: str) -> None:
    with RedisServer(appendonly=False) as redis:
        cluster = Cluster(tmp_path, redis.url, job_id)
        try:
            # A lease held by a replica that never said where it serves: writes are refused, no leader named.
            import redis as redis_lib

            client = redis_lib.Redis.from_url(redis.url)
            client.set(f"remesh:{{{job_id}}}:leader", "99", px=60_000)
            cluster.start_coordinator("--ha")
            with pytest.raises(grpc.RpcError) as refused:
                stub(cluster, cluster.address, security.Role.HOST, "h").Register(
                    pb.RegisterRequest(host_id="h", device_count=1), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert trailing(refused.value)["remesh-leader"] == ""
            assert "no leader is known yet" in (refused.value.details() or "")
            # Its reads still work.
            assert cluster.topology().epoch == 0
            client.close()
        finally:
            cluster.close()
        # Redis down: a replica that cannot reach it does not start, and says why.
        url = redis.url
    proc = Proc(
        [
            sys.executable,
            "-m",
            "remesh.cli",
            "coordinator",
            "--ha",
            "--redis",
            url,
            "--listen",
            "127.0.0.1:0",
            "--insecure",
        ],
        tmp_path / "down.log",
    )
    try:
        assert proc.popen.wait(30) == 2
        assert "unreachable" in proc.output() and "redis-server runs" in proc.output()
    finally:
        proc.close()


@pytest.fixture
def ha_settings(redis_server: RedisServer, job_id: str) -> Iterator[Settings]:
    yield Settings(
        job_id=job_id,
        redis_url=redis_server.url,
        ha=HaSettings(enabled=True, lease_ttl_s=0.3),
    )


def test_a_deposed_leaders_write_is_refused_by_redis_and_it_steps_down(ha_settings: Settings) -> None:
    async def scenario() -> None:
        a_settings = replace(ha_settings, ha=replace(ha_settings.ha, advertise="a:1"))
        b_settings = replace(ha_settings, ha=replace(ha_settings.ha, advertise="b:1"))
        a = Coordinator(a_settings, RedisStore(a_settings.redis_url, a_settings.job_id))
        b = Coordinator(b_settings, RedisStore(b_settings.redis_url, b_settings.job_id))
        try:
            await a.start()
            await _until(lambda: a.leading)
            await a.register("h1", Role.ACTIVE, 1, "10.0.0.1")
            # A stops running (as if SIGSTOPped): its lease runs out and B takes over.
            for task in a._tasks:
                task.cancel()
            await b.start()
            await _until(lambda: b.leading)
            assert a.leading, "A has not noticed: it still believes it leads"
            assert b.store.fencing_token == (a.store.fencing_token or 0) + 1
            with capture_logs() as logs, pytest.raises(NotLeader) as refused:
                await a.register("h2", Role.ACTIVE, 1, "10.0.0.2")
            assert "no longer leads" in str(refused.value)
            assert not a.leading, "A stepped down"
            assert any(e["event"] == "write refused by the store: this replica was deposed" for e in logs)
            assert any(e["event"] == "role" and e.get("role") == "follower" for e in logs)
            state, _ = await b.store.load()
            assert "h2" not in state.members and "h1" in state.members
            # B writes on.
            await b.register("h3", Role.SPARE, 1, "10.0.0.3")
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(scenario())


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(250):  # 5 s
        if predicate():
            return
        await asyncio.sleep(0.02)

"""The coordinator's state stays bounded, and replay stays exact (real coordinator, real Redis).

The event log is cut behind a ``log_compacted`` event that holds the whole state, so
``replay(log) == live state`` keeps holding however long the job runs; members gone for good are
forgotten; a flood of registrations is refused or makes room, never grows Redis without bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis

from remesh.embedded import RedisServer
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.security import Role
from tests.procs import Cluster, GrpcHost, wait_for

pytestmark = pytest.mark.integration


def remesh_replay(cluster: Cluster) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "remesh.cli", "replay", "--coordinator", cluster.address],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **cluster.client_env()},
    )


def stream_length(cluster: Cluster) -> int:
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        return int(client.xlen(f"remesh:{{{cluster.job}}}:events"))
    finally:
        client.close()


def test_a_capped_log_many_epochs_later_still_replays_to_the_live_state(cluster: Cluster) -> None:
    cluster.start_coordinator("--world-size", "2", "--max-events", "30")
    hosts = {h: GrpcHost(cluster, h, 1) for h in ("host-0", "host-1", "host-2")}
    operator = pb_grpc.CoordinatorStub(cluster.channel())
    try:
        cluster.wait_epoch(1, timeout=15)
        for _ in range(8):
            topology = cluster.topology()
            drained = topology.members[-1].host_id
            operator.Drain(pb.DrainRequest(host_id=drained, reason="rotate"), timeout=5)
            cluster.wait_epoch(topology.epoch + 1, timeout=15)
            hosts.pop(drained).stop()
            hosts[drained] = GrpcHost(cluster, drained, 1)  # back, as a spare
        assert cluster.topology().epoch >= 9
        first = wait_for(
            lambda: (e := cluster.events()) and e[0].type == pb.EVENT_TYPE_LOG_COMPACTED and e[0],
            10,
            "the log to be cut",
        )
        assert "state" in first.details
        assert stream_length(cluster) <= 30 + 20  # cut once a second: a round's events on top at most
        result = remesh_replay(cluster)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.startswith("replay matches the live state"), result.stdout
    finally:
        for host in hosts.values():
            host.stop()


def test_ten_thousand_junk_registrations_leave_redis_and_the_member_list_bounded(
    tmp_path: Path, redis_server: RedisServer, job_id: str
) -> None:
    """Insecure, so one client can name any host (with TLS each name needs its own certificate)."""
    cluster = Cluster(tmp_path, redis_server.url, job_id, secure=False)
    client = redis.Redis.from_url(redis_server.url)
    try:
        cluster.start_coordinator("--world-size", "2", "--max-members", "64", "--max-events", "500")
        stub = cluster.stub()
        before = int(client.info("memory")["used_memory"])
        outcomes: dict[str, int] = {}
        # Well inside the test's timeout (120 s) on a loaded machine; enough for thousands.
        deadline = time.monotonic() + 70
        for i in range(10_000):
            if time.monotonic() > deadline:
                break
            try:
                stub.Register(pb.RegisterRequest(host_id=f"junk-{i:05d}", address="10.0.0.1"), timeout=5)
                outcomes["ok"] = outcomes.get("ok", 0) + 1
            except grpc.RpcError as exc:
                outcomes[exc.code().name] = outcomes.get(exc.code().name, 0) + 1
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    assert "--max-members" in (exc.details() or "")
        assert sum(outcomes.values()) >= 2_000, outcomes  # the loop is bounded in time, not only count
        assert set(outcomes) <= {"ok", "RESOURCE_EXHAUSTED"}, outcomes
        members = cluster.members()
        assert len(members) <= 64
        wait_for(lambda: stream_length(cluster) <= 500 + 100, 10, "the log to be cut back")
        grown = int(client.info("memory")["used_memory"]) - before
        assert grown < 16 * 2**20, f"Redis grew by {grown / 2**20:.1f} MiB"
        listed = subprocess.run(
            [sys.executable, "-m", "remesh.cli", "members", "--coordinator", cluster.address, "--json"],
            capture_output=True, text=True, timeout=30,
            env={**os.environ, **cluster.client_env()},
        )  # fmt: skip
        assert listed.returncode == 0 and len(listed.stdout) < 64 * 1024, listed.stderr
        # The junk never heartbeats: let the detector judge all of it first, or the replay races
        # the verdicts still arriving (the log and the live state read a moment apart).
        settling = (pb.MEMBER_STATE_JOINING, pb.MEMBER_STATE_SUSPECT)
        wait_for(
            lambda: not [m for m in cluster.members().values() if m.state in settling],
            30,
            "every junk member judged",
        )
        result = remesh_replay(cluster)
        assert result.stdout.startswith("replay matches the live state"), result.stdout + result.stderr
    finally:
        client.close()
        cluster.close()


def test_a_member_gone_past_its_retention_is_forgotten_and_its_host_may_come_back(cluster: Cluster) -> None:
    cluster.start_coordinator("--world-size", "1", "--member-retention", "1")
    stayer = GrpcHost(cluster, "host-0", 1)
    leaver = GrpcHost(cluster, "host-1", 1)
    try:
        cluster.wait_epoch(1, timeout=15)
        host = pb_grpc.CoordinatorStub(cluster.channel(Role.HOST, "host-1"))
        host.Leave(
            pb.LeaveRequest(host_id="host-1", incarnation=leaver.incarnation, reason="done"), timeout=5
        )
        leaver.stop()
        wait_for(lambda: "host-1" not in cluster.members(), 10, "host-1 to be forgotten")
        forgotten = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_MEMBER_FORGOTTEN]
        assert [e.host_id for e in forgotten] == ["host-1"]
        # A new incarnation above the forgotten one: no message of the old run passes for the new.
        back = GrpcHost(cluster, "host-1", 1)
        assert back.incarnation > leaver.incarnation
        back.stop()
        result = remesh_replay(cluster)
        assert result.stdout.startswith("replay matches the live state"), result.stdout + result.stderr
    finally:
        stayer.stop()


def test_a_full_job_makes_room_for_a_newcomer_by_forgetting_its_oldest_gone_member(cluster: Cluster) -> None:
    """At --max-members a newcomer makes room: the member gone longest is forgotten, not one gone later,
    and never one still alive."""
    cluster.start_coordinator("--world-size", "1", "--max-members", "3")
    stayer = GrpcHost(cluster, "host-0", 1)
    try:
        cluster.wait_epoch(1, timeout=15)
        for host_id in ("host-1", "host-2"):  # host-1 leaves first: the older of the two gone
            gone = GrpcHost(cluster, host_id, 1)
            host = pb_grpc.CoordinatorStub(cluster.channel(Role.HOST, host_id))
            host.Leave(
                pb.LeaveRequest(host_id=host_id, incarnation=gone.incarnation, reason="done"), timeout=5
            )
            gone.stop()
        states = {h: m.state for h, m in cluster.members().items()}
        assert states == {
            "host-0": pb.MEMBER_STATE_ALIVE,
            "host-1": pb.MEMBER_STATE_LEFT,
            "host-2": pb.MEMBER_STATE_LEFT,
        }
        newcomer = GrpcHost(cluster, "host-3", 1)
        newcomer.stop()
        forgotten = [e.host_id for e in cluster.events() if e.type == pb.EVENT_TYPE_MEMBER_FORGOTTEN]
        assert forgotten == ["host-1"]
        assert set(cluster.members()) == {"host-0", "host-2", "host-3"}
    finally:
        stayer.stop()

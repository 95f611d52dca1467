"""The control plane end to end: real redis-server, a real coordinator process, real agent and
stand-in trainer processes, killed and stopped with real signals. Tests taking ``any_cluster`` run
twice: on one redis-server and on a 3-master Redis Cluster."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import signal
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from remesh.coordinator.membership import FaultKind
from remesh.coordinator.model import ClusterState, Event, EventType, Member, Topology, replay
from remesh.coordinator.model import Role as MemberRole
from remesh.coordinator.observations import CollectiveFailureReport, StallReport
from remesh.coordinator.planner import Decision, Kind
from remesh.coordinator.service import Coordinator
from remesh.coordinator.settings import DetectorSettings, PlannerSettings, Settings
from remesh.coordinator.store import RedisStore
from remesh.embedded import RedisServer
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.security import Role
from tests.in_process import live_job
from tests.procs import Cluster, GrpcHost, Proc, assert_no_events, assert_quiet_takeover, hold, wait_for

pytestmark = pytest.mark.integration

ACTIVE = ["host-0", "host-1", "host-2", "host-3"]
# The coordinator's detector timings (the local preset every test here runs with).
DETECTOR = DetectorSettings()


def start_job(cluster: Cluster, *coordinator_args: str, spares: int = 1) -> pb.Topology:
    cluster.start_coordinator("--world-size", "4", *coordinator_args)
    for h in ACTIVE:
        cluster.start_agent(h)
    for i in range(spares):
        cluster.start_agent(f"spare-{i}", spare=True)
    topology = cluster.wait_epoch(1)
    # Every trainer of epoch 1 started and acknowledged it.
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")
    return topology


class Watcher:
    """A WatchTopology stream in a thread, recording every topology it receives."""

    def __init__(self, cluster: Cluster) -> None:
        self.received: list[pb.Topology] = []
        self._channel = cluster.channel(Role.READER, "watcher")
        from remesh.v1 import coordinator_pb2_grpc as pb_grpc

        self._call = pb_grpc.CoordinatorStub(self._channel).WatchTopology(pb.WatchTopologyRequest())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for topology in self._call:
                self.received.append(topology)
        except grpc.RpcError:
            pass

    def epoch(self, epoch: int) -> pb.Topology | None:
        return next((topo for topo in self.received if topo.epoch == epoch), None)

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


def exited(proc: Proc) -> bool:
    return not proc.alive()


def test_sigkill_of_an_active_host_is_replaced_by_the_spare(any_cluster: Cluster) -> None:
    """How fast is benchmarks/detection.py's to measure; here: who replaces whom, seen by every watcher."""
    cluster = any_cluster  # one redis-server, then a Redis Cluster
    before = start_job(cluster)
    ranks = {m.host_id: m.rank for m in before.members}
    assert sorted(ranks) == ACTIVE
    watchers = [Watcher(cluster) for _ in range(3)]
    wait_for(lambda: all(w.epoch(1) for w in watchers), 10, "watchers to see epoch 1")

    victim = "host-2"
    cluster.agents[victim].kill()  # SIGKILL to the host: agent and trainer

    # (The timeout only guards against a hang.)
    after = [wait_for(functools.partial(w.epoch, 2), 10, "epoch 2 at a watcher") for w in watchers]
    assert all(t == after[0] for t in after), "every watcher receives the same topology"
    new_ranks = {m.host_id: m.rank for m in after[0].members}
    assert new_ranks["spare-0"] == ranks[victim]
    assert victim not in new_ranks
    assert {h: r for h, r in new_ranks.items() if h != "spare-0"} == {
        h: r for h, r in ranks.items() if h != victim
    }

    events = cluster.events()
    dead = [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD and e.host_id == victim]
    assert dead and "stream broke" in dead[0].reason
    change = [e for e in events if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED and e.epoch == 2]
    assert change and "hot spare spare-0 takes rank 2 of host-2" in change[0].reason
    # The spare's trainer started on epoch 2 and every member acknowledged it.
    wait_for(
        lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE and e.epoch == 2 for e in cluster.events()),
        30,
        "epoch 2 live",
    )
    # One of three members changed: each agent's stream carried epoch 2 as a delta from epoch 1.
    for host in ("host-0", "host-1", "spare-0"):
        said = [
            line
            for line in cluster.agents[host].output().splitlines()
            if "topology" in line and "epoch=2" in line
        ]
        assert said and all("sent_as=delta" in line for line in said), (host, said)
    for w in watchers:
        w.close()


def test_silent_host_is_declared_dead_and_rejoins_as_a_spare(cluster: Cluster) -> None:
    start_job(cluster, "--metrics-port", "0")
    victim = "host-1"
    inc_before = cluster.members()[victim].incarnation
    cluster.agents[victim].signal_group(signal.SIGSTOP)
    topology = cluster.wait_epoch(2, timeout=10)  # the timeout only guards against a hang
    assert victim not in [m.host_id for m in topology.members]
    dead = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_MEMBER_DEAD and e.host_id == victim]
    assert dead and "no heartbeat" in dead[0].reason
    # The detection histogram holds the silence that led to the declaration (at least the timeout).
    port = int(cluster.coordinator.output().split("metrics_port=")[1].split()[0])  # type: ignore[union-attr]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    observed = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("remesh_detection_latency_seconds_")
    }
    assert observed["remesh_detection_latency_seconds_count"] == 1
    assert observed["remesh_detection_latency_seconds_sum"] >= DETECTOR.heartbeat_timeout_s
    events_before = len(cluster.events())

    cluster.agents[victim].signal_group(signal.SIGCONT)

    def rejoined() -> pb.Member | None:
        m = cluster.members()[victim]
        return m if m.incarnation > inc_before and m.state == pb.MEMBER_STATE_ALIVE else None

    member = wait_for(rejoined, 15, "the stopped host to rejoin")
    assert member.role == pb.ROLE_SPARE and member.rank == -1
    assert cluster.topology().epoch == 2, "its stale messages changed no topology"
    later = cluster.events()[events_before:]
    # Only its new incarnation shows up; nothing was recorded for the old one.
    assert all(e.incarnation != inc_before for e in later if e.host_id == victim), later


def unreachable_count(cluster: Cluster, host: str) -> int:
    return cluster.agents[host].output().count("coordinator unreachable; retrying")


def test_coordinator_restart_on_the_same_redis_evicts_nobody_and_keeps_the_epoch(cluster: Cluster) -> None:
    start_job(cluster)
    before = cluster.members()
    events_before = cluster.events()
    retries = {h: unreachable_count(cluster, h) for h in before}
    port = cluster.port
    cluster.coordinator.kill()  # type: ignore[union-attr]
    # Every agent notices (its stream broke) and retries with backoff while nothing serves the port.
    wait_for(
        lambda: all(unreachable_count(cluster, h) > retries[h] for h in before),
        10,
        "every agent to find the coordinator gone",
    )
    cluster.reset_channel()
    cluster.start_coordinator("--world-size", "4", port=port)
    serving_at = time.monotonic()  # it granted every member a fresh deadline just before serving

    def all_back() -> bool:
        members = cluster.members()
        return all(
            members[h].state == pb.MEMBER_STATE_ALIVE and members[h].incarnation > before[h].incarnation
            for h in before
        )

    wait_for(all_back, 20, "every agent to re-register with the new coordinator")

    # Judging starts when the grace runs out; a heartbeat timeout later anyone it would evict has
    # been evicted. Nothing at all is recorded in that window.
    assert_quiet_takeover(
        cluster, before, events_before, serving_at + DETECTOR.failover_grace_s, DETECTOR.heartbeat_timeout_s
    )


def read_store(url: str, job: str) -> tuple[list[Event], ClusterState]:
    """The whole event log as the Redis stream holds it, and the stored state, read consistently
    (the log read again after the state is unchanged: no commit fell in between)."""

    async def read() -> tuple[list[Event], ClusterState]:
        store = RedisStore(url, job)
        try:
            for _ in range(50):
                events = await store.read_events()
                state, _ = await store.load()
                if await store.read_events() == events:
                    return events, state
                await asyncio.sleep(0.05)
            raise AssertionError("the event log kept changing under the reader")
        finally:
            await store.close()

    return asyncio.run(read())


STORE_DOWN = "store unavailable; nobody is judged until it is back"
STORE_BACK = "store reachable again; every member granted a fresh deadline"


def test_a_redis_outage_during_a_failure_evicts_nobody_healthy_and_loses_nothing(
    tmp_path: Path, private_redis: RedisServer, job_id: str
) -> None:
    """Redis goes down, then a host dies: the detector's write hits the dead store. Nobody is judged
    while it is down, every member gets a fresh deadline when it is back, and only then is the dead
    host declared dead and replaced; the event log written before the outage is intact."""
    cluster = Cluster(tmp_path, private_redis.url, job_id)
    try:
        start_job(cluster)
        coordinator = cluster.coordinator
        assert coordinator is not None
        members_before = cluster.members()
        events_before, state_before = read_store(private_redis.url, job_id)
        assert replay(events_before) == state_before

        private_redis.stop()
        down_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            cluster.stub_as(Role.HOST, "late-host").Register(
                pb.RegisterRequest(host_id="late-host", device_count=2), timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Redis" in (refused.value.details() or "")
        with pytest.raises(grpc.RpcError) as replay_refused:
            cluster.events()
        assert replay_refused.value.code() == grpc.StatusCode.UNAVAILABLE

        # A host dies while the store is down: the detector must write, and its write fails.
        cluster.agents["host-3"].kill()
        wait_for(lambda: STORE_DOWN in coordinator.output(), 10, "the detector to hit the dead store")

        def nobody_judged() -> None:
            # Served from the coordinator's memory: no verdict was applied without a commit.
            assert cluster.topology().epoch == 1
            members = cluster.members()
            assert {h: (m.state, m.incarnation) for h, m in members.items()} == {
                h: (pb.MEMBER_STATE_ALIVE, m.incarnation) for h, m in members_before.items()
            }

        # Observation window with the store down: several heartbeat timeouts.
        hold(3 * DETECTOR.heartbeat_timeout_s, nobody_judged)
        back_at = time.time()  # (before it starts: the coordinator cannot find it back any earlier)
        private_redis.start()  # same port and directory: it replays its AOF
        outage_s = time.monotonic() - down_at
        assert outage_s > 3 * DETECTOR.heartbeat_timeout_s
        wait_for(lambda: STORE_BACK in coordinator.output(), 10, "the coordinator to find the store back")
        log = coordinator.output()
        assert log.index(STORE_DOWN) < log.index(STORE_BACK)

        # Only now is host-3 judged, on the deadline granted when the store came back, and replaced.
        topology = cluster.wait_epoch(2, timeout=DETECTOR.failover_grace_s + 10)
        ranks = {m.host_id: m.rank for m in topology.members}
        assert ranks == {"host-0": 0, "host-1": 1, "host-2": 2, "spare-0": 3}, ranks

        def epoch_2_live() -> bool:
            try:
                return any(e.type == pb.EVENT_TYPE_EPOCH_LIVE and e.epoch == 2 for e in cluster.events())
            except grpc.RpcError as exc:
                # A read may still meet a pooled Redis connection that the restart closed: the
                # coordinator answers UNAVAILABLE, which tells the caller to retry.
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                return False

        wait_for(epoch_2_live, 30, "epoch 2 live")

        events, state = read_store(private_redis.url, job_id)
        assert events[: len(events_before)] == events_before, "nothing written before the outage was lost"
        assert replay(events) == state, "the stored state is what the event log replays to"
        later = events[len(events_before) :]
        dead = [e for e in later if e.type is EventType.MEMBER_DEAD]
        assert [e.host_id for e in dead] == ["host-3"], "no healthy host was declared dead"
        assert "no heartbeat" in dead[0].reason, dead[0].reason
        assert dead[0].time >= back_at + DETECTOR.failover_grace_s, "judged before its fresh deadline ran out"
        # host-3 declared dead, the spare given its rank, every member of epoch 2 running it: nothing else.
        assert [(e.type, e.host_id) for e in later[:4]] == [
            (EventType.MEMBER_DEAD, "host-3"),
            (EventType.MEMBER_ASSIGNED, "host-3"),
            (EventType.MEMBER_ASSIGNED, "spare-0"),
            (EventType.TOPOLOGY_CHANGED, ""),
        ], later
        assert later[3].epoch == 2 and "hot spare spare-0 takes rank 3 of host-3" in later[3].reason
        acks = later[4:-1]
        assert {e.type for e in acks} == {EventType.EPOCH_ACKED}, later
        assert sorted(e.host_id for e in acks) == ["host-0", "host-1", "host-2", "spare-0"]
        assert all(e.epoch == 2 for e in acks)
        assert (later[-1].type, later[-1].epoch) == (EventType.EPOCH_LIVE, 2)
        # The healthy hosts never re-registered: the same incarnations as before the outage.
        members = cluster.members()
        assert all(members[h].incarnation == members_before[h].incarnation for h in ACTIVE[:3])
    finally:
        cluster.close()


def test_without_a_spare_the_job_shrinks_then_waits_and_halts_below_the_minimum(cluster: Cluster) -> None:
    start_job(cluster, "--min-world-size", "3", "--max-wait", "1.5", spares=0)
    cluster.agents["host-3"].kill()
    shrunk = cluster.wait_epoch(2, timeout=10)
    assert [m.host_id for m in shrunk.members] == ["host-0", "host-1", "host-2"]
    assert [m.rank for m in shrunk.members] == [0, 1, 2]
    assert "shrank from 4 to 3" in shrunk.reason

    cluster.agents["host-1"].kill()
    waiting = wait_for(
        lambda: [e for e in cluster.events() if e.type == pb.EVENT_TYPE_JOB_WAITING], 10, "the job to wait"
    )
    assert "minimum is 3" in waiting[0].reason
    halted = cluster.wait_epoch(3, timeout=10)
    assert halted.halted and not halted.members
    assert "halted" in halted.reason and "minimum is 3" in halted.reason
    # Every remaining agent stops its trainer, leaves the job and exits with the "job halted" code:
    # the log says they left with the job, not that their hosts failed after it.
    for h in ("host-0", "host-2"):
        wait_for(functools.partial(exited, cluster.agents[h]), 15, f"agent {h} to exit")
        assert cluster.agents[h].popen.returncode == 3
    after = [e for e in cluster.events() if e.epoch >= halted.epoch]
    left = {e.host_id: e.reason for e in after if e.type == pb.EVENT_TYPE_MEMBER_LEFT}
    assert set(left) == {"host-0", "host-2"} and all("the job halted" in r for r in left.values()), left
    assert not [e.host_id for e in after if e.type == pb.EVENT_TYPE_MEMBER_DEAD]


def test_a_trainer_that_crashes_gets_its_host_replaced_and_the_host_rejoins_as_a_spare(
    cluster: Cluster,
) -> None:
    cluster.start_coordinator("--world-size", "2")
    cluster.start_agent("host-0")
    cluster.start_agent("host-1", env={"STAND_IN_FAIL_AT": "10:1"})
    cluster.start_agent("spare-0", spare=True)
    topology = cluster.wait_epoch(2, timeout=30)
    assert [m.host_id for m in topology.members] == ["host-0", "spare-0"]
    assert "spare-0 takes rank 1 of host-1" in topology.reason
    (dead,) = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_MEMBER_DEAD]
    assert dead.host_id == "host-1" and "trainer_exited: exit code 1" in dead.reason
    fault = next(e for e in cluster.events() if e.type == pb.EVENT_TYPE_FAULT_REPORTED)
    assert fault.host_id == "host-1" and fault.details["exit_code"] == "1" and fault.details["epoch"] == "1"

    def rejoined() -> pb.Member | None:
        m = cluster.members()["host-1"]
        return m if m.state == pb.MEMBER_STATE_ALIVE and m.incarnation == 2 else None

    member = wait_for(rejoined, 15, "host-1 to rejoin as a spare")
    assert member.role == pb.ROLE_SPARE
    assert cluster.agents["host-1"].alive(), "the agent outlives its trainer"


def test_a_hung_trainer_is_killed_reported_and_replaced(cluster: Cluster) -> None:
    cluster.start_coordinator("--world-size", "2")
    cluster.start_agent("host-0")
    cluster.start_agent("host-1", env={"STAND_IN_FAIL_AT": "5:hang"}, extra=["--hang-timeout", "0.5"])
    cluster.start_agent("spare-0", spare=True)
    topology = cluster.wait_epoch(2, timeout=30)
    assert [m.host_id for m in topology.members] == ["host-0", "spare-0"]
    (dead,) = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_MEMBER_DEAD]
    assert dead.host_id == "host-1" and "trainer_hung" in dead.reason
    fault = next(e for e in cluster.events() if e.type == pb.EVENT_TYPE_FAULT_REPORTED)
    assert fault.details["kind"] == "trainer_hung"


def test_a_trainer_before_its_first_step_is_on_the_start_up_clock(cluster: Cluster) -> None:
    """Start-up (JAX, restore, compile) is no step: a trainer that has not stepped in its epoch is
    judged by --startup-timeout, not by the much shorter --hang-timeout; past it, it is killed."""
    startup_s = 4.0
    cluster.start_coordinator("--world-size", "2")
    cluster.start_agent("host-0")
    cluster.start_agent(
        "host-1",
        env={"STAND_IN_FAIL_AT": "1:hang"},  # stops before it reports its first step
        extra=["--hang-timeout", "0.3", "--startup-timeout", str(startup_s)],
    )
    cluster.start_agent("spare-0", spare=True)
    topology = cluster.wait_epoch(2, timeout=30)
    assert [m.host_id for m in topology.members] == ["host-0", "spare-0"]
    events = cluster.events()
    first = next(e for e in events if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED and e.epoch == 1)
    fault = next(e for e in events if e.type == pb.EVENT_TYPE_FAULT_REPORTED)
    assert fault.host_id == "host-1" and fault.details["kind"] == "trainer_hung"
    # Its clock started when the epoch reached its agent, after the epoch was stored.
    assert fault.time - first.time >= startup_s, fault.time - first.time


def test_drain_replaces_the_host_and_its_agent_leaves(any_cluster: Cluster) -> None:
    cluster = any_cluster  # one redis-server, then a Redis Cluster
    start_job(cluster)
    member = (
        cluster.stub().Drain(pb.DrainRequest(host_id="host-3", reason="kernel upgrade"), timeout=5).member
    )
    assert member.state == pb.MEMBER_STATE_DRAINING
    topology = cluster.wait_epoch(2, timeout=10)
    assert topology.members[3].host_id == "spare-0"
    wait_for(lambda: not cluster.agents["host-3"].alive(), 15, "the drained agent to exit")
    assert cluster.agents["host-3"].popen.returncode == 0
    left = cluster.members()["host-3"]
    assert left.state == pb.MEMBER_STATE_LEFT and "kernel upgrade" in left.reason


def test_a_spare_waiting_in_standby_is_not_taken_for_a_hung_trainer(cluster: Cluster) -> None:
    hang_timeout_s = 0.5
    cluster.start_coordinator("--world-size", "1")
    cluster.start_agent("host-0")
    cluster.start_agent("spare-0", spare=True, extra=["--hang-timeout", str(hang_timeout_s)])
    cluster.wait_epoch(1)
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")
    wait_for(
        lambda: cluster.members().get("spare-0", pb.Member()).state == pb.MEMBER_STATE_ALIVE,
        15,
        "spare alive",
    )
    # Its standby trainer runs (and never steps).
    wait_for(
        lambda: re.search(r"\] trainer started", cluster.agents["spare-0"].output()),
        15,
        "the spare's trainer",
    )

    def spare_alive() -> None:
        assert cluster.members()["spare-0"].state == pb.MEMBER_STATE_ALIVE

    # Observation window of four hang timeouts: nothing at all is recorded (no fault, no verdict).
    events = assert_no_events(cluster, 4 * hang_timeout_s, spare_alive)
    assert not [e for e in events if e.type == pb.EVENT_TYPE_FAULT_REPORTED]
    # Once it holds a rank, its trainer is watched: the hang clock starts then.
    cluster.agents["host-0"].kill()
    assert [m.host_id for m in cluster.wait_epoch(2, timeout=10).members] == ["spare-0"]


def test_a_relaunched_host_takes_no_rank_in_the_epoch_that_still_lists_it(cluster: Cluster) -> None:
    """The whole job killed and started again while the coordinator waits for it: each agent comes back
    as a spare while epoch 1 still lists its host, and must wait for the next epoch to take a rank."""
    start_job(cluster, "--min-world-size", "4", "--max-wait", "3600", spares=0)
    for h in ACTIVE:
        cluster.agents[h].kill()
    wait_for(
        lambda: all(m.state == pb.MEMBER_STATE_DEAD for m in cluster.members().values()),
        10,
        "every host dead",
    )
    assert cluster.topology().epoch == 1, "the coordinator waits below the minimum: epoch 1 still lists them"
    for h in ACTIVE:
        cluster.start_agent(h)
    live = wait_for(
        lambda: [e for e in cluster.events() if e.type == pb.EVENT_TYPE_EPOCH_LIVE and e.epoch >= 2],
        30,
        "epoch 2",
    )
    assert live[0].epoch == 2
    events = cluster.events()
    relaunched = [e for e in events if e.incarnation >= 2]
    # No new process acknowledged epoch 1 or failed for having run it.
    assert not [e for e in relaunched if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 1]
    assert not [e for e in relaunched if e.type == pb.EVENT_TYPE_FAULT_REPORTED], relaunched
    for h in ACTIVE:
        assert "registered" in cluster.agents[h].output()


def test_a_large_fleets_coordinator_sends_fewer_keepalives_and_its_agents_wait_for_them(
    cluster: Cluster,
) -> None:
    """Sized for 3000 hosts the coordinator asks for a heartbeat every 3 s and sends keepalives on
    idle streams no more often (RegisterResponse says so); an agent then waits four of them (12 s)
    before it takes the coordinator for lost, instead of its own 2 s, and stays connected."""
    cluster.start_coordinator("--world-size", "1", "--fleet-size", "3000")
    reply = cluster.stub_as(Role.HOST, "probe-0").Register(
        pb.RegisterRequest(host_id="probe-0", role=pb.ROLE_SPARE, device_count=2, address="127.0.0.1"),
        timeout=5,
    )
    assert (reply.heartbeat_interval_s, reply.keepalive_s) == (3.0, 3.0)
    cluster.start_agent("host-0")
    cluster.wait_epoch(1)

    def connected() -> None:
        assert cluster.members()["host-0"].state == pb.MEMBER_STATE_ALIVE
        log = cluster.agents["host-0"].output()
        assert log.count("registered") == 1 and "sent nothing" not in log, log[-3000:]

    # Longer than the agent's own 2 s of silence, twice over: it never gave up on the coordinator.
    hold(5.0, connected, interval=0.5)


def test_the_last_step_is_stored_before_the_job_is_said_finished(cluster: Cluster) -> None:
    """The heartbeat carrying a member's last step races its Finish call: whoever reads
    ``job_finished`` in the log finds that step in the store anyway, and it stays final."""
    cluster.start_coordinator("--world-size", "2")
    hosts = [GrpcHost(cluster, "host-1", 41), GrpcHost(cluster, "host-2", 41)]
    try:
        cluster.wait_epoch(1, timeout=15)
        epoch = cluster.topology().epoch
        for host in hosts:
            host.stub.AckEpoch(
                pb.AckEpochRequest(host_id=host.host_id, incarnation=host.incarnation, epoch=epoch)
            )
        # host-1 heartbeats step 41 throughout: the Finish call alone says it completed step 50.
        hosts[0].stub.Finish(
            pb.FinishRequest(host_id="host-1", incarnation=hosts[0].incarnation, epoch=epoch, step=50),
            timeout=5,
        )
        events, _ = read_store(cluster.redis_url, cluster.job)
        assert [e.details["step"] for e in events if e.type is EventType.JOB_FINISHED] == ["50"]
        assert stored_steps(cluster)["host-1"] == 50
        # Past the coordinator's progress flush (every second), the beats of step 41 change nothing.
        hold(2.5, lambda: _assert_equal(stored_steps(cluster)["host-1"], 50))
    finally:
        for host in hosts:
            host.stop()


@contextlib.asynccontextmanager
async def two_members_in_a_live_epoch(
    redis_server: RedisServer, job_id: str, planner: PlannerSettings | None = None
) -> AsyncIterator[tuple[Coordinator, Member, Member, int]]:
    """A coordinator (world size 2) in this process, host-a and host-b registered, heartbeating and
    acknowledging the first epoch: it, them, and the epoch's number."""
    settings = Settings(
        job_id=job_id, redis_url=redis_server.url, planner=planner or PlannerSettings(world_size=2)
    )
    coordinator = Coordinator(settings, RedisStore(redis_server.url, job_id))
    await coordinator.start()
    try:
        a = await coordinator.register("host-a", MemberRole.ACTIVE, 1, "10.0.0.1")
        b = await coordinator.register("host-b", MemberRole.ACTIVE, 1, "10.0.0.2")
        for member in (a, b):
            await coordinator.heartbeat(member.host_id, member.incarnation, -1)
        for _ in range(250):
            if coordinator.state.topology is not None:
                break
            await asyncio.sleep(0.02)
        epoch = coordinator.state.epoch
        assert epoch >= 1, "no epoch formed"
        for member in (a, b):
            await coordinator.ack_epoch(member.host_id, member.incarnation, epoch, 0, "fresh", {})
        yield coordinator, a, b, epoch
    finally:
        await coordinator.stop()


async def stored_progress(redis_server: RedisServer, job_id: str) -> dict[str, int]:
    """Every member's step as stored in Redis (what a new leader reads)."""
    store = RedisStore(redis_server.url, job_id)
    try:
        return await store.read_progress()
    finally:
        await store.close()


def test_a_last_step_heard_before_finish_is_stored_with_it(redis_server: RedisServer, job_id: str) -> None:
    """The beat carrying the last step arrived first and waits in memory for the next progress
    flush (every second): Finish stores it, and every other dirty step, before the job is finished."""

    async def scenario() -> dict[str, int]:
        async with two_members_in_a_live_epoch(redis_server, job_id) as (coordinator, a, b, epoch):
            await coordinator.heartbeat("host-a", a.incarnation, 300)
            await coordinator.heartbeat("host-b", b.incarnation, 300)
            await coordinator.finish("host-a", a.incarnation, epoch, 300)
            assert coordinator.state.finished
            return await stored_progress(redis_server, job_id)

    assert asyncio.run(scenario()) == {"host-a": 300, "host-b": 300}


def test_a_beat_of_an_older_step_during_finish_does_not_undo_the_last_step(
    redis_server: RedisServer, job_id: str
) -> None:
    """A beat still carrying step 41 arrives while the Finish call of step 50 writes the job's end:
    the next progress flush stores 50, not the older step the beat carried."""

    async def scenario() -> dict[str, int]:
        async with two_members_in_a_live_epoch(redis_server, job_id) as (coordinator, a, b, epoch):
            for member in (a, b):
                await coordinator.heartbeat(member.host_id, member.incarnation, 41)
            commit = coordinator.store.commit

            async def beat_first(*args: Any, **kwargs: Any) -> Any:
                await coordinator.heartbeat("host-a", a.incarnation, 41)  # the beat racing Finish
                return await commit(*args, **kwargs)

            coordinator.store.commit = beat_first  # type: ignore[method-assign]
            await coordinator.finish("host-a", a.incarnation, epoch, 50)
            coordinator.store.commit = commit  # type: ignore[method-assign]
            assert coordinator.state.finished
            await coordinator._flush_progress()  # what the periodic flush does next
            return await stored_progress(redis_server, job_id)

    assert asyncio.run(scenario()) == {"host-a": 50, "host-b": 41}


def test_a_registration_whose_caller_went_away_before_its_commit_is_not_stored(
    redis_server: RedisServer, job_id: str
) -> None:
    """In a registration storm a caller's deadline can run out while its registration waits for the
    next batch commit: nothing is stored for it (a member nobody heartbeats for would be declared dead
    by silence a timeout later), and the registrations committed beside it are."""

    async def scenario() -> tuple[set[str], list[Event]]:
        settings = Settings(job_id=job_id, redis_url=redis_server.url)
        coordinator = Coordinator(settings, RedisStore(redis_server.url, job_id))
        await coordinator.start()
        try:
            gone = asyncio.create_task(coordinator.register("gone", MemberRole.ACTIVE, 1, "10.0.0.1"))
            stays = asyncio.create_task(coordinator.register("stays", MemberRole.ACTIVE, 1, "10.0.0.2"))
            await asyncio.sleep(0)  # both are queued for the same commit, which has not started
            gone.cancel()
            member = await stays
            assert member.host_id == "stays" and gone.cancelled()
            store = RedisStore(redis_server.url, job_id)
            try:
                state, _ = await store.load()
                return set(state.members), await store.read_events()
            finally:
                await store.close()
        finally:
            await coordinator.stop()

    members, events = asyncio.run(scenario())
    assert members == {"stays"}
    assert [e.host_id for e in events if e.type is EventType.MEMBER_JOINED] == ["stays"]


async def keep_beating(coordinator: Coordinator, members: list[Member], seconds: float) -> None:
    """Heartbeat for ``members`` every 0.1 s for ``seconds``, as their agents would."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for member in members:
            await coordinator.heartbeat(member.host_id, member.incarnation, 7)
        await asyncio.sleep(0.1)


def test_a_collective_every_member_says_failed_forms_the_same_members_again_at_once(
    redis_server: RedisServer, job_id: str
) -> None:
    """No member is lost, but every member's trainer said a collective of the epoch failed (a network
    failure between healthy hosts): the same members form the next epoch at once, nobody is
    declared dead, and the stored log says why."""

    async def scenario() -> tuple[int, int, list[Event]]:
        async with two_members_in_a_live_epoch(redis_server, job_id) as (coordinator, a, b, epoch):
            for member in (a, b):
                reason = await coordinator.report_observation(
                    member.host_id, member.incarnation, epoch, CollectiveFailureReport("timed out")
                )
                assert "reported a failed collective" in reason  # no fault of the member's
            # Said again while waiting (the trainers do, every few seconds): counted once.
            await coordinator.report_observation("host-a", a.incarnation, epoch, CollectiveFailureReport(""))
            await wait_async(lambda: coordinator.state.epoch > epoch, 5.0)
            said = coordinator.metrics.registry.get_sample_value("remesh_collective_failures_total")
            assert said == 2
            return epoch, coordinator.state.epoch, await read_events(redis_server, job_id)

    epoch, new_epoch, events = asyncio.run(scenario())
    assert new_epoch == epoch + 1
    assert not [e for e in events if e.type is EventType.MEMBER_DEAD]
    changed = [e for e in events if e.type is EventType.TOPOLOGY_CHANGED]
    assert changed[-1].topology is not None and changed[-1].topology.host_ids == ("host-a", "host-b")
    assert changed[-1].details["decision"] == "reform"
    # Formed once every member had said so, not after waiting reform_after_s for a lost member (the
    # reason of that path names how many said it and how long it waited).
    assert "every member said a collective" in changed[-1].reason


def test_a_collective_one_member_says_failed_waits_out_the_detection_window_then_reforms(
    redis_server: RedisServer, job_id: str
) -> None:
    """Only host-a said so (host-b's trainer may have stopped: its verdict would come within the
    window): the epoch stands for ``reform_after_s``, then, nobody lost, the same members form the
    next; host-a's trainer exiting meanwhile is collateral, not its host's fault."""

    async def scenario() -> tuple[int, list[tuple[float, int]], bool]:
        async with two_members_in_a_live_epoch(redis_server, job_id) as (coordinator, a, b, epoch):
            before = time.monotonic()  # the coordinator's clock starts the window after this
            await coordinator.report_observation(
                "host-a", a.incarnation, epoch, CollectiveFailureReport("timed out")
            )
            exited = await coordinator.report_fault(
                "host-a", a.incarnation, FaultKind.TRAINER_EXITED, epoch, -6, "aborted"
            )
            seen: list[tuple[float, int]] = []
            while coordinator.state.epoch == epoch and time.monotonic() - before < 10:
                await keep_beating(coordinator, [a, b], 0.2)
                seen.append((time.monotonic() - before, coordinator.state.epoch))
            return epoch, seen, exited.member_dead

    epoch, seen, dead = asyncio.run(scenario())
    window = PlannerSettings().reform_after_s
    assert [e for t, e in seen if t < window] == [epoch] * len([t for t, _ in seen if t < window])
    assert len([t for t, _ in seen if t < window]) >= 3  # it was looked at inside the window
    assert seen[-1][1] == epoch + 1 and seen[-1][0] >= window
    assert not dead


def test_a_trainer_killed_while_blocked_waiting_for_its_peers_gets_a_new_epoch_though_nobody_is_blamed(
    redis_server: RedisServer, job_id: str
) -> None:
    """host-a's trainer said it was blocked in a step (a slow peer), then died: collateral, its host
    is not blamed and its agent waits for the next epoch. Nobody else fails (its peers wait for it),
    so that next epoch must come from its death: the same members re-form once nobody was lost in
    the detection window. Seen in CI's soak: without it the job waited for ever at one step."""

    async def scenario() -> tuple[int, int, bool, str, list[Event]]:
        async with two_members_in_a_live_epoch(redis_server, job_id) as (coordinator, a, b, epoch):
            said = await coordinator.report_observation("host-a", a.incarnation, epoch, StallReport(step=7))
            assert "blocked" in said
            exited = await coordinator.report_fault(
                "host-a", a.incarnation, FaultKind.TRAINER_EXITED, epoch, -9, ""
            )
            limit = time.monotonic() + PlannerSettings().reform_after_s + 5
            while coordinator.state.epoch == epoch and time.monotonic() < limit:
                await keep_beating(coordinator, [a, b], 0.2)
            return (
                epoch,
                coordinator.state.epoch,
                exited.member_dead,
                exited.reason,
                await read_events(redis_server, job_id),
            )

    epoch, new_epoch, dead, reason, events = asyncio.run(scenario())
    assert not dead and reason.startswith("collateral: its trainer was blocked")
    assert new_epoch == epoch + 1
    assert not [e for e in events if e.type is EventType.MEMBER_DEAD]
    changed = [e for e in events if e.type is EventType.TOPOLOGY_CHANGED][-1]
    assert changed.topology is not None and changed.topology.host_ids == ("host-a", "host-b")
    assert changed.details["decision"] == "reform"


def test_hosts_whose_collective_fails_in_every_epoch_they_are_re_formed_into_halt_the_job(
    redis_server: RedisServer, job_id: str
) -> None:
    """A link among the same hosts that stays broken: every epoch they are re-formed into fails its
    collective before any step. Past ``max_futile_reforms`` such re-forms the job halts with the
    reason; a re-form after a step was completed starts the count again."""
    planner = PlannerSettings(world_size=2, max_futile_reforms=2)

    async def fail_everywhere(coordinator: Coordinator, members: tuple[Member, ...]) -> int:
        epoch = coordinator.state.epoch
        for m in members:
            await coordinator.report_observation(m.host_id, m.incarnation, epoch, CollectiveFailureReport(""))
        await wait_async(lambda: coordinator.state.epoch > epoch, 5.0)
        return coordinator.state.epoch

    async def scenario() -> tuple[list[str], Topology | None]:
        async with two_members_in_a_live_epoch(redis_server, job_id, planner) as (coordinator, a, b, _):
            decisions = []
            for step in (5, 9, 9, 9, 9):  # progress before the second failure, none after it
                for m in (a, b):
                    await coordinator.heartbeat(m.host_id, m.incarnation, step)
                await fail_everywhere(coordinator, (a, b))
                topology = coordinator.state.topology
                assert topology is not None
                decisions.append("halt" if topology.halted else topology.reason.split(":")[0])
                if topology.halted:
                    break
            return decisions, coordinator.state.topology

    decisions, final = asyncio.run(scenario())
    # Re-formed at step 5, at step 9 (a step was completed between: the count starts again), then
    # twice more at step 9 with nothing completed: the third failure without progress halts.
    assert decisions == ["every member said a collective of epoch 1 failed"] + [
        f"every member said a collective of epoch {e} failed" for e in (2, 3, 4)
    ] + ["halt"], decisions
    assert final is not None and final.halted
    assert "fails every time" in final.reason and "host-a, host-b" in final.reason


def test_every_survivors_report_of_a_failed_collective_costs_no_plan_of_its_own(
    redis_server: RedisServer, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every member of every failed epoch says its collective failed, and a plan reads the whole fleet:
    300 reports are planned when they start the window and when the last completes them (and on the
    detector's ticks in between), not once each; they make one epoch of the same 300 members."""
    import remesh.coordinator.service as service_module

    plans: list[Kind] = []
    real_plan = service_module.plan

    def counted(*args: Any, **kwargs: Any) -> Decision:
        decision = real_plan(*args, **kwargs)
        plans.append(decision.kind)
        return decision

    hosts = [f"host-{i}" for i in range(300)]

    async def scenario() -> tuple[int, list[Kind], Topology | None, float]:
        planner = PlannerSettings(world_size=len(hosts), jax_port_span=5000)
        async with live_job(redis_server.url, job_id, hosts, planner) as (coordinator, members):
            epoch = coordinator.state.epoch
            monkeypatch.setattr(service_module, "plan", counted)
            t0 = time.monotonic()
            # Bounded, so that a call that never returns fails here, with its place, not at the
            # test's timeout (one CI run hung somewhere in this test after the new epoch).
            reports = asyncio.gather(
                *(
                    coordinator.report_observation(
                        m.host_id, m.incarnation, epoch, CollectiveFailureReport("")
                    )
                    for m in members
                )
            )
            await asyncio.wait_for(reports, 30.0)
            await wait_async(lambda: coordinator.state.epoch > epoch, 10.0)
            took = time.monotonic() - t0
            return epoch, list(plans), coordinator.state.topology, took

    epoch, kinds, topology, took = asyncio.run(scenario())
    assert topology is not None and topology.epoch == epoch + 1
    assert topology.host_ids == tuple(hosts)
    assert kinds.count(Kind.REFORM) == 1
    # The first report's plan (a hold), the last one's (the re-form), and the ticks' meanwhile.
    ticks = took / DetectorSettings().tick_s
    assert len(kinds) <= ticks + 4 and len(kinds) < len(hosts) / 2, (len(kinds), took)


async def wait_async(condition: Callable[[], bool], within_s: float) -> None:
    end = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)


async def read_events(redis_server: RedisServer, job_id: str) -> list[Event]:
    store = RedisStore(redis_server.url, job_id)
    try:
        return await store.read_events()
    finally:
        await store.close()


def stored_steps(cluster: Cluster) -> dict[str, int]:
    async def read() -> dict[str, int]:
        store = RedisStore(cluster.redis_url, cluster.job)
        try:
            return await store.read_progress()
        finally:
            await store.close()

    return asyncio.run(read())


def _assert_equal(got: object, expected: object) -> None:
    assert got == expected


def test_a_writer_of_a_superseded_epoch_is_refused_over_rpc_and_its_successor_accepted(
    cluster: Cluster,
) -> None:
    """A writer paused through an epoch change (its host still a member, same incarnation) asks to
    commit for the epoch it knew: refused, naming the current one, and nothing is recorded; the same
    call for the current epoch is accepted."""
    cluster.start_coordinator("--world-size", "2")
    hosts = [GrpcHost(cluster, "host-0", 4), GrpcHost(cluster, "host-1", 4), GrpcHost(cluster, "spare-0", 4)]
    try:
        old = cluster.wait_epoch(1, timeout=15).epoch
        writer = hosts[0]
        operator = cluster.stub()
        operator.Drain(
            pb.DrainRequest(host_id="host-1", reason="epoch change under a paused writer"), timeout=5
        )
        new = wait_for(lambda: (t := cluster.topology()).epoch > old and t, 15, "the next epoch")
        assert "host-0" in [m.host_id for m in new.members]

        def commit(epoch: int) -> pb.CommitCheckpointResponse:
            return writer.stub.CommitCheckpoint(
                pb.CommitCheckpointRequest(
                    host_id="host-0", incarnation=writer.incarnation, epoch=epoch, step=4, tier="local"
                ),
                timeout=5,
            )

        with pytest.raises(grpc.RpcError) as refused:
            commit(old)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert f"stale epoch {old}: epoch {new.epoch} is current" in (refused.value.details() or "")
        committed = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_CHECKPOINT_COMMITTED]
        assert committed == []
        commit(new.epoch)
        committed = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_CHECKPOINT_COMMITTED]
        assert [(e.epoch, e.details["step"]) for e in committed] == [(new.epoch, "4")]
    finally:
        for host in hosts:
            host.stop()

"""The control plane end to end: real redis-server, a real coordinator process, real agent and
stand-in trainer processes, killed and stopped with real signals. Tests taking ``any_cluster`` run
twice: on one redis-server and on a 3-master Redis Cluster."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import grpc
import pytest

from remesh.v1 import coordinator_pb2 as pb
from tests.procs import Cluster, wait_for

pytestmark = pytest.mark.integration

ACTIVE = ["host-0", "host-1", "host-2", "host-3"]


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
    """A WatchTopology stream in a thread, recording (arrival time, topology)."""

    def __init__(self, cluster: Cluster) -> None:
        self.received: list[tuple[float, pb.Topology]] = []
        self._channel = grpc.insecure_channel(cluster.address)
        from remesh.v1 import coordinator_pb2_grpc as pb_grpc

        self._call = pb_grpc.CoordinatorStub(self._channel).WatchTopology(pb.WatchTopologyRequest())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for topology in self._call:
                self.received.append((time.monotonic(), topology))
        except grpc.RpcError:
            pass

    def epoch(self, epoch: int) -> tuple[float, pb.Topology] | None:
        return next(((t, topo) for t, topo in self.received if topo.epoch == epoch), None)

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


def test_sigkill_of_an_active_host_is_replaced_by_the_spare_within_a_second(any_cluster: Cluster) -> None:
    cluster = any_cluster  # one redis-server, then a Redis Cluster
    before = start_job(cluster)
    ranks = {m.host_id: m.rank for m in before.members}
    assert sorted(ranks) == ACTIVE
    watchers = [Watcher(cluster) for _ in range(3)]
    wait_for(lambda: all(w.epoch(1) for w in watchers), 10, "watchers to see epoch 1")

    victim = "host-2"
    killed_at = time.monotonic()
    cluster.agents[victim].kill()  # SIGKILL to the host: agent and trainer

    arrivals = [wait_for(lambda w=w: w.epoch(2), 10, "epoch 2 at a watcher") for w in watchers]
    latencies = [t - killed_at for t, _ in arrivals]  # type: ignore[misc]
    assert max(latencies) < 1.0, latencies
    after = [topo for _, topo in arrivals]  # type: ignore[misc]
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
    for w in watchers:
        w.close()


def test_silent_host_is_declared_dead_and_rejoins_as_a_spare(cluster: Cluster) -> None:
    start_job(cluster, "--metrics-port", "0")
    victim = "host-1"
    inc_before = cluster.members()[victim].incarnation
    cluster.agents[victim].signal_group(signal.SIGSTOP)
    stopped_at = time.monotonic()
    topology = cluster.wait_epoch(2, timeout=10)
    took = time.monotonic() - stopped_at
    assert took < 3.0, took
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
    assert observed["remesh_detection_latency_seconds_sum"] >= 0.6
    events_before = len(cluster.events())

    cluster.agents[victim].signal_group(signal.SIGCONT)

    def rejoined() -> pb.Member | None:
        m = cluster.members()[victim]
        return m if m.incarnation > inc_before and m.state == pb.MEMBER_STATE_ALIVE else None

    member = wait_for(rejoined, 15, "the stopped host to rejoin")
    assert member.role == pb.ROLE_SPARE and member.rank == -1  # type: ignore[union-attr]
    assert cluster.topology().epoch == 2, "its stale messages changed no topology"
    later = cluster.events()[events_before:]
    # Only its new incarnation shows up; nothing was recorded for the old one.
    assert all(e.incarnation != inc_before for e in later if e.host_id == victim), later


def test_coordinator_restart_on_the_same_redis_evicts_nobody_and_keeps_the_epoch(cluster: Cluster) -> None:
    start_job(cluster)
    before = cluster.members()
    port = cluster.port
    cluster.coordinator.kill()  # type: ignore[union-attr]
    time.sleep(1.0)  # agents notice and retry with backoff while nothing serves the port
    cluster.reset_channel()
    cluster.start_coordinator("--world-size", "4", port=port)

    def all_back() -> bool:
        members = cluster.members()
        return all(
            members[h].state == pb.MEMBER_STATE_ALIVE and members[h].incarnation > before[h].incarnation
            for h in before
        )

    wait_for(all_back, 20, "every agent to re-register with the new coordinator")
    time.sleep(1.0)  # a full heartbeat timeout later, still nobody is judged dead
    assert cluster.topology().epoch == 1
    events = cluster.events()
    assert not [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD]
    assert not [e for e in events if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED and e.epoch > 1]
    members = cluster.members()
    assert {h: m.rank for h, m in members.items()} == {h: m.rank for h, m in before.items()}


def test_redis_outage_answers_unavailable_evicts_nobody_and_carries_on(
    tmp_path, private_redis, job_id
) -> None:  # type: ignore[no-untyped-def]
    cluster = Cluster(tmp_path, private_redis.url, job_id)
    try:
        start_job(cluster)
        private_redis.stop()
        with pytest.raises(grpc.RpcError) as refused:
            cluster.stub().Register(pb.RegisterRequest(host_id="late-host", device_count=2), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Redis" in refused.value.details()
        with pytest.raises(grpc.RpcError) as replay_refused:
            cluster.events()
        assert replay_refused.value.code() == grpc.StatusCode.UNAVAILABLE
        time.sleep(1.5)  # more than the heartbeat timeout with the store down
        private_redis.start()

        def serving() -> bool:
            try:
                cluster.stub().Register(
                    pb.RegisterRequest(host_id="late-host", role=pb.ROLE_SPARE), timeout=5
                )
                return True
            except grpc.RpcError:
                return False

        wait_for(serving, 15, "the coordinator to write again")
        time.sleep(1.0)
        assert cluster.topology().epoch == 1
        events = cluster.events()
        # (late-host registered by hand and never heartbeats: it alone is declared dead, after the outage.)
        assert not [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD and e.host_id != "late-host"]
        # Nothing written before the outage was lost (AOF) and the new member was recorded after it.
        assert next(e for e in events if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED).epoch == 1
        assert any(e.type == pb.EVENT_TYPE_MEMBER_JOINED and e.host_id == "late-host" for e in events)
        # It carries on: a host killed now is still replaced.
        cluster.agents["host-0"].kill()
        assert "spare-0" in [m.host_id for m in cluster.wait_epoch(2, timeout=10).members]
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
    assert "minimum is 3" in waiting[0].reason  # type: ignore[index]
    halted = cluster.wait_epoch(3, timeout=10)
    assert halted.halted and not halted.members
    assert "halted" in halted.reason and "minimum is 3" in halted.reason
    # Every remaining agent stops its trainer and exits with the "job halted" code.
    for h in ("host-0", "host-2"):
        wait_for(lambda h=h: not cluster.agents[h].alive(), 15, f"agent {h} to exit")
        assert cluster.agents[h].popen.returncode == 3


def test_a_trainer_that_crashes_gets_its_host_replaced_and_the_host_rejoins_as_a_spare(
    cluster: Cluster,
) -> None:
    cluster.start_coordinator("--world-size", "2")
    cluster.start_agent("host-0")
    cluster.start_agent("host-1", env={"STAND_IN_FAIL_AT": "10:1"})
    cluster.start_agent("spare-0", spare=True)
    topology = cluster.wait_epoch(2, timeout=30)
    assert [m.host_id for m in topology.members] == ["host-0", "spare-0"]
    assert "trainer_exited: exit code 1" in topology.reason
    fault = next(e for e in cluster.events() if e.type == pb.EVENT_TYPE_FAULT_REPORTED)
    assert fault.host_id == "host-1" and fault.details["exit_code"] == "1" and fault.details["epoch"] == "1"
    member = wait_for(
        lambda: (
            (m := cluster.members()["host-1"]).state == pb.MEMBER_STATE_ALIVE and m.incarnation == 2 and m
        ),
        15,
        "host-1 to rejoin as a spare",
    )
    assert member.role == pb.ROLE_SPARE  # type: ignore[union-attr]
    assert cluster.agents["host-1"].alive(), "the agent outlives its trainer"


def test_a_hung_trainer_is_killed_reported_and_replaced(cluster: Cluster) -> None:
    cluster.start_coordinator("--world-size", "2")
    cluster.start_agent("host-0")
    cluster.start_agent("host-1", env={"STAND_IN_FAIL_AT": "5:hang"}, extra=["--hang-timeout", "0.5"])
    cluster.start_agent("spare-0", spare=True)
    topology = cluster.wait_epoch(2, timeout=30)
    assert [m.host_id for m in topology.members] == ["host-0", "spare-0"]
    assert "trainer_hung" in topology.reason
    fault = next(e for e in cluster.events() if e.type == pb.EVENT_TYPE_FAULT_REPORTED)
    assert fault.details["kind"] == "trainer_hung"


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
    cluster.start_coordinator("--world-size", "1")
    cluster.start_agent("host-0")
    cluster.start_agent("spare-0", spare=True, extra=["--hang-timeout", "0.5"])
    cluster.wait_epoch(1)
    wait_for(
        lambda: cluster.members().get("spare-0", pb.Member()).state == pb.MEMBER_STATE_ALIVE,
        15,
        "spare alive",
    )
    time.sleep(2.0)  # four hang timeouts of a spare whose trainer never steps
    assert cluster.members()["spare-0"].state == pb.MEMBER_STATE_ALIVE
    assert not [e for e in cluster.events() if e.type == pb.EVENT_TYPE_FAULT_REPORTED]
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
    assert live[0].epoch == 2  # type: ignore[index]
    events = cluster.events()
    relaunched = [e for e in events if e.incarnation >= 2]
    # No new process acknowledged epoch 1 or failed for having run it.
    assert not [e for e in relaunched if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 1]
    assert not [e for e in relaunched if e.type == pb.EVENT_TYPE_FAULT_REPORTED], relaunched
    for h in ACTIVE:
        assert "registered" in cluster.agents[h].output()

"""The chaos soak: its invariant checks (pure, table-driven), its network cut, and a CI-sized soak.

The checks of ``benchmarks/chaos.py`` judge ``benchmarks/soak.py`` and the soak below alike, so
they are tested first on hand-made event logs: each must flag what it claims and nothing else. The
proxy that cuts an agent off (``benchmarks/connect_proxy.py``) is tested against a real gRPC server. The soak itself runs the example
trainer (3 hosts + a spare, 2 coordinator replicas with --ha, Redis with AOF) through one fault of
each of seven kinds, injected at fixed steps (so the same faults on any machine; seed 16 stops the
host of rank 0 for 3x the heartbeat timeout and cuts rank 0 off for ~2 s, the stale-writer
scenarios of issue 16), and asserts every invariant: epochs, replay == stored state, no false
eviction, no hung epoch, one epoch per burst, no stale commit, a clean finish with every agent
exiting 0.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from benchmarks.chaos import (
    Fault,
    FaultKind,
    Marker,
    Soak,
    SoakSettings,
    check_epochs,
    check_finish,
    check_replay,
    draw_faults,
    find_false_evictions,
    find_hung_epochs,
    find_split_bursts,
    find_stale_commits,
)
from benchmarks.connect_proxy import ConnectProxy
from remesh.coordinator.model import (
    ClusterState,
    Event,
    EventType,
    Member,
    MemberState,
    Role,
    Topology,
    TopologyMember,
    replay,
)

ROOT = Path(__file__).resolve().parents[1]


# ---- hand-made event logs ----------------------------------------------------------------------------


def topology_event(epoch: int, t: float, hosts: tuple[str, ...] = ("a", "b")) -> Event:
    topology = Topology(
        epoch=epoch,
        members=tuple(TopologyMember(h, r, 2, "127.0.0.1") for r, h in enumerate(hosts)),
        mesh_shape=(len(hosts) * 2,),
        jax_coordinator_address="127.0.0.1:28000",
        restore_step=0,
        reason=f"epoch {epoch}",
        created_at=t,
    )
    return Event(EventType.TOPOLOGY_CHANGED, t, epoch, f"epoch {epoch}", topology=topology, id=f"{t}-0")


def event(type_: EventType, t: float, epoch: int, host: str = "", **details: str) -> Event:
    return Event(type_, t, epoch, f"{type_.value} {host}", host_id=host, details=details, id=f"{t}-1")


def dead(host: str, t: float, epoch: int) -> Event:
    member = Member(host, 1, Role.ACTIVE, MemberState.DEAD, reason="stream broke")
    return Event(
        EventType.MEMBER_DEAD,
        t,
        epoch,
        "stream broke",
        host_id=host,
        incarnation=1,
        member=member,
        id=f"{t}-2",
    )


def fault(kind: FaultKind, targets: tuple[str, ...], start: float, end: float | None) -> Fault:
    return Fault(1, kind, targets, kind.value, start, 1, ended_at=end)


# ---- epochs ------------------------------------------------------------------------------------------


def test_increasing_epochs_pass_and_a_reused_or_older_epoch_is_flagged() -> None:
    good = [topology_event(1, 1.0), event(EventType.EPOCH_LIVE, 2.0, 1), topology_event(2, 3.0)]
    assert check_epochs(good) == []
    reused = [topology_event(1, 1.0), topology_event(2, 2.0), topology_event(2, 3.0)]
    assert [v.check for v in check_epochs(reused)] == ["epochs"]
    assert "publishes epoch 2 after epoch 2" in check_epochs(reused)[0].message
    back = [topology_event(2, 1.0), event(EventType.EPOCH_ACKED, 2.0, 1, "a")]
    assert ["carries epoch 1 after epoch 2" in v.message for v in check_epochs(back)] == [True]


# ---- false evictions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("faults", "flagged"),
    [
        ([], True),  # nobody touched b
        ([fault(FaultKind.HOST_KILL, ("b",), 9.0, 9.0)], False),  # b was killed just before
        ([fault(FaultKind.HOST_STOP, ("b",), 5.0, 8.0)], False),  # within the grace after SIGCONT
        ([fault(FaultKind.HOST_STOP, ("b",), 1.0, 2.0)], True),  # long after its fault ended
        ([fault(FaultKind.HOST_KILL, ("a",), 9.0, 9.0)], True),  # a fault, on another host
        ([fault(FaultKind.REDIS_KILL, (), 9.0, 9.5)], True),  # a store outage evicts nobody
        ([fault(FaultKind.NETWORK_CUT, ("b",), 9.0, None)], False),  # still cut
        ([fault(FaultKind.HOST_KILL, ("b",), 11.0, 11.0)], True),  # declared before its fault
    ],
)
def test_a_member_dead_is_false_unless_a_fault_on_its_host_explains_it(
    faults: list[Fault], flagged: bool
) -> None:
    events = [topology_event(1, 0.0), dead("b", 10.0, 1)]
    found = find_false_evictions(events, faults, grace_s=5.0)
    assert bool(found) is flagged, found
    assert all(v.check == "false_eviction" and "b (incarnation 1)" in v.message for v in found)


# ---- hung epochs -------------------------------------------------------------------------------------


def test_an_epoch_must_go_live_or_be_superseded_within_the_bound() -> None:
    live = [topology_event(1, 0.0), event(EventType.EPOCH_LIVE, 5.0, 1)]
    assert find_hung_epochs(live, bound_s=10, now=100) == []
    superseded = [topology_event(1, 0.0), topology_event(2, 3.0), event(EventType.EPOCH_LIVE, 6.0, 2)]
    assert find_hung_epochs(superseded, bound_s=10, now=100) == []
    pending = [topology_event(1, 0.0)]
    assert find_hung_epochs(pending, bound_s=10, now=5) == []  # still within the bound
    hung = find_hung_epochs(pending, bound_s=10, now=50)
    assert [v.check for v in hung] == ["hung_epoch"] and "epoch 1" in hung[0].message
    late = [topology_event(1, 0.0), event(EventType.EPOCH_LIVE, 30.0, 1)]
    assert "took 30.0s" in find_hung_epochs(late, bound_s=10, now=100)[0].message


# ---- bursts -----------------------------------------------------------------------------------------


def test_a_burst_must_be_one_epoch_until_the_job_is_live_again() -> None:
    burst = Fault(1, FaultKind.BURST, ("a", "b"), "burst", 10.0, 1, ended_at=10.05, recovered_at=15.0)
    one = [topology_event(1, 0), topology_event(2, 10.2), event(EventType.EPOCH_LIVE, 15.0, 2)]
    assert find_split_bursts([*one, topology_event(3, 20.0)], [burst]) == []  # a later grow is no split
    two = [topology_event(1, 0), topology_event(2, 10.1), topology_event(3, 10.2)]
    found = find_split_bursts([*two, event(EventType.EPOCH_LIVE, 15.0, 3)], [burst])
    assert [v.check for v in found] == ["split_burst"] and "made 2 epochs" in found[0].message
    kill = dataclasses.replace(burst, kind=FaultKind.HOST_KILL)
    assert find_split_bursts(two, [kill]) == []  # only bursts are judged


# ---- stale commits -----------------------------------------------------------------------------------


def committed(t: float, epoch: int, step: int) -> Event:
    return event(EventType.CHECKPOINT_COMMITTED, t, epoch, "a", step=str(step), tier="local")


@pytest.mark.parametrize(
    ("log", "marker", "stale"),
    [
        ([topology_event(1, 0), committed(1, 1, 25)], Marker("local", 25, 1), False),
        ([topology_event(1, 0), committed(1, 1, 25)], Marker("local", 50, 1), True),  # no commit event
        ([topology_event(1, 0), committed(1, 1, 25)], Marker("local", 25, 2), True),  # other epoch
        # Recorded for epoch 1 after epoch 2 was published: the arbiter let a stale writer through.
        ([topology_event(1, 0), topology_event(2, 1), committed(2, 1, 25)], Marker("local", 25, 1), True),
    ],
)
def test_a_marker_counts_only_with_a_commit_of_its_epoch_while_current(
    log: list[Event], marker: Marker, stale: bool
) -> None:
    found = find_stale_commits([marker], log)
    assert bool(found) is stale, found
    assert all(v.check == "stale_commit" for v in found)


# ---- the finish --------------------------------------------------------------------------------------


def test_a_clean_finish_and_what_spoils_it() -> None:
    base = [topology_event(1, 0), event(EventType.EPOCH_LIVE, 1, 1)]
    finished = event(EventType.JOB_FINISHED, 5, 1, "a", step="100")
    assert check_finish([*base, finished], {"a": 0, "b": 0}, last_step=100) == []
    assert "no job_finished" in check_finish(base, {"a": 0}, 100)[0].message
    after = check_finish([*base, finished, dead("b", 6, 1)], {"a": 0}, 100)
    assert ["member_dead" in v.message for v in after] == [True]
    exits = check_finish([*base, finished], {"a": 0, "b": 1, "c": None}, 100)
    assert sorted(v.message for v in exits) == [
        "the agent of b exited with code 1",
        "the agent of c did not exit after the job finished",
    ]
    assert "last step is 200" in check_finish([*base, finished], {}, 200)[0].message


# ---- replay ------------------------------------------------------------------------------------------


def test_replay_matches_its_own_fold_and_names_the_field_that_differs() -> None:
    log = [topology_event(1, 0), dead("b", 1, 1), event(EventType.EPOCH_LIVE, 2, 1)]
    state = replay(log)
    assert check_replay(log, state) == []
    tampered = dataclasses.replace(state, live_epoch=7)
    found = check_replay(log, tampered)
    assert [v.check for v in found] == ["replay"] and "live_epoch: replay 1 stored 7" in found[0].message
    other = dataclasses.replace(
        state,
        members={**state.members, "b": dataclasses.replace(state.members["b"], state=MemberState.ALIVE)},
    )
    assert "members differ (b:" in check_replay(log, other)[0].message
    assert check_replay([], ClusterState()) == []


# ---- the schedule ------------------------------------------------------------------------------------


def test_the_schedule_is_a_pure_function_of_the_seed() -> None:
    settings = SoakSettings(seed=7, mtbf_s=10)
    assert draw_faults(settings, 20) == draw_faults(settings, 20)
    assert draw_faults(settings, 20) != draw_faults(dataclasses.replace(settings, seed=8), 20)
    # A fixed sequence of kinds keeps every other draw: the same gaps, pauses and targets.
    fixed = draw_faults(dataclasses.replace(settings, kinds=(FaultKind.REDIS_KILL,)), 20)
    assert {p.kind for p in fixed} == {FaultKind.REDIS_KILL}
    assert [p.gap_s for p in fixed] == [p.gap_s for p in draw_faults(settings, 20)]
    stops = [p for p in draw_faults(dataclasses.replace(settings, kinds=(FaultKind.HOST_STOP,)), 50)]
    timeout = settings.heartbeat_timeout_s
    assert any(2 * timeout * 0.9 <= p.pause_s <= 4 * timeout * 1.1 for p in stops)
    assert all(p.gap_s >= settings.min_gap_s for p in stops)


# ---- the network cut ---------------------------------------------------------------------------------


@pytest.fixture
def health_server() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_the_proxy_carries_every_grpc_connection_until_cut_and_again_after_restore(
    health_server: str,
) -> None:
    proxy = ConnectProxy([health_server])
    # The same channel argument the agent gets from grpc_proxy in its environment.
    channel = grpc.insecure_channel(health_server, options=[("grpc.http_proxy", f"http://{proxy.address}")])
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        assert (
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )
        assert proxy.opened == 1
        proxy.cut()
        with pytest.raises(grpc.RpcError) as cut:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
        assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # silence, not a refusal
        proxy.restore()

        def back() -> bool:
            try:
                return (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                )
            except grpc.RpcError:
                return False

        assert any(back() for _ in range(10)), "the link is back after the restore"
        assert proxy.opened >= 2  # a fresh connection: the one that lived through the cut was closed
    finally:
        channel.close()
        proxy.close()


def test_the_proxy_forwards_to_its_targets_only(health_server: str) -> None:
    elsewhere = socket.create_server(("127.0.0.1", 0))  # another loopback service on this machine
    with elsewhere, ConnectProxy([health_server]) as proxy:

        def answer(target: str) -> bytes:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as client:
                client.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
                return client.recv(1024).split(b"\r\n", 1)[0]

        assert answer(health_server) == b"HTTP/1.1 200 Connection established"
        assert answer(f"127.0.0.1:{elsewhere.getsockname()[1]}") == b"HTTP/1.1 403 Forbidden"
        assert answer("nowhere") == b"HTTP/1.1 403 Forbidden"  # no port: no target of its
        assert proxy.opened == 1
    with pytest.raises(ValueError, match="no target"):
        ConnectProxy([])


# ---- the soak ----------------------------------------------------------------------------------------

CI_KINDS = (
    FaultKind.HOST_STOP,
    FaultKind.LEADER_KILL,
    FaultKind.TRAINER_HANG,
    FaultKind.TRAINER_CRASH,
    FaultKind.REDIS_KILL,
    FaultKind.NETWORK_CUT,
    FaultKind.BURST,
)


@pytest.mark.integration
@pytest.mark.timeout(480)
def test_a_ci_sized_soak_keeps_every_invariant(tmp_path: Path) -> None:
    settings = SoakSettings(
        hosts=3,
        spares=1,
        replicas=2,
        steps=300,
        kinds=CI_KINDS,
        at_steps=(25, 55, 85, 115, 145, 175, 205),
        # The SIGSTOP of issue 16: 3x the heartbeat timeout, long enough to be replaced.
        stop_factors=(3.0,),
        # Past the heartbeat timeout, within the agent's lease: the cut host's trainer runs on.
        cut_s=(2.0, 3.0),
        seed=16,
        duration_s=300,
        startup_timeout_s=240,
        finish_timeout_s=180,
        workdir=tmp_path,
    )
    report = Soak(settings, ROOT).run()
    summary = report.summary()
    violations = "\n".join(f"[{v.check}] {v.message}" for v in report.violations)
    assert [f.kind for f in report.faults] == list(CI_KINDS), summary
    assert summary["recoveries_completed"] == len(CI_KINDS), report.to_dict()["faults"]
    assert summary["not_available"] == {}, summary["not_available"]
    assert report.violations == [], f"invariants violated (logs in {tmp_path}):\n{violations}"
    assert summary["replay_matches"] and summary["finished_cleanly"]
    assert summary["reached_step"] == settings.steps

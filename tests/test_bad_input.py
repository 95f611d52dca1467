"""Bad input to every API gets a clear gRPC status and changes nothing (real coordinator, real Redis)."""

from __future__ import annotations

import asyncio
import queue
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from remesh.embedded import RedisServer
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from tests.procs import Cluster, hold, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def running(tmp_path: Path, redis_server: RedisServer, job_id: str) -> Iterator[Cluster]:
    """Two agents in epoch 1 on an insecure coordinator: what is checked here is what the coordinator
    makes of a request, whoever sends it (who may send what: tests/test_security.py)."""
    cluster = Cluster(tmp_path, redis_server.url, job_id, secure=False)
    try:
        yield _formed(cluster)
    finally:
        cluster.close()


def _formed(cluster: Cluster) -> Cluster:
    cluster.start_coordinator("--world-size", "2", "--metrics-port", "0")
    cluster.start_agent("host-0")
    cluster.start_agent("host-1")
    cluster.wait_epoch(1)
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")
    return cluster


# Calls sent at once by the burst test: more than gRPC's default 3000 waiting at most.
BURST = 4000


def snapshot(c: Cluster) -> tuple[object, ...]:
    members = {h: (m.incarnation, m.state, m.rank, m.role, m.reason) for h, m in c.members().items()}
    return members, c.topology().SerializeToString(), len(c.events())


def code_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details() or ""


def test_bad_requests_get_clear_statuses_and_change_nothing(running: Cluster) -> None:
    stub = running.stub()
    members = running.members()
    inc = members["host-0"].incarnation
    epoch = running.topology().epoch
    before = snapshot(running)
    INVALID, NOT_FOUND, FAILED = (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    cases: list[tuple[str, Callable[[], object], grpc.StatusCode, str]] = [
        ("empty id", lambda: stub.Register(pb.RegisterRequest(host_id="")), INVALID, "empty"),
        ("oversized id", lambda: stub.Register(pb.RegisterRequest(host_id="h" * 500)), INVALID, "limit is 128"),
        ("bad characters", lambda: stub.Register(pb.RegisterRequest(host_id="a b/c")), INVALID, "characters"),
        ("negative devices", lambda: stub.Register(pb.RegisterRequest(host_id="x", device_count=-1)), INVALID, "device_count"),
        ("unknown host", lambda: stub.GetMember(pb.GetMemberRequest(host_id="ghost")), NOT_FOUND, "unknown host"),
        ("leave unknown", lambda: stub.Leave(pb.LeaveRequest(host_id="ghost", incarnation=1)), NOT_FOUND, "unknown host"),
        ("stale incarnation", lambda: stub.Leave(pb.LeaveRequest(host_id="host-0", incarnation=inc - 1)), FAILED, "stale incarnation"),
        ("future incarnation", lambda: stub.Leave(pb.LeaveRequest(host_id="host-0", incarnation=inc + 5)), FAILED, "never issued"),
        ("stale epoch ack", lambda: stub.AckEpoch(pb.AckEpochRequest(host_id="host-0", incarnation=inc, epoch=epoch - 1)), FAILED, "stale epoch"),
        ("future epoch ack", lambda: stub.AckEpoch(pb.AckEpochRequest(host_id="host-0", incarnation=inc, epoch=epoch + 7)), FAILED, "current epoch"),
        ("unknown fault kind", lambda: stub.ReportFault(pb.ReportFaultRequest(host_id="host-0", incarnation=inc, kind=99)), INVALID, "fault kind"),
        ("fault in an unpublished epoch", lambda: stub.ReportFault(pb.ReportFaultRequest(host_id="host-0", incarnation=inc, kind=pb.FAULT_KIND_TRAINER_EXITED, epoch=epoch + 3)), INVALID, "never published"),
        ("no observation", lambda: stub.Observe(pb.ObserveRequest(host_id="host-0", incarnation=inc, epoch=epoch)), INVALID, "no observation"),
        ("observation of an unpublished epoch", lambda: stub.Observe(pb.ObserveRequest(host_id="host-0", incarnation=inc, epoch=epoch + 3, stall=pb.StallObservation(step=1))), INVALID, "never published"),
        ("observation of a negative epoch", lambda: stub.Observe(pb.ObserveRequest(host_id="host-0", incarnation=inc, epoch=-1, collective_failure=pb.CollectiveFailureObservation())), INVALID, "negative"),
        ("escapes in an observation", lambda: stub.Observe(pb.ObserveRequest(host_id="host-0", incarnation=inc, epoch=epoch, collective_failure=pb.CollectiveFailureObservation(detail="\x1b[2J"))), INVALID, "control characters"),
        ("a tier that is no name", lambda: stub.Observe(pb.ObserveRequest(host_id="host-0", incarnation=inc, epoch=epoch, tier_missing=pb.TierMissingObservation(tier="../etc"))), INVALID, "tier"),
        ("observation of a stale incarnation", lambda: stub.Observe(pb.ObserveRequest(host_id="host-0", incarnation=inc - 1, epoch=epoch, stall=pb.StallObservation(step=1))), FAILED, "stale incarnation"),
        ("failed collective of a stale incarnation", lambda: stub.Observe(pb.ObserveRequest(host_id="host-0", incarnation=inc - 1, epoch=epoch, collective_failure=pb.CollectiveFailureObservation())), FAILED, "stale incarnation"),
        ("observation of an unknown host", lambda: stub.Observe(pb.ObserveRequest(host_id="ghost", incarnation=1, epoch=epoch, tier_missing=pb.TierMissingObservation(tier="buddy"))), NOT_FOUND, "unknown host"),
        ("drain unknown", lambda: stub.Drain(pb.DrainRequest(host_id="ghost")), NOT_FOUND, "unknown host"),
        ("bad state filter", lambda: stub.ListMembers(pb.ListMembersRequest(states=[42])), INVALID, "member state"),
        ("bad event id", lambda: list(stub.ReplayEvents(pb.ReplayEventsRequest(after_id="yesterday"))), INVALID, "event id"),
        ("bad event type", lambda: list(stub.ReplayEvents(pb.ReplayEventsRequest(types=[999]))), INVALID, "event type"),
        ("NaN since", lambda: list(stub.ReplayEvents(pb.ReplayEventsRequest(since=float("nan")))), INVALID, "not a time"),
        ("escapes in an address", lambda: stub.Register(pb.RegisterRequest(host_id="x", address="\x1b[2J")), INVALID, "address"),
        ("an agent of another job", lambda: stub.Register(pb.RegisterRequest(host_id="x", job_id="myjob")), FAILED, f"runs job '{running.job}', not 'myjob': start the agent with --job {running.job}"),
        ("NaN phase", lambda: stub.AckEpoch(pb.AckEpochRequest(host_id="host-0", incarnation=inc, epoch=epoch, phases={"restore": float("nan")})), INVALID, "finite"),
        ("negative watch epoch", lambda: next(iter(stub.WatchTopology(pb.WatchTopologyRequest(after_epoch=-1)))), INVALID, "negative"),
    ]  # fmt: skip
    for name, call, expected, words in cases:
        code, details = code_of(call)
        assert code == expected, (name, code, details)
        assert words in details, (name, details)
    assert snapshot(running) == before


def test_malformed_bytes_are_refused_and_change_nothing(running: Cluster) -> None:
    before = snapshot(running)
    channel = grpc.insecure_channel(running.address)
    raw = channel.unary_unary("/remesh.v1.Coordinator/Register")  # no serializer: raw bytes go out
    code, details = code_of(lambda: raw(b"\xff\xff\xff\xff not a protobuf", timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid remesh.v1.RegisterRequest" in details
    unknown = channel.unary_unary("/remesh.v1.Coordinator/Explode")
    code, _ = code_of(lambda: unknown(b"", timeout=5))
    assert code == grpc.StatusCode.UNIMPLEMENTED
    channel.close()
    assert snapshot(running) == before


def test_heartbeats_of_stale_or_unknown_incarnations_are_told_to_register_and_change_nothing(
    running: Cluster,
) -> None:
    before = snapshot(running)
    inc = running.members()["host-1"].incarnation
    for host, incarnation in (("host-1", inc - 1), ("host-1", inc + 1), ("ghost", 1)):
        replies = list(
            running.stub().Heartbeat(
                iter([pb.HeartbeatRequest(host_id=host, incarnation=incarnation)]), timeout=5
            )
        )
        assert [r.command for r in replies] == [pb.COMMAND_REREGISTER], (host, incarnation)
        assert replies[0].reason
    assert snapshot(running) == before


def test_a_heartbeat_stream_keeps_the_host_and_incarnation_of_its_first_message(running: Cluster) -> None:
    """A stream opened as one member cannot speak for another, or for another incarnation, later on:
    it is told to register again, and nothing it said past its first message counts."""
    members = running.members()
    inc0, inc1 = members["host-0"].incarnation, members["host-1"].incarnation
    for second in (
        pb.HeartbeatRequest(host_id="host-0", incarnation=inc0, step=10**6),
        pb.HeartbeatRequest(host_id="host-1", incarnation=inc1 + 1, step=10**6),
    ):
        first = pb.HeartbeatRequest(host_id="host-1", incarnation=inc1)
        replies = list(running.stub().Heartbeat(iter([first, second]), timeout=5))
        told = [r.reason for r in replies if r.command == pb.COMMAND_REREGISTER]
        assert told and f"a heartbeat stream belongs to host-1 incarnation {inc1}" in told[0], replies
    # Past the coordinator's flush of steps (every second): no step from the second messages counted.
    hold(1.5, lambda: _assert_true(all(m.last_step < 10**6 for m in running.members().values())))
    after = running.members()
    assert (after["host-0"].incarnation, after["host-1"].incarnation) == (inc0, inc1)
    assert after["host-0"].state == after["host-1"].state == pb.MEMBER_STATE_ALIVE


def test_a_second_stream_for_a_host_opened_and_cancelled_never_makes_the_live_host_dead(
    running: Cluster,
) -> None:
    """Anyone who knows a host's incarnation (GetMember tells it) can open a heartbeat stream as that
    host; closing it must say nothing about the host while its agent's own stream carries its beats."""
    before = snapshot(running)
    inc = running.members()["host-1"].incarnation
    for _ in range(3):
        beats = running.stub().Heartbeat(
            iter([pb.HeartbeatRequest(host_id="host-1", incarnation=inc)]), timeout=5
        )
        assert next(beats).HasField("topology")  # attached: the coordinator answered with the topology
        beats.cancel()
    # Well past the stream grace (0.1 s) and the heartbeat timeout: nobody was judged.
    hold(3.0, lambda: _unchanged(running, before))


def test_acknowledgements_on_a_heartbeat_stream_are_answered_on_it_refusals_too(running: Cluster) -> None:
    """An agent acknowledges on its heartbeat stream (HeartbeatRequest.ack); each gets an ack_reply
    with what AckEpoch would have answered, a refusal leaves the stream open, and none changes
    anything here (epoch 1 is live and acknowledged already)."""
    before = snapshot(running)
    inc = running.members()["host-1"].incarnation
    epoch = running.topology().epoch
    outgoing: queue.Queue[pb.HeartbeatRequest | None] = queue.Queue()

    def requests() -> Iterator[pb.HeartbeatRequest]:
        while (request := outgoing.get(timeout=10)) is not None:
            yield request

    def ack(ack: pb.AckEpochRequest) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(host_id="host-1", incarnation=inc, ack=ack)

    replies = running.stub().Heartbeat(requests(), timeout=10)
    try:
        outgoing.put(pb.HeartbeatRequest(host_id="host-1", incarnation=inc))
        assert next(replies).HasField("topology")
        sent = [
            pb.AckEpochRequest(epoch=epoch - 1),  # stale
            pb.AckEpochRequest(host_id="host-0", epoch=epoch),  # another host's
            pb.AckEpochRequest(epoch=epoch, phases={"restore": float("nan")}),  # malformed
            pb.AckEpochRequest(epoch=epoch, restored_step=-1),  # already acknowledged: live
        ]
        answers: list[pb.AckReply] = []
        for request in sent:  # one at a time: the answers come back in the order sent
            outgoing.put(ack(request))
            answers.append(next(r for r in replies if r.HasField("ack_reply")).ack_reply)
    finally:
        outgoing.put(None)
        replies.cancel()
    failed = grpc.StatusCode.FAILED_PRECONDITION.value[0]
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [(a.epoch, a.code, a.live) for a in answers] == [
        (epoch - 1, failed, False),
        (epoch, invalid, False),
        (epoch, invalid, False),
        (epoch, 0, True),
    ]
    assert "stale epoch" in answers[0].details
    assert "names host-0" in answers[1].details
    assert "finite" in answers[2].details
    assert snapshot(running) == before


def _assert_true(condition: bool) -> None:
    assert condition


def _unchanged(c: Cluster, before: tuple[object, ...]) -> None:
    assert snapshot(c) == before


def test_health_reflection_and_metrics_are_served(running: Cluster) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = grpc.insecure_channel(running.address)
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="remesh.v1.Coordinator"), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for s in next(iter(reflection)).list_services_response.service}
    assert "remesh.v1.Coordinator" in names
    channel.close()

    log = running.coordinator.output()  # type: ignore[union-attr]
    port = int(log.split("metrics_port=")[1].split()[0])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "remesh_epoch 1.0" in text
    assert 'remesh_members{state="alive"} 2.0' in text
    assert "remesh_heartbeats_total" in text
    assert "remesh_detection_latency_seconds_bucket" in text
    assert "remesh_epochs_published_total 1.0" in text


@pytest.mark.parametrize(
    ("listen", "host"),
    [
        ("127.0.0.1:50051", "127.0.0.1"),  # one machine: /metrics stays on loopback too
        ("0.0.0.0:50051", "0.0.0.0"),  # a pod: Prometheus must reach it on the pod's address
        ("[::]:50051", "::"),
        ("localhost:0", "localhost"),
        (":50051", "0.0.0.0"),
        ("unix:/run/remesh/coordinator.sock", "127.0.0.1"),  # reached from this machine alone
    ],
)
def test_metrics_bind_where_grpc_listens(listen: str, host: str) -> None:
    from remesh.coordinator.rpc import listen_host

    assert listen_host(listen) == host


def test_a_burst_of_calls_past_grpcs_pending_limit_is_served_not_cancelled(running: Cluster) -> None:
    """A fleet answers a new epoch together: thousands of calls arrive before the server's event loop
    takes them. gRPC's core cancelled every call beyond 1000 waiting (3000 at once); the coordinator
    raises those limits to its own concurrency limit, so the burst is served, just later."""

    async def burst() -> list[object]:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            calls = [stub.GetTopology(pb.GetTopologyRequest(), timeout=60) for _ in range(BURST)]
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(burst())
    failed = Counter(r.code().name for r in results if isinstance(r, grpc.aio.AioRpcError))
    assert not failed, failed
    assert all(isinstance(r, pb.Topology) and r.epoch == 1 for r in results)


def test_a_coordinator_fault_on_a_stream_acknowledgement_is_answered_at_once() -> None:
    """An acknowledgement on a heartbeat stream whose handling fails with an error that is no refusal
    (a fault of the coordinator's own) is answered on the stream at once, UNKNOWN as the AckEpoch
    call would be, not left for the agent to give up on after seconds. Unit: the servicer's own
    handling, its coordinator replaced by one that fails."""
    from remesh.coordinator.agent_stream import AgentStream
    from remesh.coordinator.servicer import CoordinatorServicer

    class Failing:
        def _acknowledge(self, host_id: str, incarnation: int, ack: pb.AckEpochRequest) -> Any:
            async def fail() -> bool:
                raise RuntimeError("a fault")

            return fail()

    stream = AgentStream("host-1", 3)
    asyncio.run(CoordinatorServicer._ack_on_stream(Failing(), pb.AckEpochRequest(epoch=4), stream))
    (answer,) = stream.replies
    assert answer.ack_reply.epoch == 4 and not answer.ack_reply.live
    assert answer.ack_reply.code == grpc.StatusCode.UNKNOWN.value[0]
    assert "a fault" in answer.ack_reply.details


def test_an_agent_started_for_another_job_exits_saying_which_job_the_coordinator_runs(
    running: Cluster,
) -> None:
    """What a user running the pieces by hand meets when the agent's --job is not the coordinator's:
    not a host that waits forever, but an exit with both names and the fix."""
    agent = running.start_agent("host-9", extra=("--job", "myjob"))
    wait_for(lambda: not agent.alive(), 30, "the agent to exit")
    out = agent.output()
    assert agent.popen.returncode == 2, out[-2000:]
    assert f"this coordinator runs job '{running.job}', not 'myjob'" in out, out[-2000:]
    assert "host-9" not in running.members()

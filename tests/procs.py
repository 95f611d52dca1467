"""The tests' view of a local job: real coordinator and agent processes (see remesh.embedded.cluster),
and the two ways a test waits: for a condition (``wait_for``), or through an explicit observation
window in which something must keep holding (``hold``, ``assert_no_events``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar, cast

import grpc

from remesh.coordinator.settings import PlannerSettings
from remesh.embedded import cluster as _cluster
from remesh.embedded.cluster import LocalCluster as Cluster
from remesh.embedded.cluster import Proc
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.security import Role

__all__ = [
    "Cluster",
    "GrpcHost",
    "Proc",
    "assert_no_events",
    "assert_quiet_takeover",
    "hold",
    "jax_port",
    "jax_port_base_of_worker",
    "wait_for",
]

T = TypeVar("T")


def jax_port_base_of_worker(worker: str) -> int:
    """The first JAX coordination port of a pytest-xdist worker ("gw0", "gw1", ...; "" without
    xdist): ranges of the default span, side by side above the default range (which a demo run by
    hand uses) and below 32768, where Linux's ephemeral ports begin."""
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    span = PlannerSettings.jax_port_span
    return PlannerSettings.jax_port_base + span * (1 + index % 3)


def jax_port(job_id: str, epoch: int) -> int:
    """The port of ``job_id``'s epoch ``epoch`` for a coordinator started by this test process."""
    return PlannerSettings(jax_port_base=int(os.environ["REMESH_JAX_PORT_BASE"])).jax_port(job_id, epoch)


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that (typed: never None)."""
    return cast(T, _cluster.wait_for(predicate, timeout, what, interval))


def hold(seconds: float, check: Callable[[], None], interval: float = 0.05) -> int:
    """An observation window: call ``check`` (which asserts) until ``seconds`` have passed, and once
    more at the end, so a failure anywhere in the window is caught. Returns how many checks ran."""
    end = time.monotonic() + seconds
    checks = 0
    while True:
        check()
        checks += 1
        left = end - time.monotonic()
        if left <= 0:
            return checks
        time.sleep(min(interval, left))


def assert_no_events(
    cluster: Cluster, seconds: float, check: Callable[[], None] = lambda: None
) -> list[pb.Event]:
    """Nothing is recorded for ``seconds``: the whole event log is the same at the end of the window as
    at its start (``check`` runs throughout). Returns the log."""
    before = cluster.events()
    hold(seconds, check)
    after = cluster.events()
    assert after == before, f"recorded during a window in which nothing should happen: {after[len(before) :]}"
    return after


def assert_quiet_takeover(
    cluster: Cluster,
    before: dict[str, pb.Member],
    events_before: list[pb.Event],
    judging_from: float,
    heartbeat_timeout_s: float,
) -> list[pb.Event]:
    """After a coordinator restart or failover: until a heartbeat timeout past ``judging_from`` (when
    the grace the coordinator granted runs out; time.monotonic()), nobody is judged and nothing at all
    is recorded; the log before is unchanged, and each host came back once as its next incarnation
    with its rank. Returns the whole log."""

    def nobody_judged() -> None:
        assert cluster.topology().epoch == 1
        assert all(m.state == pb.MEMBER_STATE_ALIVE for m in cluster.members().values())

    window = judging_from + heartbeat_timeout_s + 0.5 - time.monotonic()
    events = assert_no_events(cluster, window, nobody_judged)
    assert events[: len(events_before)] == events_before, "the event log before the change is unchanged"
    later = events[len(events_before) :]
    for host, member in before.items():
        assert [(pb.EventType.Name(e.type), e.incarnation) for e in later if e.host_id == host] == [
            ("EVENT_TYPE_MEMBER_REJOINED", member.incarnation + 1),
            ("EVENT_TYPE_MEMBER_ALIVE", member.incarnation + 1),
        ], later
    assert len(later) == 2 * len(before), later
    members = cluster.members()
    assert {h: m.rank for h, m in members.items()} == {h: m.rank for h, m in before.items()}
    return events


class GrpcHost:
    """A host registered over gRPC that keeps heartbeating (as an agent would) until stopped."""

    def __init__(self, cluster: Cluster, host_id: str, step: int) -> None:
        self.host_id = host_id
        # Its own channel, with its host's identity (mutual TLS, unless the cluster is insecure).
        self._channel = cluster.channel(Role.HOST, host_id)
        self.stub = stub = pb_grpc.CoordinatorStub(self._channel)
        reply = stub.Register(
            pb.RegisterRequest(host_id=host_id, device_count=2, address="127.0.0.1"), timeout=5
        )
        self.incarnation = reply.member.incarnation
        self._step = step
        self._stop = threading.Event()
        self._call = stub.Heartbeat(self._beats())
        self._thread = threading.Thread(target=self._drain_replies, daemon=True)
        self._thread.start()

    def _beats(self) -> Iterator[pb.HeartbeatRequest]:
        while not self._stop.is_set():
            yield pb.HeartbeatRequest(
                host_id=self.host_id,
                incarnation=self.incarnation,
                step=self._step,
                trainer_status=pb.TRAINER_STATUS_RUNNING,
            )
            self._stop.wait(0.03)

    def _drain_replies(self) -> None:
        try:
            for _ in self._call:
                pass
        except grpc.RpcError:
            pass

    def stop(self) -> None:
        self._stop.set()
        self._call.cancel()
        self._thread.join(5)
        self._channel.close()

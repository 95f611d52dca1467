"""A snapshot tier that cannot keep a host's snapshots is an error the user sees, never a silent
downgrade: the trainer counts it and says which tier, its agent publishes the count and tells the
coordinator, and the coordinator records one event per member incarnation and tier and acts on none.

First the pure transition and the fold; then a real coordinator (real Redis, agents with stand-in
trainers) told the same thing again and again over gRPC; then the whole path, a real JAX trainer
under a real agent whose snapshot directory stops being a directory (no file can be made in it,
whoever the process runs as: root included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from remesh.coordinator import membership
from remesh.coordinator.convert import event_from_pb, event_to_pb
from remesh.coordinator.errors import CoordinatorError, InvalidRequest, NotFound, Rejected
from remesh.coordinator.membership import TIERS_NOTED
from remesh.coordinator.model import ClusterState, Event, EventType, Fold, apply, replay
from remesh.elastic.agent_client import AgentClient, Assignment
from remesh.v1 import agent_pb2 as apb
from remesh.v1 import agent_pb2_grpc as apb_grpc
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.security import Role
from tests.procs import Cluster, GrpcHost, hold, wait_for
from tests.test_control_plane import read_store
from tests.test_elastic_e2e import ENV
from tests.test_membership import DEAD, NOW, job, one
from tests.test_metrics import Samples, metrics_port, scrape, value

ERROR = "NotADirectoryError: [Errno 20] Not a directory: '/dev/shm/remesh-j-a1/.step_0000000004.snap.tmp'"


def missing(
    state: ClusterState | None = None,
    *,
    host: str = "a1",
    incarnation: int = 1,
    epoch: int = 3,
    tier: str = "host-shm",
    detail: str = ERROR,
    noted: frozenset[str] = frozenset(),
) -> tuple[list[Event], str]:
    return membership.tier_missing(
        NOW, job() if state is None else state, host, incarnation, epoch, tier, detail, noted
    )


# ---- the transition and the fold (pure) ------------------------------------------------------------


def test_a_missing_tier_is_one_event_that_names_it_and_folds_to_no_change() -> None:
    state = job()
    events, reason = missing(state)
    event = one(events)
    assert (event.type, event.host_id, event.incarnation, event.epoch) == (EventType.TIER_MISSING, "a1", 1, 3)
    assert dict(event.details) == {"tier": "host-shm", "detail": ERROR, "epoch": "3"}
    assert event.reason == reason and "host-shm" in reason and ERROR in reason
    assert event.member is None and event.topology is None
    # Every way the coordinator and `remesh replay` fold it leaves the state as it was.
    assert apply(state, event) == state
    assert replay(events, state) == state
    assert Fold(state).add(events) == state
    # As stored (JSON) and as served (protobuf), read back, it is the same event and folds the same.
    stored = Event.from_json(event.to_json(), "1733150000000-0")
    served = event_from_pb(event_to_pb(stored))
    assert served == stored and served.type is EventType.TIER_MISSING
    assert event_to_pb(stored).type == pb.EVENT_TYPE_TIER_MISSING
    assert replay([served], state) == state


def test_a_spare_outside_the_topology_may_say_so_and_an_older_epoch_is_still_news() -> None:
    assert one(missing(host="s0")[0]).host_id == "s0"
    assert one(missing(epoch=1)[0]).details["epoch"] == "1"


def test_a_tier_is_recorded_once_per_member_incarnation_and_the_tiers_are_bounded() -> None:
    state = job()
    again, reason = missing(state, noted=frozenset({"host-shm"}))
    assert again == [] and "recorded already" in reason
    # A host naming tier after tier, each many times, adds at most TIERS_NOTED events.
    noted: set[str] = set()
    recorded: list[Event] = []
    for i in range(6 * TIERS_NOTED):
        events, reason = missing(state, tier=f"tier-{i % (2 * TIERS_NOTED)}", noted=frozenset(noted))
        recorded += events
        noted |= {e.details["tier"] for e in events}
    assert len(recorded) == TIERS_NOTED == len(noted)
    assert "the limit" in reason
    assert replay(recorded, state) == state


def test_after_the_job_finished_nothing_is_recorded() -> None:
    events, reason = missing(replace(job(), finished_step=40))
    assert events == [] and "finished" in reason


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: missing(job(incarnation=2)), Rejected, "stale incarnation"),
        (lambda: missing(incarnation=2), Rejected, "never issued"),
        (lambda: missing(job(states={"a1": DEAD})), Rejected, "dead"),
        (lambda: missing(host="ghost"), NotFound, "unknown host"),
        (lambda: missing(tier="Host SHM"), InvalidRequest, "tier"),
        (lambda: missing(tier=""), InvalidRequest, "tier"),
        (lambda: missing(tier="t" * 40), InvalidRequest, "tier"),
        (lambda: missing(detail="\x1b[31mred"), InvalidRequest, "control characters"),
        (lambda: missing(detail="x" * 2000), InvalidRequest, "limit is 1024"),
        (lambda: missing(epoch=-1), InvalidRequest, "negative"),
        (lambda: missing(epoch=4), InvalidRequest, "never published"),
    ],
    ids=[
        "stale incarnation",
        "future incarnation",
        "dead member",
        "unknown host",
        "tier with capitals",
        "empty tier",
        "long tier",
        "terminal escape",
        "long detail",
        "negative epoch",
        "unpublished epoch",
    ],
)
def test_a_bad_report_is_refused(
    call: Callable[[], object], error: type[CoordinatorError], match: str
) -> None:
    with pytest.raises(error, match=match):
        call()


# ---- the trainer's side: the tiers go with its progress reports ---------------------------------------


class RecordingAgent(apb_grpc.AgentLocalServicer):
    """The agent's local API as a real gRPC server that records every progress report."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.reports: list[apb.ReportProgressRequest] = []

    def WatchAssignments(
        self, request: apb.WatchAssignmentsRequest, context: grpc.ServicerContext
    ) -> Iterator[apb.Assignment]:
        while context.is_active():  # no new epoch, ever
            time.sleep(0.05)
        yield from ()

    def ReportProgress(
        self, request: apb.ReportProgressRequest, context: grpc.ServicerContext
    ) -> apb.ReportProgressResponse:
        with self.lock:
            self.reports.append(request)
            self.lock.notify_all()
        return apb.ReportProgressResponse(current_epoch=request.epoch)

    def wait(self, count: int) -> list[apb.ReportProgressRequest]:
        with self.lock:
            assert self.lock.wait_for(lambda: len(self.reports) >= count, 10), self.reports
            return list(self.reports)


def test_a_tier_said_missing_after_the_last_report_goes_at_once_and_with_every_report_after() -> None:
    recording = RecordingAgent()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    apb_grpc.add_AgentLocalServicer_to_server(recording, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    first = Assignment(epoch=1, host_id="host-0", rank=0, world_size=1, jax_coordinator="", restore_step=-1)
    client = AgentClient(f"127.0.0.1:{port}", first, progress_every_s=0.05)
    try:
        stats = {"steps": 5.0, "snapshot_failures": 2.0, "snapshot_failures.host-shm": 2.0}
        client.report_progress_later(5, 1, stats)
        (sent,) = recording.wait(1)
        assert dict(sent.tiers_missing) == {}
        assert dict(sent.totals.snapshot_failures) == {"host-shm": 2}
        # Nothing is pending: the last report goes again, now with the tier (plain text, one line).
        client.report_tiers_missing({"host-shm": f"{ERROR}\n  at a second line \x1b[31m"})
        again = recording.wait(2)[1]
        assert (again.step, again.epoch, dict(again.tiers_missing)) == (5, 1, {"host-shm": ERROR})
        client.report_progress_later(6, 1, {**stats, "steps": 6.0})
        later = recording.wait(3)[2]
        assert (later.step, dict(later.tiers_missing)) == (6, {"host-shm": ERROR})
    finally:
        client.close()
        server.stop(0)


# ---- a real coordinator, told again and again --------------------------------------------------------


def test_the_coordinator_records_a_tier_once_per_incarnation_and_acts_on_none_of_it(
    cluster: Cluster,
) -> None:
    cluster.start_coordinator("--world-size", "2")
    for host in ("host-0", "host-1"):
        cluster.start_agent(host, extra=("--no-warm-standby",))
    cluster.wait_epoch(1)
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")
    before = cluster.members()
    inc = before["host-0"].incarnation

    def report(
        tier: str, detail: str = ERROR, host: str = "host-0", incarnation: int = inc
    ) -> pb.ReportFaultResponse:
        request = pb.ReportFaultRequest(
            host_id=host,
            incarnation=incarnation,
            kind=pb.FAULT_KIND_TIER_MISSING,
            epoch=1,
            tier=tier,
            detail=detail,
        )
        # As its agent says it: with the host's own identity.
        reply: pb.ReportFaultResponse = cluster.stub_as(Role.HOST, host).ReportFault(request, timeout=10)
        return reply

    replies = [report("host-shm", f"{ERROR} (snapshot {i})") for i in range(20)]
    replies += [report("buddy") for _ in range(5)]
    assert not any(r.member_dead for r in replies)
    assert "recorded already" in replies[1].reason and "recorded already" in replies[-1].reason
    # A host that registers again is a new incarnation: what it says is news once more.
    spare = GrpcHost(cluster, "host-9", 0)
    report("host-shm", host="host-9", incarnation=spare.incarnation)
    spare.stop()
    spare = GrpcHost(cluster, "host-9", 0)
    try:
        for _ in range(3):
            report("host-shm", host="host-9", incarnation=spare.incarnation)
    finally:
        spare.stop()

    recorded = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_TIER_MISSING]
    assert [(e.host_id, e.incarnation, e.details["tier"]) for e in recorded] == [
        ("host-0", inc, "host-shm"),
        ("host-0", inc, "buddy"),
        ("host-9", spare.incarnation - 1, "host-shm"),
        ("host-9", spare.incarnation, "host-shm"),
    ]
    assert recorded[0].details["detail"] == f"{ERROR} (snapshot 0)"

    # Acted on never: the job's members keep their epoch, ranks and state, nobody is suspected.
    def untouched() -> None:
        now = cluster.members()
        assert cluster.topology().epoch == 1
        assert {h: (m.state, m.rank, m.incarnation) for h, m in now.items() if h in before} == {
            h: (pb.MEMBER_STATE_ALIVE, m.rank, m.incarnation) for h, m in before.items()
        }

    hold(1.0, untouched)
    judged = [
        e
        for e in cluster.events()
        if e.host_id in before and e.type in (pb.EVENT_TYPE_MEMBER_SUSPECT, pb.EVENT_TYPE_MEMBER_DEAD)
    ]
    assert judged == []
    # The log still rebuilds exactly what the coordinator stored.
    events, stored = read_store(cluster.redis_url, cluster.job)
    assert replay(events) == stored

    # Bad input gets a clear status and records nothing.
    count = len(cluster.events())
    with pytest.raises(grpc.RpcError) as err:
        report("Not A Tier")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tier" in (err.value.details() or "")
    with pytest.raises(grpc.RpcError) as err:
        report("host-shm", incarnation=inc - 1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert len(cluster.events()) == count


# ---- the whole path: a real trainer whose snapshot directory cannot be written -----------------------

STEPS = 12

# A user's script, as it would run under `remesh agent`, with one change for the test: right after
# the session is made, its host's snapshot directory is replaced by a regular file, as a disk that
# fails under a running job. Held at the end until the test has read the agent's metrics (the agent
# exits with its trainer once the job finished).
UNWRITABLE = textwrap.dedent(
    """
    import functools, json, os, pathlib, shutil, sys, time
    from examples.tinylm import data, model
    from remesh.elastic import Policy, Session

    shm_dir, out, release, steps = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]), int(sys.argv[4])
    config = model.Config(seq_len=16, d_model=32, n_layers=1, d_mlp=128)
    session = Session(
        init_state=functools.partial(model.init_state, 0, config),
        train_step=functools.partial(model.train_step, config=config),
        batch_for_step=lambda step: data.global_batch(step, 4, 16, 0),
        devices_per_host=2,
        policy=Policy(snapshot_every=1, shm_dir=shm_dir),
    )
    directory = session.snapshots.directory
    shutil.rmtree(directory)
    directory.write_text("no longer a directory")
    last = 0
    for result in session.run(steps):
        last = result.step
        time.sleep(0.05)
    outcome = {"last": last, "stats": session.stats, "tiers_missing": session.tiers_missing}
    with open(str(out) + ".tmp", "w") as f:
        json.dump(outcome, f)
    os.replace(str(out) + ".tmp", out)
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    session.close()
    """
)


@pytest.mark.timeout(300)
def test_a_trainer_whose_snapshot_directory_cannot_be_written_is_counted_recorded_and_finishes(
    cluster: Cluster, tmp_path: Path
) -> None:
    script, out, release = tmp_path / "unwritable.py", tmp_path / "outcome.json", tmp_path / "release"
    script.write_text(UNWRITABLE)
    shm = tmp_path / "shm"  # the snapshots' root: the trainer makes its host's directory in it
    cluster.start_coordinator("--world-size", "1")
    agent = cluster.start_agent(
        "host-0",
        trainer=[sys.executable, str(script), str(shm), str(out), str(release), str(STEPS)],
        env=ENV,
        extra=("--no-warm-standby", "--metrics-port", "0"),
    )
    try:
        wait_for(out.exists, 150, "the trainer to finish its steps")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{cluster.log_tails(40)}") from exc
    outcome = json.loads(out.read_text())
    stats = outcome["stats"]
    assert outcome["last"] == STEPS
    # Every snapshot failed, each counted by tier; the tier is said missing with its error.
    failures = stats["snapshot_failures"]
    assert failures >= 3 and stats["snapshot_failures.host-shm"] == failures, stats
    assert list(outcome["tiers_missing"]) == ["host-shm"]
    assert "Not a directory" in outcome["tiers_missing"]["host-shm"]
    # The trainer said so as an error once, however many snapshots failed.
    assert agent.output().count("the snapshot tier cannot keep this process's snapshots") == 1

    # The agent publishes the count and the missing tier (its totals arrive with progress reports).
    me = {"host": "host-0", "job_id": cluster.job}
    port = metrics_port(agent)

    def heard() -> Samples | None:
        samples = scrape(port)
        return (
            samples
            if value(samples, "remesh_trainer_snapshot_failures_total", **me, tier="host-shm")
            else None
        )

    samples = wait_for(heard, 20, "the agent to count the failures")
    counted = value(samples, "remesh_trainer_snapshot_failures_total", **me, tier="host-shm") or 0
    assert 1 <= counted <= failures
    assert value(samples, "remesh_trainer_tier_missing", **me, tier="host-shm") == 1

    # The coordinator recorded it once, naming host, tier and error, and acted on none of it.
    events = cluster.events()
    recorded = [e for e in events if e.type == pb.EVENT_TYPE_TIER_MISSING]
    assert [(e.host_id, e.details["tier"]) for e in recorded] == [("host-0", "host-shm")], recorded
    assert "Not a directory" in recorded[0].details["detail"] and "host-shm" in recorded[0].reason
    types = [e.type for e in events]
    assert pb.EVENT_TYPE_MEMBER_SUSPECT not in types and pb.EVENT_TYPE_MEMBER_DEAD not in types
    assert types.count(pb.EVENT_TYPE_TOPOLOGY_CHANGED) == 1 and types.count(pb.EVENT_TYPE_JOB_FINISHED) == 1
    stored_events, stored = read_store(cluster.redis_url, cluster.job)
    assert replay(stored_events) == stored

    # An operator reads it with `remesh events`.
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "remesh.cli",
            "events",
            "--coordinator",
            cluster.address,
            "--type",
            "tier_missing",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **cluster.client_env(), "COLUMNS": "300"},
    )
    assert shown.returncode == 0, shown.stderr
    (line,) = shown.stdout.splitlines()
    assert "tier_missing" in line and "host-0" in line and "host-shm" in line and "Not a directory" in line

    # The job ends as any finished job does: the agent exits 0 once its trainer does.
    release.touch()
    wait_for(lambda: not agent.alive(), 60, "the agent to exit")
    assert agent.popen.returncode == 0

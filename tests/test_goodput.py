"""Goodput from the event log alone (remesh.coordinator.goodput): the categories of a run with one
failure, worked out by hand, then the same run finished, mid-recovery, and with an epoch superseded
before it went live."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remesh.coordinator.goodput import BADPUT, Log, compute
from remesh.coordinator.model import Event, EventType, Topology, TopologyMember


def topology(t: float, epoch: int, hosts: list[str], restore: int, reached: int | None = None) -> Event:
    topo = Topology(
        epoch=epoch,
        members=tuple(TopologyMember(h, r, 2, "127.0.0.1") for r, h in enumerate(hosts)),
        mesh_shape=(len(hosts), 2),
        jax_coordinator_address="127.0.0.1:1",
        restore_step=restore,
        reason="test",
        created_at=t,
    )
    details = {} if reached is None else {"reached_step": str(reached)}
    return Event(EventType.TOPOLOGY_CHANGED, t, epoch, "test", topology=topo, details=details)


def ack(
    t: float, epoch: int, host: str, restored: int, restore_s: float, reached: int | None = None
) -> Event:
    phases = {"reinit": 0.5, "restore": restore_s, "compile": 1.0, "first_step": 0.2}
    details = {"restored_step": str(restored), "phases": json.dumps(phases)}
    if reached is not None:
        details["reached_step"] = str(reached)
    return Event(EventType.EPOCH_ACKED, t, epoch, "ack", host_id=host, details=details)


def live(t: float, epoch: int) -> Event:
    return Event(EventType.EPOCH_LIVE, t, epoch, "live")


def dead(t: float, host: str, epoch: int) -> Event:
    return Event(EventType.MEMBER_DEAD, t, epoch, "stream broke", host_id=host)


# Joined at 0, epoch 1 live at 20 (steps 1..100 by 120, when h1 dies), epoch 2 published at 121
# restoring step 90, live at 130 (the slowest restore 2 s), then steps 91..190 by 230.
RUN = [
    Event(EventType.MEMBER_JOINED, 0.0, 0, "joined", host_id="h0"),
    topology(10.0, 1, ["h0", "h1"], -1),
    ack(19.0, 1, "h0", 0, 0.0),
    ack(20.0, 1, "h1", 0, 0.0),
    live(20.0, 1),
    dead(120.0, "h1", 1),
    topology(121.0, 2, ["h0", "s0"], 90, reached=100),
    ack(128.0, 2, "h0", 90, 1.0),
    ack(130.0, 2, "s0", 90, 2.0),
    live(130.0, 2),
]


def test_one_failure_worked_out_by_hand() -> None:
    g = compute(RUN, now=230.0, current_step=190)
    # Epoch 1: 99 timed steps (2..100) in 100 s; epoch 2 restored 90, so steps 91..100 were thrown away.
    assert g.productive_s == pytest.approx(100 * 89 / 99 + 100)
    assert g.badput_s["wasted_progress"] == pytest.approx(100 * 10 / 99)
    assert g.badput_s["initialization"] == pytest.approx(20.0)
    assert g.badput_s["checkpoint_restore"] == pytest.approx(2.0)  # the slowest member's
    assert g.badput_s["recovery"] == pytest.approx(8.0)  # 120 -> 130, less the restore
    assert g.badput_s["checkpoint_save"] is None  # not known to the coordinator
    assert g.badput_s["other"] == pytest.approx(0.0, abs=1e-9)
    assert g.goodput == pytest.approx(g.productive_s / 230.0)
    assert set(g.badput_s) == set(BADPUT)
    # Per epoch: epoch 1 ran 100 s for 99 timed steps, 89 kept; epoch 2 ran 100 s, all 99 kept.
    assert [(e.epoch, e.steps, e.kept) for e in g.epochs] == [(1, 99, 89), (2, 99, 99)]
    assert [round(e.ran_s, 6) for e in g.epochs] == [100.0, 100.0]
    assert sum(e.productive_s for e in g.epochs) == pytest.approx(g.productive_s)
    assert sum(e.wasted_s for e in g.epochs) == pytest.approx(g.badput_s["wasted_progress"])
    (r,) = g.recoveries
    assert (r.hosts, r.epoch, r.restored_step, r.steps_lost) == (("h1",), 2, 90, 10)
    assert r.phases["decide"] == pytest.approx(1.0) and r.phases["restore"] == 2.0
    assert r.to_dict()["to_live_s"] == pytest.approx(10.0)


def test_an_epoch_resumes_from_the_lowest_step_its_members_restored_and_waits_for_the_slowest() -> None:
    """One member of epoch 2 restored step 80 (an older snapshot), the other 90: the epoch resumed
    from 80, so steps 81..100 were thrown away; its slowest member's phases are the recovery's."""
    run = [*RUN]
    run[7] = ack(128.0, 2, "h0", 80, 3.5)  # h0: restored 80, the longest restore
    g = compute(run, now=230.0, current_step=190)
    assert [(e.epoch, e.steps, e.kept) for e in g.epochs] == [(1, 99, 79), (2, 109, 109)]
    (r,) = g.recoveries
    assert (r.restored_step, r.steps_lost) == (80, 20)
    assert r.phases["restore"] == 3.5 and g.badput_s["checkpoint_restore"] == pytest.approx(3.5)


def test_the_furthest_step_a_member_acknowledged_counts_where_the_topology_lagged() -> None:
    """Progress reaches the coordinator at most once a second: epoch 2's topology recorded step 95,
    but h0 completed step 100 before it (its acknowledgement says so). The thrown-away steps are
    counted from 100, as in the run whose topology knew it."""
    lagging = [*RUN]
    lagging[6] = topology(121.0, 2, ["h0", "s0"], 90, reached=95)
    lagging[7] = ack(128.0, 2, "h0", 90, 1.0, reached=100)
    lagging[8] = ack(130.0, 2, "s0", 90, 2.0, reached=-1)  # a spare: never ran a step of the job
    g = compute(lagging, now=230.0, current_step=190)
    assert g.to_dict() == compute(RUN, now=230.0, current_step=190).to_dict()
    (r,) = g.recoveries
    assert r.steps_lost == 10
    # Without the acknowledgement, the topology's lagging figure is all there is.
    lagging[7] = ack(128.0, 2, "h0", 90, 1.0)
    assert compute(lagging, now=230.0, current_step=190).recoveries[0].steps_lost == 5
    # A member that did not run epoch 1 (s0, a host added back that once got further in a timeline
    # the job rolled back from) says nothing of how far epoch 1 got.
    lagging[8] = ack(130.0, 2, "s0", 90, 2.0, reached=400)
    assert compute(lagging, now=230.0, current_step=190).recoveries[0].steps_lost == 5


def test_a_finished_job_ends_at_its_last_step_whatever_the_clock_says() -> None:
    finished = [*RUN, Event(EventType.JOB_FINISHED, 230.0, 2, "done", details={"step": "190"})]
    g = compute(finished, now=10_000.0)
    assert g.finished and g.now == 230.0
    assert g.to_dict() == compute(RUN, now=230.0, current_step=190).to_dict() | {"finished": True}


def test_a_recovery_under_way_counts_as_recovery_so_far() -> None:
    g = compute(RUN[:6], now=125.0, current_step=None)
    assert g.badput_s["recovery"] == pytest.approx(5.0)
    assert g.badput_s["initialization"] == pytest.approx(20.0)
    # Epoch 1's steps are not known yet (no new topology recorded how far it got): its time is other.
    assert g.productive_s == 0.0 and g.badput_s["other"] == pytest.approx(100.0)
    (r,) = g.recoveries
    assert r.live_at is None and r.epoch == 0 and r.hosts == ("h1",)
    # Once the new epoch is published it says how far epoch 1 got, and what it will keep.
    g = compute(RUN[:7], now=125.0, current_step=None)
    assert g.productive_s == pytest.approx(100 * 89 / 99)
    assert g.badput_s["recovery"] == pytest.approx(5.0)


def test_an_epoch_superseded_before_going_live_is_part_of_the_recovery() -> None:
    # Epoch 2 is published, then s0 dies too before it goes live; epoch 3 (restoring 90) goes live.
    run = [
        *RUN[:7],
        dead(124.0, "s0", 2),
        topology(125.0, 3, ["h0", "s1"], 90, reached=90),
        ack(134.0, 3, "h0", 90, 1.0),
        ack(135.0, 3, "s1", 90, 3.0),
        live(135.0, 3),
    ]
    g = compute(run, now=235.0, current_step=190)
    # Epoch 1 is followed by epoch 2, which recorded that it got to step 100; epoch 3 kept up to 90.
    assert g.badput_s["wasted_progress"] == pytest.approx(100 * 10 / 99)
    assert g.badput_s["checkpoint_restore"] == pytest.approx(3.0)
    assert g.badput_s["recovery"] == pytest.approx(15.0 - 3.0)
    (r,) = g.recoveries
    assert r.hosts == ("h1", "s0") and r.epoch == 3
    assert g.productive_s + sum(v for v in g.badput_s.values() if v is not None) == pytest.approx(235.0)


def test_no_epoch_live_yet_is_all_initialization() -> None:
    g = compute(RUN[:3], now=15.0)
    assert (g.productive_s, g.badput_s["initialization"], g.goodput) == (0.0, 15.0, 0.0)
    assert compute([], now=5.0).wall_s == 0.0


@st.composite
def job_logs(draw: st.DrawFn) -> list[Event]:
    """A job's log in time order: epochs of a few hosts, acknowledged (restored steps, phases and
    reached steps drawn), live or not, failures between them, sometimes a finish."""
    hosts = [f"h{i}" for i in range(5)]
    t = 0.0
    log = [Event(EventType.MEMBER_JOINED, t, 0, "joined", host_id="h0")]
    for epoch in range(1, draw(st.integers(1, 4)) + 1):
        t += draw(st.floats(0.1, 30))
        members = draw(st.lists(st.sampled_from(hosts), min_size=1, max_size=4, unique=True))
        reached = draw(st.none() | st.integers(-1, 300))
        log.append(topology(t, epoch, members, draw(st.integers(-1, 200)), reached))
        for host in draw(st.lists(st.sampled_from(hosts), max_size=6)):  # strangers and repeats too
            t += draw(st.floats(0.0, 3))
            restored = draw(st.integers(-1, 200))
            log.append(
                ack(t, epoch, host, restored, draw(st.floats(0, 5)), draw(st.none() | st.integers(-1, 300)))
            )
        if draw(st.booleans()):
            t += draw(st.floats(0.0, 2))
            log.append(live(t, epoch))
        for host in draw(st.lists(st.sampled_from(hosts), max_size=2)):
            t += draw(st.floats(0.1, 60))
            log.append(dead(t, host, epoch))
    if draw(st.booleans()):
        t += draw(st.floats(0.1, 20))
        log.append(
            Event(EventType.JOB_FINISHED, t, 0, "done", details={"step": str(draw(st.integers(0, 400)))})
        )
    return log


@given(job_logs(), st.floats(0, 30), st.none() | st.integers(-1, 400))
def test_the_log_folded_as_it_comes_gives_what_compute_gives(
    log: list[Event], later: float, step: int | None
) -> None:
    """The coordinator folds each event into a ``Log`` as it publishes it and asks it every few
    seconds; ``remesh goodput --from-log`` computes from the events. After every event, both agree."""
    folded = Log()
    for i, event in enumerate(log):
        folded.add(event)
        now = event.time + later
        assert folded.goodput(now, step) == compute(log[: i + 1], now, step)

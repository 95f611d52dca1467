"""The recovery report and goodput as pure functions of the event log and the step records."""

from __future__ import annotations

import json
from typing import Any

import pytest

from remesh.demo.report import build_report, compare, step_records
from remesh.demo.runner import DemoConfig, DemoError, Schedule

T0 = 1_000.0


def ev(kind: str, t: float, epoch: int = 0, host: str = "", **details: Any) -> dict[str, Any]:
    return {
        "id": f"{int(t * 1000)}-0",
        "type": kind,
        "time": T0 + t,
        "host_id": host,
        "epoch": epoch,
        "reason": kind,
        "details": {k: str(v) if not isinstance(v, dict) else json.dumps(v) for k, v in details.items()},
        "topology": None,
    }


def topology(t: float, epoch: int, hosts: list[str], restore: int, **details: Any) -> dict[str, Any]:
    """A topology_changed event as `remesh events --json` prints it."""
    event = ev("topology_changed", t, epoch, **details)
    event["topology"] = {
        "epoch": epoch,
        "world_size": len(hosts),
        "mesh_shape": [len(hosts), 2],
        "jax_coordinator_address": "127.0.0.1:1",
        "restore_step": restore,
        "reason": "test",
        "created_at": T0 + t,
        "halted": False,
        "job_id": "job",
        "commits": [],
        "members": [
            {"host_id": h, "rank": r, "device_count": 2, "address": "127.0.0.1"} for r, h in enumerate(hosts)
        ],
    }
    return event


def steps(first: int, last: int, t_start: float, dt: float, epoch: int, source: str) -> list[dict[str, Any]]:
    return [
        {"t": T0 + t_start + i * dt, "step": s, "loss": 5.0 - s / 100, "epoch": epoch, "source": source}
        for i, s in enumerate(range(first, last + 1))
    ]


PHASES = {"started_at": T0 + 20.3, "reinit": 0.3, "restore": 1.0, "compile": 1.5, "first_step": 0.4}


def one_failure_run() -> tuple[
    dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]
]:
    """Training from t=10 at 10 steps/s to step 100 (t=19.9); host-1 killed at t=20.0; the survivors
    restore step 98 (2 steps lost), first new step at t=22.6, then steps 99..200."""
    events = [
        topology(5.0, 1, ["host-0", "host-1"], -1),
        ev("epoch_live", 9.9, 1),
        ev("member_dead", 20.12, 1, "host-1"),
        topology(20.13, 2, ["host-0", "spare-0"], 98, reached_step=100),
        ev(
            "epoch_acked",
            22.5,
            2,
            "host-0",
            restored_step=98,
            restore_source="memory",
            phases=PHASES,
            restored_bytes={"memory": 1000},
        ),
        ev(
            "epoch_acked",
            22.6,
            2,
            "spare-0",
            restored_step=98,
            restore_source="buddy+peer",
            phases=PHASES,
            restored_bytes={"buddy": 900, "peer": 100},
        ),
        ev("epoch_live", 22.6, 2),
    ]
    records = steps(1, 100, 10.0, 0.1, 1, "host-0-1") + steps(99, 200, 22.6, 0.1, 2, "host-0-1")
    failures = [
        {"index": 0, "time": T0 + 20.0, "host_id": "host-1", "how": "kill", "rank": 1, "epoch_before": 1,
         "recovered_epoch": 2}
    ]  # fmt: skip
    run = {"mode": "inplace", "started_at": T0, "ended_at": records[-1]["t"], "target_step": 200}
    return run, failures, events, records


def test_a_recovery_is_measured_phase_by_phase_from_the_event_log() -> None:
    report = build_report(*one_failure_run())
    (f,) = report["failures"]
    assert f["recovered"] and f["epoch_before"] == 1 and f["epoch_after"] == 2
    assert f["mttr_s"] == pytest.approx(2.6)
    assert f["phases"]["detect"] == pytest.approx(0.12)
    assert f["phases"]["decide"] == pytest.approx(0.01)
    assert f["phases"]["broadcast"] == pytest.approx(0.17)
    assert f["phases"]["compile"] == 1.5
    assert f["step_at_failure"] == 100 and f["restored_step"] == 98 and f["steps_lost"] == 2
    assert f["restore_sources"] == ["buddy+peer", "memory"]
    # Which tier each member's state came from, and the bytes: the spare's moved, host-0's did not.
    assert f["restored_bytes"] == {"buddy": 900, "memory": 1000, "peer": 100}
    assert f["restored_bytes_by_member"]["spare-0"] == {"buddy": 900, "peer": 100}
    s = report["summary"]
    assert (s["failures"], s["recovered"], s["first_epoch"], s["last_epoch"]) == (1, 1, 1, 2)
    assert report["run"]["final_step"] == 200 and report["run"]["reached_target"]


def test_goodput_counts_each_surviving_step_once_and_names_the_rest() -> None:
    report = build_report(*one_failure_run())
    g = report["goodput_from_steps"]
    # 200 kept steps of 0.1 s; steps 99 and 100 of epoch 1 were trained again: wasted.
    assert g["productive_s"] == pytest.approx(20.0, abs=0.01)
    assert g["badput_s"]["wasted_progress"] == pytest.approx(0.2, abs=0.01)
    # Step 1 completed at t=10.0 after 0.1 s of training: the 9.9 s before it were start-up.
    assert g["badput_s"]["initialization"] == pytest.approx(9.9, abs=0.01)
    # Recovery: from the kill (t=20.0) to the start of the first new step (22.6 - 0.1), restore apart.
    assert g["badput_s"]["checkpoint_restore"] == pytest.approx(1.0)
    assert g["badput_s"]["recovery"] == pytest.approx(1.5, abs=0.01)
    total = g["productive_s"] + sum(g["badput_s"].values())
    assert total == pytest.approx(g["wall_s"], abs=0.01)
    assert g["goodput"] == pytest.approx(g["productive_s"] / g["wall_s"], abs=1e-3)


def test_the_reports_goodput_is_the_coordinators_from_the_event_log() -> None:
    """The headline figures come from remesh.coordinator.goodput (what `remesh goodput` and the
    coordinator's gauges say): epoch 1 ran from live (9.9) to host-1's death (20.12), 100 steps of
    which epoch 2 kept 98; epoch 2 ran from 22.6 to the end (32.7), all kept."""
    run, failures, events, records = one_failure_run()
    g = build_report(run, failures, events, records)["goodput"]
    assert g["productive_s"] == pytest.approx(10.22 * 98 / 100 + 10.1, abs=0.01)
    assert g["badput_s"]["wasted_progress"] == pytest.approx(10.22 * 2 / 100, abs=0.01)
    assert g["badput_s"]["initialization"] == pytest.approx(9.9, abs=0.01)  # from the demo's start
    assert g["badput_s"]["checkpoint_restore"] == pytest.approx(1.0)
    assert g["badput_s"]["recovery"] == pytest.approx(2.48 - 1.0, abs=0.01)
    assert g["productive_s"] + sum(g["badput_s"].values()) == pytest.approx(g["wall_s"], abs=0.01)
    assert [r["hosts"] for r in g["recoveries"]] == [["host-1"]]
    # The checkpoint waits only the trainers know move from kept steps to checkpoint save.
    waited = [dict(r, checkpoint_wait_s=0.5) if r["step"] == 200 else r for r in records]
    h = build_report(run, failures, events, waited)["goodput"]
    assert h["badput_s"]["checkpoint_save"] == pytest.approx(0.5)
    assert h["productive_s"] == pytest.approx(g["productive_s"] - 0.5, abs=0.01)


def test_a_failure_without_its_events_is_reported_unrecovered() -> None:
    run, failures, events, records = one_failure_run()
    events = [e for e in events if not (e["type"] == "epoch_live" and e["epoch"] == 2)]
    (f,) = build_report(run, failures, events, records)["failures"]
    assert not f["recovered"] and f["missing"] == ["epoch_live"]


def test_a_failure_the_job_finished_before_is_reported_as_such_not_as_missing_events() -> None:
    run, failures, events, records = one_failure_run()
    failures = [{**failures[0], "finished_first": True}]
    failures[0].pop("recovered_epoch")
    (f,) = build_report(run, failures, events, records)["failures"]
    assert f["finished_first"] and not f["recovered"] and "missing" not in f


def test_step_records_mark_the_last_training_of_each_step_as_kept() -> None:
    rows = step_records(steps(1, 3, 0, 1, 1, "a") + steps(2, 4, 10, 1, 2, "b"))
    assert [(r["step"], r["kept"]) for r in rows] == [
        (1, True),
        (2, False),
        (3, False),
        (2, True),
        (3, True),
        (4, True),
    ]
    assert [r["duration"] for r in rows] == [None, 1.0, 1.0, None, 1.0, 1.0]


def test_compare_puts_two_runs_side_by_side_with_ratios() -> None:
    a = build_report(*one_failure_run())
    run, failures, events, records = one_failure_run()
    b = build_report({**run, "mode": "restart", "ended_at": run["ended_at"] + 10}, failures, events, records)
    rows = {r[0]: r for r in compare(a, b)}
    assert rows["mode"][1:3] == ("inplace", "restart")
    assert rows["wall time (s)"][3] == f"{b['goodput']['wall_s'] / a['goodput']['wall_s']:.2f}x"
    assert "badput: recovery (s)" in rows


def test_bad_demo_arguments_are_refused_before_anything_starts() -> None:
    with pytest.raises(DemoError, match="unknown host 'host-9'"):
        DemoConfig(hosts=3, schedule=Schedule(targets=("host-9",))).validate()
    with pytest.raises(DemoError, match="outside the run"):
        DemoConfig(steps=100, schedule=Schedule(at_steps=(100,))).validate()
    with pytest.raises(DemoError, match="--mtbf"):
        DemoConfig(schedule=Schedule(mtbf_s=0)).validate()
    DemoConfig(hosts=3, steps=100, schedule=Schedule(at_steps=(50,), targets=("rank0", "host-2"))).validate()


def test_mtbf_schedule_is_seeded_and_bounded() -> None:
    a = Schedule(mtbf_s=10, seed=1).mtbf_offsets(100)
    assert a == Schedule(mtbf_s=10, seed=1).mtbf_offsets(100)
    assert a != Schedule(mtbf_s=10, seed=2).mtbf_offsets(100)
    assert a and all(0 < x <= 100 for x in a) and a == sorted(a)
    assert Schedule().mtbf_offsets(100) == []

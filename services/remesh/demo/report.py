"""The recovery report: what each failure cost, and the run's goodput, from the logs alone.

Everything here is a pure function of three records, so ``remesh events`` and the report always agree:

- the coordinator's **event log** (as ``remesh events --json`` prints it): when a member was declared
  dead, when the new topology was published, what each member restored and how long each phase of
  its recovery took (``epoch_acked``), when every member ran the new epoch (``epoch_live``);
- the **failures** the demo injected (when, which host, how, which epoch recovered it);
- the trainers' **step records** (one line per training step from the process holding rank 0: wall
  time, step, loss, epoch).

Goodput follows Google's ml-goodput-measurement: productive time is the time spent on training steps
whose result survives to the end of the run; everything else is badput, broken down into
initialisation (job start to the first step), recovery (failure to the first step after it, less
its restore), checkpoint restore, checkpoint save (time the loop waited for a save), wasted progress
(steps trained, lost to a failure, trained again) and the unaccounted rest. The report's figures
are the coordinator's (``remesh.coordinator.goodput``, from the event log), with the checkpoint
waits only the trainers know; ``goodput_from_steps`` computes them again from the step records.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from remesh.coordinator import goodput
from remesh.views import event_from_dict

__all__ = ["PHASES", "build_report", "compare", "step_records"]

# The phases of one recovery, in order. In-place: the coordinator decides and broadcasts a new epoch.
# Restart baseline: the whole job is killed and launched again ("relaunch" replaces decide).
PHASES = ("detect", "decide", "relaunch", "broadcast", "reinit", "restore", "compile", "first_step")
_TRAINER_PHASES = ("reinit", "restore", "compile", "first_step")
BADPUT = ("initialization", "recovery", "checkpoint_restore", "checkpoint_save", "wasted_progress", "other")


def _ordered(events: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(events, key=lambda e: (e["time"], e.get("id", "")))


def _first(events: Sequence[Mapping[str, Any]], **match: Any) -> Mapping[str, Any] | None:
    after = match.pop("after", None)
    for e in events:
        if after is not None and e["time"] < after:
            continue
        if all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def _acks(events: Sequence[Mapping[str, Any]], epoch: int) -> list[Mapping[str, Any]]:
    return [e for e in events if e["type"] == "epoch_acked" and e["epoch"] == epoch]


def _phases(ack: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in json.loads(ack["details"].get("phases", "{}")).items()}


def step_records(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Step records in time order, each with its ``duration`` (None where it cannot be known: the
    first step a process ran in an epoch) and whether it is ``kept`` (the last time this step was
    trained) or wasted (trained again after a failure)."""
    ordered = sorted((dict(r) for r in records), key=lambda r: r["t"])
    previous: dict[tuple[str, int], dict[str, Any]] = {}
    last_index: dict[int, int] = {}
    for i, r in enumerate(ordered):
        key = (str(r.get("source", "")), int(r["epoch"]))
        prev = previous.get(key)
        r["duration"] = r["t"] - prev["t"] if prev is not None and prev["step"] == r["step"] - 1 else None
        previous[key] = r
        last_index[int(r["step"])] = i
    for i, r in enumerate(ordered):
        r["kept"] = last_index[int(r["step"])] == i
    return ordered


def _failure_report(
    failure: Mapping[str, Any],
    events: Sequence[Mapping[str, Any]],
    steps: Sequence[Mapping[str, Any]],
    mode: str,
) -> dict[str, Any]:
    t_kill = float(failure["time"])
    victim = failure["host_id"]
    epoch = int(failure.get("recovered_epoch", -1))
    out: dict[str, Any] = {
        "index": failure["index"],
        "host_id": victim,
        "how": failure["how"],
        "rank": failure.get("rank", -1),
        "time": t_kill,
        "epoch_before": failure.get("epoch_before"),
        "epoch_after": epoch if epoch > 0 else None,
        "recovered": False,
    }
    before = [r for r in steps if r["t"] <= t_kill]
    step_at_kill = max((int(r["step"]) for r in before), default=0)
    out["step_at_failure"] = step_at_kill
    if failure.get("finished_first"):
        out["finished_first"] = True  # the job completed before any recovery was needed
        return out
    dead = _first(events, type="member_dead", host_id=victim, after=t_kill)
    changed = _first(events, type="topology_changed", epoch=epoch) if epoch > 0 else None
    live = _first(events, type="epoch_live", epoch=epoch) if epoch > 0 else None
    acks = _acks(events, epoch) if epoch > 0 else []
    if dead is None or changed is None or live is None or not acks:
        out["missing"] = [
            name
            for name, value in (("member_dead", dead), ("topology_changed", changed), ("epoch_live", live))
            if value is None
        ] + ([] if acks else ["epoch_acked"])
        return out
    phases_by_member = [_phases(a) for a in acks]
    started = max(p.get("started_at", changed["time"]) for p in phases_by_member)
    phases: dict[str, float] = {"detect": dead["time"] - t_kill}
    if mode == "restart":
        phases["relaunch"] = changed["time"] - dead["time"]
    else:
        phases["decide"] = changed["time"] - dead["time"]
    phases["broadcast"] = max(0.0, started - changed["time"])
    # The slowest member sets the pace: a step needs every member.
    for name in _TRAINER_PHASES:
        phases[name] = max(p.get(name, 0.0) for p in phases_by_member)
    restored = min(int(a["details"].get("restored_step", "-1")) for a in acks)
    sources = sorted({a["details"].get("restore_source", "") for a in acks})
    # Where each member's state came from: bytes per tier, and all members together.
    by_member = {a.get("host_id", ""): _restored_bytes(a) for a in acks}
    tiers: dict[str, int] = {}
    for member in by_member.values():
        for tier, n in member.items():
            tiers[tier] = tiers.get(tier, 0) + n
    out.update(
        recovered=True,
        mttr_s=live["time"] - t_kill,
        detected_s=dead["time"] - t_kill,
        phases={k: round(v, 4) for k, v in phases.items()},
        restored_step=restored,
        restore_sources=sources,
        restored_bytes=dict(sorted(tiers.items())),
        restored_bytes_by_member=by_member,
        steps_lost=max(0, step_at_kill - max(restored, 0)),
        dead_reason=dead.get("reason", ""),
        topology_reason=changed.get("reason", ""),
        world_size_after=len((changed.get("topology") or {}).get("members", [])),
    )
    return out


def _restored_bytes(ack: Mapping[str, Any]) -> dict[str, int]:
    try:
        raw = json.loads(ack["details"].get("restored_bytes", "{}"))
    except ValueError:
        return {}
    return {str(k): int(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def _checkpoint_waits(steps: Sequence[Mapping[str, Any]]) -> float:
    """Seconds the trainers' loops waited for a checkpoint save: each process reports its own running
    total, so the last record of each counts once."""
    by_source: dict[str, float] = {}
    for r in steps:
        by_source[str(r.get("source", ""))] = float(r.get("checkpoint_wait_s", 0.0))
    return sum(by_source.values())


def _goodput_from_log(
    run: Mapping[str, Any], events: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The run's goodput as the coordinator computes it (``remesh.coordinator.goodput``, from the
    event log alone), from the demo's start, with what only the trainers know added: the time their
    loop waited for a checkpoint save (out of the time on kept steps) and the typical step."""
    final_step = max((int(r["step"]) for r in steps), default=None)
    g = goodput.compute(
        [event_from_dict(e) for e in events], float(run["ended_at"]), final_step, float(run["started_at"])
    )
    save = min(_checkpoint_waits(steps), g.productive_s)
    badput = {k: float(v) if v is not None else 0.0 for k, v in g.badput_s.items()}
    badput["checkpoint_save"] = save
    productive, wall = g.productive_s - save, max(g.wall_s, 1e-9)
    known = [r["duration"] for r in steps if r["duration"] is not None]
    return _summary(wall, productive, badput, statistics.median(known) if known else 0.0) | {
        "recoveries": [r.to_dict() for r in g.recoveries],
        "epochs": [e.to_dict() for e in g.epochs],
    }


def _summary(
    wall: float, productive: float, badput: Mapping[str, float], median_step: float
) -> dict[str, Any]:
    """The goodput section of the report; "running" leaves the job's start-up out (paid once by every
    way of recovering; on this machine mostly JAX importing and compiling on 2 cores)."""
    running = wall - badput["initialization"]
    return {
        "wall_s": round(wall, 3),
        "productive_s": round(productive, 3),
        "goodput": round(productive / wall, 4),
        "running_s": round(running, 3),
        "running_goodput": round(productive / running, 4) if running > 0 else 0.0,
        "badput_s": {k: round(v, 3) for k, v in badput.items()},
        "badput_fraction": {k: round(v / wall, 4) for k, v in badput.items()},
        "median_step_s": round(median_step, 4),
    }


def _goodput_from_steps(
    run: Mapping[str, Any],
    failures: Sequence[Mapping[str, Any]],  # the failure reports: time, epoch_after, phases
    steps: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """The same categories from the trainer's own step records (rank 0's line per step): a second
    opinion on ``_goodput_from_log``, which the report's headline figures come from."""
    start, end = float(run["started_at"]), float(run["ended_at"])
    wall = max(end - start, 1e-9)
    known = [r["duration"] for r in steps if r["duration"] is not None]
    typical = statistics.median(known) if known else 0.0

    def duration(r: Mapping[str, Any]) -> float:
        return float(r["duration"]) if r["duration"] is not None else typical

    productive = sum(duration(r) for r in steps if r["kept"])
    badput = dict.fromkeys(BADPUT, 0.0)
    badput["wasted_progress"] = sum(duration(r) for r in steps if not r["kept"])
    if steps:
        badput["initialization"] = max(0.0, steps[0]["t"] - start - duration(steps[0]))
    for f in failures:
        t_kill = float(f["time"])
        epoch = int(f.get("epoch_after") or -1)
        resumed = next((r for r in steps if r["t"] > t_kill and int(r["epoch"]) >= epoch > 0), None)
        if resumed is None:
            continue
        window = max(0.0, resumed["t"] - t_kill - duration(resumed))
        restore = min(window, float(f.get("phases", {}).get("restore", 0.0)))
        badput["checkpoint_restore"] += restore
        badput["recovery"] += window - restore
    badput["checkpoint_save"] = _checkpoint_waits(steps)
    badput["other"] = wall - productive - sum(v for k, v in badput.items() if k != "other")
    return _summary(wall, productive, badput, typical)


def build_report(
    run: Mapping[str, Any],
    failures: Sequence[Mapping[str, Any]],
    events: Iterable[Mapping[str, Any]],
    records: Iterable[Mapping[str, Any]],
) -> dict[str, Any]:
    """The report.json document. ``run`` holds mode, job, started_at, ended_at and target_step."""
    ordered = _ordered(events)
    steps = step_records(records)
    mode = str(run.get("mode", "inplace"))
    reports = [_failure_report(f, ordered, steps, mode) for f in failures]
    recovered = [f for f in reports if f["recovered"]]
    epochs = [e["epoch"] for e in ordered if e["type"] == "topology_changed"]
    final_step = max((int(r["step"]) for r in steps), default=0)
    lost = [f["steps_lost"] for f in recovered]
    finished = next((e for e in ordered if e["type"] == "job_finished"), None)
    # A clean end: nobody declared dead and no epoch once the job reached its last step.
    after_finish = [
        e["type"]
        for e in ordered
        if finished is not None
        and e["time"] >= finished["time"]
        and e["type"] in ("member_dead", "topology_changed", "job_halted")
    ]
    return {
        "run": {**run, "final_step": final_step, "reached_target": final_step >= int(run["target_step"])},
        "summary": {
            "failures": len(reports),
            "recovered": len(recovered),
            "mttr_s": [round(f["mttr_s"], 3) for f in recovered],
            "mttr_p50_s": round(statistics.median([f["mttr_s"] for f in recovered]), 3)
            if recovered
            else None,
            "steps_lost": lost,
            "steps_lost_total": sum(lost),
            "epochs": sorted(set(epochs)),
            "first_epoch": min(epochs, default=0),
            "last_epoch": max(epochs, default=0),
            "finished_step": int(finished["details"]["step"]) if finished else None,
            "events_after_finish": after_finish,
        },
        # As the coordinator, `remesh goodput` and `remesh top` compute it (one implementation), and
        # a second opinion from the trainer's step records.
        "goodput": _goodput_from_log(run, ordered, steps),
        "goodput_from_steps": _goodput_from_steps(run, reports, steps),
        "failures": reports,
        "loss": [
            {"t": round(r["t"] - float(run["started_at"]), 3), "step": r["step"], "loss": r["loss"]}
            for r in steps
            if "loss" in r
        ],
        "events": len(ordered),
    }


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows (what, A, B, B/A) comparing two reports: recovery times, steps lost, goodput, badput."""

    def num(x: Any, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    def ratio(x: Any, y: Any) -> str:
        return f"{y / x:.2f}x" if isinstance(x, int | float) and isinstance(y, int | float) and x else "-"

    sa, sb = a["summary"], b["summary"]
    ga, gb = a["goodput"], b["goodput"]
    rows = [
        ("mode", str(a["run"].get("mode")), str(b["run"].get("mode")), ""),
        ("failures recovered", f"{sa['recovered']}/{sa['failures']}", f"{sb['recovered']}/{sb['failures']}", ""),
        ("MTTR median (s)", num(sa["mttr_p50_s"]), num(sb["mttr_p50_s"]), ratio(sa["mttr_p50_s"], sb["mttr_p50_s"])),
        ("steps lost", str(sa["steps_lost_total"]), str(sb["steps_lost_total"]), ""),
        ("wall time (s)", num(ga["wall_s"]), num(gb["wall_s"]), ratio(ga["wall_s"], gb["wall_s"])),
        ("goodput", num(ga["goodput"], "{:.3f}"), num(gb["goodput"], "{:.3f}"), ratio(ga["goodput"], gb["goodput"])),
        ("goodput after start-up", num(ga["running_goodput"], "{:.3f}"), num(gb["running_goodput"], "{:.3f}"),
         ratio(ga["running_goodput"], gb["running_goodput"])),
    ]  # fmt: skip
    for name in BADPUT:
        x, y = ga["badput_s"][name], gb["badput_s"][name]
        rows.append((f"badput: {name} (s)", num(x), num(y), ratio(x, y)))
    return rows

"""`remesh goodput`: how much of a job's wall time was training, from its event log.

Live, it reads the running coordinator's event log and how far the current epoch's members got;
afterwards, ``--from-log FILE`` reads what ``remesh events --json`` wrote. Both go through
``remesh.coordinator.goodput.compute``, as does the coordinator's own ``remesh_goodput_ratio``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console
from rich.table import Table

from remesh.cli._top import furthest_step
from remesh.coordinator import convert
from remesh.coordinator.goodput import Goodput, compute, keep
from remesh.coordinator.model import Event
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.views import event_from_dict

__all__ = ["run_goodput"]


def _from_log(path: Path) -> list[Event]:
    events = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            events.append(event_from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path}:{number} is not an event as `remesh events --json` prints it ({exc})"
            ) from exc
    return events


def _live(stub: Any, timeout: float) -> tuple[list[Event], int | None]:
    events: list[Event] = []
    for e in stub.ReplayEvents(pb.ReplayEventsRequest(), timeout=timeout):
        keep(events, convert.event_from_pb(e))
    topology = stub.GetTopology(pb.GetTopologyRequest(), timeout=timeout)
    members = stub.ListMembers(pb.ListMembersRequest(), timeout=timeout).members
    return events, furthest_step(topology, members)


def _show(report: Goodput) -> None:
    console = Console(highlight=False)
    d = report.to_dict()
    state = "finished" if report.finished else "so far"
    console.print(
        f"goodput {d['goodput']:.1%} ({state}): {d['productive_s']:.1f} s of {d['wall_s']:.1f} s spent on kept steps"
    )
    table = Table(title="badput", title_justify="left")
    table.add_column("category")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for name, seconds in d["badput_s"].items():
        known = seconds is not None
        share = f"{seconds / d['wall_s']:.1%}" if known and d["wall_s"] else "-"
        table.add_row(name.replace("_", " "), f"{seconds:.1f}" if known else "not known", share)
    console.print(table)
    if d["epochs"]:
        per = Table(title="epochs", title_justify="left")
        for column in ("epoch", "ran", "steps", "kept", "productive", "wasted"):
            per.add_column(column, justify="right")
        for e in d["epochs"]:
            known = e["steps"] is not None
            per.add_row(
                str(e["epoch"]),
                f"{e['ran_s']:.1f}s",
                str(e["steps"]) if known else "not known",
                str(e["kept"]) if known else "-",
                f"{e['productive_s']:.1f}s",
                f"{e['wasted_s']:.1f}s",
            )
        console.print(per)
    if d["recoveries"]:
        rec = Table(title="recoveries", title_justify="left")
        for column in ("failed", "hosts", "epoch", "to live", "steps lost", "phases (slowest member)"):
            rec.add_column(column)
        for r in d["recoveries"]:
            phases = " ".join(f"{k} {v:.2f}s" for k, v in r["phases"].items())
            rec.add_row(
                time.strftime("%H:%M:%S", time.localtime(r["failed_at"])),
                ", ".join(r["hosts"]),
                str(r["epoch"] or "-"),
                "-" if r["to_live_s"] is None else f"{r['to_live_s']:.2f}s",
                "-" if r["steps_lost"] is None else str(r["steps_lost"]),
                phases or "under way",
            )
        console.print(rec)
    if report.badput_s.get("checkpoint_save") is None:
        console.print(
            "checkpoint save: the coordinator does not see it; the agents' "
            "remesh_trainer_checkpoint_wait_seconds_total has it",
            style="dim",
        )


def run_goodput(args: argparse.Namespace, channel: grpc.Channel | None) -> int:
    if args.log is not None:
        try:
            events = _from_log(Path(args.log))
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        now = args.now if args.now is not None else max((e.time for e in events), default=0.0)
        step = args.step
    else:
        assert channel is not None
        events, step = _live(pb_grpc.CoordinatorStub(channel), args.timeout)
        now = args.now if args.now is not None else time.time()
        step = args.step if args.step is not None else step
    report = compute(events, now, step)
    if args.json:
        print(json.dumps({**report.to_dict(), "current_step": step}))
    else:
        _show(report)
    return 0

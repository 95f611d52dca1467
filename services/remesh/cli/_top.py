"""`remesh top`: a live view of one running job, for people on a terminal.

Each refresh reads the members and the topology, and the events appended since the last refresh
(the whole log once, at the start: it is bounded). The job's step is the lowest step any member of
the current epoch completed (the step the job as a whole reached); its rate is the change between
two refreshes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from remesh.coordinator import convert
from remesh.coordinator.goodput import compute, keep
from remesh.coordinator.model import Event
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.views import enum_name, event_dict, event_line, member_dict, members_table, safe

__all__ = ["Top", "furthest_step", "job_step", "run_top"]

# Too frequent to be news on a screen of the last few events.
_QUIET = {pb.EVENT_TYPE_MEMBER_ALIVE, pb.EVENT_TYPE_MEMBER_ASSIGNED, pb.EVENT_TYPE_EPOCH_ACKED}


def _steps(topology: pb.Topology, members: Iterable[pb.Member]) -> list[int]:
    ranked = {m.host_id for m in topology.members}
    return [m.last_step for m in members if m.host_id in ranked and m.last_step >= 0]


def job_step(topology: pb.Topology, members: list[pb.Member]) -> int | None:
    """The lowest step completed by a member of ``topology`` (None: not every member reported one)."""
    steps = _steps(topology, members)
    return min(steps) if len(steps) == len(topology.members) and steps else None


def furthest_step(topology: pb.Topology, members: Iterable[pb.Member]) -> int | None:
    """The furthest step a member of ``topology`` completed (goodput's current step)."""
    return max(_steps(topology, members), default=None)


@dataclass
class Top:
    """What `remesh top` shows, refreshed from the coordinator."""

    stub: Any
    timeout: float
    keep: int = 8
    events: deque[pb.Event] = field(default_factory=deque)
    live_epochs: set[int] = field(default_factory=set)
    goodput_events: list[Event] = field(default_factory=list)
    _after: str = ""
    _previous: tuple[float, int, int] | None = None  # (time, epoch, step) at the last refresh
    doc: dict[str, Any] = field(default_factory=dict)
    members: list[pb.Member] = field(default_factory=list)
    topology: pb.Topology = field(default_factory=pb.Topology)

    def refresh(self) -> dict[str, Any]:
        reply = self.stub.ListMembers(pb.ListMembersRequest(), timeout=self.timeout)
        topology = self.stub.GetTopology(pb.GetTopologyRequest(), timeout=self.timeout)
        for event in self.stub.ReplayEvents(
            pb.ReplayEventsRequest(after_id=self._after), timeout=self.timeout
        ):
            self._after = event.id
            keep(self.goodput_events, convert.event_from_pb(event))
            if event.type == pb.EVENT_TYPE_EPOCH_LIVE:
                self.live_epochs.add(event.epoch)
            if event.type not in _QUIET:
                self.events.append(event)
                while len(self.events) > self.keep:
                    self.events.popleft()
        now = time.time()
        members = list(reply.members)
        step = job_step(topology, members)
        rate = None
        previous = self._previous
        if step is not None and previous is not None and previous[1] == topology.epoch and now > previous[0]:
            rate = max(0.0, (step - previous[2]) / (now - previous[0]))
        self._previous = (now, topology.epoch, step) if step is not None else None
        self.members, self.topology = members, topology
        report = compute(self.goodput_events, now, furthest_step(topology, members))
        self.doc = {
            "time": now,
            "job_id": topology.job_id,
            "epoch": topology.epoch,
            "epoch_live": topology.epoch in self.live_epochs,
            "halted": topology.halted,
            "world_size": len(topology.members),
            "restore_step": topology.restore_step,
            "reason": topology.reason,
            "step": step,
            "steps_per_s": None if rate is None else round(rate, 3),
            "goodput": round(report.goodput, 4),
            "badput_s": {k: None if v is None else round(v, 3) for k, v in report.badput_s.items()},
            "members_by_state": dict(
                Counter(enum_name(pb.MemberState, m.state, "MEMBER_STATE_") for m in members)
            ),
            "members": [member_dict(m) for m in members],
            "events": [event_dict(e) for e in self.events],
        }
        return self.doc

    def render(self) -> Group:
        d = self.doc
        head = Text()
        head.append("job ", style="dim")
        head.append(safe(d["job_id"] or "?"))
        head.append("  epoch ", style="dim")
        head.append(str(d["epoch"]), style="bold")
        if d["halted"]:
            head.append(" halted", style="bold red")
        else:
            head.append(
                " live" if d["epoch_live"] else " forming", style="green" if d["epoch_live"] else "yellow"
            )
        head.append("  world size ", style="dim")
        head.append(str(d["world_size"]))
        head.append("  step ", style="dim")
        head.append("-" if d["step"] is None else str(d["step"]), style="bold")
        head.append("  steps/s ", style="dim")
        head.append("-" if d["steps_per_s"] is None else f"{d['steps_per_s']:.2f}")
        head.append("  goodput ", style="dim")
        head.append(f"{d['goodput']:.1%}")
        head.append("  members ", style="dim")
        head.append(", ".join(f"{n} {s}" for s, n in sorted(d["members_by_state"].items())) or "none")
        why = Text("  why: ", style="dim")
        why.append(safe(d["reason"] or "-"))
        lines: list[Any] = [head, why, members_table(self.members, self.topology.epoch, d["time"])]
        lines.append(Text(f"last {len(self.events)} event(s):", style="dim"))
        lines.extend(event_line(e) for e in self.events)
        return Group(*lines)


def run_top(args: argparse.Namespace, channel: grpc.Channel) -> int:
    """Until Ctrl-C (its normal end), or one snapshot with ``--once``."""
    try:
        return _top(args, channel)
    except KeyboardInterrupt:
        return 0


def _top(args: argparse.Namespace, channel: grpc.Channel) -> int:
    top = Top(pb_grpc.CoordinatorStub(channel), args.timeout, keep=args.events)
    console = Console(highlight=False)
    if args.once:
        top.refresh()
        time.sleep(args.interval)  # a second look gives the step rate
        doc = top.refresh()
        if args.json:
            print(json.dumps(doc))
        else:
            console.print(top.render())
        return 0
    if args.json or not sys.stdout.isatty():
        while True:  # one snapshot per interval, until Ctrl-C
            doc = top.refresh()
            if args.json:
                print(json.dumps(doc), flush=True)
            else:
                console.print(top.render())
                console.print()
            time.sleep(args.interval)
    top.refresh()
    with Live(top.render(), console=console, refresh_per_second=4, screen=False) as live:
        while True:
            time.sleep(args.interval)
            top.refresh()
            live.update(top.render())

"""How remesh's tools show the coordinator's answers: rich tables and lines for people, plain dicts
for ``--json`` (and events back from them), and the ``--since`` times. Pure functions of the
messages; nothing here calls the coordinator or prints, except ``print_topology`` onto the console
it is given.

The operator commands (``remesh.cli``) and the demo (``remesh.demo``: its events.json is what
``remesh events --json`` prints) both read and write these forms, so they sit below both and import
neither.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from remesh.coordinator.model import Event, EventType, Topology, TopologyMember
from remesh.v1 import coordinator_pb2 as pb

__all__ = [
    "enum_name",
    "event_dict",
    "event_from_dict",
    "event_line",
    "format_age",
    "format_time",
    "member_dict",
    "members_table",
    "parse_since",
    "print_topology",
    "state_text",
    "topology_dict",
]

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhdw])", re.IGNORECASE)
_DURATIONS = re.compile(rf"(?:\s*{_DURATION.pattern})+\s*", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

_STATE_STYLE = {
    "joining": "cyan",
    "alive": "green",
    "suspect": "yellow",
    "dead": "bold red",
    "left": "dim",
    "draining": "magenta",
}
_EVENT_STYLE = {
    "member_joined": "cyan",
    "member_rejoined": "cyan",
    "member_alive": "green",
    "member_suspect": "yellow",
    "member_dead": "bold red",
    "member_left": "dim",
    "member_draining": "magenta",
    "fault_reported": "red",
    "topology_changed": "bold blue",
    "epoch_live": "blue",
    "job_waiting": "yellow",
    "job_halted": "bold red",
    "checkpoint_committed": "green",
    "job_finished": "bold green",
    # A tier that cannot keep a host's snapshots: nothing is acted on, but the host runs without it.
    "tier_missing": "red",
}


def parse_since(text: str, now: float) -> float:
    """``--since``: a duration back from ``now`` ("30s", "10m", "1h30m", "2d"), a Unix time
    ("1733150000"), or an ISO 8601 time ("2024-12-02T14:00:00", local time unless it has an offset).
    """
    value = text.strip()
    if not value:
        raise ValueError("empty --since: give a duration such as 10m or a Unix time")
    if _DURATIONS.fullmatch(value):
        seconds = sum(float(n) * _UNIT_S[u.lower()] for n, u in _DURATION.findall(value))
        return max(0.0, now - seconds)
    try:
        stamp = float(value)
    except ValueError:
        pass
    else:
        if stamp < 0:
            raise ValueError(f"--since {text!r} is negative")
        return stamp
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise ValueError(
            f"--since {text!r} is neither a duration (30s, 10m, 1h, 2d), a Unix time nor an ISO 8601 time"
        ) from None


def format_age(seconds_ago: float) -> str:
    """A short, human age: "4s ago", "12m ago", "3h ago", "2d ago"."""
    if seconds_ago < 0:
        return "in the future"
    if seconds_ago < 1:
        return "just now"
    for limit, unit, size in ((60, "s", 1), (3600, "m", 60), (86400, "h", 3600)):
        if seconds_ago < limit:
            return f"{int(seconds_ago // size)}{unit} ago"
    return f"{int(seconds_ago // 86400)}d ago"


def format_time(stamp: float) -> str:
    """Local wall-clock time with milliseconds, sortable."""
    return datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def enum_name(enum_type: Any, value: int, prefix: str) -> str:
    """``MEMBER_STATE_ALIVE`` -> ``alive``; a number this CLI does not know stays a number."""
    try:
        return str(enum_type.Name(value)).removeprefix(prefix).lower()
    except ValueError:
        return str(value)


def member_dict(msg: pb.Member, *, with_step: bool = True) -> dict[str, Any]:
    d: dict[str, Any] = {
        "host_id": msg.host_id,
        "incarnation": msg.incarnation,
        "role": enum_name(pb.Role, msg.role, "ROLE_"),
        "state": enum_name(pb.MemberState, msg.state, "MEMBER_STATE_"),
        "device_count": msg.device_count,
        "address": msg.address,
        "rank": msg.rank,
        "reason": msg.reason,
        "updated_at": msg.updated_at,
    }
    if with_step:
        d["last_step"] = msg.last_step
    return d


def topology_dict(msg: pb.Topology) -> dict[str, Any]:
    return {
        "epoch": msg.epoch,
        "world_size": len(msg.members),
        "mesh_shape": list(msg.mesh_shape),
        "jax_coordinator_address": msg.jax_coordinator_address,
        "restore_step": msg.restore_step,
        "reason": msg.reason,
        "created_at": msg.created_at,
        "halted": msg.halted,
        "job_id": msg.job_id,
        "commits": [{"step": c.step, "epoch": c.epoch} for c in msg.commits],
        "members": [
            {"host_id": m.host_id, "rank": m.rank, "device_count": m.device_count, "address": m.address}
            for m in msg.members
        ],
    }


def event_dict(msg: pb.Event) -> dict[str, Any]:
    return {
        "id": msg.id,
        "type": enum_name(pb.EventType, msg.type, "EVENT_TYPE_"),
        "time": msg.time,
        "host_id": msg.host_id,
        "incarnation": msg.incarnation,
        "epoch": msg.epoch,
        "reason": msg.reason,
        "details": dict(msg.details),
        "member": member_dict(msg.member, with_step=False) if msg.HasField("member") else None,
        "topology": topology_dict(msg.topology) if msg.HasField("topology") else None,
    }


def event_from_dict(d: Mapping[str, Any]) -> Event:
    """An event as ``remesh events --json`` prints it, back as the coordinator's model (what goodput
    reads of it: type, time, epoch, host, details, topology)."""
    t = d.get("topology")
    topology = None
    if t:
        topology = Topology(
            epoch=int(t["epoch"]),
            members=tuple(
                TopologyMember(m["host_id"], int(m["rank"]), int(m["device_count"]), m["address"])
                for m in t["members"]
            ),
            mesh_shape=tuple(t["mesh_shape"]),
            jax_coordinator_address=t["jax_coordinator_address"],
            restore_step=int(t["restore_step"]),
            reason=t["reason"],
            created_at=float(t["created_at"]),
            halted=bool(t["halted"]),
            job_id=t.get("job_id", ""),
        )
    return Event(
        type=EventType(d["type"]),
        time=float(d["time"]),
        epoch=int(d["epoch"]),
        reason=d.get("reason", ""),
        host_id=d.get("host_id", ""),
        incarnation=int(d.get("incarnation", 0)),
        topology=topology,
        details={str(k): str(v) for k, v in (d.get("details") or {}).items()},
        id=d.get("id", ""),
    )


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def safe(value: str) -> Text:
    """Text a client supplied (ids, reasons, addresses), as plain text: rich markup is not parsed and
    control characters (terminal escapes) are shown escaped, never sent to the terminal."""
    return Text(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value))


def state_text(state: str) -> Text:
    return Text(state, style=_STATE_STYLE.get(state, ""))


def _dash(value: int) -> str:
    return "-" if value < 0 else str(value)


def members_table(members: Sequence[pb.Member], epoch: int, now: float) -> Table:
    table = Table(title=f"{len(members)} member(s), epoch {epoch}", title_justify="left", expand=False)
    for name, justify in (
        ("host", "left"),
        ("rank", "right"),
        ("role", "left"),
        ("state", "left"),
        ("incarnation", "right"),
        ("devices", "right"),
        ("last step", "right"),
        ("reason", "left"),
        ("updated", "right"),
    ):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for m in members:
        table.add_row(
            safe(m.host_id),
            _dash(m.rank),
            enum_name(pb.Role, m.role, "ROLE_"),
            state_text(enum_name(pb.MemberState, m.state, "MEMBER_STATE_")),
            str(m.incarnation),
            str(m.device_count),
            _dash(m.last_step),
            safe(m.reason),
            format_age(now - m.updated_at) if m.updated_at else "-",
        )
    return table


def print_topology(console: Console, msg: pb.Topology, now: float) -> None:
    if msg.epoch == 0:
        console.print(Text(f"epoch 0: {msg.reason or 'no topology yet'}", style="yellow"))
        return
    head = Text(f"epoch {msg.epoch}", style="bold")
    if msg.halted:
        head.append("  HALTED", style="bold red")
    console.print(head)
    mesh = " x ".join(str(n) for n in msg.mesh_shape) or "-"
    # The members restore the newest step they hold between them (or a newer checkpoint); the
    # topology says how far every survivor had reported when the epoch was planned.
    restore = (
        "from scratch"
        if msg.restore_step < 0
        else f"the newest step the members hold (survivors were at step {msg.restore_step})"
    )
    info = Table.grid(padding=(0, 2))
    info.add_column(style="dim")
    info.add_column()
    info.add_row("world size", str(len(msg.members)))
    info.add_row("mesh shape", mesh)
    info.add_row("jax coordinator", safe(msg.jax_coordinator_address or "-"))
    info.add_row("restore", restore)
    info.add_row("reason", safe(msg.reason))
    info.add_row("created", f"{format_time(msg.created_at)} ({format_age(now - msg.created_at)})")
    if msg.job_id:
        info.add_row("job", safe(msg.job_id))
    console.print(info)
    if msg.members:
        ranks = Table(expand=False)
        ranks.add_column("rank", justify="right")
        ranks.add_column("host")
        ranks.add_column("devices", justify="right")
        ranks.add_column("address")
        for m in msg.members:
            ranks.add_row(str(m.rank), safe(m.host_id), str(m.device_count), safe(m.address or "-"))
        console.print(ranks)


def event_line(msg: pb.Event) -> Text:
    kind = enum_name(pb.EventType, msg.type, "EVENT_TYPE_")
    line = Text(format_time(msg.time), style="dim")
    line.append("  ")
    line.append(f"{kind:<16}", style=_EVENT_STYLE.get(kind, ""))
    line.append("  ")
    line.append(safe(f"{msg.host_id or '-':<16}"))
    line.append(f"  epoch {msg.epoch:<4}  ")
    line.append(safe(msg.reason))
    return line

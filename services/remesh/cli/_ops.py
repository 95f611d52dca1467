"""Operator commands: ``remesh members``, ``topology``, ``events``, ``replay``, ``drain``, ``top``, ``goodput``.

Each command is a thin gRPC client of one coordinator (``--coordinator``, default env
``REMESH_COORDINATOR`` or 127.0.0.1:50051). People get rich tables and one line per event; scripts
pass ``--json`` and get one JSON document, or JSON lines for the streaming commands (``events``,
``topology --watch``). Formatting, ``--since`` parsing and the replay comparison are pure functions;
the command functions only call the coordinator and print.

Exit codes: 0 success; 1 the coordinator refused or could not be reached (one line on stderr with
the gRPC status, the server's message and what to do), or ``replay`` found a difference; 2 bad usage.
gRPC errors are translated to that line in one place, ``_describe_rpc_error``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from rich.console import Console
from rich.table import Table

from remesh.cli._goodput import run_goodput
from remesh.cli._top import run_top
from remesh.cli.replay_check import compare
from remesh.cli.tls_options import add_tls_arguments, tls_from_args
from remesh.coordinator import convert
from remesh.coordinator.model import EventType, MemberState, replay
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.security import channel as channel_to
from remesh.views import (
    enum_name,
    event_dict,
    event_line,
    member_dict,
    members_table,
    parse_since,
    print_topology,
    safe,
    state_text,
    topology_dict,
)

__all__ = ["add_parsers"]

_DEFAULT_ADDRESS = "127.0.0.1:50051"
# Long enough for a coordinator under load, short enough that a wrong address fails while you wait.
_DEFAULT_TIMEOUT_S = 10.0
_EVENT_ID = re.compile(r"^\d+(-\d+)?$")
# A replay whose log grew while the live state was read is compared again, this many times.
_REPLAY_ATTEMPTS = 3

_HINTS: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.UNAVAILABLE: (
        "is the coordinator running at {address}? Start it with `remesh coordinator`, or point "
        "--coordinator / REMESH_COORDINATOR at the right host:port or unix:/path"
    ),
    grpc.StatusCode.DEADLINE_EXCEEDED: (
        "the coordinator at {address} did not answer within the deadline; check the address, or raise --timeout"
    ),
    grpc.StatusCode.NOT_FOUND: "list the known hosts with `remesh members`",
    grpc.StatusCode.FAILED_PRECONDITION: (
        "the coordinator refuses this in the current state; see `remesh members` and `remesh events`"
    ),
    grpc.StatusCode.INVALID_ARGUMENT: "fix the arguments; see --help",
    grpc.StatusCode.ABORTED: "the state changed while the coordinator worked on it; run the command again",
    grpc.StatusCode.UNIMPLEMENTED: "is {address} a remesh coordinator of a compatible version?",
    grpc.StatusCode.UNAUTHENTICATED: (
        "your certificate names no remesh identity of this job; use one `remesh certs` or your CA issued"
    ),
    grpc.StatusCode.PERMISSION_DENIED: (
        "your identity may not do this; reads need a reader or operator certificate, drain an operator one"
    ),
}


def _describe_rpc_error(exc: grpc.RpcError, address: str) -> str:
    """The one line an operator sees for a gRPC error: status, the server's message, what to do."""
    if not isinstance(exc, grpc.Call):
        return f"gRPC error talking to {address}: {exc}"
    code = exc.code()
    details = (exc.details() or "").strip() or "no details"
    hint = _HINTS.get(code, "")
    if code is grpc.StatusCode.UNAVAILABLE and "handshake" in details.lower():
        hint = (
            "the TLS handshake failed: --tls-ca must be the CA that issued the coordinator's certificate, "
            "and --tls-cert/--tls-key yours, from the same CA (or both sides --insecure)"
        )
    elif code is grpc.StatusCode.UNAVAILABLE and "redis" in details.lower():
        # The coordinator answered: it is its store that is down, not the coordinator.
        hint = (
            "the coordinator is up but cannot reach Redis; check redis-server and the coordinator's --redis"
        )
    line = f"{code.name} from the coordinator at {address}: {details}"
    return f"{line}; hint: {hint.format(address=address)}" if hint else line


# ---- output ---------------------------------------------------------------------------------------


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich exits 1 here; a reader that went away (`| head`) is no failure: let ``_run`` end quietly.
        raise BrokenPipeError


def _console() -> Console:
    # Wide enough that piped tables are not cut at rich's default of 80 columns.
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS") or 160)
    return _Console(highlight=False, width=width)


def _emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, sort_keys=False) + "\n")
    sys.stdout.flush()


# ---- commands -------------------------------------------------------------------------------------


def _stub(channel: grpc.Channel) -> Any:
    return pb_grpc.CoordinatorStub(channel)


def _follow(stream: Any, each: Callable[[Any], None]) -> None:
    """Hand each message of a server stream to ``each`` until the stream ends or Ctrl-C ends it.

    Ctrl-C cancels the call from a signal handler, and the stream then ends as cancelled: raised as
    KeyboardInterrupt inside gRPC's wait instead, it could leave the process hanging at exit (seen once
    in CI: ``events --follow`` still running 10 s after SIGINT).
    """
    interrupted = False

    def cancel(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True
        stream.cancel()

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, cancel)
    try:
        for msg in stream:
            each(msg)
    except grpc.RpcError as exc:
        if not (interrupted and exc.code() == grpc.StatusCode.CANCELLED):
            raise
    except KeyboardInterrupt:  # where no handler could be installed (not the main thread)
        stream.cancel()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _members(args: argparse.Namespace, channel: grpc.Channel) -> int:
    states = [getattr(pb, f"MEMBER_STATE_{s.upper()}") for s in args.state or ()]
    reply = _stub(channel).ListMembers(pb.ListMembersRequest(states=states), timeout=args.timeout)
    if args.json:
        _emit_json({"epoch": reply.epoch, "members": [member_dict(m) for m in reply.members]})
        return 0
    _console().print(members_table(reply.members, reply.epoch, time.time()))
    return 0


def _topology(args: argparse.Namespace, channel: grpc.Channel) -> int:
    stub = _stub(channel)
    if not args.watch:
        msg = stub.GetTopology(pb.GetTopologyRequest(), timeout=args.timeout)
        if args.json:
            _emit_json(topology_dict(msg))
        else:
            print_topology(_console(), msg, time.time())
        return 0
    console = _console()

    def show(msg: pb.Topology) -> None:
        if args.json:
            _emit_json(topology_dict(msg))
        else:
            print_topology(console, msg, time.time())
            console.print()

    _follow(stub.WatchTopology(pb.WatchTopologyRequest(after_epoch=0)), show)
    return 0


def _events(args: argparse.Namespace, channel: grpc.Channel) -> int:
    request = pb.ReplayEventsRequest(
        after_id=args.after or "",
        since=args.since or 0.0,
        host_ids=args.host or [],
        types=[getattr(pb, f"EVENT_TYPE_{t.upper()}") for t in args.type or ()],
        follow=args.follow,
    )
    stream = _stub(channel).ReplayEvents(request, timeout=None if args.follow else args.timeout)
    console = _console()
    shown = 0

    def show(msg: pb.Event) -> None:
        nonlocal shown
        shown += 1
        if args.json:
            _emit_json(event_dict(msg))
        else:
            console.print(event_line(msg), soft_wrap=True)
            sys.stdout.flush()

    _follow(stream, show)
    if not shown and not args.json and not args.follow:
        print("no matching events", file=sys.stderr)
    return 0


def _read_log_and_live(
    stub: Any, timeout: float
) -> tuple[list[pb.Event], pb.ListMembersResponse, pb.Topology, bool]:
    """The whole event log and the live state, read so that no event landed in between (if possible).

    The log is read before and after the live state; when it grew meanwhile the comparison would
    chase a moving target, so the reads are repeated. The last flag says whether they settled.
    """
    log: list[pb.Event] = []
    members = pb.ListMembersResponse()
    topology = pb.Topology()
    for _ in range(_REPLAY_ATTEMPTS):
        log = list(stub.ReplayEvents(pb.ReplayEventsRequest(), timeout=timeout))
        members = stub.ListMembers(pb.ListMembersRequest(), timeout=timeout)
        topology = stub.GetTopology(pb.GetTopologyRequest(), timeout=timeout)
        after = log[-1].id if log else "0-0"
        tail = list(stub.ReplayEvents(pb.ReplayEventsRequest(after_id=after), timeout=timeout))
        if not tail:
            return log, members, topology, True
    return log, members, topology, False


def _replay(args: argparse.Namespace, channel: grpc.Channel) -> int:
    log, live_members, live_topology, settled = _read_log_and_live(_stub(channel), args.timeout)
    try:
        events = [convert.event_from_pb(e) for e in log]
        members = {m.host_id: convert.member_from_pb(m) for m in live_members.members}
    except ValueError as exc:
        print(
            f"error: cannot read the coordinator's records: {exc} (is this remesh too old?)", file=sys.stderr
        )
        return 1
    state = replay(events)
    topology = convert.topology_from_pb(live_topology)
    differences = compare(state, members, topology)
    if args.json:
        _emit_json(
            {
                "matches": not differences,
                "events": len(events),
                "replayed_epoch": state.epoch,
                "live_epoch": live_topology.epoch,
                "settled": settled,
                "differences": [d.to_dict() for d in differences],
            }
        )
        return 1 if differences else 0
    console = _console()
    if not differences:
        console.print(f"replay matches the live state ({len(events)} events, epoch {state.epoch})")
        return 0
    table = Table(
        title=(
            f"replay of {len(events)} events differs from the live state in {len(differences)} place(s) "
            f"(replayed epoch {state.epoch}, live epoch {live_topology.epoch})"
        ),
        title_justify="left",
    )
    for name in ("record", "field", "replayed", "live"):
        table.add_column(name, overflow="fold")
    for d in differences:
        table.add_row(safe(d.subject), d.field, safe(json.dumps(d.replayed)), safe(json.dumps(d.live)))
    console.print(table)
    if not settled:
        console.print("note: the event log kept growing while it was read; run `remesh replay` again")
    return 1


def _drain(args: argparse.Namespace, channel: grpc.Channel) -> int:
    reply = _stub(channel).Drain(pb.DrainRequest(host_id=args.host, reason=args.reason), timeout=args.timeout)
    if args.json:
        _emit_json(member_dict(reply.member))
        return 0
    m = reply.member
    state = enum_name(pb.MemberState, m.state, "MEMBER_STATE_")
    line = safe(m.host_id)
    line.append(" is ")
    line.append(state_text(state))
    line.append(": ")
    line.append(safe(m.reason))
    console = _console()
    console.print(line)
    if state == MemberState.DRAINING.value:
        console.print(
            "the planner replaces it like a failed host and its agent is told to stop and leave; "
            "follow with `remesh events --follow`",
            style="dim",
        )
    return 0


def _run(command: Callable[[argparse.Namespace, grpc.Channel], int]) -> Callable[[argparse.Namespace], int]:
    """Open the channel, run ``command``, and turn expected failures into one line and an exit code."""

    def run(args: argparse.Namespace) -> int:
        try:
            tls = tls_from_args(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            with channel_to(args.coordinator, tls) as channel:
                return command(args, channel)
        except grpc.RpcError as exc:
            print(f"error: {_describe_rpc_error(exc, args.coordinator)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            # Ctrl-C is how a stream that follows ends; anywhere else it is an interruption (130).
            if getattr(args, "follow", False) or getattr(args, "watch", False):
                return 0
            raise
        except BrokenPipeError:
            # The reader went away (`| head`): stop quietly, and keep Python from complaining at exit.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 0

    return run


# ---- argument parsing -----------------------------------------------------------------------------


def _since_arg(text: str) -> float:
    try:
        return parse_since(text, time.time())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _event_id_arg(text: str) -> str:
    if not _EVENT_ID.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an event id like 1733150000000-0 (see `events --json`)"
        )
    return text


def _timeout_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("the timeout must be positive")
    return value


def _common(default_address: str) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--coordinator",
        metavar="ADDRESS",
        default=default_address,
        help="the coordinator's gRPC address, HOST:PORT or unix:/PATH (default: $REMESH_COORDINATOR, "
        f"else {_DEFAULT_ADDRESS})",
    )
    common.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
    add_tls_arguments(common, "your (role operator or reader)")
    common.add_argument(
        "--timeout",
        type=_timeout_arg,
        default=_DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"deadline of each call (default {_DEFAULT_TIMEOUT_S:g}s; streams that follow have none)",
    )
    return common


def _para(text: str) -> str:
    """A description paragraph, wrapped by hand: the raw formatter keeps the epilog's examples as typed."""
    return textwrap.fill(text, width=88)


def _choices(values: Iterable[str]) -> list[str]:
    return sorted(values)


def add_parsers(sub: Any) -> None:
    """Register the operator subcommands on the ``remesh`` parser."""
    common = _common(os.environ.get("REMESH_COORDINATOR") or _DEFAULT_ADDRESS)
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser(
        "members",
        parents=[common],
        formatter_class=fmt,
        help="list the job's members and their states",
        description=_para(
            "List every member the coordinator knows: rank, role, state, incarnation, devices, "
            "last reported step, why it is in its state and when that changed."
        ),
        epilog="examples:\n  remesh members\n  remesh members --state suspect dead\n  remesh members --json | jq",
    )
    p.add_argument(
        "--state",
        nargs="+",
        action="extend",
        choices=_choices(s.value for s in MemberState),
        metavar="STATE",
        help="only members in these states: " + ", ".join(s.value for s in MemberState),
    )
    p.set_defaults(run=_run(_members))

    p = sub.add_parser(
        "topology",
        parents=[common],
        formatter_class=fmt,
        help="show the current topology epoch (or watch it change)",
        description=_para(
            "Show the current topology: epoch, world size, mesh shape, the JAX coordinator "
            "address, the step every member restores from, why it exists, and the ranks."
        ),
        epilog="examples:\n  remesh topology\n  remesh topology --watch          (Ctrl-C to stop)\n"
        "  remesh topology --watch --json   (one JSON line per epoch)",
    )
    p.add_argument("--watch", action="store_true", help="keep printing each new epoch until Ctrl-C")
    p.set_defaults(run=_run(_topology))

    p = sub.add_parser(
        "events",
        parents=[common],
        formatter_class=fmt,
        help="print the event log (membership and topology changes)",
        description=_para(
            "Print the job's event log, one line per event: time, type, host, the epoch after "
            "the event, and the reason. With --json, one JSON object per line (also without --follow). "
            "A topology event matches --host when the topology names that host."
        ),
        epilog="examples:\n  remesh events --since 10m\n  remesh events --follow --type member_dead topology_changed\n"
        "  remesh events --host host-3 --json\n  remesh events --after 1733150000000-0 --follow",
    )
    p.add_argument(
        "--since",
        type=_since_arg,
        metavar="WHEN",
        help="only events from then on: a duration back from now (30s, 10m, 1h30m, 2d), a Unix time, "
        "or an ISO 8601 time",
    )
    p.add_argument("--after", type=_event_id_arg, metavar="ID", help="only events after this event id")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events until Ctrl-C")
    p.add_argument("--host", nargs="+", action="extend", metavar="HOST", help="only events of these hosts")
    p.add_argument(
        "--type",
        nargs="+",
        action="extend",
        choices=_choices(t.value for t in EventType),
        metavar="TYPE",
        help="only events of these types: " + ", ".join(t.value for t in EventType),
    )
    p.set_defaults(run=_run(_events))

    p = sub.add_parser(
        "replay",
        parents=[common],
        formatter_class=fmt,
        help="check that replaying the event log rebuilds the live state",
        description=_para(
            "Read the whole event log, fold it with the coordinator's pure replay, and compare "
            "the result with the live members and topology. Exits 0 when they match and 1 when they "
            "differ, listing each difference (last_step is progress, not state, and is not compared)."
        ),
    )
    p.set_defaults(run=_run(_replay))

    p = sub.add_parser(
        "drain",
        parents=[common],
        formatter_class=fmt,
        help="take a host out of the topology and ask it to leave",
        description=_para(
            "Drain a host: the planner replaces it like a failed host (a new epoch), then its "
            "agent is told to stop its trainer and leave. Draining a draining host changes nothing."
        ),
        epilog='example:\n  remesh drain host-3 --reason "kernel upgrade"',
    )
    p.add_argument("host", metavar="HOST", help="the host id, as `remesh members` shows it")
    p.add_argument("--reason", default="", help="why (recorded in the member and the event log)")
    p.set_defaults(run=_run(_drain))

    p = sub.add_parser(
        "top",
        parents=[common],
        formatter_class=fmt,
        help="a live view of the running job: epoch, step rate, members, the last events",
        description=_para(
            "Refresh every --interval seconds until Ctrl-C: the epoch and whether every member runs "
            "it, the world size, the step the whole job reached and its rate, the members and the "
            "last events. On a terminal it redraws in place; piped, or with --json, it prints one "
            "snapshot per refresh."
        ),
        epilog="examples:\n  remesh top\n  remesh top --once --json | jq .steps_per_s",
    )
    p.add_argument(
        "--interval", type=_timeout_arg, default=2.0, metavar="SECONDS", help="between refreshes (2)"
    )
    p.add_argument(
        "--events", type=int, default=8, metavar="N", help="how many of the last events to show (8)"
    )
    p.add_argument(
        "--once", action="store_true", help="look twice, --interval apart (for the rate), print, exit"
    )
    p.set_defaults(run=_run(run_top))

    p = sub.add_parser(
        "goodput",
        parents=[common],
        formatter_class=fmt,
        help="how much of the job's wall time was training: goodput, badput by category, recoveries",
        description=_para(
            "Goodput and badput (initialization, recovery, checkpoint restore, checkpoint save, wasted "
            "progress, other) and a phase table per recovery, computed from the event log alone: of "
            "the running job (the coordinator's log, and how far its members got), or afterwards of "
            "a log `remesh events --json` wrote (--from-log). The coordinator's remesh_goodput_ratio "
            "is the same computation."
        ),
        epilog=(
            "examples:\n  remesh goodput\n  remesh events --json > job.jsonl; remesh goodput --from-log job.jsonl"
        ),
    )
    p.add_argument(
        "--from-log",
        dest="log",
        metavar="FILE",
        help="a log `remesh events --json` wrote, instead of the coordinator",
    )
    p.add_argument(
        "--now",
        type=float,
        metavar="UNIX_TIME",
        help="compute as of this time (default: now; --from-log: its last event)",
    )
    p.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="the furthest step of the current epoch, where the log does not say (a job still running)",
    )
    live_goodput = _run(run_goodput)
    p.set_defaults(run=lambda args: run_goodput(args, None) if args.log is not None else live_goodput(args))

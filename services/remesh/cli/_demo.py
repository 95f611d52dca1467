"""``remesh demo``: a whole job on this machine, one host killed on purpose, the recovery shown live.

Starts an embedded redis-server (unless ``--redis`` names one), the coordinator, N agents and hot
spares as real processes, each agent supervising the stand-in trainer; kills one host once the first
epoch is live, prints every membership event as it happens and, at the end, how long detection and
the new epoch took. Everything it started is stopped on exit and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import structlog
from rich.console import Console

from remesh.embedded import RedisServer
from remesh.embedded.cluster import LocalCluster, wait_for
from remesh.v1 import coordinator_pb2 as pb

log = structlog.get_logger("remesh.cli")

_STYLE = {
    pb.EVENT_TYPE_MEMBER_DEAD: "bold red",
    pb.EVENT_TYPE_MEMBER_SUSPECT: "yellow",
    pb.EVENT_TYPE_TOPOLOGY_CHANGED: "bold green",
    pb.EVENT_TYPE_EPOCH_LIVE: "green",
    pb.EVENT_TYPE_JOB_HALTED: "bold red",
}


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "demo",
        help="run a whole job here, kill a host, watch remesh recover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hosts", type=int, default=4, help="active hosts")
    p.add_argument("--spares", type=int, default=1, help="hot spares")
    p.add_argument("--kill", default="any", help="host to fail: a host id like host-2, or 'any'")
    p.add_argument("--how", choices=["kill", "stop"], default="kill",
                   help="kill: SIGKILL the host; stop: SIGSTOP it (a silent host)")  # fmt: skip
    p.add_argument("--kill-after", type=float, default=2.0, help="seconds after the first epoch is live")
    p.add_argument("--redis", default=os.environ.get("REMESH_REDIS_URL"),
                   help="Redis URL (env REMESH_REDIS_URL); default: start an embedded redis-server")  # fmt: skip
    p.add_argument("--out", default=None, help="folder for the processes' logs (default: a temporary one)")
    p.add_argument("--seed", type=int, default=None, help="seed for choosing the host with --kill any")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=False)
    hosts = [f"host-{i}" for i in range(args.hosts)]
    if args.hosts < 1 or args.spares < 0:
        console.print("[red]--hosts must be at least 1 and --spares at least 0[/]")
        return 2
    if args.kill != "any" and args.kill not in hosts:
        console.print(f"[red]unknown host {args.kill!r}: choose one of {', '.join(hosts)} or 'any'[/]")
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="remesh-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    redis: RedisServer | None = None
    cluster: LocalCluster | None = None
    try:
        if args.redis:
            redis_url = args.redis
        else:
            redis = RedisServer(appendonly=False).start()
            redis_url = redis.url
            console.print(f"embedded redis-server on {redis_url}")
        cluster = LocalCluster(out, redis_url, f"demo-{uuid.uuid4().hex[:6]}")
        try:
            cluster.start_coordinator("--world-size", str(args.hosts))
        except RuntimeError as exc:
            console.print(f"[red]the coordinator did not start[/]: {str(exc).splitlines()[0]}")
            console.print(f"check that Redis answers at {redis_url}; logs are in {out}")
            return 2
        console.print(
            f"coordinator on {cluster.address}; starting {args.hosts} hosts and {args.spares} spare(s)"
        )
        stop_printing = threading.Event()
        t_start = time.time()
        printer = threading.Thread(
            target=_print_events, args=(cluster, console, t_start, stop_printing), daemon=True
        )
        printer.start()
        for h in hosts:
            cluster.start_agent(h)
        for i in range(args.spares):
            cluster.start_agent(f"spare-{i}", spare=True)
        _wait_live(cluster, 1, 60)
        time.sleep(args.kill_after)
        before = cluster.topology()
        victim = args.kill if args.kill != "any" else random.Random(args.seed).choice(hosts)
        console.print(
            f"\n[bold]>>> {'SIGKILL' if args.how == 'kill' else 'SIGSTOP'} {victim} (agent and trainer)[/]\n"
        )
        t_kill = time.time()
        cluster.agents[victim].signal_group(signal.SIGKILL if args.how == "kill" else signal.SIGSTOP)
        after = cluster.wait_epoch(before.epoch + 1, timeout=30)
        live = _wait_live(cluster, after.epoch, 60)
        dead = next(
            e
            for e in cluster.events()
            if e.type == pb.EVENT_TYPE_MEMBER_DEAD and e.host_id == victim and e.time >= t_kill
        )
        time.sleep(0.3)
        stop_printing.set()
        console.print()
        console.print(f"[bold green]recovered[/]: {after.reason}")
        console.print(f"  failure detected   {dead.time - t_kill:6.3f} s after the {args.how}")
        console.print(
            f"  epoch {after.epoch} published {after.created_at - t_kill:6.3f} s after the {args.how}"
        )
        console.print(f"  epoch {after.epoch} live      {live.time - t_kill:6.3f} s after the {args.how} "
                      "(every member's trainer acknowledged it)")  # fmt: skip
        console.print(f"  ranks: {', '.join(f'{m.rank}={m.host_id}' for m in after.members)}")
        console.print(f"coordinator and agent logs: {out}")
        return 0
    except KeyboardInterrupt:
        console.print("\ninterrupted: stopping every process the demo started")
        return 130
    except TimeoutError as exc:
        console.print(f"[red]the demo stalled[/]: {exc}; logs are in {out}")
        return 1
    finally:
        if cluster is not None:
            cluster.close()
        if redis is not None:
            redis.close()


def _wait_live(cluster: LocalCluster, epoch: int, timeout: float) -> pb.Event:
    def live() -> pb.Event | None:
        try:
            events = cluster.stub().ReplayEvents(
                pb.ReplayEventsRequest(types=[pb.EVENT_TYPE_EPOCH_LIVE]), timeout=5
            )
            return next((e for e in events if e.epoch == epoch), None)
        except grpc.RpcError:
            return None

    return wait_for(live, timeout, f"epoch {epoch} to be live")  # type: ignore[return-value]


def _print_events(cluster: LocalCluster, console: Console, t0: float, stop: threading.Event) -> None:
    channel = grpc.insecure_channel(cluster.address)
    from remesh.v1 import coordinator_pb2_grpc as pb_grpc

    call = pb_grpc.CoordinatorStub(channel).ReplayEvents(pb.ReplayEventsRequest(follow=True))
    threading.Thread(target=lambda: (stop.wait(), call.cancel()), daemon=True).start()
    try:
        for e in call:
            name = pb.EventType.Name(e.type).removeprefix("EVENT_TYPE_").lower()
            style = _STYLE.get(e.type, "")
            who = e.host_id or f"epoch {e.epoch}"
            line = f"{e.time - t0:7.3f}s  {name:<17} {who:<10} {e.reason}"
            console.print(line, style=style or None, highlight=False, markup=False)
    except grpc.RpcError:
        pass
    finally:
        channel.close()

"""``remesh agent``: the per-host daemon next to a trainer."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import signal
from typing import Any

import structlog

from remesh.cli.tls_options import add_tls_arguments, tls_from_args

log = structlog.get_logger("remesh.cli")


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "agent",
        help="run the agent for one host, supervising its trainer",
        description=(
            "Register this host with the coordinator, keep its heartbeat stream, start the trainer when the "
            "host is in the topology and restart or stop it as epochs change. Everything after -- is the "
            "trainer command."
        ),
        usage="remesh agent --coordinator ADDR --host-id ID [options] -- TRAINER COMMAND...",
    )
    p.add_argument(
        "--coordinator",
        default=os.environ.get("REMESH_COORDINATOR", "127.0.0.1:50051"),
        help="coordinator address host:port or unix:/path (a Unix socket), or several separated by "
        "commas (env REMESH_COORDINATOR)",
    )
    p.add_argument(
        "--relay",
        default=os.environ.get("REMESH_RELAY", ""),
        help="host:port of a `remesh relay` to take topology epochs from (env REMESH_RELAY; for fleets "
        "of thousands; heartbeats still go to the coordinator, which sends epochs again if the relay fails)",
    )
    p.add_argument("--host-id", default=os.environ.get("REMESH_HOST_ID"), help="this host's stable id")
    p.add_argument("--spare", action="store_true", help="join as a hot spare")
    p.add_argument("--devices", type=int, default=1, help="accelerator devices on this host")
    p.add_argument(
        "--address",
        default="127.0.0.1",
        help="address the job's other hosts reach this host at (its JAX coordination port as rank 0, "
        "its snapshots for peers); default %(default)s, which only hosts on this machine reach: give "
        "this host's own address in a job on several machines",
    )
    p.add_argument(
        "--job",
        default=os.environ.get("REMESH_JOB", "default"),
        help="job id (env REMESH_JOB; default %(default)s): the coordinator's --job; a coordinator of "
        "another job refuses this agent",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=120.0,
        help="seconds without step progress before the trainer counts as hung (0: never)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="the same before the trainer's first step of an epoch: JAX start-up, restore and "
        "compile (0: never)",
    )
    p.add_argument(
        "--no-warm-standby",
        action="store_true",
        help="do not keep a second, idle trainer process ready to replace the active one",
    )
    p.add_argument(
        "--lease",
        type=float,
        default=None,
        help="seconds without any coordinator after which the trainer is stopped as cut off (0: never; "
        "default: as long as the coordinator waits before declaring a silent host dead, at least 5)",
    )
    p.add_argument(
        "--trainer-nice",
        type=int,
        default=10,  # AgentSettings.trainer_nice
        help="niceness added to the trainer, so the agent's heartbeats go first on a busy CPU (0: none)",
    )
    p.add_argument(
        "--standby-nice",
        type=int,
        default=19,  # AgentSettings.standby_nice
        help="the niceness of a trainer's session while it holds no rank (a spare's, a warm standby): "
        "it imports JAX on what working trainers leave, and gets --trainer-nice with a rank (0: off)",
    )
    p.add_argument(
        "--local-listen",
        default="",
        help="unix:/path, or a loopback host:port (TCP: any local user can reach it, and speak for the "
        "trainer), of the local API for the trainer; default: a Unix socket in a directory only this "
        "user may enter. It has no authentication: any other address is refused",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics of the agent and its trainer on this port (0: a free one, logged)",
    )
    p.add_argument(
        "--metrics-address",
        default="127.0.0.1",
        help="address /metrics binds to (0.0.0.0 where a scraper on another host reads it)",
    )
    add_tls_arguments(p, "this host's (role host, named by --host-id)")
    p.add_argument("trainer", nargs=argparse.REMAINDER, help="-- followed by the trainer command")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from remesh.agent import Agent, AgentSettings

    command = args.trainer[1:] if args.trainer[:1] == ["--"] else args.trainer
    if not args.host_id:
        log.error("no host id", hint="pass --host-id ID (or set REMESH_HOST_ID)")
        return 2
    if not command:
        log.error("no trainer command", hint="append -- followed by the command that runs the trainer")
        return 2
    for flag, nice in (("--trainer-nice", args.trainer_nice), ("--standby-nice", args.standby_nice)):
        if not 0 <= nice <= 19:
            log.error("niceness out of range", flag=flag, value=nice, hint=f"pass {flag} between 0 and 19")
            return 2
    try:
        tls = tls_from_args(args)
    except ValueError as exc:
        log.error("invalid TLS settings", error=str(exc))
        return 2
    if args.local_listen and not args.local_listen.startswith("unix:"):
        host = args.local_listen.rsplit(":", 1)[0] if ":" in args.local_listen else args.local_listen
        if not _loopback(host):
            log.error(
                "the trainers' local API has no authentication: it may not listen beyond this machine",
                local_listen=args.local_listen,
                hint="leave --local-listen out (a Unix socket only this user reaches), or give "
                "unix:/PATH or 127.0.0.1:PORT",
            )
            return 2
    coordinators = tuple(a.strip() for a in args.coordinator.split(",") if a.strip())
    if _loopback(args.address) and not all(_on_this_machine(a) for a in coordinators):
        log.warning(
            "this host's address is a loopback address, but its coordinator is on another machine: the "
            "job's other hosts cannot reach it (as rank 0, or for its snapshots)",
            address=args.address,
            coordinator=args.coordinator,
            hint="pass --address with this host's own address",
        )
    settings = AgentSettings(
        coordinators=coordinators,
        host_id=args.host_id,
        trainer_command=tuple(command),
        spare=args.spare,
        device_count=args.devices,
        address=args.address,
        job_id=args.job,
        local_listen=args.local_listen,
        hang_timeout_s=args.hang_timeout,
        startup_timeout_s=args.startup_timeout,
        warm_standby=not args.no_warm_standby,
        lease_s=args.lease,
        trainer_nice=args.trainer_nice,
        standby_nice=args.standby_nice,
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        log_json=args.log_json,
        tls=tls,
        relay=args.relay,
    )
    return asyncio.run(_main(Agent(settings)))


async def _main(agent: Any) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, agent.request_shutdown, sig.name)
    return int(await agent.run())


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _on_this_machine(address: str) -> bool:
    """Whether a coordinator address (HOST:PORT, or unix:/PATH) is on this machine as far as its text
    says: a Unix socket or a loopback host."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return _loopback(host)

"""``remesh coordinator``: serve one job's membership from Redis, alone or as one of several replicas."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog

from remesh.cli.tls_options import add_tls_arguments, tls_from_args
from remesh.coordinator.settings import InvalidSettings, PlannerSettings, Settings
from remesh.embedded import RedisServer
from remesh.v1.security import Tls

log = structlog.get_logger("remesh.cli")


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "coordinator",
        help="run the coordinator (gRPC) for one job",
        description="Serve membership, failure detection and topology epochs for one job, with state in Redis.",
    )
    p.add_argument(
        "--redis",
        default=os.environ.get("REMESH_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="Redis URL (env REMESH_REDIS_URL): redis://, rediss:// (TLS), redis+cluster:// or "
        "rediss+cluster:// (Redis Cluster, any node), unix:///PATH?db=0 (a Unix socket), or 'embedded' "
        "to start a private redis-server on a Unix socket",
    )
    p.add_argument(
        "--redis-username",
        default=os.environ.get("REMESH_REDIS_USERNAME"),
        help="Redis ACL user (env REMESH_REDIS_USERNAME); the password is read from env "
        "REMESH_REDIS_PASSWORD or --redis-password-file, never from a flag",
    )
    p.add_argument("--redis-password-file", help="file holding the Redis password (e.g. a mounted secret)")
    p.add_argument("--redis-ca-file", help="CA bundle (PEM) that verifies the Redis server's TLS certificate")
    p.add_argument(
        "--ha",
        action="store_true",
        help="run as one of several replicas on the same Redis and job: one leads (Redis lease), the "
        "others serve reads and point writers to the leader",
    )
    p.add_argument(
        "--advertise",
        default=os.environ.get("REMESH_ADVERTISE"),
        help="HOST:PORT or unix:/PATH agents reach this replica at (env REMESH_ADVERTISE; implies --ha); "
        "default: the listen address",
    )
    p.add_argument(
        "--lease-ttl", type=float, help="seconds a dead leader's lease lasts before a follower takes over"
    )
    p.add_argument("--job", default=os.environ.get("REMESH_JOB", "default"), help="job id (env REMESH_JOB)")
    p.add_argument(
        "--listen",
        default="127.0.0.1:50051",
        help="gRPC address: HOST:PORT (port 0 picks a free port), or unix:/PATH for a Unix socket (no TCP "
        "port: with Redis on a Unix socket or embedded, and no --metrics-port or --health-port, the "
        "coordinator opens no TCP/UDP socket at all)",
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve the gRPC health service alone, without TLS, on this port (for kubelet probes)",
    )
    p.add_argument("--preset", choices=["local", "production"], default="local", help="detector timings")
    p.add_argument("--world-size", type=int, default=4, help="hosts the job forms with and grows back to")
    p.add_argument("--min-world-size", type=int, default=1, help="never shrink below this; wait instead")
    p.add_argument(
        "--must-divide", type=int, default=0, help="a world size must divide this (e.g. global batch)"
    )
    p.add_argument(
        "--max-wait", type=float, default=30.0, help="seconds to wait below the minimum before halting"
    )
    p.add_argument(
        "--max-repeated-crashes",
        type=int,
        default=PlannerSettings.max_repeated_crashes,
        help="recoveries granted in a row to the same trainer error when none completes a step (a bug "
        "in the script); the next such failure halts the job with the error (default %(default)s)",
    )
    p.add_argument(
        "--jax-port-base",
        type=int,
        default=os.environ.get("REMESH_JAX_PORT_BASE", str(PlannerSettings.jax_port_base)),
        help="first port of the range the JAX coordination service of each epoch listens in on rank 0 "
        "(env REMESH_JAX_PORT_BASE; give jobs that share hosts ranges of their own)",
    )
    p.add_argument(
        "--jax-port-span", type=int, default=PlannerSettings.jax_port_span, help="size of that port range"
    )
    p.add_argument(
        "--fleet-size",
        type=int,
        default=0,
        help="hosts (active and spares) the coordinator is sized for (default: --world-size); past "
        "--heartbeat-budget of them per second, heartbeats are spaced out (see docs/scale.md)",
    )
    p.add_argument(
        "--heartbeat-budget",
        type=float,
        default=1000.0,
        help="heartbeats per second the whole fleet may send this coordinator (default 1000)",
    )
    p.add_argument("--heartbeat-interval", type=float, help="override the preset's heartbeat interval (s)")
    p.add_argument("--heartbeat-timeout", type=float, help="override the preset's heartbeat timeout (s)")
    p.add_argument(
        "--no-stream-signal",
        action="store_true",
        help="judge hosts by heartbeat timeouts alone, ignoring broken heartbeat streams",
    )
    p.add_argument(
        "--max-members",
        type=int,
        default=Settings.max_members,
        help="members kept at most; a newcomer makes room by forgetting the oldest dead or left one",
    )
    p.add_argument(
        "--member-retention",
        type=float,
        default=Settings.member_retention_s,
        help="seconds a dead or left member is kept before it is forgotten (its events stay in the log)",
    )
    p.add_argument(
        "--max-events",
        type=int,
        default=Settings.max_events,
        help="events kept in the log; beyond, it is cut behind an event holding the whole state",
    )
    p.add_argument("--port-file", help="write the bound gRPC port to this file once serving")
    add_tls_arguments(p, "this coordinator's (role coordinator)")
    p.set_defaults(run=run)


# The flag that sets each settings field (or ``for_fleet`` argument), for the usage error of settings
# that contradict themselves (``InvalidSettings``).
_FLAGS = {
    "world_size": "--world-size",
    "min_world_size": "--min-world-size",
    "world_size_must_divide": "--must-divide",
    "max_wait_s": "--max-wait",
    "max_repeated_crashes": "--max-repeated-crashes",
    "jax_port_base": "--jax-port-base",
    "jax_port_span": "--jax-port-span",
    "hosts": "--fleet-size",
    "beats_per_second": "--heartbeat-budget",
    "heartbeat_interval_s": "--heartbeat-interval",
    "suspect_after_s": "--heartbeat-interval",
    "heartbeat_timeout_s": "--heartbeat-timeout",
    "max_members": "--max-members",
    "max_events": "--max-events",
    "member_retention_s": "--member-retention",
    "lease_ttl_s": "--lease-ttl",
}


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings the flags ask for; ``InvalidSettings`` where they contradict each other, OSError
    where the Redis password file cannot be read."""
    base = Settings.production() if args.preset == "production" else Settings.local()
    d = base.detector.for_fleet(args.fleet_size or args.world_size, args.heartbeat_budget)
    if args.heartbeat_interval:
        # Keep the preset's ratios: suspect after 3 missed heartbeats, dead after 6.
        d = replace(
            d,
            heartbeat_interval_s=args.heartbeat_interval,
            suspect_after_s=3 * args.heartbeat_interval,
            heartbeat_timeout_s=6 * args.heartbeat_interval,
        )
    if args.heartbeat_timeout:
        d = replace(d, heartbeat_timeout_s=args.heartbeat_timeout)
    if args.no_stream_signal:
        d = replace(d, stream_break_signal=False)
    planner = replace(
        base.planner,
        world_size=args.world_size,
        min_world_size=args.min_world_size,
        world_size_must_divide=args.must_divide,
        max_wait_s=args.max_wait,
        max_repeated_crashes=args.max_repeated_crashes,
        jax_port_base=args.jax_port_base,
        jax_port_span=args.jax_port_span,
    ).covering(d)
    ha = replace(base.ha, enabled=bool(args.ha or args.advertise), advertise=args.advertise or "")
    if args.lease_ttl:
        ha = replace(ha, lease_ttl_s=args.lease_ttl)
    password = os.environ.get("REMESH_REDIS_PASSWORD")
    if args.redis_password_file:
        password = Path(args.redis_password_file).read_text().strip()
    return Settings(
        job_id=args.job,
        redis_url=args.redis,
        redis_username=args.redis_username,
        redis_password=password,
        redis_ca_file=args.redis_ca_file,
        ha=ha,
        listen=args.listen,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        max_members=args.max_members,
        member_retention_s=args.member_retention,
        max_events=args.max_events,
        detector=d,
        planner=planner,
    )


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except InvalidSettings as exc:
        flags = sorted({_FLAGS[f] for f in exc.fields if f in _FLAGS})
        log.error(exc.title, hint=str(exc), flags=", ".join(flags) or None)
        return 2
    except OSError as exc:
        log.error("invalid settings", error=str(exc))
        return 2
    try:
        tls = tls_from_args(args)
    except ValueError as exc:
        log.error("invalid TLS settings", error=str(exc))
        return 2
    if urlsplit(args.redis).password:
        log.warning(
            "the Redis password in --redis is on this process's command line, which every local user "
            "may read (/proc/PID/cmdline, ps)",
            hint="pass it in REMESH_REDIS_PASSWORD or --redis-password-file, and leave it out of the URL",
        )
    embedded = None
    if args.redis == "embedded":
        # On a Unix socket: a private server needs no TCP port (and some hosts allow none).
        embedded = RedisServer(unix=True).start()
        settings = replace(settings, redis_url=embedded.url)
        log.info("embedded redis started", url=embedded.url, dir=embedded.directory)
    try:
        return asyncio.run(_serve(settings, tls, args.port_file))
    finally:
        if embedded is not None:
            embedded.close()


async def _serve(settings: Settings, tls: Tls | None, port_file: str | None) -> int:
    from remesh.coordinator.errors import StoreUnavailable
    from remesh.coordinator.server import serve

    try:
        running = await serve(settings, tls)
    except ValueError as exc:
        log.error("cannot start", error=str(exc))
        return 2
    except StoreUnavailable as exc:
        log.error("cannot start", error=str(exc))
        return 2
    except OSError as exc:
        log.error("cannot start", error=str(exc))
        return 2
    if port_file:
        write_port_file(port_file, running.port)
    await until_signalled()
    log.info("coordinator stopping")
    await running.stop()
    return 0


def write_port_file(path: str, port: int) -> None:
    # Written atomically: a launcher polling for the file never reads half a number.
    tmp = Path(f"{path}.tmp")
    tmp.write_text(str(port))
    tmp.replace(path)


async def until_signalled() -> None:
    """Until SIGINT or SIGTERM: how a serving command waits before it stops gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

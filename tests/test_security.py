"""Who may call what: the access policy as a table, then real certificates and real processes.

Every coordinator, agent and client here holds a certificate of the cluster's throwaway CA (as in
every other test); each attack is made with a real identity that lacks the right, and must change
neither the state nor the event log.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from remesh.coordinator.auth import POLICY, decide, identity_of
from remesh.embedded.certs import DevPki
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.security import Identity, Role
from remesh.v1.security import channel as secure_channel
from tests.procs import Cluster, wait_for

HOST0 = Identity(Role.HOST, "host-0")
OPERATOR = Identity(Role.OPERATOR, "alice")
READER = Identity(Role.READER, "dashboards")
COORDINATOR = Identity(Role.COORDINATOR, "c0")

# ---- the policy, pure ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("identity", "method", "host", "allowed"),
    [
        (HOST0, "Register", "host-0", True),
        (HOST0, "Register", "host-1", False),
        (HOST0, "Heartbeat", "host-1", False),
        (HOST0, "AckEpoch", "host-0", True),
        (HOST0, "ReportFault", "host-1", False),
        (HOST0, "Observe", "host-0", True),
        (HOST0, "Observe", "host-1", False),
        (READER, "Observe", "host-0", False),
        (HOST0, "Finish", "host-1", False),
        (HOST0, "CommitCheckpoint", "host-1", False),
        (HOST0, "Leave", "host-1", False),
        (HOST0, "WatchTopology", None, True),
        (HOST0, "FollowTopology", "host-0", True),
        (HOST0, "FollowTopology", "host-1", False),
        (READER, "FollowTopology", "host-0", False),
        (HOST0, "ListMembers", None, False),
        (HOST0, "ReplayEvents", None, False),
        (HOST0, "Drain", "host-0", False),
        (OPERATOR, "Drain", "host-1", True),
        (OPERATOR, "ListMembers", None, True),
        (OPERATOR, "Register", "alice", False),
        (READER, "ReplayEvents", None, True),
        (READER, "Drain", "host-1", False),
        (None, "GetTopology", None, False),
        (OPERATOR, "NoSuchMethod", None, False),
        # A coordinator replica (or a relay, which runs with a coordinator certificate) reads, and
        # follows the topology, but acts for no host and drains nothing.
        (COORDINATOR, "WatchTopology", None, True),
        (COORDINATOR, "GetTopology", None, True),
        (COORDINATOR, "ListMembers", None, True),
        (COORDINATOR, "ReplayEvents", None, True),
        (COORDINATOR, "Register", "c0", False),
        (COORDINATOR, "Heartbeat", "c0", False),
        (COORDINATOR, "ReportFault", "host-0", False),
        (COORDINATOR, "CommitCheckpoint", "host-0", False),
        (COORDINATOR, "Finish", "host-0", False),
        (COORDINATOR, "Drain", "host-0", False),
        (COORDINATOR, "FollowTopology", "host-0", False),
    ],
)
def test_the_policy_table(identity: Identity | None, method: str, host: str | None, allowed: bool) -> None:
    reason = decide(identity, method, host)
    assert (reason is None) == allowed, reason


def test_every_rpc_of_the_services_has_a_rule() -> None:
    services = ("Coordinator", "TopologyRelay")  # a relay's calls pass the same policy
    methods = {m.name for s in services for m in pb.DESCRIPTOR.services_by_name[s].methods}
    assert methods == set(POLICY)


def test_identities_come_from_uri_sans_of_the_trust_domain_only() -> None:
    assert identity_of({"peer_uri": [b"spiffe://remesh.local/host/host-0"]}) == HOST0
    assert identity_of({"peer_uri": [b"spiffe://elsewhere/host/host-0"]}) is None
    assert identity_of({"peer_uri": [b"spiffe://remesh.local/admin/root"]}) is None
    assert identity_of({"peer_uri": [b"spiffe://remesh.local/host/a b"]}) is None
    assert identity_of({"x509_common_name": [b"host/host-0"]}) is None  # a CN is no identity
    with pytest.raises(ValueError, match="identity name"):
        Identity(Role.HOST, "../etc")


# ---- real certificates, real processes -----------------------------------------------------------


@pytest.fixture
def job(cluster: Cluster) -> Iterator[Cluster]:
    cluster.start_coordinator("--world-size", "2", "--metrics-port", "0")
    cluster.start_agent("host-0")
    cluster.start_agent("host-1")
    cluster.start_agent("spare-0", spare=True)
    cluster.wait_epoch(1)
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")
    yield cluster


def snapshot(c: Cluster) -> tuple[object, ...]:
    members = {h: (m.incarnation, m.state, m.rank, m.role, m.reason) for h, m in c.members().items()}
    return members, c.topology().SerializeToString(), [e.id for e in c.events()]


def as_(c: Cluster, role: Role, name: str) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(c.channel(role, name))


def refused(call: Callable[[], object]) -> tuple[grpc.StatusCode | None, str]:
    """The status a call was refused with (None, and what it answered, when it was not refused)."""
    try:
        answer = call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return None, repr(answer)


@pytest.mark.integration
def test_no_identity_can_act_for_another_host_or_beyond_its_role(job: Cluster) -> None:
    members = job.members()
    # The attacker holds a real host certificate (its own host's); the victim is rank 0.
    victim = next(h for h, m in members.items() if m.rank == 0)
    attacker = next(h for h, m in members.items() if m.rank == 1)
    inc = members[victim].incarnation
    epoch = job.topology().epoch
    before = snapshot(job)
    host = as_(job, Role.HOST, attacker)
    reader = as_(job, Role.READER, "dashboards")
    DENIED = grpc.StatusCode.PERMISSION_DENIED
    attacks: list[tuple[str, Callable[[], object]]] = [
        # Take rank 0: a spare whose id sorts first, then a fault report against the real rank 0.
        ("register a fake spare", lambda: host.Register(pb.RegisterRequest(host_id="000-attacker", role=pb.ROLE_SPARE), timeout=5)),
        ("report a fault against rank 0", lambda: host.ReportFault(pb.ReportFaultRequest(host_id=victim, incarnation=inc, kind=pb.FAULT_KIND_HOST, epoch=epoch), timeout=5)),
        # Steal the victim's stream (the incarnation is no secret) and end it.
        ("heartbeat as the victim", lambda: list(host.Heartbeat(iter([pb.HeartbeatRequest(host_id=victim, incarnation=inc, step=0)]), timeout=5))),
        ("re-register the victim", lambda: host.Register(pb.RegisterRequest(host_id=victim), timeout=5)),
        ("ack for the victim", lambda: host.AckEpoch(pb.AckEpochRequest(host_id=victim, incarnation=inc, epoch=epoch), timeout=5)),
        ("churn with ADDRESS_IN_USE", lambda: host.ReportFault(pb.ReportFaultRequest(host_id=victim, incarnation=inc, kind=pb.FAULT_KIND_ADDRESS_IN_USE, epoch=epoch), timeout=5)),
        # Say the victim's collective failed (every member saying so re-forms the epoch), or its trainer blocked.
        ("a failed collective for the victim", lambda: host.Observe(pb.ObserveRequest(host_id=victim, incarnation=inc, epoch=epoch, collective_failure=pb.CollectiveFailureObservation(detail="x")), timeout=5)),
        ("a stall for the victim", lambda: host.Observe(pb.ObserveRequest(host_id=victim, incarnation=inc, epoch=epoch, stall=pb.StallObservation(step=1)), timeout=5)),
        ("the same, as a fault report of old", lambda: host.ReportFault(pb.ReportFaultRequest(host_id=victim, incarnation=inc, kind=pb.FAULT_KIND_COLLECTIVE_FAILED, epoch=epoch), timeout=5)),
        ("commit for the victim", lambda: host.CommitCheckpoint(pb.CommitCheckpointRequest(host_id=victim, incarnation=inc, epoch=epoch, step=1, tier="local"), timeout=5)),
        ("finish for the victim", lambda: host.Finish(pb.FinishRequest(host_id=victim, incarnation=inc, epoch=epoch, step=1), timeout=5)),
        ("the victim leaves", lambda: host.Leave(pb.LeaveRequest(host_id=victim, incarnation=inc), timeout=5)),
        ("an agent drains", lambda: host.Drain(pb.DrainRequest(host_id=victim), timeout=5)),
        ("an agent reads every address", lambda: host.ListMembers(pb.ListMembersRequest(), timeout=5)),
        ("an agent reads the log", lambda: list(host.ReplayEvents(pb.ReplayEventsRequest(), timeout=5))),
        ("a reader drains", lambda: reader.Drain(pb.DrainRequest(host_id=victim), timeout=5)),
        ("a reader registers", lambda: reader.Register(pb.RegisterRequest(host_id="dashboards"), timeout=5)),
    ]  # fmt: skip
    for name, call in attacks:
        code, details = refused(call)
        assert code == DENIED, (name, code, details)
        # The refusal names who asked and what it may not do: its own identity and the rule.
        who = "reader/dashboards" if name.startswith("a reader") else f"host/{attacker}"
        assert who in details and ("may not call" in details or "may act for host" in details), (
            name,
            details,
        )
    assert snapshot(job) == before
    # A reader reads, and every refusal was counted by method.
    assert reader.ListMembers(pb.ListMembersRequest(), timeout=5).members
    metrics = _metrics(job)
    counted = sum(
        float(v)
        for v in re.findall(
            r'remesh_refused_calls_total\{[^}]*kind="permission_denied"[^}]*\} (\S+)', metrics
        )
    )
    assert counted == len(attacks), metrics
    # The operator drains, and the spare replaces host-1.
    drained = as_(job, Role.OPERATOR, "alice").Drain(
        pb.DrainRequest(host_id="host-1", reason="test"), timeout=5
    )
    assert drained.member.state == pb.MEMBER_STATE_DRAINING
    job.wait_epoch(epoch + 1)
    assert "spare-0" in [m.host_id for m in job.topology().members]


@pytest.mark.integration
def test_without_a_certificate_of_the_job_nobody_gets_an_answer(job: Cluster, tmp_path: Path) -> None:
    before = snapshot(job)
    plain = pb_grpc.CoordinatorStub(grpc.insecure_channel(job.address))
    code, _ = refused(lambda: plain.GetTopology(pb.GetTopologyRequest(), timeout=3))
    assert code == grpc.StatusCode.UNAVAILABLE  # the TLS handshake never completes
    # A certificate naming the right host, from another CA.
    stranger = DevPki(tmp_path / "other-ca").tls(Role.HOST, "host-1")
    with secure_channel(job.address, stranger) as channel:
        code, details = refused(
            lambda: pb_grpc.CoordinatorStub(channel).Register(pb.RegisterRequest(host_id="host-1"), timeout=3)
        )
    assert code == grpc.StatusCode.UNAVAILABLE and "handshake" in details.lower(), details
    assert snapshot(job) == before


@pytest.mark.integration
def test_an_agent_talks_only_to_servers_holding_a_coordinator_certificate(job: Cluster) -> None:
    """An address that is not a coordinator's (a forged leader hint, a wrong flag) gets no request from
    an agent, even from a server whose certificate the job's own CA issued to a host."""
    impostor = grpc.server(ThreadPoolExecutor(2))
    seen: list[str] = []

    class Impostor(pb_grpc.CoordinatorServicer):
        def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
            seen.append(request.host_id)
            return pb.RegisterResponse()

    pb_grpc.add_CoordinatorServicer_to_server(Impostor(), impostor)
    tls = job.tls(Role.HOST, "impostor")
    assert tls is not None
    port = impostor.add_secure_port("127.0.0.1:0", tls.server_credentials())
    impostor.start()
    try:
        job.addresses = [f"127.0.0.1:{port}", job.address]  # the impostor first
        agent = job.start_agent("host-2", spare=True)
        wait_for(lambda: "host-2" in job.members(), 20, "host-2 to register with the real coordinator")
        assert agent.alive()
        assert seen == []
        assert "coordinator unreachable" in agent.output()
    finally:
        impostor.stop(None)


@pytest.mark.integration
def test_an_agent_whose_certificate_names_another_host_stops_with_the_reason(job: Cluster) -> None:
    tls = job.tls(Role.HOST, "host-0")
    assert tls is not None
    flags = ["--tls-ca", str(tls.ca_file), "--tls-cert", str(tls.cert_file), "--tls-key", str(tls.key_file)]
    agent = job.start_agent("host-7", spare=True, extra=flags)
    wait_for(lambda: not agent.alive(), 20, "the agent to exit")
    assert agent.popen.returncode == 2
    assert "may act for host 'host-0' only" in agent.output()
    assert "host-7" not in job.members()


def _metrics(c: Cluster) -> str:
    assert c.coordinator is not None
    port = int(c.coordinator.output().split("metrics_port=")[1].split()[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


@pytest.mark.integration
def test_the_trainers_local_api_is_a_socket_only_the_agents_user_can_reach(job: Cluster) -> None:
    agent = job.agents["host-0"]
    found = re.search(r"local_api=unix:(\S+)", agent.output())
    assert found, agent.output()[-2000:]
    socket_path = Path(found.group(1))
    assert stat.S_ISSOCK(socket_path.stat().st_mode)
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700  # nobody else may even look in
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    agent.signal_group(signal.SIGTERM)
    wait_for(lambda: not agent.alive(), 20, "the agent to stop")
    assert not socket_path.parent.exists()  # removed on the way out


@pytest.mark.parametrize("listen", ["0.0.0.0:0", ":0", "10.0.0.1:7000", "[::]:7000"])
def test_the_trainers_local_api_is_never_offered_beyond_this_machine(listen: str) -> None:
    """It has no authentication: an agent told to listen on any other address refuses to start."""
    done = subprocess.run(
        [sys.executable, "-m", "remesh.cli", "agent", "--insecure", "--host-id", "h", "--local-listen", listen, "--", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "may not listen beyond this machine" in done.stdout + done.stderr


@pytest.mark.integration
def test_threads_asking_for_the_same_identity_at_once_get_one_matching_key_and_certificate(
    tmp_path: Path,
) -> None:
    """The demo's event follower and status poller ask for the operator's files together on a fresh
    CA: each gets them (no thread fails on the other's half-done issue), and the key on disk is the
    one the certificate was issued for."""
    pki = DevPki(tmp_path / "ca")
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def ask() -> None:
        start.wait()
        try:
            pki.tls(Role.OPERATOR, "operator")
        except BaseException as exc:  # any failure is the finding
            failures.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    tls = pki.tls(Role.OPERATOR, "operator")
    cert = x509.load_pem_x509_certificate(tls.cert_file.read_bytes())
    key = serialization.load_pem_private_key(tls.key_file.read_bytes(), password=None)
    assert cert.public_key().public_numbers() == key.public_key().public_numbers()  # type: ignore[union-attr]
    assert not list((tmp_path / "ca").glob("*.tmp"))  # no writer's leftovers


def test_the_coordinator_takes_rotated_certificate_files_without_a_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The coordinator's files are replaced in place (as cert-manager renews a mounted Secret): a new
    connection gets the new certificate; the running process never restarts."""
    old, new = DevPki(tmp_path / "old-ca"), DevPki(tmp_path / "new-ca")
    mounted = tmp_path / "mounted"
    mounted.mkdir()

    def install(pki: DevPki) -> None:
        tls = pki.tls(Role.COORDINATOR, "c0")
        for source, name in ((tls.ca_file, "ca.pem"), (tls.cert_file, "cert.pem"), (tls.key_file, "key.pem")):
            (mounted / f"{name}.tmp").write_bytes(source.read_bytes())
            (mounted / f"{name}.tmp").replace(mounted / name)

    install(old)
    proc = cluster.start_coordinator(
        "--world-size", "1", "--tls-ca", str(mounted / "ca.pem"),
        "--tls-cert", str(mounted / "cert.pem"), "--tls-key", str(mounted / "key.pem"),
    )  # fmt: skip

    def topology_as(pki: DevPki) -> grpc.StatusCode | None:
        with secure_channel(cluster.address, pki.tls(Role.READER, "r")) as channel:
            code, _ = refused(
                lambda: pb_grpc.CoordinatorStub(channel).GetTopology(pb.GetTopologyRequest(), timeout=3)
            )
        return code

    assert topology_as(old) is None and topology_as(new) == grpc.StatusCode.UNAVAILABLE
    install(new)
    wait_for(lambda: topology_as(new) is None, 10, "the new certificate to be served")
    assert topology_as(old) == grpc.StatusCode.UNAVAILABLE
    assert proc.alive()


def certs(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "remesh.cli", "certs", "--out", str(out), "--host", "host-0"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_certs_keep_keys_only_where_nobody_else_may_write_or_read(tmp_path: Path) -> None:
    fresh = certs(tmp_path / "new")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    assert {stat.S_IMODE(k.stat().st_mode) for k in (tmp_path / "new").glob("*-key.pem")} == {0o600}
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # as /tmp is: another user could have made it, and put a CA of theirs in it
    refused = certs(shared)
    assert refused.returncode == 2 and "others may write to it" in refused.stdout, refused.stdout
    assert not list(shared.iterdir())
    leaked = tmp_path / "leaked"
    leaked.mkdir(mode=0o700)
    (leaked / "ca-key.pem").write_text("a key others could read")
    (leaked / "ca-key.pem").chmod(0o644)
    refused = certs(leaked)
    assert refused.returncode == 2 and "ca-key.pem may be read by others" in refused.stdout, refused.stdout
    if os.getuid() == 0:  # CI runs as root: a directory given to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        refused = certs(theirs)
        assert refused.returncode == 2 and "another user (uid 65534) owns it" in refused.stdout


def test_a_private_key_others_may_read_is_warned_of(tmp_path: Path) -> None:
    import argparse

    from structlog.testing import capture_logs

    from remesh.cli.tls_options import tls_from_args

    tls = DevPki(tmp_path / "pki").tls(Role.HOST, "host-0")
    args = argparse.Namespace(
        tls_ca=str(tls.ca_file), tls_cert=str(tls.cert_file), tls_key=str(tls.key_file), insecure=False
    )
    with capture_logs() as quiet:
        tls_from_args(args)
    assert quiet == []
    tls.key_file.chmod(0o644)
    with capture_logs() as said:
        tls_from_args(args)
    assert [e["event"] for e in said] == [
        "the private key may be read by other users: anyone who reads it holds this identity"
    ]
    assert said[0]["hint"] == f"chmod 600 {tls.key_file}"


def test_a_redis_password_on_the_command_line_is_warned_of() -> None:
    """Every local user may read a process's command line; the coordinator says so, and where the
    password goes instead (it then fails to reach this Redis, which nobody serves)."""
    done = subprocess.run(
        [sys.executable, "-m", "remesh.cli", "coordinator", "--insecure", "--redis", "redis://:sekrit@127.0.0.1:1/0", "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "the Redis password in --redis is on this process's command line" in out
    assert "REMESH_REDIS_PASSWORD or --redis-password-file" in out
    assert "sekrit" not in out  # the password itself is never logged

"""Every attack on the control plane we know of, made against a coordinator with mutual TLS, and what
security costs failure detection.

Starts a real job on this machine (embedded redis-server, a coordinator process with mutual TLS, 2
active agents and a hot spare with the stand-in trainer). The attacker holds a real certificate of
the job's CA for a host of its own (``host/intruder``: the strongest position short of stealing a key),
or another CA's certificate, or none. Each attack is judged by its effect: it succeeded if the state
or the event log changed in a way the identity may not cause, or data the identity may not read came
back. Then it measures crash detection (SIGKILL of a host -> member_dead, medians over ``--trials``) on
the same job with mutual TLS and on a job without it (``--insecure``), so the cost of security is known.

    python benchmarks/attacks.py [--trials 10]

Prints one line per attack, the detection table, then one JSON line (the last line) with
attacks_tried, attacks_succeeded (target 0), tls_crash_detect_p50_s and plain_crash_detect_p50_s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.detection import Job, run_trials  # noqa: E402  (the detection benchmark's job)
from remesh.cli.logs import configure_logging  # noqa: E402
from remesh.embedded import RedisServer  # noqa: E402
from remesh.embedded.certs import DevPki  # noqa: E402
from remesh.embedded.cluster import LocalCluster  # noqa: E402
from remesh.v1 import coordinator_pb2 as pb  # noqa: E402
from remesh.v1 import coordinator_pb2_grpc as pb_grpc  # noqa: E402
from remesh.v1.security import Role  # noqa: E402
from remesh.v1.security import channel as secure_channel  # noqa: E402

INTRUDER = "intruder"  # the attacker's own host identity, issued by the job's CA


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Outcome:
    name: str
    succeeded: bool
    how: str


def snapshot(cluster: LocalCluster) -> tuple[object, ...]:
    """What an attack must not change: members, the topology, the event log."""
    members = {h: (m.incarnation, m.state, m.rank, m.role, m.reason) for h, m in cluster.members().items()}
    return members, cluster.topology().SerializeToString(), [e.id for e in cluster.events()]


def call(fn: Callable[[], object]) -> tuple[bool, str]:
    """(answered, status): whether the call got an answer other than a refusal, and its status."""
    try:
        fn()
    except grpc.RpcError as exc:
        return False, exc.code().name if isinstance(exc, grpc.Call) else str(exc)
    return True, "OK"


def state_changing_attacks(cluster: LocalCluster) -> list[tuple[str, Callable[[], object]]]:
    members = cluster.members()
    victim = next(h for h, m in members.items() if m.rank == 0)
    inc = members[victim].incarnation
    epoch = cluster.topology().epoch
    me = cluster.stub_as(Role.HOST, INTRUDER)
    return [
        ("take rank 0: register a spare whose id sorts first", lambda: me.Register(pb.RegisterRequest(host_id="000-attacker", role=pb.ROLE_SPARE), timeout=5)),
        ("take rank 0: report a fault against rank 0", lambda: me.ReportFault(pb.ReportFaultRequest(host_id=victim, incarnation=inc, kind=pb.FAULT_KIND_HOST, epoch=epoch), timeout=5)),
        ("roll training back: heartbeat step 0 as a member", lambda: list(me.Heartbeat(iter([pb.HeartbeatRequest(host_id=victim, incarnation=inc, step=0)]), timeout=5))),
        ("kill a host by stealing its heartbeat stream", lambda: list(me.Heartbeat(iter([pb.HeartbeatRequest(host_id=victim, incarnation=inc)]), timeout=2))),
        ("drain a host", lambda: me.Drain(pb.DrainRequest(host_id=victim, reason="x"), timeout=5)),
        ("churn epochs with ADDRESS_IN_USE", lambda: me.ReportFault(pb.ReportFaultRequest(host_id=victim, incarnation=inc, kind=pb.FAULT_KIND_ADDRESS_IN_USE, epoch=epoch), timeout=5)),
        ("re-register a host to evict its agent", lambda: me.Register(pb.RegisterRequest(host_id=victim), timeout=5)),
        ("acknowledge an epoch for another host", lambda: me.AckEpoch(pb.AckEpochRequest(host_id=victim, incarnation=inc, epoch=epoch), timeout=5)),
        ("commit a checkpoint for another host", lambda: me.CommitCheckpoint(pb.CommitCheckpointRequest(host_id=victim, incarnation=inc, epoch=epoch, step=1, tier="local"), timeout=5)),
        ("finish the job for another host", lambda: me.Finish(pb.FinishRequest(host_id=victim, incarnation=inc, epoch=epoch, step=1), timeout=5)),
        ("make another host leave", lambda: me.Leave(pb.LeaveRequest(host_id=victim, incarnation=inc), timeout=5)),
        ("oversized address (10 KiB)", lambda: me.Register(pb.RegisterRequest(host_id=INTRUDER, address="a" * 10240), timeout=5)),
        ("terminal escapes in an address", lambda: me.Register(pb.RegisterRequest(host_id=INTRUDER, address="\x1b]0;owned\x07"), timeout=5)),
    ]  # fmt: skip


def run_attacks(cluster: LocalCluster, tmp: Path) -> list[Outcome]:
    outcomes: list[Outcome] = []
    # Attacks on the state: each must change nothing.
    for name, attack in state_changing_attacks(cluster):
        before = snapshot(cluster)
        answered, status = call(attack)
        time.sleep(0.3)  # a stolen stream's end would be judged within the stream grace
        changed = snapshot(cluster) != before
        outcomes.append(Outcome(name, answered or changed, f"{status}{', state changed' if changed else ''}"))

    # Reads the attacker may not make.
    me = cluster.stub_as(Role.HOST, INTRUDER)
    for name, read in (
        ("read every member's address", lambda: me.ListMembers(pb.ListMembersRequest(), timeout=5)),
        ("read the event log", lambda: list(me.ReplayEvents(pb.ReplayEventsRequest(), timeout=5))),
        ("read one member", lambda: me.GetMember(pb.GetMemberRequest(host_id="host-0"), timeout=5)),
    ):
        answered, status = call(read)
        outcomes.append(Outcome(name, answered, status))

    # No certificate, and a certificate of another CA naming a real host.
    before = snapshot(cluster)
    plain = pb_grpc.CoordinatorStub(grpc.insecure_channel(cluster.address))
    answered, status = call(lambda: plain.Drain(pb.DrainRequest(host_id="host-0"), timeout=3))
    outcomes.append(Outcome("drain without a certificate", answered, status))
    stranger = DevPki(tmp / "stranger-ca").tls(Role.OPERATOR, "admin")
    with secure_channel(cluster.address, stranger) as channel:
        answered, status = call(
            lambda: pb_grpc.CoordinatorStub(channel).Drain(pb.DrainRequest(host_id="host-0"), timeout=3)
        )
    outcomes.append(
        Outcome("drain as an operator of another CA", answered or snapshot(cluster) != before, status)
    )

    # A forged leader hint: a server that is not a coordinator (it holds a host certificate of the job's
    # CA) gets a connection from an agent's channel; it succeeded if a request reached it.
    seen: list[str] = []

    class Impostor(pb_grpc.CoordinatorServicer):
        def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
            seen.append(request.host_id)
            return pb.RegisterResponse()

    impostor = grpc.server(ThreadPoolExecutor(2))
    pb_grpc.add_CoordinatorServicer_to_server(Impostor(), impostor)
    tls = cluster.tls(Role.HOST, "impostor")
    assert tls is not None
    port = impostor.add_secure_port("127.0.0.1:0", tls.server_credentials())
    impostor.start()
    try:
        with cluster.channel(Role.HOST, "host-0", f"127.0.0.1:{port}") as channel:
            _, status = call(
                lambda: pb_grpc.CoordinatorStub(channel).Register(
                    pb.RegisterRequest(host_id="host-0"), timeout=3
                )
            )
        outcomes.append(Outcome("agent follows a forged leader hint", bool(seen), status))
    finally:
        impostor.stop(None)

    # Floods: streams and registrations.
    reader = cluster.stub_as(Role.READER, "flood")
    opened = []
    refused = 0
    for _ in range(40):
        stream = reader.WatchTopology(pb.WatchTopologyRequest(after_epoch=0))
        try:
            next(stream)
            opened.append(stream)
        except grpc.RpcError:
            refused += 1
    for stream in opened:
        stream.cancel()
    outcomes.append(
        Outcome(
            "open 40 topology watches at once", len(opened) > 16, f"{len(opened)} opened, {refused} refused"
        )
    )
    before_members = len(cluster.members())
    flood_ok = 0
    for i in range(2000):
        junk = pb.RegisterRequest(host_id=f"junk-{i}")
        ok, _ = call(lambda: me.Register(junk, timeout=5))  # noqa: B023  (called at once)
        flood_ok += ok
    outcomes.append(
        Outcome(
            "2000 junk registrations",
            flood_ok > 0 or len(cluster.members()) > before_members,
            f"{flood_ok} accepted",
        )
    )
    answered, status = call(
        lambda: list(cluster.stub().ReplayEvents(pb.ReplayEventsRequest(since=float("nan")), timeout=5))
    )
    outcomes.append(
        Outcome("since=NaN (an answer other than INVALID_ARGUMENT)", status != "INVALID_ARGUMENT", status)
    )
    return outcomes


def main() -> int:
    # Stopped by SIGTERM (timeout, a scheduler), it still stops every process it started.
    from remesh.embedded import stop_on_sigterm

    stop_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10, help="SIGKILLs per variant for detection")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    configure_logging(level="warning")
    rng = random.Random(args.seed)
    detect: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="remesh-bench-") as tmp, RedisServer(appendonly=False) as redis:
        for label, secure in (("mutual TLS", True), ("plaintext", False)):
            progress(f"{label}: starting the job")
            job = Job(Path(tmp), redis.url, [], secure=secure)
            try:
                if secure:
                    progress("mutual TLS: the attacks")
                    outcomes = run_attacks(job.cluster, Path(tmp))
                    job.wait_steady()
                detect[label] = run_trials(job, "crash", args.trials, rng, label).detect
            finally:
                job.close()
    print()
    for o in outcomes:
        print(f"{'SUCCEEDED' if o.succeeded else 'refused  '}  {o.name}: {o.how}")
    print()
    print(f"{'crash detection':<20}{'p50':>8}{'p90':>8}{'max':>8}")
    for label, values in detect.items():
        ordered = sorted(values)
        print(
            f"{label:<20}{statistics.median(values):>8.3f}{ordered[int(0.9 * (len(ordered) - 1))]:>8.3f}"
            f"{max(values):>8.3f}"
        )
    tls, plain = statistics.median(detect["mutual TLS"]), statistics.median(detect["plaintext"])
    summary = {
        "attacks_tried": len(outcomes),
        "attacks_succeeded": sum(o.succeeded for o in outcomes),
        "succeeded": [o.name for o in outcomes if o.succeeded],
        "tls_crash_detect_p50_s": round(tls, 4),
        "plain_crash_detect_p50_s": round(plain, 4),
        "tls_vs_plain_ratio": round(tls / plain, 3),
        "trials": args.trials,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

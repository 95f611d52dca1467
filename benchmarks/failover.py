"""How fast a follower coordinator takes over when the leader dies, and whether anyone is evicted.

Runs a real job on this machine (embedded redis-server, 3 coordinator replicas with ``--ha``, 3
active agents and 1 hot spare given all three addresses, each agent supervising the stand-in
trainer) and, per trial, SIGKILLs the leading replica and measures from the kill to:

- lease:   a follower answers a write as the leader (it took the lease and loaded the state);
- serving: the new leader accepted the first heartbeat of a re-registered agent (its MEMBER_ALIVE
           event: a state-changing RPC committed by the new leader);
- all:     every agent is back, heartbeating to the new leader.

Then it restarts the killed replica on its port, waits past the grace a new leader grants, and
counts false evictions (MEMBER_DEAD events: every host was healthy) and epoch changes (none is due).

    python benchmarks/failover.py [--trials 10]

Prints a table, then one JSON line (the last line) with failover_p50_s (kill -> serving),
failover_max_s, lease_p50_s, all_agents_p50_s, false_evictions, epoch_changes and trials.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

from remesh.cli.logs import configure_logging
from remesh.embedded import RedisServer
from remesh.embedded.cluster import LocalCluster, Proc, wait_for
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.security import Role

REPLICAS = 3
ACTIVE = 3
SPARES = 1
# A new leader grants every member 3 s (failover_grace_s) before it judges anyone; a heartbeat
# timeout (0.6 s) and margin on top.
JUDGE_AFTER_S = 4.5


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def is_leader(cluster: LocalCluster, address: str) -> bool:
    """A write to an unknown host: the leader handles it (NOT_FOUND), a follower refuses (UNAVAILABLE)."""
    with cluster.channel(Role.HOST, "bench-probe", address) as channel:
        try:
            pb_grpc.CoordinatorStub(channel).Leave(
                pb.LeaveRequest(host_id="bench-probe", incarnation=1), timeout=1
            )
        except grpc.RpcError as exc:
            return bool(exc.code() == grpc.StatusCode.NOT_FOUND)
    return True


class Job:
    def __init__(self, tmp: Path, redis_url: str) -> None:
        job_id = f"failover-{uuid.uuid4().hex[:8]}"
        (tmp / job_id).mkdir()
        self.cluster = LocalCluster(tmp / job_id, redis_url, job_id)
        self.replicas: dict[str, Proc] = {}
        try:
            for _ in range(REPLICAS):
                proc = self.cluster.start_coordinator("--ha", "--world-size", str(ACTIVE))
                self.replicas[self.cluster.address] = proc
            self.cluster.addresses = list(self.replicas)
            self.use(self.leader())
            for i in range(ACTIVE):
                self.cluster.start_agent(f"host-{i}")
            for i in range(SPARES):
                self.cluster.start_agent(f"spare-{i}", spare=True)
            self.cluster.wait_epoch(1, timeout=60)
            self.wait_steady()
        except BaseException:
            self.close()
            raise

    def leader(self, timeout: float = 30) -> str:
        def find() -> str | None:
            return next(
                (a for a, p in self.replicas.items() if p.alive() and is_leader(self.cluster, a)), None
            )

        return wait_for(find, timeout, "a leading replica", interval=0.01)  # type: ignore[return-value]

    def use(self, address: str) -> None:
        self.cluster.reset_channel()
        self.cluster.port = int(address.rsplit(":", 1)[1])

    def members(self) -> dict[str, pb.Member]:
        try:
            return self.cluster.members()
        except grpc.RpcError:
            return {}

    def wait_steady(self) -> None:
        def steady() -> bool:
            members = self.members()
            running = [h for h, p in self.cluster.agents.items() if p.alive()]
            return all(h in members and members[h].state == pb.MEMBER_STATE_ALIVE for h in running)

        wait_for(steady, 60, "every agent alive")

    def events(self, types: list[int], since: float) -> list[pb.Event]:
        request = pb.ReplayEventsRequest(types=types, since=since)  # type: ignore[arg-type]
        return list(self.cluster.stub().ReplayEvents(request, timeout=10))

    def trial(self) -> dict[str, float]:
        old = self.leader()
        self.use(old)
        before = self.members()
        epoch = self.cluster.topology().epoch
        t0 = time.time()
        self.replicas[old].kill()  # SIGKILL
        new = self.leader(timeout=30)
        lease_s = time.time() - t0
        self.use(new)

        def all_back() -> bool:
            members = self.members()
            return all(
                h in members
                and members[h].state == pb.MEMBER_STATE_ALIVE
                and members[h].incarnation > before[h].incarnation
                for h in before
            )

        wait_for(all_back, 30, "every agent to heartbeat to the new leader")
        alive = [e for e in self.events([pb.EVENT_TYPE_MEMBER_ALIVE], t0) if e.time >= t0]
        serving_s = min(e.time for e in alive) - t0
        all_s = max(max(e.time for e in alive if e.host_id == h) for h in before) - t0
        # Bring the killed replica back on its port, so every trial starts with three.
        port = int(old.rsplit(":", 1)[1])
        self.replicas[old] = self.cluster.start_coordinator("--ha", "--world-size", str(ACTIVE), port=port)
        self.use(new)
        time.sleep(max(0.0, t0 + lease_s + JUDGE_AFTER_S - time.time()))
        dead = self.events([pb.EVENT_TYPE_MEMBER_DEAD], t0)
        for event in dead:
            progress(f"    false eviction: {event.host_id}: {event.reason}")
        return {
            "lease": lease_s,
            "serving": serving_s,
            "all": all_s,
            "false_evictions": len(dead),
            "epoch_changes": self.cluster.topology().epoch - epoch,
        }

    def close(self) -> None:
        self.cluster.close()


def main() -> int:
    # Stopped by SIGTERM (timeout, a scheduler), it still stops every process it started.
    from remesh.embedded import stop_on_sigterm

    stop_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10, help="leader kills")
    args = parser.parse_args()
    configure_logging(level="warning")  # logs go to stderr; stdout is the table and the JSON line
    trials: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="remesh-bench-") as tmp, RedisServer(appendonly=False) as redis:
        progress(f"starting {REPLICAS} coordinator replicas, {ACTIVE} hosts and {SPARES} spare")
        job = Job(Path(tmp), redis.url)
        try:
            for i in range(args.trials):
                trials.append(job.trial())
                t = trials[-1]
                progress(
                    f"  trial {i + 1}/{args.trials}: new leader {t['lease']:.3f}s, serving {t['serving']:.3f}s, "
                    f"all agents {t['all']:.3f}s, false evictions {t['false_evictions']:.0f}"
                )
        finally:
            job.close()

    def column(key: str) -> list[float]:
        return [t[key] for t in trials]

    print()
    print(f"{'leader SIGKILL ->':<28}{'p50':>8}{'max':>8}{'min':>8}")
    for key, label in (
        ("lease", "follower leads"),
        ("serving", "first heartbeat accepted"),
        ("all", "every agent back"),
    ):
        values = column(key)
        print(f"{label:<28}{statistics.median(values):>8.3f}{max(values):>8.3f}{min(values):>8.3f}")
    false_evictions = int(sum(column("false_evictions")))
    epoch_changes = int(sum(column("epoch_changes")))
    print(f"{args.trials} leader kills: {false_evictions} false evictions, {epoch_changes} epoch changes")
    summary = {
        "failover_p50_s": round(statistics.median(column("serving")), 4),
        "failover_max_s": round(max(column("serving")), 4),
        "lease_p50_s": round(statistics.median(column("lease")), 4),
        "all_agents_p50_s": round(statistics.median(column("all")), 4),
        "all_agents_max_s": round(max(column("all")), 4),
        "false_evictions": false_evictions,
        "epoch_changes": epoch_changes,
        "trials": args.trials,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

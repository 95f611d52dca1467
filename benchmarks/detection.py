"""How fast remesh detects a failed host and publishes the new epoch, and whether load fools it.

Runs a real job on this machine (embedded redis-server, a coordinator process, 4 active agents and 2
hot spares, each agent supervising the stand-in trainer) and measures, per trial:

- crash:  SIGKILL of a whole host (agent + trainer) -> MEMBER_DEAD event, and -> the new epoch
          received by every WatchTopology watcher;
- silent: SIGSTOP of a whole host (it stays connected but says nothing) -> the same two moments;

for remesh at its default settings and, side by side in the same run, for the heartbeat-timeout-only
baseline (the same coordinator with ``--no-stream-signal``: what detection costs without the
broken-stream signal). Then it runs the job for ``--load-seconds`` with both cores kept busy and
counts false failure declarations.

    python benchmarks/detection.py [--trials 20] [--load-seconds 120]

Prints a table, then one JSON line (the last line) with crash_p50_s, crash_p99_s, silent_p50_s,
silent_p99_s, false_positives, trials and the baseline's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from remesh.cli.logs import configure_logging
from remesh.embedded import RedisServer
from remesh.embedded.cluster import LocalCluster, wait_for
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.security import Role

ACTIVE = 4
SPARES = 2
WATCHERS = 3


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Watcher:
    """A WatchTopology stream in a thread: wall-clock arrival time of each epoch."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.arrivals: dict[int, float] = {}
        self._channel = channel
        self._call = pb_grpc.CoordinatorStub(self._channel).WatchTopology(pb.WatchTopologyRequest())
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for topology in self._call:
                self.arrivals.setdefault(topology.epoch, time.time())
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


@dataclass
class Samples:
    detect: list[float] = field(default_factory=list)
    epoch: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (with 20 samples, p99 is the maximum)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class Job:
    def __init__(
        self, tmp: Path, redis_url: str, coordinator_args: list[str], *, secure: bool = True
    ) -> None:
        job_id = f"bench-{uuid.uuid4().hex[:8]}"
        (tmp / job_id).mkdir()
        self.cluster = LocalCluster(tmp / job_id, redis_url, job_id, secure=secure)
        self.next_spare = 0
        self.watchers: list[Watcher] = []
        try:
            self.cluster.start_coordinator("--world-size", str(ACTIVE), *coordinator_args)
            for i in range(ACTIVE):
                self.cluster.start_agent(f"host-{i}")
            for _ in range(SPARES):
                self.add_spare()
            self.cluster.wait_epoch(1, timeout=60)
            self.wait_steady()
            self.watchers = [Watcher(self.cluster.channel(Role.READER, "bench")) for _ in range(WATCHERS)]
            wait_for(lambda: all(1 in w.arrivals for w in self.watchers), 10, "watchers to connect")
        except BaseException:
            self.close()  # never leave the processes of a half-started job behind
            raise

    def add_spare(self) -> None:
        self.cluster.start_agent(f"spare-{self.next_spare}", spare=True)
        self.next_spare += 1

    def wait_steady(self) -> None:
        """Every live agent process is an alive member, and the current epoch is live."""

        def steady() -> bool:
            members = self.cluster.members()
            running = [h for h, p in self.cluster.agents.items() if p.alive()]
            if not all(h in members and members[h].state == pb.MEMBER_STATE_ALIVE for h in running):
                return False
            epoch = self.cluster.topology().epoch
            return any(
                e.type == pb.EVENT_TYPE_EPOCH_LIVE and e.epoch == epoch
                for e in self.cluster.stub().ReplayEvents(
                    pb.ReplayEventsRequest(types=[pb.EVENT_TYPE_EPOCH_LIVE]), timeout=10
                )
            )

        wait_for(steady, 60, "the job to settle")

    def dead_event(self, host: str, after: float) -> pb.Event:
        def found() -> pb.Event | None:
            events = self.cluster.stub().ReplayEvents(
                pb.ReplayEventsRequest(host_ids=[host], types=[pb.EVENT_TYPE_MEMBER_DEAD], since=after),
                timeout=10,
            )
            return next(iter(events), None)

        return wait_for(found, 30, f"{host} declared dead")  # type: ignore[return-value]

    def trial(self, rng: random.Random, how: str, samples: Samples) -> None:
        topology = self.cluster.topology()
        victim = rng.choice([m.host_id for m in topology.members])
        proc = self.cluster.agents[victim]
        t0 = time.time()
        proc.signal_group(signal.SIGKILL if how == "crash" else signal.SIGSTOP)
        new_epoch = topology.epoch + 1
        wait_for(
            lambda: all(new_epoch in w.arrivals for w in self.watchers), 30, f"epoch {new_epoch} everywhere"
        )
        dead = self.dead_event(victim, t0 - 1)
        samples.detect.append(dead.time - t0)
        samples.epoch.append(max(w.arrivals[new_epoch] for w in self.watchers) - t0)
        if how == "crash":
            proc.popen.wait(10)
            self.add_spare()
        else:
            proc.signal_group(signal.SIGCONT)  # it rejoins as a spare with a new incarnation
        self.wait_steady()

    def dead_count(self) -> int:
        return len(
            list(
                self.cluster.stub().ReplayEvents(
                    pb.ReplayEventsRequest(types=[pb.EVENT_TYPE_MEMBER_DEAD]), timeout=10
                )
            )
        )

    def close(self) -> None:
        for w in self.watchers:
            w.close()
        self.cluster.close()


def run_trials(job: Job, how: str, trials: int, rng: random.Random, label: str) -> Samples:
    samples = Samples()
    for i in range(trials):
        job.trial(rng, how, samples)
        progress(
            f"  {label} {how} {i + 1}/{trials}: detected {samples.detect[-1]:.3f}s, "
            f"epoch at every watcher {samples.epoch[-1]:.3f}s"
        )
    return samples


def load_run(job: Job, seconds: float) -> tuple[list[pb.Event], int]:
    """Both cores busy for ``seconds``: failure declarations and suspicions in that window."""
    before_dead = job.dead_count()
    t0 = time.time()
    burn = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(os.cpu_count() or 2)]
    try:
        while any(b.poll() is None for b in burners):
            time.sleep(min(5.0, max(0.1, t0 + seconds - time.time())))
            progress(
                f"  load: {time.time() - t0:.0f}/{seconds:.0f}s, {job.dead_count() - before_dead} declared dead"
            )
    finally:
        for b in burners:
            b.kill()
            b.wait()

    def since_start(kind: Any) -> list[pb.Event]:
        return list(
            job.cluster.stub().ReplayEvents(pb.ReplayEventsRequest(types=[kind], since=t0), timeout=10)
        )

    return since_start(pb.EVENT_TYPE_MEMBER_DEAD), len(since_start(pb.EVENT_TYPE_MEMBER_SUSPECT))


def main() -> int:
    # Stopped by SIGTERM (timeout, a scheduler), it still stops every process it started.
    from remesh.embedded import stop_on_sigterm

    stop_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=20, help="trials per failure kind and variant")
    parser.add_argument("--load-seconds", type=float, default=120.0, help="length of the busy-cores run")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    configure_logging(level="warning")  # logs go to stderr; stdout is the table and the JSON line
    rng = random.Random(args.seed)
    results: dict[str, Samples] = {}
    with tempfile.TemporaryDirectory(prefix="remesh-bench-") as tmp, RedisServer(appendonly=False) as redis:
        for label, extra in (("remesh", []), ("heartbeat-only", ["--no-stream-signal"])):
            progress(f"{label}: starting {ACTIVE} hosts and {SPARES} spares")
            job = Job(Path(tmp), redis.url, extra)
            try:
                for how in ("crash", "silent"):
                    results[f"{label} {how}"] = run_trials(job, how, args.trials, rng, label)
                if label == "remesh":
                    progress(f"remesh: {args.load_seconds:.0f}s with every core busy")
                    declared, suspects = load_run(job, args.load_seconds)
                    false_positives = len(declared)
            finally:
                job.close()

    print()
    print(f"{'failure':<24}{'to dead p50':>12}{'p99':>8}{'max':>8}{'to epoch p50':>14}{'p99':>8}{'max':>8}")
    for name, s in results.items():
        print(
            f"{name:<24}{statistics.median(s.detect):>12.3f}{percentile(s.detect, 99):>8.3f}{max(s.detect):>8.3f}"
            f"{statistics.median(s.epoch):>14.3f}{percentile(s.epoch, 99):>8.3f}{max(s.epoch):>8.3f}"
        )
    print(
        f"busy cores for {args.load_seconds:.0f}s: {false_positives} false failure declarations, {suspects} suspicions"
    )
    for event in declared:
        print(f"  declared dead under load: {event.host_id}: {event.reason}")
    crash, silent = results["remesh crash"], results["remesh silent"]
    base_crash = results["heartbeat-only crash"]
    summary = {
        "crash_p50_s": round(statistics.median(crash.epoch), 4),
        "crash_p99_s": round(percentile(crash.epoch, 99), 4),
        "silent_p50_s": round(statistics.median(silent.epoch), 4),
        "silent_p99_s": round(percentile(silent.epoch, 99), 4),
        "crash_detect_p50_s": round(statistics.median(crash.detect), 4),
        "silent_detect_p50_s": round(statistics.median(silent.detect), 4),
        "baseline_crash_p50_s": round(statistics.median(base_crash.epoch), 4),
        "baseline_silent_p50_s": round(statistics.median(results["heartbeat-only silent"].epoch), 4),
        "crash_vs_baseline_ratio": round(
            statistics.median(crash.epoch) / statistics.median(base_crash.epoch), 3
        ),
        "false_positives": false_positives,
        "suspicions_under_load": suspects,
        "load_seconds": args.load_seconds,
        "trials": args.trials,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

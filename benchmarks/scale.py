"""One coordinator against fleets of simulated agents (benchmarks/fleet.py): what it holds, measured.

For each fleet size: an embedded redis-server, one coordinator process with mutual TLS, and the
simulated agents (a tenth of them hot spares), each with its own certificate, channel, registration
and heartbeat stream, in two simulator processes. All of it shares this machine's cores with the
coordinator: the figures are the coordinator's on a machine that is also running the whole fleet.

Per size: heartbeat ingest rate, coordinator CPU (cores, over a steady window), Redis memory, crash
detection (SIGKILL-like: a simulated agent's connection closes -> member_dead), silent detection (an
agent stops sending -> member_dead), false positives (anyone else declared dead; their declarations
counted by phase, forming / steady / correlated, and by reason, stream broke / silence), fan-out (the new
epoch's topology event -> every simulated agent holding it), and one correlated failure (a tenth of
the active hosts at once: epochs published, time to the new epoch live). Then, as the fan-out's
baseline, gRPC's own (``benchmarks/fanout_floor.py``, ``--floor-rounds`` rounds, the coordinator and
its fleet stopped): one message written to as many streams from two client processes beside as many
heartbeats, with nothing of remesh's on the server; ``fanout_floor_p99_s`` and
``fanout_floor_write_s`` in the figures.

The heartbeat interval grows with the fleet (the coordinator's ``--fleet-size`` and
``--heartbeat-budget``): a coordinator ingests about ``--beats-per-second`` heartbeats whatever the size; crash detection does not wait for heartbeats
(the closed stream is the signal), silent detection does (six intervals).

    python benchmarks/scale.py [--hosts 1000,2000] [--crashes 5] [--silent 3] [--ack-delay 1.0]
        [--acks stream|unary] [--floor-rounds 3] [--relays 0]

With ``--relays R`` the coordinator writes each epoch to R topology relays (``remesh relay``, one per
simulator process, on this machine too) and each relay to its simulator's agents; heartbeats and
acknowledgements still go to the coordinator. ``relay_cpu_cores`` in the figures is the relays' CPU
over the steady window, beside the coordinator's.

A simulated trainer acknowledges a new epoch ``--ack-delay`` to twice that after its agent received
it, as a real one does once it has re-meshed and restored (the demo's trainers: about 1.2 s); with
``--ack-delay 0`` every member acknowledges at once, and the acknowledgements of thousands of hosts
meet the fan-out of the same epoch at the coordinator. It acknowledges on its heartbeat stream, as an
agent does with a coordinator that offers it (``--acks stream``), or with an ``AckEpoch`` call each
(``--acks unary``, as agents did before).

Prints a table, a line "all figures: {JSON}" for the largest size, and last one JSON line with
exactly hosts, crash_detect_p99_s, silent_detect_p99_s, fanout_p99_s, false_positives,
coordinator_cpu_cores and epochs_for_correlated_failure.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc
import redis
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.fanout_floor import measure_floor  # noqa: E402
from benchmarks.fleet import Fleet, host_ids  # noqa: E402
from remesh.cli.logs import configure_logging  # noqa: E402
from remesh.coordinator.settings import DetectorSettings  # noqa: E402
from remesh.embedded import RedisServer, free_port  # noqa: E402
from remesh.embedded.cluster import LocalCluster, cpu_seconds, wait_for  # noqa: E402
from remesh.v1 import coordinator_pb2 as pb  # noqa: E402

T = TypeVar("T")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else float("nan")


_AGAIN = (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


def bucket_count(before: dict[float, float], after: dict[float, float]) -> int:
    """How many observations a cumulative histogram counted between two scrapes."""
    return int(after.get(math.inf, 0.0) - before.get(math.inf, 0.0))


def bucket_p99(before: dict[float, float], after: dict[float, float]) -> float:
    """The upper bound of the bucket holding the 99th percentile of what a cumulative histogram
    counted between two scrapes (nan: nothing counted, or beyond the last finite bound)."""
    counted = {le: after[le] - before.get(le, 0.0) for le in after}
    total = counted.get(math.inf, 0.0)
    if not total:
        return math.nan
    bound = next(le for le in sorted(counted) if counted[le] >= 0.99 * total)
    return bound if bound != math.inf else math.nan


def patiently(call: Callable[[], T], attempts: int = 5, again: tuple[grpc.StatusCode, ...] = _AGAIN) -> T:
    """``call()``, sent again when the coordinator sheds it: at 2000 hosts and more it answers some calls
    with CANCELLED while its agents' calls pour in (the agents send theirs again the same way)."""
    for attempt in range(attempts):
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() not in again or attempt == attempts - 1:
                raise
            time.sleep(0.2 * 2**attempt)
    raise AssertionError("unreachable")


class Run:
    def __init__(
        self,
        tmp: Path,
        redis_server: RedisServer,
        hosts: int,
        beats_per_second: float,
        ack_delay_s: float,
        acks: str = "stream",
        relays: int = 0,
    ) -> None:
        self.job = f"scale-{uuid.uuid4().hex[:8]}"
        self.redis_server = redis_server
        self.cluster = LocalCluster(tmp / self.job, redis_server.url, self.job)
        (tmp / self.job).mkdir(parents=True)
        self.spares = host_ids(hosts // 10, "spare")
        self.active = host_ids(hosts - len(self.spares))
        self.beats_per_second = beats_per_second
        self.ack_delay_s = ack_delay_s
        self.acks = acks
        self.relays = relays
        self.relay_pids: list[int] = []
        # What the coordinator's --fleet-size/--heartbeat-budget make of its preset.
        self.interval = DetectorSettings().for_fleet(hosts, beats_per_second).heartbeat_interval_s
        self.hosts = hosts
        self.metrics_port = free_port()
        self.fleet: Fleet | None = None
        self._log: list[pb.Event] = []
        self._last_id = ""

    def start(self) -> None:
        proc = self.cluster.start_coordinator(
            "--world-size", str(len(self.active)), "--fleet-size", str(self.hosts),
            "--heartbeat-budget", str(self.beats_per_second),
            "--max-members", str(2 * self.hosts), "--jax-port-span", "20000", "--jax-port-base", "30000",
            "--metrics-port", str(self.metrics_port),
        )  # fmt: skip
        self.pid = proc.pid
        relays = []
        for _ in range(self.relays):
            # Keepalives as far apart as the coordinator's at this size (its heartbeat interval):
            # each is a write to every follower, 5000 of them per relay here.
            relay, address = self.cluster.start_relay("--keepalive", str(self.interval))
            self.relay_pids.append(relay.pid)
            relays.append(address)
        progress(
            f"  {self.hosts} hosts: issuing certificates, starting simulators (interval {self.interval} s"
            + (f", {self.relays} relays" if self.relays else "")
            + ")"
        )
        self.fleet = Fleet(
            self.cluster.address,
            self.active,
            self.spares,
            relays=relays,
            # A relay serves one simulator's agents, as a rack's relay serves its rack.
            processes=max(2, self.relays),
            pki=self.cluster.pki,
            start_spread_s=max(2.0, self.hosts / 500),
            ack_delay_s=self.ack_delay_s,
            acks=self.acks,
        )
        self.fleet.start(timeout=600)
        progress(f"  {self.hosts} hosts: every simulated agent registered; waiting for the first epoch")
        wait_for(lambda: self.published() >= 1, 300, "epoch 1", interval=0.5)
        progress(f"  {self.hosts} hosts: epoch {self.published()} published; waiting for it to go live")
        # The job formed and its current epoch is live (a host lost while forming makes epoch 2).
        try:
            # The epoch asked about is the newest at each look: a host lost meanwhile makes another.
            wait_for(lambda: self.live_at(self.published()), 300, "the job's epoch live", interval=0.5)
        except TimeoutError as exc:
            epoch = self.published()
            acked = {e.host_id for e in self.events([pb.EVENT_TYPE_EPOCH_ACKED]) if e.epoch == epoch}
            raise TimeoutError(
                f"{exc}: epoch {epoch} acknowledged by {len(acked)} of {len(self.active)} hosts; "
                f"the simulators saw {dict(self.fleet.trouble) or 'nothing wrong'}"
            ) from exc
        if self.relays:
            everyone = {*self.active, *self.spares}
            fleet = self.fleet
            wait_for(lambda: everyone <= fleet.relay_followers(), 300, "every agent to follow its relay")
            progress(f"  {self.hosts} hosts: every agent takes its topologies from a relay")

    def events(self, types: list[Any], since: float = 0.0) -> list[pb.Event]:
        """The events of ``types`` (from ``since``), read incrementally: each call asks the coordinator
        only for what is new since the last one, so watching the job does not load what it measures."""

        def read() -> None:  # resumes after the last event read if sent again
            for event in self.cluster.stub().ReplayEvents(
                pb.ReplayEventsRequest(after_id=self._last_id), timeout=60
            ):
                self._log.append(event)
                self._last_id = event.id

        # A read that ran out of time kept what it read: the next one resumes after it (10,000 hosts
        # forming on a loaded machine once made one read of the log outlast its 60 s, and once had
        # five in a row shed over 6 s while the registrations poured in).
        patiently(read, attempts=8, again=(*_AGAIN, grpc.StatusCode.DEADLINE_EXCEEDED))
        return [e for e in self._log if e.type in types and e.time >= since]

    def published(self) -> int:
        """The newest epoch published, from the event log: watching for it costs the coordinator
        the events since the last look, where a GetTopology encodes every member each time."""
        return max((e.epoch for e in self.events([pb.EVENT_TYPE_TOPOLOGY_CHANGED])), default=0)

    def topology(self) -> pb.Topology:
        return patiently(lambda: self.cluster.stub().GetTopology(pb.GetTopologyRequest(), timeout=60))

    def live_at(self, epoch: int) -> float | None:
        """When ``epoch``'s epoch_live event was written (every member acknowledged it); None before."""
        return next((e.time for e in self.events([pb.EVENT_TYPE_EPOCH_LIVE]) if e.epoch == epoch), None)

    def wait_live(self, epoch: int, what: str, timeout: float = 120, interval: float = 0.2) -> float:
        """Wait for ``epoch`` to go live; when it did."""
        return cast(float, wait_for(functools.partial(self.live_at, epoch), timeout, what, interval=interval))

    def steady(self, seconds: float) -> dict[str, float]:
        assert self.fleet is not None
        c0, r0, t0 = self.coordinator_cpu(), self.relay_cpu(), time.monotonic()
        time.sleep(seconds)
        cores = (self.coordinator_cpu() - c0) / (time.monotonic() - t0)
        relay_cores = (self.relay_cpu() - r0) / (time.monotonic() - t0)
        client = redis.Redis.from_url(self.redis_server.url)
        try:
            memory = int(client.info("memory")["used_memory"])
        finally:
            client.close()
        return {
            "ingest_per_s": self.fleet.heartbeat_rate(seconds),
            "cpu_cores": cores,
            "relay_cpu_cores": relay_cores,
            "redis_mb": memory / 2**20,
        }

    def relay_cpu(self) -> float:
        """CPU seconds the relays used, all of them together."""
        total = 0.0
        for pid in self.relay_pids:
            cpu = cpu_seconds(pid)
            if cpu is None:
                raise RuntimeError(f"relay {pid} exited; see {self.cluster.tmp}")
            total += cpu
        return total

    def coordinator_cpu(self) -> float:
        cpu = cpu_seconds(self.pid)
        if cpu is None:
            raise RuntimeError(f"the coordinator exited; see {self.cluster.tmp}")
        return cpu

    def published_at(self, epoch: int) -> float:
        """When ``epoch``'s topology_changed event was written."""
        return next(e.time for e in self.events([pb.EVENT_TYPE_TOPOLOGY_CHANGED]) if e.epoch == epoch)

    def fail(self, how: str, victims: list[str]) -> tuple[float, pb.Topology]:
        """Fail ``victims`` at once; returns when the fleet did it and the topology that replaced them."""
        assert self.fleet is not None
        before = self.published()
        t = self.fleet.command(how, victims)
        wait_for(lambda: self.published() > before, 120, f"an epoch after {how}", interval=0.2)
        return t, self.topology()

    def detection(self, victim: str, t: float) -> float:
        dead = wait_for(
            lambda: [e for e in self.events([pb.EVENT_TYPE_MEMBER_DEAD], since=t - 1) if e.host_id == victim],
            120,
            f"{victim} declared dead",
            interval=0.2,
        )
        return float(dead[0].time - t)  # type: ignore[index]

    def deliveries(self) -> dict[float, float]:
        """The coordinator's own side of a fan-out: its histogram of topologies handed to heartbeat
        streams (cumulative count per bucket bound), from its /metrics."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as reply:
            text = reply.read().decode()
        return {
            float(sample.labels["le"]): sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "remesh_topology_delivery_seconds"
            for sample in family.samples
            if sample.name.endswith("_bucket")
        }

    def fanout(self, topology: pb.Topology, expect: set[str]) -> float:
        assert self.fleet is not None
        published = self.published_at(topology.epoch)
        arrivals = wait_for(
            lambda: expect <= set(got := self.fleet.received(topology.epoch)) and got,  # type: ignore[union-attr]
            120,
            f"epoch {topology.epoch} at every agent",
            interval=0.2,
        )
        return percentile([arrivals[h] - published for h in expect], 99)  # type: ignore[index]

    def up(self) -> set[str]:
        members = patiently(
            lambda: self.cluster.stub().ListMembers(pb.ListMembersRequest(), timeout=60)
        ).members
        return {m.host_id for m in members if m.state == pb.MEMBER_STATE_ALIVE}

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
        self.cluster.close()


def measure(run: Run, crashes: int, silents: int, rng: random.Random) -> dict[str, Any]:
    started = time.time()
    run.start()
    formed = time.time()
    progress(f"  {run.hosts} hosts: formed in {formed - started:.0f}s; steady window")
    result: dict[str, Any] = {"hosts": run.hosts, "heartbeat_interval_s": run.interval}
    result.update(run.steady(10.0))
    lost: set[str] = set()
    crash: list[float] = []
    silent: list[float] = []
    fanout: list[float] = []
    delivery: list[float] = []  # the coordinator's side of each fan-out (a histogram bucket's bound)
    # From each single failure's epoch published to every member's acknowledgement committed (live):
    # the acknowledgements' path through the coordinator. The next failure waits for it, so one
    # epoch's acknowledgements never meet the next one's fan-out.
    acked: list[float] = []
    for kind, count in (("crash", crashes), ("silent", silents)):
        for i in range(count):
            victim = rng.choice([m.host_id for m in run.topology().members])
            handed = run.deliveries()
            t, topology = run.fail(kind, [victim])
            lost.add(victim)
            (crash if kind == "crash" else silent).append(run.detection(victim, t))
            fanout.append(run.fanout(topology, run.up() - lost))
            now_handed = run.deliveries()
            delivery.append(bucket_p99(handed, now_handed))
            live_at = run.wait_live(topology.epoch, f"epoch {topology.epoch} live")
            acked.append(live_at - run.published_at(topology.epoch))
            progress(
                f"  {run.hosts} hosts: {kind} {i + 1}/{count}: dead after {(crash if kind == 'crash' else silent)[-1]:.3f}s, "
                f"fan-out p99 {fanout[-1]:.3f}s (written to {bucket_count(handed, now_handed)} streams by the "
                f"coordinator: p99 <= {delivery[-1]} s), live {acked[-1]:.2f}s after it was published"
            )
    members = [m.host_id for m in run.topology().members]
    victims = rng.sample(members, len(members) // 10)
    before = run.published()
    handed = run.deliveries()
    t, topology = run.fail("crash", victims)
    lost |= set(victims)
    published_at = run.published_at(topology.epoch)
    correlated_fanout = run.fanout(topology, run.up() - lost)
    now_handed = run.deliveries()
    correlated_delivery = bucket_p99(handed, now_handed)
    correlated_written = bucket_count(handed, now_handed)
    live_at = run.wait_live(topology.epoch, "the epoch after the correlated failure live")
    progress(
        f"  {run.hosts} hosts: {len(victims)} crashed at once: epoch {topology.epoch} published after "
        f"{published_at - t:.2f}s, at every survivor {correlated_fanout:.2f}s later (p99; written to "
        f"{correlated_written} streams by the coordinator: p99 <= {correlated_delivery} s), live after "
        f"{live_at - t:.2f}s"
    )
    time.sleep(3.0)  # anything late would show now
    epochs = [e for e in run.events([pb.EVENT_TYPE_TOPOLOGY_CHANGED]) if e.epoch > before]
    dead_events = run.events([pb.EVENT_TYPE_MEMBER_DEAD])
    dead = {e.host_id for e in dead_events}
    # When, and why, healthy hosts were declared dead: forming the job, the steady window and the
    # single failures, or the correlated failure and what followed it.
    false_by_phase: Counter[str] = Counter()
    false_by_reason: Counter[str] = Counter()
    for e in dead_events:
        if e.host_id in lost:
            continue
        false_by_phase["forming" if e.time < formed else "steady" if e.time < t else "correlated"] += 1
        false_by_reason["stream broke" if "stream broke" in e.reason else "silence"] += 1
    # Suspicions of hosts that never failed: not false positives (nobody was replaced), but how near
    # the detector came to them.
    suspected = {e.host_id for e in run.events([pb.EVENT_TYPE_MEMBER_SUSPECT])} - lost
    # How the correlated failure reached the planner: when its hosts were declared dead (first,
    # median, last, from the fleet's crash) and when each epoch after it was published. A burst
    # spread over longer than the planner holds one makes more than one epoch.
    victim_set = set(victims)
    victims_dead = sorted(e.time - t for e in dead_events if e.host_id in victim_set)
    result.update(
        {
            "crash_detect_p50_s": round(percentile(crash, 50), 3),
            "crash_detect_p99_s": round(percentile(crash, 99), 3),
            "silent_detect_p99_s": round(percentile(silent, 99), 3),
            "fanout_p99_s": round(max(fanout), 3),
            "single_failure_fanout_p99_s": [round(f, 3) for f in fanout],
            "single_failure_published_to_live_s": [round(a, 2) for a in acked],
            # The same epochs, up to the coordinator's hand-over to each stream (where a fan-out
            # spends its time: the coordinator, or the simulators sharing its cores).
            "coordinator_delivery_p99_le_s": max(
                (d for d in delivery if not math.isnan(d)), default=math.nan
            ),
            "correlated_failure_delivery_p99_le_s": correlated_delivery,
            "false_positives": len(dead - lost),
            # Declarations, not hosts: a host declared dead twice counts twice here.
            "false_declarations_by_phase": dict(false_by_phase),
            "false_declarations_by_reason": dict(false_by_reason),
            "healthy_hosts_suspected": len(suspected),
            "correlated_failure_hosts": len(victims),
            "epochs_for_correlated_failure": len(epochs),
            "relays": run.relays,
            "correlated_failure_to_epoch_s": round(published_at - t, 3),
            "correlated_failure_dead_after_s": [
                round(victims_dead[0], 3),
                round(percentile(victims_dead, 50), 3),
                round(victims_dead[-1], 3),
            ]
            if victims_dead
            else [],
            "correlated_failure_epochs_after_s": [round(e.time - t, 3) for e in epochs],
            "correlated_failure_fanout_p99_s": round(correlated_fanout, 3),
            "correlated_failure_to_live_s": round(live_at - t, 3),
            # Calls the simulated agents had to send again, or gave up, by status: the load they met.
            "agent_trouble": dict(run.fleet.trouble) if run.fleet is not None else {},
        }
    )
    if run.fleet is not None:
        progress(f"  {run.hosts} hosts: the simulated agents met {run.fleet.trouble_report()}")
    if false_by_phase:
        progress(
            f"  {run.hosts} hosts: healthy hosts declared dead, by phase {dict(false_by_phase)}, "
            f"by reason {dict(false_by_reason)}"
        )
        # The story of a few of them, from the log: what they did before they were declared dead.
        everything = run.events(list(pb.EventType.values()))
        for host in sorted(dead - lost)[:3]:
            story = [e for e in everything if e.host_id == host]
            progress(f"  {host}: " + "; ".join(f"+{e.time - started:.1f}s {e.reason}" for e in story[:8]))
    return result


def main() -> int:
    # Stopped by SIGTERM (timeout, a scheduler), it still stops every process it started.
    from remesh.embedded import stop_on_sigterm

    stop_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", default="1000,2000", help="fleet sizes, comma-separated")
    parser.add_argument("--crashes", type=int, default=5, help="single-host crashes per size")
    parser.add_argument("--silent", type=int, default=3, help="single-host silences per size")
    parser.add_argument(
        "--beats-per-second", type=float, default=1000.0, help="fleet heartbeat rate aimed at"
    )
    parser.add_argument(
        "--ack-delay",
        type=float,
        default=1.0,
        help="seconds (to twice that) a simulated trainer re-meshes before acknowledging an epoch; 0: at once",
    )
    parser.add_argument(
        "--acks",
        choices=("stream", "unary"),
        default="stream",
        help="simulated agents acknowledge on their heartbeat stream (as agents do) or by AckEpoch calls",
    )
    parser.add_argument(
        "--relays",
        type=int,
        default=0,
        help="topology relays (`remesh relay`) the simulated agents take their epochs from, one per "
        "simulator process; 0: every epoch goes on each heartbeat stream",
    )
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument(
        "--floor-rounds",
        type=int,
        default=3,
        help="rounds of gRPC's own fan-out to as many streams after each size (benchmarks/fanout_floor.py); 0: none",
    )
    args = parser.parse_args()
    configure_logging(level="warning")
    rng = random.Random(args.seed)
    results = []
    failed: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="remesh-scale-") as tmp:
        for hosts in (int(h) for h in args.hosts.split(",")):
            with RedisServer(appendonly=False) as redis_server:
                run = Run(
                    Path(tmp),
                    redis_server,
                    hosts,
                    args.beats_per_second,
                    args.ack_delay,
                    args.acks,
                    args.relays,
                )
                try:
                    results.append(measure(run, args.crashes, args.silent, rng))
                except (TimeoutError, RuntimeError, grpc.RpcError) as exc:
                    # Said, not hidden: the sizes before still print, and this one says where it stopped.
                    why = (
                        f"the coordinator kept refusing the benchmark's reads past their retries: "
                        f"{exc.code().name}: {exc.details()}"
                        if isinstance(exc, grpc.Call)
                        else str(exc)
                    )
                    progress(f"  {hosts} hosts: FAILED: {why}")
                    if run.fleet is not None:
                        progress(f"  {hosts} hosts: the simulated agents met {run.fleet.trouble_report()}")
                    failed[hosts] = why
                finally:
                    run.close()
            if args.floor_rounds > 0 and hosts not in failed:
                # The baseline, with the coordinator and its fleet gone: gRPC alone writing one message
                # to as many streams, from as many client processes, beside as many heartbeats.
                progress(f"  {hosts} streams: gRPC's own fan-out, {args.floor_rounds} rounds")
                floor = measure_floor(hosts, 2, args.beats_per_second, args.floor_rounds)
                results[-1]["fanout_floor_p99_s"] = floor["receive_p99_s"]
                results[-1]["fanout_floor_write_s"] = floor["write_all_s_p50"]
    columns = [
        ("hosts", "hosts"), ("heartbeat_interval_s", "beat s"), ("ingest_per_s", "beats/s"),
        ("cpu_cores", "coord cores"), ("relay_cpu_cores", "relay cores"), ("redis_mb", "redis MiB"), ("crash_detect_p99_s", "crash p99"),
        ("silent_detect_p99_s", "silent p99"), ("fanout_p99_s", "fan-out p99"), ("fanout_floor_p99_s", "gRPC floor"), ("false_positives", "false +"),
        ("epochs_for_correlated_failure", "epochs (10%)"), ("correlated_failure_to_live_s", "10% to live"),
    ]  # fmt: skip
    print("  ".join(f"{title:>12}" for _, title in columns))
    for r in results:
        print(
            "  ".join(
                f"{v:>12.3f}" if isinstance(v, float) else f"{v:>12}"
                for v in (r.get(key, float("nan")) for key, _ in columns)
            )
        )
    for hosts, why in failed.items():
        print(f"{hosts:>12}  FAILED: {why}")
    # The keys always, null when no size completed.
    required = (
        "hosts", "crash_detect_p99_s", "silent_detect_p99_s", "fanout_p99_s", "false_positives",
        "coordinator_cpu_cores", "epochs_for_correlated_failure",
    )  # fmt: skip
    last: dict[str, Any] = dict.fromkeys(required)
    if results:
        # NaN (nothing measured of that kind, e.g. --silent 0) is null: not every JSON reader takes NaN.
        last = {
            k: (None if math.isnan(v) else round(v, 3)) if isinstance(v, float) else v
            for k, v in results[-1].items()
        }
        last["coordinator_cpu_cores"] = last.pop("cpu_cores")
    last["sizes"] = [r["hosts"] for r in results]
    last["ack_delay_s"] = args.ack_delay
    last["acks"] = args.acks
    last["relays"] = args.relays
    last["failed_sizes"] = {str(h): why for h, why in failed.items()}
    # Every figure on the line before; the last line carries exactly the keys issue #13 names.
    print("all figures: " + json.dumps(last))
    print(json.dumps({key: last.get(key) for key in required}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

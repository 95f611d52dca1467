"""Prometheus metrics of one agent and of the trainer it supervises, on a registry of its own.

One endpoint per host: the trainer sends its running totals with its progress reports (the local
API) and the agent publishes them here, so a host is one scrape target whatever its trainer does
(restarts, a warm standby beside it). Counters run on across trainer restarts: a new trainer's
totals start at zero and are added to what the earlier ones reported.

Every series carries ``host`` and ``job_id`` labels, the ones operators filter a fleet by (``job``
is the scrape job's, which Prometheus sets itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from remesh.v1 import agent_pb2 as apb

__all__ = ["TOTALS", "AgentMetrics"]

# Tiers a trainer may name in its metrics' labels: it has a few ("host-shm", "buddy"); the bound keeps
# a confused trainer from growing the registry without end.
_TIERS_LABELLED = 8

# TrainerTotals field -> (metric name, help). Counters: their names end in _total once exposed.
TOTALS: Mapping[str, tuple[str, str]] = {
    "steps": ("remesh_trainer_steps", "Training steps completed and timed (an epoch's first is not)"),
    "step_seconds": ("remesh_trainer_step_seconds", "Wall time of the timed steps"),
    "snapshots": ("remesh_trainer_snapshots", "Host-memory snapshots taken"),
    "snapshot_seconds": (
        "remesh_trainer_snapshot_seconds",
        "Time spent taking snapshots (in the background)",
    ),
    "snapshot_bytes": ("remesh_trainer_snapshot_bytes", "Bytes copied into snapshots"),
    "checkpoints": ("remesh_trainer_checkpoints", "Checkpoint saves finished"),
    "checkpoint_bytes": ("remesh_trainer_checkpoint_bytes", "Bytes this host wrote into checkpoints"),
    "checkpoint_save_seconds": (
        "remesh_trainer_checkpoint_save_seconds",
        "Time spent saving checkpoints (in the background)",
    ),
    "checkpoint_wait_seconds": (
        "remesh_trainer_checkpoint_wait_seconds",
        "Time the training loop waited for a checkpoint save to finish",
    ),
    "peer_failures": (
        "remesh_trainer_peer_failures",
        "Epochs the trainer left because a peer failed (a collective timed out or broke)",
    ),
}


class AgentMetrics:
    def __init__(self, host: str, job: str) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"host": host, "job_id": job}
        names = ["host", "job_id"]
        r = self.registry
        self.trainer_starts = Counter(
            "remesh_agent_trainer_starts",
            "Trainer processes started (role: active, or standby kept warm)",
            [*names, "role"],
            registry=r,
        )
        self.trainer_exits = Counter(
            "remesh_agent_trainer_exits",
            "Trainer processes that ended, by cause (completed, error, signal, hung, stopped)",
            [*names, "cause"],
            registry=r,
        )
        self.topologies = Counter(
            "remesh_agent_topologies",
            "Topologies received on the heartbeat stream, by how they were sent (whole, or as a delta "
            "from the one before)",
            [*names, "sent_as"],
            registry=r,
        )
        # Families with only the host and job labels are used through their one child.
        labels = self._labels
        self.registrations = Counter(
            "remesh_agent_registrations", "Times the agent registered with a coordinator", names, registry=r
        ).labels(**labels)
        self.connected = Gauge(
            "remesh_agent_connected",
            "1 while the agent is registered and its heartbeat stream is open",
            names,
            registry=r,
        ).labels(**labels)
        self.epoch = Gauge(
            "remesh_agent_epoch", "Newest topology epoch the agent knows", names, registry=r
        ).labels(**labels)
        self.rank = Gauge(
            "remesh_agent_rank", "This host's rank in that epoch (-1: none)", names, registry=r
        ).labels(**labels)
        self.rank.set(-1)
        self.standby_ready = Gauge(
            "remesh_agent_standby_ready", "1 while a warm standby trainer is running", names, registry=r
        ).labels(**labels)
        self.cut_off_seconds = Gauge(
            "remesh_agent_cut_off_seconds",
            "How long no coordinator has been reachable (0 while one is); past --lease the trainer is stopped",
            names,
            registry=r,
        ).labels(**labels)
        self.lease_expiries = Counter(
            "remesh_agent_lease_expiries",
            "Times the lease ran out and the agent stopped its ranked trainer (cut off from every coordinator)",
            names,
            registry=r,
        ).labels(**labels)
        self.heartbeat_rtt = Histogram(
            "remesh_agent_heartbeat_rtt_seconds",
            "Round trip of a heartbeat (the coordinator echoes one in each keepalive, less the time it held it)",
            names,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        ).labels(**labels)
        self._call_seconds = Histogram(
            "remesh_agent_coordinator_call_seconds",
            "Round trip of the agent's calls to the coordinator (Register, and the trainer's relayed calls)",
            [*names, "method"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.restores = Counter(
            "remesh_trainer_restores",
            "Epochs the trainer joined, by where its state came from (memory, peer, buddy, local, gcs, "
            "scratch, ...)",
            [*names, "source"],
            registry=r,
        )
        self.restore_seconds = Gauge(
            "remesh_trainer_restore_seconds",
            "Time the trainer took to restore its state when it last joined an epoch",
            names,
            registry=r,
        ).labels(**labels)
        self.restored_bytes = Counter(
            "remesh_trainer_restored_bytes", "Bytes of state restored, by tier", [*names, "tier"], registry=r
        )
        self.totals = {
            field: Counter(name, help_text, names, registry=r).labels(**labels)
            for field, (name, help_text) in TOTALS.items()
        }
        self._snapshot_failures = Counter(
            "remesh_trainer_snapshot_failures",
            "Snapshots that could not be kept where they were meant to be, by tier (host-shm, buddy): "
            "each was kept in the trainer process only",
            [*names, "tier"],
            registry=r,
        )
        self._tier_missing = Gauge(
            "remesh_trainer_tier_missing",
            "1 for each tier the running trainer says cannot keep its snapshots (they are kept in its "
            "process only, and a trainer restarted on this host finds none)",
            [*names, "tier"],
            registry=r,
        )
        # Gauges, not totals: what the running trainer says now.
        self.snapshot_every = Gauge(
            "remesh_trainer_snapshot_every",
            "Steps between host-memory snapshots the trainer's cadence asks for (0: none yet)",
            names,
            registry=r,
        ).labels(**labels)
        self.snapshot_every_kept = Gauge(
            "remesh_trainer_snapshot_every_kept",
            "Steps between the trainer's last two snapshots kept: more than asked where a snapshot "
            "takes longer than the steps between them (the ones due meanwhile are skipped)",
            names,
            registry=r,
        ).labels(**labels)
        self._tiers: set[str] = set()  # the tier labels in use
        self._reported: dict[str, float] = {}  # the current trainer's totals as last reported

    def call(self, method: str, seconds: float) -> None:
        self._call_seconds.labels(**self._labels, method=method).observe(seconds)

    def trainer_started(self, role: str) -> None:
        self.trainer_starts.labels(**self._labels, role=role).inc()

    def topology_received(self, sent_as: str) -> None:
        self.topologies.labels(**self._labels, sent_as=sent_as).inc()

    def trainer_exited(self, cause: str, active: bool) -> None:
        self.trainer_exits.labels(**self._labels, cause=cause).inc()
        if active:
            self._reported = {}  # the next trainer counts from zero again
            self.tiers_missing(())  # and says for itself which tiers cannot keep its snapshots

    def trainer_totals(self, totals: apb.TrainerTotals) -> None:
        """Add what the trainer did since its last report (its totals run from its own start)."""
        for field, counter in self.totals.items():
            value = float(getattr(totals, field))
            before = self._reported.get(field, 0.0)
            if value < before:  # a trainer process we did not see exit: its totals restarted
                before = 0.0
            if value > before:
                counter.inc(value - before)
            self._reported[field] = value
        self.snapshot_every.set(totals.snapshot_every)
        self.snapshot_every_kept.set(totals.snapshot_every_kept)
        for tier, count in totals.snapshot_failures.items():
            if not self._labelled(tier):
                continue
            key = f"snapshot_failures/{tier}"
            before = self._reported.get(key, 0.0)
            if count < before:  # as above
                before = 0.0
            if count > before:
                self._snapshot_failures.labels(**self._labels, tier=tier).inc(count - before)
            self._reported[key] = float(count)

    def tiers_missing(self, missing: Iterable[str]) -> None:
        """The tiers the running trainer says cannot keep its snapshots (every other one can)."""
        said = {tier for tier in missing if self._labelled(tier)}
        for tier in self._tiers:
            self._tier_missing.labels(**self._labels, tier=tier).set(1.0 if tier in said else 0.0)

    def _labelled(self, tier: str) -> bool:
        """Whether ``tier`` has (or now gets) a label: a bounded number of them."""
        if tier not in self._tiers and len(self._tiers) < _TIERS_LABELLED:
            self._tiers.add(tier)
        return tier in self._tiers

    def restored(self, source: str, seconds: float | None, tiers: Mapping[str, int]) -> None:
        self.restores.labels(**self._labels, source=source or "unknown").inc()
        if seconds is not None:
            self.restore_seconds.set(seconds)
        for tier, nbytes in tiers.items():
            if nbytes > 0:
                self.restored_bytes.labels(**self._labels, tier=tier).inc(nbytes)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on ``port`` (0: a free one) in a thread; returns the port bound."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)

"""Prometheus metrics of one coordinator, on a registry of its own (several can run in one process)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from remesh.coordinator.model import MemberState

if TYPE_CHECKING:
    from remesh.coordinator.goodput import Goodput

__all__ = ["Metrics", "Refusals", "RelayMetrics"]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.members = Gauge("remesh_members", "Members by state", ["state"], registry=self.registry)
        self.epoch = Gauge("remesh_epoch", "Current topology epoch", registry=self.registry)
        self.epoch_info = Gauge(
            "remesh_epoch_info",
            "The current epoch, labelled with its number and why it exists; the value is when it was "
            "published (Unix time, ms), for dashboards' annotations (one series: the current epoch's)",
            ["epoch", "reason"],
            registry=self.registry,
        )
        self._epoch_labels: tuple[str, str] | None = None
        self.world_size = Gauge(
            "remesh_world_size", "Members in the current topology", registry=self.registry
        )
        self.detection = Histogram(
            "remesh_detection_latency_seconds",
            "From the first failure signal (stream break, last heartbeat, fault report) to the member declared dead",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.epoch_live = Histogram(
            "remesh_epoch_live_seconds",
            "From a topology's publication to every member running it (re-meshed, restored, first step done)",
            buckets=(0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0),
            registry=self.registry,
        )
        self.delivery = Histogram(
            "remesh_topology_delivery_seconds",
            "From a topology's publication to its write on the heartbeat stream of an agent still sending (one per stream)",
            buckets=(
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1.0,
                1.5,
                2.0,
                2.5,
                3.0,
                4.0,
                5.0,
                7.5,
                10.0,
                15.0,
                30.0,
            ),
            registry=self.registry,
        )
        self.goodput = Gauge(
            "remesh_goodput_ratio",
            "Productive time over wall time since the job's first event (remesh.coordinator.goodput)",
            registry=self.registry,
        )
        self.productive = Gauge(
            "remesh_productive_seconds", "Time spent on training steps the job kept", registry=self.registry
        )
        self.badput = Gauge(
            "remesh_badput_seconds",
            "Time not spent on kept steps, by category (initialization, recovery, checkpoint_restore, "
            "wasted_progress, other)",
            ["category"],
            registry=self.registry,
        )
        self.goodput_at = Gauge(
            "remesh_goodput_computed_at_seconds",
            "When the goodput figures were computed (Unix time): `remesh goodput --from-log` of the event log, "
            "with --now this and --step remesh_goodput_step, gives the same figures",
            registry=self.registry,
        )
        self.goodput_step = Gauge(
            "remesh_goodput_step",
            "The furthest step of the current epoch the goodput figures used (-1: none reported)",
            registry=self.registry,
        )
        self.heartbeats = Counter("remesh_heartbeats", "Heartbeats received", registry=self.registry)
        self.epochs_published = Counter(
            "remesh_epochs_published", "Topology epochs published", registry=self.registry
        )
        self.events = Counter("remesh_events", "Events appended to the log", ["type"], registry=self.registry)
        self.collective_failures = Counter(
            "remesh_collective_failures",
            "Members that said a collective of the running epoch failed (each member once per epoch)",
            registry=self.registry,
        )
        self.leader = Gauge(
            "remesh_leader", "1 while this replica leads the job, 0 while it follows", registry=self.registry
        )
        self.leader.set(1)  # a single replica always leads
        self.fencing_token = Gauge(
            "remesh_fencing_token",
            "Fencing token of this replica's lease (0: never led)",
            registry=self.registry,
        )
        self.role_changes = Counter(
            "remesh_role_changes", "Times this replica became leader or stepped down", registry=self.registry
        )
        self.store_errors = Counter(
            "remesh_store_errors", "Redis operations that failed (store unreachable)", registry=self.registry
        )

        self.refusals = _refusals(self.registry)

    def set_epoch(self, epoch: int, reason: str, created_at: float) -> None:
        labels = (str(epoch), reason[:200])  # a reason lists every host lost: bounded for a label
        if labels == self._epoch_labels:
            return
        if self._epoch_labels is not None:
            self.epoch_info.remove(*self._epoch_labels)
        self.epoch_info.labels(*labels).set(round(created_at * 1000))
        self._epoch_labels = labels

    def set_members(self, counts: Mapping[MemberState, int]) -> None:
        for state in MemberState:
            self.members.labels(state=state.value).set(counts.get(state, 0))

    def set_goodput(self, report: Goodput, step: int | None) -> None:
        self.goodput_at.set(report.now)
        self.goodput_step.set(-1 if step is None else step)
        self.goodput.set(report.goodput)
        self.productive.set(report.productive_s)
        for category, seconds in report.badput_s.items():
            if seconds is not None:  # checkpoint save is not known to the coordinator
                self.badput.labels(category=category).set(seconds)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on ``port`` (0: a free one) in a thread; returns the port bound."""
        return _serve(self.registry, port, addr)


class Refusals(Protocol):
    """What the access policy counts its refusals in (``Authorizer``): a coordinator's or a relay's."""

    refusals: Counter


def _refusals(registry: CollectorRegistry) -> Counter:
    return Counter(
        "remesh_refused_calls",
        "Calls refused by the access policy (kind: unauthenticated or permission_denied)",
        ["method", "kind"],
        registry=registry,
    )


def _serve(registry: CollectorRegistry, port: int, addr: str) -> int:
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return int(server.server_port)


class RelayMetrics:
    """Prometheus metrics of one topology relay (``remesh relay``), on a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.refusals = _refusals(self.registry)
        self.followers = Gauge(
            "remesh_relay_followers", "Hosts' streams this relay serves now", registry=self.registry
        )
        self.epoch = Gauge(
            "remesh_relay_epoch",
            "The newest epoch this relay got from the coordinator (-1: it follows no coordinator now)",
            registry=self.registry,
        )
        self.epoch.set(-1)
        self.losses = Counter(
            "remesh_relay_coordinator_losses",
            "Times this relay lost the coordinator it followed (its followers went back to their "
            "heartbeat streams)",
            registry=self.registry,
        )

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on ``port`` (0: a free one) in a thread; returns the port bound."""
        return _serve(self.registry, port, addr)

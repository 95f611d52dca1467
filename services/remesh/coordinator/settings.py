"""The coordinator's settings: one immutable object, with named presets.

Environment variables and flags are read only by the command line (``remesh coordinator``), which
builds one of these; nothing below it reads the environment. Each settings object checks its own
invariants when it is made (``__post_init__``, for ``replace`` too), and raises ``InvalidSettings``
saying which fields contradict each other: settings built in code get the same checks as the
command line, which turns the error into its usage error.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

__all__ = ["DetectorSettings", "HaSettings", "InvalidSettings", "PlannerSettings", "Settings"]


class InvalidSettings(ValueError):
    """Settings that contradict themselves or make no sense: ``title`` says what in a few words,
    the message how, and ``fields`` which fields (the command line names the flags that set them)."""

    def __init__(self, title: str, message: str, *fields: str) -> None:
        super().__init__(message)
        self.title = title
        self.fields = fields


def _require(holds: bool, title: str, message: str, *fields: str) -> None:
    if not holds:
        raise InvalidSettings(title, message, *fields)


@dataclass(frozen=True)
class DetectorSettings:
    # Agents send a heartbeat this often; the detector ticks at a quarter of it.
    heartbeat_interval_s: float = 0.1
    # Three missed heartbeats make a member suspect (shown to operators; nothing is replaced yet).
    suspect_after_s: float = 0.3
    # Six missed heartbeats make it dead: long enough that a loaded 2-core machine never trips it
    # (benchmarks/detection.py counts false declarations), short enough for sub-second detection.
    heartbeat_timeout_s: float = 0.6
    # A broken heartbeat stream is a strong signal (the agent's process died and its socket closed),
    # but a flaky link breaks streams too: give the agent this long to reconnect first.
    stream_grace_s: float = 0.1
    # Judge by heartbeats alone, ignoring stream breaks (for networks whose proxies cut idle streams,
    # and as the heartbeat-timeout-only baseline in benchmarks/detection.py).
    stream_break_signal: bool = True
    # After a coordinator start or a store outage every member gets this long before anyone is
    # judged, so a coordinator failover never evicts healthy hosts.
    failover_grace_s: float = 3.0
    # Every other member reported its trainer blocked in a step for this long (after the trainers'
    # own threshold, half their 2 s collective timeout): the one that did not report is frozen. A
    # healthy step takes tens of milliseconds here, so a member one second behind its peers in the
    # same step is not lagging but stopped.
    stall_verdict_s: float = 1.0

    def __post_init__(self) -> None:
        title = "invalid heartbeat timings"
        _require(
            self.heartbeat_interval_s > 0,
            title,
            f"heartbeat_interval_s is {self.heartbeat_interval_s}: agents beat at a positive interval",
            "heartbeat_interval_s",
        )
        _require(
            0 < self.suspect_after_s <= self.heartbeat_timeout_s,
            title,
            f"suspect_after_s ({self.suspect_after_s}) must be positive and at most heartbeat_timeout_s "
            f"({self.heartbeat_timeout_s}): a silent member is suspected before it is declared dead",
            "suspect_after_s",
            "heartbeat_timeout_s",
        )
        _require(
            self.heartbeat_timeout_s > self.heartbeat_interval_s,
            title,
            f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_interval_s "
            f"({self.heartbeat_interval_s}), or every host is declared dead between two of its heartbeats",
            "heartbeat_timeout_s",
            "heartbeat_interval_s",
        )
        _require(
            min(self.stream_grace_s, self.failover_grace_s, self.stall_verdict_s) >= 0,
            title,
            "stream_grace_s, failover_grace_s and stall_verdict_s are durations: none may be negative",
            "stream_grace_s",
            "failover_grace_s",
            "stall_verdict_s",
        )

    @property
    def tick_s(self) -> float:
        """How often the detector looks: at most every 25 ms, whatever the heartbeat interval. A look
        costs only the members whose deadline came up (remesh.coordinator.liveness), so a broken
        stream is judged within its grace plus 25 ms at any fleet size."""
        return min(self.heartbeat_interval_s / 4, 0.025)

    def for_fleet(self, hosts: int, beats_per_second: float) -> DetectorSettings:
        """These timings stretched so that ``hosts`` agents send about ``beats_per_second``
        heartbeats in all: the interval grows with the fleet, and suspicion and the timeout keep
        their ratio to it (silent hosts are found later; crashed ones, by their broken streams, as
        fast as ever). Never shorter than these."""
        _require(
            beats_per_second > 0 and hosts >= 0,
            "invalid heartbeat budget",
            f"a fleet of {hosts} hosts and a budget of {beats_per_second} heartbeats a second: the "
            "budget must be positive and the fleet at least 0",
            "beats_per_second",
            "hosts",
        )
        interval = hosts / beats_per_second
        if interval <= self.heartbeat_interval_s:
            return self
        scale = interval / self.heartbeat_interval_s
        return replace(
            self,
            heartbeat_interval_s=round(interval, 3),
            suspect_after_s=round(self.suspect_after_s * scale, 3),
            heartbeat_timeout_s=round(self.heartbeat_timeout_s * scale, 3),
        )


@dataclass(frozen=True)
class PlannerSettings:
    # The world size the job forms at and grows back to.
    world_size: int = 4
    # Never shrink below this many hosts; wait instead.
    min_world_size: int = 1
    # When non-zero, a world size must divide this number (e.g. the global batch size).
    world_size_must_divide: int = 0
    # How long to wait for a replacement below the minimum before halting.
    max_wait_s: float = 30.0
    # The JAX coordination service of epoch E listens on rank 0 at a port in [base, base + span):
    # a new port per epoch, because a re-initialised JAX runtime cannot reuse the old service's port
    # at once; offset by a hash of the job id, so jobs sharing a host rarely meet on one port. The
    # range lies below Linux's ephemeral ports (32768-60999), which outgoing connections take.
    jax_port_base: int = 28000
    jax_port_span: int = 1000
    # Members lost while others of the topology are suspect: wait this long at most (from the first
    # loss) for the suspects' verdicts, so a correlated failure is planned as one epoch. A suspect is
    # judged within heartbeat_timeout_s - suspect_after_s of silence (0.3 s here) or stream_grace_s
    # after its stream broke (0.1 s); the rest is margin for a busy coordinator. Costs nothing when
    # nobody else is suspect.
    suspect_hold_s: float = 0.5
    # Every loss is held this long before the plan, for the rest of a burst: hosts killed together
    # are seen apart by up to ~0.15 s on a loaded 2-core machine (each death arrives over its own
    # connection; the soak split 2 of 12 two-host bursts with no window). Costs every recovery this.
    burst_window_s: float = 0.15
    # A burst still growing (each loss or suspicion within burst_window_s of the one before) is held
    # until it stops, up to this long from its first loss. Thousands of hosts lost together reach the
    # coordinator over seconds (450 of 5000 made two epochs with a fixed hold); a lone failure still
    # waits only burst_window_s.
    burst_max_s: float = 5.0
    # Members said a collective of their epoch failed, yet none of them is lost: the same members form
    # a new epoch at once when every member said so, else after this long without a loss. A member
    # that stopped says nothing and is judged within the detector's heartbeat_timeout_s (silent host)
    # or stall_verdict_s (hung trainer): this must exceed both (0.6 s and 1.0 s here), or the epoch is
    # formed again around a member about to be declared dead (one recovery more). It also exceeds
    # the trainers' 2 s collective timeout on CPU: peers still blocked in the failed collective say
    # so themselves first, and leave it in-process, instead of being overtaken by the new epoch
    # (a step still blocked 0.2 s after a new epoch ends its process for the warm standby).
    reform_after_s: float = 3.0
    # Re-forms in a row whose epochs completed no step (a collective fails among the same hosts every
    # time: a link that stays broken) before the job halts with the reason, instead of forming the
    # same hosts again forever; each takes seconds (3.6 s measured on CPU).
    max_futile_reforms: int = 5
    # Recoveries granted in a row to the same trainer error when none of them completed a step (a
    # bug in the training script fails on every host it moves to): the next such failure halts the
    # job with the error, so a job burns at most this many spares on one bug.
    max_repeated_crashes: int = 2

    def __post_init__(self) -> None:
        _require(
            self.world_size >= 1 and self.min_world_size <= self.world_size,
            "invalid sizes",
            f"world_size ({self.world_size}) must be at least 1 and at least min_world_size "
            f"({self.min_world_size})",
            "world_size",
            "min_world_size",
        )
        _require(
            self.world_size_must_divide >= 0,
            "invalid sizes",
            f"world_size_must_divide is {self.world_size_must_divide}: 0 (none), or the number every "
            "world size must divide",
            "world_size_must_divide",
        )
        base, span = self.jax_port_base, self.jax_port_span
        _require(
            span >= 1 and 1024 <= base <= 65536 - span,
            "invalid JAX port range",
            f"the range [jax_port_base, jax_port_base + jax_port_span) = [{base}, {base + span}) must "
            "hold a port and lie within 1024-65535",
            "jax_port_base",
            "jax_port_span",
        )
        waits = ("max_wait_s", "suspect_hold_s", "burst_window_s", "burst_max_s", "reform_after_s")
        _require(
            min(getattr(self, name) for name in waits) >= 0
            and min(self.max_futile_reforms, self.max_repeated_crashes) >= 0,
            "invalid planner timings",
            f"{', '.join(waits)} are durations, max_futile_reforms and max_repeated_crashes counts: "
            "none may be negative",
            *waits,
            "max_futile_reforms",
            "max_repeated_crashes",
        )

    def covering(self, detector: DetectorSettings) -> PlannerSettings:
        """These settings with their holds stretched over ``detector``'s verdicts, never shortened: a
        suspect's verdict comes within the silence between suspect and dead, so losses are held that
        long (plus a margin) to be planned together; and re-forming after a failed collective waits
        out the verdicts on a stopped member (a silent host, a hung trainer), or the epoch would be
        formed again around a member about to be declared dead."""
        return replace(
            self,
            suspect_hold_s=max(
                self.suspect_hold_s, detector.heartbeat_timeout_s - detector.suspect_after_s + 0.2
            ),
            reform_after_s=max(
                self.reform_after_s, max(detector.heartbeat_timeout_s, detector.stall_verdict_s) + 0.4
            ),
        )

    def jax_port(self, job_id: str, epoch: int) -> int:
        return self.jax_port_base + (zlib.crc32(job_id.encode()) + epoch) % self.jax_port_span

    def is_valid_size(self, n: int) -> bool:
        if n < max(1, self.min_world_size) or n > self.world_size:
            return False
        return not (self.world_size_must_divide and self.world_size_must_divide % n)

    def largest_valid_size(self, available: int) -> int:
        """Largest valid world size using at most ``available`` hosts, or 0 when there is none."""
        for n in range(min(available, self.world_size), 0, -1):
            if self.is_valid_size(n):
                return n
        return 0


@dataclass(frozen=True)
class HaSettings:
    # Several replicas share one Redis and elect a leader through a lease; off: this coordinator is
    # the only one and writes unfenced (no other writer exists to fence out).
    enabled: bool = False
    # Where agents reach this replica (host:port), stored next to the lease so followers can name
    # the leader. Empty: the address it listens on.
    advertise: str = ""
    # A dead leader's lease runs out after this long; a follower then takes over. Long enough that
    # a busy 2-core machine renews in time (at a third of it), short enough to fail over in ~1.5 s.
    lease_ttl_s: float = 1.2
    # The leader sends an empty message on every idle heartbeat stream this often, so an agent
    # notices a leader that stopped answering (SIGSTOP, partition) and looks for the new one.
    keepalive_s: float = 0.5

    def __post_init__(self) -> None:
        _require(
            self.lease_ttl_s > 0 and self.keepalive_s > 0,
            "invalid lease",
            f"lease_ttl_s ({self.lease_ttl_s}) and keepalive_s ({self.keepalive_s}) must be positive",
            "lease_ttl_s",
            "keepalive_s",
        )

    @property
    def renew_every_s(self) -> float:
        return self.lease_ttl_s / 3


@dataclass(frozen=True)
class Settings:
    job_id: str = "default"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # ACL user, password and TLS CA bundle for Redis (see remesh.coordinator.redis_connection).
    redis_username: str | None = None
    redis_password: str | None = None
    redis_ca_file: str | None = None
    # gRPC listen address; port 0 picks a free port (the server reports the one it bound);
    # unix:/path serves on a Unix socket, with no TCP port at all.
    listen: str = "127.0.0.1:50051"
    # Prometheus /metrics on this port; None turns it off, 0 picks a free port.
    metrics_port: int | None = None
    # The gRPC health service alone, in plaintext, on this port (for probes that cannot do mutual
    # TLS, like the kubelet's); None turns it off, 0 picks a free port.
    health_port: int | None = None
    # Longest accepted host id: ids end up in Redis keys, logs and metrics labels.
    max_id_length: int = 128
    # Bounded state. At most this many members (a newcomer makes room by forgetting the oldest dead
    # or left member; with none, it is refused): well above any job's hosts plus spares.
    max_members: int = 4096
    # A dead or left member is forgotten this long after it went (its history stays in the log).
    member_retention_s: float = 3600.0
    # Once the event log is longer than this, it is cut behind an event that holds the whole state:
    # ~1 KiB an event, so about 100 MiB of Redis at most, and a replay that reads a bounded log.
    max_events: int = 100_000
    detector: DetectorSettings = field(default_factory=DetectorSettings)
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    ha: HaSettings = field(default_factory=HaSettings)

    def __post_init__(self) -> None:
        _require(
            self.max_members >= 1 and self.max_events >= 10 and self.member_retention_s >= 0,
            "invalid limits",
            f"max_members ({self.max_members}) must be at least 1, max_events ({self.max_events}) at "
            f"least 10 and member_retention_s ({self.member_retention_s}) at least 0",
            "max_members",
            "max_events",
            "member_retention_s",
        )
        _require(
            self.max_id_length >= 1,
            "invalid limits",
            f"max_id_length is {self.max_id_length}: a host id has at least one character",
            "max_id_length",
        )

    @property
    def stream_keepalive_s(self) -> float:
        """How often an idle heartbeat stream gets a keepalive: ``ha.keepalive_s``, or the heartbeat
        interval once a large fleet stretched it longer. Keepalives at a fixed 0.5 s would be two
        messages a second on every stream: at 2000 hosts (heartbeats every 2 s), four times the
        heartbeats themselves."""
        return max(self.ha.keepalive_s, self.detector.heartbeat_interval_s)

    @classmethod
    def local(cls, **overrides: object) -> Settings:
        """One machine, loopback: sub-second detection."""
        return cls(**overrides)  # type: ignore[arg-type]

    @classmethod
    def production(cls, **overrides: object) -> Settings:
        """A real cluster: slower heartbeats, a longer timeout that rides out GC pauses and packet loss."""
        detector = DetectorSettings(
            heartbeat_interval_s=1.0,
            suspect_after_s=3.0,
            heartbeat_timeout_s=10.0,
            stream_grace_s=2.0,
            failover_grace_s=15.0,
            stall_verdict_s=30.0,
        )
        # Redis across a network: a lease that rides out a slow round trip, keepalives every second.
        ha = HaSettings(lease_ttl_s=3.0, keepalive_s=1.0)
        # Suspect to dead takes 7 s of silence here (10 - 3); a rack failure is still one epoch.
        # Re-forming after a failed collective waits out the 30 s stall verdict (a hung trainer).
        planner = PlannerSettings(suspect_hold_s=8.0, burst_window_s=1.0, reform_after_s=35.0)
        base: dict[str, object] = {
            "listen": "0.0.0.0:50051",
            "metrics_port": 9090,
            "detector": detector,
            "planner": planner,
            "ha": ha,
        }
        return cls(**{**base, **overrides})  # type: ignore[arg-type]

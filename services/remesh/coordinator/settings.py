"""The coordinator's settings: one immutable object, with named presets.

Environment variables and flags are read only by the command line (``remesh coordinator``), which
builds one of these; nothing below it reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DetectorSettings", "PlannerSettings", "Settings"]


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

    @property
    def tick_s(self) -> float:
        return self.heartbeat_interval_s / 4


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
    # The JAX coordination service of epoch E listens on rank 0 at base + E % span: a new port per
    # epoch, because a re-initialised JAX runtime cannot reuse the old service's port at once.
    jax_port_base: int = 47000
    jax_port_span: int = 1000

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
class Settings:
    job_id: str = "default"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # gRPC listen address; port 0 picks a free port (the server reports the one it bound).
    listen: str = "127.0.0.1:50051"
    # Prometheus /metrics on this port; None turns it off, 0 picks a free port.
    metrics_port: int | None = None
    # Longest accepted host id: ids end up in Redis keys, logs and metrics labels.
    max_id_length: int = 128
    detector: DetectorSettings = field(default_factory=DetectorSettings)
    planner: PlannerSettings = field(default_factory=PlannerSettings)

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
        )
        base: dict[str, object] = {"listen": "0.0.0.0:50051", "metrics_port": 9090, "detector": detector}
        return cls(**{**base, **overrides})  # type: ignore[arg-type]

"""The agent's settings: one immutable object built by ``remesh agent`` from its flags."""

from __future__ import annotations

from dataclasses import dataclass

from remesh.v1.security import Tls

__all__ = ["AgentSettings"]


@dataclass(frozen=True)
class AgentSettings:
    # Coordinator addresses (host:port, or unix:/path for a Unix socket); the agent tries them in turn
    # until one answers.
    coordinators: tuple[str, ...]
    host_id: str
    trainer_command: tuple[str, ...]
    spare: bool = False
    device_count: int = 1
    # Address peers reach this host at (the JAX coordination service runs here when it is rank 0).
    address: str = "127.0.0.1"
    job_id: str = "default"
    # Local API for the trainer (its address passed in the trainer's environment): "" is a Unix
    # socket in a directory only this user may enter; host:port binds TCP (port 0: a free one);
    # unix:/path a Unix socket there.
    local_listen: str = ""
    # Prometheus /metrics of the agent and its trainer on this port (None: off; 0: a free one), bound
    # to ``metrics_address`` (0.0.0.0 in a pod, for the scraper).
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"
    # The agent logs JSON lines (--log-json): its trainers are told to as well (REMESH_LOG_FORMAT).
    log_json: bool = False
    # This host's certificate, key and the job's CA (mutual TLS to the coordinator); None: plain
    # gRPC, for local experiments (``remesh agent --insecure``).
    tls: Tls | None = None
    # A trainer that reports no step for this long is hung: killed and reported. 0 turns it off.
    hang_timeout_s: float = 120.0
    # The same before a trainer's first step of an epoch (counted from its start or the epoch's): JAX
    # start-up, the restore and the compile of a large model take minutes, on a loaded host more.
    startup_timeout_s: float = 600.0
    # Reconnect backoff: doubling from the first to the cap, with jitter, so a restarted coordinator
    # is not hit by every agent at once, yet is found again within a second.
    reconnect_initial_s: float = 0.05
    reconnect_max_s: float = 1.0
    # A coordinator that sends nothing on the heartbeat stream for this long (it sends a keepalive
    # every 0.5 s) is taken for lost, as if the stream broke; also the deadline of a registration.
    # Below the 3 s a new leader grants every member, so agents of a stopped leader move in time.
    coordinator_silence_s: float = 2.0
    # A registration that runs out of its deadline (at first ``coordinator_silence_s``) is sent again
    # with twice as long, up to this: a fleet of thousands registering at once queues at its
    # coordinator (benchmarks/scale.py), and a fixed short deadline would give up on every answer.
    register_timeout_max_s: float = 30.0
    # A follower coordinator that knows no leader yet is asked again after this long: an election
    # takes a lease TTL, and a follower answers without touching Redis.
    leader_retry_s: float = 0.1
    # Keep a second trainer process warm (started, imports done, waiting for a rank) to replace the
    # active one at once when a peer's death aborts it. Costs one idle process per host.
    warm_standby: bool = True
    # A trainer that aborted (SIGABRT, JAX's reaction to a peer's death) is reported this much later,
    # so the peer's own failure reaches the coordinator first (see Agent._watch_trainer).
    abort_report_delay_s: float = 0.5
    # A running trainer that used no CPU time for this long is reported idle in heartbeats
    # (TRAINER_STATUS_HUNG): stopped or deadlocked, unless its own stall report says it waits for a
    # peer. A trainer that computes, however starved, uses some CPU every heartbeat period.
    idle_after_s: float = 1.0
    # How long a trainer told to stop gets before SIGKILL.
    stop_grace_s: float = 5.0
    # After the job finished, how long the ranked trainer may take to leave the JAX runtime and
    # write its outputs before it is stopped (the agent then exits 0 either way).
    finish_grace_s: float = 60.0
    # An agent that has had no stream to any coordinator for this long assumes it was cut off and
    # declared dead (its rank given to another host): it stops its ranked trainer, which must not
    # train or write for an epoch it no longer belongs to, and rejoins as a spare when the link
    # returns. None: derived from the heartbeat timeout the coordinator sends (``core.lease_s``:
    # as long as the coordinator waits before declaring a silent host dead, at least 5 s, longer
    # than a coordinator restart takes). 0 turns it off.
    lease_s: float | None = None
    # Niceness added to the trainer process. The agent's heartbeats decide whether the host is
    # alive: where the trainer saturates the CPU (JAX starting or compiling, snapshot copies on a
    # small host), they must not wait behind it. 10 gives the agent about nine times the trainer's
    # share when both want a core (5 gave three, and a 2-core machine running three trainers with
    # their warm standbys still starved an agent past the 0.6 s timeout). On Linux the trainer runs
    # in a session of its own and the session gets this niceness: CPU time is shared between
    # sessions before niceness counts (see remesh.agent.supervisor). Costs the trainer nothing while
    # a core is free. 0 leaves it as is.
    trainer_nice: int = 10
    # The session niceness of a trainer process that holds no rank: a spare's trainer waiting for
    # one, and the warm standby beside an active trainer. Each imports JAX (seconds of CPU) and then
    # waits; on a host whose cores the working trainers need (the job starting or recovering, a
    # healthy step) that import takes its CPU only where they leave it. Given a rank, the process's
    # session gets trainer_nice back at once (a session's niceness may go down to 0 again without
    # privileges, unlike a process's). Equal to trainer_nice, or 0, turns it off.
    standby_nice: int = 19
    # HTTP/2 keepalive pings on the coordinator channel: a link that silently drops packets breaks
    # the stream after about twice this, instead of after TCP's minutes.
    keepalive_s: float = 0.5
    # A relay (``remesh relay``, host:port) to take topologies from instead of the heartbeat stream:
    # at thousands of hosts the coordinator then writes each epoch to a few relays. "": none.
    # Heartbeats, acknowledgements and commands stay on the heartbeat stream either way.
    relay: str = ""
    # A relay stream silent this long (it sends an empty message every --keepalive, 5 s by default)
    # is taken for lost: the topologies come from the coordinator again. A relay's host that is gone
    # is noticed sooner, by keepalive pings every ``relay_ping_s`` on the relay's channel (slower than
    # the coordinator's: a relay may serve thousands of hosts, and a lost relay costs no liveness).
    relay_silence_s: float = 20.0
    relay_ping_s: float = 5.0

"""A chaos soak: a seeded fault injector over a running elastic job, and the invariants it must keep.

``benchmarks/soak.py`` runs it for minutes; ``tests/test_soak.py`` runs a CI-sized one. Both judge a
run with the same pure checks (``check_*``, over the event log, the faults injected and the
checkpoint markers found), so a finding of one is a finding of the other. It is a harness, not part
of remesh: it lives with the benchmarks (outside the wheel, checked by mypy with them), and the tests
import it from here as they import ``benchmarks.fleet``::

    Soak(settings).run()
      SoakJob.start()   Redis (AOF, fsync always), coordinator replicas (--ha), hosts + spares: each an
                        agent behind its own CONNECT proxy (benchmarks/connect_proxy.py), supervising the
                        example trainer (examples/tinylm/train_elastic.py)
      Monitor           a thread that reads the event log from Redis every 0.5 s and re-checks the
                        invariants as events arrive (reported the moment they break)
      loop until duration_s:
        wait until the job is whole (world size, epoch live, a spare up); check replay == stored state
        wait a gap drawn from an exponential law (seeded); inject the next drawn fault and end it
        (SIGCONT, restore, restart); wait for its recovery (an epoch live, or none needed); relaunch
        the hosts it lost as spares, so the job keeps its size
      finish            no more faults; training reaches its last step; every agent must exit 0
      final checks      the whole event log, the stored state, the checkpoint markers

The invariants (each a ``Violation.check`` name):

- ``epochs``: topology epochs strictly increase, no two topology events share one, and no event's
  epoch goes back;
- ``replay``: ``replay(event log)`` equals the state the store holds (``RedisStore.load()``);
- ``false_eviction``: a ``member_dead`` for a host no fault touched within a window before it;
- ``hung_epoch``: a published epoch that neither went live nor was superseded within a bound;
- ``split_burst``: a burst of host kills (50 ms apart, within one detection window) planned as more
  than one epoch before the job went live again;
- ``stale_commit``: a checkpoint marker (``{root}/step_N/COMMITTED``) without a
  ``checkpoint_committed`` event of its step and epoch recorded while that epoch was current;
- ``finish``: the job reached its last step (``job_finished``), nothing was declared dead and no
  epoch was published afterwards, and every agent exited 0 on its own;
- ``hang_not_caught``, ``agent_exit``, ``stuck``: a stopped trainer its agent never killed, an agent
  that exited on its own mid-run, a job that never became whole again after a fault.

The last two checks need the job-completion and commit-arbiter contract (events ``job_finished``
and ``checkpoint_committed``, sent by the trainer through the agent's local API); where this
checkout lacks it they are reported as not available, not as passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import redis

from remesh.coordinator.model import (
    ClusterState,
    Event,
    EventType,
    Member,
    MemberState,
    Role,
    Topology,
    replay,
)
from remesh.coordinator.store import RedisStore
from remesh.embedded.cluster import LocalCluster, Proc, wait_for
from remesh.embedded.gcs_server import FakeGcsServer
from remesh.embedded.redis_server import RedisServer

__all__ = [
    "Fault",
    "FaultKind",
    "Marker",
    "PlannedFault",
    "Soak",
    "SoakJob",
    "SoakReport",
    "SoakSettings",
    "Violation",
    "check_epochs",
    "check_finish",
    "check_replay",
    "contract_available",
    "draw_faults",
    "find_false_evictions",
    "find_hung_epochs",
    "find_split_bursts",
    "find_stale_commits",
]

Progress = Callable[[str], None]

# The proxy in front of each agent, run by its path: it needs nothing on sys.path.
PROXY = Path(__file__).with_name("connect_proxy.py")


class FaultKind(enum.StrEnum):
    HOST_KILL = "host_kill"  # SIGKILL the host's process group: agent, trainer and standby
    HOST_STOP = "host_stop"  # SIGSTOP the host's process group, SIGCONT after a drawn pause
    AGENT_KILL = "agent_kill"  # SIGKILL the agent alone (its trainers follow by PDEATHSIG); restarted
    TRAINER_CRASH = "trainer_crash"  # SIGKILL the ranked trainer alone
    TRAINER_HANG = "trainer_hang"  # SIGSTOP the ranked trainer alone: the agent's hang clock must act
    REDIS_KILL = "redis_kill"  # SIGKILL redis-server; restart it on its port from its AOF after a pause
    LEADER_KILL = "leader_kill"  # SIGKILL the leading coordinator replica; restart it on its port
    NETWORK_CUT = "network_cut"  # cut one agent off from every coordinator; restore after a pause
    BURST = "burst"  # SIGKILL two hosts ~50 ms apart: one correlated failure


# How often each kind is drawn (relative weights).
DEFAULT_WEIGHTS: Mapping[FaultKind, float] = {
    FaultKind.HOST_KILL: 2.0,
    FaultKind.HOST_STOP: 2.5,
    FaultKind.AGENT_KILL: 1.0,
    FaultKind.TRAINER_CRASH: 1.0,
    FaultKind.TRAINER_HANG: 1.0,
    FaultKind.REDIS_KILL: 1.0,
    FaultKind.LEADER_KILL: 1.5,
    FaultKind.NETWORK_CUT: 1.5,
    FaultKind.BURST: 1.0,
}

# Faults that take hosts away for good: each lost host is relaunched as a fresh spare.
_HOST_LOSING = (FaultKind.HOST_KILL, FaultKind.BURST)


@dataclass(frozen=True)
class SoakSettings:
    # The job: active hosts, hot spares, coordinator replicas (--ha).
    hosts: int = 3
    spares: int = 1
    replicas: int = 3
    # The trainer's last step: the job must reach it after the faults stop.
    steps: int = 2000
    step_sleep_s: float = 0.05
    d_model: int = 64
    layers: int = 1
    seq_len: int = 32
    checkpoint_every: int = 25
    # Also checkpoint to a GCS emulator (a second tier whose markers are checked too).
    gcs: bool = False
    # Faults: injected for this long (seconds from the job's first live epoch), gaps drawn with this
    # mean from an exponential law seeded by ``seed``.
    duration_s: float = 300.0
    mtbf_s: float = 15.0
    seed: int = 0
    # Faults also stop once training reached this step (0: never), so the job ends without them.
    stop_before_step: int = 0
    weights: Mapping[FaultKind, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    # A fixed sequence of kinds instead of weighted draws (cycled): a CI run that must cover them.
    kinds: tuple[FaultKind, ...] = ()
    # Inject the n-th fault once training passed the n-th of these steps (and the job is whole),
    # instead of after drawn gaps: as many faults as steps, whatever the machine's speed.
    at_steps: tuple[int, ...] = ()
    # No fault sooner than this after the job became whole again.
    min_gap_s: float = 1.0
    # The coordinator's heartbeat timeout (its default): SIGSTOP pauses are drawn as multiples of it.
    heartbeat_timeout_s: float = 0.6
    # SIGSTOP pauses, as multiples of the heartbeat timeout: below it (absorbed), 2-4x (the stale
    # rank 0 of issue 16), and past the agent's lease.
    stop_factors: tuple[float, ...] = (0.5, 2.0, 3.0, 4.0, 12.0)
    # Network cuts (s): below the heartbeat timeout, and up to past the agent's lease.
    cut_s: tuple[float, float] = (0.3, 8.0)
    # Redis down (s) before it is restarted from its AOF.
    redis_down_s: tuple[float, float] = (0.5, 4.0)
    # A killed leader replica is restarted on its port after this long (s).
    leader_restart_s: tuple[float, float] = (0.5, 3.0)
    # The agent's hang clock (--hang-timeout): a ranked trainer without step progress this long is
    # killed. Before its first step of an epoch (JAX start-up, restore, compile) the limit is
    # --startup-timeout: one clock for both, 45 s, evicted healthy hosts at start-up on a 2-core
    # machine running the test suite beside the soak (12 s did in a cascade at a load average of 8).
    hang_timeout_s: float = 45.0
    trainer_startup_timeout_s: float = 180.0
    # The agent's lease (--lease): cut off this long, it stops its ranked trainer.
    lease_s: float = 5.0
    # The planner: never below this world size (waits, then halts after max_wait_s).
    min_world_size: int = 1
    max_wait_s: float = 60.0
    # A member_dead within this long after a fault on its host ended is the fault's doing.
    blame_grace_s: float = 10.0
    # Every published epoch goes live or is superseded within this long.
    epoch_bound_s: float = 120.0
    # A fault not recovered this long after it ended counts as not recovered.
    recovery_timeout_s: float = 150.0
    # After a fault that needs no epoch (a short pause, a Redis restart, a failover), wait this long
    # after it ended before calling it absorbed: a new leader's grace (3 s) and a heartbeat timeout.
    settle_s: float = 5.0
    # The job must be whole again (world size, epoch live, a spare up) within this long.
    ready_timeout_s: float = 180.0
    startup_timeout_s: float = 300.0
    # After the faults stop: the last step must be reached within this long, then every agent must
    # exit on its own within agent_exit_timeout_s.
    finish_timeout_s: float = 600.0
    agent_exit_timeout_s: float = 60.0
    # The monitor's poll of the event log.
    poll_s: float = 0.5
    # Where logs, checkpoints and the report go.
    workdir: Path = Path("remesh-soak")


# ---- the fault schedule ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedFault:
    """One drawn fault: when (after the job became whole again), what, how long, and whom.

    ``picks`` choose the targets among the hosts that qualify at injection time (index
    ``int(pick * len(candidates))``), so the schedule is a pure function of the seed.
    """

    gap_s: float
    kind: FaultKind
    pause_s: float
    picks: tuple[float, float]


def draw_faults(settings: SoakSettings, count: int) -> list[PlannedFault]:
    """The first ``count`` faults of the schedule ``settings.seed`` draws. Pure."""
    rng = random.Random(settings.seed)
    kinds = [k for k, w in settings.weights.items() if w > 0]
    weights = [settings.weights[k] for k in kinds]
    planned: list[PlannedFault] = []
    for i in range(count):
        # Every draw is made for every fault, whatever its kind: the n-th fault is the same for a
        # given seed whether or not the sequence of kinds is fixed.
        gap = max(settings.min_gap_s, rng.expovariate(1.0 / settings.mtbf_s))
        drawn = rng.choices(kinds, weights)[0]
        kind = settings.kinds[i % len(settings.kinds)] if settings.kinds else drawn
        stop = rng.choice(settings.stop_factors) * settings.heartbeat_timeout_s * rng.uniform(0.9, 1.1)
        cut = rng.uniform(*settings.cut_s)
        down = rng.uniform(*settings.redis_down_s)
        restart = rng.uniform(*settings.leader_restart_s)
        picks = (rng.random(), rng.random())
        pause = {
            FaultKind.HOST_STOP: stop,
            FaultKind.NETWORK_CUT: cut,
            FaultKind.REDIS_KILL: down,
            FaultKind.LEADER_KILL: restart,
            FaultKind.BURST: 0.05,
            FaultKind.AGENT_KILL: 0.5,  # a supervisor restarts the agent daemon
        }.get(kind, 0.0)
        planned.append(PlannedFault(gap, kind, round(pause, 3), picks))
    return planned


def _pick(candidates: Sequence[str], u: float) -> str:
    return candidates[min(len(candidates) - 1, int(u * len(candidates)))]


# ---- what happened ---------------------------------------------------------------------------------


@dataclass
class Fault:
    """One injected fault and its outcome (times are wall-clock, the event log's clock)."""

    index: int
    kind: FaultKind
    targets: tuple[str, ...]
    detail: str
    started_at: float
    epoch_before: int
    ended_at: float | None = None
    # recovered (an epoch went live), absorbed (no epoch was needed), not recovered
    outcome: str = "pending"
    recovered_at: float | None = None
    epoch_after: int | None = None

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.started_at

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind.value,
            "targets": list(self.targets),
            "detail": self.detail,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "epoch_before": self.epoch_before,
            "epoch_after": self.epoch_after,
            "outcome": self.outcome,
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 3),
        }


@dataclass(frozen=True)
class Violation:
    check: str
    message: str


@dataclass(frozen=True)
class Marker:
    """A checkpoint commit marker found in a checkpoint root."""

    where: str
    step: int
    epoch: int


# ---- the invariants: pure functions of what was observed -------------------------------------------

_TOPOLOGY_EVENTS = (EventType.TOPOLOGY_CHANGED, EventType.JOB_HALTED)


def contract_available(name: str) -> bool:
    """Whether this checkout records the event ``name`` ("JOB_FINISHED", "CHECKPOINT_COMMITTED") that
    the finish and stale-commit checks are judged by."""
    return hasattr(EventType, name)


def _event_type(name: str) -> EventType | None:
    return getattr(EventType, name, None)


def check_epochs(events: Sequence[Event]) -> list[Violation]:
    """Topology epochs strictly increase and are never reused; no event's epoch goes back."""
    out: list[Violation] = []
    last_topology = 0
    last_epoch = 0
    for e in events:
        if e.type in _TOPOLOGY_EVENTS and e.topology is not None:
            epoch = e.topology.epoch
            if epoch <= last_topology:
                out.append(
                    Violation(
                        "epochs",
                        f"event {e.id}: {e.type.value} publishes epoch {epoch} after epoch {last_topology} "
                        f"({e.reason})",
                    )
                )
            last_topology = max(last_topology, epoch)
        if e.epoch < last_epoch:
            out.append(
                Violation(
                    "epochs", f"event {e.id}: {e.type.value} carries epoch {e.epoch} after epoch {last_epoch}"
                )
            )
        last_epoch = max(last_epoch, e.epoch)
    return out


def find_false_evictions(events: Sequence[Event], faults: Sequence[Fault], grace_s: float) -> list[Violation]:
    """A ``member_dead`` for a host that no fault touched from its start to ``grace_s`` after its end."""
    out: list[Violation] = []
    for e in events:
        if e.type is not EventType.MEMBER_DEAD:
            continue
        blamed = any(
            e.host_id in f.targets
            and f.started_at - 0.05
            <= e.time
            <= (f.ended_at if f.ended_at is not None else math.inf) + grace_s
            for f in faults
        )
        if not blamed:
            near = [f for f in faults if f.started_at - 0.05 <= e.time]
            context = f" (last fault: #{near[-1].index} {near[-1].detail})" if near else ""
            out.append(
                Violation(
                    "false_eviction",
                    f"event {e.id}: {e.host_id} (incarnation {e.incarnation}) declared dead, no fault "
                    f"touched it: {e.reason}{context}",
                )
            )
    return out


def find_hung_epochs(events: Sequence[Event], bound_s: float, now: float) -> list[Violation]:
    """Published epochs that neither went live nor were superseded within ``bound_s``. An epoch still
    unresolved but younger than the bound at ``now`` is pending, not hung."""
    published = [(e.topology.epoch, e.time) for e in events if e.type in _TOPOLOGY_EVENTS and e.topology]
    live: dict[int, float] = {}
    for e in events:
        if e.type is EventType.EPOCH_LIVE:
            live.setdefault(e.epoch, e.time)
    finished = _event_type("JOB_FINISHED")
    out: list[Violation] = []
    for i, (epoch, at) in enumerate(published):
        halted = any(
            e.type is EventType.JOB_HALTED and e.topology and e.topology.epoch == epoch for e in events
        )
        if halted:
            continue  # a halted job has no epoch to run (reported by the finish check)
        superseded = published[i + 1][1] if i + 1 < len(published) else math.inf
        done = min(live.get(epoch, math.inf), superseded)
        if finished is not None and done == math.inf:
            done = min((e.time for e in events if e.type is finished and e.epoch == epoch), default=math.inf)
        if done == math.inf:
            if now - at > bound_s:
                out.append(
                    Violation("hung_epoch", f"epoch {epoch} published {now - at:.1f}s ago never went live")
                )
        elif done - at > bound_s:
            out.append(
                Violation("hung_epoch", f"epoch {epoch} took {done - at:.1f}s to go live or be superseded")
            )
    return out


def find_split_bursts(events: Sequence[Event], faults: Sequence[Fault]) -> list[Violation]:
    """A burst (hosts lost within one detection window) must be planned as one epoch: more than one
    topology published between the burst and the first epoch that went live after it is a split."""
    out: list[Violation] = []
    for f in faults:
        if f.kind is not FaultKind.BURST:
            continue
        end = f.recovered_at if f.recovered_at is not None else math.inf
        published = [
            e
            for e in events
            if e.type is EventType.TOPOLOGY_CHANGED and e.topology and f.started_at <= e.time <= end
        ]
        if len(published) > 1:
            epochs = "; ".join(
                f"epoch {e.topology.epoch} at +{e.time - f.started_at:.3f}s ({e.reason})"
                for e in published
                if e.topology
            )
            out.append(
                Violation(
                    "split_burst", f"fault {f.index} ({f.detail}) made {len(published)} epochs: {epochs}"
                )
            )
    return out


def find_stale_commits(markers: Iterable[Marker], events: Sequence[Event]) -> list[Violation]:
    """Markers with no ``checkpoint_committed`` of the same step and epoch, or whose event was recorded
    while another epoch was current (its position in the log)."""
    committed = _event_type("CHECKPOINT_COMMITTED")
    accepted: dict[tuple[int, int], list[int]] = {}
    current = 0
    for e in events:
        if e.type in _TOPOLOGY_EVENTS and e.topology is not None:
            current = e.topology.epoch
        elif committed is not None and e.type is committed:
            accepted.setdefault((int(e.details.get("step", "-1")), e.epoch), []).append(current)
    out: list[Violation] = []
    for m in sorted(markers, key=lambda m: (m.where, m.step)):
        currents = accepted.get((m.step, m.epoch))
        if currents is None:
            out.append(
                Violation(
                    "stale_commit",
                    f"{m.where}: step {m.step} committed for epoch {m.epoch} with no checkpoint_committed "
                    "event of that step and epoch",
                )
            )
        elif m.epoch not in currents:
            out.append(
                Violation(
                    "stale_commit",
                    f"{m.where}: step {m.step} of epoch {m.epoch} was accepted while epoch(s) "
                    f"{sorted(set(currents))} were current",
                )
            )
    return out


def check_finish(
    events: Sequence[Event], agent_exits: Mapping[str, int | None], last_step: int
) -> list[Violation]:
    """The job finished at its last step; nothing was declared dead and no epoch was published
    afterwards; every agent running at the end exited 0 on its own (None: it did not exit)."""
    finished_type = _event_type("JOB_FINISHED")
    out: list[Violation] = []
    finished = next((i for i, e in enumerate(events) if e.type is finished_type), None)
    if finished is None:
        halted = next((e for e in events if e.type is EventType.JOB_HALTED), None)
        why = f": the job halted ({halted.reason})" if halted else ""
        return [Violation("finish", f"no job_finished event in the log{why}")]
    event = events[finished]
    step = int(event.details.get("step", "-1"))
    if step != last_step:
        out.append(Violation("finish", f"job_finished at step {step}, the job's last step is {last_step}"))
    for e in events[finished + 1 :]:
        if e.type in (EventType.MEMBER_DEAD, EventType.TOPOLOGY_CHANGED):
            out.append(
                Violation(
                    "finish",
                    f"event {e.id} after job_finished: {e.type.value} {e.host_id or e.epoch}: {e.reason}",
                )
            )
    for host, code in sorted(agent_exits.items()):
        if code is None:
            out.append(Violation("finish", f"the agent of {host} did not exit after the job finished"))
        elif code != 0:
            out.append(Violation("finish", f"the agent of {host} exited with code {code}"))
    return out


def check_replay(events: Sequence[Event], stored: ClusterState) -> list[Violation]:
    """``replay(events)`` equals the stored state; a difference is named field by field."""
    rebuilt = replay(events)
    if rebuilt == stored:
        return []
    diffs: list[str] = []
    for f in fields(ClusterState):
        a, b = getattr(rebuilt, f.name), getattr(stored, f.name)
        if a == b:
            continue
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            keys = sorted({*a, *b}, key=str)
            parts = [f"{k}: replay {a.get(k)!r} stored {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
            diffs.append(f"{f.name} differ ({'; '.join(parts)[:800]})")
        else:
            diffs.append(f"{f.name}: replay {str(a)[:300]} stored {str(b)[:300]}")
    return [
        Violation("replay", f"replay(events) != stored state after {len(events)} events: {' | '.join(diffs)}")
    ]


# ---- reading the job from Redis --------------------------------------------------------------------


class JobView:
    """Reads one job's keys in Redis directly (whichever replica leads, and while none does)."""

    def __init__(self, redis_url: str, job: str) -> None:
        self.redis_url = redis_url
        self.job = job
        # The store's own key names (no I/O here): one layout, defined in one place.
        self.keys = RedisStore(redis_url, job).keys
        self._r = redis.Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=1.0
        )

    def close(self) -> None:
        self._r.close()

    def events_after(self, after_id: str, count: int = 2000) -> list[Event]:
        start = f"({after_id}" if after_id else "-"
        entries: Any = self._r.xrange(self.keys["events"], min=start, max="+", count=count)
        return [Event.from_json(f["e"], event_id) for event_id, f in entries]

    def topology(self) -> Topology | None:
        raw: Any = self._r.get(self.keys["topology"])
        return Topology.from_dict(json.loads(raw)) if raw else None

    def members(self) -> dict[str, Member]:
        raw: Any = self._r.hgetall(self.keys["members"])
        return {h: Member.from_dict(json.loads(m)) for h, m in raw.items()}

    def live_epoch(self) -> int:
        raw: Any = self._r.hget(self.keys["meta"], "live_epoch")
        return int(raw or 0)

    def leader_address(self) -> str | None:
        raw: Any = self._r.get(self.keys["leader_address"])
        return str(raw) if raw else None

    def steps(self) -> dict[str, int]:
        raw: Any = self._r.hgetall(self.keys["progress"])
        return {h: int(s) for h, s in raw.items()}

    def snapshot(self, attempts: int = 10) -> tuple[ClusterState, list[Event]] | None:
        """The stored state and the whole event log, consistent (no commit between the two reads:
        every event is appended by a commit, which bumps the revision). None if Redis is away or
        the log kept moving."""

        async def read() -> tuple[ClusterState, list[Event]] | None:
            store = RedisStore(self.redis_url, self.job)
            try:
                for _ in range(attempts):
                    state, rev = await store.load()
                    events = await store.read_events()
                    _, rev_after = await store.load()
                    if rev == rev_after:
                        return state, events
                    await asyncio.sleep(0.05)
                return None
            finally:
                await store.close()

        try:
            return asyncio.run(read())
        except Exception:  # the store's errors (Redis away) and redis-py's: try again later
            return None


_REDIS_ERRORS = (redis.RedisError, OSError)


class Monitor:
    """Follows the event log (every ``poll_s``) and re-checks the invariants that need no snapshot."""

    def __init__(
        self, view: JobView, settings: SoakSettings, faults: Callable[[], list[Fault]], say: Progress
    ) -> None:
        self.view = view
        self.settings = settings
        self._faults = faults
        self._say = say
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-monitor", daemon=True)
        self.reported: dict[str, Violation] = {}
        self.unreadable_polls = 0

    def start(self, deadline_s: float) -> None:
        self._deadline = time.monotonic() + deadline_s
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def poll(self) -> list[Event]:
        """Read what is new now (also called from the injector's thread for a fresh view)."""
        with self._lock:
            after = self._events[-1].id if self._events else ""
            try:
                for _ in range(100):  # bounded: 2000 events a read
                    new = self.view.events_after(after)
                    self._events.extend(new)
                    if len(new) < 2000:
                        break
                    after = new[-1].id
            except _REDIS_ERRORS:
                self.unreadable_polls += 1
            return list(self._events)

    def check(self) -> list[Violation]:
        events = self.poll()
        found = [
            *check_epochs(events),
            *find_false_evictions(events, self._faults(), self.settings.blame_grace_s),
            *find_hung_epochs(events, self.settings.epoch_bound_s, time.time()),
        ]
        for v in found:
            key = f"{v.check}: {v.message}"
            if key not in self.reported:
                self.reported[key] = v
                self._say(f"!!! invariant violated: {key}")
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.settings.poll_s) and time.monotonic() < self._deadline:
            try:
                self.check()
            except Exception as exc:  # keep following: a check that crashed must not stop the others
                self._say(f"monitor: check failed: {type(exc).__name__}: {exc}")


# ---- the job ---------------------------------------------------------------------------------------

_PROMOTED = re.compile(r"warm standby trainer promoted\b.*?\bpid=(\d+)")
_STANDBY = re.compile(r"warm standby trainer started\b.*?\bpid=(\d+)")
_SPAWNED = re.compile(r"(?<!standby )trainer started\b.*?\bpid=(\d+)")


def _proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` (R, S, T, Z...), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


@dataclass
class Host:
    host_id: str
    agent: Proc
    proxy: Proc
    proxy_port: int
    # up, lost (killed: relaunched as a spare under a new id), exited (its agent ended on its own)
    status: str = "up"


class SoakJob:
    """The processes of one soak: Redis, (GCS), coordinator replicas, and hosts with their proxies."""

    def __init__(self, settings: SoakSettings, root: Path) -> None:
        self.settings = settings
        self.root = root
        self.job = f"soak-{uuid.uuid4().hex[:8]}"
        self.workdir = settings.workdir
        self.logs = self.workdir / "logs"
        self.checkpoints = self.workdir / "checkpoints"
        self.redis = RedisServer(appendonly=True, appendfsync="always")
        self.gcs: FakeGcsServer | None = None
        self.gcs_url = ""
        self.cluster = LocalCluster(self.logs, self.redis.url, self.job)
        self.replicas: dict[int, Proc] = {}
        self.hosts: dict[str, Host] = {}
        self.env = {"PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
        self._spares = 0
        self._proxies = 0
        self.view = JobView(self.redis.url, self.job)

    # -- set-up --

    def start(self) -> None:
        for d in (self.logs, self.checkpoints):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        self.redis.start()
        if self.settings.gcs:
            self.gcs = FakeGcsServer().start()
            self.gcs.create_bucket("remesh-soak")
            self.env.update(self.gcs.env())
            self.gcs_url = f"gs://remesh-soak/{self.job}"
        for _ in range(self.settings.replicas):
            self.start_replica(0)
        self.cluster.addresses = [f"127.0.0.1:{p}" for p in self.replicas]
        for i in range(self.settings.hosts):
            self.start_host(f"host-{i}")
        for _ in range(self.settings.spares):
            self.add_spare()

    def coordinator_args(self) -> list[str]:
        s = self.settings
        return [
            "--ha", "--world-size", str(s.hosts), "--min-world-size", str(s.min_world_size),
            "--max-wait", str(s.max_wait_s),
        ]  # fmt: skip

    def start_replica(self, port: int) -> Proc:
        proc = self.cluster.start_coordinator(*self.coordinator_args(), port=port)
        self.replicas[self.cluster.port] = proc
        return proc

    def trainer_command(self) -> list[str]:
        s = self.settings
        # The trainer must not inherit the agent's grpc_proxy: its own connections (the local API,
        # the JAX coordination service) are not the link a network cut severs.
        env = shutil.which("env") or "/usr/bin/env"
        cmd = [
            env, "-u", "grpc_proxy",
            sys.executable, "-m", "examples.tinylm.train_elastic", "--steps", str(s.steps),
            "--d-model", str(s.d_model), "--layers", str(s.layers), "--seq-len", str(s.seq_len),
            "--log-every", "50", "--step-sleep", str(s.step_sleep_s),
            "--checkpoint-dir", str(self.checkpoints / "local"), "--checkpoint-every", str(s.checkpoint_every),
        ]  # fmt: skip
        if self.gcs_url:
            cmd += ["--gcs", self.gcs_url]
        return cmd

    def _start_proxy(self, host_id: str) -> tuple[Proc, int]:
        self._proxies += 1
        port_file = self.logs / f"proxy-{host_id}-{self._proxies}.port"
        targets = [arg for address in self.cluster.addresses for arg in ("--target", address)]
        proc = Proc(
            [sys.executable, str(PROXY), "--port-file", str(port_file), *targets],
            self.logs / f"proxy-{host_id}-{self._proxies}.log",
            env=self.env,
        )
        self.cluster.procs.append(proc)
        wait_for(lambda: port_file.exists() or not proc.alive(), 30, f"the proxy of {host_id}")
        if not proc.alive():
            raise RuntimeError(f"the proxy of {host_id} exited: {proc.output()[-2000:]}")
        return proc, int(port_file.read_text())

    def start_host(self, host_id: str, *, spare: bool = False, proxy: tuple[Proc, int] | None = None) -> Host:
        proxy_proc, port = proxy or self._start_proxy(host_id)
        agent = self.cluster.start_agent(
            host_id,
            spare=spare,
            trainer=self.trainer_command(),
            extra=[
                "--hang-timeout",
                str(self.settings.hang_timeout_s),
                "--startup-timeout",
                str(self.settings.trainer_startup_timeout_s),
                "--lease",
                str(self.settings.lease_s),
            ],
            env={**self.env, "grpc_proxy": f"http://127.0.0.1:{port}"},
        )
        host = Host(host_id, agent, proxy_proc, port)
        self.hosts[host_id] = host
        return host

    def add_spare(self) -> Host:
        host = self.start_host(f"spare-{self._spares}", spare=True)
        self._spares += 1
        return host

    def close(self) -> None:
        self.view.close()
        self.cluster.close()
        if self.gcs is not None:
            self.gcs.close()
        self.redis.close()

    # -- what runs now --

    def up_hosts(self) -> list[Host]:
        return [h for h in self.hosts.values() if h.status == "up"]

    def ranked(self, topology: Topology) -> list[str]:
        """The hosts of ``topology`` by rank whose agent runs."""
        return [
            m.host_id
            for m in sorted(topology.members, key=lambda m: m.rank)
            if m.host_id in self.hosts
            and self.hosts[m.host_id].status == "up"
            and self.hosts[m.host_id].agent.alive()
        ]

    def trainer_pid(self, host_id: str) -> int | None:
        """The agent's active (ranked) trainer process, from the agent's own log: the pid it started
        as the trainer or promoted from standby last, that is still its child."""
        agent = self.hosts[host_id].agent
        active: int | None = None
        before: int | None = None
        for line in agent.output().splitlines():
            if (m := _PROMOTED.search(line)) is not None:
                active = int(m.group(1))
            elif (m := _STANDBY.search(line)) is not None:
                if active == int(m.group(1)):
                    active = before
            elif (m := _SPAWNED.search(line)) is not None:
                before, active = active, int(m.group(1))
        if active is None or _parent(active) != agent.pid or _proc_state(active) in (None, "Z"):
            return None
        return active

    def leader(self) -> tuple[int, Proc] | None:
        try:
            address = self.view.leader_address()
        except _REDIS_ERRORS:
            return None
        if not address:
            return None
        port = int(address.rsplit(":", 1)[1])
        proc = self.replicas.get(port)
        return (port, proc) if proc is not None and proc.alive() else None

    def markers(self) -> list[Marker]:
        """Every checkpoint commit marker in the local root and (if used) the GCS bucket."""
        found: list[Marker] = []
        for path in sorted(self.checkpoints.glob("*/step_*/COMMITTED")):
            with contextlib.suppress(OSError, ValueError, KeyError):
                d = json.loads(path.read_text())
                found.append(Marker(str(path.relative_to(self.workdir)), int(d["step"]), int(d["epoch"])))
        if self.gcs is not None:
            client = self.gcs.client()
            for blob in client.list_blobs("remesh-soak", prefix=f"{self.job}/"):
                if blob.name.endswith("/COMMITTED"):
                    with contextlib.suppress(ValueError, KeyError):
                        d = json.loads(blob.download_as_bytes())
                        found.append(Marker(f"gs://remesh-soak/{blob.name}", int(d["step"]), int(d["epoch"])))
        return found


# ---- the run ---------------------------------------------------------------------------------------


# The checks the summary counts by name; the rest (stuck, agent_exit, hang_not_caught) are "other".
_COUNTED = ("false_eviction", "stale_commit", "hung_epoch", "split_burst", "epochs", "replay", "finish")


@dataclass
class SoakReport:
    settings: SoakSettings
    job: str
    faults: list[Fault]
    violations: list[Violation]
    not_available: dict[str, str]
    replay_checks: int
    events: int
    epochs: int
    last_step: int
    reached_step: int
    finished_cleanly: bool | None
    replay_matches: bool
    started_at: float
    training_from: float
    faults_until: float
    ended_at: float
    agent_exits: dict[str, int | None]
    notes: list[str]

    def count(self, check: str) -> int:
        return sum(1 for v in self.violations if v.check == check)

    def summary(self) -> dict[str, Any]:
        recovered = [
            f.recovery_s for f in self.faults if f.outcome == "recovered" and f.recovery_s is not None
        ]
        by_kind: dict[str, int] = {}
        for f in self.faults:
            by_kind[f.kind.value] = by_kind.get(f.kind.value, 0) + 1
        stale = None if "stale_commits" in self.not_available else self.count("stale_commit")
        return {
            "faults_injected": len(self.faults),
            "recoveries_completed": sum(1 for f in self.faults if f.outcome in ("recovered", "absorbed")),
            "absorbed": sum(1 for f in self.faults if f.outcome == "absorbed"),
            "false_evictions": self.count("false_eviction"),
            "stale_commits": stale,
            "hung_epochs": self.count("hung_epoch"),
            "replay_matches": self.replay_matches,
            "finished_cleanly": self.finished_cleanly,
            "mttr_p50_s": round(statistics.median(recovered), 3) if recovered else None,
            "mttr_max_s": round(max(recovered), 3) if recovered else None,
            "split_bursts": self.count("split_burst"),
            "epoch_violations": self.count("epochs"),
            "other_violations": sum(1 for v in self.violations if v.check not in _COUNTED),
            "by_kind": by_kind,
            "epochs": self.epochs,
            "events": self.events,
            "replay_checks": self.replay_checks,
            "last_step": self.last_step,
            "reached_step": self.reached_step,
            "fault_minutes": round((self.faults_until - self.training_from) / 60, 2),
            "wall_s": round(self.ended_at - self.started_at, 1),
            "seed": self.settings.seed,
            "mtbf_s": self.settings.mtbf_s,
            "not_available": self.not_available,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "summary": self.summary(),
            "faults": [f.to_dict() for f in self.faults],
            "violations": [{"check": v.check, "message": v.message} for v in self.violations],
            "agent_exits": self.agent_exits,
            "notes": self.notes,
        }


class Soak:
    """One soak run: ``run()`` returns the report; every process it started is stopped on exit."""

    def __init__(self, settings: SoakSettings, root: Path, say: Progress | None = None) -> None:
        self.settings = settings
        self.root = root
        self._say_to = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.job = SoakJob(settings, root)
        self.faults: list[Fault] = []
        self._faults_lock = threading.Lock()
        self.monitor = Monitor(self.job.view, settings, self._fault_list, self._say)
        self.violations: list[Violation] = []
        self.notes: list[str] = []
        self.replay_checks = 0
        self.started_at = time.time()
        self.training_from = self.started_at
        self.faults_until = self.started_at

    def _fault_list(self) -> list[Fault]:
        with self._faults_lock:
            return list(self.faults)

    def _say(self, line: str) -> None:
        self._say_to(f"{time.time() - self.started_at:7.1f}s  {line}")

    def _violate(self, check: str, message: str) -> None:
        self.violations.append(Violation(check, message))
        self._say(f"!!! {check}: {message}")

    # -- the run --

    def run(self) -> SoakReport:
        s = self.settings
        hard_limit = s.startup_timeout_s + s.duration_s + s.finish_timeout_s + 600
        try:
            self._say(
                f"starting {s.replicas} coordinator replicas (--ha), Redis (AOF), {s.hosts} hosts + "
                f"{s.spares} spare(s) training tinylm to step {s.steps}; logs in {self.job.logs}"
            )
            self.job.start()
            self.monitor.start(hard_limit)
            self._wait(
                "the job to start (epoch 1 live)",
                lambda: self.job.view.live_epoch() >= 1,
                s.startup_timeout_s,
            )
            self.training_from = time.time()
            self._say("epoch 1 is live: injecting faults")
            self._inject_for(s.duration_s)
            self.faults_until = time.time()
            exits = self._finish()
            return self._report(exits)
        finally:
            self.monitor.stop()
            self._save_logs_index()
            self.job.close()

    def _wait(self, what: str, done: Callable[[], object], timeout: float) -> object:
        def safe() -> object:
            try:
                return done()
            except _REDIS_ERRORS:
                return None

        return wait_for(safe, timeout, what, interval=0.2)

    def _inject_for(self, duration_s: float) -> None:
        s = self.settings
        deadline = self.training_from + duration_s
        planned = draw_faults(s, len(s.at_steps) or max(10, int(duration_s / s.min_gap_s) + 1))
        last_status = 0.0
        for index, plan in enumerate(planned):
            ready, why = self._await_ready(deadline)
            if not ready:
                if time.time() < deadline:
                    self._violate(
                        "stuck", f"the job was not whole again within {s.ready_timeout_s:.0f}s: {why}"
                    )
                return
            self._quiet_point_checks()
            if self._near_the_end():
                return
            due = time.time() + plan.gap_s
            while time.time() < deadline:
                if s.at_steps and self._step() >= s.at_steps[index]:
                    break
                if not s.at_steps and time.time() >= due:
                    break
                time.sleep(min(0.5, max(0.05, due - time.time())) if not s.at_steps else 0.1)
                if self._near_the_end():
                    return
                if time.time() - last_status > 10:
                    last_status = time.time()
                    self._status()
            if time.time() >= deadline:
                return
            fault = self._inject(index + 1, plan)
            if fault is None:
                continue
            self._await_recovery(fault)
            self._repair()

    def _step(self) -> int:
        """The newest step any host reported (-1 while unknown)."""
        try:
            return max(self.job.view.steps().values(), default=-1)
        except _REDIS_ERRORS:
            return -1

    def _near_the_end(self) -> bool:
        limit = self.settings.stop_before_step
        if not limit:
            return False
        step = self._step()
        if step >= limit:
            self._say(f"step {step} reached: no more faults, so the job ends without them")
            return True
        return False

    def _status(self) -> None:
        try:
            topology = self.job.view.topology()
            live = self.job.view.live_epoch()
            steps = self.job.view.steps()
        except _REDIS_ERRORS:
            self._say("status: Redis unreachable")
            return
        epoch = topology.epoch if topology else 0
        self._say(
            f"status: step {max(steps.values(), default=-1)}, epoch {epoch} ({'live' if live >= epoch else 'recovering'}), "
            f"world {topology.world_size if topology else 0}, faults {len(self.faults)}, "
            f"violations {len(self.monitor.reported) + len(self.violations)}"
        )

    def _await_ready(self, deadline: float) -> tuple[bool, str]:
        """Wait until the job is whole: its world size, its epoch live, every member alive, a spare
        up, every replica running and one leading. Returns (ready, why not)."""
        s = self.settings
        limit = time.time() + s.ready_timeout_s
        why = ""
        while time.time() < limit:
            why = self._not_ready()
            if not why:
                return True, ""
            if time.time() >= deadline:
                return False, why
            time.sleep(0.2)
        return False, why

    def _not_ready(self) -> str:
        s = self.settings
        view = self.job.view
        try:
            topology = view.topology()
            live = view.live_epoch()
            members = view.members()
            leader = self.job.leader()
        except _REDIS_ERRORS:
            return "Redis unreachable"
        if topology is None or topology.halted:
            return "no running topology"
        if topology.world_size != s.hosts:
            return f"world size {topology.world_size}, not {s.hosts}"
        if live < topology.epoch:
            return f"epoch {topology.epoch} not live yet"
        if len(self.job.ranked(topology)) != topology.world_size:
            return "a member's agent is not running"
        if any(
            members.get(h) is None or members[h].state is not MemberState.ALIVE for h in topology.host_ids
        ):
            return "a member is not alive"
        up = {h.host_id for h in self.job.up_hosts() if h.agent.alive()}
        spares = [
            m
            for m in members.values()
            if m.role is Role.SPARE and m.state is MemberState.ALIVE and m.host_id in up
        ]
        if not spares:
            return "no spare up"
        if any(not p.alive() for p in self.job.replicas.values()):
            return "a coordinator replica is down"
        if leader is None:
            return "no leading replica"
        return ""

    def _quiet_point_checks(self) -> None:
        snap = self.job.view.snapshot()
        if snap is None:
            self.notes.append(
                f"{time.time() - self.started_at:.1f}s: no consistent snapshot for the replay check"
            )
            return
        state, events = snap
        self.replay_checks += 1
        for v in check_replay(events, state):
            self._violate(v.check, v.message)

    # -- faults --

    def _inject(self, index: int, plan: PlannedFault) -> Fault | None:
        job = self.job
        topology = job.view.topology()
        if topology is None:
            return None
        ranked = job.ranked(topology)
        ranks = {m.host_id: m.rank for m in topology.members}
        kind = plan.kind
        targets: tuple[str, ...] = ()
        if kind in (FaultKind.HOST_KILL, FaultKind.HOST_STOP, FaultKind.AGENT_KILL, FaultKind.NETWORK_CUT):
            targets = (_pick(ranked, plan.picks[0]),)
        elif kind in (FaultKind.TRAINER_CRASH, FaultKind.TRAINER_HANG):
            with_trainer = [h for h in ranked if job.trainer_pid(h) is not None]
            if not with_trainer:
                self.notes.append(f"fault {index} ({kind}): no ranked trainer process found; skipped")
                return None
            targets = (_pick(with_trainer, plan.picks[0]),)
        elif kind is FaultKind.BURST:
            first = _pick(ranked, plan.picks[0])
            rest = [h for h in ranked if h != first]
            targets = (first, _pick(rest, plan.picks[1]))

        def where(h: str) -> str:
            return f"{h} (rank {ranks.get(h, -1)})"

        fault = Fault(index, kind, targets, "", time.time(), topology.epoch)
        timeout = self.settings.heartbeat_timeout_s
        if kind is FaultKind.HOST_KILL:
            fault.detail = f"SIGKILL host {where(targets[0])}"
            self._record(fault)
            job.hosts[targets[0]].agent.signal_group(signal.SIGKILL)
            job.hosts[targets[0]].status = "lost"
            fault.ended_at = fault.started_at
        elif kind is FaultKind.BURST:
            fault.detail = f"SIGKILL hosts {where(targets[0])} and {where(targets[1])} {plan.pause_s * 1000:.0f} ms apart"
            self._record(fault)
            job.hosts[targets[0]].agent.signal_group(signal.SIGKILL)
            time.sleep(plan.pause_s)
            job.hosts[targets[1]].agent.signal_group(signal.SIGKILL)
            for h in targets:
                job.hosts[h].status = "lost"
            fault.ended_at = time.time()
        elif kind is FaultKind.HOST_STOP:
            fault.detail = f"SIGSTOP host {where(targets[0])} for {plan.pause_s:.2f}s ({plan.pause_s / timeout:.1f}x the heartbeat timeout)"
            self._record(fault)
            agent = job.hosts[targets[0]].agent
            agent.signal_group(signal.SIGSTOP)
            time.sleep(plan.pause_s)
            agent.signal_group(signal.SIGCONT)
            fault.ended_at = time.time()
        elif kind is FaultKind.AGENT_KILL:
            fault.detail = (
                f"SIGKILL the agent of {where(targets[0])} (its trainers follow), restarted as a spare"
            )
            self._record(fault)
            host = job.hosts[targets[0]]
            os.kill(host.agent.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                host.agent.popen.wait(10)
            time.sleep(plan.pause_s)
            job.start_host(targets[0], spare=True, proxy=(host.proxy, host.proxy_port))
            fault.ended_at = time.time()
        elif kind is FaultKind.TRAINER_CRASH:
            pid = job.trainer_pid(targets[0])
            fault.detail = f"SIGKILL the trainer (pid {pid}) of {where(targets[0])}"
            self._record(fault)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            fault.ended_at = fault.started_at
        elif kind is FaultKind.TRAINER_HANG:
            pid = job.trainer_pid(targets[0])
            assert pid is not None
            fault.detail = f"SIGSTOP the trainer (pid {pid}) of {where(targets[0])}: a hang"
            self._record(fault)
            self._hang(fault, pid)
        elif kind is FaultKind.REDIS_KILL:
            fault.detail = f"SIGKILL redis-server, restarted from its AOF after {plan.pause_s:.2f}s"
            self._record(fault)
            job.redis.kill()
            time.sleep(plan.pause_s)
            job.redis.start()
            fault.ended_at = time.time()
        elif kind is FaultKind.LEADER_KILL:
            found = job.leader()
            if found is None:
                self.notes.append(f"fault {index} ({kind}): no leading replica found; skipped")
                return None
            port, proc = found
            fault.detail = (
                f"SIGKILL the leading coordinator (port {port}), restarted after {plan.pause_s:.2f}s"
            )
            self._record(fault)
            proc.kill()
            time.sleep(plan.pause_s)
            job.start_replica(port)
            fault.ended_at = time.time()
        elif kind is FaultKind.NETWORK_CUT:
            fault.detail = f"cut {where(targets[0])} off from every coordinator for {plan.pause_s:.2f}s"
            self._record(fault)
            proxy = job.hosts[targets[0]].proxy
            proxy.popen.send_signal(signal.SIGUSR1)
            time.sleep(plan.pause_s)
            proxy.popen.send_signal(signal.SIGUSR2)
            fault.ended_at = time.time()
        return fault

    def _record(self, fault: Fault) -> None:
        with self._faults_lock:
            self.faults.append(fault)
        self._say(f">>> fault {fault.index}: {fault.detail} (epoch {fault.epoch_before})")

    def _hang(self, fault: Fault, pid: int) -> None:
        """SIGSTOP the trainer; its agent must kill it within its hang clock's limit (plus a margin):
        the start-up timeout's if it had not stepped in its epoch yet."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        wait_s = max(self.settings.hang_timeout_s, self.settings.trainer_startup_timeout_s) + 30
        limit = time.time() + wait_s
        while time.time() < limit and _proc_state(pid) not in (None, "Z"):
            time.sleep(0.1)
        if _proc_state(pid) not in (None, "Z"):
            self._violate(
                "hang_not_caught",
                f"fault {fault.index}: the stopped trainer {pid} of {fault.targets[0]} is still there "
                f"{wait_s:.0f}s later; SIGCONT",
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        fault.ended_at = time.time()

    def _await_recovery(self, fault: Fault) -> None:
        s = self.settings
        assert fault.ended_at is not None
        settle = fault.ended_at + s.settle_s
        limit = fault.ended_at + s.recovery_timeout_s
        # A fault that needed no epoch is absorbed only once the job steps past where it stood when
        # the fault ended: a trainer left dead with no epoch coming (seen once in CI) is no recovery.
        stood = self._step()
        while True:
            events = self.monitor.poll()
            after = [e for e in events if e.time >= fault.started_at - 0.05]
            live = next(
                (e for e in after if e.type is EventType.EPOCH_LIVE and e.epoch > fault.epoch_before), None
            )
            changed = any(e.type in _TOPOLOGY_EVENTS for e in after)
            now = time.time()
            if live is not None:
                fault.outcome, fault.recovered_at, fault.epoch_after = "recovered", live.time, live.epoch
                self._say(
                    f"<<< fault {fault.index} recovered in {live.time - fault.started_at:.2f}s (epoch {live.epoch} live)"
                )
                for v in find_split_bursts(events, [fault]):
                    self._violate(v.check, v.message)
                return
            if not changed and now >= settle and self._step() > stood:
                fault.outcome = "absorbed"
                self._say(f"<<< fault {fault.index} absorbed: no epoch needed, the job stepped on")
                return
            if now >= limit:
                fault.outcome = "not recovered"
                self._say(f"<<< fault {fault.index} NOT recovered {s.recovery_timeout_s:.0f}s after it ended")
                return
            time.sleep(0.1)

    def _repair(self) -> None:
        """Relaunch every host the faults took away as a fresh spare, so the job keeps its size."""
        for host in list(self.job.hosts.values()):
            if host.status == "lost":
                with contextlib.suppress(Exception):
                    host.agent.popen.wait(10)
                host.proxy.terminate(5)
                host.status = "gone"
                spare = self.job.add_spare()
                self._say(f"    relaunched {host.host_id} as {spare.host_id}")
            elif host.status == "up" and not host.agent.alive():
                code = host.agent.popen.returncode
                host.status = "exited"
                host.proxy.terminate(5)
                self._violate(
                    "agent_exit", f"the agent of {host.host_id} exited on its own with code {code} mid-run"
                )
                spare = self.job.add_spare()
                self._say(f"    relaunched {host.host_id} as {spare.host_id}")

    # -- the end --

    def _finish(self) -> dict[str, int | None]:
        """No more faults: the job trains to its last step; every agent must exit 0 on its own."""
        s = self.settings
        self._repair()
        self._say(f"faults stopped after {len(self.faults)}; training on to step {s.steps}")
        finished_type = _event_type("JOB_FINISHED")
        has_contract = contract_available("JOB_FINISHED")
        limit = time.time() + s.finish_timeout_s
        last_status = time.time()
        while time.time() < limit:
            events = self.monitor.poll()
            if finished_type is not None and any(e.type is finished_type for e in events):
                break
            if any(e.type is EventType.JOB_HALTED for e in events):
                self._say("the job halted")
                break
            with contextlib.suppress(*_REDIS_ERRORS):
                if not has_contract and max(self.job.view.steps().values(), default=-1) >= s.steps:
                    time.sleep(10)  # let the end play out: what happens after the last step is checked
                    break
            if time.time() - last_status > 10:
                last_status = time.time()
                self._status()
            time.sleep(0.2)
        else:
            self._say(f"the job did not finish within {s.finish_timeout_s:.0f}s")
        exits: dict[str, int | None] = {}
        running = [h for h in self.job.up_hosts() if h.agent.alive() or h.agent.popen.returncode is not None]
        if has_contract:
            exit_limit = time.time() + s.agent_exit_timeout_s
            while time.time() < exit_limit and any(h.agent.alive() for h in running):
                time.sleep(0.2)
        for h in running:
            exits[h.host_id] = h.agent.popen.returncode if not h.agent.alive() else None
        self._say(
            "agents at the end: "
            + ", ".join(f"{h}={'running' if c is None else c}" for h, c in sorted(exits.items()))
        )
        return exits

    def _report(self, exits: dict[str, int | None]) -> SoakReport:
        s = self.settings
        markers = self.job.markers()  # before the log: a marker's event precedes it
        snap = None
        for _ in range(20):
            snap = self.job.view.snapshot()
            if snap is not None:
                break
            time.sleep(0.5)
        violations = list(self.violations)
        not_available: dict[str, str] = {}
        if snap is None:
            events = self.monitor.poll()
            replay_ok = False
            violations.append(Violation("replay", "no consistent snapshot of the store at the end"))
        else:
            state, events = snap
            self.replay_checks += 1
            found = check_replay(events, state)
            replay_ok = not found
            violations += found
        now = time.time()
        violations += check_epochs(events)
        violations += find_false_evictions(events, self.faults, s.blame_grace_s)
        violations += find_hung_epochs(events, s.epoch_bound_s, now)
        violations += find_split_bursts(events, self.faults)
        if contract_available("CHECKPOINT_COMMITTED"):
            violations += find_stale_commits(markers, events)
        else:
            not_available["stale_commits"] = (
                f"this checkout has no checkpoint_committed contract ({len(markers)} markers found, not judged)"
            )
        finished_cleanly: bool | None
        if contract_available("JOB_FINISHED"):
            found = check_finish(events, exits, s.steps)
            finished_cleanly = not found
            violations += found
        else:
            finished_cleanly = None
            not_available["finished_cleanly"] = "this checkout has no job_finished contract"
            self._note_end_without_contract(events)
        # The monitor saw these too; keep one of each.
        unique: dict[tuple[str, str], Violation] = {}
        for v in violations:
            unique.setdefault((v.check, v.message), v)
        try:
            reached = max(self.job.view.steps().values(), default=-1)
        except _REDIS_ERRORS:
            reached = -1
        epochs = max(
            (e.topology.epoch for e in events if e.type in _TOPOLOGY_EVENTS and e.topology), default=0
        )
        report = SoakReport(
            settings=s,
            job=self.job.job,
            faults=self.faults,
            violations=list(unique.values()),
            not_available=not_available,
            replay_checks=self.replay_checks,
            events=len(events),
            epochs=epochs,
            last_step=s.steps,
            reached_step=reached,
            finished_cleanly=finished_cleanly,
            replay_matches=replay_ok,
            started_at=self.started_at,
            training_from=self.training_from,
            faults_until=self.faults_until,
            ended_at=now,
            agent_exits=exits,
            notes=self.notes,
        )
        with contextlib.suppress(OSError):
            (s.workdir / "events.json").write_text(
                "[\n"
                + ",\n".join(json.dumps({"id": e.id, **json.loads(e.to_json())}) for e in events)
                + "\n]\n"
            )
            (s.workdir / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
        return report

    def _note_end_without_contract(self, events: Sequence[Event]) -> None:
        """Without job_finished, say what happened after the last step anyway (evidence, not judged)."""
        for e in events:
            if e.type is EventType.MEMBER_DEAD and e.time > self.faults_until + self.settings.blame_grace_s:
                self.notes.append(f"after the faults stopped: {e.host_id} declared dead: {e.reason}")

    def _save_logs_index(self) -> None:
        with contextlib.suppress(OSError):
            (self.settings.workdir / "processes.txt").write_text(
                "\n".join(
                    f"{p.pid} {p.log_path.name} {' '.join(p.args[-12:])}" for p in self.job.cluster.procs
                )
            )

"""Run a whole elastic training job on this machine, fail hosts on purpose, and record what happened.

``DemoRun`` starts an embedded redis-server and GCS emulator (unless real ones are configured), the
coordinator, and every host as a real ``remesh agent`` process supervising the example language
model's trainer (``examples/tinylm/train_elastic.py``, a real multi-process JAX job). It injects the
failures of a ``Schedule`` (SIGKILL or SIGSTOP of a whole host, at a step or at random times), waits
for each recovery, and at the end writes ``report.json`` and ``timeline.png``.

Two modes run the same schedule:

- ``inplace``: remesh as designed: the coordinator replaces the dead host with a hot spare (or the
  job shrinks), survivors re-mesh and restore in place; after each recovery a fresh host joins the
  spare pool, as a repaired machine would.
- ``restart``: what users do today, for comparison: once the failure is detected, every trainer
  process of the job is killed and the job is launched again on a full set of hosts, restoring from
  the newest checkpoint. The coordinator keeps running only to record the event log, so both modes
  are measured the same way. The baseline is given remesh's fast detection for free; a real job
  would first wait out a collective timeout and its scheduler.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from remesh.demo.display import Display
from remesh.demo.report import build_report
from remesh.embedded import FakeGcsServer, RedisServer
from remesh.embedded.cluster import LocalCluster
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.contract import COMPILATION_CACHE_ENV
from remesh.views import event_dict

__all__ = ["DemoConfig", "DemoError", "DemoRun", "Schedule", "repo_root"]

log = structlog.get_logger("remesh.demo")

BUCKET = "remesh-demo"
TARGETS_HELP = "any (a random active host), rank0 (the host running JAX process 0), or a host id"


class DemoError(Exception):
    """A problem the user can fix (bad arguments, an unreachable service): said in one line."""


def repo_root() -> Path:
    """The source checkout this package runs from: the demo's trainer lives in its ``examples/``."""
    root = Path(__file__).resolve().parents[3]
    if not (root / "examples" / "tinylm" / "train_elastic.py").is_file():
        raise DemoError(
            f"examples/tinylm not found under {root}: run remesh demo from a source checkout "
            "installed with `pip install -e .` (what `make demo` does)"
        )
    return root


@dataclass(frozen=True)
class Schedule:
    """When to fail which host, and how. ``at_steps`` and ``mtbf_s`` may be combined."""

    at_steps: tuple[int, ...] = ()
    targets: tuple[str, ...] = ("any",)
    how: str = "kill"
    mtbf_s: float | None = None
    seed: int = 0
    # Never fail a host sooner than this after the previous recovery (a job needs to be running to fail).
    min_gap_s: float = 3.0

    def target(self, index: int) -> str:
        return self.targets[index % len(self.targets)]

    def mtbf_offsets(self, horizon_s: float) -> list[float]:
        """Failure times (seconds after training starts) drawn from an exponential law, seeded."""
        if not self.mtbf_s:
            return []
        rng = random.Random(self.seed)
        offsets: list[float] = []
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / self.mtbf_s)
            if t > horizon_s:
                return offsets
            offsets.append(t)


@dataclass
class DemoConfig:
    hosts: int = 3
    spares: int = 1
    steps: int = 300
    schedule: Schedule = field(default_factory=Schedule)
    mode: str = "inplace"  # or "restart"
    out: Path = Path("remesh-demo")
    redis_url: str | None = None
    gcs_url: str | None = None  # gs://BUCKET/PREFIX on real GCS; None: an embedded emulator
    checkpoint_every: int = 25
    # Host-memory snapshots every N steps, or "auto" (the trainer library's default: the interval
    # follows what a snapshot costs and the run's MTBF).
    snapshot_every: str = "auto"
    # The failure interval the trainers' automatic cadence assumes until the coordinator observes one
    # (seconds); None: the run's --mtbf, else about a minute (this run fails on purpose, soon). 0:
    # none, remesh's default (remesh.elastic.cadence.PRIOR_MTBF_S until a failure is observed).
    trainer_mtbf_s: float | None = None
    step_sleep: float = 0.05
    d_model: int = 64
    layers: int = 2
    # replicated | fsdp | hsdp (replica groups of two hosts): how the trainers lay out the state.
    sharding: str = "replicated"
    seq_len: int = 64
    duration_s: float | None = None  # stop at this many seconds of training even before ``steps``
    replace_failed: bool = True
    devices: int = 2
    # The trainers' XLA compilation cache (REMESH_COMPILATION_CACHE_DIR); None: the machine's
    # shared one, warm from earlier runs.
    compile_cache_dir: Path | None = None
    port: int = 0  # the coordinator's gRPC port on 127.0.0.1; 0: any free one
    startup_timeout_s: float = 300.0
    recovery_timeout_s: float = 180.0
    # From the last step to every agent gone: the trainers meet at a barrier, report, leave JAX.
    finish_timeout_s: float = 90.0

    def validate(self) -> None:
        hosts = [f"host-{i}" for i in range(self.hosts)]
        if self.hosts < 1:
            raise DemoError("--hosts must be at least 1")
        if self.spares < 0:
            raise DemoError("--spares must be at least 0")
        if self.steps < 1:
            raise DemoError("--steps must be at least 1")
        if self.sharding not in ("replicated", "fsdp", "hsdp"):
            raise DemoError(f"unknown sharding {self.sharding!r}: replicated, fsdp or hsdp")
        if self.mode not in ("inplace", "restart"):
            raise DemoError(f"unknown mode {self.mode!r}: inplace or restart")
        if self.schedule.how not in ("kill", "stop"):
            raise DemoError(f"unknown way to fail a host {self.schedule.how!r}: kill or stop")
        for step in self.schedule.at_steps:
            if not 0 < step < self.steps:
                raise DemoError(
                    f"--kill-at {step} is outside the run: choose a step between 1 and {self.steps - 1} "
                    f"(the run trains {self.steps} steps)"
                )
        for target in self.schedule.targets:
            if target not in ("any", "rank0") and target not in hosts:
                raise DemoError(f"unknown host {target!r}: choose {TARGETS_HELP} ({', '.join(hosts)})")
        if self.schedule.mtbf_s is not None and self.schedule.mtbf_s <= 0:
            raise DemoError("--mtbf must be a positive number of seconds")
        if self.trainer_mtbf_s is not None and self.trainer_mtbf_s < 0:
            raise DemoError("--trainer-mtbf must be a number of seconds (0: remesh's default)")
        if not 0 <= self.port < 65536:
            raise DemoError(f"--port {self.port} is not a TCP port")
        if self.gcs_url is not None and not self.gcs_url.startswith("gs://"):
            raise DemoError(f"--gcs {self.gcs_url!r} is not a gs://BUCKET/PREFIX address")


class DemoRun:
    """One run of the demo. ``run()`` returns the report; everything started is stopped on exit."""

    def __init__(self, config: DemoConfig, display: Display | None = None) -> None:
        config.validate()
        self.config = config
        self.root = repo_root()
        self.display = display or Display(quiet=True)
        self.job = f"demo-{uuid.uuid4().hex[:6]}"
        self.out = config.out
        self.logs = self.out / "logs"
        self.metrics_dir = self.out / "steps"
        self.redis: RedisServer | None = None
        self.gcs: FakeGcsServer | None = None
        self.cluster: LocalCluster | None = None
        self.events: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self._events_lock = threading.Lock()
        self._stop = threading.Event()
        self._records: dict[Path, tuple[int, list[dict[str, Any]]]] = {}
        self._spares_started = 0
        self._env: dict[str, str] = {}
        self._gcs_url = ""

    # ---- set-up ------------------------------------------------------------------------------------

    def _prepare_out(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for old in (self.logs, self.metrics_dir):
            shutil.rmtree(old, ignore_errors=True)
            old.mkdir(parents=True)

    def _start_services(self) -> None:
        c = self.config
        if c.redis_url:
            self._check_redis(c.redis_url)
            redis_url = c.redis_url
        else:
            self.redis = RedisServer(appendonly=False).start()
            redis_url = self.redis.url
            self.display.note(f"embedded redis-server on {redis_url}")
        self._env = {"PYTHONPATH": str(self.root), "PYTHONUNBUFFERED": "1"}
        if c.compile_cache_dir is not None:
            self._env[COMPILATION_CACHE_ENV] = str(c.compile_cache_dir)
        if c.gcs_url:
            self._gcs_url = c.gcs_url.rstrip("/") + f"/{self.job}"
        else:
            self.gcs = FakeGcsServer().start()
            self.gcs.create_bucket(BUCKET)
            self._env.update(self.gcs.env())
            self._gcs_url = f"gs://{BUCKET}/{self.job}"
            self.display.note(f"embedded GCS emulator on {self.gcs.endpoint} (checkpoints: {self._gcs_url})")
        self.cluster = LocalCluster(self.logs, redis_url, self.job)
        extra = ["--world-size", str(c.hosts)]
        if c.mode == "restart":
            # The baseline never shrinks: it waits for the whole job to be launched again.
            extra += ["--min-world-size", str(c.hosts), "--max-wait", "3600"]
        try:
            self.cluster.start_coordinator(*extra, port=c.port)
        except RuntimeError as exc:
            lines = str(exc).splitlines()
            cause = next((line for line in reversed(lines) if "cannot" in line or "rror" in line), lines[0])
            raise DemoError(
                f"the coordinator did not start: {cause.strip()} (its log is in {self.logs})"
            ) from exc
        self.display.note(f"coordinator on {self.cluster.address}, job {self.job}")

    @staticmethod
    def _check_redis(url: str) -> None:
        import redis

        try:
            redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping()
        except (redis.RedisError, ValueError) as exc:
            raise DemoError(
                f"Redis at {url} does not answer ({exc}); start it, fix --redis, or leave --redis out "
                "for an embedded redis-server"
            ) from exc

    def _trainer(self) -> list[str]:
        c = self.config
        return [
            sys.executable, "-m", "examples.tinylm.train_elastic",
            "--steps", str(1_000_000 if c.duration_s else c.steps),
            "--d-model", str(c.d_model), "--layers", str(c.layers), "--seq-len", str(c.seq_len),
            "--devices", str(c.devices), "--log-every", "25", "--step-sleep", str(c.step_sleep),
            "--metrics-dir", str(self.metrics_dir),
            "--gcs", self._gcs_url, "--checkpoint-every", str(c.checkpoint_every),
            "--sharding", c.sharding,  # a sharded state: every host writes its own shards to GCS
            # With --snapshot-every auto (the default) the interval follows how often this run fails
            # a host: what the coordinator observes once a host failed; before, the run's MTBF, or
            # about a minute for failures at given steps (--trainer-mtbf).
            "--snapshot-every", c.snapshot_every, *self._trainer_mtbf(),
        ]  # fmt: skip

    def _trainer_mtbf(self) -> list[str]:
        c = self.config
        assumed = c.trainer_mtbf_s if c.trainer_mtbf_s is not None else (c.schedule.mtbf_s or 60.0)
        return ["--mtbf", str(assumed)] if assumed > 0 else []

    def _start_host(self, host_id: str, *, spare: bool = False) -> None:
        assert self.cluster is not None
        extra = ["--devices", str(self.config.devices)]
        if self.config.mode == "restart":
            extra.append("--no-warm-standby")  # the baseline uses none of remesh's recovery aids
        self.cluster.start_agent(host_id, spare=spare, trainer=self._trainer(), extra=extra, env=self._env)

    def _add_spare(self) -> None:
        self._start_host(f"spare-{self._spares_started}", spare=True)
        self._spares_started += 1

    # ---- what the job is doing ---------------------------------------------------------------------

    def _follow_events(self, address: str) -> None:
        while not self._stop.is_set():
            assert self.cluster is not None
            try:
                channel = self.cluster.channel(address=address)
            except OSError as exc:
                # Its certificate files unreadable for a moment: a thread that ended here left the
                # demo waiting for events that never came, until its start-up timeout.
                log.warning("cannot open a channel to follow the event log; retrying", error=str(exc))
                if self._stop.wait(0.2):
                    return
                continue
            try:
                after = self.events[-1]["id"] if self.events else ""
                call = pb_grpc.CoordinatorStub(channel).ReplayEvents(
                    pb.ReplayEventsRequest(follow=True, after_id=after)
                )
                threading.Thread(target=lambda c=call: (self._stop.wait(), c.cancel()), daemon=True).start()
                for e in call:
                    d = event_dict(e)
                    with self._events_lock:
                        self.events.append(d)
                    self.display.event(d)
            except grpc.RpcError:
                if not self._stop.wait(0.2):
                    continue
            finally:
                channel.close()

    def _events(self, type_: str) -> list[dict[str, Any]]:
        with self._events_lock:
            return [e for e in self.events if e["type"] == type_]

    def _live_epoch(self) -> int:
        return max((e["epoch"] for e in self._events("epoch_live")), default=0)

    def _published_epoch(self) -> int:
        return max((e["epoch"] for e in self._events("topology_changed")), default=0)

    def records(self) -> list[dict[str, Any]]:
        """Every step record the trainers wrote so far (read incrementally)."""
        for path in sorted(self.metrics_dir.glob("*.jsonl")):
            offset, rows = self._records.get(path, (0, []))
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            for line in complete.splitlines():
                row = json.loads(line)
                row["source"] = path.stem
                rows.append(row)
            self._records[path] = (offset + len(complete), rows)
        return [r for _, rows in self._records.values() for r in rows]

    def _latest(self) -> dict[str, Any] | None:
        rows = self.records()
        return max(rows, key=lambda r: r["t"]) if rows else None

    def _members(self) -> list[pb.Member]:
        assert self.cluster is not None
        try:
            return list(self.cluster.members().values())
        except grpc.RpcError:
            return []

    def _refresh(self, phase: str) -> None:
        self.display.update(
            phase=phase,
            latest=self._latest(),
            target=self.config.steps,
            members=self._members(),
            live_epoch=self._live_epoch(),
            elapsed=time.time() - self.started_at,
        )

    def _wait(self, what: str, done: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = done()
            if value:
                return value
            self._refresh(what)
            time.sleep(0.2)
        raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}; the logs are in {self.logs}")

    # ---- failures ----------------------------------------------------------------------------------

    def _victim(self, index: int, topology: pb.Topology) -> str | None:
        target = self.config.schedule.target(index)
        ranks = [m.host_id for m in sorted(topology.members, key=lambda m: m.rank)]
        if target == "rank0":
            return ranks[0]
        if target == "any":
            return random.Random(self.config.schedule.seed * 1000 + index).choice(ranks)
        return target if target in ranks else None

    def _inject(self, index: int) -> None:
        assert self.cluster is not None
        topology = self.cluster.topology()
        victim = self._victim(index, topology)
        if victim is None:
            target = self.config.schedule.target(index)
            self.display.note(f"failure {index + 1}: {target} is not an active host now; skipped")
            return
        how = self.config.schedule.how
        rank = next(m.rank for m in topology.members if m.host_id == victim)
        latest = self._latest()
        failure: dict[str, Any] = {
            "index": index,
            "time": time.time(),
            "host_id": victim,
            "how": how,
            "rank": rank,
            "epoch_before": topology.epoch,
            "step_seen": latest["step"] if latest else 0,
        }
        self.cluster.agents[victim].signal_group(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        self.failures.append(failure)
        sig = "SIGKILL" if how == "kill" else "SIGSTOP"
        self.display.failure(f"failure {index + 1}: {sig} {victim} (rank {rank}, agent and trainer)")
        if self.config.mode == "restart":
            self._relaunch(failure)
        else:
            self._recover_in_place(failure)

    def _recover_in_place(self, failure: dict[str, Any]) -> None:
        epoch, t_kill = failure["epoch_before"], failure["time"]

        def recovered_or_finished() -> int:
            if self._live_epoch() > epoch:
                return self._live_epoch()
            # A failure in the last step: the survivors may complete the job without a new epoch.
            return -1 if any(e["time"] >= t_kill for e in self._events("job_finished")) else 0

        live = self._wait(
            f"recovery from failure {failure['index'] + 1}",
            recovered_or_finished,
            self.config.recovery_timeout_s,
        )
        if live < 0:
            failure["finished_first"] = True
            self.display.note(f"failure {failure['index'] + 1}: the job finished before it needed a recovery")
            return
        failure["recovered_epoch"] = live
        failure["recovered_at"] = time.time()
        self.display.recovered(failure["time"], live, failure["host_id"])
        if self.config.replace_failed:
            self._add_spare()

    def _relaunch(self, failure: dict[str, Any]) -> None:
        """The baseline: once the failure is seen, kill every trainer and launch the job again."""
        assert self.cluster is not None
        victim, t_kill = failure["host_id"], failure["time"]
        self._wait(
            f"the failure of {victim} to be detected",
            lambda: any(e["host_id"] == victim and e["time"] >= t_kill for e in self._events("member_dead")),
            60,
        )
        self.display.note("restart baseline: killing every trainer of the job and launching it again")
        hosts = list(self.cluster.agents)
        for proc in self.cluster.procs:
            if proc is not self.cluster.coordinator:
                proc.close()
        self.cluster.clear_snapshots()  # a relaunched job restores from its checkpoints, not host memory
        self._wait("every host of the old job to be declared dead", self._all_down, 30)
        epoch = self._published_epoch()
        for host in hosts:
            self._start_host(host)
        live = self._wait(
            "the relaunched job to run",
            lambda: self._live_epoch() > epoch and self._live_epoch(),
            self.config.startup_timeout_s,
        )
        failure["recovered_epoch"] = live
        failure["recovered_at"] = time.time()
        self.display.recovered(t_kill, live, victim)

    def _all_down(self) -> bool:
        members = self._members()
        return bool(members) and all(m.state in (pb.MEMBER_STATE_DEAD, pb.MEMBER_STATE_LEFT) for m in members)

    # ---- the run -----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        c = self.config
        self._prepare_out()
        self.started_at = time.time()
        with self.display:
            try:
                self._start_services()
                assert self.cluster is not None
                threading.Thread(
                    target=self._follow_events, args=(self.cluster.address,), daemon=True
                ).start()
                hosts = [f"host-{i}" for i in range(c.hosts)]
                self.display.note(
                    f"starting {c.hosts} hosts"
                    + (f" and {c.spares} hot spare(s)" if c.mode == "inplace" and c.spares else "")
                    + f", each an agent supervising a JAX trainer with {c.devices} CPU devices"
                )
                for h in hosts:
                    self._start_host(h)
                if c.mode == "inplace":
                    for _ in range(c.spares):
                        self._add_spare()
                self._wait("the job to start (epoch 1 live)", self._live_epoch, c.startup_timeout_s)
                self.trained_from = time.time()
                self._train()
                self.ended_at = time.time()
                if c.duration_s is None:
                    self._wait_finished()
            finally:
                events = self._all_events()
                self._stop.set()
                if self.cluster is not None:
                    self.cluster.close()  # its processes, then their /dev/shm snapshots
                if self.gcs is not None:
                    self.gcs.close()
                if self.redis is not None:
                    self.redis.close()
        return self._report(events)

    def _train(self) -> None:
        c = self.config
        pending_steps = sorted(c.schedule.at_steps)
        horizon = c.duration_s or 3600.0
        pending_times = c.schedule.mtbf_offsets(horizon)
        index = 0
        # The gap is between failures: the first may come as soon as the job trains (epoch 1 is live).
        last_recovery = float("-inf")
        while True:
            latest = self._latest()
            step = latest["step"] if latest else 0
            elapsed = time.time() - self.trained_from
            if step >= c.steps or (c.duration_s is not None and elapsed >= c.duration_s):
                return
            due = bool(pending_steps and step >= pending_steps[0]) or bool(
                pending_times and elapsed >= pending_times[0]
            )
            if due and time.time() - last_recovery >= c.schedule.min_gap_s:
                if pending_steps and step >= pending_steps[0]:
                    pending_steps.pop(0)
                else:
                    pending_times.pop(0)
                self._inject(index)
                index += 1
                last_recovery = time.time()
                continue
            self._refresh("training")
            time.sleep(0.1)

    def _wait_finished(self) -> None:
        """The last step is done: the job finishes on its own (a JOB_FINISHED event) and every agent
        the demo did not kill exits by itself, with code 0: those still running, and those that
        exited already (a spare leaves as soon as the job finishes; one that failed earlier counts)."""
        assert self.cluster is not None
        killed = {f["host_id"] for f in self.failures}
        watched = {
            host: proc for host, proc in self.cluster.agents.items() if host not in killed or proc.alive()
        }
        self._wait(
            "the job to finish and every agent to exit",
            lambda: self._events("job_finished") and not any(p.alive() for p in watched.values()),
            self.config.finish_timeout_s,
        )
        self.agent_exit_codes = {host: proc.popen.returncode for host, proc in watched.items()}
        failed = {host: code for host, code in self.agent_exit_codes.items() if code != 0}
        if failed:
            raise DemoError(
                f"agents exited with an error after the job finished: {failed}; logs in {self.logs}"
            )

    def _all_events(self) -> list[dict[str, Any]]:
        """The whole event log, read once more at the end (the follower may lag by a few events)."""
        if self.cluster is not None and self.cluster.coordinator is not None:
            try:
                return [event_dict(e) for e in self.cluster.events()]
            except grpc.RpcError as exc:
                log.warning(
                    "could not read the event log at the end; using what was followed", error=str(exc)
                )
        with self._events_lock:
            return list(self.events)

    def _report(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        c = self.config
        run = {
            "mode": c.mode,
            "job": self.job,
            "hosts": c.hosts,
            "spares": c.spares if c.mode == "inplace" else 0,
            "started_at": self.started_at,
            "training_started_at": getattr(self, "trained_from", None),
            "ended_at": getattr(self, "ended_at", time.time()),
            "target_step": c.steps if not c.duration_s else 0,
            "duration_s": c.duration_s,
            "checkpoint_every": c.checkpoint_every,
            "snapshot_every": c.snapshot_every,
            "agent_exit_codes": getattr(self, "agent_exit_codes", {}),
            "checkpoints": self._gcs_url,
            "schedule": {
                "at_steps": list(c.schedule.at_steps),
                "targets": list(c.schedule.targets),
                "how": c.schedule.how,
                "mtbf_s": c.schedule.mtbf_s,
                "seed": c.schedule.seed,
            },
        }
        report = build_report(run, self.failures, events, self.records())
        with contextlib.suppress(OSError):
            (self.out / "events.json").write_text(json.dumps(events, indent=1))
        (self.out / "report.json").write_text(json.dumps(report, indent=2))
        from remesh.demo.timeline import plot_timeline

        plot_timeline(report, events, self.out / "timeline.png")
        return report

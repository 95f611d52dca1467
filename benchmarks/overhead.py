"""What a healthy step costs under remesh: the same model, mesh and data trained by a plain JAX loop
(examples/tinylm/train_plain_sharded.py: jax.distributed, no remesh) and under remesh (coordinator,
agents, the Session loop with snapshots, buddy copies, progress reports and checkpoints every
--checkpoint-every steps), in alternating rounds of one run.

    python benchmarks/overhead.py [--state-mb 256] [--steps N] [--rounds R] [--snapshot-every K]
        [--checkpoint-every M] [--plain-sessions own|shared] [--plain-checkpoints]

Both jobs are --hosts processes of 2 virtual CPU devices each, FSDP over all of them, each process
started as an agent starts its trainer: in a session of its own, at --trainer-nice (--plain-sessions
shared puts the plain run's both in this command's session, at its niceness). With
--plain-checkpoints the plain loop checkpoints too, every --checkpoint-every steps, the way an Orbax
user's loop does (CheckpointManager, asynchronous saves): the ratio is then what remesh costs beyond
the checkpoints a job writes anyway. A step's time
is the interval between consecutive steps completed on process 0 (both loops read a step's loss
once the next step is dispatched); the first --warmup steps of every run (compiling) are left out.
Prints a table, a line "all figures: {JSON}" with overhead_ratio (remesh / plain, of the median
step times), overhead_ratio_mean (of the mean step times: it counts the steps a snapshot or a
checkpoint slows, which the median leaves out), plain_step_s_p50, remesh_step_s_p50 and the rest,
and as its last line a JSON object with exactly overhead_ratio, state_mb and snapshot_every.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from remesh.agent.supervisor import nice_session, niced_and_bound
from remesh.cli.logs import configure_logging
from remesh.elastic import Policy
from remesh.elastic.cadence import Cadence, parse_every
from remesh.embedded import RedisServer
from remesh.embedded.cluster import LocalCluster, cpu_seconds, descendants, wait_for

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.recovery import d_model_for, state_bytes  # noqa: E402  (sized as the recovery benchmark)

ENV = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def model_args(args: argparse.Namespace) -> list[str]:
    return [
        "--d-model", str(args.d_model), "--layers", str(args.layers), "--seq-len", str(args.seq_len),
        "--batch", str(args.batch), "--steps", str(args.steps),
    ]  # fmt: skip


def records(metrics: Path) -> list[dict[str, Any]]:
    """A run's metrics file: one record per step process 0 completed."""
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def completions(lines: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> when process 0 completed it (wall clock), from a run's ``records``."""
    return {int(r["step"]): float(r["t"]) for r in lines}


def cadences(lines: list[dict[str, Any]]) -> dict[int, Cadence]:
    """Step -> the snapshot cadence the remesh loop was on when it completed it (``records``)."""
    return {
        int(r["step"]): Cadence(int(r["snapshot_every"]), int(r["snapshot_since"]))
        for r in lines
        if r.get("snapshot_every")  # the own-loop example writes no statistics
    }


def step_times(times: dict[int, float], warmup: int) -> dict[int, float]:
    """Step -> seconds since the step before completed (``times``: ``completions``), after the first
    ``warmup``. The last step is left out: the loops write it once the run has ended (remesh's after
    its final barrier)."""
    steps = sorted(s for s in times if warmup < s < max(times))
    return {s: times[s] - times[s - 1] for s in steps if s - 1 in times}


def beside_background(step: int, args: argparse.Namespace, cadence: Cadence | None) -> bool:
    """Whether remesh's background work runs beside ``step``: a snapshot (and buddy copy) or a
    checkpoint of it, or of the step before (the one the loop waits for while it runs).
    ``cadence``: the snapshots' at that step, where the remesh run said it."""
    if cadence is None and args.snapshot_every != "auto":
        cadence = Cadence(args.snapshot_every)
    snapshot = cadence is not None and cadence.beside_snapshot(step)
    return snapshot or bool(args.checkpoint_every and step % args.checkpoint_every in (0, 1))


class CpuWatch:
    """CPU time of the processes of a run, by kind, sampled with the wall-clock time while the run
    goes on; ``cores`` says how much each kind used between two moments (the steps that are timed),
    so start-up (imports, compiling) counts for neither loop."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, int], list[tuple[float, float]]] = {}

    def sample(self, pids: dict[int, str]) -> None:
        now = time.time()
        for pid, kind in pids.items():
            cpu = cpu_seconds(pid)
            if cpu is not None:
                self.samples.setdefault((kind, pid), []).append((now, cpu))

    def cores(self, kind: str, start: float, end: float) -> float:
        """Cores ``kind`` used from ``start`` to ``end`` (wall clock), to within one sample."""
        used = 0.0
        for (k, _), seen in self.samples.items():
            if k != kind:
                continue
            before = [cpu for t, cpu in seen if t <= start]
            until = [cpu for t, cpu in seen if t <= end]
            if until:
                used += until[-1] - (before[-1] if before else seen[0][1])
        return used / max(1e-9, end - start)


def timed_window(times: dict[int, float], warmup: int) -> tuple[float, float]:
    """From the last untimed step (the warm-up's end) to the last step timed (``step_times``)."""
    last = max(times)
    timed = [s for s in times if warmup <= s < last]
    return times[min(timed)], times[max(timed)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plain_run(tmp: Path, args: argparse.Namespace) -> tuple[dict[int, float], dict[str, float]]:
    """Step times of a plain run, and the cores its trainers used while they were timed."""
    run = uuid.uuid4().hex[:6]
    metrics, ckpt = tmp / f"plain-{run}.jsonl", tmp / f"plain-{run}-ckpt"
    watch = CpuWatch()
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(args.hosts):
        cmd = [
            sys.executable, "-m", "examples.tinylm.train_plain_sharded", *model_args(args),
            "--processes", str(args.hosts), "--process-id", str(i), "--coordinator", address,
            "--metrics", str(metrics),
        ]  # fmt: skip
        if args.plain_checkpoints:  # as an Orbax user checkpoints: CheckpointManager, async saves
            cmd += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(args.checkpoint_every)]
        log = open(tmp / f"plain-{i}.log", "w")  # noqa: SIM115
        # --plain-sessions own (the default): each process is started as an agent starts its
        # trainer, by the agent's own code (remesh.agent.supervisor): leading a session of its own,
        # at --trainer-nice, which is also given to the session, and killed with this process.
        # Linux shares CPU time between sessions before threads (autogroup): two processes in one
        # session share these 2 cores as one pool of threads, as no two hosts of a real job can,
        # and ran 4-8% faster here than the same two in two sessions.
        own = False
        if args.plain_sessions == "own":
            cmd, own = niced_and_bound(cmd, args.trainer_nice)
        proc = subprocess.Popen(
            cmd, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT, start_new_session=own
        )
        procs.append(proc)
        if own and args.trainer_nice:
            nice_session(proc.pid, args.trainer_nice)
    try:
        deadline = time.monotonic() + args.run_timeout
        while any(proc.poll() is None for proc in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the plain run did not finish in {args.run_timeout:.0f}s")
            watch.sample(dict.fromkeys((p.pid for p in procs), "trainers"))
            time.sleep(0.5)
        if any(proc.returncode != 0 for proc in procs):
            raise RuntimeError(f"the plain run failed; see {tmp}/plain-*.log")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    times = completions(records(metrics))
    start, end = timed_window(times, args.warmup)
    return step_times(times, args.warmup), {"trainers": watch.cores("trainers", start, end)}


def remesh_run(
    tmp: Path, redis_url: str, redis_pid: int, args: argparse.Namespace
) -> tuple[dict[int, float], dict[str, float], dict[str, float], dict[int, Cadence]]:
    """Step times of a run under remesh, its trainers' statistics, the cores its trainers, agents,
    coordinator and Redis used while the steps were timed, and its snapshot cadence by step."""
    job = f"overhead-{uuid.uuid4().hex[:8]}"
    folder = tmp / job
    folder.mkdir()
    cluster = LocalCluster(folder, redis_url, job)
    (folder / "metrics").mkdir()
    if args.loop == "own":  # examples/tinylm/train_own_loop.py: the user's loop on Session.epochs
        trainer = [
            sys.executable, "-m", "examples.tinylm.train_own_loop", *model_args(args),
            "--metrics", str(folder / "metrics" / "rank0.jsonl"), "--snapshot-every", str(args.snapshot_every),
        ]  # fmt: skip
    else:  # examples/tinylm/train_elastic.py: Session.run
        trainer = [
            sys.executable, "-m", "examples.tinylm.train_elastic", *model_args(args),
            "--sharding", "fsdp", "--log-every", "1000", "--metrics-dir", str(folder / "metrics"),
            "--snapshot-every", str(args.snapshot_every),
            *(["--mtbf", str(args.mtbf)] if args.mtbf is not None else []),
        ]  # fmt: skip
    if args.checkpoint_every:
        trainer += [
            "--checkpoint-dir",
            str(folder / "ckpt"),
            "--checkpoint-every",
            str(args.checkpoint_every),
            "--checkpoint-format",
            args.checkpoint_format,
        ]
    watch = CpuWatch()
    try:
        coordinator = cluster.start_coordinator("--world-size", str(args.hosts), "--preset", args.preset).pid
        agents = [
            cluster.start_agent(
                f"host-{i}",
                trainer=trainer,
                env=ENV,
                extra=("--no-warm-standby", "--trainer-nice", str(args.trainer_nice)),
            ).pid
            for i in range(args.hosts)
        ]

        pids = {coordinator: "coordinator", redis_pid: "redis", **dict.fromkeys(agents, "agents")}

        def finished() -> Path | None:
            # The trainers are looked for in /proc (every process's stat) only until each agent's is
            # found: the plain run's observer reads nothing but its trainers', and so does this one.
            if list(pids.values()).count("trainers") < args.hosts:
                for agent in agents:
                    pids.update(dict.fromkeys(descendants(agent), "trainers"))
            watch.sample(pids)
            for path in (folder / "metrics").glob("*.jsonl"):
                lines = path.read_text().splitlines()
                if lines and json.loads(lines[-1])["step"] >= args.steps:
                    return path
            return None

        metrics = wait_for(finished, args.run_timeout, "the remesh run to finish", interval=0.5)
        started = [p for p in (folder / "metrics").glob("*.jsonl") if p.stat().st_size]
        if len(started) > 1:  # a trainer process was replaced: a recovery, not a healthy run
            raise RuntimeError(
                f"the remesh run recovered from a fault ({len(started)} trainer processes wrote steps); "
                "its step times would not be a healthy run's"
            )
        lines = records(Path(metrics))  # type: ignore[arg-type]
        last = lines[-1]
        stats = {
            k: float(last.get(k, 0.0))
            for k in (
                "snapshot_s", "snapshots_skipped", "checkpoint_wait_s", "buddy_copies", "buddy_wait_s",
                "snapshot_every",
            )
        }  # fmt: skip
        times = completions(lines)
        start, end = timed_window(times, args.warmup)
        cpu = {kind: watch.cores(kind, start, end) for kind in ("trainers", "agents", "coordinator", "redis")}
        return step_times(times, args.warmup), stats, cpu, cadences(lines)
    except BaseException:
        progress(f"remesh: the remesh run did not finish; its logs end with:\n{cluster.log_tails()}")
        raise
    finally:
        cluster.close()


def main() -> int:
    # Stopped by SIGTERM (timeout, a scheduler), it still stops every process it started.
    from remesh.embedded import stop_on_sigterm

    stop_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--state-mb", type=float, default=64.0, help="size the model to about this much state"
    )
    parser.add_argument("--steps", type=int, default=30, help="steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of a run left out")
    parser.add_argument("--rounds", type=int, default=3, help="plain and remesh runs, alternating")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument(
        "--snapshot-every",
        type=parse_every,
        default=Policy().snapshot_every,
        help='snapshots every K steps, or "auto" (K from their measured cost and --mtbf)',
    )
    parser.add_argument(
        "--mtbf",
        type=float,
        default=Policy().mtbf_s,
        help="the remesh run's expected seconds between failures (--snapshot-every auto; default: "
        "remesh's, 3 hours until the coordinator observes a failure)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=10, help="remesh run (0: none)")
    parser.add_argument(
        "--checkpoint-format",
        choices=("orbax", "pieces"),
        default="orbax",
        help="the remesh run's local sharded checkpoints: Orbax (the default) or one file of pieces a process",
    )
    parser.add_argument(
        "--loop",
        choices=("session", "own"),
        default="session",
        help="the remesh run's loop: Session.run (train_elastic) or the user's own (train_own_loop)",
    )
    parser.add_argument(
        "--trainer-nice",
        type=int,
        default=10,
        help="the agents' --trainer-nice (10, their default, keeps heartbeats ahead of a busy trainer), "
        "and the plain run's processes' niceness with --plain-sessions own",
    )
    parser.add_argument(
        "--plain-sessions",
        choices=("own", "shared"),
        default="own",
        help="the plain run's processes: each in a session of its own at --trainer-nice, as an agent "
        "starts a trainer (the default), or both in this command's session at its niceness (faster on "
        "one machine: see docs/benchmarks.md)",
    )
    parser.add_argument(
        "--plain-checkpoints",
        action="store_true",
        help="the plain run checkpoints too, every --checkpoint-every steps, as an Orbax user's loop "
        "does (CheckpointManager, asynchronous saves): the ratio is then what remesh costs beyond the "
        "checkpoints a job writes anyway",
    )
    parser.add_argument(
        "--preset",
        choices=("local", "production"),
        default="local",
        help="the coordinator's detector timings: local (heartbeats every 0.1 s, the demo's and the "
        "tests') or production (every 1 s, what a cluster runs)",
    )
    parser.add_argument("--run-timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.steps <= args.warmup + 1:
        parser.error("--steps must exceed --warmup + 1")
    if args.plain_checkpoints and not args.checkpoint_every:
        parser.error("--plain-checkpoints checkpoints every --checkpoint-every steps: give it above 0")
    if args.loop == "own" and args.checkpoint_every:
        parser.error("train_own_loop writes no checkpoints: give --checkpoint-every 0 with --loop own")
    args.layers, args.seq_len, args.batch = 2, 8, 24
    args.d_model = d_model_for(args.state_mb, args.layers, args.seq_len)
    mb = state_bytes(args.d_model, args.layers, args.seq_len) / 2**20
    configure_logging(level="warning")
    progress(
        f"remesh: fsdp state of {mb:.0f} MiB (d_model {args.d_model}) over {args.hosts} hosts x 2 devices; "
        f"{args.rounds} rounds of {args.steps} steps, plain then remesh"
    )
    # (round, step, seconds) of every step timed, of every run of each loop; the remesh run's
    # snapshot cadence by step, of each round.
    plain_steps: list[tuple[int, int, float]] = []
    remesh_steps: list[tuple[int, int, float]] = []
    cadence: list[dict[int, Cadence]] = []
    stats: list[dict[str, float]] = []
    plain_cpu: list[dict[str, float]] = []
    remesh_cpu: list[dict[str, float]] = []
    with (
        tempfile.TemporaryDirectory(prefix="remesh-overhead-") as name,
        RedisServer(appendonly=False) as redis,
    ):
        tmp = Path(name)
        for r in range(args.rounds):
            t = time.monotonic()
            times, cpu = plain_run(tmp, args)
            plain_steps += [(r, step, t) for step, t in times.items()]
            plain_cpu.append(cpu)
            progress(
                f"  round {r + 1}/{args.rounds}: plain  {statistics.median(times.values()):.3f} s/step ({time.monotonic() - t:.0f} s)"
            )
            t = time.monotonic()
            assert redis.process is not None
            times, s, cpu, by_step = remesh_run(tmp, redis.url, redis.process.pid, args)
            remesh_steps += [(r, step, t) for step, t in times.items()]
            cadence.append(by_step)
            stats.append(s)
            remesh_cpu.append(cpu)
            progress(
                f"  round {r + 1}/{args.rounds}: remesh {statistics.median(times.values()):.3f} s/step ({time.monotonic() - t:.0f} s)"
            )
    plain, under = [t for _, _, t in plain_steps], [t for _, _, t in remesh_steps]
    p50_plain, p50_remesh = statistics.median(plain), statistics.median(under)
    ratio = p50_remesh / p50_plain
    # The mean counts what the median leaves out: the steps a snapshot or a checkpoint slows down.
    mean_ratio = statistics.mean(under) / statistics.mean(plain)
    print()
    print(f"{'loop':<10}{'step p50 (s)':>14}{'mean (s)':>10}{'p90 (s)':>10}{'steps':>8}")
    for name, values in (("plain", plain), ("remesh", under)):
        p90 = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
        print(
            f"{name:<10}{statistics.median(values):>14.4f}{statistics.mean(values):>10.4f}{p90:>10.4f}{len(values):>8}"
        )
    print(f"overhead ratio (remesh / plain): {ratio:.3f} of the medians, {mean_ratio:.3f} of the means")

    # Where the means part: the steps background work runs beside, against the others (and the
    # plain loop's same steps, which have none: the control).
    # (With snapshots every step or two, every step has some: there are no others.) The plain
    # loop's steps are told apart by the cadence of the remesh run of the same round.
    def p50(values: list[float]) -> str:
        return f"{statistics.median(values):.4f}" if values else "-"

    split: dict[str, tuple[list[float], list[float]]] = {}
    for name, steps in (("plain", plain_steps), ("remesh", remesh_steps)):
        beside = [beside_background(step, args, cadence[r].get(step)) for r, step, _ in steps]
        split[name] = (
            [t for (_, _, t), b in zip(steps, beside, strict=True) if b],
            [t for (_, _, t), b in zip(steps, beside, strict=True) if not b],
        )
    print(
        "step p50 beside remesh's background work (a snapshot, buddy copy or checkpoint of it or of "
        f"the step before) / the other steps: remesh {p50(split['remesh'][0])} / {p50(split['remesh'][1])} s, "
        f"plain {p50(split['plain'][0])} / {p50(split['plain'][1])} s"
    )
    quiet = split["remesh"][1], split["plain"][1]
    print(
        f"remesh, per run: snapshots skipped {statistics.median(s['snapshots_skipped'] for s in stats):.0f}, "
        f"background snapshot time {statistics.median(s['snapshot_s'] for s in stats):.2f} s, "
        f"waits for a checkpoint {statistics.median(s['checkpoint_wait_s'] for s in stats):.2f} s, "
        f"buddy copies {statistics.median(s['buddy_copies'] for s in stats):.0f}, "
        f"waits for buddy copies {statistics.median(s['buddy_wait_s'] for s in stats):.2f} s, "
        f"snapshots every {sorted(int(s['snapshot_every']) for s in stats)} steps at the end of each"
    )
    # Where the CPU goes while steps are timed (medians of the runs): on this machine every process
    # shares the same cores, so CPU the remesh side spends outside the step is taken from it.
    cpu_plain = statistics.median(c["trainers"] for c in plain_cpu)
    cpu_remesh = {k: statistics.median(c[k] for c in remesh_cpu) for k in remesh_cpu[0]}
    print(
        f"cores while timed: plain trainers {cpu_plain:.2f}; remesh trainers {cpu_remesh['trainers']:.2f}, "
        f"agents {cpu_remesh['agents']:.3f}, coordinator {cpu_remesh['coordinator']:.3f}, "
        f"redis {cpu_remesh['redis']:.3f}"
    )
    result = {
        "overhead_ratio": round(ratio, 4),
        "overhead_ratio_mean": round(mean_ratio, 4),
        "overhead_ratio_steps_without_background_work": (
            round(statistics.median(quiet[0]) / statistics.median(quiet[1]), 4) if all(quiet) else None
        ),
        "state_mb": round(mb, 1),
        "snapshot_every": args.snapshot_every,
        # The cadence each remesh run ended on (with "auto": the one its members agreed).
        "snapshot_every_at_end": sorted(int(s["snapshot_every"]) for s in stats),
        "mtbf_s": args.mtbf if args.snapshot_every == "auto" else None,
        "checkpoint_every": args.checkpoint_every,
        "checkpoint_format": args.checkpoint_format,
        "plain_step_s_p50": round(p50_plain, 4),
        "remesh_step_s_p50": round(p50_remesh, 4),
        "hosts": args.hosts,
        "preset": args.preset,
        "plain_sessions": args.plain_sessions,
        "plain_checkpoints": args.plain_checkpoints,
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "cores_while_timed": {"plain_trainers": round(cpu_plain, 3)}
        | {f"remesh_{k}": round(v, 3) for k, v in cpu_remesh.items()},
    }
    # Every figure on the line before; the last line carries exactly the keys issue #11 names.
    print("all figures: " + json.dumps(result))
    print(json.dumps({key: result[key] for key in ("overhead_ratio", "state_mb", "snapshot_every")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

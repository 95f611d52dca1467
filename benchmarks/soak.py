"""A chaos soak: minutes of seeded faults over a running job, every invariant checked as it goes.

Runs the example trainer (tinylm, data-parallel over 3 hosts x 2 CPU devices, one hot spare, local
checkpoints every 25 steps and, with --gcs, to a GCS emulator too) under 3 coordinator replicas
(--ha) on an embedded Redis with AOF (appendfsync always), every agent behind a proxy that can cut
it off from the coordinators. For --minutes it injects faults at exponential intervals (--mtbf, from
the moment the job is whole again) drawn from --seed: host SIGKILL, host SIGSTOP/SIGCONT (pauses
from half to 12x the heartbeat timeout, 2-4x included), agent kill, trainer crash, trainer hang,
Redis kill and restart, leader kill and restart, network cut, and a burst of two host kills 50 ms
apart. Lost hosts are relaunched as spares so the job keeps its size. Then no more faults: the job
trains to its last step, and every agent must exit 0 on its own.

Invariants (see benchmarks/chaos.py): epochs strictly increase; replay(event log) == stored state
(at every quiet point and at the end); no member_dead for a host no fault touched (false eviction);
every epoch live or superseded within a bound (hung epoch); a burst is one epoch (split burst); no
checkpoint marker without a checkpoint_committed event of its epoch while current (stale commit);
the job finishes cleanly (job_finished, nothing dead and no epoch after it, every agent exits 0).

The step count: the job must end after the faults stop, so its last step is chosen from a step
rate (--step-rate, steps/s of this job on this 2-core machine without faults, measured) times the
expected share of productive time (--goodput) over the soak, plus a tail; faults stop at --minutes
or when training is --tail-s seconds from its last step, whichever comes first. --steps overrides.

    python benchmarks/soak.py --minutes 5 [--mtbf 10] [--seed 1] [--gcs] [--out DIR]

Prints progress lines while it runs (stderr), then a table of the faults (kind, target, recovery
time: fault to the next epoch_live, or "no epoch needed"), a table by kind, the violations, and as
its last line a JSON object with faults_injected, recoveries_completed, false_evictions,
stale_commits, hung_epochs, split_bursts, replay_matches, finished_cleanly, mttr_p50_s (stale_commits
and finished_cleanly are null where the checkout lacks the contract those checks need).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.chaos import DEFAULT_WEIGHTS, FaultKind, Soak, SoakReport, SoakSettings  # noqa: E402
from remesh.cli.logs import configure_logging  # noqa: E402


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def print_report(report: SoakReport) -> None:
    print()
    print(f"{'#':>3} {'t (s)':>7}  {'kind':<14}{'outcome':<15}{'recovery':>10}  detail")
    for f in report.faults:
        t = f.started_at - report.training_from
        if f.outcome == "recovered" and f.recovery_s is not None:
            recovery = f"{f.recovery_s:.2f}s"
        elif f.outcome == "absorbed":
            recovery = "no epoch needed"
        else:
            recovery = "-"
        print(f"{f.index:>3} {t:>7.1f}  {f.kind.value:<14}{f.outcome:<15}{recovery:>10}  {f.detail}")
    print()
    print(
        f"{'kind':<15}{'faults':>7}{'recovered':>10}{'absorbed':>9}{'failed':>7}{'p50 (s)':>9}{'max (s)':>9}"
    )
    for kind in FaultKind:
        rows = [f for f in report.faults if f.kind is kind]
        if not rows:
            continue
        times = [f.recovery_s for f in rows if f.outcome == "recovered" and f.recovery_s is not None]
        p50 = f"{statistics.median(times):.2f}" if times else "-"
        worst = f"{max(times):.2f}" if times else "-"
        print(
            f"{kind.value:<15}{len(rows):>7}{sum(f.outcome == 'recovered' for f in rows):>10}"
            f"{sum(f.outcome == 'absorbed' for f in rows):>9}"
            f"{sum(f.outcome not in ('recovered', 'absorbed') for f in rows):>7}{p50:>9}{worst:>9}"
        )
    print()
    if report.violations:
        print(f"{len(report.violations)} invariant violation(s):")
        for v in report.violations:
            print(f"  [{v.check}] {v.message}")
    else:
        print("no invariant violated")
    for check, why in report.not_available.items():
        print(f"  {check}: not available ({why})")
    for note in report.notes:
        print(f"  note: {note}")
    s = report.summary()
    print(
        f"trained to step {s['reached_step']} of {s['last_step']}, {s['epochs']} epochs, {s['events']} events, "
        f"{s['replay_checks']} replay checks, faults for {s['fault_minutes']} min, {s['wall_s']}s in all"
    )


def main() -> int:
    # Stopped by SIGTERM (timeout, a scheduler), it still stops every process it started.
    from remesh.embedded import stop_on_sigterm

    stop_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="minutes of fault injection")
    parser.add_argument("--mtbf", type=float, default=10.0, help="mean seconds between faults (job whole)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault schedule")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=3, help="coordinator replicas (--ha)")
    parser.add_argument(
        "--kinds",
        default="",
        help="comma-separated fault kinds to cycle through instead of weighted draws "
        f"({', '.join(k.value for k in FaultKind)})",
    )
    parser.add_argument("--exclude", default="", help="comma-separated fault kinds never to draw")
    parser.add_argument("--steps", type=int, default=0, help="the job's last step (0: from the step rate)")
    parser.add_argument(
        "--step-rate",
        type=float,
        default=5.0,
        help="steps/s of this job without faults (measured here: 2.5-5 with 3 hosts on 2 shared cores)",
    )
    parser.add_argument(
        "--goodput",
        type=float,
        default=1.0,
        help="expected productive share of the soak under faults: an overestimate makes a longer "
        "fault-free tail, never fewer faults (measured here: 0.3-0.5 on a busy machine, 0.9 on a quiet "
        "one, where 0.6 ended the faults after 2.75 of 5 minutes)",
    )
    parser.add_argument(
        "--tail-s", type=float, default=30.0, help="seconds of fault-free training at the end"
    )
    parser.add_argument("--gcs", action="store_true", help="also checkpoint to a GCS emulator")
    parser.add_argument("--out", type=Path, help="keep logs, events.json and report.json here")
    args = parser.parse_args()
    configure_logging(level="warning")
    duration = args.minutes * 60
    tail_steps = math.ceil(args.step_rate * args.tail_s)
    steps = args.steps or math.ceil(args.step_rate * args.goodput * duration) + tail_steps
    excluded = {FaultKind(k.strip()) for k in args.exclude.split(",") if k.strip()}
    weights = {k: w for k, w in DEFAULT_WEIGHTS.items() if k not in excluded}
    kinds = tuple(FaultKind(k.strip()) for k in args.kinds.split(",") if k.strip())
    with tempfile.TemporaryDirectory(prefix="remesh-soak-") as tmp:
        workdir = args.out or Path(tmp)
        settings = SoakSettings(
            hosts=args.hosts,
            spares=args.spares,
            replicas=args.replicas,
            steps=steps,
            duration_s=duration,
            mtbf_s=args.mtbf,
            seed=args.seed,
            weights=weights,
            kinds=kinds,
            gcs=args.gcs,
            stop_before_step=max(0, steps - tail_steps),
            workdir=workdir,
        )
        progress(
            f"soak: {args.minutes:g} min of faults (MTBF {args.mtbf:g}s, seed {args.seed}), last step {steps} "
            f"(faults stop by step {settings.stop_before_step})"
        )
        report = Soak(settings, ROOT, progress).run()
        print_report(report)
        if args.out:
            print(f"logs, events.json and report.json: {args.out}")
    print(json.dumps(report.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

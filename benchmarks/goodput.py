"""Goodput under random host failures: remesh's in-place recovery vs relaunching the whole job.

For each MTBF, runs the demo's job (tinylm on 3 hosts x 2 CPU devices, one hot spare, checkpoints
every 25 steps to a GCS emulator) for ``--duration`` seconds of training while hosts are SIGKILLed at
seeded exponential intervals — once with remesh recovering in place, once with the whole-job restart
baseline (every trainer killed and relaunched from the newest checkpoint) — same schedule, same run.

Every run starts with an empty XLA compilation cache of its own, so both modes compile their
program once at start-up and read it back from that cache on every recovery or relaunch.

Goodput is productive training time (steps whose result survives) over wall time, as Google's
ml-goodput-measurement defines it. Two figures: over the whole run, and after start-up (from the
first training step: the job's one-time start on this machine's 2 cores, its services, agents
and JAX trainers and the first compile, which both modes pay once, left out). Badput is broken
down by category (see remesh.demo.report).

    python benchmarks/goodput.py [--duration 240] [--mtbf 60,30] [--seed 1]

Prints a table and, as its last line, a JSON object with mtbf_s, inplace_goodput, restart_goodput,
inplace_badput_vs_restart (for the first MTBF), and every figure per MTBF under "runs".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from remesh.cli.logs import configure_logging
from remesh.demo.display import Display
from remesh.demo.report import BADPUT
from remesh.demo.runner import DemoConfig, DemoRun, Schedule


def run_one(mode: str, mtbf: float, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    config = DemoConfig(
        hosts=3,
        spares=1,
        steps=1_000_000,
        duration_s=args.duration,
        schedule=Schedule(at_steps=(), targets=("any",), mtbf_s=mtbf, seed=args.seed),
        mode=mode,
        out=out,
        # Each run compiles from an empty cache of its own: with the machine's shared one, whichever
        # mode ran first paid the compile the other read back (docs/benchmarks.md: "Each run compiles").
        compile_cache_dir=out / "jax-cache",
    )
    console = Console(stderr=True, highlight=False)
    console.print(f"--- {mode}, MTBF {mtbf:g}s, {args.duration:g}s of training")
    report: dict[str, Any] = DemoRun(config, Display(console, brief=True)).run()
    g = report["goodput"]
    console.print(
        f"    goodput {g['goodput']:.3f} ({g['running_goodput']:.3f} after start-up), "
        f"{report['summary']['recovered']}/{report['summary']['failures']} failures recovered"
    )
    return report


def badput_ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float:
    bad_a, bad_b = 1 - a["goodput"][key], 1 - b["goodput"][key]
    return round(bad_a / bad_b, 3) if bad_b > 0 else float("nan")


def main() -> int:
    # Stopped by SIGTERM (timeout, a scheduler), it still stops every process it started.
    from remesh.embedded import stop_on_sigterm

    stop_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of training per run")
    parser.add_argument(
        "--mtbf", default="60,30", help="mean times between failures to run (s), comma-separated"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the failure schedule")
    args = parser.parse_args()
    configure_logging(level="warning")
    mtbfs = [float(x) for x in args.mtbf.split(",") if x.strip()]
    runs = []
    with tempfile.TemporaryDirectory(prefix="remesh-goodput-") as tmp:
        for mtbf in mtbfs:
            inplace = run_one("inplace", mtbf, args, Path(tmp) / f"inplace-{mtbf:g}")
            restart = run_one("restart", mtbf, args, Path(tmp) / f"restart-{mtbf:g}")
            runs.append((mtbf, inplace, restart))

    print()
    print(
        f"{'MTBF':>6} {'mode':<9}{'failures':>9}{'MTTR p50':>9}{'goodput':>9}{'running':>9}"
        + "".join(f"{b[:10]:>11}" for b in BADPUT)
    )
    for mtbf, *reports in runs:
        for r in reports:
            g, s = r["goodput"], r["summary"]
            mttr = f"{s['mttr_p50_s']:.2f}" if s["mttr_p50_s"] is not None else "-"
            print(
                f"{mtbf:>6g} {r['run']['mode']:<9}{s['recovered']:>4}/{s['failures']:<4}{mttr:>9}"
                f"{g['goodput']:>9.3f}{g['running_goodput']:>9.3f}"
                + "".join(f"{g['badput_s'][b]:>10.1f}s" for b in BADPUT)
            )
    print("(badput in seconds of wall time; 'running' is goodput from the first training step on)")
    per_mtbf = [
        {
            "mtbf_s": mtbf,
            "failures": [inplace["summary"]["failures"], restart["summary"]["failures"]],
            "inplace_goodput": inplace["goodput"]["goodput"],
            "restart_goodput": restart["goodput"]["goodput"],
            "inplace_running_goodput": inplace["goodput"]["running_goodput"],
            "restart_running_goodput": restart["goodput"]["running_goodput"],
            "inplace_badput_vs_restart": badput_ratio(inplace, restart, "goodput"),
            "inplace_running_badput_vs_restart": badput_ratio(inplace, restart, "running_goodput"),
            "inplace_mttr_p50_s": inplace["summary"]["mttr_p50_s"],
            "restart_mttr_p50_s": restart["summary"]["mttr_p50_s"],
        }
        for mtbf, inplace, restart in runs
    ]
    print(json.dumps({**per_mtbf[0], "duration_s": args.duration, "runs": per_mtbf}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``remesh demo``: a whole elastic JAX job on this machine, hosts failed on purpose, recovery measured.

Starts an embedded redis-server and GCS emulator (unless --redis / --gcs name real ones), the
coordinator, and N hosts plus hot spares, each a real agent process supervising a trainer of the
example language model (a multi-process JAX job on CPU devices). It fails a host at --kill-at steps
(or at random with --mtbf), shows the recovery live, and writes report.json and timeline.png to --out.
--baseline restart runs the same schedule the way jobs recover today (everything killed, relaunched
from the newest checkpoint); `remesh report A B` compares two runs. Everything started is stopped on
exit and on Ctrl-C.

``remesh report DIR [DIR]``: print one run's report, or compare two.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import structlog
from rich.console import Console
from rich.table import Table

from remesh.demo.display import Display
from remesh.demo.report import PHASES, compare
from remesh.demo.runner import DemoConfig, DemoError, DemoRun, Schedule
from remesh.embedded import stop_on_sigterm

log = structlog.get_logger("remesh.cli")


# The demo model width for a sharded state: divides by 4, 6 and 8 devices (and 4 heads).
SHARDED_D_MODEL = 96


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of steps") from None


def _snapshot_every(text: str) -> str:
    """The trainers' --snapshot-every, checked here: the demo's trainers would only fail on it later."""
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f'{text!r} is not a number of steps (1 or more) or "auto"')


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "demo",
        help="run an elastic JAX job here, fail hosts on purpose, watch remesh recover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hosts", type=int, default=3, help="active hosts (JAX processes)")
    p.add_argument("--spares", type=int, default=1, help="hot spares (ignored by --baseline restart)")
    p.add_argument("--steps", type=int, default=300, help="train this many steps")
    p.add_argument(
        "--kill-at", type=_int_list, default=None, metavar="STEP[,STEP...]",
        help="fail a host when training reaches these steps (default: 40%% of --steps; '' for none)",
    )  # fmt: skip
    p.add_argument(
        "--kill", default="any", metavar="TARGET[,TARGET...]",
        help="which host each failure hits, in turn: any, rank0 (the host of JAX process 0) or a host id",
    )  # fmt: skip
    p.add_argument("--how", choices=["kill", "stop"], default="kill",
                   help="kill: SIGKILL the host; stop: SIGSTOP it (a silent host)")  # fmt: skip
    p.add_argument("--mtbf", type=float, default=None, metavar="SECONDS",
                   help="also fail hosts at random, this mean time between failures apart (seeded)")  # fmt: skip
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="stop after this much training time even before --steps")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed for --kill any and --mtbf")
    p.add_argument("--baseline", choices=["restart"], default=None,
                   help="restart: recover the way jobs do today, by relaunching the whole job")  # fmt: skip
    p.add_argument("--out", default="remesh-demo", help="folder for report.json, timeline.png and logs")
    p.add_argument("--redis", default=os.environ.get("REMESH_REDIS_URL"),
                   help="Redis URL (env REMESH_REDIS_URL); default: an embedded redis-server")  # fmt: skip
    p.add_argument("--gcs", default=os.environ.get("REMESH_GCS_URL"),
                   help="gs://BUCKET/PREFIX for checkpoints (env REMESH_GCS_URL); default: an embedded GCS emulator")  # fmt: skip
    p.add_argument("--port", type=int, default=0, help="the coordinator's gRPC port (default: any free one)")
    p.add_argument("--checkpoint-every", type=int, default=25, help="checkpoint every N steps (rank 0)")
    p.add_argument(
        "--snapshot-every",
        type=_snapshot_every,
        default="auto",
        help='host-memory snapshots every N steps, or "auto" (the default: the interval follows what a '
        "snapshot costs and the run's MTBF)",
    )
    p.add_argument(
        "--trainer-mtbf",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the failure interval the trainers' automatic cadence assumes until the coordinator observes "
        "one (default: --mtbf, else 60, since this run fails on purpose; 0: remesh's default, 3 hours)",
    )
    p.add_argument(
        "--d-model",
        type=int,
        default=None,
        help=f"model width (default {DemoConfig.d_model}; {SHARDED_D_MODEL} with --sharding fsdp/hsdp, which "
        "divides by 4, 6 and 8 devices so every matrix stays sharded through a shrink)",
    )
    p.add_argument("--layers", type=int, default=DemoConfig.layers, help="transformer layers")
    p.add_argument("--seq-len", type=int, default=DemoConfig.seq_len, help="tokens per training row")
    p.add_argument(
        "--sharding",
        choices=("replicated", "fsdp", "hsdp"),
        default=DemoConfig.sharding,
        help="the state's layout: whole on every host, sharded over every device (fsdp), or sharded "
        "inside replica groups of two hosts (hsdp); fsdp/hsdp want a --d-model that divides by the "
        "device counts (e.g. 96)",
    )
    p.add_argument(
        "--step-sleep", type=float, default=0.05, help="pause after each step (stands for compute)"
    )
    p.set_defaults(run=run)

    r: argparse.ArgumentParser = sub.add_parser(
        "report",
        help="print a demo's recovery report, or compare two (remesh report A B)",
        description="Print the report.json of a `remesh demo --out DIR` run, or compare two runs side by side.",
    )
    r.add_argument(
        "runs", nargs="+", metavar="DIR", help="one or two demo output folders (or report.json files)"
    )
    r.add_argument("--json", action="store_true", help="print the comparison as JSON")
    r.set_defaults(run=run_report)


def run(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    kill_at = (
        args.kill_at
        if args.kill_at is not None
        else ((max(1, int(args.steps * 0.4)),) if args.steps > 1 else ())
    )
    config = DemoConfig(
        hosts=args.hosts,
        spares=args.spares,
        steps=args.steps,
        schedule=Schedule(
            at_steps=kill_at,
            targets=tuple(t.strip() for t in args.kill.split(",") if t.strip()) or ("any",),
            how=args.how,
            mtbf_s=args.mtbf,
            seed=args.seed,
        ),
        mode=args.baseline or "inplace",
        out=Path(args.out),
        redis_url=args.redis,
        gcs_url=args.gcs,
        checkpoint_every=args.checkpoint_every,
        snapshot_every=args.snapshot_every,
        trainer_mtbf_s=args.trainer_mtbf,
        step_sleep=args.step_sleep,
        duration_s=args.duration,
        port=args.port,
        d_model=args.d_model or (DemoConfig.d_model if args.sharding == "replicated" else SHARDED_D_MODEL),
        layers=args.layers,
        seq_len=args.seq_len,
        sharding=args.sharding,
    )
    # SIGTERM stops the demo like Ctrl-C does: every process it started is stopped.
    stop_on_sigterm()
    try:
        demo = DemoRun(config, Display(console))
        report = demo.run()
    except DemoError as exc:
        console.print(f"[red]remesh demo: {exc}[/]")
        return 2
    except KeyboardInterrupt:
        console.print("\ninterrupted: every process the demo started has been stopped")
        return 130
    _print_summary(console, report, config.out)
    ok = (report["run"]["reached_target"] and not report["summary"].get("events_after_finish")) or bool(
        config.duration_s
    )
    return 0 if ok and report["summary"]["recovered"] == report["summary"]["failures"] else 1


def _print_summary(console: Console, report: dict[str, Any], out: Path) -> None:
    s, g = report["summary"], report["goodput"]
    console.print()
    console.print(
        f"[bold]{'remesh in-place recovery' if report['run']['mode'] == 'inplace' else 'whole-job restart baseline'}[/]: "
        f"trained to step {report['run']['final_step']} in {g['wall_s']:.1f}s, "
        f"{s['recovered']}/{s['failures']} failure(s) recovered, epochs {s['first_epoch']}→{s['last_epoch']}"
    )
    for f in report["failures"]:
        if not f["recovered"]:
            console.print(
                f"  failure {f['index'] + 1} ({f['host_id']}): [red]not recovered[/] ({f.get('missing')})"
            )
            continue
        phases = "  ".join(f"{k} {v:.2f}" for k, v in f["phases"].items())
        console.print(
            f"  failure {f['index'] + 1}: {f['how']} {f['host_id']} (rank {f['rank']}) → "
            f"[bold green]recovered in {f['mttr_s']:.2f}s[/] (detected in {f['detected_s']:.2f}s), "
            f"restored step {f['restored_step']} from {', '.join(f['restore_sources'])}, "
            f"{f['steps_lost']} step(s) lost"
        )
        if f.get("restored_bytes"):
            tiers = ", ".join(f"{tier} {n / 2**20:.1f} MiB" for tier, n in f["restored_bytes"].items())
            console.print(f"    state restored from: {tiers}", style="dim")
        console.print(f"    phases (s): {phases}", style="dim")
    if s.get("finished_step") is not None:
        after = s.get("events_after_finish") or []
        codes = report["run"].get("agent_exit_codes") or {}
        console.print(
            f"  the job finished at step {s['finished_step']}: "
            + (
                f"[red]{', '.join(after)} after it[/]"
                if after
                else "nothing declared dead and no epoch after it"
            )
            + (f", {len(codes)} agent(s) exited 0" if codes and set(codes.values()) == {0} else "")
        )
    bad = ", ".join(f"{k} {v:.1f}s" for k, v in g["badput_s"].items() if abs(v) >= 0.05)
    console.print(
        f"  goodput {g['goodput']:.3f}, {g['running_goodput']:.3f} after start-up (productive {g['productive_s']:.1f}s of {g['wall_s']:.1f}s; badput: {bad})"
    )
    console.print(f"report: {out / 'report.json'}   timeline: {out / 'timeline.png'}   logs: {out / 'logs'}")


def _load(path_text: str) -> dict[str, Any]:
    path = Path(path_text)
    if path.is_dir():
        path = path / "report.json"
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"remesh report: {path} does not exist; run `remesh demo --out DIR` first") from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"remesh report: {path} is not a report ({exc})") from None
    if not {"run", "summary", "goodput", "failures"} <= doc.keys():
        raise SystemExit(f"remesh report: {path} is not a remesh demo report")
    return doc


def run_report(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    if len(args.runs) > 2:
        console.print("[red]remesh report: give one run, or two to compare[/]")
        return 2
    reports = [_load(p) for p in args.runs]
    if len(reports) == 1:
        report = reports[0]
        if args.json:
            print(json.dumps(report["summary"] | {"goodput": report["goodput"]}))
            return 0
        _print_summary(console, report, Path(args.runs[0]))
        table = Table("failure", "host", *PHASES, "MTTR", "lost", title="recovery phases (s)")
        for f in report["failures"]:
            if f["recovered"]:
                table.add_row(
                    str(f["index"] + 1), f["host_id"],
                    *(f"{f['phases'][p]:.2f}" if p in f["phases"] else "-" for p in PHASES),
                    f"{f['mttr_s']:.2f}", str(f["steps_lost"]),
                )  # fmt: skip
        console.print(table)
        return 0
    rows = compare(*reports)
    if args.json:
        print(json.dumps([dict(zip(("what", "a", "b", "b_over_a"), row, strict=True)) for row in rows]))
        return 0
    table = Table("", f"A: {args.runs[0]}", f"B: {args.runs[1]}", "B/A")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return 0

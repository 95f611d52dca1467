"""Mean time to recovery of a training job that loses a host: remesh in place vs a full-job restart.

Runs tinylm data-parallel on 3 hosts (each an agent supervising a JAX trainer process with 2 CPU
devices) plus hot spares, all on this machine, and per trial SIGKILLs one host mid-run:

- in-place:       a host that is not rank 0 (survivors re-mesh with a spare, restore from host memory);
- agent-restart:  the host of rank 0 (the JAX coordination service dies with it, survivors' runtimes
                  abort, their agents hand over to their warm standby processes);
- full restart:   the baseline users have today, in the same run: every process of the job is killed,
                  the job is launched again and restores from the newest checkpoint (local, every
                  ``--checkpoint-every`` steps).

MTTR is the time from the SIGKILL to the first training step completed on the new topology by every
member (the coordinator's epoch_live event). The phases come from the coordinator's event log
(detect, decide) and the trainers' acknowledgements (re-initialise, restore, compile, first step).
Lost steps are the steps completed before the kill that had to be trained again.

With ``--sharding fsdp`` (or ``hsdp``) the state is sharded over the devices of every host (or of
each replica group of two hosts), and ``--state-mb`` sizes the model so that parameters and Adam
moments take about that much in all; the in-place recovery then takes the lost host's shards from a
survivor's buddy copy (FSDP) or from the other replica group (HSDP), and the bytes each member
restored per tier are reported. The full restart restores the sharded checkpoint every host wrote.

    python benchmarks/detection.py ...   (failure detection alone)
    python benchmarks/recovery.py [--trials 5]
    python benchmarks/recovery.py --sharding fsdp --state-mb 256 [--trials 3]

Prints a table and, as its last line, a JSON object with inplace_mttr_p50_s,
agent_restart_mttr_p50_s, full_restart_mttr_p50_s, inplace_vs_full_ratio, lost_steps_max, trials,
state_mb, sharding and inplace_bytes_by_tier (median over trials of the bytes all members restored
from each tier); and what a failure costs in all, since the steps a recovery replays are paid again:
inplace_compile_p50_s (the compile phase of the in-place recoveries), inplace_replayed_steps_max,
healthy_step_s_p50, and inplace_cost_vs_full_ratio: (MTTR + steps replayed x healthy step) of the
in-place recoveries over the same of the full restarts, medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remesh.cli.logs import configure_logging
from remesh.embedded import RedisServer
from remesh.embedded.cluster import LocalCluster, wait_for
from remesh.v1 import coordinator_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
HOSTS = ("host-0", "host-1", "host-2")
PHASES = ("reinit", "restore", "compile", "first_step")
# Where a restore's time goes (part of "restore"): agreeing on the restore point with the other
# members, fetching pieces from them, building the arrays on the new mesh.
RESTORE_PARTS = ("restore_agree", "restore_fetch", "restore_build")
# Where compiling the step for the new mesh goes (part of "compile", which runs beside the restore):
# tracing (replaying the program traced once per process), lowering for the mesh, XLA (a persistent
# cache hit when this mesh shape was seen before).
COMPILE_PARTS = ("compile_trace", "compile_lower", "compile_xla")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Trial:
    kind: str
    mttr: float
    lost_steps: int
    phases: dict[str, float] = field(default_factory=dict)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)


def state_bytes(d_model: int, layers: int, seq_len: int) -> int:
    """Bytes of tinylm's whole training state (parameters and optimizer moments) at this size."""
    import functools

    import jax

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the example is not an installed package
    from examples.tinylm import model

    config = model.Config(seq_len=seq_len, d_model=d_model, n_layers=layers, d_mlp=4 * d_model)
    shapes = jax.eval_shape(functools.partial(model.init_state, 0, config))
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))


def d_model_for(state_mb: float, layers: int, seq_len: int) -> int:
    """The smallest width, a multiple of 48 (so it splits over 4, 6 and 8 devices and 4 heads), whose
    state takes at least ``state_mb`` MiB."""
    d = 48
    while state_bytes(d, layers, seq_len) < state_mb * 2**20:
        d += 48
    return d


def trainer_command(args: argparse.Namespace, checkpoint_dir: Path | None) -> list[str]:
    cmd = [
        sys.executable, "-m", "examples.tinylm.train_elastic", "--steps", "1000000",
        "--d-model", str(args.d_model), "--layers", str(args.layers), "--seq-len", str(args.seq_len),
        "--log-every", "50", "--step-sleep", str(args.step_sleep), "--sharding", args.sharding,
    ]  # fmt: skip
    if checkpoint_dir is not None:
        cmd += ["--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", str(args.checkpoint_every)]
    return cmd


class Job:
    def __init__(
        self, tmp: Path, redis_url: str, args: argparse.Namespace, *, spares: int, checkpoint_dir: Path | None
    ) -> None:
        self.args = args
        self.job = f"bench-{uuid.uuid4().hex[:8]}"
        (tmp / self.job).mkdir(parents=True)
        self.cluster = LocalCluster(tmp / self.job, redis_url, self.job)
        self.checkpoint_dir = checkpoint_dir
        self.spares = 0
        try:
            self.cluster.start_coordinator("--world-size", str(len(HOSTS)))
            for h in HOSTS:
                self.start(h)
            for _ in range(spares):
                self.add_spare()
            self.wait_live(1, 300)
        except BaseException as exc:
            if not isinstance(exc, KeyboardInterrupt):
                progress(f"remesh: the job did not start; its logs end with:\n{self.cluster.log_tails()}")
            self.cluster.close()
            raise

    def start(self, host: str, spare: bool = False) -> None:
        self.cluster.start_agent(
            host,
            spare=spare,
            trainer=trainer_command(self.args, self.checkpoint_dir),
            env=ENV,
            extra=() if self.args.trainer_nice is None else ("--trainer-nice", str(self.args.trainer_nice)),
        )

    def add_spare(self) -> None:
        self.start(f"spare-{self.spares}", spare=True)
        self.spares += 1

    def events(self, *types: Any) -> list[pb.Event]:
        return list(self.cluster.stub().ReplayEvents(pb.ReplayEventsRequest(types=list(types)), timeout=20))

    def wait_live(self, epoch: int, timeout: float) -> pb.Event:
        def live() -> pb.Event | None:
            return next((e for e in self.events(pb.EVENT_TYPE_EPOCH_LIVE) if e.epoch == epoch), None)

        return wait_for(live, timeout, f"epoch {epoch} to be live", interval=0.1)  # type: ignore[return-value]

    def wait_warm(self) -> None:
        """Every agent's standby trainer process has imported JAX and waits for a rank."""

        def warm() -> bool:
            return all(
                "standby: no rank for this process yet" in log.read_text(errors="replace")
                for log in (self.cluster.tmp / name for name in self._agent_logs())
            )

        wait_for(warm, 120, "standby trainers to be warm", interval=0.5)

    def _agent_logs(self) -> list[str]:
        return [p.name for p in self.cluster.tmp.glob("agent-*.log")]

    def step_now(self) -> int:
        return max((m.last_step for m in self.cluster.members().values()), default=-1)

    def wait_step(self, step: int) -> None:
        wait_for(lambda: self.step_now() >= step, 300, f"step {step}", interval=0.1)

    def close(self) -> None:
        self.cluster.close()


def bytes_of(job: Job, epoch: int) -> dict[str, int]:
    """Bytes every member of ``epoch`` restored, per tier, summed over the members."""
    total: dict[str, int] = {}
    for e in job.events(pb.EVENT_TYPE_EPOCH_ACKED):
        if e.epoch == epoch:
            for tier, n in json.loads(e.details.get("restored_bytes", "{}")).items():
                total[tier] = total.get(tier, 0) + int(n)
    return total


def phases_of(job: Job, epoch: int) -> dict[str, float]:
    acks = [e for e in job.events(pb.EVENT_TYPE_EPOCH_ACKED) if e.epoch == epoch]
    per_member = [json.loads(e.details["phases"]) for e in acks]
    # The slowest member sets the pace: a step needs every member.
    return (
        {p: max(m.get(p, 0.0) for m in per_member) for p in (*PHASES, *RESTORE_PARTS, *COMPILE_PARTS)}
        if per_member
        else {}
    )


def inplace_trial(job: Job, kind: str) -> Trial:
    topology = job.cluster.topology()
    ranks = {m.rank: m.host_id for m in topology.members}
    victim = ranks[0] if kind == "agent-restart" else ranks[1 + (topology.epoch % (len(ranks) - 1))]
    t0, first = time.monotonic(), job.step_now()
    job.wait_step(first + 5)
    healthy = (time.monotonic() - t0) / max(1, job.step_now() - first)
    before = job.step_now()
    t_kill = time.time()
    job.cluster.agents[victim].signal_group(signal.SIGKILL)
    live = job.wait_live(topology.epoch + 1, 300)
    after = job.cluster.topology()
    dead = next(e for e in job.events(pb.EVENT_TYPE_MEMBER_DEAD) if e.host_id == victim and e.time >= t_kill)
    changed = next(e for e in job.events(pb.EVENT_TYPE_TOPOLOGY_CHANGED) if e.epoch == after.epoch)
    phases = {"detect": dead.time - t_kill, "decide": changed.time - dead.time, **phases_of(job, after.epoch)}
    job.cluster.agents[victim].popen.wait(10)
    job.add_spare()
    job.wait_warm()
    restored = min(
        int(e.details["restored_step"])
        for e in job.events(pb.EVENT_TYPE_EPOCH_ACKED)
        if e.epoch == after.epoch
    )
    phases["healthy_step"] = healthy
    return Trial(kind, live.time - t_kill, max(0, before - restored), phases, bytes_of(job, after.epoch))


def full_restart_trial(tmp: Path, redis_url: str, args: argparse.Namespace, checkpoints: Path) -> Trial:
    job = Job(tmp, redis_url, args, spares=0, checkpoint_dir=checkpoints)
    try:
        # Half an interval after a committed checkpoint (a large state takes a while to write).
        wait_for(lambda: committed(checkpoints) >= args.checkpoint_every, 600, "a committed checkpoint", 0.2)
        job.wait_step(committed(checkpoints) + args.checkpoint_every // 2)
        before = job.step_now()
        t_kill = time.time()
        for proc in job.cluster.procs:  # the whole job: coordinator, agents, trainers
            proc.signal_group(signal.SIGKILL)
    finally:
        job.close()
    relaunched = Job(tmp, redis_url, args, spares=0, checkpoint_dir=checkpoints)
    try:
        live = relaunched.wait_live(1, 300)
        acks = relaunched.events(pb.EVENT_TYPE_EPOCH_ACKED)
        restored = min(int(e.details["restored_step"]) for e in acks)
        return Trial(
            "full restart",
            live.time - t_kill,
            max(0, before - restored),
            phases_of(relaunched, 1),
            bytes_of(relaunched, 1),
        )
    finally:
        relaunched.close()


def committed(checkpoints: Path) -> int:
    """The newest step with a commit marker in a local checkpoint directory (-1: none)."""
    steps = (int(p.parent.name.removeprefix("step_")) for p in checkpoints.glob("step_*/COMMITTED"))
    return max(steps, default=-1)


def summary(trials: list[Trial], kind: str) -> tuple[float, float]:
    values = [t.mttr for t in trials if t.kind == kind]
    return (statistics.median(values), max(values)) if values else (float("nan"), float("nan"))


def main() -> int:
    # Stopped by SIGTERM (timeout, a scheduler), it still stops every process it started.
    from remesh.embedded import stop_on_sigterm

    stop_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=5, help="failures of each kind")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--sharding", choices=("replicated", "fsdp", "hsdp"), default="replicated")
    parser.add_argument(
        "--state-mb", type=float, help="size the model to about this much state (sets --d-model; --layers 2)"
    )
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument(
        "--checkpoint-every", type=int, default=20, help="baseline checkpoint interval (steps)"
    )
    parser.add_argument("--trainer-nice", type=int, help="the agents' --trainer-nice (default: theirs)")
    args = parser.parse_args()
    if args.state_mb:
        args.layers = 2
        args.seq_len = 8  # few tokens per step: the state is what this measures, not the compute
        args.d_model = d_model_for(args.state_mb, args.layers, args.seq_len)
    mb = state_bytes(args.d_model, args.layers, args.seq_len) / 2**20
    configure_logging(level="warning")
    progress(f"remesh: {args.sharding} state of {mb:.0f} MiB (d_model {args.d_model}, {args.layers} layers)")
    trials: list[Trial] = []
    with (
        tempfile.TemporaryDirectory(prefix="remesh-recovery-") as tmp_name,
        RedisServer(appendonly=False) as redis,
    ):
        tmp = Path(tmp_name)
        progress(f"remesh: starting {len(HOSTS)} hosts and 2 hot spares")
        job = Job(tmp, redis.url, args, spares=2, checkpoint_dir=None)
        try:
            job.wait_warm()
            for i in range(args.trials):
                for kind in ("in-place", "agent-restart"):
                    trial = inplace_trial(job, kind)
                    trials.append(trial)
                    progress(
                        f"  {kind} {i + 1}/{args.trials}: MTTR {trial.mttr:.2f}s, lost {trial.lost_steps} step(s)"
                    )
        except BaseException as exc:
            if not isinstance(exc, KeyboardInterrupt):
                kept = Path(tempfile.mkdtemp(prefix="remesh-recovery-failed-"))
                shutil.copytree(job.cluster.tmp, kept, dirs_exist_ok=True)
                progress(f"remesh: a trial failed; the job's logs are kept in {kept}; they end with:")
                progress(job.cluster.log_tails())
            raise
        finally:
            job.close()
        for i in range(args.trials):
            trial = full_restart_trial(tmp, redis.url, args, tmp / f"checkpoints-{i}")
            trials.append(trial)
            progress(
                f"  full restart {i + 1}/{args.trials}: MTTR {trial.mttr:.2f}s, lost {trial.lost_steps} step(s)"
            )

    print()
    header = f"{'path':<16}{'MTTR p50':>10}{'max':>8}{'lost max':>10}" + "".join(
        f"{p:>12}" for p in ("detect", "decide", *PHASES)
    )
    print(header)
    for kind in ("in-place", "agent-restart", "full restart"):
        rows = [t for t in trials if t.kind == kind]
        p50, worst = summary(trials, kind)
        cells = "".join(
            f"{statistics.median([t.phases.get(p, 0.0) for t in rows]):>12.2f}"
            for p in ("detect", "decide", *PHASES)
        )
        print(f"{kind:<16}{p50:>10.2f}{worst:>8.2f}{max(t.lost_steps for t in rows):>10}{cells}")
    print()
    for what, parts in (("restore", RESTORE_PARTS), ("compile", COMPILE_PARTS)):
        print(f"{what + ', of which':<30}" + "".join(f"{p.removeprefix(what + '_'):>10}" for p in parts))
        for kind in ("in-place", "agent-restart", "full restart"):
            rows = [t for t in trials if t.kind == kind]
            print(
                f"{kind:<30}"
                + "".join(f"{statistics.median([t.phases.get(p, 0.0) for t in rows]):>10.2f}" for p in parts)
            )
    print()
    tiers = sorted({tier for t in trials for tier in t.bytes_by_tier})
    print(f"{'bytes restored (MiB, median)':<30}" + "".join(f"{tier:>10}" for tier in tiers))
    for kind in ("in-place", "agent-restart", "full restart"):
        rows = [t for t in trials if t.kind == kind]
        medians = [statistics.median([t.bytes_by_tier.get(tier, 0) for t in rows]) / 2**20 for tier in tiers]
        print(f"{kind:<30}" + "".join(f"{m:>10.1f}" for m in medians))
    inplace, _ = summary(trials, "in-place")
    restart, _ = summary(trials, "agent-restart")
    full, _ = summary(trials, "full restart")
    healthy = statistics.median([t.phases["healthy_step"] for t in trials if "healthy_step" in t.phases])

    def cost(kind: str) -> float:
        """What a failure cost the job: its MTTR plus the steps it replayed, at a healthy step each."""
        return statistics.median(t.mttr + t.lost_steps * healthy for t in trials if t.kind == kind)

    inplace_cost, full_cost = cost("in-place"), cost("full restart")
    cost_ratio = inplace_cost / full_cost
    print(
        f"\ncost of a failure (MTTR + replayed steps x {healthy:.3f}s), median: in place "
        f"{inplace_cost:.2f}s, full restart {full_cost:.2f}s, ratio {cost_ratio:.3f}"
    )
    result = {
        "inplace_mttr_p50_s": round(inplace, 3),
        "agent_restart_mttr_p50_s": round(restart, 3),
        "full_restart_mttr_p50_s": round(full, 3),
        "inplace_vs_full_ratio": round(inplace / full, 3),
        "lost_steps_max": max(t.lost_steps for t in trials if t.kind != "full restart"),
        "full_restart_lost_steps_max": max(t.lost_steps for t in trials if t.kind == "full restart"),
        "trials": args.trials,
        # Seconds per step before each kill (including --step-sleep): the first step on the new
        # topology, part of the MTTR, takes about this long however fast the recovery.
        "healthy_step_s_p50": round(healthy, 3),
        "inplace_compile_p50_s": round(
            statistics.median([t.phases.get("compile", 0.0) for t in trials if t.kind == "in-place"]), 3
        ),
        "inplace_replayed_steps_max": max(t.lost_steps for t in trials if t.kind == "in-place"),
        "inplace_cost_vs_full_ratio": round(cost_ratio, 3),
        "state_mb": round(mb, 1),
        "sharding": args.sharding,
        "inplace_bytes_by_tier": {
            tier: int(
                statistics.median([t.bytes_by_tier.get(tier, 0) for t in trials if t.kind == "in-place"])
            )
            for tier in tiers
        },
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""remesh on whatever accelerator JAX finds: steady-state cost of snapshots, device memory, copy
speeds, every tier bitwise, and a trainer killed and restored by its agent.

    python benchmarks/accelerator.py [--state-gb G] [--steps N] [--rounds R] [--snapshot-every K]
        [--width W] [--batch B] [--skip-job]

Runs on the backend JAX picks (the CPU here; the TPU on the accelerator machine), in one run:

1. **Healthy steps, snapshots off and on, in alternating rounds.** A user's own loop
   (``Session.epochs`` with ``epoch.jit``) trains an MLP stack with Adam whose state is --state-gb:
   bfloat16 weights, float32 first moments, bfloat16 second moments. Each round is a ``Session`` of
   its own in this process (run alone: no agent, ``SoloAgent``), closed before the next. A step's time
   is the interval between consecutive steps the loop got back; the first --warmup steps (compiling)
   and the last are left out. The off round first, then the on round: the device's peak-memory
   counter only grows, so after the first two rounds it holds each mode's peak exactly (elsewhere, and
   on CPU, the peak of the live bytes sampled every few milliseconds).
2. **Copy speeds**: the snapshots' own bytes and background seconds (device to host to the snapshot
   store), and an in-process restore: a snapshot held in memory (and one read back from /dev/shm)
   built onto the device, timed to ``block_until_ready``.
3. **Every tier that runs here, bitwise**: the trained state through the memory tier, /dev/shm (read
   back by a fresh store, as a restarted trainer does), the peer/buddy exchange (TCP: where sockets
   open), local checkpoints (Orbax, and the plain pieces format), and GCS (an emulator: where TCP
   opens); compared byte for byte with what went in.
4. **A one-host job under a real coordinator and agent over Unix sockets** (Redis too): its trainer is
   SIGKILLed mid-run, the agent starts a new one, which restores from /dev/shm; MTTR by phase (from the
   kill), and the final state compared bitwise with round 1's uninterrupted run of the same steps.

Prints a table, a line "all figures: {JSON}" and, last, one JSON object with backend, state_gb,
overhead_ratio_mean, overhead_ratio_p50, peak_device_memory_ratio, snapshot_every_kept,
snapshot_gbps, restore_gbps, trainer_restart_mttr_s and bitwise.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PyTree = Any


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- the model ---------------------------------------------------------------------------------


class Model:
    """An MLP stack of ``layers`` square ``width`` x ``width`` bfloat16 weights, trained with Adam
    (float32 first moments, bfloat16 second moments) on data made on the device from the step
    number: the state is about 8 bytes a weight, and every replayed step sees its own batch."""

    def __init__(self, state_gb: float, width: int, batch: int) -> None:
        self.width = width
        self.batch = batch
        self.layers = max(2, round(state_gb * 1e9 / 8 / (width * width)))

    @property
    def state_bytes(self) -> int:
        weights = self.layers * self.width * self.width
        return weights * (2 + 4 + 2) + 4

    def _optimizer(self) -> Any:
        import jax.numpy as jnp
        import optax

        return optax.adam(1e-4, mu_dtype=jnp.float32)

    def init_state(self) -> PyTree:
        import jax
        import jax.numpy as jnp

        keys = jax.random.split(jax.random.PRNGKey(0), self.layers)
        scale = 1.0 / math.sqrt(self.width)
        params = [
            (jax.random.normal(k, (self.width, self.width), jnp.float32) * scale).astype(jnp.bfloat16)
            for k in keys
        ]
        return {"params": params, "opt": self._optimizer().init(params)}

    def train_step(self, state: PyTree, batch: Any) -> tuple[PyTree, dict[str, Any]]:
        import jax
        import jax.numpy as jnp
        import optax

        key = jax.random.fold_in(jax.random.PRNGKey(1), batch[0])
        x = jax.random.normal(key, (self.batch, self.width), jnp.bfloat16)
        target = jnp.sin(x)

        def loss_fn(params: list[Any]) -> Any:
            h = x
            for w in params:
                h = jnp.tanh(h @ w)
            return jnp.mean(jnp.square((h - target).astype(jnp.float32)))

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = self._optimizer().update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": loss}


def digest(leaves: list[Any]) -> str:
    """sha256 over every leaf's dtype name, shape and raw bytes: equal digests, equal bits."""
    import numpy as np

    h = hashlib.sha256()
    for leaf in leaves:
        host = np.asarray(leaf)
        h.update(f"{host.dtype.name}{host.shape}".encode())
        h.update(host.reshape(-1).view(np.uint8).tobytes())
    return h.hexdigest()


def bitwise_equal(a: list[Any], b: list[Any]) -> bool:
    import numpy as np

    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype.name != y.dtype.name or x.shape != y.shape:
            return False
        if not np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)):
            return False
    return True


# ---- device memory -----------------------------------------------------------------------------


class MemoryWatch:
    """The device's bytes in use, sampled every few milliseconds while a round runs (the device's
    own counter where it keeps one; on CPU the live arrays' bytes)."""

    def __init__(self) -> None:
        import jax

        self.device = jax.local_devices()[0]
        # Where the device keeps its own peak counter the samples are only a second opinion, taken
        # rarely so that they do not compete with the loop's dispatch; elsewhere they are the figure.
        self.every_s = 0.05 if self.counted() else 0.005
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def counted(self) -> bool:
        stats = self.device.memory_stats()
        return bool(stats and "bytes_in_use" in stats)

    def in_use(self) -> int:
        stats = self.device.memory_stats()
        if stats and "bytes_in_use" in stats:
            return int(stats["bytes_in_use"])
        import jax

        # Each buffer once: a shard taken from an array (``shard.data``) is an array of its own over
        # the same buffer, and a snapshot holds such shards of a state the loop may still hold.
        buffers = {}
        for x in jax.live_arrays():
            for shard in x.addressable_shards:
                data = shard.data
                buffers[(shard.device.id, data.unsafe_buffer_pointer())] = int(data.nbytes)
        return sum(buffers.values())

    def device_peak(self) -> int | None:
        """The device's own peak counter (it only grows), where it keeps one."""
        stats = self.device.memory_stats()
        return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None

    def __enter__(self) -> MemoryWatch:
        self.peak = self.in_use()
        self._thread = threading.Thread(target=self._sample, name="memory-watch", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self.in_use())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, self.in_use())


# ---- rounds ------------------------------------------------------------------------------------


def policy_for(snapshots: bool, args: argparse.Namespace, shm: Path) -> Any:
    from remesh.elastic import Policy

    if not snapshots:
        return Policy(snapshots_kept=0, buddy_every=0, snapshot_every=10**9, shm_dir=None)
    return Policy(
        snapshot_every=args.snapshot_every, buddy_every=0, shm_dir=None if args.no_shm else str(shm)
    )


def run_round(model: Model, snapshots: bool, args: argparse.Namespace, shm: Path) -> dict[str, Any]:
    """One Session alone in this process: --steps steps of the user's own loop."""
    import jax
    import numpy as np

    from remesh.elastic import Session
    from remesh.elastic.solo import SoloAgent

    job = f"accel-{uuid.uuid4().hex[:8]}"
    done_at: list[float] = []
    with contextlib.ExitStack() as stack:
        session = Session(
            init_state=model.init_state,
            devices_per_host=args.devices,
            policy=policy_for(snapshots, args, shm),
            agent=SoloAgent(job),
            job_id=job,
        )
        stack.callback(session.close)
        watch = stack.enter_context(MemoryWatch())
        final: list[Any] = []
        for epoch in session.epochs(args.steps):
            with epoch:
                step_fn = epoch.jit(model.train_step, out_shardings=(epoch.shardings, epoch.replicated))
                state = epoch.state
                for step in epoch.steps():
                    rows = np.full((args.devices,), step, np.int32)
                    state, metrics = step_fn(state, epoch.batch(rows))
                    if epoch.done(state, metrics) is not None:
                        done_at.append(time.perf_counter())
                done_at.append(time.perf_counter())
                final = [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
        stats = dict(session.stats)
    times = [b - a for a, b in itertools.pairwise(done_at)][args.warmup : -1]
    return {
        "snapshots": snapshots,
        "step_s": times,
        "peak_sampled": watch.peak,
        "device_peak": watch.device_peak(),
        "stats": stats,
        "final": final,
    }


# ---- tiers -------------------------------------------------------------------------------------


def tcp_opens() -> bool:
    try:
        with socket.create_server(("127.0.0.1", 0)):
            return True
    except OSError:
        return False


def tier_round_trips(final: list[Any], workdir: Path) -> dict[str, dict[str, Any]]:
    """``final`` (host arrays) through every tier that runs here; what came back compared bitwise."""
    import numpy as np

    from remesh.elastic.sharding import whole
    from remesh.elastic.snapshots import Snapshots, read_pieces, write_pieces

    pieces = {(i, whole(x.shape)): np.asarray(x) for i, x in enumerate(final)}
    shapes = [(tuple(x.shape), x.dtype) for x in final]
    nbytes = sum(int(x.nbytes) for x in final)
    out: dict[str, dict[str, Any]] = {}

    def trial(name: str, run: Callable[[], list[Any]]) -> None:
        t = time.perf_counter()
        try:
            back = run()
        except Exception as exc:
            out[name] = {"ran": True, "bitwise": False, "error": f"{type(exc).__name__}: {exc}"}
            progress(f"  tier {name}: FAILED {type(exc).__name__}: {exc}")
            return
        seconds = time.perf_counter() - t
        same = bitwise_equal(final, back)
        out[name] = {
            "ran": True,
            "bitwise": same,
            "seconds": round(seconds, 3),
            "gbps": round(nbytes / 1e9 / seconds, 2),
        }
        said = f"  tier {name}: {'bitwise' if same else 'DIFFERENT'} in {seconds:.2f}s"
        if name in onto_device:
            device_s = onto_device[name]
            out[name]["onto_device_s"] = round(device_s, 4)
            out[name]["onto_device_gbps"] = round(nbytes / 1e9 / device_s, 2)
            said += f" (onto the device {device_s:.3f}s, {nbytes / 1e9 / device_s:.2f} GB/s)"
        progress(said)

    def leaves_of(got: dict[Any, Any]) -> list[Any]:
        return [got[(i, whole(s))] for i, (s, _) in enumerate(shapes)]

    import jax

    from remesh.elastic.sharding import build

    mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("devices",))
    replicated = [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())] * len(shapes)
    onto_device: dict[str, float] = {}

    def restored(name: str, got: dict[Any, Any]) -> list[Any]:
        """``got`` built onto the devices as a restore does, timed to ``block_until_ready`` (a copy
        to the device is asynchronous), and read back for the comparison."""
        t = time.perf_counter()
        leaves = build(got, shapes, replicated)
        jax.block_until_ready(leaves)
        onto_device[name] = time.perf_counter() - t
        return [np.asarray(x) for x in leaves]

    def memory() -> list[Any]:
        store = Snapshots(2, None)
        store.put(1, 1, {k: np.array(v, copy=True) for k, v in pieces.items()})
        snap = store.get(1, shapes)
        assert snap is not None
        return restored("memory", snap.pieces)

    def host_shm() -> list[Any]:
        directory = Path(
            tempfile.mkdtemp(prefix="remesh-accel-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        )
        try:
            Snapshots(2, directory).put(1, 1, pieces)
            snap = Snapshots(2, directory).get(1, shapes)  # a fresh store: a restarted trainer's
            assert snap is not None and snap.tier == "host-shm", snap
            return restored("host-shm", snap.pieces)
        finally:
            import shutil

            shutil.rmtree(directory, ignore_errors=True)

    def pieces_file() -> list[Any]:
        path = workdir / "pieces.bin"
        write_pieces(path, 1, 1, pieces)
        _, got = read_pieces(path)
        return [np.array(x) for x in leaves_of(got)]

    def local_orbax() -> list[Any]:
        import jax

        from remesh.elastic.checkpoints import LocalCheckpoints

        store = LocalCheckpoints(workdir / "ckpt")
        store.save(1, 1, list(final))
        template = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
        return list(store.restore_state(1, template))

    def peer() -> list[Any]:
        from remesh.elastic.exchange import PieceServer, fetch

        server = PieceServer(lambda point: pieces if point == (1, 1) else {})
        try:
            got = fetch(f"127.0.0.1:{server.port}", (1, 1), list(pieces), 60.0)
        finally:
            server.close()
        return leaves_of(got)

    def gcs() -> list[Any]:
        import jax

        from remesh.elastic.checkpoints import GcsCheckpoints
        from remesh.embedded.gcs_server import FakeGcsServer

        with FakeGcsServer() as server:
            server.create_bucket("accel")
            store = GcsCheckpoints("accel", "job", server.client(), workdir / "gcs-staging")
            store.save(1, 1, list(final))
            template = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
            return list(store.restore_state(1, template))

    trial("memory", memory)
    trial("host-shm", host_shm)
    trial("pieces-file", pieces_file)
    trial("local", local_orbax)
    if tcp_opens():
        trial("peer", peer)
        trial("gcs", gcs)
    else:
        for name in ("peer", "gcs"):
            out[name] = {"ran": False, "why": "no TCP socket opens on this machine"}
            progress(f"  tier {name}: not run here (no TCP socket opens on this machine)")
    return out


# ---- a one-host job under a real agent ---------------------------------------------------------


def trainer_main(args: argparse.Namespace) -> int:
    """The trainer the agent starts (``accelerator.py trainer``): the same loop as the rounds, under
    the agent's local API, writing one line per step completed and its phases when it restores."""
    import jax
    import numpy as np

    from remesh.elastic import Policy, Session

    out = Path(args.out)
    model = Model(args.state_gb, args.width, args.batch)
    started = time.time()
    session = Session(
        init_state=model.init_state,
        devices_per_host=args.devices,
        policy=Policy(snapshot_every=args.snapshot_every, buddy_every=0, shm_dir=args.shm),
    )
    pid = os.getpid()

    def say(record: dict[str, Any]) -> None:
        with out.open("a") as f:
            f.write(json.dumps({"pid": pid, "t": time.time(), **record}) + "\n")

    for epoch in session.epochs(args.steps):
        with epoch:
            say({"ready": epoch.step, "source": epoch.restored_from, "process_started": started,
                 "phases": {k: round(v, 4) for k, v in epoch.phases.items()}})  # fmt: skip
            step_fn = epoch.jit(model.train_step, out_shardings=(epoch.shardings, epoch.replicated))
            state = epoch.state
            for step in epoch.steps():
                rows = np.full((args.devices,), step, np.int32)
                state, metrics = step_fn(state, epoch.batch(rows))
                result = epoch.done(state, metrics)
                if result is not None:
                    say({"step": result.step, "epoch": result.epoch, "snapshots": session.stats["snapshots"]})
            if epoch.last is not None:
                say({"step": epoch.last.step, "epoch": epoch.last.epoch})
            final = [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
    if session.rank == 0 and final:
        say({"final_digest": digest(final), "last_restore": session.last_restore})
    session.close()
    return 0


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_until(what: str, timeout: float, check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout:g}s")


def restart_job(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Redis, a coordinator and an agent, all on Unix sockets; the trainer is SIGKILLed once a
    snapshot exists, the agent starts a new one, and the job finishes."""
    from remesh.embedded import RedisServer

    sockets = Path(tempfile.mkdtemp(prefix="remesh-accel-", dir="/tmp"))
    coordinator_socket = f"unix:{sockets / 'coordinator.sock'}"
    job = f"accel-job-{uuid.uuid4().hex[:6]}"
    out = workdir / "trainer.jsonl"
    shm = Path(
        tempfile.mkdtemp(prefix="remesh-accel-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
        "PYTHONUNBUFFERED": "1",
    }
    procs: list[subprocess.Popen[bytes]] = []
    logs = Path(args.logs) if args.logs else workdir / "job-logs"
    logs.mkdir(parents=True, exist_ok=True)

    def start(name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (logs / f"{name}.log").open("wb") as log_file:
            proc = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    with RedisServer(appendonly=False, unix=True) as redis:
        try:
            start("coordinator", [sys.executable, "-m", "remesh.cli", "coordinator", "--insecure",
                   "--redis", redis.url, "--listen", coordinator_socket, "--job", job,
                   "--world-size", "1"])  # fmt: skip
            kill_at = args.kill_at or 2 * args.snapshot_every + args.snapshot_every // 2
            trainer = [sys.executable, str(Path(__file__).resolve()), "trainer", "--out", str(out),
                       "--state-gb", str(args.state_gb), "--width", str(args.width), "--batch", str(args.batch),
                       "--steps", str(args.steps), "--snapshot-every", str(args.snapshot_every),
                       "--devices", str(args.devices), "--shm", str(shm)]  # fmt: skip
            start("agent", [sys.executable, "-m", "remesh.cli", "agent", "--insecure",
                  "--coordinator", coordinator_socket, "--host-id", "host-0", "--job", job,
                  "--devices", str(args.devices), "--no-warm-standby", "--", *trainer])  # fmt: skip
            progress(
                f"  job {job}: waiting for step {kill_at} and a snapshot kept (the trainer starts and compiles first)"
            )
            first = wait_until(
                "the trainer's step before the kill",
                args.job_timeout,
                # Past --kill-at and once a snapshot is kept: a snapshot of gigabytes takes seconds,
                # and a trainer killed before its first is kept has nothing in /dev/shm to restore.
                lambda: next(
                    (
                        r
                        for r in read_lines(out)
                        if r.get("step", -1) >= kill_at and r.get("snapshots", 0) >= 1
                    ),
                    None,
                ),
            )
            victim = int(first["pid"])
            os.kill(victim, signal.SIGKILL)
            killed_at = time.time()
            progress(f"  SIGKILLed trainer pid {victim} after step {first['step']}")
            ready = wait_until(
                "the new trainer's restore",
                args.job_timeout,
                lambda: next((r for r in read_lines(out) if "ready" in r and r["pid"] != victim), None),
            )
            stepped = wait_until(
                "the new trainer's first step",
                args.job_timeout,
                lambda: next((r for r in read_lines(out) if "step" in r and r["pid"] == ready["pid"]), None),
            )
            finished = wait_until(
                "the job's end",
                args.job_timeout,
                lambda: next((r for r in read_lines(out) if "final_digest" in r), None),
            )
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in reversed(procs):
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            import shutil

            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(sockets, ignore_errors=True)
    phases = dict(ready["phases"])
    return {
        "killed_after_step": first["step"],
        "restored_step": ready["ready"],
        "restored_from": ready["source"],
        "mttr_s": stepped["t"] - killed_at,
        "process_start_s": ready["process_started"] - killed_at,
        "ready_s": ready["t"] - killed_at,
        "phases": phases,
        "final_digest": finished["final_digest"],
        "replayed_steps": int(first["step"]) - int(ready["ready"]),
    }


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "mode", nargs="?", default="bench", choices=["bench", "measure", "trainer"], help=argparse.SUPPRESS
    )
    parser.add_argument("--state-gb", type=float, default=None,
                        help="state size in GB (default: 2.2 on an accelerator, 0.05 on CPU)")  # fmt: skip
    parser.add_argument(
        "--width", type=int, default=None, help="MLP width (default: 8192 on an accelerator, 512 on CPU)"
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="rows per step (default: 4096 on an accelerator, 64 on CPU)"
    )
    parser.add_argument("--steps", type=int, default=120, help="steps per round and of the job")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of each round's timing")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each mode (off, on, off, on, ...)")
    parser.add_argument("--snapshot-every", type=int, default=10, help="K: a snapshot every K steps")
    parser.add_argument("--devices", type=int, default=1, help="devices this process uses")
    parser.add_argument(
        "--no-shm",
        action="store_true",
        help="snapshots stay in the process, no /dev/shm file: what the host copy costs without the file",
    )
    parser.add_argument(
        "--kill-at", type=int, default=0, help="SIGKILL the job's trainer after this step (default 2.5 K)"
    )
    parser.add_argument(
        "--job-timeout", type=float, default=300.0, help="seconds the job may take for each stage"
    )
    parser.add_argument("--skip-job", action="store_true", help="leave out the one-host job under an agent")
    parser.add_argument(
        "--logs",
        help="where the job's coordinator and agent (with its trainer) log (default: a temporary directory)",
    )
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--shm", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def measure_main(args: argparse.Namespace) -> int:
    """``accelerator.py measure``: the rounds and the tiers, in a process of their own (a TPU chip
    opens in one process at a time: the job's trainers need it after), written to ``--result``."""
    from remesh.cli.logs import configure_logging

    configure_logging(level="warning")
    import jax

    model = Model(args.state_gb, args.width, args.batch)
    progress(
        f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), state "
        f"{model.state_bytes / 1e9:.2f} GB in {model.layers} layers of {args.width}x{args.width}, batch "
        f"{args.batch}, {args.steps} steps a round"
    )
    workdir = Path(tempfile.mkdtemp(prefix="remesh-accel-"))
    shm = Path(
        tempfile.mkdtemp(prefix="remesh-accel-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for snapshots in (False, True):
            progress(f"round {r + 1}, snapshots {'on' if snapshots else 'off'}")
            rounds.append(run_round(model, snapshots, args, shm))
            got = rounds[-1]
            progress(
                f"  step p50 {statistics.median(got['step_s']) * 1e3:.1f} ms, mean "
                f"{statistics.fmean(got['step_s']) * 1e3:.1f} ms, peak {got['peak_sampled'] / 2**30:.2f} GiB"
            )
    progress("tiers, bitwise:")
    tiers = tier_round_trips(rounds[1]["final"], workdir)
    measured = {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "state_gb": round(model.state_bytes / 1e9, 3),
        "rounds": [{k: v for k, v in r.items() if k != "final"} for r in rounds],
        "rounds_bitwise_identical": all(bitwise_equal(rounds[0]["final"], r["final"]) for r in rounds[1:]),
        "clean_digest": digest(rounds[0]["final"]),
        "tiers": tiers,
    }
    Path(args.result).write_text(json.dumps(measured, default=str))
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from remesh.elastic.runtime import configure_backend

    platform = configure_backend(args.devices, 2.0, None)  # no backend is made here
    accelerated = platform != "cpu"
    if args.state_gb is None:
        args.state_gb = 2.2 if accelerated else 0.05
    if args.width is None:
        args.width = 8192 if accelerated else 512
    if args.batch is None:
        args.batch = 4096 if accelerated else 64
    if args.mode == "trainer":
        return trainer_main(args)
    if args.mode == "measure":
        return measure_main(args)

    # This process never opens a device: the measuring process does, then the job's trainers.
    workdir = Path(tempfile.mkdtemp(prefix="remesh-accel-"))
    result = workdir / "measured.json"
    subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "measure",
            *(a for a in argv if a != "bench"),
            "--result",
            str(result),
        ],
        check=True,
    )
    measured = json.loads(result.read_text())
    rounds, tiers = measured["rounds"], measured["tiers"]
    job = None
    if not args.skip_job:
        progress("a one-host job under a real coordinator and agent, over Unix sockets:")
        try:
            job = restart_job(args, workdir)
        except (TimeoutError, subprocess.SubprocessError, OSError) as exc:
            # The rounds' figures still count; the job's are reported as missing, with why.
            progress(f"  the job failed: {type(exc).__name__}: {exc} (its logs: {args.logs or workdir})")
            job = {"error": f"{type(exc).__name__}: {exc}", "mttr_s": None, "final_digest": None}
        else:
            progress(
                f"  restored step {job['restored_step']} from {job['restored_from']}; MTTR "
                f"{job['mttr_s']:.2f}s (new process started +{job['process_start_s']:.2f}s, ready "
                f"+{job['ready_s']:.2f}s)"
            )
    off = [t for r in rounds if not r["snapshots"] for t in r["step_s"]]
    on = [t for r in rounds if r["snapshots"] for t in r["step_s"]]
    first_off, first_on = rounds[0], rounds[1]
    if first_off["device_peak"] is not None and first_on["device_peak"] is not None:
        peak_off, peak_on, peak_how = first_off["device_peak"], first_on["device_peak"], "device counter"
    else:
        peak_off = max(r["peak_sampled"] for r in rounds if not r["snapshots"])
        peak_on = max(r["peak_sampled"] for r in rounds if r["snapshots"])
        peak_how = "sampled"
    on_stats = [r["stats"] for r in rounds if r["snapshots"]]
    snap_bytes = sum(s.get("snapshot_bytes", 0) for s in on_stats)
    snap_s = sum(s.get("snapshot_s", 0.0) for s in on_stats)
    identical = measured["rounds_bitwise_identical"]
    job_bitwise = job is None or job["final_digest"] == measured["clean_digest"]
    tiers_bitwise = all(t["bitwise"] for t in tiers.values() if t["ran"])
    figures = {
        "backend": measured["backend"],
        "device": measured["device"],
        "state_gb": measured["state_gb"],
        "steps": args.steps,
        "snapshot_every": args.snapshot_every,
        "step_s_p50_off": statistics.median(off),
        "step_s_p50_on": statistics.median(on),
        "step_s_mean_off": statistics.fmean(off),
        "step_s_mean_on": statistics.fmean(on),
        "overhead_ratio_p50": statistics.median(on) / statistics.median(off),
        "overhead_ratio_mean": statistics.fmean(on) / statistics.fmean(off),
        "peak_device_memory_off_gib": peak_off / 2**30,
        "peak_device_memory_on_gib": peak_on / 2**30,
        "peak_device_memory_ratio": peak_on / peak_off,
        "peak_measured_by": peak_how,
        "snapshot_held_bytes_peak_gb": max(s.get("snapshot_held_bytes_peak", 0) for s in on_stats) / 1e9,
        "snapshots_taken": sum(s.get("snapshots", 0) for s in on_stats),
        "snapshots_skipped": sum(s.get("snapshots_skipped", 0) for s in on_stats),
        "snapshot_every_kept": max((s.get("snapshot_every_kept", 0) for s in on_stats), default=0),
        "snapshot_gbps": snap_bytes / 1e9 / snap_s if snap_s else None,
        "snapshot_s_each": snap_s / max(1, sum(s.get("snapshots", 0) for s in on_stats)),
        # An in-process restore: a snapshot held in memory built onto the device.
        "restore_gbps": tiers["memory"].get("onto_device_gbps"),
        "restore_s": tiers["memory"].get("onto_device_s"),
        "rounds_bitwise_identical": identical,
        "tiers": tiers,
        "job": job,
        "trainer_restart_mttr_s": job["mttr_s"] if job else None,
        "bitwise": identical and tiers_bitwise and job_bitwise,
    }
    rows = [
        ("step p50 off / on (ms)", f"{figures['step_s_p50_off'] * 1e3:.1f} / {figures['step_s_p50_on'] * 1e3:.1f}"),
        ("step mean off / on (ms)", f"{figures['step_s_mean_off'] * 1e3:.1f} / {figures['step_s_mean_on'] * 1e3:.1f}"),
        ("overhead ratio mean / p50", f"{figures['overhead_ratio_mean']:.4f} / {figures['overhead_ratio_p50']:.4f}"),
        ("peak device memory off / on (GiB)", f"{peak_off / 2**30:.2f} / {peak_on / 2**30:.2f} ({peak_how})"),
        ("held by a snapshot at a step, most (GB)", f"{figures['snapshot_held_bytes_peak_gb']:.2f}"),
        ("snapshots taken / skipped, kept every", f"{figures['snapshots_taken']} / {figures['snapshots_skipped']}, {figures['snapshot_every_kept']}"),
        ("snapshot GB/s, s each", f"{figures['snapshot_gbps'] or 0:.2f}, {figures['snapshot_s_each']:.2f}"),
        ("restore onto the device GB/s, s", f"{figures['restore_gbps'] or 0:.2f}, {figures['restore_s'] or 0:.3f}"),
        ("tiers bitwise", ", ".join(f"{k}: {v['bitwise'] if v['ran'] else 'not run'}" for k, v in tiers.items())),
        ("trainer SIGKILL -> first step (s)", f"{job['mttr_s']:.2f}" if job and job["mttr_s"] else "not run"),
        ("bitwise (rounds, tiers, job)", f"{identical}, {tiers_bitwise}, {job_bitwise}"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("all figures: " + json.dumps(figures, default=str))
    keys = ("backend", "state_gb", "overhead_ratio_mean", "overhead_ratio_p50", "peak_device_memory_ratio",
            "snapshot_every_kept", "snapshot_gbps", "restore_gbps", "trainer_restart_mttr_s", "bitwise")  # fmt: skip
    print(json.dumps({k: figures[k] for k in keys}))
    return 0 if figures["bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

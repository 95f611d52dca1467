"""A training script run as a plain ``python script.py``, with no agent: a job of one host.

The script is a user's own loop (``Session.epochs``, ``epoch.jit``), its data a function of the step,
checkpoints in a local directory. Without ``REMESH_AGENT_ADDRESS`` the session takes a ``SoloAgent``
(and says so in one line), opens no TCP or UDP socket and joins no JAX distributed runtime (the script
refuses both, as an accelerator host without networking would), and trains to the end. SIGKILLed
mid-run and run again, it resumes from its newest committed checkpoint (not from the snapshots the
killed run left in its snapshot directory: those are another run's) and ends on the state of the
uninterrupted run, bit for bit. A second run of the same job id while one runs is refused.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_solo_runtime import NO_NETWORK

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
EVERY = 5

OWN_LOOP = NO_NETWORK + textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp
    import numpy as np
    from remesh.elastic import LocalCheckpoints, Policy, Session

    final, ckpt, shm, steps, pause = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])

    def init_state():
        k1, k2 = jax.random.split(jax.random.key(0))
        return {"w1": jax.random.normal(k1, (8, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 1)) * 0.3}

    def batch_for(step):
        rng = np.random.default_rng(step)  # the data position is the step
        x = rng.normal(size=(16, 8)).astype(np.float32)
        return x, np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)

    def train_step(state, batch):
        x, y = batch
        def loss_fn(s):
            return jnp.mean((jnp.tanh(x @ s["w1"]) @ s["w2"] - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state)
        return jax.tree.map(lambda p, g: p - 0.05 * g, state, grads), {"loss": loss}

    session = Session(
        init_state=init_state,
        devices_per_host=2,
        policy=Policy(checkpoint_every=EVERY, snapshot_every=3, shm_dir=shm),
        checkpoints=[LocalCheckpoints(ckpt)],
        job_id="alone",
    )
    for epoch in session.epochs(steps):
        with epoch:
            step_fn = epoch.jit(train_step, out_shardings=(epoch.shardings, epoch.replicated))
            state = epoch.state
            for step in epoch.steps():
                x, y = batch_for(step)
                state, metrics = step_fn(state, (epoch.batch(x), epoch.batch(y)))
                epoch.done(state, metrics)
                time.sleep(pause)
    np.savez(final, *session.final_leaves())
    session.close()
    print("TRAINED", flush=True)
    """
).replace("EVERY", str(EVERY))


def env_without_agent() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMESH_")}
    return {**env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}


def command(tmp: Path, final: Path, ckpt: Path, pause: float) -> list[str]:
    script = tmp / "train.py"
    script.write_text(OWN_LOOP)
    return [sys.executable, str(script), str(final), str(ckpt), str(tmp / "shm"), str(STEPS), str(pause)]


def run(tmp: Path, final: Path, ckpt: Path, pause: float = 0.0) -> str:
    proc = subprocess.run(
        command(tmp, final, ckpt, pause), capture_output=True, text=True, timeout=200, env=env_without_agent()
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "TRAINED" in out, out[-5000:]
    return out


def committed(ckpt: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step_")) for p in ckpt.glob("step_*/COMMITTED"))


def leaves(path: Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def test_a_users_own_loop_runs_without_an_agent_and_a_run_again_resumes_from_its_newest_checkpoint(
    tmp_path: Path,
) -> None:
    # Uninterrupted: trained to the end as a job of one host, said in one line.
    clean = tmp_path / "clean.npz"
    (tmp_path / "a").mkdir()
    out = run(tmp_path / "a", clean, tmp_path / "a" / "ckpt")
    assert out.count("running alone") == 1 and "remesh agent --coordinator" in out
    assert re.search(r"epoch ready .*source=scratch.* step=0", out), out[-3000:]
    assert "job finished" in out

    # Killed past its third checkpoint, with snapshots newer than it left in its snapshot directory.
    work = tmp_path / "b"
    work.mkdir()
    ckpt, final = work / "ckpt", work / "final.npz"
    killed = subprocess.Popen(
        command(work, final, ckpt, pause=0.1),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env_without_agent(),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 150
        while len(committed(ckpt)) < 3:
            assert killed.poll() is None and time.monotonic() < deadline, "no third checkpoint"
            time.sleep(0.05)
        time.sleep(0.4)  # a few steps (and snapshots) past it
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    newest = committed(ckpt)[-1]
    left = sorted(int(p.stem.removeprefix("step_")) for p in (work / "shm").glob("*/step_*.snap"))
    assert left and max(left) > newest, (left, newest)  # newer snapshots it must not restore

    out = run(work, final, ckpt)
    ready = re.search(r"epoch ready .*?source=(\S+).*? step=(\d+)", out)
    assert ready is not None, out[-3000:]
    assert (ready.group(1), int(ready.group(2))) == ("local", newest), ready.group(0)
    assert "host-memory snapshots of an earlier agent deleted" in out
    for a, b in zip(leaves(final), leaves(clean), strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), "differs from the uninterrupted run"
    # The job finished: its snapshot directory went with it.
    assert not any((work / "shm").glob("*/step_*.snap"))


def test_a_second_run_of_the_same_job_alone_on_a_host_is_refused_while_the_first_runs(
    tmp_path: Path,
) -> None:
    first = subprocess.Popen(
        command(tmp_path, tmp_path / "first.npz", tmp_path / "ckpt-1", pause=0.2),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env_without_agent(),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "shm" / "remesh-alone-solo" / "ALONE").exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        second = subprocess.run(
            command(tmp_path, tmp_path / "second.npz", tmp_path / "ckpt-2", pause=0.0),
            capture_output=True,
            text=True,
            timeout=120,
            env=env_without_agent(),
        )
        assert second.returncode != 0
        assert "another process runs this job alone on this host" in second.stderr, second.stderr[-3000:]
        assert first.poll() is None  # the first one runs on, its snapshots untouched
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()

"""Bring your own loop: a small JAX regression trained in a loop of your own, under remesh.

Alone (no agent: a job of one host), as docs/tutorial.md starts it::

    python examples/tutorial/train.py --steps 40

and on every host under ``remesh agent`` (the same file, unchanged)::

    remesh agent --job tutorial --host-id host-0 --devices 2 -- python examples/tutorial/train.py --steps 400
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from remesh.elastic import LocalCheckpoints, Policy, Session


def init_state() -> dict[str, jax.Array]:
    # remesh traces this with jax.eval_shape to learn the state's shapes before any device is used:
    # build the arrays with jax (jax.random, jnp), not numpy.
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (8, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 1)) * 0.3}


def train_step(state: dict[str, jax.Array], batch: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], dict]:
    def loss_fn(s: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean((jnp.tanh(batch["x"] @ s["w1"]) @ s["w2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state)
    return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads), {"loss": loss}


class Regression:
    """The input, addressed by step (a ``remesh.elastic.StepData``): global batch ``step`` is a
    function of the step alone, so a replayed step reads exactly the rows it read before."""

    global_batch_size = 24  # divides by every world size x devices per host this job runs at

    def rows(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        x = np.random.default_rng(step).normal(size=(self.global_batch_size, 8)).astype(np.float32)
        y = np.sin(x[:, :1]) + 0.5 * x[:, 1:2]  # what the model learns
        return {"x": x[rows], "y": y[rows]}


def main() -> int:
    p = argparse.ArgumentParser(description="remesh tutorial: your own loop on Session.epochs")
    p.add_argument("--steps", type=int, default=40)
    # Under `remesh agent --devices N` the agent says how many devices this host has.
    p.add_argument("--devices", type=int, default=int(os.environ.get("REMESH_DEVICE_COUNT", "2")))
    p.add_argument("--checkpoint-dir", help="commit a checkpoint here every 20 steps (a run again resumes)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="pause after each step, to watch it")
    args = p.parse_args()

    session = Session(
        init_state=init_state,
        # On CPU the session gives XLA this many virtual devices per process.
        devices_per_host=args.devices,
        policy=Policy(checkpoint_every=20 if args.checkpoint_dir else 0),
        checkpoints=[LocalCheckpoints(args.checkpoint_dir)] if args.checkpoint_dir else [],
    )
    source = Regression()
    for epoch in session.epochs(args.steps):
        with epoch:  # a failure in here ends the epoch; the next one comes round re-meshed and restored
            step_fn = epoch.jit(train_step, out_shardings=(epoch.shardings, epoch.replicated))
            state = epoch.state  # restored onto this epoch's mesh: the state after epoch.step steps
            print(
                f"epoch {epoch.epoch}: rank {epoch.rank} of {epoch.world_size}, "
                f"{jax.device_count()} devices, from step {epoch.step} ({epoch.restored_from})",
                flush=True,
            )
            batches = epoch.data(source)  # this host's rows of each step's batch, from epoch.step on
            for step in epoch.steps():  # 0, 1, 2, ...: the steps done before this one
                state, metrics = step_fn(state, epoch.batch(next(batches)))
                # The step before, once finished (None for the epoch's first): done.step == step.
                done = epoch.done(state, metrics)
                if done is not None and step % 10 == 0 and epoch.rank == 0:
                    print(f"step {done.step}: loss {done.metrics['loss']:.4f}", flush=True)
                time.sleep(args.step_sleep)
        if epoch.last is not None and epoch.rank == 0:  # the last step's result, once the job finished
            print(f"finished at step {epoch.last.step}: loss {epoch.last.metrics['loss']:.4f}", flush=True)
    session.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Train tinylm with its state sharded over every device of every process (FSDP), in plain JAX with
no remesh at all: the baseline ``benchmarks/overhead.py`` runs beside the same job under remesh.

Start one process per host (here: per local process), each with ``--devices`` virtual CPU devices:

    python -m examples.tinylm.train_plain_sharded --processes 2 --process-id 0 --coordinator 127.0.0.1:8476
    python -m examples.tinylm.train_plain_sharded --processes 2 --process-id 1 --coordinator 127.0.0.1:8476

The loop is the one a JAX user writes: dispatch a step, then read the previous step's loss (so the
devices never wait for the host). Process 0 appends ``{"t", "step", "loss"}`` per step to
``--metrics`` when given. With ``--checkpoint-dir`` it also checkpoints as an Orbax user does:
``orbax.checkpoint.CheckpointManager``, asynchronous saves every ``--checkpoint-every`` steps, the
last 3 kept.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from examples.tinylm import data, model

AXES = ("replica", "fsdp")


def fsdp_spec(size: int, leaf: Any) -> P:
    """Shard a leaf on its largest dimension that divides by ``size``; small or indivisible leaves
    stay replicated."""
    shape = tuple(leaf.shape)
    dims = sorted((d for d in range(len(shape)) if shape[d] % size == 0), key=lambda d: -shape[d])
    if size == 1 or math.prod(shape) < 1024 or not dims:
        return P()
    return P(*([None] * dims[0]), "fsdp")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--coordinator", default="127.0.0.1:8476")
    p.add_argument("--devices", type=int, default=2, help="virtual CPU devices per process")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=model.Config.d_model)
    p.add_argument("--layers", type=int, default=model.Config.n_layers)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics", help="process 0 appends one JSON line per step here")
    p.add_argument("--checkpoint-dir", help="checkpoint here with Orbax's CheckpointManager (asynchronous)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    args = p.parse_args(argv)

    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.processes > 1:
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)

    config = model.Config(
        seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, d_mlp=4 * args.d_model
    )
    mesh = Mesh(np.array(jax.devices()).reshape(1, -1), AXES)
    shapes = jax.eval_shape(functools.partial(model.init_state, args.seed, config))
    shardings = jax.tree.map(lambda leaf: NamedSharding(mesh, fsdp_spec(mesh.shape["fsdp"], leaf)), shapes)
    rows, replicated = NamedSharding(mesh, P(AXES)), NamedSharding(mesh, P())
    state = jax.jit(functools.partial(model.init_state, args.seed, config), out_shardings=shardings)()
    step_fn = jax.jit(
        functools.partial(model.train_step, config=config),
        in_shardings=(shardings, rows),
        out_shardings=(shardings, replicated),
    )

    def batch(step: int) -> jax.Array:
        whole = data.global_batch(step, args.batch, args.seq_len, args.seed)
        per = whole.shape[0] // args.processes
        mine = whole[args.process_id * per : (args.process_id + 1) * per]
        return jax.make_array_from_process_local_data(rows, mine, whole.shape)

    manager = None
    if args.checkpoint_dir:
        import orbax.checkpoint as ocp

        options = ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True)
        manager = ocp.CheckpointManager(os.path.abspath(args.checkpoint_dir), options=options)

    out = open(args.metrics, "a", buffering=1) if args.metrics and args.process_id == 0 else None  # noqa: SIM115
    previous: tuple[int, Any] | None = None
    for step in range(1, args.steps + 1):
        state, metrics = step_fn(state, batch(step - 1))
        if manager is not None and step % args.checkpoint_every == 0:
            manager.save(step, args=ocp.args.StandardSave(state))
        if previous is not None:
            done, loss = previous[0], float(np.asarray(previous[1]["loss"].addressable_shards[0].data))
            if out is not None:
                out.write(
                    json.dumps({"t": round(time.time(), 4), "step": done, "loss": round(loss, 5)}) + "\n"
                )
        previous = (step, metrics)
    if previous is not None and out is not None:
        loss = float(np.asarray(previous[1]["loss"].addressable_shards[0].data))
        out.write(
            json.dumps({"t": round(time.time(), 4), "step": previous[0], "loss": round(loss, 5)}) + "\n"
        )
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    if args.processes > 1:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

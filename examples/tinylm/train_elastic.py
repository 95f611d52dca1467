"""Train tinylm data-parallel across hosts, elastically: run it under a remesh agent.

    remesh agent --coordinator ADDR --host-id host-0 --devices 2 -- \\
        python -m examples.tinylm.train_elastic --steps 300

Everything about failure is remesh's: this script is the JAX a user would write anyway — a state,
a step function, and a batch that is a pure function of the step — handed to ``remesh.elastic``.
Each host runs one process with ``--devices`` virtual CPU devices (``REMESH_DEVICE_COUNT``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import structlog

from examples.tinylm import data, model
from remesh.elastic import (
    Checkpoints,
    Faults,
    GrainData,
    Layout,
    LocalCheckpoints,
    Policy,
    Session,
    StepResult,
    configure_logging,
    fsdp_partition,
    gcs_checkpoints_from_url,
)
from remesh.elastic.cadence import parse_every


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--batch", type=int, default=24, help="global batch rows; 24 splits over 1-4 hosts x 2 devices"
    )
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=model.Config.d_model)
    p.add_argument("--layers", type=int, default=model.Config.n_layers)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=int, default=int(os.environ.get("REMESH_DEVICE_COUNT", "2")))
    p.add_argument(
        "--checkpoint-dir",
        help="local Orbax checkpoints; '{host}' in it is this host's id (a directory of each host's own)",
    )
    p.add_argument(
        "--checkpoint-format",
        choices=("orbax", "pieces"),
        default="orbax",
        help="how a sharded state is written to --checkpoint-dir: Orbax (readable by any Orbax "
        "program) or each process's pieces as one plain file (a sixth of the CPU; remesh reads it)",
    )
    p.add_argument(
        "--gcs",
        help="gs://BUCKET/PREFIX for Orbax checkpoints on GCS (STORAGE_EMULATOR_HOST for an emulator)",
    )
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument(
        "--keep-checkpoints", type=int, default=3, help="committed checkpoints kept per tier (0: all)"
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="pause after each step (paces demos and tests)"
    )
    p.add_argument(
        "--metrics-dir",
        help="rank 0 appends one JSON line per step here (time, step, loss, epoch): the demo's loss curve",
    )
    p.add_argument("--save-final", help="rank 0 writes the final state's leaves here (.npz)")
    p.add_argument(
        "--no-snapshots",
        action="store_true",
        help="keep no host-memory snapshots: every recovery restores from the checkpoint tiers (tests of those tiers)",
    )
    p.add_argument(
        "--checksums",
        help="every rank appends one JSON line per step here with checksums of the state the step began "
        "from (computed on the devices: for an epoch's first step, the state it restored) and of the "
        "state after it, and of the global batch it trained on; tests compare what an epoch restored "
        "with what the last one left, and each step's batch with the one a clean run reads",
    )
    p.add_argument("--collective-timeout", type=float, default=Policy().collective_timeout_s)
    p.add_argument(
        "--sharding",
        choices=("replicated", "fsdp", "hsdp"),
        default="replicated",
        help="replicated: every host holds the whole state; fsdp: each leaf sharded over every device "
        "of every host; hsdp: sharded inside replica groups of --hosts-per-replica hosts, replicated "
        "across them",
    )
    p.add_argument("--hosts-per-replica", type=int, default=2, help="hosts in one replica group (hsdp)")
    p.add_argument(
        "--snapshot-every",
        type=parse_every,
        default=Policy().snapshot_every,
        help="host-memory snapshots every K steps, in the background (a failure replays up to K - 1); "
        '"auto": K from what a snapshot costs the loop and --mtbf',
    )
    p.add_argument(
        "--buddy-every",
        type=int,
        default=None,
        help="buddy copies every K steps, a multiple of --snapshot-every (default: every snapshot; 0: none)",
    )
    p.add_argument(
        "--peer-host",
        default=os.environ.get("REMESH_PEER_HOST"),
        help="the address the other hosts fetch this host's pieces from (default: the source address "
        "of the route to the epoch's coordination service; $REMESH_PEER_HOST)",
    )
    p.add_argument(
        "--shm-dir",
        default=Policy().shm_dir,
        help="the folder where snapshots outlive this process, for the agent's next trainer to restore "
        "(default: /dev/shm)",
    )
    p.add_argument(
        "--mtbf",
        type=float,
        default=Policy().mtbf_s,
        help="expected seconds between failures of the job, for --snapshot-every auto, until the "
        "coordinator observes a failure (default: 3 hours)",
    )
    args = p.parse_args(argv)
    configure_logging()  # JSON lines when the agent logs JSON

    log = structlog.get_logger("tinylm")
    config = model.Config(
        seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, d_mlp=4 * args.d_model
    )
    stores: list[Checkpoints] = []
    if args.checkpoint_dir:
        stores.append(
            LocalCheckpoints(
                args.checkpoint_dir.replace("{host}", os.environ.get("REMESH_HOST_ID", "host")),
                max_to_keep=args.keep_checkpoints,
                pieces=args.checkpoint_format == "pieces",
            )
        )
    if args.gcs:
        stores.append(gcs_checkpoints_from_url(args.gcs, max_to_keep=args.keep_checkpoints))
    try:
        policy = Policy(
            checkpoint_every=args.checkpoint_every,
            collective_timeout_s=args.collective_timeout,
            snapshot_every=args.snapshot_every,
            buddy_every=args.buddy_every,
            mtbf_s=args.mtbf,
            shm_dir=args.shm_dir,
            peer_host=args.peer_host,
            # A sharded state is gathered whole at the end only where it is written out whole.
            gather_final=bool(args.save_final) and args.sharding != "replicated",
        )
    except ValueError as exc:
        p.error(str(exc))
    if args.no_snapshots:
        policy = dataclasses.replace(policy, snapshots_kept=0, shm_dir=None)
    train_step = functools.partial(model.train_step, config=config)
    if args.checksums:
        train_step = functools.partial(_with_input_checksum, train_step)
    session = Session(
        init_state=functools.partial(model.init_state, args.seed, config),
        train_step=train_step,
        # Each host reads only its own rows of every step's global batch, from the restored step on.
        data=GrainData(data.records(args.seq_len, args.seed), args.batch),
        devices_per_host=args.devices,
        policy=policy,
        checkpoints=stores,
        layout=Layout(
            partition=None if args.sharding == "replicated" else fsdp_partition,
            hosts_per_replica=args.hosts_per_replica if args.sharding == "hsdp" else None,
        ),
        # Tests and benchmarks make this host slow or faulty on purpose (REMESH_FAULT_*); none by default.
        faults=Faults.from_env(),
    )
    t0 = time.monotonic()
    last = None
    metrics = _MetricsFile(args.metrics_dir) if args.metrics_dir else None
    checksums = _MetricsFile(args.checksums) if args.checksums else None
    for result in session.run(args.steps):
        last = result
        if metrics is not None and session.rank == 0:
            metrics.write(result, session.stats)
        if checksums is not None:
            checksums.line(
                {
                    "rank": session.rank,
                    "epoch": result.epoch,
                    "world_size": result.world_size,
                    "step": result.step,
                    "state_in": int(result.metrics["state_in"]),
                    "state_out": int(result.metrics["state_out"]),
                    "batch": int(result.metrics["batch"]),
                }
            )
        if result.step % args.log_every == 0 or result.step == args.steps:
            log.info(
                "step",
                step=result.step,
                loss=round(result.metrics["loss"], 4),
                epoch=result.epoch,
                world_size=result.world_size,
                elapsed_s=round(time.monotonic() - t0, 2),
            )
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if last is None:
        return 0
    if args.save_final and session.rank == 0:
        leaves = session.final_leaves()
        # Written whole, then renamed: whoever waits for the file never reads half of it.
        tmp = f"{args.save_final}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, *leaves)
        os.replace(tmp, args.save_final)
        log.info("final state written", path=args.save_final, step=last.step)
    session.close()
    return 0


class _MetricsFile:
    """One JSON line per step, flushed at once: a reader sees every step up to a kill."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        host = os.environ.get("REMESH_HOST_ID", "host")
        self._file = open(os.path.join(folder, f"{host}-{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def write(self, result: StepResult, stats: dict[str, float]) -> None:
        self.line(
            {
                "t": round(time.time(), 4),
                "step": result.step,
                "loss": round(result.metrics["loss"], 5),
                "epoch": result.epoch,
                "world_size": result.world_size,
                **{k: round(v, 4) for k, v in stats.items()},
            }
        )

    def line(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")


def _with_input_checksum(
    train_step: Callable[[Any, jax.Array], tuple[Any, dict[str, jax.Array]]], state: Any, batch: jax.Array
) -> tuple[Any, dict[str, jax.Array]]:
    """``train_step``, with checksums of the state it was given, the state it gives back and the
    global batch it trained on among its metrics (``--checksums``).

    Computed inside the step, on the devices: the only place the state an epoch restored can be seen
    from outside the session. Integer arithmetic, so any reduction order gives the same value.
    """
    new_state, metrics = train_step(state, batch)
    return new_state, {
        **metrics,
        "state_in": checksum(jnp, jax.tree_util.tree_leaves(state)),
        "state_out": checksum(jnp, jax.tree_util.tree_leaves(new_state)),
        "batch": checksum(jnp, [batch]),
    }


def checksum(xp: Any, leaves: Sequence[Any]) -> Any:
    """A position-weighted sum of the bits of every element, mod 2**32; ``xp`` is numpy or jax.numpy.

    Every weight is odd, so a change to any single element always changes it. Leaves of 4-byte types.
    """
    sums = []
    for i, leaf in enumerate(leaves):
        bits: Any = (
            np.ascontiguousarray(leaf).view(np.uint32).reshape(-1)
            if xp is np
            else jax.lax.bitcast_convert_type(leaf, jnp.uint32).reshape(-1)
        )
        seed = xp.uint32(((2 * i + 1) * 0x85EBCA77) & 0xFFFFFFFF)
        weights = (xp.arange(bits.size, dtype=xp.uint32) * xp.uint32(0x9E3779B1) + seed) | xp.uint32(1)
        sums.append(xp.sum(bits * weights, dtype=xp.uint32))  # uint32 arrays wrap silently
    if xp is np:
        return sum(int(x) for x in sums) % 2**32
    return functools.reduce(lambda a, b: a + b, sums, jnp.zeros((), jnp.uint32))


if __name__ == "__main__":
    sys.exit(main())

"""Train tinylm FSDP-sharded in your own loop, elastically: ``train_plain_sharded.py`` under remesh.

    remesh agent --coordinator ADDR --host-id host-0 --devices 2 -- \\
        python -m examples.tinylm.train_own_loop --steps 300

The loop, the jitted step and the batch are the plain script's; what changes (``diff`` the two):
no ``jax.distributed.initialize`` and no mesh of your own (each epoch brings its mesh, its state
shardings and the state restored onto them), the loop sits inside ``for epoch in
session.epochs(...)`` / ``with epoch:``, each host reads only its own rows of each step's batch of
the same Grain records (``epoch.data``, from the restored step on) and feeds them through
``epoch.batch``, the step is jitted with ``epoch.jit`` (``jax.jit`` whose first call waits, once
compiled, for every member: no host enters the step's first collective while another still
compiles), and ``epoch.done(state, metrics)`` takes each new state back.

``--input`` picks how each host reads its rows: ``records`` (the default), the rows of each step's
global batch by index (``GrainData``: the position is the step, good for any number of hosts);
``iterator``, its own shard through a Grain ``DatasetIterator`` whose position remesh keeps with
every snapshot and checkpoint (``IteratorData``: a spare takes the position of the host it replaces;
a shrink is refused); ``elastic``, Grain's ``ElasticIterator``, whose position holds for any number
of hosts (``IteratorData(..., shared_state=True)``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import numpy as np

from examples.tinylm import data, model
from remesh.elastic import Faults, GrainData, IteratorData, Layout, Policy, Session, fsdp_partition
from remesh.elastic.cadence import parse_every


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=int(os.environ.get("REMESH_DEVICE_COUNT", "2")))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=model.Config.d_model)
    p.add_argument("--layers", type=int, default=model.Config.n_layers)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics", help="process 0 appends one JSON line per step here")
    p.add_argument(
        "--snapshot-every",
        type=parse_every,
        default=Policy().snapshot_every,
        help='snapshots every K steps, or "auto" (K from what they cost)',
    )
    p.add_argument("--save-final", help="rank 0 writes the final state's leaves here (.npz)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="pause after each step (paces tests)")
    p.add_argument("--input", choices=("records", "iterator", "elastic"), default="records")
    p.add_argument("--input-log", help="every process appends the windows each step read here (jsonl)")
    args = p.parse_args(argv)

    config = model.Config(
        seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, d_mlp=4 * args.d_model
    )
    session = Session(
        init_state=functools.partial(model.init_state, args.seed, config),
        devices_per_host=args.devices,
        layout=Layout(partition=fsdp_partition),
        policy=Policy(snapshot_every=args.snapshot_every, gather_final=bool(args.save_final)),
        # Tests make this host slow on purpose (REMESH_FAULT_*); none by default.
        faults=Faults.from_env(),
    )
    source: GrainData | IteratorData
    if args.input == "records":
        source = GrainData(data.records(args.seq_len, args.seed), args.batch)
    else:
        # make_iterator(rank, world_size): this host's iterator of an epoch, from the start of the data.
        make = data.host_iterator if args.input == "iterator" else data.elastic_iterator
        source = IteratorData(
            functools.partial(make, args.seq_len, args.seed, args.batch), shared_state=args.input == "elastic"
        )
    out = open(args.metrics, "a", buffering=1) if args.metrics else None  # noqa: SIM115
    read = open(args.input_log, "a", buffering=1) if args.input_log else None  # noqa: SIM115
    for epoch in session.epochs(args.steps):
        with epoch:
            step_fn = epoch.jit(  # jax.jit, whose first call meets every member once compiled
                functools.partial(model.train_step, config=config),
                in_shardings=(epoch.shardings, epoch.batch_sharding),
                out_shardings=(epoch.shardings, epoch.replicated),
            )
            state = epoch.state
            batches = epoch.data(source)  # this host's rows of each step's batch, from epoch.step on
            for step in epoch.steps():
                rows = next(batches)
                if isinstance(rows, dict):  # windows with their offsets (--input iterator, elastic)
                    if read is not None:
                        line = {
                            "epoch": epoch.epoch,
                            "rank": epoch.rank,
                            "step": step,
                            "offsets": rows["offset"],
                        }
                        read.write(json.dumps(line, default=lambda a: a.tolist()) + "\n")
                    rows = rows["tokens"]
                state, metrics = step_fn(state, epoch.batch(rows))
                done = epoch.done(state, metrics)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if done is not None and out is not None and epoch.rank == 0:
                    out.write(
                        json.dumps({"t": round(time.time(), 4), "step": done.step, **done.metrics}) + "\n"
                    )
        if epoch.last is not None and epoch.rank == 0:
            if out is not None:
                out.write(
                    json.dumps({"t": round(time.time(), 4), "step": epoch.last.step, **epoch.last.metrics})
                    + "\n"
                )
            print(f"finished at step {epoch.last.step}: loss {epoch.last.metrics['loss']:.4f}", flush=True)
            if args.save_final:
                tmp = f"{args.save_final}.tmp"  # written whole, then renamed
                with open(tmp, "wb") as f:
                    np.savez(f, *session.final_leaves())
                os.replace(tmp, args.save_final)
    session.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The CPU a sharded checkpoint save takes in the process that trains: the same state written by
Orbax (``LocalCheckpoints.write_global``, the default) and as pieces (``write_pieces``, one plain
file of the process's own shards), alternating, in one process with --devices virtual CPU devices.

    python benchmarks/checkpoint_cpu.py [--state-mb 64] [--arrays 81] [--saves 7] [--devices 2]

On a host whose cores run the training step (here: always; on a GPU host: the cores that feed it),
the CPU a background save takes is taken from the step beside it (benchmarks/overhead.py measures
that step). Each save is timed by the process's CPU time (every thread) and by the wall clock; the
first save of each kind (imports, thread pools) is left out. Prints a table and, as its last line,
JSON with orbax_cpu_s_p50, pieces_cpu_s_p50, cpu_ratio (orbax / pieces), the walls, state_mb and
arrays.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def main() -> None:
    # Stopped by SIGTERM (timeout, a scheduler), it still stops every process it started.
    from remesh.embedded import stop_on_sigterm

    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mb", type=float, default=64.0)
    parser.add_argument("--arrays", type=int, default=81, help="leaves of the state (tinylm at 64 MiB: 81)")
    parser.add_argument("--saves", type=int, default=7, help="saves of each kind (the first left out)")
    parser.add_argument(
        "--devices", type=int, default=2, help="virtual CPU devices the state is sharded over"
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    if args.saves < 2:
        parser.error("--saves must be at least 2 (the first of each kind is left out)")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from remesh.cli.logs import configure_logging
    from remesh.elastic.checkpoints import LocalCheckpoints
    from remesh.elastic.exchange import Pieces
    from remesh.elastic.sharding import first_replicas

    configure_logging(level="warning")
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    rows = args.devices * 8
    cols = max(1, int(args.state_mb * 2**20 / 4 / args.arrays / rows))
    rng = np.random.default_rng(0)
    state = {
        f"p{i:03d}": jax.device_put(
            rng.standard_normal((rows, cols), dtype=np.float32), NamedSharding(mesh, P("fsdp"))
        )
        for i in range(args.arrays)
    }
    mb = sum(x.nbytes for x in state.values()) / 2**20
    leaves = jax.tree_util.tree_leaves(state)
    print(f"{args.arrays} arrays, {mb:.1f} MiB over {args.devices} devices, {args.saves} saves of each kind")

    root = Path(args.dir or tempfile.mkdtemp(prefix="remesh-ckpt-cpu-"))
    orbax = LocalCheckpoints(root / "orbax", max_to_keep=2)
    plain = LocalCheckpoints(root / "pieces", max_to_keep=2, pieces=True)

    def save_orbax(step: int) -> None:
        assert orbax.prepare_global(step, 1)
        orbax.write_global(step, state)
        orbax.commit_global(step, 1)

    def save_pieces(step: int) -> None:
        assert plain.prepare_global(step, 1)
        # As the Session does: this process's first replica of every shard, host views of them.
        pieces: Pieces = {key: np.asarray(data) for key, data in first_replicas(leaves).items()}
        plain.write_pieces(step, 0, 1, pieces)
        plain.commit_global(step, 1)

    kinds: dict[str, Callable[[int], None]] = {"orbax": save_orbax, "pieces": save_pieces}
    timed: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    try:
        for step in range(1, args.saves + 1):
            for name, save in kinds.items():
                cpu, wall = time.process_time(), time.monotonic()
                save(step)
                timed[name].append((time.process_time() - cpu, time.monotonic() - wall))
            print(
                f"  save {step}/{args.saves}: "
                + ", ".join(f"{k} {v[-1][0]:.3f} CPU s / {v[-1][1]:.3f} s" for k, v in timed.items()),
                flush=True,
            )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    result: dict[str, Any] = {"state_mb": round(mb, 1), "arrays": args.arrays, "saves": args.saves - 1}
    for name, values in timed.items():
        kept = values[1:]
        result[f"{name}_cpu_s_p50"] = round(statistics.median(c for c, _ in kept), 4)
        result[f"{name}_wall_s_p50"] = round(statistics.median(w for _, w in kept), 4)
    result["cpu_ratio"] = round(result["orbax_cpu_s_p50"] / max(result["pieces_cpu_s_p50"], 1e-9), 1)
    print(
        f"median of {args.saves - 1}: Orbax {result['orbax_cpu_s_p50']:.3f} CPU s "
        f"({result['orbax_wall_s_p50']:.3f} s), pieces {result['pieces_cpu_s_p50']:.3f} CPU s "
        f"({result['pieces_wall_s_p50']:.3f} s): {result['cpu_ratio']}x the CPU"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

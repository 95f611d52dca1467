"""Train tinylm in one process, with no remesh at all: the baseline the elastic runs are compared with.

    python -m examples.tinylm.train_plain --steps 300

Prints the loss every ``--log-every`` steps with the mean step time since the last line. Step 0 has
a line of its own: its time is mostly initialisation and jit compilation.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import numpy as np

from examples.tinylm.data import global_batch
from examples.tinylm.model import Config, init_state, train_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="seeds both the parameters and the data order")
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    config = Config(decay_steps=args.steps)  # the cosine schedule ends where the run does
    print(config, flush=True)
    step_fn = jax.jit(functools.partial(train_step, config=config))

    def batch(step: int) -> np.ndarray:
        return global_batch(step, args.batch_size, config.seq_len, args.seed)

    start = time.perf_counter()
    state = init_state(args.seed, config)
    state, metrics = step_fn(state, batch(0))
    first_loss = float(metrics["loss"])  # float() waits for the device, so the time is real
    setup_s = time.perf_counter() - start
    print(f"step     0  loss {first_loss:.4f}  (init, compile and first step: {setup_s:.2f} s)", flush=True)

    loss, interval_start, interval_steps = first_loss, time.perf_counter(), 0
    for step in range(1, args.steps):
        state, metrics = step_fn(state, batch(step))
        interval_steps += 1
        if (step + 1) % args.log_every == 0 or step == args.steps - 1:
            loss = float(metrics["loss"])
            ms = (time.perf_counter() - interval_start) / interval_steps * 1e3
            elapsed = time.perf_counter() - start
            print(f"step {step:5d}  loss {loss:.4f}  {ms:6.1f} ms/step  {elapsed:6.1f} s", flush=True)
            interval_start, interval_steps = time.perf_counter(), 0
    print(f"done: loss {first_loss:.4f} -> {loss:.4f} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

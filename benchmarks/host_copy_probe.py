"""What copying the whole state to the host costs the training steps beside it, by way of copying.

A probe for issue 44 (a snapshot every 10 steps of a 2 GB state at <= 1 % mean step overhead): a
bfloat16 state of ``--state-gb`` in 48 leaves, a jitted step that reads every leaf (about 60 ms on a
TPU v5e at 2 GB), and a background thread that copies the step's state to the host every
``--every`` steps (one copy at a time) by each of these ways, in one run:

- ``none``: no copy (the baseline; measured first and again between the others);
- ``all_at_once``: ``copy_to_host_async`` on every leaf, then ``np.asarray`` of each (what
  ``remesh.elastic.host_copies.SnapshotCopy`` does);
- ``one_by_one``: ``copy_to_host_async`` and ``np.asarray`` leaf after leaf;
- ``pinned_host``: ``jax.device_put`` into the ``pinned_host`` memory kind, then ``np.asarray``.

It prints each way's step p50/mean/max, copies made and copy seconds, and ends with one JSON line.
On CPU the copies are views (``np.asarray`` of a CPU array), so the figures say little there; the
device machine is where it means something (see docs/measurements.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Copier = Callable[[Sequence[jax.Array]], object]


def make_state(state_gb: float, leaves: int) -> tuple[list[jax.Array], jax.Array]:
    side = int((state_gb * 2**30 / 2 / leaves) ** 0.5)
    key = jax.random.PRNGKey(0)
    state = [jax.random.normal(jax.random.fold_in(key, i), (side, side), jnp.bfloat16) for i in range(leaves)]
    return state, jax.random.normal(key, (4096, side), jnp.bfloat16)


@jax.jit
def step(state: list[jax.Array], x: jax.Array) -> tuple[list[jax.Array], jax.Array]:
    h = x
    for w in state:
        h = jnp.tanh(h @ w)
    return [w * 0.999 + 1e-3 * jnp.mean(h) for w in state], x


def all_at_once(snap: Sequence[jax.Array]) -> object:
    for a in snap:
        a.copy_to_host_async()
    return [np.asarray(a) for a in snap]


def one_by_one(snap: Sequence[jax.Array]) -> object:
    out = []
    for a in snap:
        a.copy_to_host_async()
        out.append(np.asarray(a))
    return out


def pinned_host(snap: Sequence[jax.Array]) -> object:
    host = jax.device_put(list(snap), snap[0].sharding.with_memory_kind("pinned_host"))
    jax.block_until_ready(host)
    return [np.asarray(a) for a in host]


class Loop:
    def __init__(self, state: list[jax.Array], x: jax.Array) -> None:
        self.state, self.x = state, x

    def run(self, steps: int, copier: Copier | None, every: int) -> dict[str, Any]:
        times: list[float] = []
        copies: list[float] = []
        worker: threading.Thread | None = None
        for i in range(steps):
            t = time.perf_counter()
            self.state, self.x = step(self.state, self.x)
            jax.block_until_ready(self.state[0])
            times.append(time.perf_counter() - t)
            if copier is not None and i % every == 0 and (worker is None or not worker.is_alive()):
                worker = threading.Thread(target=self._copy, args=(copier, list(self.state), copies))
                worker.start()
        if worker is not None:
            worker.join()
        return {
            "step_p50_ms": round(1e3 * statistics.median(times), 2),
            "step_mean_ms": round(1e3 * statistics.mean(times), 2),
            "step_max_ms": round(1e3 * max(times), 1),
            "copies": len(copies),
            "copy_s_p50": round(statistics.median(copies), 3) if copies else None,
        }

    @staticmethod
    def _copy(copier: Copier, snap: list[jax.Array], took: list[float]) -> None:
        began = time.perf_counter()
        copier(snap)
        took.append(time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-gb", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=60, help="steps per way of copying")
    parser.add_argument("--every", type=int, default=10, help="a copy every this many steps")
    args = parser.parse_args()
    loop = Loop(*make_state(args.state_gb, 48))
    gb = sum(a.nbytes for a in loop.state) / 2**30
    result: dict[str, Any] = {"backend": jax.default_backend(), "state_gb": round(gb, 2)}
    loop.run(5, None, args.every)  # compiled
    ways: list[tuple[str, Copier | None]] = [
        ("none", None),
        ("all_at_once", all_at_once),
        ("none_again", None),
        ("one_by_one", one_by_one),
        ("pinned_host", pinned_host),
    ]
    for name, copier in ways:
        try:
            figures = loop.run(args.steps, copier, args.every)
        except Exception as exc:  # a memory kind this backend lacks: said, and the others still run
            figures = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        if figures.get("copy_s_p50"):
            figures["copy_gbps"] = round(gb / figures["copy_s_p50"], 2)
        result[name] = figures
        print(f"{name:12s} {figures}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

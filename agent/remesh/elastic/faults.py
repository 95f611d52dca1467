"""Faults injected into a trainer on purpose, by tests and benchmarks: a value, built at the entry point.

The library never reads them from anywhere: a trainer script that wants them builds ``Faults`` (from
its own flags, or from the environment with ``Faults.from_env()``, as the example trainers do) and
hands it to ``Session(faults=...)``. None is injected by default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["FAULT_ENV", "FailOnce", "Faults"]

# The environment variables ``Faults.from_env`` reads, by field.
FAULT_ENV = {
    "buddy_copy_delay_s": "REMESH_FAULT_BUDDY_COPY_DELAY_S",
    "compile_delay_s": "REMESH_FAULT_COMPILE_DELAY_S",
    "snapshot_shard_delay_s": "REMESH_FAULT_SNAPSHOT_SHARD_DELAY_S",
    "collective_fails_at_step": "REMESH_FAULT_COLLECTIVE_AT_STEP",
}


@dataclass(frozen=True)
class Faults:
    """What goes wrong on this host, on purpose."""

    # Every buddy copy first sleeps this long plus the loop's own shortest recent interval between
    # copies (its waits for copies left out): a copy is slower than a step by this much however fast
    # or slow the machine runs the loop, so the loop waits about this long per copy, and no longer
    # (its peers wait as long in the next collective, which must not time out).
    buddy_copy_delay_s: float = 0.0
    # Compiling a step of the user's loop (``Epoch.jit``) first sleeps this long, as on a slower or
    # busier host.
    compile_delay_s: float = 0.0
    # A snapshot's copy to the host pauses this long before each shard, as a state of gigabytes
    # takes seconds to copy.
    snapshot_shard_delay_s: float = 0.0
    # The step after this many steps fails here once, as a collective does when the network between
    # healthy hosts fails for a moment (its peers' collectives then time out). None: never.
    collective_fails_at_step: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Faults:
        """The faults ``REMESH_FAULT_*`` name (``FAULT_ENV``); unset or empty: none."""
        env = os.environ if env is None else env

        def number(field: str) -> float:
            return float(env.get(FAULT_ENV[field]) or 0)

        at = env.get(FAULT_ENV["collective_fails_at_step"]) or ""
        return cls(
            buddy_copy_delay_s=number("buddy_copy_delay_s"),
            compile_delay_s=number("compile_delay_s"),
            snapshot_shard_delay_s=number("snapshot_shard_delay_s"),
            collective_fails_at_step=int(at) if at and int(at) >= 0 else None,
        )


class FailOnce:
    """A fault that fires once in a process: at the step it names, then never again."""

    def __init__(self, step: int | None) -> None:
        self._step = step

    def now(self, step: int) -> bool:
        if self._step is None or step != self._step:
            return False
        self._step = None
        return True

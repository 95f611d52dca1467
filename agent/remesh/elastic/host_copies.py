"""Copies of the training state from the devices to host memory, by the fastest path that is safe.

What a copy costs depends on the backend (measured with JAX 0.10):

- On CPU the "device" is host memory: ``np.asarray`` of a device buffer is a view of it, made at
  no cost, and it lives only as long as the buffer (the runtime frees buffers when it is torn down,
  and a donated buffer is written over). A copy that must outlive its buffer is a real copy.
- On an accelerator ``np.asarray`` is already a fresh host copy (the bytes come over the bus), and
  ``np.array(copy=True)`` copies them a second time: 0.5 GB/s against 1.07 GB/s on a TPU v5e.
  Starting every buffer's transfer at once (``copy_to_host_async``) and then taking each one runs
  the transfers back to back: 2.1 GB/s there. In benchmarks/accelerator.py (2.15 GB beside 61 ms
  steps, 2026-12-07) a snapshot took 3.0 s that way against 3.7-4.0 s one buffer at a time, and the
  mean step was 96 ms against 113 (67 and 75 without snapshots): both slow the mean step, one at a
  time more (docs/measurements.md says where that time goes, as far as it is known).

``host_copy`` is one array's copy. ``SnapshotCopy`` is one snapshot of this process's own shards on
its way to the host: it waits for the step that computed them, starts every shard's transfer, then
takes each shard's host copy in turn and lets go of that shard's device buffer at once (a snapshot
held until copied whole would hold a second copy of the state in device memory); it stops at the
next shard when told to (an epoch being left does not wait for a copy it will not restore from).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Mapping
from typing import Generic, Literal, TypeVar

import jax
import numpy as np

__all__ = ["SnapshotCopy", "aliases_device_memory", "copies_of", "host_copy"]

K = TypeVar("K", bound=Hashable)

# What a copy is doing: waiting for the step that computes its arrays (a step stuck in a collective
# with a dead peer waits here: the watchdog's business), copying (its own work, progressing), done.
Phase = Literal["step", "copy", "done"]


def aliases_device_memory(x: jax.Array) -> bool:
    """Whether ``np.asarray(x)`` is a view of ``x``'s device buffer rather than a copy (on CPU)."""
    return all(d.platform == "cpu" for d in x.devices())


def host_copy(x: jax.Array) -> np.ndarray:
    """``x``'s values in host memory that outlive its device buffer, copied once: ``np.asarray`` on
    an accelerator (a fresh host copy already), a copy of that view on CPU."""
    host = np.asarray(x)
    return host.copy() if aliases_device_memory(x) else host


class SnapshotCopy(Generic[K]):
    """One snapshot's arrays (``shards``: key -> a single-device array) copied to the host.

    Made on the training loop's thread, which hands over its references (``shards`` is emptied), and
    run once (``run``) on a background thread. ``owned``: every host copy must outlive its device
    buffer (``host_copy``); otherwise ``np.asarray`` (a view of the buffer on CPU, which the caller
    then copies elsewhere before the buffer goes; until ``release`` the view keeps it, and it is
    counted as held). ``shard_delay_s``: fault injection, a pause before each shard's copy.
    """

    def __init__(self, shards: dict[K, jax.Array], *, owned: bool, shard_delay_s: float = 0.0) -> None:
        self._shards: dict[K, jax.Array | None] = dict(shards)
        shards.clear()
        self._owned = owned
        self._delay_s = shard_delay_s
        self.nbytes = sum(int(x.nbytes) for x in self._shards.values() if x is not None)
        self._held = self.nbytes
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.phase: Phase = "step"
        self.created = self.since = time.monotonic()
        # Seconds spent copying once the step was done (the transfers, not the wait for the step).
        self.copy_s = 0.0

    @property
    def held_bytes(self) -> int:
        """Device bytes this copy still keeps alive."""
        return self._held

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop at the next shard: what was copied is dropped (``run`` returns None)."""
        self._stop.set()

    def release(self) -> None:
        """The caller is done with the host copies: views of device buffers count no more."""
        with self._lock:
            self._shards.clear()
            self._held = 0

    def run(self) -> dict[K, np.ndarray] | None:
        """Every shard's host copy, or None when stopped first. Raises what the step raised (a
        failed collective) while waiting for it."""
        jax.block_until_ready([x for x in self._shards.values() if x is not None])
        if self._stop.is_set():
            self.release()
            return None
        self.phase, self.since = "copy", time.monotonic()
        began = self.since
        for x in self._shards.values():
            if x is not None:
                x.copy_to_host_async()  # every transfer queued at once: back to back on the bus
        out: dict[K, np.ndarray] = {}
        for key in list(self._shards):
            if self._stop.is_set():
                out.clear()
                self.release()
                return None
            if self._delay_s:
                time.sleep(self._delay_s)
            x = self._shards[key]
            assert x is not None
            host = host_copy(x) if self._owned else np.asarray(x)
            out[key] = host
            if self._owned or not aliases_device_memory(x):
                with self._lock:  # this shard's device buffer goes as soon as the loop drops it too
                    self._shards[key] = None
                    self._held -= int(x.nbytes)
            del x
        self.copy_s = time.monotonic() - began
        self.phase, self.since = "done", time.monotonic()
        return out


def copies_of(shards: Mapping[K, jax.Array]) -> dict[K, np.ndarray]:
    """Host copies of ``shards`` that outlive their device buffers, made the way a snapshot's are
    (every transfer started first, then each one taken)."""
    copies = SnapshotCopy(dict(shards), owned=True).run()
    assert copies is not None  # only a copy told to stop returns none
    return copies

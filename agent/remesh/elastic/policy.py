"""How a session recovers: one immutable value, every default with its reason.

``Policy`` is passed to ``Session`` (``remesh.elastic.session``), which builds its parts from it
(the snapshot schedule, the watchdog, the runtime's timeouts).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Literal

from remesh.elastic.agent_client import PROGRESS_EVERY_S
from remesh.elastic.schedule import SnapshotSchedule
from remesh.v1.contract import COMPILATION_CACHE_ENV

__all__ = ["Policy"]

# A step whose collective waits for a dead peer on CPU fails within the collective timeout; this
# much more lets its error reach the loop, which then recovers in place.
_AFTER_THE_COLLECTIVE_S = 1.0
# On an accelerator a step stuck in a collective never ends: this short a grace lets a step that
# was about to end anyway finish.
_ACCELERATOR_STEP_GRACE_S = 0.2


@dataclass(frozen=True)
class Policy:
    """How the session recovers. Passed in as a value; every default says why."""

    # A collective with a dead peer raises after this long. Each step is short and every member
    # waits at a barrier before the first collective, so healthy members are never this far apart.
    collective_timeout_s: float = 2.0
    # Every member of an epoch must join the JAX runtime within this (a spare's process is already
    # warm: it waits in standby with JAX imported).
    init_timeout_s: float = 60.0
    # After a failed collective, how long to wait for the agent to announce the new epoch before
    # asking the agent for a fresh process.
    epoch_wait_s: float = 30.0
    # Host-memory snapshots kept: the restore is the newest step whose pieces the members hold
    # between them, and one member's newest snapshot may be a step or two ahead of another's.
    snapshots_kept: int = 3
    # Take a host-memory snapshot (this process's own shards, into RAM and /dev/shm) every K steps,
    # in the background: a thread copies them once the step is done, beside the steps after it, so
    # no step waits for it. One at a time (each holds device memory until copied): with one still
    # on its way, a job of one host skips the next one due (a snapshot slower than K steps thus
    # stretches the interval kept: stats["snapshot_every_kept"], and a warning that says which K it
    # fits in); with several hosts the loop waits for it instead (every member must hold the same
    # steps, and each one's skips would follow its own timing). A failure loses at most the K - 1
    # steps after the newest snapshot every member holds, and they are replayed (the batch is a
    # function of the step).
    # "auto" (the default): K is Young's interval, sqrt(2 x cost x mtbf_s), from what a snapshot
    # costs the loop, measured on its own step times and its waits for snapshots, and never fewer
    # steps than a snapshot takes; agreed by every member (the median of their proposals, so no one
    # host's estimate sets everyone's, never below what any member's snapshots fit in); 5 until the
    # first agreement, after 30 steps (remesh.elastic.cadence).
    # A snapshot that costs nothing is taken every 3 steps (on a GPU or TPU the copy is DMA beside
    # the compute) or as often as it fits; one that costs much (on CPU the copy shares the cores
    # with the step, benchmarks/overhead.py) is taken rarely. Buddy copies then go with every
    # snapshot or never (buddy_every 0). A number: every K steps, fixed (1: nothing is ever
    # replayed, whatever it costs). When each is due is ``remesh.elastic.schedule``'s to say.
    snapshot_every: int | Literal["auto"] = "auto"
    # The device memory a snapshot may still hold, in bytes, when the loop hands the next step back
    # (Epoch.done). A snapshot keeps its step's arrays alive on the device until each is copied to
    # the host (released one by one as copied), and the loop has moved on to newer ones meanwhile:
    # on a device nearly full that is an out-of-memory error, not an overhead. None: one snapshot
    # of this process's own shards at most (one is on its way at a time), and the loop never waits.
    # A number: the loop waits (stats["snapshot_wait_s"], a cost the cadence counts) until the
    # snapshot on its way holds no more than this (0: none of an earlier step is left on the device
    # when a step is handed back).
    snapshot_device_budget_bytes: int | None = None
    # The expected time between failures of the whole job, for snapshot_every="auto": the rarer
    # failures are, the more steps a snapshot may be apart (a failure replays half of them, on
    # average). Whatever is set here, once the coordinator has observed a failure the cadence weighs
    # the interval it observes (the time since the job formed over its recoveries, carried by every
    # topology); until then this, or where None (the default) remesh.elastic.cadence.PRIOR_MTBF_S,
    # three hours. Every epoch's start logs the interval weighed and what a failure would replay.
    mtbf_s: float | None = None
    # Save a checkpoint every N steps from rank 0 (0: never).
    checkpoint_every: int = 0
    # A step blocked this long reports it (the agent tells the coordinator): when every other member
    # is blocked like this and one is not, that one stopped taking part and is replaced, before the
    # collective times out. None: half the collective timeout (a healthy step here takes tens of ms).
    stall_report_s: float | None = None
    # A step still running this long after a new epoch was announced is stuck (in a collective with
    # a dead peer, or in the loop's own code): the process exits for the agent's warm standby process
    # to take over, with the reason named (remesh.elastic.exits). "auto" (the default) keeps the
    # process where it can recover in place: on CPU a collective with a dead peer fails by itself
    # within collective_timeout_s (at once when the peer's process died), so a step gets that and a
    # second more, fails, and the process re-meshes in place, keeping its snapshots in memory and its
    # compiled programs' cache; on GPU and TPU a collective never gives up, so 0.2 s, and a new epoch
    # that leaves out a member of the step's epoch ends it at once. None: always wait it out.
    stuck_step_exit_s: float | Literal["auto"] | None = "auto"
    # Joining an epoch (runtime, restore, compile, the barrier) still blocked this long after a newer
    # epoch was announced: a member of the joined epoch died or never came (the coordination service
    # would wait init_timeout_s for it). The process exits for the warm standby to join the new one.
    # Longer than a step's grace: a healthy join of a doomed epoch finishes, then leaves in-process.
    stuck_join_exit_s: float | None = 2.0
    # Every K steps each host copies one peer's own shards into its RAM (a buddy copy), in the
    # background, so a host lost under plain FSDP (no second replica) is restored without storage.
    # A multiple of snapshot_every (the peer serves its snapshot of the step). Every host copies at
    # the same steps, never skipping one: a restore needs one step that the lost host's buddy copied
    # and every survivor still holds. A copy still running when the next is due runs beside it;
    # with two on their way, the loop waits (stats["buddy_wait_s"]) and says to raise K. None (the
    # default): with every snapshot, so that a host lost under FSDP loses no more steps than the
    # snapshots' interval. 0: never. Only where a shard has one holder.
    buddy_every: int | None = None
    # At the end of the run, gather the whole state onto every process (a collective) so that
    # ``final_leaves`` holds it even when it is sharded.
    gather_final: bool = False
    # Tell the agent the newest completed step at most this often (remesh.elastic.agent_client); a
    # step that follows a stall report is told at once.
    progress_every_s: float = PROGRESS_EVERY_S
    # In-process recoveries before the session asks for a fresh process instead.
    max_in_process_recoveries: int = 50
    # Persistent XLA compilation cache: a re-initialised process compiles from it. By default
    # $REMESH_COMPILATION_CACHE_DIR, else remesh-jax-cache in the temporary directory (kept across
    # runs: a job started again finds its programs compiled).
    compilation_cache_dir: str | None = field(
        default_factory=lambda: (
            os.environ.get(COMPILATION_CACHE_ENV) or os.path.join(tempfile.gettempdir(), "remesh-jax-cache")
        )
    )
    # Host-memory snapshots that survive the trainer process (tmpfs); None keeps them in-process only.
    shm_dir: str | None = "/dev/shm" if os.path.isdir("/dev/shm") else None
    # The address the other members of an epoch fetch this host's pieces from (its piece server).
    # None: the source address of this host's route to the epoch's coordination service, the right
    # one unless the hosts reach each other through an address translation.
    peer_host: str | None = None

    @property
    def own_snapshots_kept(self) -> int:
        """Own snapshots kept: ``snapshots_kept``, and with buddy copies on, as far back as a buddy
        copy can lag (``SnapshotSchedule.own_snapshots_kept``)."""
        return SnapshotSchedule.of(self).own_snapshots_kept(self.snapshots_kept)

    def step_exit_after_s(self, platform: str) -> float | None:
        """``stuck_step_exit_s`` on ``platform`` ("cpu", "gpu", "tpu"), "auto" resolved."""
        if self.stuck_step_exit_s != "auto":
            return self.stuck_step_exit_s
        if platform == "cpu":
            return self.collective_timeout_s + _AFTER_THE_COLLECTIVE_S
        return _ACCELERATOR_STEP_GRACE_S

    @property
    def stall_report_after_s(self) -> float:
        """When a blocked step is reported: ``stall_report_s``, by default half the collective timeout."""
        return self.stall_report_s or self.collective_timeout_s / 2

    def __post_init__(self) -> None:
        if self.progress_every_s < 0:
            raise ValueError(f"progress_every_s must be >= 0, not {self.progress_every_s}")
        if self.snapshot_device_budget_bytes is not None and self.snapshot_device_budget_bytes < 0:
            raise ValueError(
                f"snapshot_device_budget_bytes must be None or >= 0, not {self.snapshot_device_budget_bytes}"
            )
        SnapshotSchedule.check(self.snapshot_every, self.buddy_every, self.mtbf_s)

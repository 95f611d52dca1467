"""When a trainer snapshots its state and copies its buddy's: the snapshot schedule, one object.

A ``SnapshotSchedule`` is passed to the session like a save policy (``Session(schedule=...)``;
``SnapshotSchedule.of(policy)`` by default). It owns

- the **cadence**: every K steps, K fixed or chosen from what snapshots cost
  (``remesh.elastic.cadence``), begun anew at every epoch;
- the **buddy rule**: copies of the buddy's pieces with every snapshot, every N steps (a multiple of
  K: a buddy copies the snapshot its peer took at that step) or never;
- **due**: whether step S is snapshotted, and whether it is a buddy step;
- the **interval kept**: the steps between the last two snapshots kept, said when it is longer than
  asked;
- the **agreement** of a new K by every member of the epoch (the median of their proposals, never
  below what any member's snapshots fit in, from an agreed later step);
- the **failure interval** the automatic cadence weighs: the one the coordinator observes
  (``observe_failures``) once there is one, else the user's ``mtbf_s``, else ``PRIOR_MTBF_S``. Proposals travel through ``Proposals``: the session posts them to the
  coordination service's key-value store and waits for them as for a step.

No JAX, no sockets, no clock: the session tells it step and snapshot times.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

import structlog

from remesh.elastic.cadence import PRIOR_MTBF_S, Cadence

if TYPE_CHECKING:
    from remesh.elastic.policy import Policy

__all__ = ["Proposals", "SnapshotSchedule"]

log = structlog.get_logger("remesh.elastic")


class Proposals(Protocol):
    """How the members of an epoch exchange their proposed intervals."""

    def post(self, name: str, value: int) -> None:
        """Post this member's ``value`` under ``name`` (no waiting)."""

    def gather(self, name: str, asked: int, at: int) -> list[int]:
        """Every member's value under ``name``, posted at step ``asked`` and needed by step ``at``:
        waits for a member that is behind as for a step, and raises as a failed collective does."""
        ...


class SnapshotSchedule:
    """Snapshots every ``every`` steps (or "auto": K from what they cost and the job's failure
    interval), buddy copies every ``buddy_every`` steps (None: with every snapshot; 0: never).
    ``mtbf_s``: the failure interval to assume until the coordinator observes one (None:
    ``PRIOR_MTBF_S``)."""

    def __init__(
        self,
        every: int | Literal["auto"] = "auto",
        buddy_every: int | None = None,
        mtbf_s: float | None = None,
    ) -> None:
        self.check(every, buddy_every, mtbf_s)
        self.asked = every
        self.buddy_every = buddy_every
        self.mtbf_s = mtbf_s
        # The failure interval the coordinator observes, asked at each proposal (None: none yet).
        self._observed: Callable[[], float | None] = lambda: None
        # The least interval the snapshots of an earlier epoch fit in (None: none timed yet).
        self._fits: int | None = None
        self.cadence = self._cadence(0)
        # The (asked, kept) intervals warned of (``snapshot_kept``), across epochs.
        self._told: set[tuple[int, int]] = set()
        # Seconds the loop waited for snapshots since the last step completed.
        self._waited_s = 0.0

    @classmethod
    def of(cls, policy: Policy) -> SnapshotSchedule:
        return cls(policy.snapshot_every, policy.buddy_every, policy.mtbf_s)

    @staticmethod
    def check(every: int | Literal["auto"], buddy_every: int | None, mtbf_s: float | None) -> None:
        """Raise ``ValueError`` for a schedule that cannot be kept, saying why."""
        if every == "auto":
            if buddy_every not in (None, 0, 1):
                raise ValueError(
                    f'with snapshot_every="auto" a buddy copy goes with every snapshot (buddy_every None '
                    f"or 1) or with none (0), not every {buddy_every} steps"
                )
            if mtbf_s is not None and mtbf_s <= 0:
                raise ValueError(f"mtbf_s must be positive (or None: observed), not {mtbf_s}")
            return
        if not isinstance(every, int) or every < 1:
            raise ValueError(f'snapshot_every must be >= 1 or "auto", not {every!r}')
        if buddy_every is not None and (buddy_every < 0 or (buddy_every and buddy_every % every)):
            raise ValueError(
                f"buddy_every ({buddy_every}) must be None (with every snapshot), 0 or a multiple of "
                f"snapshot_every ({every}): a buddy copies the snapshot its peer took at that step"
            )

    @property
    def automatic(self) -> bool:
        return self.asked == "auto"

    @property
    def copies_buddies(self) -> bool:
        return self.buddy_every != 0

    def own_snapshots_kept(self, snapshots_kept: int) -> int:
        """Own snapshots kept: ``snapshots_kept``, and with buddy copies on, every snapshot of the last
        3 buddy intervals. A host's newest whole buddy copy may be that far behind the step a
        survivor reached (two copies on their way, and the survivor a step ahead), and every
        survivor must still hold its own shards of that step for the restore to find it whole."""
        if snapshots_kept <= 0:
            return 0
        if self.asked == "auto":  # a copy with every snapshot, whatever K is agreed
            return max(snapshots_kept, 3 + 1)
        buddy = self.asked if self.buddy_every is None else self.buddy_every
        return max(snapshots_kept, 3 * buddy // self.asked + 1)

    # ---- the cadence of an epoch ------------------------------------------------------------------

    def begin(self, since: int) -> None:
        """An epoch begins at step ``since``: the cadence begins anew (measured afresh, agreed afresh),
        and says what a failure would replay. The least interval the last epoch's snapshots fit in is
        kept for that: a K they do not fit in is not the interval kept."""
        self._fits = self.cadence.fits_every() or self._fits
        self.cadence = self._cadence(since)
        log.info("snapshot cadence", since=since, **self.expected())

    def _cadence(self, since: int) -> Cadence:
        every = self.asked
        return Cadence.automatic(since, self.failure_interval()[0]) if every == "auto" else Cadence(every)

    def observe_failures(self, observed: Callable[[], float | None]) -> None:
        """Where the coordinator's observed failure interval comes from (seconds, None while it has
        observed none): asked at every proposal, so the interval follows the job's own failures."""
        self._observed = observed

    def failure_interval(self) -> tuple[float, str]:
        """The failure interval the automatic cadence weighs now, and where it comes from."""
        observed = self._observed()
        if observed is not None and observed > 0:
            return observed, "observed by the coordinator"
        if self.mtbf_s is not None:
            return self.mtbf_s, "Policy.mtbf_s"
        return PRIOR_MTBF_S, "assumed until a failure is observed"

    def expected(self) -> dict[str, object]:
        """What the cadence means for a failure now, for the start-up line and the agreement's: the
        steps a failure replays at most and on average (K - 1, where K is the interval asked, or the
        least one the snapshots were seen to fit in, if longer: those kept are that far apart), and
        the failure interval weighed."""
        every = self.cadence.every
        kept = max(every, self.cadence.fits_every() or self._fits or every)
        mtbf, source = self.failure_interval()
        return {
            "every": every,
            "automatic": self.automatic,
            "replay_max_steps": kept - 1,
            "replay_mean_steps": (kept - 1) / 2,
            "mtbf_s": round(mtbf, 1) if self.automatic else None,
            "mtbf_from": source if self.automatic else None,
        }

    @property
    def every(self) -> int:
        return self.cadence.every

    @property
    def since(self) -> int:
        return self.cadence.since

    def due(self, step: int, proposals: Proposals) -> bool:
        """Whether ``step`` is snapshotted. With an automatic cadence: at an agreed step every member
        posts its Young's K and the least K its snapshots fit in (no collective), and the median of
        the first, never below the largest of the second, counts from an agreed later step; that
        step reads every member's, there already unless a member lags several steps behind."""
        cadence = self.cadence
        if cadence.agreeing is not None and step >= cadence.agreeing[1]:
            self._agree(proposals)
        due = cadence.due(step)
        if due and (at := cadence.calibrates_at(step)) is not None:
            cadence.mtbf_s = self.failure_interval()[0]
            young, fits = cadence.young_every(), cadence.fits_every() or 1
            cadence.agreeing = (step, at)
            proposals.post(f"cadence-{step}", young)
            proposals.post(f"cadence-fits-{step}", fits)
            log.debug("snapshot cadence proposed", step=step, every=young, fits=fits, cost_s=cadence.cost_s())
        return due

    def _agree(self, proposals: Proposals) -> None:
        cadence = self.cadence
        assert cadence.agreeing is not None
        asked, at = cadence.agreeing
        posted = proposals.gather(f"cadence-{asked}", asked, at)
        fits = proposals.gather(f"cadence-fits-{asked}", asked, at)
        cost, before = cadence.cost_s(), cadence.every
        cadence.agree(at, posted, fits)
        log.info(
            "snapshot cadence agreed",
            asked_at=asked,
            from_step=at,
            was=before,
            cost_s=None if cost is None else round(cost, 4),
            proposals=posted,
            fits=fits,
            **self.expected(),
        )

    def buddy_step(self, step: int) -> bool:
        """Whether every host copies its buddy's pieces of ``step`` (the same steps on every host)."""
        if not self.copies_buddies:
            return False
        if self.buddy_every is None or self.automatic:  # with every snapshot
            return self.cadence.due(step)
        return step % self.buddy_every == 0

    # ---- what snapshots cost -----------------------------------------------------------------------

    def step_completed(self, step: int, seconds: float | None) -> None:
        """Step ``step`` was completed ``seconds`` after the one before (None: not a step to time it
        by). What the loop waited for snapshots meanwhile is left out: a cost of its own
        (``observe_wait``), which the step times would otherwise count again."""
        if seconds is not None:
            self.cadence.observe(step, max(seconds - self._waited_s, 0.0))
        self._waited_s = 0.0

    def observe_wait(self, seconds: float) -> None:
        """The loop waited ``seconds`` for a snapshot."""
        self.cadence.observe_wait(seconds)
        self._waited_s += seconds

    def snapshot_kept(self, step: int, seconds: float) -> int | None:
        """A snapshot of ``step`` was kept ``seconds`` after its step was dispatched: the interval kept
        since the one before, where both were on the cadence (None otherwise). One longer than asked
        (a snapshot took longer than the steps between them: the ones due meanwhile were skipped) is
        said once for each interval asked and kept, with one that snapshots fit in."""
        cadence = self.cadence
        cadence.observe_snapshot(seconds)
        kept = cadence.kept(step)
        if kept is None:
            return None
        asked = cadence.every
        if kept == asked or (asked, kept) in self._told:
            return kept
        self._told.add((asked, kept))
        # What the recent snapshots fit in; where that is no more than asked (this one was slower
        # than the others), what was kept.
        fits = cadence.fits_every() or kept
        fix = fits if fits > asked else kept
        adapts = self.automatic and fits > asked
        log.warning(
            "snapshots are kept further apart than asked: one took longer than the steps between "
            "them, and one due while the last is still on its way is skipped"
            + (
                f"; the automatic cadence moves to at least {fits} steps when its members next agree"
                if adapts
                else f"; ask for an interval they fit in: Policy(snapshot_every={fix})"
            ),
            asked_every=asked,
            kept_every=kept,
            snapshot_s=round(max(cadence.snapshot_s, default=0.0), 3),
            step_s=round(statistics.median(cadence.step_s), 4) if cadence.step_s else None,
            fix=f"Policy(snapshot_every={fix})",
        )
        return kept

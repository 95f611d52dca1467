"""When host-memory snapshots are taken: every K steps, K fixed or chosen from what they cost.

A snapshot (and the buddy copy made of it) costs the steps it runs beside: on CPU the copies share
the cores with the step, on an accelerator they share the host's memory bandwidth with the input
pipeline. Fewer snapshots cost less but lose more: a failure replays the steps after the newest
snapshot every member holds. The interval that loses least in all is Young's (and Daly's first
order): ``sqrt(2 * C * M)`` seconds between snapshots, where ``C`` is what one snapshot costs the
loop and ``M`` the expected time between failures of the job. ``Cadence`` measures ``C`` from the
loop's own step times (the steps beside a snapshot against the others), so the interval follows the
state size, the host and the step as they are, not as a default guessed them.

A snapshot must also fit in its interval. Only one is on its way at a time (each holds device
memory until copied), so one due while the last is still being copied is skipped, and the interval
kept is longer than asked whenever a snapshot takes longer than K steps. ``Cadence`` remembers what
snapshots really take (from their step's dispatch until kept) and never proposes a K they do not
fit in; ``kept`` says the interval actually kept, for the session to report.

Every member must snapshot the same steps (a restore needs one step every survivor holds, and the
buddy copies are made of the same steps), so a new K is agreed, not decided alone: at an agreed
step each member proposes Young's K from its own measurements and the least K its snapshots fit
in; every member takes the median of the first, never below the largest of the second, from an
agreed later step. The median, because every member's cost estimate comes from noisy step times and
one odd host must not set everyone's interval (the largest would: one host's noise once spaced a
job's snapshots 127 steps apart); the fit floor from every member, because a K a member's
snapshots do not fit in is not kept by that member, and a restore needs a step every survivor holds.

``M`` is the job's failure interval: the one the coordinator observes (the time since the job
formed over the recoveries since, carried by every topology) once it observed one, else
``Policy.mtbf_s`` where the user set it, else ``PRIOR_MTBF_S``.

Pure logic: the session feeds it step times and does the agreeing (``remesh.elastic.session``).
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

# Snapshots taken at one K before the members agree on the next: enough steps beside a snapshot to
# take a median of, few enough that a costly first K is not kept long.
CALIBRATE_AFTER = 6
# The first K of an automatic cadence, before anything is measured.
FIRST_EVERY = 5
# The smallest K an automatic cadence takes: with snapshots every 1 or 2 steps every step runs
# beside one and there are no others to measure the cost against, so it could never grow again.
LEAST_EVERY = 3
# Snapshots whose time is remembered: the slowest of them sets the least K they fit in (a snapshot
# slower than its interval makes the next one due be skipped).
SNAPSHOTS_REMEMBERED = 5
# Step times remembered for that (their median is the step's time).
STEPS_REMEMBERED = 31
# The job's failure interval assumed until the coordinator observes a failure, where the user gave
# none (Policy.mtbf_s): three hours, as a 16,000-GPU job saw one unexpected interruption every 3.1
# hours (Llama 3's 54-day pre-training run). A smaller job fails more rarely; its first failure
# replaces the assumption with what it observes.
PRIOR_MTBF_S = 3 * 3600.0


def young_daly_every(cost_s: float, step_s: float, mtbf_s: float, least: int = 1, most: int = 10_000) -> int:
    """Steps between snapshots that waste least: ``sqrt(2 * cost_s * mtbf_s)`` seconds, in steps of
    ``step_s``, from ``least`` to ``most``. A snapshot that costs nothing is taken every ``least``."""
    if step_s <= 0 or not math.isfinite(step_s):
        raise ValueError(f"a step must take a positive time, not {step_s}")
    if cost_s <= 0:
        return least
    every = math.sqrt(2.0 * cost_s * mtbf_s) / step_s
    return max(least, min(most, round(every)))


def fitting_every(snapshot_s: float, step_s: float) -> int:
    """The fewest steps apart that snapshots of ``snapshot_s`` each (from their step's dispatch until
    kept) can be taken, one at a time, at ``step_s`` a step: more than ``snapshot_s`` must pass
    between one and the next, else the next is due while the last is still on its way."""
    if step_s <= 0 or not math.isfinite(step_s):
        raise ValueError(f"a step must take a positive time, not {step_s}")
    return max(1, math.floor(snapshot_s / step_s) + 1)


@dataclass
class Cadence:
    """Snapshots every ``every`` steps counted from step ``since``; with ``mtbf_s`` set, ``every`` is
    re-chosen (``young_daly_every``) after each ``CALIBRATE_AFTER`` snapshots, once agreed."""

    every: int
    since: int = 0
    # Expected seconds between failures of the job: set, the cadence is automatic.
    mtbf_s: float | None = None
    most: int = 10_000
    # Completed steps: seconds each took, those beside a snapshot and the others (steps beside other
    # background work, a checkpoint, are told apart by the caller and never given).
    beside: list[float] = field(default_factory=list)
    quiet: list[float] = field(default_factory=list)
    # (calibration step, step the agreed K counts from) while the members agree.
    agreeing: tuple[int, int] | None = None
    # Seconds each recent snapshot was on its way (from its step's dispatch until kept), and recent
    # step times: what sets the least K a snapshot fits in (``fits_every``), at a fixed K as well.
    snapshot_s: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=SNAPSHOTS_REMEMBERED)
    )
    step_s: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=STEPS_REMEMBERED)
    )
    # Seconds the loop waited for snapshots (the device memory budget, a buddy copy's step), and the
    # snapshots kept, since the last agreement: a wait is a cost the step times do not show.
    waited_s: float = 0.0
    taken: int = 0
    # The step of the last snapshot kept (``kept``).
    last_kept: int | None = None

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"snapshots must be every >= 1 steps, not {self.every}")

    @classmethod
    def automatic(cls, since: int, mtbf_s: float, most: int = 10_000) -> Cadence:
        if mtbf_s <= 0:
            raise ValueError(f"mtbf_s must be positive, not {mtbf_s}")
        return cls(min(FIRST_EVERY, most), since, mtbf_s, most)

    def due(self, step: int) -> bool:
        """Whether a snapshot of ``step`` (the state after it) is taken."""
        return step >= self.since and (step - self.since) % self.every == 0

    def beside_snapshot(self, step: int) -> bool:
        """Whether the background work of a snapshot runs beside ``step``: one of the step before
        (copied while this step runs) or of this step (its copy waits for it)."""
        return self.due(step) or self.due(step - 1)

    def observe(self, step: int, seconds: float) -> None:
        """Step ``step`` took ``seconds`` (from the end of the step before; waits for snapshots left
        out: they are told with ``observe_wait``)."""
        self.step_s.append(seconds)
        if self.mtbf_s is None:
            return
        (self.beside if self.beside_snapshot(step) else self.quiet).append(seconds)

    def observe_snapshot(self, seconds: float) -> None:
        """A snapshot was kept ``seconds`` after its step was dispatched."""
        self.snapshot_s.append(seconds)
        self.taken += 1

    def observe_wait(self, seconds: float) -> None:
        """The loop waited ``seconds`` for a snapshot."""
        self.waited_s += seconds

    def fits_every(self) -> int | None:
        """The least K the recent snapshots fit in (``fitting_every``: the slowest of them at the
        median step); None until a snapshot and a step were measured."""
        if not self.snapshot_s or not self.step_s:
            return None
        return fitting_every(max(self.snapshot_s), statistics.median(self.step_s))

    def kept(self, step: int) -> int | None:
        """A snapshot of ``step`` was kept: the steps since the one kept before it, where both were
        due at the current K (None otherwise: the first one, or one taken off the cadence)."""
        last, self.last_kept = self.last_kept, step
        if last is None or last < self.since or not (self.due(last) and self.due(step)):
            return None
        return step - last

    def calibrates_at(self, step: int) -> int | None:
        """At a snapshot step where the members agree on the next K: the step it counts from (the
        next snapshot step of this K at least 4 steps on, so that every member knows the answer
        before any reaches it). None elsewhere; the same answer on every member."""
        if self.mtbf_s is None or self.agreeing is not None or step <= self.since or not self.due(step):
            return None
        if (step - self.since) // self.every % CALIBRATE_AFTER:
            return None
        return step + self.every * math.ceil(4 / self.every)

    def cost_s(self) -> float | None:
        """What one snapshot costs the loop, in seconds: what the steps beside it lose
        (``beside_cost_s``) plus what the loop waited for it (``observe_wait``, per snapshot kept).
        None where neither is known."""
        beside = self.beside_cost_s()
        waited = self.waited_s / self.taken if self.taken else 0.0
        if beside is None:
            return waited if waited > 0 else None
        return beside + waited

    def beside_cost_s(self) -> float | None:
        """What one snapshot costs the steps beside it, in seconds: how much longer they take
        than the others (the medians), less what the medians' own noise could make of nothing (two
        standard errors), times the steps beside each; 0 where the steps beside are no slower.
        None until both were seen, and where the step times cannot tell the difference (either way)
        from their noise: unknown, so the cadence stays where it is. Counted as none, such a cost took K to its
        least, where two steps in three run beside a snapshot, too few others remain to measure it
        against, and K never grew again, however much the snapshots cost; counted as its upper
        bound, a few milliseconds of noise would space cheap snapshots ten steps apart."""
        if len(self.beside) < 2 or len(self.quiet) < 2:
            return None
        per_step = statistics.median(self.beside) - statistics.median(self.quiet)
        noise = 2 * math.hypot(_median_error(self.beside), _median_error(self.quiet))
        if abs(per_step) <= noise and noise > 0:
            return None
        return max(0.0, per_step - noise) * 2  # two steps run beside each snapshot (beside_snapshot)

    def young_every(self) -> int:
        """Young's K from the cost measured here (the current K until one is)."""
        if self.mtbf_s is None:
            return self.every
        cost = self.cost_s()
        times = self.quiet or list(self.step_s)
        if cost is None or not times:
            return self.every
        return young_daly_every(
            cost, statistics.median(times), self.mtbf_s, min(LEAST_EVERY, self.most), self.most
        )

    def proposal(self) -> int:
        """This member's K alone: Young's (``young_every``), never fewer steps than a snapshot fits in
        (``fits_every``): a K snapshots do not fit in is not kept (every other one due is skipped),
        whatever the cost. A fixed cadence proposes none but its own."""
        if self.mtbf_s is None:
            return self.every
        return min(self.most, max(self.young_every(), self.fits_every() or 1))

    def agree(self, at: int, proposals: Sequence[int], fits: Sequence[int] = ()) -> None:
        """Every member's proposals are in: from step ``at`` on, the median of their Young's K
        (``proposals``; the upper median of an even count), never below the largest K a member's
        snapshots fit in (``fits``). Measured anew at the new K."""
        every = max(statistics.median_high(proposals), max(fits, default=1))
        self.every = max(min(LEAST_EVERY, self.most), min(self.most, every))
        self.since = at
        self.agreeing = None
        self.beside.clear()
        self.quiet.clear()
        self.waited_s, self.taken = 0.0, 0


def _median_error(values: list[float]) -> float:
    """The standard error of the median of ``values``, from their median absolute deviation (robust
    to the odd slow step): 1.2533 x sigma / sqrt(n), sigma = 1.4826 x MAD for normal noise."""
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return 1.2533 * 1.4826 * mad / math.sqrt(len(values))


def parse_every(text: str) -> int | Literal["auto"]:
    """A command line's snapshot interval: a number of steps, or "auto" (``Policy.snapshot_every``)."""
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f'snapshot interval: a number of steps or "auto", not {text!r}') from None

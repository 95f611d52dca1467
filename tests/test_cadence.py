"""The snapshot cadence (remesh.elastic.cadence): pure logic, no processes."""

from __future__ import annotations

import math

import pytest

from remesh.elastic import Policy
from remesh.elastic.cadence import (
    CALIBRATE_AFTER,
    FIRST_EVERY,
    LEAST_EVERY,
    Cadence,
    fitting_every,
    parse_every,
    young_daly_every,
)


def test_young_daly_interval_balances_what_a_snapshot_costs_against_what_a_failure_replays() -> None:
    # 0.15 s a snapshot, 0.25 s a step, a failure every 3 hours: sqrt(2 * 0.15 * 10800) = 56.9 s.
    assert young_daly_every(0.15, 0.25, 3 * 3600) == round(math.sqrt(2 * 0.15 * 10800) / 0.25) == 228
    # Failures ten times as often: snapshots about three times as close.
    assert young_daly_every(0.15, 0.25, 1080) == 72
    # Free snapshots: as often as allowed; dear ones: no rarer than allowed.
    assert young_daly_every(0.0, 0.25, 10800, least=3) == 3
    assert young_daly_every(50.0, 0.01, 10800, most=1000) == 1000
    with pytest.raises(ValueError, match="positive time"):
        young_daly_every(0.1, 0.0, 10800)


def test_a_fixed_cadence_is_every_kth_step_and_never_calibrates() -> None:
    cadence = Cadence(4)
    assert [s for s in range(1, 13) if cadence.due(s)] == [4, 8, 12]
    for step in range(1, 100):
        cadence.observe(step, 0.1)
        assert cadence.calibrates_at(step) is None
    assert cadence.cost_s() is None and cadence.proposal() == 4
    with pytest.raises(ValueError, match=">= 1"):
        Cadence(0)


def test_an_automatic_cadence_counts_from_the_epochs_first_step_and_agrees_at_the_same_steps_everywhere() -> (
    None
):
    # Two members of an epoch restored at step 7: the same steps snapshotted, the same step to agree at.
    a, b = Cadence.automatic(7, 3600.0), Cadence.automatic(7, 3600.0)
    assert a.every == FIRST_EVERY and not a.due(6) and a.due(7) and a.due(7 + FIRST_EVERY)
    asks = [s for s in range(8, 200) if a.calibrates_at(s) is not None]
    assert asks == [s for s in range(8, 200) if b.calibrates_at(s) is not None]
    first = 7 + CALIBRATE_AFTER * FIRST_EVERY
    assert asks[0] == first
    # The agreed cadence counts from a later snapshot step, at least 4 steps on.
    at = a.calibrates_at(first)
    assert at is not None and at - first >= 4 and a.due(at)
    # While the members agree, no second agreement begins.
    a.agreeing = (first, at)
    assert all(a.calibrates_at(s) is None for s in range(first, 400))


def test_the_cost_is_how_much_longer_the_steps_beside_a_snapshot_take() -> None:
    cadence = Cadence.automatic(0, 3 * 3600.0)
    assert cadence.cost_s() is None  # nothing measured: the current cadence is proposed
    assert cadence.proposal() == FIRST_EVERY
    for step in range(1, 61):
        cadence.observe(step, 0.35 if cadence.beside_snapshot(step) else 0.25)
    assert cadence.beside and cadence.quiet
    # Two steps beside each snapshot, each 0.1 s longer.
    assert cadence.cost_s() == pytest.approx(0.2)
    assert cadence.proposal() == young_daly_every(0.2, 0.25, 3 * 3600, LEAST_EVERY)


def test_a_difference_the_step_times_cannot_tell_from_their_noise_keeps_the_cadence() -> None:
    """Steps beside a snapshot 3 ms slower in the median, with step times spread over +-30 ms: within
    the medians' noise, so the cost is unknown and the current K is proposed again (not the least,
    where too few steps are free of a snapshot to ever measure it); the same 3 ms difference with
    no spread is a cost."""
    noisy, steady = Cadence.automatic(0, 600.0), Cadence.automatic(0, 600.0)
    # Seven values against snapshots every five steps: the jitter does not line up with them.
    spread = [-0.03, -0.02, -0.01, 0.0, 0.01, 0.02, 0.03]
    for step in range(1, 61):
        jitter = spread[step % len(spread)]
        extra = 0.003 if noisy.beside_snapshot(step) else 0.0
        noisy.observe(step, 0.25 + extra + jitter)
        steady.observe(step, 0.25 + extra)
    assert noisy.cost_s() is None and noisy.proposal() == FIRST_EVERY
    assert steady.cost_s() == pytest.approx(0.006)
    assert steady.proposal() == young_daly_every(0.006, 0.25, 600.0, LEAST_EVERY) > LEAST_EVERY


def test_steps_beside_a_snapshot_that_are_no_slower_propose_the_least_interval_not_every_step() -> None:
    cadence = Cadence.automatic(0, 3 * 3600.0)
    for step in range(1, 61):
        cadence.observe(step, 0.2 if cadence.beside_snapshot(step) else 0.25)
    assert cadence.cost_s() == 0.0
    # At every step (or every other) no step would be free of a snapshot to measure against again.
    assert cadence.proposal() == LEAST_EVERY > 2


def test_agreeing_takes_the_median_proposal_never_below_a_fit_from_the_agreed_step_and_measures_anew() -> (
    None
):
    cadence = Cadence.automatic(0, 3600.0)
    for step in range(1, 31):
        cadence.observe(step, 0.3)
    cadence.agreeing = (30, 35)
    # One host's estimate (127: its step times were noisy) does not set everyone's interval.
    cadence.agree(35, [12, 127, 7], [2, 3, 2])
    assert (cadence.every, cadence.since, cadence.agreeing) == (12, 35, None)
    assert cadence.beside == cadence.quiet == []
    assert cadence.due(35) and cadence.due(47) and not cadence.due(40)
    # A member whose snapshots fit in no fewer than 20 steps sets the floor: it would skip others.
    cadence.agree(47, [12, 9, 7], [2, 20, 2])
    assert cadence.every == 20
    # An even count takes the upper median; a proposal below the least interval is raised to it.
    cadence.agree(67, [4, 10])
    assert cadence.every == 10
    cadence.agree(77, [1, 2])
    assert cadence.every == LEAST_EVERY


def test_policy_takes_auto_with_buddy_copies_at_every_snapshot_or_none() -> None:
    assert Policy(snapshot_every="auto").own_snapshots_kept >= 4
    assert Policy(snapshot_every="auto", buddy_every=0).buddy_every == 0
    with pytest.raises(ValueError, match="with every snapshot"):
        Policy(snapshot_every="auto", buddy_every=5)
    with pytest.raises(ValueError, match="mtbf_s must be positive"):
        Policy(snapshot_every="auto", mtbf_s=0)
    with pytest.raises(ValueError, match='or "auto"'):
        Policy(snapshot_every="often")  # type: ignore[arg-type]


def test_a_command_line_interval_is_a_number_or_auto() -> None:
    assert parse_every("auto") == "auto" and parse_every("7") == 7
    with pytest.raises(ValueError, match='number of steps or "auto"'):
        parse_every("sometimes")


def test_a_snapshot_fits_in_more_steps_than_it_takes() -> None:
    """One snapshot at a time: the next one due must come after the last was kept, so more than
    its seconds must pass between them (at least ceil(seconds / step))."""
    assert fitting_every(1.9, 0.064) == 30 == math.ceil(1.9 / 0.064)  # 29.7 steps' worth
    assert fitting_every(1.0, 0.125) == 9  # exactly 8 steps: the 8th is due as it ends
    assert fitting_every(0.01, 0.064) == 1
    assert fitting_every(0.0, 0.5) == 1
    with pytest.raises(ValueError, match="positive time"):
        fitting_every(1.0, 0.0)


def test_an_automatic_cadence_whose_cost_is_unknown_still_moves_to_an_interval_snapshots_fit_in() -> None:
    """Steps beside a snapshot no slower than the others, within their noise (a DMA beside the
    compute): the cost is unknown, which once kept K at 5, however long a snapshot took. A snapshot
    that takes 30 steps' time is proposed an interval it fits in."""
    cadence = Cadence.automatic(0, 3 * 3600.0)
    spread = [-0.003, -0.002, -0.001, 0.0, 0.001, 0.002, 0.003]
    for step in range(1, 31):
        cadence.observe(step, 0.064 + spread[step % len(spread)])
    assert cadence.cost_s() is None
    assert cadence.proposal() == FIRST_EVERY  # nothing known of the snapshots yet
    cadence.observe_snapshot(1.9)
    cadence.observe_snapshot(2.1)  # the slowest of the recent ones counts
    assert cadence.fits_every() == fitting_every(2.1, 0.064) == 33
    assert cadence.proposal() == 33
    # Agreed on: measured anew beside it, but what snapshots take is a fact of the device: kept.
    cadence.agree(35, [cadence.proposal()])
    assert cadence.every == 33 and cadence.fits_every() == 33 and cadence.proposal() == 33


def test_the_loops_waits_for_snapshots_are_a_cost_of_them() -> None:
    """The loop waited (a device memory budget, a buddy copy's step): what the step times do not
    show is counted per snapshot kept, alone where the steps tell nothing, added where they do."""
    cadence = Cadence.automatic(0, 600.0)
    for step in range(1, 61):
        cadence.observe(step, 0.25)
    assert cadence.cost_s() == 0.0  # steps beside a snapshot no slower, no waits
    for _ in range(4):
        cadence.observe_snapshot(0.1)
    cadence.observe_wait(0.2)
    cadence.observe_wait(0.2)
    assert cadence.cost_s() == pytest.approx(0.1)  # 0.4 s over 4 snapshots
    assert cadence.proposal() == young_daly_every(0.1, 0.25, 600.0, LEAST_EVERY) > LEAST_EVERY
    cadence.agree(60, [cadence.proposal()])
    assert cadence.waited_s == 0.0 and cadence.taken == 0

    unknown = Cadence.automatic(0, 600.0)
    unknown.observe(1, 0.25)
    unknown.observe_snapshot(0.1)
    unknown.observe_wait(0.3)
    assert unknown.beside_cost_s() is None and unknown.cost_s() == pytest.approx(0.3)


def test_the_interval_kept_is_between_two_snapshots_on_the_cadence() -> None:
    cadence = Cadence(4)
    assert cadence.kept(4) is None  # the first: nothing to measure from
    assert cadence.kept(8) == 4
    assert cadence.kept(20) == 12  # those due at 12 and 16 were skipped
    assert cadence.kept(23) is None  # off the cadence (the job's last step)
    assert cadence.kept(24) is None  # the one before was off it
    assert cadence.kept(28) == 4
    # A new K counts from its own first step: the one before it is not on it.
    cadence.every, cadence.since = 6, 30
    assert cadence.kept(30) is None and cadence.kept(42) == 12


def test_a_fixed_cadence_records_step_and_snapshot_times_but_never_proposes_another_k() -> None:
    cadence = Cadence(2)
    for step in range(1, 20):
        cadence.observe(step, 0.02)
    cadence.observe_snapshot(0.25)
    assert cadence.fits_every() == 13 and cadence.proposal() == 2
    assert Cadence(2).fits_every() is None

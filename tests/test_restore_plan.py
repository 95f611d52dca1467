"""The restore order (``remesh.elastic.restore_plan.choose``), as a table: what the members offer, the
commits the epoch lists and its restore step in, the plan out. Pure: no JAX runtime, no sockets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from remesh.elastic.cells import Key
from remesh.elastic.restore_plan import (
    FromMembers,
    FromScratch,
    Held,
    MemberOffer,
    Need,
    ReadCheckpoint,
    StateGone,
    choose,
)

# One leaf of 6 x 4 float32, cut into three row blocks by the old mesh (one per host).
ROWS = [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((4, 6), (0, 4))]
BLOCK_BYTES = 2 * 4 * 4


def key(row: int) -> Key:
    return (0, ROWS[row])


def held(
    step: int, own: Sequence[int], buddy: Sequence[int] = (), tier: str = "memory", layout: int = 1
) -> Held:
    return Held((step, layout), tier, frozenset(key(r) for r in own), frozenset(key(r) for r in buddy))


def member(*points: Held) -> MemberOffer:
    return MemberOffer("", points)


def need(rank: int, rows: list[int]) -> Need:
    """Rank ``rank`` of the new mesh holds ``rows`` of the leaf."""
    return Need(rank, {0: [ROWS[r] for r in rows]}, [(6, 4)], [4])


@dataclass(frozen=True)
class Case:
    name: str
    offers: list[MemberOffer]
    need: Need
    restore_step: int
    commits: frozenset[tuple[int, int]]
    first: ReadCheckpoint | None
    otherwise: type
    point: tuple[int, int] | None = None  # the restore point, from members
    incomplete: tuple[tuple[int, int], ...] = ()


# Three hosts held rows 0, 1, 2 at steps 4 and 6; each keeps a buddy copy of the next host's rows.
WHOLE = [
    member(held(4, [0], [1]), held(6, [0], [1])),
    member(held(4, [1], [2]), held(6, [1], [2])),
    member(held(4, [2], [0]), held(6, [2], [0])),
]

# fmt: off
CASES = [
    # name; offers, the process's need, restore step, commits; the plan: checkpoint first, otherwise,
    # the point restored from members, the points held only in part.
    Case("a job that never ran starts from scratch unless storage holds one",
         [member(), member()], need(0, [0]), -1, frozenset(), ReadCheckpoint(), FromScratch),
    Case("what is offered counts for nothing before the first step",
         WHOLE, need(0, [0]), -1, frozenset(), ReadCheckpoint(), FromScratch),
    Case("nothing held at step 0: storage, then scratch",
         [member(), member()], need(0, [0]), 0, frozenset(), ReadCheckpoint(), FromScratch),
    Case("the newest step held whole, and no storage read",
         WHOLE, need(0, [0]), 5, frozenset(), None, FromMembers, (6, 1)),
    Case("restore_step bounds nothing: a step newer than it is restored",
         WHOLE, need(2, [2]), 1, frozenset({(3, 1)}), None, FromMembers, (6, 1)),
    Case("a commit no newer than the step held: memory",
         WHOLE, need(1, [1]), 6, frozenset({(6, 1), (2, 1)}), None, FromMembers, (6, 1)),
    Case("a commit newer than the step held: that checkpoint first, the step held after",
         WHOLE, need(0, [0, 1]), 6, frozenset({(9, 2)}), ReadCheckpoint(newer_than=6), FromMembers, (6, 1)),
    Case("a host lost with its snapshot of step 6 only: step 4, whole through a buddy copy",
         [member(held(4, [0], [1]), held(6, [0], [1])), member(held(4, [2], [0]))], need(1, [1]),
         6, frozenset(), None, FromMembers, (4, 1), ((6, 1),)),
    Case("no step held whole, steps completed: storage, else the state is lost",
         [member(held(6, [0])), member(held(6, [2]))], need(0, [0]),
         6, frozenset(), ReadCheckpoint(), StateGone, None, ((6, 1),)),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_restore_order(case: Case) -> None:
    plan = choose(case.offers, case.need, case.restore_step, case.commits)
    assert plan.first == case.first
    assert isinstance(plan.otherwise, case.otherwise)
    assert plan.incomplete == case.incomplete
    assert plan.reason
    if case.point is not None:
        assert isinstance(plan.otherwise, FromMembers) and plan.otherwise.point == case.point


def test_each_process_fetches_only_what_it_lacks_and_says_where_it_came_from() -> None:
    # Host 1 was lost and replaced: the newcomer (rank 1) holds nothing; rank 0 copied its rows.
    offers = [member(held(6, [0], [1])), member(), member(held(6, [2], [0], tier="host-shm"))]
    newcomer = choose(offers, need(1, [1]), 6, frozenset()).otherwise
    assert isinstance(newcomer, FromMembers)
    assert newcomer.fetch.holders == {key(1): (0, "buddy")}
    assert newcomer.fetch.bytes_by_source == {"buddy": BLOCK_BYTES}
    # Rank 2, restarted on its host since, reads its own rows back from /dev/shm: nothing moves.
    restarted = choose(offers, need(2, [2]), 6, frozenset()).otherwise
    assert isinstance(restarted, FromMembers)
    assert restarted.fetch.holders == {key(2): (2, "host-shm")}
    # Every member chooses the same point from the same offers.
    assert newcomer.point == restarted.point == (6, 1)


def test_an_offer_goes_between_members_as_text_and_back_unchanged() -> None:
    offer = MemberOffer("10.0.0.7:4100", (held(4, [0], [1], tier="host-shm", layout=3), held(6, [0])))
    assert MemberOffer.from_json(offer.to_json()) == offer
    assert MemberOffer.from_json(MemberOffer().to_json()) == MemberOffer()

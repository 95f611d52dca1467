"""Where an epoch's state comes from: the restore order, as one pure choice.

Every member of an epoch gathers what every member offers (the restore points each holds in
memory, ``MemberOffer``) and reads the commits the epoch's assignment lists, then calls ``choose``
on the same inputs: every member makes the same choice without another round of messages. The
choice is a ``RestorePlan``: read a committed checkpoint first where the plan says so, and
otherwise (or where no such checkpoint is readable) restore from the members' memory, start from
``init_state``, or give up with the state lost.

Pure: no JAX, no sockets, no key-value store, no clock. ``remesh.elastic.restore`` gathers the
offers, carries the plan out (fetching, reading checkpoints, every member checking its share) and
logs the reasons given here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from remesh.elastic.cells import (
    Cell,
    Fetch,
    Key,
    Offer,
    RestorePoint,
    Uncovered,
    decode_key,
    encode_key,
    plan_fetch,
)

__all__ = [
    "ALL_DATA",
    "NO_DATA",
    "SOME_DATA",
    "FromMembers",
    "FromScratch",
    "Held",
    "MemberOffer",
    "Need",
    "ReadCheckpoint",
    "RestorePlan",
    "StateGone",
    "choose",
    "newest_held",
]


# What a member holds of the input position at a restore point (``Held.data``): none was kept
# with the step (the input is addressed by step), only some hosts' (it did not gather every one),
# or every host's (iterators that keep their own position: ``remesh.elastic.data.IteratorData``).
NO_DATA, SOME_DATA, ALL_DATA = "", "some", "all"


@dataclass(frozen=True)
class Held:
    """What one member holds at one restore point: its own pieces (kept in ``tier``: "memory", or
    "host-shm" for a process restarted on its host since), its copies of its buddy's pieces, and the
    hosts' input position (``NO_DATA``, ``SOME_DATA`` or ``ALL_DATA``)."""

    point: RestorePoint
    tier: str = "memory"
    own: frozenset[Key] = frozenset()
    buddy: frozenset[Key] = frozenset()
    data: str = NO_DATA


@dataclass(frozen=True)
class MemberOffer:
    """What one member offers the restore: where its piece server listens ("" in a world of one,
    which fetches nothing) and what it holds, newest restore point or not."""

    address: str = ""
    held: tuple[Held, ...] = ()

    def to_json(self) -> str:
        """As the members exchange it (the coordination service's key-value store, as text)."""
        points = [
            [*h.point, h.tier, [encode_key(k) for k in h.own], [encode_key(k) for k in h.buddy], h.data]
            for h in self.held
        ]
        return json.dumps({"addr": self.address, "points": points})

    @classmethod
    def from_json(cls, text: str) -> MemberOffer:
        raw: dict[str, Any] = json.loads(text)
        return cls(
            str(raw["addr"]),
            tuple(
                Held(
                    (int(step), int(layout)),
                    str(tier),
                    frozenset(decode_key(k) for k in own),
                    frozenset(decode_key(k) for k in buddy),
                    str(data),
                )
                for step, layout, tier, own, buddy, data in raw["points"]
            ),
        )


@dataclass(frozen=True)
class Need:
    """What this process needs of the state on the epoch's mesh: its rank, the boxes of each leaf its
    devices hold, and every leaf's shape and item size."""

    rank: int
    cells: Mapping[int, Sequence[Cell]]
    shapes: Sequence[tuple[int, ...]]
    itemsizes: Sequence[int]


@dataclass(frozen=True)
class FromMembers:
    """Restore ``point`` from the members' memory: each process fetches what it lacks as ``fetch``
    says (its own pieces first, then its buddy copies, then peers'), host to host; and every host's
    input position from rank ``data_from`` (None: none was kept with the step)."""

    point: RestorePoint
    fetch: Fetch
    data_from: int | None = None

    @property
    def step(self) -> int:
        return self.point[0]


@dataclass(frozen=True)
class FromScratch:
    """Start from ``init_state``: the job has not completed a step."""


@dataclass(frozen=True)
class StateGone:
    """The job completed steps, and nothing holds any of them: the state is lost."""


@dataclass(frozen=True)
class ReadCheckpoint:
    """Read the newest committed checkpoint every member can read, newer than ``newer_than`` (None:
    any step)."""

    newer_than: int | None = None


@dataclass(frozen=True)
class RestorePlan:
    """``first`` where set (a checkpoint), and ``otherwise`` where it is not, or finds no checkpoint
    every member can read. ``incomplete``: the restore points offered that the members do not hold
    whole between them (newest first); ``reason``: the choice, in words."""

    first: ReadCheckpoint | None
    otherwise: FromMembers | FromScratch | StateGone
    reason: str
    incomplete: tuple[RestorePoint, ...] = ()


def choose(
    offers: Sequence[MemberOffer], need: Need, restore_step: int, commits: Iterable[tuple[int, int]]
) -> RestorePlan:
    """The state to start an epoch from, in this order:

    1. **the members' memory**: the newest restore point whose pieces the members hold between them
       (own snapshots, a surviving replica group, buddy copies), each process fetching only what it
       lacks; unless the coordinator accepted a commit (``commits``: (step, epoch)) of a newer step:
       then first the newest readable committed checkpoint newer than that point (reading it costs
       less than replaying the steps between), and that point where none is readable;
    2. **storage**: where the members hold no step whole, the newest readable committed checkpoint
       (local, then GCS: the order of the session's checkpoint tiers);
    3. **init_state**, only where the job never completed a step (``restore_step`` <= 0); else the
       state is lost, and the job halts with the reason rather than start again from step 0.

    ``restore_step`` (the newest step every survivor had reported to the coordinator when it
    planned) bounds nothing: reports go out at most once a second, and every step a member holds is
    a state of the job's one timeline. It says only whether the job completed a step at all (-1:
    no member offers anything, and storage or scratch it is).
    """
    held, incomplete = newest_held(offers, need) if restore_step >= 0 else (None, ())
    newest_commit = max((step for step, _ in commits), default=-1)
    if held is not None and held.step >= newest_commit:
        return RestorePlan(None, held, f"the members hold step {held.step} between them", incomplete)
    if held is not None:
        return RestorePlan(
            ReadCheckpoint(newer_than=held.step),
            held,
            f"a committed checkpoint (step {newest_commit}) is newer than the newest step the members "
            f"hold ({held.step})",
            incomplete,
        )
    if restore_step <= 0:
        return RestorePlan(
            ReadCheckpoint(),
            FromScratch(),
            "the members hold no step; the job has not completed one",
            incomplete,
        )
    return RestorePlan(
        ReadCheckpoint(),
        StateGone(),
        f"the job completed steps (step {restore_step} reported) and no member holds any of them whole",
        incomplete,
    )


def newest_held(
    offers: Sequence[MemberOffer], need: Need
) -> tuple[FromMembers | None, tuple[RestorePoint, ...]]:
    """The newest restore point whose pieces the members hold between them, with where this process
    fetches each piece it lacks (None where they hold no point whole), and the newer points they
    hold only in part. A point whose input position was kept (``Held.data``) is whole only where a
    member holds every host's: a step restored without it would read other data than it did."""
    points = sorted({h.point for o in offers for h in o.held}, reverse=True)
    incomplete: list[RestorePoint] = []
    for point in points:
        held = [(rank, h) for rank, o in enumerate(offers) for h in o.held if h.point == point]
        members = [Offer(rank, h.own, h.buddy, h.tier) for rank, h in held]
        every_position = [rank for rank, h in held if h.data == ALL_DATA]
        if not every_position and any(h.data != NO_DATA for _, h in held):
            incomplete.append(point)
            continue
        try:
            fetch = plan_fetch(need.rank, need.cells, members, need.shapes, need.itemsizes)
        except Uncovered:
            incomplete.append(point)
            continue
        return FromMembers(point, fetch, min(every_position, default=None)), tuple(incomplete)
    return None, tuple(incomplete)

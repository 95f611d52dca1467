"""Pieces of the state named independently of any mesh, and who serves each one: pure logic.

A piece of the state is one leaf's values over a ``Cell`` (a box in global coordinates: start and
stop per dimension), so it means the same on any mesh. A restore point is a step and the epoch whose
mesh cut its pieces. ``plan_fetch`` decides, from what the members of an epoch offer at one restore
point, which member serves each cell a process needs on the new mesh, and says where the bytes come
from (``Fetch``). No JAX, no sockets: ``remesh.elastic.sharding`` lays the pieces out on devices,
``remesh.elastic.exchange`` moves them between hosts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Cell",
    "Fetch",
    "Key",
    "Offer",
    "RestorePoint",
    "Uncovered",
    "cell_of",
    "covered",
    "covers",
    "decode_key",
    "encode_key",
    "intersect",
    "plan_fetch",
    "volume",
    "whole",
]

# A box in global coordinates: (start, stop) for every dimension; () for a scalar.
Cell = tuple[tuple[int, int], ...]
# A piece's name: (leaf index, cell).
Key = tuple[int, Cell]
# (step, epoch whose mesh laid the pieces out)
RestorePoint = tuple[int, int]


def cell_of(index: tuple[slice, ...] | None, shape: Sequence[int]) -> Cell:
    """The box that a shard's ``index`` (slices, as JAX gives them; None: all of it) covers."""
    if index is None:
        return whole(shape)
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape, strict=True))


def whole(shape: Sequence[int]) -> Cell:
    return tuple((0, n) for n in shape)


def volume(cell: Cell) -> int:
    return math.prod(b - a for a, b in cell)


def intersect(a: Cell, b: Cell) -> Cell | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return box if all(lo < hi for lo, hi in box) else None


def encode_key(key: Key) -> list[Any]:
    """A piece's name as JSON takes it."""
    leaf, cell = key
    return [leaf, [list(b) for b in cell]]


def decode_key(raw: Any) -> Key:
    leaf, cell = raw
    return int(leaf), tuple((int(a), int(b)) for a, b in cell)


class Uncovered(Exception):
    """No member holds some part of the state at the step asked for."""


@dataclass(frozen=True)
class Offer:
    """What one member can serve at one restore point: its own pieces and its buddy copies."""

    rank: int
    own: frozenset[Key] = frozenset()
    buddy: frozenset[Key] = frozenset()
    # The tier its own pieces are kept in: "memory", or "host-shm" for a process restarted since.
    own_tier: str = "memory"


@dataclass
class Fetch:
    """Where each old cell a process needs comes from, and the bytes per source.

    A source is where a restore's bytes come from: this process's own tier ("memory", "host-shm"),
    its own buddy copy or a peer's ("buddy"), or a peer's own pieces ("peer")."""

    # (leaf, cell) -> (rank that serves it, source)
    holders: dict[Key, tuple[int, str]] = field(default_factory=dict)
    bytes_by_source: dict[str, int] = field(default_factory=dict)


def covered(offers: Iterable[Offer], shapes: Sequence[tuple[int, ...]]) -> bool:
    """Whether the offers together hold every element of every leaf.

    The cells of one restore point come from one mesh, so distinct cells of a leaf never overlap
    and their volumes add up to the leaf's size exactly when they cover it.
    """
    cells: list[set[Cell]] = [set() for _ in shapes]
    for offer in offers:
        for leaf, cell in offer.own | offer.buddy:
            if 0 <= leaf < len(cells):
                cells[leaf].add(cell)
    return all(covers(cs, shape) for cs, shape in zip(cells, shapes, strict=True))


def covers(cells: Iterable[Cell], shape: Sequence[int]) -> bool:
    """Whether cells of one layout (distinct ones never overlap) cover a leaf of ``shape``: their
    volumes add up to its size."""
    return sum(volume(c) for c in set(cells)) == math.prod(shape)


def plan_fetch(
    me: int,
    needed: Mapping[int, Sequence[Cell]],
    offers: Sequence[Offer],
    shapes: Sequence[tuple[int, ...]],
    itemsizes: Sequence[int],
) -> Fetch:
    """For every old cell overlapping a box this process needs, the member that serves it.

    Preference: this process's own pieces, then its buddy copies (no bytes move), then a peer's own
    pieces (another replica group holds the same shards, or the state is re-split), then a peer's
    buddy copy; among peers, the one serving the fewest bytes so far. Raises ``Uncovered`` when a
    needed element is held by nobody.
    """
    if not covered(offers, shapes):
        raise Uncovered("the members' pieces do not cover the state")
    holders: dict[Key, list[tuple[int, int, str]]] = {}
    for offer in offers:
        local = offer.rank == me
        for key in offer.own:
            holders.setdefault(key, []).append(
                (0 if local else 2, offer.rank, offer.own_tier if local else "peer")
            )
        for key in offer.buddy:
            holders.setdefault(key, []).append((1 if local else 3, offer.rank, "buddy"))
    load: dict[int, int] = {}
    plan = Fetch()
    by_leaf: dict[int, list[Cell]] = {}
    for leaf, cell in holders:
        by_leaf.setdefault(leaf, []).append(cell)
    for leaf, regions in sorted(needed.items()):
        for region in regions:
            for cell in sorted(c for c in by_leaf.get(leaf, []) if intersect(region, c) is not None):
                key = (leaf, cell)
                if key in plan.holders:
                    continue
                nbytes = volume(cell) * itemsizes[leaf]
                rank_, source = min(
                    ((pref, load.get(r, 0), r, source) for pref, r, source in holders[key]),
                    key=lambda h: (h[0], h[1], h[2]),
                )[2:]
                plan.holders[key] = (rank_, source)
                if rank_ != me:
                    load[rank_] = load.get(rank_, 0) + nbytes
                plan.bytes_by_source[source] = plan.bytes_by_source.get(source, 0) + nbytes
    return plan

"""ClusterState in the store's Redis layout: the state read back whole (``decode``), and what one
commit changes (``commit_input``, the commit script's input).

    members   hash    host_id -> Member JSON
    topology  string  Topology JSON
    acks      hash    host_id -> epoch acknowledged
    meta      hash    every other field of the state (the commits as "checkpoints"), and rev

Every value is the JSON ``ClusterState.to_dict`` gives the field or record, the form a log_compacted
event carries the state in: a field added to the state is stored, loaded and compacted alike, with no
change here. The layout is the store's contract with what earlier versions wrote, and stays as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from remesh.coordinator.model import ClusterState, Event, Member, Topology, ack_changes

__all__ = ["META_FIELDS", "commit_input", "decode", "encode_member", "encode_topology"]

# Each in a key of its own; every other field of the state is an entry of the meta hash.
_KEYED = frozenset({"members", "topology", "acks"})
META_FIELDS = tuple(f.name for f in fields(ClusterState) if f.name not in _KEYED)
# A meta entry's name where it is not the field's.
_META_KEYS = {"commits": "checkpoints"}


def _meta_key(name: str) -> str:
    """The meta hash's entry for the state's field ``name``."""
    return _META_KEYS.get(name, name)


def encode_member(member: Member) -> str:
    return json.dumps(member.to_dict(), sort_keys=True)


def encode_topology(topology: Topology) -> str:
    return json.dumps(topology.to_dict(), sort_keys=True)


def decode(
    members: Mapping[str, str], topology: str | None, meta: Mapping[str, str], acks: Mapping[str, str]
) -> tuple[ClusterState, int]:
    """The state stored in the four keys (as Redis returns them), and its revision. A meta entry
    missing or empty is the field's default (HDEL'd, as a None is written, or never written)."""
    d: dict[str, Any] = {
        "members": {h: json.loads(m) for h, m in members.items()},
        "topology": json.loads(topology) if topology else None,
        "acks": acks,
    }
    for name in META_FIELDS:
        if raw := meta.get(_meta_key(name)):
            d[name] = json.loads(raw)
    return ClusterState.from_dict(d), int(meta.get("rev", 0))


def _meta_changes(before: ClusterState, after: ClusterState) -> dict[str, str]:
    """The meta entries that differ from ``before`` to ``after``: "" for a field that became None
    (the script deletes it)."""
    changed = [n for n in META_FIELDS if getattr(after, n) != getattr(before, n)]
    return {_meta_key(n): "" if v is None else json.dumps(v) for n, v in after.to_dict(changed).items()}


def commit_input(before: ClusterState, after: ClusterState, events: Sequence[Event]) -> str:
    """What the commit script writes to go from ``before`` to ``after`` (which ``events`` folded it
    to): the changed members and topology, the members forgotten, the meta entries and
    acknowledgements that changed, and the events to append. JSON, as the script decodes it."""
    acks, acks_replaced = ack_changes(before, after, events)
    # Events that name no member (acknowledgements, a new epoch's topology) keep the members
    # mapping itself: nothing of it to compare, a thousand members or not.
    same_members = after.members is before.members
    payload: dict[str, Any] = {
        "members": {}
        if same_members
        else {
            h: encode_member(m)
            for h, m in after.members.items()
            # A member no event touched is the same object: compared by identity first, since
            # comparing records field by field costs each commit the whole fleet.
            if (old := before.members.get(h)) is not m and old != m
        },
        "topology": encode_topology(after.topology)
        if after.topology is not None
        and after.topology is not before.topology
        and after.topology != before.topology
        else "",
        "meta": _meta_changes(before, after),
        "acks": acks,
        "acks_clear": acks_replaced,
        "forgotten": [] if same_members else [h for h in before.members if h not in after.members],
        "events": [e.to_json() for e in events],
    }
    # cjson decodes {} and [] alike; an empty table is fine for the script's loops either way.
    return json.dumps(payload)

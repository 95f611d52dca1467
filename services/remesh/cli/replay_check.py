"""``remesh replay``'s comparison: the state folded from the event log against the coordinator's live
members and topology, field by field. Pure."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from remesh.coordinator.model import ClusterState, Member, Topology

__all__ = ["Difference", "compare"]


def _plain(value: Any) -> Any:
    """A JSON-able copy of a model value (dataclasses, tuples, enums)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Difference:
    """One place where the replayed event log and the coordinator's live state disagree."""

    subject: str  # "member HOST" or "topology"
    field: str  # a field name, or "record" when one side has no record at all
    replayed: Any
    live: Any

    def __str__(self) -> str:
        return f"{self.subject}: {self.field}: replayed {json.dumps(self.replayed)}, live {json.dumps(self.live)}"

    def to_dict(self) -> dict[str, Any]:
        return {"subject": self.subject, "field": self.field, "replayed": self.replayed, "live": self.live}


def _record_summary(record: Member | Topology | None) -> Any:
    if record is None:
        return None
    if isinstance(record, Member):
        return f"{record.state.value}, incarnation {record.incarnation}"
    return f"epoch {record.epoch}"


def _field_differences(subject: str, replayed: Any, live: Any) -> list[Difference]:
    if replayed is None or live is None:
        if replayed is live:
            return []
        return [Difference(subject, "record", _record_summary(replayed), _record_summary(live))]
    return [
        Difference(subject, f.name, _plain(getattr(replayed, f.name)), _plain(getattr(live, f.name)))
        for f in dataclasses.fields(replayed)
        if getattr(replayed, f.name) != getattr(live, f.name)
    ]


def compare(
    replayed: ClusterState, members: Mapping[str, Member], topology: Topology | None
) -> list[Difference]:
    """Every difference between the state folded from the log and the live members and topology."""
    differences: list[Difference] = []
    for host in sorted(set(replayed.members) | set(members)):
        differences += _field_differences(f"member {host}", replayed.members.get(host), members.get(host))
    differences += _field_differences("topology", replayed.topology, topology)
    return differences

"""The coordinator's domain model: members, topologies, events, and the pure fold that replays them.

Everything here is plain immutable data. The event log is the source of truth: ``apply(state, event)``
is pure, and ``replay(events)`` is a fold over the log that must equal what the store holds. Member and
topology events carry the full new record, so the fold needs no other input.
"""

from __future__ import annotations

import enum
import functools
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, cast

__all__ = [
    "ADDRESS_REFUSED",
    "COMMITS_KEPT",
    "ClusterState",
    "Event",
    "EventType",
    "FaultDetails",
    "Fold",
    "Member",
    "MemberState",
    "Role",
    "Tally",
    "Topology",
    "TopologyMember",
    "ack_changes",
    "apply",
    "replay",
    "tally",
]


# The field names of each record type ``_fields_of`` was given, looked up once.
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _fields_of(record: Any) -> dict[str, Any]:
    """A dataclass record's fields by name, one level deep (what ``asdict`` gives for a record of plain
    values, without its recursive deep copy)."""
    names = _FIELD_NAMES.get(type(record))
    if names is None:
        names = _FIELD_NAMES[type(record)] = tuple(f.name for f in fields(record))
    return {name: getattr(record, name) for name in names}


class Role(enum.StrEnum):
    ACTIVE = "active"
    SPARE = "spare"


class MemberState(enum.StrEnum):
    JOINING = "joining"
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"
    DRAINING = "draining"

    @property
    def is_up(self) -> bool:
        """Whether the member still counts as present (it may hold its rank)."""
        return self in (MemberState.JOINING, MemberState.ALIVE, MemberState.SUSPECT)


# Detail of a FAULT_REPORTED event: the epoch's JAX coordination address was taken ("true").
ADDRESS_REFUSED = "address_refused"
# Detail of a FAULT_REPORTED event: the host was declared dead for the failure ("true").
CHARGED = "charged"


@dataclass(frozen=True)
class FaultDetails:
    """What a FAULT_REPORTED event records beside its reason, typed. Stored as the event's string
    details (``encode``); ``decode`` reads them back, from this version's events or older ones."""

    kind: str
    epoch: int
    exit_code: int
    detail: str
    # The report refused the epoch's JAX coordination address: the same members move to a new one.
    address_refused: bool = False
    # The failure was charged to the host (declared dead for it), not taken for collateral damage:
    # what ``observations`` counts towards a crash loop.
    charged: bool = False

    def encode(self) -> dict[str, str]:
        details = {
            "kind": self.kind,
            "epoch": str(self.epoch),
            "exit_code": str(self.exit_code),
            "detail": self.detail,
        }
        if self.address_refused:
            details[ADDRESS_REFUSED] = "true"
        if self.charged:
            details[CHARGED] = "true"
        return details

    @classmethod
    def decode(cls, details: Mapping[str, str]) -> FaultDetails:
        return cls(
            kind=details.get("kind", ""),
            epoch=int(details.get("epoch", "0")),
            exit_code=int(details.get("exit_code", "0")),
            detail=details.get("detail", ""),
            address_refused=details.get(ADDRESS_REFUSED) == "true",
            charged=details.get(CHARGED) == "true",
        )


# Accepted checkpoint commits a topology carries (see ``Topology.commits``): enough for any restore
# step a new epoch names (the newest step its survivors all reached), a bounded record at any size.
COMMITS_KEPT = 8


class EventType(enum.StrEnum):
    MEMBER_JOINED = "member_joined"
    MEMBER_REJOINED = "member_rejoined"
    MEMBER_ALIVE = "member_alive"
    MEMBER_SUSPECT = "member_suspect"
    MEMBER_DEAD = "member_dead"
    MEMBER_LEFT = "member_left"
    MEMBER_DRAINING = "member_draining"
    MEMBER_ASSIGNED = "member_assigned"
    FAULT_REPORTED = "fault_reported"
    TOPOLOGY_CHANGED = "topology_changed"
    EPOCH_ACKED = "epoch_acked"
    EPOCH_LIVE = "epoch_live"
    JOB_WAITING = "job_waiting"
    JOB_HALTED = "job_halted"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    JOB_FINISHED = "job_finished"
    # A dead or left member removed from the state (kept past its retention, or making room).
    MEMBER_FORGOTTEN = "member_forgotten"
    # The log was cut: this event carries the whole state (details "state"), and the events before
    # it are gone. Replay starts from it: replay(log) is still the live state.
    LOG_COMPACTED = "log_compacted"
    # A member's trainer said a tier cannot keep its snapshots (details: tier, detail, epoch). For
    # operators only: it carries no record and folds to no change.
    TIER_MISSING = "tier_missing"


@dataclass(frozen=True)
class Member:
    host_id: str
    incarnation: int
    role: Role
    state: MemberState
    device_count: int = 0
    address: str = ""
    rank: int = -1
    reason: str = ""
    updated_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return _fields_of(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Member:
        return cls(**{**d, "role": Role(d["role"]), "state": MemberState(d["state"])})


@dataclass(frozen=True)
class TopologyMember:
    host_id: str
    rank: int
    device_count: int
    address: str


@dataclass(frozen=True)
class Topology:
    epoch: int
    members: tuple[TopologyMember, ...]
    mesh_shape: tuple[int, ...]
    jax_coordinator_address: str
    restore_step: int
    reason: str
    created_at: float
    halted: bool = False
    job_id: str = ""
    # The checkpoints the coordinator accepted before this epoch was published, (step, epoch), newest
    # first (at most ``COMMITS_KEPT``): the only ones a member of this epoch may restore from. Every
    # commit a restore in this epoch could want precedes the epoch: its own commits come later and
    # are of later steps than its restore step.
    commits: tuple[tuple[int, int], ...] = ()
    # When the job's first epoch was formed, and the epochs since that recovered from a failure
    # (a member lost, or a collective failed): the failure rate the coordinator observes, which the
    # trainers' automatic snapshot cadence weighs (``failure_interval_s``).
    formed_at: float = 0.0
    recoveries: int = 0

    @property
    def world_size(self) -> int:
        return len(self.members)

    # Computed once per topology (it never changes): every acknowledgement, plan and detector tick
    # asks, and at thousands of members a walk of the list for each answer adds up.
    @functools.cached_property
    def host_ids(self) -> tuple[str, ...]:
        return tuple(m.host_id for m in self.members)

    @functools.cached_property
    def host_set(self) -> frozenset[str]:
        return frozenset(self.host_ids)

    def rank_of(self, host_id: str) -> int:
        for m in self.members:
            if m.host_id == host_id:
                return m.rank
        return -1

    def to_dict(self) -> dict[str, Any]:
        # Field by field, not ``dataclasses.asdict``: a new epoch's topology is encoded for its event and
        # for the store, and asdict's deep copy of 5000 members takes 0.1-0.2 s each time.
        d = _fields_of(self)
        d["members"] = tuple(_fields_of(m) for m in self.members)
        if self.commits:
            d["commits"] = tuple(tuple(c) for c in self.commits)
        else:
            # Written only when set: an event log from before the field reads and writes back unchanged.
            del d["commits"]
        for name in ("formed_at", "recoveries"):
            if not d[name]:
                del d[name]  # the same: written only when set
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Topology:
        return cls(
            **{
                **d,
                "members": tuple(TopologyMember(**m) for m in d["members"]),
                "mesh_shape": tuple(d["mesh_shape"]),
                "commits": tuple((int(s), int(e)) for s, e in d.get("commits", ())),
            }
        )


@dataclass(frozen=True)
class Event:
    """One immutable change. ``epoch`` is the epoch current after the event."""

    type: EventType
    time: float
    epoch: int
    reason: str
    host_id: str = ""
    incarnation: int = 0
    member: Member | None = None
    topology: Topology | None = None
    details: Mapping[str, str] = field(default_factory=dict)
    # Stream id once stored; empty before.
    id: str = ""

    def to_json(self) -> str:
        d = _fields_of(self)
        del d["id"]
        d["details"] = dict(self.details)
        d["member"] = self.member.to_dict() if self.member is not None else None
        d["topology"] = self.topology.to_dict() if self.topology is not None else None
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes, event_id: str = "") -> Event:
        d = json.loads(raw)
        return cls(
            type=EventType(d["type"]),
            time=d["time"],
            epoch=d["epoch"],
            reason=d["reason"],
            host_id=d["host_id"],
            incarnation=d["incarnation"],
            member=Member.from_dict(d["member"]) if d["member"] else None,
            topology=Topology.from_dict(d["topology"]) if d["topology"] else None,
            details=d["details"],
            id=event_id,
        )


@dataclass(frozen=True)
class ClusterState:
    """Everything the store holds for one job, and everything the event log rebuilds."""

    members: Mapping[str, Member] = field(default_factory=dict)
    topology: Topology | None = None
    # Set while the planner waits for enough hosts (JOB_WAITING), cleared by the next topology.
    waiting_since: float | None = None
    # Highest epoch every member acknowledged.
    live_epoch: int = 0
    # host_id -> epoch it acknowledged, for the members of the current epoch: only its members
    # acknowledge it, each once, and every new topology starts it empty (``apply``), so its length is
    # the number of members that acknowledged the current epoch.
    acks: Mapping[str, int] = field(default_factory=dict)
    # An epoch whose JAX coordination address rank 0 found taken: its members form the next epoch,
    # on another port (see ``membership.report_fault``).
    address_refused_epoch: int = 0
    # Checkpoint commits the coordinator accepted, (step, epoch), newest first (``COMMITS_KEPT``).
    commits: tuple[tuple[int, int], ...] = ()
    # The last step of a job that finished (JOB_FINISHED); -1 while it runs.
    finished_step: int = -1
    # The highest incarnation of any member forgotten: a host registering anew starts above it, so
    # a message from a forgotten incarnation is never taken for a new one.
    incarnation_floor: int = 0

    def to_dict(self, names: Iterable[str] | None = None) -> dict[str, Any]:
        """The state's fields (those of ``names``, else all) as JSON values: ``from_dict``'s input."""
        return {n: _STATE_FIELDS[n][0](getattr(self, n)) for n in (_STATE_FIELDS if names is None else names)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterState:
        """The state ``to_dict`` wrote; a field it leaves out (one written before the field was) is
        the field's default."""
        return cls(**{n: decode(d[n]) for n, (_, decode) in _STATE_FIELDS.items() if n in d})

    def to_json(self) -> str:
        """The state as a log_compacted event carries it (``from_json`` reads it back)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ClusterState:
        return cls.from_dict(json.loads(raw))

    @property
    def epoch(self) -> int:
        return self.topology.epoch if self.topology else 0

    @property
    def halted(self) -> bool:
        return bool(self.topology and self.topology.halted)

    @property
    def finished(self) -> bool:
        return self.finished_step >= 0


# Every field of ClusterState as JSON (``ClusterState.to_dict``), and back. The one place a field is
# spelled out: a log_compacted event carries the state in this form, and the store keeps the fields
# besides the members, the topology and the acknowledgements in its meta hash in it
# (``remesh.coordinator.state_codec``). A new field needs an entry here, and nothing else to be stored.
_STATE_FIELDS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "members": (
        lambda members: {h: m.to_dict() for h, m in sorted(members.items())},
        lambda d: {h: Member.from_dict(m) for h, m in d.items()},
    ),
    "topology": (
        lambda t: t.to_dict() if t is not None else None,
        lambda d: Topology.from_dict(d) if d else None,
    ),
    "waiting_since": (lambda t: t, lambda t: float(t) if t is not None else None),
    "live_epoch": (lambda e: e, int),
    "acks": (lambda acks: dict(sorted(acks.items())), lambda d: {h: int(e) for h, e in d.items()}),
    "address_refused_epoch": (lambda e: e, int),
    "commits": (
        lambda commits: [list(c) for c in commits],
        lambda d: tuple((int(step), int(epoch)) for step, epoch in d),
    ),
    "finished_step": (lambda step: step, int),
    "incarnation_floor": (lambda n: n, int),
}


def apply(state: ClusterState, event: Event) -> ClusterState:
    """Fold one event into the state. Pure: the same inputs always give the same output."""
    if event.type is EventType.LOG_COMPACTED:
        return ClusterState.from_json(event.details["state"])
    if event.type is EventType.MEMBER_FORGOTTEN:
        kept = {h: m for h, m in state.members.items() if h != event.host_id}
        acks = {h: e for h, e in state.acks.items() if h != event.host_id}
        floor = max(state.incarnation_floor, event.incarnation)
        return replace(state, members=kept, acks=acks, incarnation_floor=floor)
    members = state.members
    if event.member is not None:
        members = {**members, event.member.host_id: event.member}
    if event.type is EventType.TOPOLOGY_CHANGED:
        if event.topology is None:  # pragma: no cover - guarded by the transitions
            raise ValueError("topology_changed event without a topology")
        return replace(state, members=members, topology=event.topology, waiting_since=None, acks={})
    if event.type is EventType.JOB_HALTED:
        return replace(state, members=members, topology=event.topology, waiting_since=None, acks={})
    if event.type is EventType.JOB_WAITING:
        return replace(state, members=members, waiting_since=event.time)
    if event.type is EventType.EPOCH_ACKED:
        return replace(state, members=members, acks={**state.acks, event.host_id: event.epoch})
    if event.type is EventType.EPOCH_LIVE:
        return replace(state, members=members, live_epoch=event.epoch)
    if (
        event.type is EventType.FAULT_REPORTED
        and (fault := FaultDetails.decode(event.details)).address_refused
    ):
        return replace(state, members=members, address_refused_epoch=fault.epoch)
    step = _step_of(event)
    if event.type is EventType.CHECKPOINT_COMMITTED and step is not None:
        commits = tuple(sorted({*state.commits, (step, event.epoch)}, reverse=True))[:COMMITS_KEPT]
        return replace(state, members=members, commits=commits)
    if event.type is EventType.JOB_FINISHED and step is not None:
        return replace(state, members=members, finished_step=step)
    return replace(state, members=members)


# The events after which ``apply`` builds the acknowledgements anew (cleared, or one removed); any
# other event adds at most its own (EPOCH_ACKED) or leaves them as they are.
_ACKS_REBUILT = frozenset(
    {EventType.TOPOLOGY_CHANGED, EventType.JOB_HALTED, EventType.MEMBER_FORGOTTEN, EventType.LOG_COMPACTED}
)


def ack_changes(
    before: ClusterState, after: ClusterState, events: Iterable[Event]
) -> tuple[dict[str, int], bool]:
    """What ``events`` did to the acknowledgements, from ``before`` to ``after`` (= the events
    applied to ``before``): the acknowledgements to write, and whether the stored ones are replaced
    by them (True: all of ``after``'s). Costs the events, not the members: a new epoch of thousands
    of hosts is acknowledged by thousands of commits."""
    acked: list[str] = []
    for event in events:
        if event.type in _ACKS_REBUILT:
            return dict(after.acks), True
        if event.type is EventType.EPOCH_ACKED and event.host_id is not None:
            acked.append(event.host_id)
    return {h: after.acks[h] for h in acked if h in after.acks and before.acks.get(h) != after.acks[h]}, False


def _step_of(event: Event) -> int | None:
    """The ``step`` detail of a checkpoint or finish event; None where it has none (it changes nothing)."""
    raw = event.details.get("step", "")
    return int(raw) if raw.lstrip("-").isdigit() else None


@dataclass(frozen=True)
class Tally:
    """The members of one ``members`` mapping (``of``) counted by state and role."""

    of: Mapping[str, Member]
    counts: Mapping[tuple[MemberState, Role], int]

    def count(self, state: MemberState, role: Role | None = None) -> int:
        return sum(n for (s, r), n in self.counts.items() if s is state and role in (None, r))


def tally(members: Mapping[str, Member], since: Tally | None = None, events: Iterable[Event] = ()) -> Tally:
    """``members`` counted by state and role. Given ``since``, the tally of the mapping ``events``
    turned into ``members``, only the hosts those events name are looked at: a fleet of thousands
    commits a few members at a time, and counting all of them for each commit (the planner while
    forming, the gauges) would make the commits of a forming job quadratic in its size."""
    if since is None:
        return Tally(members, Counter((m.state, m.role) for m in members.values()))
    if since.of is members:
        return since
    named: set[str] = set()
    for e in events:
        if e.type is EventType.LOG_COMPACTED:  # every record may have changed
            return tally(members)
        named.add(e.host_id)
        if e.member is not None:
            named.add(e.member.host_id)
    counts = Counter(since.counts)
    for host in named:
        if (old := since.of.get(host)) is not None:
            counts[(old.state, old.role)] -= 1
        if (new := members.get(host)) is not None:
            counts[(new.state, new.role)] += 1
    return Tally(members, +counts)


# Events ``replay`` folds with ``apply`` itself: they replace the members or the acknowledgements
# wholesale, or remove a record from them (rare: a member kept past its retention).
_FOLDED_WHOLE = frozenset(
    {EventType.LOG_COMPACTED, EventType.TOPOLOGY_CHANGED, EventType.JOB_HALTED, EventType.MEMBER_FORGOTTEN}
)
# Events whose fold changes a field of the state besides the members and the acknowledgements.
_FOLDED_FIELDS = frozenset(
    {
        EventType.JOB_WAITING,
        EventType.EPOCH_LIVE,
        EventType.FAULT_REPORTED,
        EventType.CHECKPOINT_COMMITTED,
        EventType.JOB_FINISHED,
    }
)


def replay(events: Iterable[Event], start: ClusterState | None = None) -> ClusterState:
    """Rebuild the state from the event log: ``apply`` folded over ``events``, with the members and
    the acknowledgements copied once for a run of events instead of once for each. A correlated
    failure of 900 hosts among 10,000 members is 1800 member events, and the coordinator replays a
    change's events more than once (to plan it, to store it): a copy of 10,000 records each."""
    return Fold(start or ClusterState()).add(events)


def _refs(obj: object) -> int:
    """How many references hold ``obj``, this call's own left out (CPython's count). Pass an
    attribute, not a local variable: a local is one more holder."""
    return sys.getrefcount(obj) - _CALL


# The references a call of ``_refs`` adds itself (its parameter, getrefcount's argument), measured on
# an object nothing else holds: interpreters differ in how they count an argument.
_CALL = 0
_CALL = _refs(object())


class Fold:
    """``replay`` in instalments: ``add`` folds a batch of events into the state that the batches
    before it produced. A state it hands out (``state``, what ``add`` returns) never changes after,
    and neither does the state it started from.

    A batch commit checks each of its changes against the state the ones before it produced: 10,000
    acknowledgements, each on a state with a copy of the acknowledgements of its own, would copy them
    10,000 times. So the fold changes the members or the acknowledgements it copied in place while
    nothing but the fold holds them or the state around them, and copies them first once anything
    else does (CPython's reference counts say which): a state handed out and dropped again, as a
    transition drops the state it was given, costs no copy; one that is kept, one copy."""

    def __init__(self, start: ClusterState) -> None:
        self.state = start
        # The mappings of the state this fold copied itself ("members", "acks"): changed in place
        # while nothing else holds them or the state.
        self._mine: dict[str, dict[str, Any] | None] = {"members": None, "acks": None}

    def _own(self, name: str) -> dict[str, Any]:
        """The state's mapping ``name``, to change: in place where nobody else can see it change."""
        if (
            self._mine[name] is None
            or getattr(self.state, name) is not self._mine[name]
            or _refs(self.state) > 1  # held by this fold only
            or _refs(self._mine[name]) > 2  # by this fold and its state only, no other state
        ):
            self._mine[name] = copied = dict(getattr(self.state, name))
            changes: dict[str, Any] = {name: copied}
            self.state = replace(self.state, **changes)
        return cast(dict[str, Any], self._mine[name])

    def add(self, events: Iterable[Event]) -> ClusterState:
        for event in events:
            if event.type in _FOLDED_WHOLE:
                self.state = apply(self.state, event)
                continue
            if event.member is not None:
                self._own("members")[event.member.host_id] = event.member
            if event.type is EventType.EPOCH_ACKED:
                self._own("acks")[event.host_id] = event.epoch
            elif event.type in _FOLDED_FIELDS:
                # Its member (if any) is in the members already: apply folds the rest.
                self.state = apply(
                    self.state, replace(event, member=None) if event.member is not None else event
                )
        return self.state

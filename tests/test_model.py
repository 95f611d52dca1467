"""Tests of the domain model: JSON and dict round trips, ``apply`` and ``replay``.

``golden/replace_with_spare.jsonl`` is an event log recorded from the pure core (three hosts, world
size 2: form, the trainer on h2 dies, the spare h3 takes its rank, h2 comes back as a spare). It pins
the stored format: a log written today must still replay to the same state after any change.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from remesh.coordinator.model import (
    ClusterState,
    Event,
    EventType,
    Fold,
    Member,
    MemberState,
    Role,
    Topology,
    TopologyMember,
    ack_changes,
    apply,
    replay,
)

GOLDEN = Path(__file__).parent / "golden" / "replace_with_spare.jsonl"

times = st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)
texts = st.text(max_size=20)
host_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,12}", fullmatch=True)
small = st.integers(min_value=-1, max_value=2**31)

members = st.builds(
    Member,
    host_id=host_ids,
    incarnation=small,
    role=st.sampled_from(Role),
    state=st.sampled_from(MemberState),
    device_count=small,
    address=texts,
    rank=small,
    reason=texts,
    updated_at=times,
)
topology_members = st.builds(TopologyMember, host_id=host_ids, rank=small, device_count=small, address=texts)
topologies = st.builds(
    Topology,
    epoch=small,
    members=st.lists(topology_members, max_size=4).map(tuple),
    mesh_shape=st.lists(st.integers(0, 64), max_size=3).map(tuple),
    jax_coordinator_address=texts,
    restore_step=small,
    reason=texts,
    created_at=times,
    halted=st.booleans(),
    job_id=texts,
)
events = st.builds(
    Event,
    type=st.sampled_from(EventType),
    time=times,
    epoch=small,
    reason=texts,
    host_id=host_ids | st.just(""),
    incarnation=small,
    member=st.none() | members,
    topology=st.none() | topologies,
    details=st.dictionaries(texts, texts, max_size=3),
)


@given(events, st.text(alphabet="0123456789-", max_size=16))
def test_event_json_round_trip(event: Event, event_id: str) -> None:
    raw = event.to_json()
    assert Event.from_json(raw) == event
    assert Event.from_json(raw.encode(), event_id) == Event(**{**event.__dict__, "id": event_id})


@given(events)
def test_event_json_is_the_stored_format_dataclasses_asdict_wrote(event: Event) -> None:
    """Events are encoded field by field (``asdict``'s deep copy of a large topology was most of an
    epoch's publication); the stored bytes are what ``asdict`` gave, so every log already written
    compares and replays the same."""
    d = dataclasses.asdict(event)
    del d["id"]
    d["details"] = dict(event.details)
    if event.topology is not None:
        d["topology"] = dataclasses.asdict(event.topology)
        for name in ("commits", "formed_at", "recoveries"):  # fields added later: written when set
            if not getattr(event.topology, name):
                del d["topology"][name]
    assert event.to_json() == json.dumps(d, separators=(",", ":"), sort_keys=True)


def test_event_json_leaves_out_the_stream_id() -> None:
    event = Event(EventType.EPOCH_LIVE, 1.5, 3, "all live", id="1700-0")
    raw = event.to_json()
    assert "1700-0" not in raw and "id" not in json.loads(raw)
    assert Event.from_json(raw).id == ""
    # Stable bytes: keys sorted, no spaces, so equal events store equal entries.
    assert raw == Event(EventType.EPOCH_LIVE, 1.5, 3, "all live").to_json()
    assert ", " not in raw and ": " not in raw


@given(members)
def test_member_dict_round_trip(member: Member) -> None:
    assert Member.from_dict(member.to_dict()) == member
    back = Member.from_dict(json.loads(json.dumps(member.to_dict())))
    assert back == member
    assert type(back.role) is Role and type(back.state) is MemberState


@given(topologies)
def test_topology_dict_round_trip(topology: Topology) -> None:
    assert Topology.from_dict(topology.to_dict()) == topology
    # JSON turns tuples into lists; from_dict must turn them back (a list != a tuple).
    back = Topology.from_dict(json.loads(json.dumps(topology.to_dict())))
    assert back == topology
    assert isinstance(back.members, tuple) and isinstance(back.mesh_shape, tuple)


def test_topology_accessors() -> None:
    t = Topology(
        epoch=2,
        members=(TopologyMember("a", 0, 1, ""), TopologyMember("b", 1, 1, "")),
        mesh_shape=(2, 1),
        jax_coordinator_address="",
        restore_step=-1,
        reason="",
        created_at=0.0,
    )
    assert (t.world_size, t.host_ids, t.rank_of("b"), t.rank_of("zz")) == (2, ("a", "b"), 1, -1)
    assert ClusterState(topology=t).epoch == 2 and ClusterState().epoch == 0
    assert not ClusterState(topology=t).halted


def _well_formed(log: list[Event]) -> list[Event]:
    """What the transitions guarantee: a topology on every topology_changed event, and the state in
    every log_compacted event (``compacted`` makes those)."""
    return [
        e
        for e in log
        if (e.type is not EventType.TOPOLOGY_CHANGED or e.topology is not None)
        and e.type is not EventType.LOG_COMPACTED
    ]


def compacted(state: ClusterState) -> Event:
    return Event(
        EventType.LOG_COMPACTED, 0.0, state.epoch, "cut", details={"state": json.dumps(state.to_dict())}
    )


@given(st.lists(events, max_size=12), st.integers(min_value=0, max_value=12))
def test_replay_is_a_fold_of_apply(log: list[Event], cut: int) -> None:
    log = _well_formed(log)
    assert replay(log) == functools.reduce(apply, log, ClusterState())
    assert replay(log[cut:], replay(log[:cut])) == replay(log)
    assert replay([]) == ClusterState()


@given(st.lists(events, max_size=16), st.lists(st.integers(min_value=0, max_value=16), max_size=4))
def test_a_fold_in_instalments_is_the_replay_and_leaves_its_start_alone(
    log: list[Event], cuts: list[int]
) -> None:
    """``Fold.add`` batch after batch (as a batch commit folds each queued change's events) gives
    what one replay gives after every batch, though it changes its own copies in place; the state
    it started from is never changed."""
    log = _well_formed(log)
    half = len(log) // 2
    start = replay(log[:half])
    start_json = json.dumps(start.to_dict(), sort_keys=True)
    fold = Fold(start)
    bounds = [half, *sorted(half + c for c in cuts if half + c <= len(log)), len(log)]
    for lo, hi in itertools.pairwise(bounds):
        assert fold.add(log[lo:hi]) == replay(log[:hi]) == fold.state
    assert json.dumps(start.to_dict(), sort_keys=True) == start_json
    assert start == replay(log[:half])


@given(st.lists(events, max_size=16), st.lists(st.integers(min_value=0, max_value=16), max_size=4))
def test_every_state_a_fold_handed_out_stays_as_it_was_handed_out(log: list[Event], cuts: list[int]) -> None:
    """A caller may keep any state ``Fold.add`` returned: folding more events changes none of them."""
    log = _well_formed(log)
    fold = Fold(ClusterState())
    kept: list[tuple[ClusterState, str]] = []
    bounds = [0, *sorted(c for c in cuts if c <= len(log)), len(log)]
    for lo, hi in itertools.pairwise(bounds):
        state = fold.add(log[lo:hi])
        kept.append((state, json.dumps(state.to_dict(), sort_keys=True)))
    for (state, handed_out), hi in zip(kept, bounds[1:], strict=True):
        assert json.dumps(state.to_dict(), sort_keys=True) == handed_out
        assert state == replay(log[:hi])


def _acked(host: str) -> Event:
    return Event(EventType.EPOCH_ACKED, 1.0, 1, f"{host} acknowledged", host, 1)


def _joined(host: str) -> Event:
    return Event(EventType.MEMBER_JOINED, 1.0, 0, "joined", host, 1, member=_member(host))


def test_a_fold_copies_what_a_caller_holds_before_changing_it() -> None:
    fold = Fold(ClusterState())
    held = fold.add([_joined("a"), _acked("a")])
    fold.add([_joined("b"), _acked("b")])
    assert set(held.members) == set(held.acks) == {"a"}

    # A mapping held alone, its state dropped, stays as it was too.
    acks = fold.state.acks
    fold.add([_acked("c")])
    assert set(acks) == {"a", "b"} and set(fold.state.acks) == {"a", "b", "c"}


def test_a_fold_whose_states_nobody_keeps_copies_nothing_after_its_first_change() -> None:
    """A batch commit hands each change the state the ones before produced and keeps none of them:
    10,000 acknowledgements so folded are one copy of the acknowledgements, not 10,000."""
    fold = Fold(ClusterState())
    fold.add([_acked("h0")])
    copy = id(fold.state.acks)
    for i in range(1, 10_000):
        assert fold.state.acks.get(f"h{i}") is None  # what a transition reads of the state
        fold.add([_acked(f"h{i}")])
    assert id(fold.state.acks) == copy and len(fold.state.acks) == 10_000


@given(st.lists(events, max_size=12), st.integers(min_value=0, max_value=12))
def test_a_log_cut_behind_a_compaction_event_replays_to_the_same_state(log: list[Event], cut: int) -> None:
    """The store cuts the log behind a log_compacted event carrying the state so far: replaying what
    is left, from nothing, gives what the whole log gives."""
    log = _well_formed(log)
    kept = [compacted(replay(log[:cut])), *log[cut:]]
    assert replay(kept) == replay(log)
    # And a state survives its own JSON round trip exactly (the event stores it as JSON).
    state = replay(log)
    assert ClusterState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


@given(st.lists(events, max_size=12), st.integers(min_value=0, max_value=12))
def test_ack_changes_are_what_the_events_did_to_the_acknowledgements(log: list[Event], cut: int) -> None:
    """The store writes acknowledgements from the events of a commit, not by comparing every member's:
    written onto the ones stored before (or in their place), they are the state's after it."""
    log = _well_formed(log)
    before = replay(log[:cut])
    after = replay(log[cut:], before)
    written, replaced = ack_changes(before, after, log[cut:])
    assert ({} if replaced else dict(before.acks)) | written == dict(after.acks)


def test_a_forgotten_member_is_gone_and_raises_the_incarnation_floor() -> None:
    state = replay([Event(EventType.MEMBER_JOINED, 1.0, 0, "", "h", 7, member=_member("h"))])
    after = apply(state, Event(EventType.MEMBER_FORGOTTEN, 2.0, 0, "gone", "h", 7))
    assert "h" not in after.members and after.incarnation_floor == 7


def _member(host: str, state: MemberState = MemberState.ALIVE) -> Member:
    return Member(host, 1, Role.ACTIVE, state)


def _topology(epoch: int, halted: bool = False) -> Topology:
    return Topology(epoch, (TopologyMember("a", 0, 1, ""),), (1, 1), "", -1, "", 0.0, halted)


def test_apply_folds_each_kind_of_event() -> None:
    start = ClusterState(members={"a": _member("a")}, waiting_since=3.0, live_epoch=1, acks={"a": 1})

    dead = _member("a", MemberState.DEAD)
    s = apply(start, Event(EventType.MEMBER_DEAD, 5.0, 1, "x", "a", 1, member=dead))
    assert s.members == {"a": dead} and s.waiting_since == 3.0 and s.acks == {"a": 1}

    s = apply(start, Event(EventType.JOB_WAITING, 7.0, 1, "wait"))
    assert s.waiting_since == 7.0

    s = apply(start, Event(EventType.TOPOLOGY_CHANGED, 8.0, 2, "t", topology=_topology(2)))
    assert s.topology == _topology(2) and s.waiting_since is None and s.acks == {} and s.live_epoch == 1

    s = apply(start, Event(EventType.JOB_HALTED, 8.0, 2, "h", topology=_topology(2, halted=True)))
    assert s.halted and s.waiting_since is None and s.acks == {}

    s = apply(start, Event(EventType.EPOCH_ACKED, 9.0, 2, "ack", "b"))
    assert s.acks == {"a": 1, "b": 2}

    s = apply(start, Event(EventType.EPOCH_LIVE, 9.0, 2, "live"))
    assert s.live_epoch == 2

    s = apply(start, Event(EventType.FAULT_REPORTED, 9.0, 1, "fault", "a", 1, details={"kind": "host"}))
    assert s == start

    # The input is never changed.
    assert start == ClusterState(members={"a": _member("a")}, waiting_since=3.0, live_epoch=1, acks={"a": 1})


def test_golden_log_replays_to_the_recorded_state() -> None:
    lines = GOLDEN.read_text().splitlines()
    log = [Event.from_json(line, f"{i}-0") for i, line in enumerate(lines)]
    # Every stored line survives a round trip byte for byte.
    assert [e.to_json() for e in log] == lines

    state = replay(log)
    assert state.topology is not None
    assert state.epoch == 2 and state.live_epoch == 2
    assert state.topology.host_ids == ("h1", "h3")
    assert state.topology.restore_step == 40
    assert state.topology.job_id == "golden"
    assert state.acks == {"h1": 2, "h3": 2}
    assert state.waiting_since is None
    ranks = {h: (m.role, m.rank, m.incarnation, m.state) for h, m in state.members.items()}
    assert ranks == {
        "h1": (Role.ACTIVE, 0, 1, MemberState.ALIVE),
        "h2": (Role.SPARE, -1, 2, MemberState.ALIVE),
        "h3": (Role.ACTIVE, 1, 1, MemberState.ALIVE),
    }
    topology_epochs = [e.epoch for e in log if e.topology is not None]
    assert topology_epochs == [1, 2]


def test_fault_details_read_back_typed_from_the_strings_events_store() -> None:
    from remesh.coordinator.model import FaultDetails

    refused = FaultDetails("address_in_use", 4, 98, "JAX coordination port taken", address_refused=True)
    assert refused.encode()["address_refused"] == "true"
    assert FaultDetails.decode(refused.encode()) == refused
    plain = FaultDetails("trainer_exited", 2, 1, "")
    assert "address_refused" not in plain.encode() and FaultDetails.decode(plain.encode()) == plain

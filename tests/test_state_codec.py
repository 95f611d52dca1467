"""The one codec of ``ClusterState``: every field written and read back through the store's Redis
layout (a real redis-server) and through the log_compacted event, byte for byte as stored by earlier
versions, so that a store or a log written before still loads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import fields, replace
from typing import TypeVar

import pytest
import redis

from remesh.coordinator import model, state_codec
from remesh.coordinator.model import ClusterState, Event, EventType, replay
from remesh.coordinator.store import RedisStore
from remesh.embedded import RedisServer

pytestmark = pytest.mark.integration

T = TypeVar("T")


def _member(host: str, incarnation: int) -> model.Member:
    return model.Member(
        host, incarnation, model.Role.ACTIVE, model.MemberState.ALIVE, 4, f"{host}.local", -1, "up", 1.5
    )


TOPOLOGY = model.Topology(
    2,
    (model.TopologyMember("h1", 0, 4, "h1.local"), model.TopologyMember("h2", 1, 4, "h2.local")),
    (2, 4),
    "h1.local:7000",
    5,
    "formed",
    10.25,
    job_id="job",
    commits=((5, 1),),
)
# A log after which every field of the state differs from its default.
LOG = [
    Event(EventType.MEMBER_JOINED, 1.0, 0, "j", "h1", 1, member=_member("h1", 1)),
    Event(EventType.MEMBER_JOINED, 1.0, 0, "j", "h2", 1, member=_member("h2", 1)),
    Event(EventType.MEMBER_JOINED, 1.0, 0, "j", "h3", 3, member=_member("h3", 3)),
    Event(EventType.TOPOLOGY_CHANGED, 2.0, 2, "t", topology=TOPOLOGY),
    Event(EventType.EPOCH_ACKED, 3.0, 2, "a", "h1", 1),
    Event(EventType.EPOCH_ACKED, 3.0, 2, "a", "h2", 1),
    Event(EventType.EPOCH_LIVE, 3.5, 2, "live"),
    Event(EventType.JOB_WAITING, 12.5, 2, "wait"),
    Event(
        EventType.FAULT_REPORTED,
        13.0,
        2,
        "f",
        "h1",
        1,
        details={"kind": "host", "epoch": "2", "exit_code": "0", "detail": "", "address_refused": "true"},
    ),
    Event(EventType.CHECKPOINT_COMMITTED, 14.0, 2, "c", "h1", 1, details={"step": "7"}),
    Event(EventType.JOB_FINISHED, 15.0, 2, "done", "h1", 1, details={"step": "9"}),
    Event(EventType.MEMBER_FORGOTTEN, 16.0, 2, "gone", "h3", 3),
]
STATE = replay(LOG)

# The four keys as stores already hold STATE: what this codec must read, and go on writing.
_MEMBER_JSON = (
    '{{"address": "{h}.local", "device_count": 4, "host_id": "{h}", "incarnation": 1, "rank": -1, '
    '"reason": "up", "role": "active", "state": "alive", "updated_at": 1.5}}'
)
STORED = {
    "members": {h: _MEMBER_JSON.format(h=h) for h in ("h1", "h2")},
    "topology": (
        '{"commits": [[5, 1]], "created_at": 10.25, "epoch": 2, "halted": false, "jax_coordinator_address": '
        '"h1.local:7000", "job_id": "job", "members": [{"address": "h1.local", "device_count": 4, "host_id": '
        '"h1", "rank": 0}, {"address": "h2.local", "device_count": 4, "host_id": "h2", "rank": 1}], '
        '"mesh_shape": [2, 4], "reason": "formed", "restore_step": 5}'
    ),
    "meta": {
        "rev": "1",
        "waiting_since": "12.5",
        "live_epoch": "2",
        "address_refused_epoch": "2",
        "checkpoints": "[[7, 2]]",
        "finished_step": "9",
        "incarnation_floor": "3",
    },
    "acks": {"h1": "2", "h2": "2"},
}


def _key(job_id: str, name: str) -> str:
    return f"remesh:{{{job_id}}}:{name}"


def _raw(url: str, job_id: str) -> dict[str, object]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return {
            "members": client.hgetall(_key(job_id, "members")),
            "topology": client.get(_key(job_id, "topology")),
            "meta": client.hgetall(_key(job_id, "meta")),
            "acks": client.hgetall(_key(job_id, "acks")),
        }
    finally:
        client.close()


def _with_store(url: str, job_id: str, use: Callable[[RedisStore], Awaitable[T]]) -> T:
    async def run() -> T:
        store = RedisStore(url, job_id)
        try:
            return await use(store)
        finally:
            await store.close()

    return asyncio.run(run())


def test_the_codec_names_every_field_of_the_state() -> None:
    """A field added to ClusterState without an entry in the codec fails here, not in production."""
    names = {f.name for f in fields(ClusterState)}
    assert set(ClusterState().to_dict()) == names
    assert set(state_codec.META_FIELDS) | {"members", "topology", "acks"} == names
    # And LOG sets every one of them: the round trips below cover every field.
    assert all(getattr(STATE, f.name) != getattr(ClusterState(), f.name) for f in fields(ClusterState))


def test_every_field_is_stored_in_the_layout_earlier_versions_wrote_and_loads_back(
    redis_server: RedisServer, job_id: str
) -> None:
    async def commit(store: RedisStore) -> tuple[ClusterState, int]:
        await store.commit(0, ClusterState(), STATE, LOG)
        return await store.load()

    assert _with_store(redis_server.url, job_id, commit) == (STATE, 1)
    assert _raw(redis_server.url, job_id) == STORED


def test_a_store_written_by_an_earlier_version_loads(redis_server: RedisServer, job_id: str) -> None:
    """The keys as an earlier version left them load to the state they hold; entries a version
    before a field existed never wrote load as the field's default."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        client.hset(_key(job_id, "members"), mapping=STORED["members"])
        client.set(_key(job_id, "topology"), str(STORED["topology"]))
        client.hset(_key(job_id, "acks"), mapping=STORED["acks"])
        client.hset(_key(job_id, "meta"), mapping=STORED["meta"])
        assert _with_store(redis_server.url, job_id, RedisStore.load) == (STATE, 1)

        for older in ("incarnation_floor", "checkpoints", "finished_step", "waiting_since"):
            client.hdel(_key(job_id, "meta"), older)
        loaded, rev = _with_store(redis_server.url, job_id, RedisStore.load)
    finally:
        client.close()
    assert rev == 1
    assert loaded == ClusterState(
        members=STATE.members,
        topology=TOPOLOGY,
        live_epoch=2,
        acks={"h1": 2, "h2": 2},
        address_refused_epoch=2,
    )
    assert (loaded.incarnation_floor, loaded.commits, loaded.finished_step, loaded.waiting_since) == (
        0,
        (),
        -1,
        None,
    )


def test_a_field_that_goes_back_to_none_leaves_the_meta_hash(redis_server: RedisServer, job_id: str) -> None:
    waiting = [Event(EventType.JOB_WAITING, 12.5, 0, "wait")]
    formed = [Event(EventType.TOPOLOGY_CHANGED, 13.0, 2, "t", topology=TOPOLOGY)]

    async def commits(store: RedisStore) -> ClusterState:
        before = replay(waiting)
        await store.commit(0, ClusterState(), before, waiting)
        await store.commit(1, before, replay(formed, before), formed)
        return (await store.load())[0]

    loaded = _with_store(redis_server.url, job_id, commits)
    assert loaded.waiting_since is None and loaded.topology == TOPOLOGY
    assert "waiting_since" not in _raw(redis_server.url, job_id)["meta"]


def test_every_field_survives_the_log_compacted_event() -> None:
    """The state a log_compacted event carries folds back to itself, and one written by an earlier
    version (before the incarnation floor) to the state it held."""
    assert ClusterState.from_json(STATE.to_json()) == STATE
    assert (
        model.apply(
            ClusterState(), Event(EventType.LOG_COMPACTED, 20.0, 2, "cut", details={"state": STATE.to_json()})
        )
        == STATE
    )

    earlier = json.loads(STATE.to_json())
    del earlier["incarnation_floor"]
    assert ClusterState.from_dict(earlier) == replace(STATE, incarnation_floor=0)

"""The Redis store: one job's membership, topology and event log, changed only in atomic steps.

Layout (every key shares the hash tag ``{JOB}``, so a job lives in one Redis Cluster slot)::

    remesh:{JOB}:members    hash    host_id -> Member JSON
    remesh:{JOB}:topology   string  Topology JSON (its epoch inside)
    remesh:{JOB}:meta       hash    rev (commits so far), waiting_since, live_epoch
    remesh:{JOB}:acks       hash    host_id -> epoch acknowledged (current epoch's members)
    remesh:{JOB}:events     stream  one entry per Event, field "e" = Event JSON
    remesh:{JOB}:progress   hash    host_id -> last step (flushed in batches, not an event)

``commit`` writes the state that the events produce and appends the events in one Lua script that
first checks the revision it was planned against: a writer that planned from an older state is
refused (``Conflict``) and changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import redis.asyncio as aioredis
import redis.exceptions

from remesh.coordinator.errors import Conflict, StoreUnavailable
from remesh.coordinator.model import ClusterState, Event, Member, Topology, replay

__all__ = ["RedisStore"]

_COMMIT = """
local rev = tonumber(redis.call('HGET', KEYS[3], 'rev') or '0')
if rev ~= tonumber(ARGV[1]) then
  return redis.error_reply('CONFLICT store is at revision ' .. rev .. ', the change was planned at ' .. ARGV[1])
end
local p = cjson.decode(ARGV[2])
for host, m in pairs(p.members) do redis.call('HSET', KEYS[1], host, m) end
if p.topology ~= '' then redis.call('SET', KEYS[2], p.topology) end
for k, v in pairs(p.meta) do
  if v == '' then redis.call('HDEL', KEYS[3], k) else redis.call('HSET', KEYS[3], k, v) end
end
if p.acks_clear then redis.call('DEL', KEYS[4]) end
for host, e in pairs(p.acks) do redis.call('HSET', KEYS[4], host, e) end
local ids = {}
for i, e in ipairs(p.events) do ids[i] = redis.call('XADD', KEYS[5], '*', 'e', e) end
redis.call('HSET', KEYS[3], 'rev', rev + 1)
return ids
"""


def _translate(exc: Exception, url: str) -> Exception:
    if isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("CONFLICT"):
        return Conflict(str(exc))
    return StoreUnavailable(
        f"Redis at {url} is unreachable ({type(exc).__name__}: {exc}); the coordinator keeps its state "
        "and retries — check that redis-server runs and the URL is right"
    )


class RedisStore:
    def __init__(self, url: str, job_id: str, *, socket_timeout: float = 1.0) -> None:
        self.url = url
        self.job_id = job_id
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout, decode_responses=True
        )
        prefix = f"remesh:{{{job_id}}}"
        self.keys = {
            name: f"{prefix}:{name}" for name in ("members", "topology", "meta", "acks", "events", "progress")
        }
        self._commit = self._redis.register_script(_COMMIT)

    async def close(self) -> None:
        await self._redis.aclose()

    async def ping(self) -> None:
        try:
            await self._redis.ping()
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc

    async def load(self) -> tuple[ClusterState, int]:
        """The stored state and its revision, read in one MULTI/EXEC so they are consistent."""
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(self.keys["members"])
                pipe.get(self.keys["topology"])
                pipe.hgetall(self.keys["meta"])
                pipe.hgetall(self.keys["acks"])
                members_raw, topology_raw, meta, acks_raw = await pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc
        members = {h: Member.from_dict(json.loads(m)) for h, m in members_raw.items()}
        topology = Topology.from_dict(json.loads(topology_raw)) if topology_raw else None
        state = ClusterState(
            members=members,
            topology=topology,
            waiting_since=float(meta["waiting_since"]) if meta.get("waiting_since") else None,
            live_epoch=int(meta.get("live_epoch", 0)),
            acks={h: int(e) for h, e in acks_raw.items()},
        )
        return state, int(meta.get("rev", 0))

    async def commit(
        self, rev: int, before: ClusterState, events: Sequence[Event]
    ) -> tuple[ClusterState, list[Event]]:
        """Apply ``events`` to ``before`` (stored at ``rev``) and store the result atomically.

        Returns the new state and the events with their stream ids.
        """
        after = replay(events, before)
        payload: dict[str, Any] = {
            "members": {
                h: json.dumps(m.to_dict(), sort_keys=True)
                for h, m in after.members.items()
                if before.members.get(h) != m
            },
            "topology": json.dumps(after.topology.to_dict(), sort_keys=True)
            if after.topology is not None and after.topology != before.topology
            else "",
            "meta": {},
            "acks": {h: e for h, e in after.acks.items() if before.acks.get(h) != e},
            "acks_clear": any(h not in after.acks for h in before.acks),
            "events": [e.to_json() for e in events],
        }
        if after.waiting_since != before.waiting_since:
            payload["meta"]["waiting_since"] = (
                repr(after.waiting_since) if after.waiting_since is not None else ""
            )
        if after.live_epoch != before.live_epoch:
            payload["meta"]["live_epoch"] = str(after.live_epoch)
        if payload["acks_clear"]:
            payload["acks"] = dict(after.acks)
        # cjson decodes {} and [] alike; an empty table is fine for both loops above.
        keys = [self.keys[k] for k in ("members", "topology", "meta", "acks", "events")]
        try:
            ids = await self._commit(keys=keys, args=[rev, json.dumps(payload)])
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc
        stored = [_with_id(e, i) for e, i in zip(events, ids, strict=True)]
        return after, stored

    async def read_events(
        self, after_id: str = "", since: float = 0.0, count: int | None = None
    ) -> list[Event]:
        start = f"({after_id}" if after_id else (f"{int(since * 1000)}-0" if since else "-")
        try:
            entries = await self._redis.xrange(self.keys["events"], min=start, max="+", count=count)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc
        return [
            Event.from_json(fields["e"], event_id)
            for event_id, fields in cast(list[tuple[str, dict[str, str]]], entries)
        ]

    async def follow_events(self, after_id: str, block_ms: int = 500) -> AsyncIterator[list[Event]]:
        """Yield batches of new events after ``after_id`` ("$": only new ones), forever."""
        # A blocking read needs a socket timeout longer than the block.
        client = aioredis.Redis.from_url(
            self.url, socket_timeout=block_ms / 1000 + 2, socket_connect_timeout=1.0, decode_responses=True
        )
        last = after_id or "0-0"
        try:
            while True:
                try:
                    reply = await client.xread({self.keys["events"]: last}, block=block_ms, count=256)
                except (redis.exceptions.RedisError, OSError) as exc:
                    raise _translate(exc, self.url) from exc
                streams = cast(list[tuple[str, list[tuple[str, dict[str, str]]]]], reply or [])
                batch = [Event.from_json(f["e"], i) for _, entries in streams for i, f in entries]
                if batch:
                    last = batch[-1].id
                yield batch
        finally:
            await client.aclose()

    async def write_progress(self, steps: Mapping[str, int]) -> None:
        if not steps:
            return
        try:
            await self._redis.hset(self.keys["progress"], mapping={h: str(s) for h, s in steps.items()})
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc

    async def read_progress(self) -> dict[str, int]:
        try:
            raw = await self._redis.hgetall(self.keys["progress"])
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc
        return {str(h): int(s) for h, s in raw.items()}


def _with_id(event: Event, event_id: str) -> Event:
    return replace(event, id=event_id)

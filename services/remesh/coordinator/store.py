"""The Redis store: one job's membership, topology and event log, changed only in atomic steps.

Layout (every key shares the hash tag ``{JOB}``, so a job lives in one Redis Cluster slot)::

    remesh:{JOB}:members    hash    host_id -> Member JSON
    remesh:{JOB}:topology   string  Topology JSON (its epoch inside)
    remesh:{JOB}:meta       hash    rev (commits so far), and every other field of the state:
                                    waiting_since, live_epoch, address_refused_epoch, checkpoints
                                    (accepted checkpoint commits), finished_step, incarnation_floor
    remesh:{JOB}:acks       hash    host_id -> epoch acknowledged (current epoch's members)
    remesh:{JOB}:events     stream  one entry per Event, field "e" = Event JSON
    remesh:{JOB}:progress   hash    host_id -> last step (flushed in batches, not an event)
    remesh:{JOB}:leader     string  the leading replica's fencing token (SET NX PX: the lease)
    remesh:{JOB}:leader_address  string  where the leader serves (same expiry as the lease)
    remesh:{JOB}:fence      string  the last fencing token issued (INCR per acquisition)

The state's records and fields are written and read as ``remesh.coordinator.state_codec`` says.
``commit`` writes the state that the events produce and appends the events in one Lua script that
first checks the revision it was planned against: a writer that planned from an older state is
refused (``Conflict``) and changes nothing. With several coordinator replicas (``fencing_token`` set)
every write also checks that the lease still holds this writer's token: a deposed leader's write is
refused (``Fenced``) and changes nothing.

The event log is bounded: ``compact`` appends a ``log_compacted`` event that carries the whole state
and cuts every event before it, in one script, so the log always replays to the stored state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import cast

import redis.exceptions

from remesh.coordinator import state_codec
from remesh.coordinator.errors import Conflict, Fenced, StoreUnavailable
from remesh.coordinator.model import ClusterState, Event
from remesh.coordinator.redis_connection import RedisConnection

__all__ = ["RedisStore"]

# Every write script opens with this: a writer whose token is not the lease's is a deposed leader.
_FENCE = """
local function fenced(lease, token)
  if token == '' then return nil end
  local holder = redis.call('GET', lease)
  if holder ~= token then
    return redis.error_reply('FENCED the lease is held by token ' .. tostring(holder or 'none') .. ', this writer has token ' .. token)
  end
  return nil
end
"""

# The writes that move the revision open with this as well: the writer's token must hold the lease,
# and the stored revision must be the one the write was planned at. Returns (refusal, revision).
_GUARD = (
    _FENCE
    + """
local function guarded(lease, token, meta, planned)
  local refused = fenced(lease, token)
  if refused then return refused, nil end
  local rev = tonumber(redis.call('HGET', meta, 'rev') or '0')
  if rev ~= tonumber(planned) then
    return redis.error_reply('CONFLICT store is at revision ' .. rev .. ', the write was planned at ' .. planned), nil
  end
  return nil, rev
end
"""
)

_COMMIT = (
    _GUARD
    + """
local refused, rev = guarded(KEYS[6], ARGV[3], KEYS[3], ARGV[1])
if refused then return refused end
local p = cjson.decode(ARGV[2])
for host, m in pairs(p.members) do redis.call('HSET', KEYS[1], host, m) end
for i, host in ipairs(p.forgotten) do
  redis.call('HDEL', KEYS[1], host)
  redis.call('HDEL', KEYS[7], host)
end
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
)

# KEYS: meta, events, leader. ARGV: rev, the log_compacted event (JSON), token. Returns its id.
_COMPACT = (
    _GUARD
    + """
local refused, rev = guarded(KEYS[3], ARGV[3], KEYS[1], ARGV[1])
if refused then return refused end
local id = redis.call('XADD', KEYS[2], '*', 'e', ARGV[2])
redis.call('XTRIM', KEYS[2], 'MINID', id)
redis.call('HSET', KEYS[1], 'rev', rev + 1)
return id
"""
)

_WRITE_PROGRESS = (
    _FENCE
    + """
local refused = fenced(KEYS[2], ARGV[1])
if refused then return refused end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
)

# KEYS: leader, leader_address, fence. ARGV: ttl_ms, address. Returns {token or 0, leader address}.
_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder then return {0, redis.call('GET', KEYS[2]) or ''} end
local token = redis.call('INCR', KEYS[3])
redis.call('SET', KEYS[1], token, 'PX', ARGV[1])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1])
return {token, ARGV[2]}
"""

# KEYS: leader, leader_address. ARGV: token, ttl_ms. 1 while the lease is ours (extended), else 0.
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""


def _translate(exc: Exception, url: str) -> Exception:
    if isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("CONFLICT"):
        return Conflict(str(exc))
    if isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("FENCED"):
        return Fenced(f"write refused: this replica no longer leads ({str(exc).removeprefix('FENCED ')})")
    if isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.NoPermissionError) or (
        isinstance(exc, redis.exceptions.ResponseError)
        and str(exc).startswith(("NOAUTH", "WRONGPASS", "NOPERM"))
    ):
        return StoreUnavailable(
            f"Redis at {url} refused this coordinator ({type(exc).__name__}: {exc}): check the ACL user "
            "(--redis-username) and its password (REMESH_REDIS_PASSWORD or --redis-password-file), and "
            "that the user may run scripts on the keys remesh:*"
        )
    return StoreUnavailable(
        f"Redis at {url} is unreachable ({type(exc).__name__}: {exc}); the coordinator keeps its state "
        "and retries — check that redis-server runs and the URL is right"
    )


_KEYS = ("members", "topology", "meta", "acks", "events", "progress", "leader", "leader_address", "fence")


class RedisStore:
    def __init__(
        self, connection: RedisConnection | str, job_id: str, *, socket_timeout: float = 1.0
    ) -> None:
        self.connection = (
            connection if isinstance(connection, RedisConnection) else RedisConnection(connection)
        )
        self.url = self.connection.redacted_url
        self.job_id = job_id
        self._redis = self.connection.connect(socket_timeout)
        prefix = f"remesh:{{{job_id}}}"
        self.keys = {name: f"{prefix}:{name}" for name in _KEYS}
        self._commit = self._redis.register_script(_COMMIT)
        self._compact = self._redis.register_script(_COMPACT)
        self._write_progress = self._redis.register_script(_WRITE_PROGRESS)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._renew = self._redis.register_script(_RENEW)
        self._release = self._redis.register_script(_RELEASE)
        # The lease token this writer holds (several replicas); None: the only writer, unfenced.
        self.fencing_token: int | None = None

    @property
    def _token_arg(self) -> str:
        return "" if self.fencing_token is None else str(self.fencing_token)

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
        return state_codec.decode(members_raw, topology_raw, meta, acks_raw)

    async def commit(
        self, rev: int, before: ClusterState, after: ClusterState, events: Sequence[Event]
    ) -> list[Event]:
        """Store ``after`` (the state ``events`` fold ``before``, stored at ``rev``, to) and append the
        events, atomically. Returns the events with their stream ids."""
        keys = [self.keys[k] for k in ("members", "topology", "meta", "acks", "events", "leader", "progress")]
        change = state_codec.commit_input(before, after, events)
        try:
            ids = await self._commit(keys=keys, args=[rev, change, self._token_arg])
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc
        return [_with_id(e, i) for e, i in zip(events, ids, strict=True)]

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

    async def page_events(
        self, after_id: str = "", since: float = 0.0, page: int = 500
    ) -> AsyncIterator[list[Event]]:
        """The log from ``after_id`` (or ``since``) to its end as it is now, ``page`` events at a time:
        a reader holds one page in memory, never the whole log."""
        after = after_id
        while True:
            batch = await self.read_events(after, since if not after else 0.0, count=page)
            if batch:
                yield batch
            if len(batch) < page:
                return
            after = batch[-1].id

    async def last_event_id(self) -> str:
        """The id of the newest event ("0-0" for an empty log)."""
        try:
            entries = await self._redis.xrevrange(self.keys["events"], count=1)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc
        return str(entries[0][0]) if entries else "0-0"

    async def event_count(self) -> int:
        try:
            return int(await self._redis.xlen(self.keys["events"]))
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc

    async def compact(self, rev: int, event: Event) -> Event:
        """Append ``event`` (a ``log_compacted`` event carrying the state stored at ``rev``) and cut
        every event before it; the revision moves on by one. Returns the event with its id."""
        keys = [self.keys[k] for k in ("meta", "events", "leader")]
        try:
            event_id = await self._compact(keys=keys, args=[rev, event.to_json(), self._token_arg])
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc
        return _with_id(event, event_id)

    async def follow_events(self, after_id: str, block_ms: int = 500) -> AsyncIterator[list[Event]]:
        """Yield batches of new events after ``after_id`` ("$": only new ones), forever."""
        # A blocking read needs a socket timeout longer than the block.
        client = self.connection.connect(socket_timeout=block_ms / 1000 + 2, connect_timeout=1.0)
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
        args = [self._token_arg, *(x for h, s in steps.items() for x in (h, str(s)))]
        try:
            await self._write_progress(keys=[self.keys["progress"], self.keys["leader"]], args=args)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc

    async def read_progress(self) -> dict[str, int]:
        try:
            raw = await self._redis.hgetall(self.keys["progress"])
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc
        return {str(h): int(s) for h, s in raw.items()}

    # ---- the leader lease (several coordinator replicas) -----------------------------------------

    async def acquire_lease(self, address: str, ttl_s: float) -> tuple[int, str]:
        """Take the lease if nobody holds it: (the new fencing token, ``address``); else (0, the
        holder's address, "" if unknown)."""
        keys = [self.keys[k] for k in ("leader", "leader_address", "fence")]
        try:
            token, holder = await self._acquire(keys=keys, args=[int(ttl_s * 1000), address])
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc
        return int(token), str(holder)

    async def renew_lease(self, token: int, ttl_s: float) -> bool:
        """Extend the lease if ``token`` still holds it (compare-and-pexpire)."""
        keys = [self.keys["leader"], self.keys["leader_address"]]
        try:
            return bool(await self._renew(keys=keys, args=[token, int(ttl_s * 1000)]))
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc

    async def release_lease(self, token: int) -> None:
        """Give the lease up at once (a clean stop), if ``token`` still holds it."""
        try:
            await self._release(keys=[self.keys["leader"], self.keys["leader_address"]], args=[token])
        except (redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, self.url) from exc


def _with_id(event: Event, event_id: str) -> Event:
    return replace(event, id=event_id)

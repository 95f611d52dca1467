"""Which coordinator replica leads: the Redis lease, renewed by the leader and polled by followers.

With several replicas (``settings.ha.enabled``) exactly one leads: the one holding the lease. It
renews the lease at a third of its TTL and writes with its fencing token, so a deposed leader's writes
are refused by Redis (it then steps down). A follower polls for the lease twice as often, names the
holder in its refusals (``NotLeader``), and mirrors the stored state for reads and topology watches.
A single replica always leads and writes unfenced.

This module decides the role; what taking over and stepping down do to the coordinator's state
(loading it, granting every member a fresh deadline, telling agents to find the new leader) is the
coordinator's, passed in as callbacks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from remesh.coordinator.errors import NotLeader, StoreUnavailable
from remesh.coordinator.metrics import Metrics
from remesh.coordinator.settings import HaSettings
from remesh.coordinator.store import RedisStore

__all__ = ["Leadership"]

log = structlog.get_logger("remesh.coordinator")


class Leadership:
    def __init__(
        self,
        settings: HaSettings,
        store: RedisStore,
        metrics: Metrics,
        *,
        take_over: Callable[[int], Awaitable[None]],
        step_down: Callable[[str], None],
        follow: Callable[[], Awaitable[None]],
        on_store_error: Callable[[StoreUnavailable], None],
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.leading = not settings.enabled
        self.advertise = settings.advertise
        self.leader_address = ""
        self._renewed_at = 0.0
        self._take_over = take_over
        self._step_down = step_down
        self._follow = follow
        self._on_store_error = on_store_error
        if settings.enabled:
            self.store.fencing_token = 0  # never issued: a replica that never led can write nothing

    def not_leader(self, detail: str = "") -> NotLeader:
        leader = self.leader_address if self.leader_address != self.advertise else ""
        where = f"the leader is at {leader}" if leader else "no leader is known yet; retry shortly"
        return NotLeader(
            f"this coordinator ({self.advertise}) is a follower: {where}"
            + (f" ({detail})" if detail else ""),
            leader,
        )

    async def run(self) -> None:
        """The lease loop (only with several replicas): renew while leading, else try to take it."""
        ha = self.settings
        self.metrics.leader.set(0)
        log.info("role", role="follower", address=self.advertise, reason="started; looking for the lease")
        while True:
            try:
                if self.leading:
                    await self._renew()
                else:
                    token, holder = await self.store.acquire_lease(self.advertise, ha.lease_ttl_s)
                    if token:
                        await self._take_over(token)
                    else:
                        if holder != self.leader_address:
                            log.info("leader", leader=holder or None)
                        self.leader_address = holder
                        await self._follow()
            except StoreUnavailable as exc:
                self._on_store_error(exc)
                if self.leading and time.monotonic() - self._renewed_at > ha.lease_ttl_s:
                    self._step_down(f"could not renew the lease for {ha.lease_ttl_s}s: {exc}")
            # A follower polls twice as often as the leader renews: it notices an expired lease soon.
            await asyncio.sleep(ha.renew_every_s if self.leading else ha.renew_every_s / 2)

    async def _renew(self) -> None:
        token = self.store.fencing_token or 0
        if await self.store.renew_lease(token, self.settings.lease_ttl_s):
            self._renewed_at = time.monotonic()
        else:
            self._step_down(f"lease lost: token {token} no longer holds it (another replica took over)")

    def led(self, token: int) -> None:
        """The lease is ours (``token``) and the coordinator has loaded the state: lead."""
        self.store.fencing_token = token
        self._renewed_at = time.monotonic()
        self.leading = True
        self.leader_address = self.advertise
        self.metrics.leader.set(1)
        self.metrics.fencing_token.set(token)
        self.metrics.role_changes.inc()

    def stepped_down(self, reason: str) -> bool:
        """Follow from now on; False when this replica was not leading."""
        if not self.leading:
            return False
        self.leading = False
        self.leader_address = ""
        self.metrics.leader.set(0)
        self.metrics.role_changes.inc()
        log.warning("role", role="follower", address=self.advertise, reason=reason)
        return True

"""The coordinator's engine run in the test's own process on a real Redis, for tests that count
what it does (its plans, its folds) where a coordinator process would hide it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence

from remesh.coordinator.model import Member, Role
from remesh.coordinator.service import Coordinator
from remesh.coordinator.settings import DetectorSettings, PlannerSettings, Settings
from remesh.coordinator.store import RedisStore

__all__ = ["QUIET", "live_job", "until"]

# Nobody is judged by silence: tests on this engine send one heartbeat per host.
QUIET = DetectorSettings(suspect_after_s=60.0, heartbeat_timeout_s=120.0)


async def until(condition: Callable[[], bool], within_s: float = 30.0) -> None:
    end = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def live_job(
    redis_url: str,
    job_id: str,
    hosts: Sequence[str],
    planner: PlannerSettings,
    detector: DetectorSettings = QUIET,
) -> AsyncIterator[tuple[Coordinator, list[Member]]]:
    """A coordinator whose job formed from ``hosts`` (registered together, one heartbeat each) and
    went live (every member of its first epoch acknowledged it), with the hosts' members."""
    settings = Settings(job_id=job_id, redis_url=redis_url, detector=detector, planner=planner)
    coordinator = Coordinator(settings, RedisStore(redis_url, job_id))
    await coordinator.start()
    try:
        members = await asyncio.gather(*(coordinator.register(h, Role.ACTIVE, 1, "10.0.0.1") for h in hosts))
        for m in members:
            await coordinator.heartbeat(m.host_id, m.incarnation, -1)
        await until(lambda: coordinator.state.topology is not None)
        topology = coordinator.state.topology
        assert topology is not None
        await asyncio.gather(
            *(
                coordinator.ack_epoch(m.host_id, m.incarnation, topology.epoch, 0, "fresh", {})
                for m in members
                if m.host_id in topology.host_set
            )
        )
        yield coordinator, list(members)
    finally:
        # Bounded, so that a stop that never returns fails here, with its place.
        await asyncio.wait_for(coordinator.stop(), 30.0)

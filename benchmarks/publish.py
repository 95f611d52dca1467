"""What a new epoch costs the coordinator before any stream is written to, at N members.

    python benchmarks/publish.py [--members 1000,5000,10000] [--rounds 3]

One coordinator in this process (no gRPC) on an embedded redis-server, N active members and N/10
spares registered, heartbeating once and acknowledging the first epoch. Each round one active
member leaves; the spare that replaces it makes a new epoch. Measured per round: from the plan (the
topology's ``created_at``) to the new epoch published, its streams woken (``publish_s``), and the
time for every member of the new epoch to have its acknowledgement committed, all sent at once
(``acks_s``). Both are the coordinator's own work on its event loop, which every heartbeat stream
waits for before its write (``benchmarks/scale.py`` measures the whole fan-out, with gRPC).

Prints a line per round and, last, JSON with `members`, `publish_s_p50`, `acks_s_p50` and `rounds`
for the largest size; the line before it, `all figures: [...]`, for every size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from remesh.cli.logs import configure_logging  # noqa: E402
from remesh.coordinator.model import Role  # noqa: E402
from remesh.coordinator.service import Coordinator  # noqa: E402
from remesh.coordinator.settings import DetectorSettings, PlannerSettings, Settings  # noqa: E402
from remesh.coordinator.store import RedisStore  # noqa: E402
from remesh.embedded import RedisServer  # noqa: E402


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _until(condition: Callable[[], bool], within_s: float, what: str) -> None:
    end = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {within_s:.0f}s")
        await asyncio.sleep(0.001)


async def _measure(redis_url: str, members: int, rounds: int) -> dict[str, float]:
    job = f"publish-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        job_id=job,
        redis_url=redis_url,
        # Nobody is judged by silence: the members send one heartbeat each and nothing after.
        detector=DetectorSettings(suspect_after_s=3600.0, heartbeat_timeout_s=7200.0),
        planner=PlannerSettings(world_size=members, jax_port_base=10000, jax_port_span=50000),
        max_members=3 * members,
    )
    coordinator = Coordinator(settings, RedisStore(redis_url, job))
    await coordinator.start()
    try:
        hosts = [(f"host-{i:05d}", Role.ACTIVE) for i in range(members)]
        hosts += [(f"spare-{i:05d}", Role.SPARE) for i in range(max(rounds, members // 10))]
        started = time.monotonic()
        registered = await asyncio.gather(
            *(coordinator.register(h, role, 1, "10.0.0.1") for h, role in hosts)
        )
        incarnation = {m.host_id: m.incarnation for m in registered}
        for m in registered:
            await coordinator.heartbeat(m.host_id, m.incarnation, -1)
        await _until(lambda: coordinator.state.topology is not None, 600, "the first epoch")
        progress(f"  {members} members: formed in {time.monotonic() - started:.1f}s")

        async def acknowledge() -> float:
            topology = coordinator.state.topology
            assert topology is not None
            t0 = time.perf_counter()
            await asyncio.gather(
                *(
                    coordinator.ack_epoch(h, incarnation[h], topology.epoch, 0, "fresh", {})
                    for h in topology.host_ids
                )
            )
            return time.perf_counter() - t0

        await acknowledge()
        publish, acks = [], []
        for round_ in range(rounds):
            topology = coordinator.state.topology
            assert topology is not None
            leaving = topology.host_ids[len(topology.host_ids) // 2]
            epoch = coordinator.state.epoch
            await coordinator.leave(leaving, incarnation[leaving], "benchmarks/publish.py")
            await _until(lambda: coordinator.state.epoch > epoch, 60, "the new epoch")  # noqa: B023
            published = time.time()
            new = coordinator.state.topology
            assert new is not None
            publish.append(published - new.created_at)
            acks.append(await acknowledge())
            progress(
                f"  {members} members, round {round_ + 1}/{rounds}: published {publish[-1]:.3f}s "
                f"after the plan, {len(new.host_ids)} acknowledgements committed in {acks[-1]:.3f}s"
            )
        return {
            "members": members,
            "publish_s_p50": round(statistics.median(publish), 4),
            "acks_s_p50": round(statistics.median(acks), 4),
            "rounds": rounds,
        }
    finally:
        await coordinator.stop()


def main() -> None:
    # Stopped by SIGTERM (timeout, a scheduler), it still stops every process it started.
    from remesh.embedded import stop_on_sigterm

    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="1000,5000,10000", help="fleet sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    configure_logging(level="error")
    figures = []
    for size in (int(n) for n in args.members.split(",") if n):
        with RedisServer(appendonly=False) as redis_server:
            figures.append(asyncio.run(_measure(redis_server.url, size, args.rounds)))
    print("all figures: " + json.dumps(figures))
    print(json.dumps(figures[-1]))


if __name__ == "__main__":
    main()

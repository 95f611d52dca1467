"""A healthy step waits for nothing on the host: a real trainer process under a real agent and
coordinator, whose snapshot writer is made deliberately slow, keeps stepping while it writes."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from remesh.elastic import Policy
from remesh.embedded import RedisServer
from remesh.v1.contract import COMPILATION_CACHE_ENV
from tests.procs import Cluster, wait_for
from tests.test_elastic_e2e import ENV, new_job_id

pytestmark = pytest.mark.integration

STEPS = 12
WRITE_S = 1.0

# A user's script, as it would run under `remesh agent`, with one change for the test: the
# snapshot store records when each write begins and ends and takes WRITE_S seconds to write.
SLOW_WRITER = textwrap.dedent(
    """
    import functools, json, os, sys, time
    from examples.tinylm import data, model
    from remesh.elastic import Policy, Session
    from remesh.elastic.snapshots import Snapshots

    events = []
    put = Snapshots.put

    def slow_put(self, step, layout, pieces, data=None):
        events.append(["write-begin", step])
        time.sleep(float(sys.argv[3]))
        put(self, step, layout, pieces, data)
        events.append(["write-end", step])

    Snapshots.put = slow_put  # every snapshot store of this process writes slowly (one host: no buddy)

    config = model.Config(seq_len=16, d_model=32, n_layers=1, d_mlp=128)
    session = Session(
        init_state=functools.partial(model.init_state, 0, config),
        train_step=functools.partial(model.train_step, config=config),
        batch_for_step=lambda step: data.global_batch(step, 4, 16, 0),
        devices_per_host=2,
        policy=Policy(snapshot_every=1, shm_dir=None),
    )
    for result in session.run(int(sys.argv[2])):
        events.append(["step", result.step])
    events.append(["skipped", session.stats["snapshots_skipped"]])
    # Whole or not at all: the test reads the file as soon as it exists.
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump(events, f)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    session.close()
    """
)


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer(appendonly=False) as server:
        yield server


def test_steps_go_on_while_a_slow_snapshot_is_written_and_snapshots_are_skipped_not_queued(
    tmp_path: Path, redis: RedisServer
) -> None:
    script = tmp_path / "slow_writer.py"
    script.write_text(SLOW_WRITER)
    out = tmp_path / "events.json"
    cluster = Cluster(tmp_path, redis.url, new_job_id())
    try:
        cluster.start_coordinator("--world-size", "1")
        cluster.start_agent(
            "host-0",
            trainer=[sys.executable, str(script), str(out), str(STEPS), str(WRITE_S)],
            env=ENV,
            extra=("--no-warm-standby",),
        )
        wait_for(out.exists, 120, "the trainer to finish")
        events = json.loads(out.read_text())
    finally:
        cluster.close()

    steps = [e[1] for e in events if e[0] == "step"]
    assert steps == list(range(1, STEPS + 1))
    end = events.index(["write-end", 1])
    before_end = [e[1] for e in events[:end] if e[0] == "step"]
    # The loop did not wait for the first snapshot's write: most of the run was done before it ended
    # (during it, or before it began where the low-priority snapshot thread got the CPU late).
    assert len(before_end) >= STEPS // 2, events
    # The snapshots due meanwhile were skipped, not queued behind it (one is on its way at a time:
    # each holds device memory until copied); the last step's is taken.
    writes = [e[1] for e in events if e[0] == "write-begin"]
    assert writes[0] == 1 and 2 not in writes and writes[-1] == STEPS and len(writes) < STEPS // 2, writes
    assert events[-1] == ["skipped", STEPS - len(writes)]
    # A snapshot is only kept once whole: the final one ended before the job reported its end.
    assert events.index(["write-end", STEPS]) < events.index(["step", STEPS])


_TENSORSTORE_PRIORITIES = textwrap.dedent(
    """
    import glob, json, os, sys, tempfile
    from concurrent.futures import ThreadPoolExecutor
    import jax, jax.numpy as jnp
    from remesh.elastic.checkpoints import LocalCheckpoints
    from remesh.elastic.exchange import lower_priority

    def workers():
        nice = []
        for task in glob.glob("/proc/self/task/*"):
            if open(task + "/comm").read().startswith("ts_pool_worker"):
                nice.append(os.getpriority(os.PRIO_PROCESS, int(os.path.basename(task))))
        return sorted(nice)

    store = LocalCheckpoints(tempfile.mkdtemp())
    state = {f"w{i}": jnp.full((512, 64), float(i)) for i in range(6)}
    # On the loop's own thread, as a trainer restoring its first epoch from a checkpoint does: this
    # starts tensorstore's workers, at the loop's priority.
    store.save(1, 0, state)
    restored = store.restore_state(1, state)
    first = workers()
    background = ThreadPoolExecutor(1, initializer=lower_priority)
    background.submit(store.save, 2, 0, state).result()
    after_save = workers()
    print(json.dumps({
        "base": os.getpriority(os.PRIO_PROCESS, 0),
        "saver": background.submit(lambda: os.getpriority(os.PRIO_PROCESS, 0)).result(),
        "first": first, "after_save": after_save,
        "restored": float(restored["w5"][0, 0]),
    }))
    """
)


def test_tensorstores_workers_started_by_a_restore_write_background_saves_at_the_savers_priority() -> None:
    """Tensorstore (Orbax's I/O) starts its worker threads on first use, at the priority of the
    thread that used it. A trainer that restored from a checkpoint on its loop's thread would run
    every later background save's I/O at the step's priority, taking cores from the step: a save
    from the background thread moves those workers down to its own priority first."""
    done = subprocess.run(
        [sys.executable, "-c", _TENSORSTORE_PRIORITIES], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["restored"] == 5.0
    assert got["saver"] > got["base"], got  # the background thread runs below the loop
    # The restore on the loop's thread started workers at the loop's priority ...
    assert got["first"] and min(got["first"]) == got["base"], got
    # ... and the background save moved every one of them to its own before writing.
    assert got["after_save"] and min(got["after_save"]) >= got["saver"], got


def test_a_policy_whose_buddy_copies_fall_between_snapshots_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of snapshot_every"):
        Policy(snapshot_every=3, buddy_every=4)
    with pytest.raises(ValueError, match="snapshot_every must be >= 1"):
        Policy(snapshot_every=0)
    assert Policy(snapshot_every=3, buddy_every=6).buddy_every == 6
    # By default the buddy copies go with every snapshot, whatever the interval.
    assert Policy(snapshot_every=5).buddy_every is None
    assert Policy(snapshot_every=5).own_snapshots_kept == 4


def test_the_compilation_cache_is_where_the_environment_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(COMPILATION_CACHE_ENV, raising=False)
    assert Policy().compilation_cache_dir == str(Path(tempfile.gettempdir()) / "remesh-jax-cache")
    monkeypatch.setenv(COMPILATION_CACHE_ENV, str(tmp_path / "cache"))
    assert Policy().compilation_cache_dir == str(tmp_path / "cache")
    assert Policy(compilation_cache_dir=None).compilation_cache_dir is None  # off, whatever it says


def test_epoch_jit_meets_the_members_before_its_first_call_runs_and_never_again() -> None:
    """``Epoch.jit``'s function compiles and meets the epoch's members (the meeting, recorded here in
    its place) before its first call runs, once: later calls are ``jax.jit``'s, the first call runs
    what the meeting compiled (traced once), and its other attributes are the jitted function's."""
    import jax
    import jax.numpy as jnp

    from remesh.elastic.epoch import _MeetsOnFirstCall

    seen: list[tuple[object, ...]] = []

    def meet(jitted: object, name: str, args: tuple[object, ...], kwargs: dict) -> None:
        jitted.lower(*args, **kwargs).compile()  # type: ignore[attr-defined]
        seen.append(("met", name))

    def step(x: jax.Array) -> jax.Array:
        seen.append(("traced",))
        return x + 1

    f = _MeetsOnFirstCall(meet, jax.jit(step), "compiled-1")
    assert int(f(jnp.int32(1))) == 2
    assert int(f(jnp.int32(2))) == 3
    assert seen == [("traced",), ("met", "compiled-1")]
    assert f.lower(jnp.int32(5)).compile()(jnp.int32(5)) == 6

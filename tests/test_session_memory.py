"""What a ``Session`` holds, and for how long: device memory, threads, /dev/shm mappings and time.

Real trainer processes (JAX on CPU, a tiny state) drive a ``Session`` through its own loop; the
agent is stood in (``tests.local_agent``: a real gRPC server on a Unix socket, spoken to by the real
``AgentClient``). Each case is a process of its own where a process matters (the watchdog ends it;
thread counts and memory maps are the process's) and so that JAX starts with the session's flags.

- A snapshot being copied when a new epoch comes is dropped at its next shard; the process recovers
  in-process and the watchdog, at its default grace, does not end it. A snapshot waiting for a step
  that never ends is still a stuck peer: the watchdog ends the process.
- 20 sessions opened, run and closed in one process leave its threads and its /dev/shm mappings as
  they were.
- At every ``done()`` the device holds the live state and at most one snapshot more, or what
  ``snapshot_device_budget_bytes`` allows, released shard by shard as copied.
- The interval between snapshots kept is reported, and said when it is not the one asked for; the
  automatic cadence moves to an interval snapshots fit in.
- Host copies on CPU never share memory with a device buffer.
- The restore's build phase ends when the data is on the device.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remesh.elastic.cadence import FIRST_EVERY
from remesh.elastic.host_copies import SnapshotCopy, copies_of, host_copy
from remesh.v1.contract import RESTART_EXIT_CODE
from tests.local_agent import LocalAgent, socket_path

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]

# A trainer's own loop over ``Session.epochs`` with a tiny state: LEAVES float32 leaves of 128 KiB.
PRELUDE = textwrap.dedent(
    """
    import gc, json, os, sys, threading, time
    from pathlib import Path
    import numpy as np
    import jax, jax.numpy as jnp
    from remesh.elastic import Faults, Policy, Session, configure_logging
    from tests.local_agent import LocalAgent

    configure_logging("info")
    LEAVES, ROWS, COLS = 8, 128, 256
    STATE_BYTES = LEAVES * ROWS * COLS * 4

    def init_state():
        return {f"w{i}": jnp.full((ROWS, COLS), float(i), jnp.float32) for i in range(LEAVES)}

    def train_step(state, batch):
        shift = jnp.mean(batch)
        new = {k: v * 0.5 + shift for k, v in state.items()}
        return new, {"loss": jnp.mean(new["w0"])}

    def train(session, steps, after_done=None, step_fn_of=None):
        for epoch in session.epochs(steps):
            with epoch:
                step_fn = epoch.jit(step_fn_of or train_step, out_shardings=(epoch.shardings, epoch.replicated))
                state = epoch.state
                for step in epoch.steps():
                    state, metrics = step_fn(state, epoch.batch(np.full((1, 4), step, np.float32)))
                    epoch.done(state, metrics)
                    if after_done is not None:
                        after_done(epoch, state)
                    del metrics

    def write(path, value):
        with open(path + ".tmp", "w") as f:
            json.dump(value, f)
        os.replace(path + ".tmp", path)
    """
)


def run_script(body: str, *args: str, env: dict[str, str] | None = None, timeout: float = 240) -> Any:
    """Run PRELUDE + ``body`` as a trainer process; its result is what it wrote to ``args[0]``."""
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body), *args],
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "JAX_PLATFORMS": "cpu",
            "REMESH_LOG_FORMAT": "json",
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done


def log_events(stderr: str) -> list[dict[str, Any]]:
    """The trainer's structured log lines (JSON, one a line)."""
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory of its own on a tmpfs (/dev/shm where there is one): snapshots are memory."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix="remesh-test-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---- leaving an epoch does not wait for a snapshot it will not restore ----------------------------

SHARD_DELAY_S = 0.5  # a slow snapshot: 8 shards, 4 s in all, twenty times the watchdog's grace
ON_DEVICE_PAUSE_S = 0.3

RECOVERY = f"""
    out, shm, sock = sys.argv[1], sys.argv[2], sys.argv[3]
    import remesh.elastic.restore as restore
    agent = LocalAgent(Path(sock))
    events = []
    waited_on_device = restore.on_device

    def recorded(leaves):
        waited_on_device(leaves)
        events.append({{"ready": all(x.is_ready() for x in leaves), "leaves": len(leaves)}})
        time.sleep({ON_DEVICE_PAUSE_S})  # inside the restore's build phase, if it ends after this

    restore.on_device = recorded
    # The watchdog at its defaults: a step still blocked 0.2 s after a new epoch ends the process.
    session = Session(
        init_state=init_state, devices_per_host=1, agent=agent.client(), job_id="slow-snapshot",
        policy=Policy(snapshot_every=1, shm_dir=shm),
    )
    epochs, slow = [], {{}}

    def after_done(epoch, state):
        time.sleep(0.02)  # a step of 20 ms: a fast snapshot is kept within a step or two
        if epoch.epoch != 1:
            return
        if not slow and session.stats["snapshots"] >= 2:
            session.snapshotter.shard_delay_s = {SHARD_DELAY_S}  # every snapshot taken from now on is slow
            slow["from"] = epoch.step
            return
        flight = session.snapshotter.in_flight
        if slow and "step" not in slow and flight is not None and flight.step > slow["from"]:
            while flight.copy.phase != "copy":  # its step is done: it copies, shard by shard
                time.sleep(0.005)
            slow["step"] = flight.step
            slow["kept_before"] = session.snapshots.steps()
            agent.publish(2, restore_step=epoch.step - 1)
            while session.agent.latest.epoch < 2:
                time.sleep(0.005)

    for epoch in session.epochs(40):
        with epoch:
            epochs.append({{"epoch": epoch.epoch, "pid": os.getpid(), "step": epoch.step,
                            "source": epoch.restored_from, "held": session.snapshots.steps()}})
            session.snapshotter.shard_delay_s = 0.0  # fast again: slow only while epoch 1 is left
            step_fn = epoch.jit(train_step, out_shardings=(epoch.shardings, epoch.replicated))
            state = epoch.state
            for step in epoch.steps():
                state, metrics = step_fn(state, epoch.batch(np.full((1, 4), step, np.float32)))
                epoch.done(state, metrics)
                after_done(epoch, state)
    final = [float(x[0, 0]) for x in session.final_leaves()]
    session.close()
    write(out, {{"epochs": epochs, "slow": slow, "stats": session.stats, "events": events,
                 "acks": agent.acks, "final": final}})
    agent.close()
"""


def test_a_snapshot_being_copied_is_dropped_when_the_epoch_is_left_and_the_watchdog_lets_the_recovery_be(
    tmp_path: Path, shm_dir: Path
) -> None:
    out = tmp_path / "out.json"
    done = run_script(RECOVERY, str(out), str(shm_dir), str(socket_path(tmp_path)))
    # Exit 75 (RESTART_EXIT_CODE) is the watchdog taking the snapshot's copy for a dead peer.
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(out.read_text())
    slow = got["slow"]
    first, second = got["epochs"]
    # One process, two epochs: the recovery was in-process.
    assert (first["epoch"], second["epoch"]) == (1, 2) and first["pid"] == second["pid"]
    # The slow snapshot was being copied when the epoch was left: dropped, never kept ...
    assert got["stats"]["snapshots_abandoned"] >= 1
    assert slow["step"] not in second["held"]
    # ... and the restore took the newest snapshot kept before it, from memory.
    assert second["source"] == "memory"
    assert second["step"] == max(slow["kept_before"]) < slow["step"]
    # The job went on to its end from there.
    assert got["final"] and got["stats"]["snapshots"] > len(slow["kept_before"])

    # Every restore waited for its leaves to be on the device, and its phase counted the wait: the
    # pause after the leaves were ready is inside the epoch-2 restore's build phase.
    assert got["events"] and all(e["ready"] for e in got["events"])
    ack = next(a for a in got["acks"] if a["epoch"] == 2)
    assert ack["source"] == "memory" and ack["restored_step"] == second["step"]
    assert ack["phases"]["restore_build"] >= ON_DEVICE_PAUSE_S


STUCK = """
    out, shm, sock = sys.argv[1], sys.argv[2], sys.argv[3]
    agent = LocalAgent(Path(sock))
    STUCK_AT = 5

    def stuck_step(state, batch):
        # Step STUCK_AT computes for minutes, as one waiting for a dead peer never ends; dispatched
        # without waiting, as any step (a host callback would make the dispatch itself wait).
        w = jnp.full((512, 512), 0.001, jnp.float32)
        rounds = jnp.where(jnp.mean(batch) == STUCK_AT, 1_000_000, 0).astype(jnp.int32)
        def spin(carry):
            i, v = carry
            return i + 1, jnp.tanh(v @ w)
        _, v = jax.lax.while_loop(lambda c: c[0] < rounds, spin, (jnp.int32(0), jnp.zeros((512, 512))))
        new, metrics = train_step(state, batch)
        return {k: x + 0 * v[0, 0] for k, x in new.items()}, metrics

    session = Session(
        init_state=init_state, devices_per_host=1, agent=agent.client(), job_id="stuck-step",
        policy=Policy(snapshot_every=3, shm_dir=shm),
    )

    def after_done(epoch, state):
        if epoch.step == STUCK_AT - 1:
            time.sleep(0.5)  # the snapshot of step 3 is long kept: the next one is taken
        if epoch.step == STUCK_AT + 1:  # dispatched; its snapshot waits for it
            print("announcing", flush=True)
            agent.publish(2, restore_step=3)
            while session.agent.latest.epoch < 2:
                time.sleep(0.005)

    train(session, 12, after_done, stuck_step)
    write(out, {"finished": True})
"""


def test_a_snapshot_waiting_for_a_step_that_never_ends_is_still_a_stuck_peer(
    tmp_path: Path, shm_dir: Path
) -> None:
    out = tmp_path / "out.json"
    started = time.monotonic()
    done = run_script(STUCK, str(out), str(shm_dir), str(socket_path(tmp_path)), timeout=100)
    assert done.returncode == RESTART_EXIT_CODE, done.stderr[-4000:]
    assert not out.exists()
    exits = [e for e in log_events(done.stderr) if e.get("code") == RESTART_EXIT_CODE]
    assert exits and exits[0]["reason"].startswith("leaving of epoch 1 still blocked"), exits
    assert time.monotonic() - started < 100  # ended by the watchdog, not by the step's 120 s


# ---- closing frees everything ------------------------------------------------------------------------

CLOSING = """
    from remesh.elastic.agent_client import AgentClient, Assignment
    import weakref

    out, shm, address, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    def mapped():
        with open("/proc/self/maps") as f:
            rows = [line.split() for line in f if shm in line]
        return sum(int(r[0].split("-")[1], 16) - int(r[0].split("-")[0], 16) for r in rows), len(rows)

    def files():
        return sorted(str(p) for p in Path(shm).rglob("*"))

    sessions = []

    def one(i):
        first = Assignment(1, "host-0", 0, 1, "", -1, hosts=("host-0",))
        with Session(
            init_state=init_state, devices_per_host=1, job_id=f"close-{i}",
            agent=AgentClient(address, first, progress_every_s=0),
            policy=Policy(snapshot_every=2, shm_dir=shm),
        ) as session:
            train(session, 6)
            final = session.final_leaves()
            assert len(final) == 8 and all(x.shape == (ROWS, COLS) for x in final)
            del final
        sessions.append(weakref.ref(session))

    one(0)  # JAX's backend, gRPC's own threads: there before any session is counted
    gc.collect()
    before = {"threads": threading.active_count(), "names": sorted(t.name for t in threading.enumerate()),
              "mapped": mapped(), "files": files()}
    for i in range(1, count + 1):
        one(i)
    gc.collect()
    time.sleep(0.5)
    after = {"threads": threading.active_count(), "names": sorted(t.name for t in threading.enumerate()),
             "mapped": mapped(), "files": files()}
    write(out, {"before": before, "after": after, "alive": sum(r() is not None for r in sessions)})
"""


def test_twenty_sessions_opened_run_and_closed_leave_threads_and_shared_memory_as_they_were(
    tmp_path: Path, shm_dir: Path
) -> None:
    agent = LocalAgent(socket_path(tmp_path))
    try:
        out = tmp_path / "out.json"
        done = run_script(CLOSING, str(out), str(shm_dir), agent.address, "20", timeout=280)
    finally:
        agent.close()
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(out.read_text())
    before, after = got["before"], got["after"]
    assert len(agent.finished) == 21  # every session ran its job to the end
    # No thread of any session is left (watchdog, background work, the agent client's) ...
    assert after["threads"] == before["threads"], (before["names"], after["names"])
    # ... no file of /dev/shm stays mapped (a deleted one would hold its memory), none is left over ...
    assert after["mapped"] == before["mapped"] == [0, 0]
    assert after["files"] == before["files"] == []
    # ... and nothing keeps a closed session alive.
    assert got["alive"] == 0


# ---- device memory is a budget -----------------------------------------------------------------------

BUDGET = """
    out, shm = sys.argv[1], sys.argv[2]
    from remesh.elastic.solo import SoloAgent

    def device_bytes(exclude):
        seen, total = set(), 0
        for x in jax.live_arrays():
            if x.is_deleted():
                continue
            for shard in x.addressable_shards:
                pointer = shard.data.unsafe_buffer_pointer()
                if pointer not in seen and pointer not in exclude:
                    seen.add(pointer)
                    total += shard.data.nbytes
        return total

    def run(budget, shm_dir):
        extra = []
        held = []
        def after_done(epoch, state):
            live = {x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(state)}
            extra.append(device_bytes(live))  # beside the live state: what snapshots (and the step) hold
            flight = session.snapshotter.in_flight
            if flight is not None and flight.step < epoch.step:
                held.append(flight.copy.held_bytes)
        with Session(
            init_state=init_state, devices_per_host=1, agent=SoloAgent(f"budget-{budget}"),
            job_id=f"budget-{budget}", faults=Faults.from_env(),
            policy=Policy(snapshot_every=1, shm_dir=shm_dir, snapshot_device_budget_bytes=budget),
        ) as session:
            train(session, 16, after_done)
        return {"extra": extra, "held": held, "stats": session.stats}

    write(out, {
        "state_bytes": STATE_BYTES,
        "none": run(None, None),
        "none_shm": run(None, shm),
        "half": run(STATE_BYTES // 2, None),
    })
"""


def test_snapshots_hold_at_most_one_state_of_device_memory_or_the_budget_released_as_copied(
    tmp_path: Path, shm_dir: Path
) -> None:
    out = tmp_path / "out.json"
    done = run_script(BUDGET, str(out), str(shm_dir), env={"REMESH_FAULT_SNAPSHOT_SHARD_DELAY_S": "0.03"})
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(out.read_text())
    state = got["state_bytes"]
    leaf = state // 8
    # Beside the live state at every done(): at most one snapshot of an earlier step (it was slow:
    # one was on its way at most done()s), and the step's small outputs; two on their way would be 2x.
    for name in ("none", "none_shm"):
        run = got[name]
        assert run["held"], f"{name}: no done() found a snapshot of an earlier step on its way"
        assert max(run["extra"]) <= state + leaf // 4, (name, run["extra"])
        assert run["stats"]["snapshot_held_bytes_peak"] <= state
        assert run["stats"]["snapshots_skipped"] > 0  # one at a time: those due meanwhile skipped
    # With a budget of half a state the loop waits until the snapshot on its way holds at most that:
    # it lets go of each shard as it is copied, so the wait ends halfway through the copy.
    half = got["half"]
    assert max(half["extra"]) <= state // 2 + leaf // 4, half["extra"]
    assert 0 < half["stats"]["snapshot_held_bytes_peak"] <= state // 2
    assert any(0 < h <= state // 2 for h in half["held"]), half["held"]
    assert half["stats"]["snapshot_wait_s"] > 0


# ---- the interval kept is reported ---------------------------------------------------------------

INTERVAL = """
    out = sys.argv[1]
    from remesh.elastic.solo import SoloAgent

    def slow_steps(epoch, state):
        time.sleep(0.02)  # a step of 20 ms; a snapshot takes 8 shards x 30 ms and more

    def run(every, steps, **policy):
        with Session(
            init_state=init_state, devices_per_host=1, agent=SoloAgent(f"interval-{every}"),
            job_id=f"interval-{every}", faults=Faults.from_env(),
            policy=Policy(snapshot_every=every, shm_dir=None, **policy),
        ) as session:
            train(session, steps, slow_steps)
        return dict(session.stats)

    write(out, {"fixed": run(2, 60), "auto": run("auto", 110, mtbf_s=1.0)})
"""


def test_the_interval_kept_is_reported_and_the_automatic_cadence_moves_to_one_snapshots_fit_in(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.json"
    done = run_script(INTERVAL, str(out), env={"REMESH_FAULT_SNAPSHOT_SHARD_DELAY_S": "0.03"})
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(out.read_text())
    fixed, auto = got["fixed"], got["auto"]
    # Asked every 2 steps, a snapshot takes about 12: those due meanwhile are skipped, and the
    # interval kept (a multiple of 2) is what the session says.
    assert fixed["snapshot_every"] == 2
    assert fixed["snapshot_every_kept"] > 2 and fixed["snapshot_every_kept"] % 2 == 0
    warnings = [
        e for e in log_events(done.stderr) if e.get("event", "").startswith("snapshots are kept further")
    ]
    assert warnings, done.stderr[-3000:]
    told = warnings[0]
    assert told["asked_every"] == 2 and told["kept_every"] > 2 and told["snapshot_s"] > 0
    assert told["fix"].startswith("Policy(snapshot_every=") and int(told["fix"][22:-1]) > 2
    assert "ask for an interval they fit in" in told["event"]
    # The automatic cadence, whose snapshots take about 12 steps, does not stay at its first K.
    assert auto["snapshot_every"] > FIRST_EVERY, auto
    assert auto["snapshot_since"] > 0


# ---- host copies -------------------------------------------------------------------------------------


def test_a_host_copy_on_cpu_owns_its_memory_where_np_asarray_is_a_view() -> None:
    x = jnp.arange(4096, dtype=jnp.float32) * 2
    view = np.asarray(x)
    assert view.ctypes.data == x.unsafe_buffer_pointer()  # what makes the copy necessary here
    host = host_copy(x)
    assert host.ctypes.data != x.unsafe_buffer_pointer() and not np.shares_memory(host, view)
    # The checkpoint's host copy of a replicated state goes the same way.
    (saved,) = copies_of({0: x}).values()
    assert saved.ctypes.data != x.unsafe_buffer_pointer() and not np.shares_memory(saved, view)
    del view
    x.delete()  # the device buffer is gone; the host copy is not
    assert host[4095] == 8190.0 and saved[4095] == 8190.0
    bf16 = host_copy(jnp.ones((3, 5), jnp.bfloat16))
    assert bf16.dtype == jnp.bfloat16 and bf16.shape == (3, 5) and float(bf16.sum()) == 15.0


def test_a_snapshot_copy_lets_go_of_each_shard_as_copied_and_stops_at_the_next_shard() -> None:
    shards = {i: jnp.full((64, 64), float(i)) for i in range(6)}
    nbytes = sum(int(x.nbytes) for x in shards.values())
    copy = SnapshotCopy(shards, owned=True)
    assert shards == {} and copy.held_bytes == nbytes and copy.phase == "step"
    got = copy.run()
    assert got is not None and copy.phase == "done" and copy.held_bytes == 0
    assert [float(got[i][0, 0]) for i in range(6)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]

    slow = SnapshotCopy({i: jnp.full((64, 64), float(i)) for i in range(6)}, owned=True, shard_delay_s=0.2)
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(slow.run()))
    worker.start()
    while slow.phase != "copy":
        time.sleep(0.005)
    time.sleep(0.3)  # a shard or two copied
    slow.stop()
    worker.join(timeout=5)
    assert result == [None] and slow.held_bytes == 0  # stopped short of the rest, nothing kept


def test_the_restore_waits_for_the_device_before_its_timer_stops() -> None:
    """The hook the restore phases go through (``restore.on_device``) leaves every leaf ready."""
    from remesh.elastic.restore import on_device

    leaves = [jax.device_put(np.full((256, 256), float(i), np.float32)) for i in range(4)]
    on_device(leaves)
    assert all(x.is_ready() for x in leaves)


def test_a_session_alone_whose_snapshot_directory_cannot_be_made_says_so_and_trains(tmp_path: Path) -> None:
    """``Policy.shm_dir`` names a regular file: no snapshot directory can be made there. The session
    neither refuses to start (it would fail the same way on every host, and the job would go round
    its spares) nor downgrades silently: the tier is missing, counted and logged, the snapshots stay
    in the process, and the result is bitwise that of a run that keeps them in the process on purpose."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    done = run_script(
        """
        from remesh.elastic.solo import SoloAgent
        out, blocker = sys.argv[1], sys.argv[2]
        finals = {}
        for name, shm in (("blocked", blocker), ("in-process", None)):
            session = Session(init_state=init_state, devices_per_host=1, agent=SoloAgent(name),
                              job_id=name, policy=Policy(snapshot_every=2, shm_dir=shm))
            train(session, 6)
            finals[name] = [np.asarray(x).tolist() for x in session.final_leaves()]
            stats, missing = dict(session.stats), dict(session.tiers_missing)
            session.close()
            finals[name + "-stats"] = {"failures": stats["snapshot_failures"], "snapshots": stats["snapshots"],
                                        "missing": missing}
        write(out, finals)
        """,
        str(tmp_path / "out.json"),
        str(blocker),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    blocked = result["blocked-stats"]
    assert set(blocked["missing"]) == {"host-shm"} and "NotADirectoryError" in blocked["missing"]["host-shm"]
    assert blocked["failures"] >= 1 and blocked["snapshots"] >= 2  # the first due, and the last step's
    assert result["in-process-stats"]["missing"] == {}
    assert result["blocked"] == result["in-process"]
    errors = [e for e in log_events(done.stderr) if e.get("level") == "error"]
    assert any(
        "snapshot tier cannot keep" in e.get("event", "") and e.get("tier") == "host-shm" for e in errors
    )

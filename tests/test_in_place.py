"""In-process recovery is the normal path of a user's own loop, and where it cannot be, the reason is
named: in the trainer's log (with the fix) and in the exit note its agent reads.

End to end (real coordinator, agents and JAX trainers of examples/tinylm/train_own_loop.py, 3 hosts
x 2 CPU devices and a spare): a non-zero rank is SIGKILLed, and every survivor recovers in the same
process (the pid that ran epoch 1 runs epoch 2, restored from its own memory), nothing exits, and the
run ends on the state of the run without the kill, bit for bit. What made the survivors leave before:
the watchdog ended any step still blocked when the new epoch left out a member (a step in a
collective with a dead peer), although on CPU that collective fails by itself; and rank 0 shut the
epoch's coordination service down while the others were still connected to it, which JAX makes
fatal for them ("Failed to disconnect from coordination service").

Then a trainer under a scripted agent whose loop blocks in its own code when a new epoch comes: past
the step's grace it exits for a fresh process, naming ``step-stuck`` with what to do, and leaves the
same in ``$REMESH_EXIT_NOTE``; and one whose failure is followed by no new epoch names
``no-new-epoch``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from remesh.elastic.exits import EXIT_NOTE_ENV, ExitNote, Why
from remesh.embedded import RedisServer
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.contract import RESTART_EXIT_CODE, TrainerAssignment
from tests import test_elastic_e2e
from tests.procs import Cluster
from tests.test_elastic_e2e import ENV, STEPS, leaves, run_job
from tests.test_solo_runtime import NO_NETWORK, ScriptedAgent, _serve

# The Redis server of test_elastic_e2e's jobs, one per module: a fixture shared by name.
redis = test_elastic_e2e.redis

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]


def own_loop(final: Path, *extra: str) -> list[str]:
    """The own-loop trainer, pausing between steps as the other end-to-end tests' trainers do: a
    peer killed in the middle of a collective can leave the survivors out of step on CPU, and gloo
    then ends one of them (``Why.COLLECTIVE_TORN``, for its agent to name), about one kill in five
    with no pause; this test is about the recovery every other kill gets."""
    return [
        sys.executable, "-m", "examples.tinylm.train_own_loop", "--steps", str(STEPS),
        "--d-model", "64", "--layers", "1", "--seq-len", "32", "--save-final", str(final),
        "--step-sleep", "0.05", *extra,
    ]  # fmt: skip


def pids_by_epoch(cluster: Cluster, host: str) -> dict[int, set[int]]:
    """The trainer processes that said "epoch ready" in ``host``'s log, by epoch."""
    seen: dict[int, set[int]] = {}
    for m in re.finditer(r"epoch ready .*?epoch=(\d+) .*?pid=(\d+)", cluster.agents[host].output()):
        seen.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return seen


def test_a_users_own_loop_recovers_in_the_same_process_when_a_non_zero_rank_is_killed(
    tmp_path: Path, redis: RedisServer
) -> None:
    clean_final, clean = run_job(
        tmp_path / "clean",
        redis.url,
        spares=0,
        victim=None,
        command=own_loop(tmp_path / "clean" / "final.npz"),
    )
    clean.close()
    final, cluster = run_job(
        tmp_path / "killed",
        redis.url,
        spares=1,
        victim="host-1",
        command=own_loop(tmp_path / "killed" / "final.npz"),
    )
    try:
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "spare-0", "host-2"]
        for host in ("host-0", "host-2"):
            pids = pids_by_epoch(cluster, host)
            assert len(pids[1]) == 1 and pids[2] == pids[1], (host, pids)  # the same process
            log = cluster.agents[host].output()
            assert "trainer exited" not in log.split("job finished")[0], host
            assert "in-process recovery impossible" not in log, host
        acks = {
            e.host_id: e for e in cluster.events() if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 2
        }
        # The survivors restored from their own memory (a fresh process would have read /dev/shm).
        assert {acks[h].details["restore_source"] for h in ("host-0", "host-2")} == {"memory"}, acks
        for a, b in zip(leaves(final), leaves(clean_final), strict=True):
            assert a.tobytes() == b.tobytes(), "the state differs from the run without the kill"
    finally:
        cluster.close()


class AnnouncingAgent(ScriptedAgent):
    """The scripted agent of tests/test_solo_runtime.py, whose epoch 2 comes when the test says."""

    def __init__(self) -> None:
        super().__init__(switch_at=None)
        self.announced_at = 0.0

    def announce(self) -> None:
        with self.changed:
            self.epoch = 2
            self.announced_at = time.monotonic()
            self.changed.notify_all()


# A user's own loop whose input blocks at step 5 of epoch 1 (say, a data loader waiting on a
# filesystem that hangs), after saying so in a file.
BLOCKING_LOOP = NO_NETWORK + textwrap.dedent(
    """
    import functools, pathlib, sys, time
    from examples.tinylm import data, model
    from remesh.elastic import Faults, Policy, Session

    stuck = pathlib.Path(sys.argv[1])
    config = model.Config(seq_len=16, d_model=32, n_layers=1, d_mlp=128)
    session = Session(
        init_state=functools.partial(model.init_state, 0, config),
        devices_per_host=1,
        policy=Policy(snapshot_every=1, shm_dir=None, progress_every_s=0.05, epoch_wait_s=float(sys.argv[2])),
        faults=Faults(collective_fails_at_step=int(sys.argv[3]) if sys.argv[3] != "-" else None),
    )
    for epoch in session.epochs(50):
        with epoch:
            step_fn = epoch.jit(functools.partial(model.train_step, config=config))
            state = epoch.state
            for step in epoch.steps():
                if epoch.epoch == 1 and step == 5 and sys.argv[3] == "-":
                    stuck.write_text("blocked")
                    time.sleep(120)
                state, metrics = step_fn(state, epoch.batch(data.global_batch(step, 4, 16, 0)))
                epoch.done(state, metrics)
    """
)


def start_trainer(
    tmp: Path, agent: ScriptedAgent, epoch_wait_s: float, fails_at: str
) -> tuple[subprocess.Popen[str], Path, Path]:
    script = tmp / "trainer.py"
    script.write_text(BLOCKING_LOOP)
    sock = tmp / "agent.sock"
    note = tmp / "exit-note.json"
    given = TrainerAssignment(
        agent_address=f"unix:{sock}", slot=1, host_id="host-0", job_id="in-place", epoch=1, rank=0,
        world_size=1, jax_coordinator="127.0.0.1:1", restore_step=-1, device_count=1, commits=(),
    )  # fmt: skip
    env = {**os.environ, **ENV, "JAX_PLATFORMS": "cpu", **given.to_env(), EXIT_NOTE_ENV: str(note)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp / "stuck"), str(epoch_wait_s), fails_at],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    return proc, tmp / "stuck", note


def test_a_loop_blocked_in_its_own_code_past_the_grace_names_step_stuck_and_the_fix(tmp_path: Path) -> None:
    agent = AnnouncingAgent()
    server = _serve(agent, tmp_path / "agent.sock")
    proc, stuck, note = start_trainer(tmp_path, agent, epoch_wait_s=30.0, fails_at="-")
    try:
        deadline = time.monotonic() + 120
        while not stuck.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stdout.read() if proc.stdout else ""
            )
            time.sleep(0.05)
        agent.announce()
        out, _ = proc.communicate(timeout=60)
        ended = time.monotonic()
    finally:
        proc.kill()
        server.stop(None)
    assert proc.returncode == RESTART_EXIT_CODE, out[-4000:]
    # Not before the grace: on CPU a collective with a dead peer fails within the collective
    # timeout (2 s), and the step gets that and a second more to do so.
    assert ended - agent.announced_at >= 3.0
    told = ExitNote.from_json(note.read_text())
    assert told.why == Why.STEP_STUCK and told.exit_code == RESTART_EXIT_CODE
    assert "step of epoch 1 still blocked" in told.reason and "epoch 2 was announced" in told.reason
    assert "input that blocks" in told.fix and "Policy.stuck_step_exit_s" in told.fix
    line = next(line for line in out.splitlines() if "in-process recovery impossible" in line)
    assert "why=step-stuck" in line and "input that blocks" in line


def test_a_failure_no_new_epoch_follows_names_no_new_epoch(tmp_path: Path) -> None:
    agent = AnnouncingAgent()  # never announces
    server = _serve(agent, tmp_path / "agent.sock")
    proc, _, note = start_trainer(tmp_path, agent, epoch_wait_s=1.0, fails_at="4")
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        server.stop(None)
    assert proc.returncode == RESTART_EXIT_CODE, out[-4000:]
    told = ExitNote.from_json(note.read_text())
    assert told.why == Why.NO_NEW_EPOCH and "no new epoch within 1s" in told.reason
    assert "remesh status" in told.fix

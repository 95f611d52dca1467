"""A trainer that gives up on recovering in place says why (its exit note, ``Env.EXIT_NOTE``), and its
agent puts that into what it logs and reports: pure decisions first, then a real agent and
coordinator whose trainer leaves a note and exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from remesh.agent.core import AgentState, TrainerExit, on_trainer_exit
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.contract import RESTART_EXIT_CODE, STATE_LOST_EXIT_CODE, ExitNote
from tests.procs import Cluster, wait_for

NOTE = ExitNote("step-stuck", "a step of epoch 3 still ran 2.1s after epoch 4", "keep the loop short", 75)


def test_a_note_round_trips_and_a_broken_one_is_refused() -> None:
    assert ExitNote.from_json(NOTE.to_json()) == NOTE
    for broken in ("", "{", '{"why": "x"}', '{"why": "x", "reason": "r", "fix": "f", "exit_code": "n"}'):
        with pytest.raises((ValueError, KeyError, TypeError)):
            ExitNote.from_json(broken)


def _exit(code: int, note: ExitNote | None) -> str:
    started = AgentState().trainer_started()
    decision = on_trainer_exit(
        started, TrainerExit(3, code, False, note=note), current_epoch=3, restore_step=17, abort_delay_s=0.5
    )
    return decision.reason


def test_a_restart_and_a_lost_state_carry_the_trainers_reason() -> None:
    assert NOTE.reason in _exit(RESTART_EXIT_CODE, NOTE) and "step-stuck" in _exit(RESTART_EXIT_CODE, NOTE)
    assert _exit(RESTART_EXIT_CODE, None) == "it asked for a fresh process on the current topology"
    lost = ExitNote("data-position-lost", "the input positions of step 40 cannot be carried", "see docs", 65)
    assert _exit(STATE_LOST_EXIT_CODE, lost) == lost.reason
    assert "no tier holding any step" in _exit(STATE_LOST_EXIT_CODE, None)


# A trainer that leaves a note saying its input positions are lost, and exits as the session does.
LOSES_ITS_INPUT = textwrap.dedent(
    """
    import os, sys
    from remesh.v1.contract import Env, ExitNote, STATE_LOST_EXIT_CODE
    note = ExitNote("data-position-lost", "the input positions of step 40 cannot be carried to 2 hosts",
                    "give IteratorData a rebuild_at", STATE_LOST_EXIT_CODE)
    with open(os.environ[Env.EXIT_NOTE], "w") as f:
        f.write(note.to_json())
    sys.exit(STATE_LOST_EXIT_CODE)
    """
)


@pytest.mark.integration
def test_the_agent_logs_and_reports_the_reason_its_trainer_left(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(LOSES_ITS_INPUT)
    cluster.start_coordinator("--world-size", "1")
    agent = cluster.start_agent("host-0", trainer=[sys.executable, str(script)], extra=("--no-warm-standby",))

    def halted() -> pb.Event | None:
        return next((e for e in cluster.events() if e.type == pb.EVENT_TYPE_JOB_HALTED), None)

    wait_for(halted, 30, "the job to halt")
    fault = next(e for e in cluster.events() if e.type == pb.EVENT_TYPE_FAULT_REPORTED)
    assert "cannot be carried to 2 hosts" in fault.reason, fault
    log = agent.log_path.read_text()
    assert "why=data-position-lost" in log or '"why": "data-position-lost"' in log, log[-2000:]


# A user's script with a bug every host shares: its init_state hands numpy a traced array (the
# session traces init_state with jax.eval_shape), which raises on every host it runs on.
BUGGY = textwrap.dedent(
    """
    import jax.numpy as jnp
    import numpy as np
    from remesh.elastic import Session

    def init_state():
        return {"w": np.asarray(jnp.zeros((4,)))}

    session = Session(init_state=init_state, devices_per_host=2)
    for epoch in session.epochs(5):
        with epoch:
            state = epoch.state
            for step in epoch.steps():
                epoch.done(state, {})
    """
)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_bug_in_the_training_script_halts_the_job_within_its_budget(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The same error on a fresh host, recovery after recovery with no step completed, follows the job
    and not a host: after the budget of recoveries the operator set, the job halts with the script's
    own error, in the event and in ``remesh topology``, having burned no more spares than that."""
    script = tmp_path / "buggy.py"
    script.write_text(BUGGY)
    budget = 1
    cluster.start_coordinator("--world-size", "1", "--max-repeated-crashes", str(budget))
    cluster.start_agent("host-0", trainer=[sys.executable, str(script)], extra=("--no-warm-standby",))
    for i in range(2):
        cluster.start_agent(
            f"spare-{i}", spare=True, trainer=[sys.executable, str(script)], extra=("--no-warm-standby",)
        )

    def halted() -> pb.Event | None:
        return next((e for e in cluster.events() if e.type == pb.EVENT_TYPE_JOB_HALTED), None)

    halt = wait_for(halted, 200, "the job to halt")
    assert "TracerArrayConversionError" in halt.reason and "buggy.py:7 in init_state" in halt.reason, halt
    assert (
        f"{budget + 1} trainer failures in a row" in halt.reason
        and "the job completed no step" in halt.reason
    )
    events = cluster.events()
    recoveries = [
        e
        for e in events
        if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED and e.details["decision"] in ("replace", "shrink")
    ]
    assert len(recoveries) == budget, [e.reason for e in recoveries]
    dead = [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD]
    assert len(dead) == budget + 1, [e.reason for e in dead]
    # Each charged failure carried the script's own error, not only an exit code.
    assert all("TracerArrayConversionError" in e.reason for e in dead), [e.reason for e in dead]
    shown = subprocess.run(
        [sys.executable, "-m", "remesh.cli", "topology", "--coordinator", cluster.address],
        env={**os.environ, **cluster.client_env(), "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "HALTED" in shown.stdout and "TracerArrayConversionError" in shown.stdout, shown.stdout


# Asks once for a fresh process, saying why as the session does (exit 75 with a note); the fresh one
# waits for the agent to stop it.
ASKS_FOR_A_FRESH_PROCESS = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from remesh.v1.contract import Env, ExitNote, RESTART_EXIT_CODE
    once = Path(sys.argv[1])
    if once.exists():
        time.sleep(600)
    once.write_text("asked")
    note = ExitNote("leave-stuck", "leaving epoch 1 waited 2.0s for a checkpoint being saved",
                    "checkpoint less often if it recurs", RESTART_EXIT_CODE)
    with open(os.environ[Env.EXIT_NOTE], "w") as f:
        f.write(note.to_json())
    sys.exit(RESTART_EXIT_CODE)
    """
)


@pytest.mark.integration
def test_a_trainer_that_asks_for_a_fresh_process_says_why_in_the_event_log(
    cluster: Cluster, tmp_path: Path
) -> None:
    """In-process recovery is the normal path; where a trainer cannot take it, the reason reaches the
    job's event log, and its host keeps its rank (nothing is charged, no epoch planned)."""
    script = tmp_path / "trainer.py"
    script.write_text(ASKS_FOR_A_FRESH_PROCESS)
    cluster.start_coordinator("--world-size", "1")
    cluster.start_agent(
        "host-0", trainer=[sys.executable, str(script), str(tmp_path / "once")], extra=("--no-warm-standby",)
    )

    def recorded() -> pb.Event | None:
        return next(
            (
                e
                for e in cluster.events()
                if e.type == pb.EVENT_TYPE_FAULT_REPORTED and "trainer_restarted" in e.reason
            ),
            None,
        )

    event = wait_for(recorded, 60, "the restart to be recorded")
    assert "leave-stuck: leaving epoch 1 waited 2.0s for a checkpoint being saved" in event.reason, event
    events = cluster.events()
    assert not [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD], events
    assert [e.epoch for e in events if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED] == [1]
    assert cluster.members()["host-0"].state == pb.MEMBER_STATE_ALIVE

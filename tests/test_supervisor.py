"""The agent's trainer process, real processes: its own session and priority, bound to the agent's life,
and reached by a signal to the whole host.

A process stands in for the agent: it starts a trainer (``sleep``) through ``TrainerProcess`` exactly
as the agent does, writes the trainer's pid to a file and waits.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from remesh.agent.supervisor import Role, Run, TrainerProcess
from remesh.embedded.cluster import Proc, wait_for

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="sessions, /proc and PR_SET_PDEATHSIG are Linux's"
)

AGENT = """
import asyncio, os, sys
from remesh.agent.supervisor import Role, Run, TrainerProcess

async def main():
    trainer = TrainerProcess(["sleep", "60"], {}, epoch=1, nice=int(sys.argv[1]))
    await trainer.start()
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(str(trainer.pid))
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])  # whole, or not there
    await asyncio.sleep(60)

asyncio.run(main())
"""


def state(pid: int) -> str | None:
    """The process's state letter (R, S, T...), None once it is gone (or a zombie)."""
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None
    return None if letter in ("Z", "X") else letter


def start_agent(tmp_path: Path, nice: int = 10) -> tuple[Proc, int]:
    written = tmp_path / "trainer.pid"
    agent = Proc([sys.executable, "-c", AGENT, str(nice), str(written)], tmp_path / "agent.log")
    pid = wait_for(
        lambda: written.exists() and written.read_text().isdigit() and int(written.read_text()), 30, "the pid"
    )
    assert isinstance(pid, int)
    wait_for(
        lambda: Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep"), 10, "the trainer to exec"
    )
    return agent, pid


def probe(pid: int) -> tuple[int, int, int, str]:
    wait_for(
        lambda: Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep"), 10, "the trainer to exec"
    )
    autogroup = Path(f"/proc/{pid}/autogroup")
    line = autogroup.read_text().strip() if autogroup.exists() else ""
    return pid, os.getsid(pid), os.getpriority(os.PRIO_PROCESS, pid), line


def session_of(nice: int) -> tuple[int, int, int, str]:
    """Start a trainer with ``nice``: (its pid, its session, its niceness, its session's autogroup
    line or ""), then stop it."""

    async def go() -> tuple[int, int, int, str]:
        trainer = TrainerProcess(["sleep", "30"], {}, epoch=1, nice=nice)
        await trainer.start()
        try:
            return probe(trainer.pid)
        finally:
            await trainer.stop(5)
            assert not trainer.running()

    return asyncio.run(go())


def test_the_trainer_runs_in_a_session_of_its_own_with_its_niceness() -> None:
    pid, session, niceness, autogroup = session_of(10)
    # Its own session, so the kernel does not charge the agent's session for its CPU time.
    assert session == pid != os.getsid(0)
    assert niceness == os.getpriority(os.PRIO_PROCESS, 0) + 10
    if autogroup:  # kernels built with autogroup: the session carries the niceness
        assert autogroup.endswith("nice 10"), autogroup


def test_a_trainer_without_niceness_keeps_the_default() -> None:
    pid, session, niceness, autogroup = session_of(0)
    assert session == pid
    assert niceness == os.getpriority(os.PRIO_PROCESS, 0)
    if autogroup:
        assert autogroup.endswith("nice 0"), autogroup


def test_a_killed_agent_leaves_no_trainer_behind(tmp_path: Path) -> None:
    agent, trainer = start_agent(tmp_path)
    try:
        os.kill(agent.pid, signal.SIGKILL)  # the agent alone, not its host: the death signal must do it
        agent.popen.wait(10)
        wait_for(lambda: state(trainer) is None, 10, "the trainer to die with its agent")
    finally:
        agent.close()


def test_a_signal_to_the_host_reaches_the_trainer_in_its_own_session(tmp_path: Path) -> None:
    agent, trainer = start_agent(tmp_path)
    try:
        assert os.getsid(trainer) != os.getsid(agent.pid)
        agent.signal_group(signal.SIGSTOP)
        wait_for(lambda: state(trainer) == "T" and state(agent.pid) == "T", 10, "the host to stop")
        agent.signal_group(signal.SIGCONT)
        wait_for(lambda: state(trainer) == "S" and state(agent.pid) == "S", 10, "the host to go on")
        agent.kill()
        wait_for(lambda: state(trainer) is None, 10, "the trainer to die with its host")
    finally:
        agent.close()


def autogroup_nice(pid: int) -> int | None:
    """The niceness of the session ``pid`` leads, None on kernels without autogroup."""
    autogroup = Path(f"/proc/{pid}/autogroup")
    return int(autogroup.read_text().split()[-1]) if autogroup.exists() else None


def test_a_trainer_waiting_for_a_rank_yields_the_cpu_and_takes_the_trainers_priority_with_one() -> None:
    """A spare's trainer (or a warm standby) starts at the waiting niceness; given a rank its session
    gets the trainer's back (a session's niceness may go down again, a process's may not), and a
    rank taken away sends it back to waiting."""

    async def go() -> list[tuple[int | None, int]]:
        seen: list[tuple[int | None, int]] = []
        trainer = TrainerProcess(["sleep", "30"], {}, epoch=1, nice=10, waiting_nice=19, ranked=False)
        await trainer.start()
        try:
            probe(trainer.pid)  # exec'd: the niceness below is the sleep's own
            seen.append((autogroup_nice(trainer.pid), os.getpriority(os.PRIO_PROCESS, trainer.pid)))
            for ranked in (True, False, True):
                await trainer.hold_rank(ranked)
                seen.append((autogroup_nice(trainer.pid), os.getpriority(os.PRIO_PROCESS, trainer.pid)))
        finally:
            await trainer.stop(5)
        return seen

    own = os.getpriority(os.PRIO_PROCESS, 0)
    seen = asyncio.run(go())
    if seen[0][0] is None:  # no autogroup: the process's own niceness is all there is, and it stays
        assert seen == [(None, own + 10)] * 4
    else:
        assert seen == [(19, own + 10), (10, own + 10), (19, own + 10), (10, own + 10)]


def test_closing_a_stopped_host_kills_its_trainer_too(tmp_path: Path) -> None:
    agent, trainer = start_agent(tmp_path)
    agent.signal_group(signal.SIGSTOP)
    wait_for(lambda: state(trainer) == "T", 10, "the trainer to stop")
    started = time.monotonic()
    agent.close()
    wait_for(lambda: state(trainer) is None, 10, "the stopped trainer to die")
    assert time.monotonic() - started < 10


def test_a_trainer_process_goes_through_its_states_and_a_standby_is_promoted() -> None:
    async def go() -> list[object]:
        seen: list[object] = []
        standby = TrainerProcess(["sleep", "30"], {}, epoch=1, role=Role.STANDBY)
        seen.append(standby.run)
        await standby.start()
        seen += [standby.run, standby.role]
        standby.promote(epoch=3)
        seen += [standby.role, standby.epoch]
        standby.kill_hung()
        seen.append(standby.run)
        result = await standby.wait()
        seen += [standby.run, result.hung, result.stopped, result.epoch]
        stopped = TrainerProcess(["sleep", "30"], {}, epoch=4)
        await stopped.start()
        task = asyncio.create_task(stopped.stop(5))
        await asyncio.sleep(0)
        seen.append(stopped.run)
        await task
        seen += [stopped.run, (await stopped.wait()).stopped]
        return seen

    assert asyncio.run(go()) == [
        Run.NOT_STARTED,
        Run.RUNNING,
        Role.STANDBY,
        Role.ACTIVE,
        3,
        Run.KILLED_HUNG,
        Run.EXITED,
        True,
        False,
        3,
        Run.STOPPING,
        Run.EXITED,
        True,
    ]

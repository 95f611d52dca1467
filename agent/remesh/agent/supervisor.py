"""Runs the trainer command as a child process and watches it.

The trainer is bound to the agent's life with PR_SET_PDEATHSIG, so a killed agent never leaves an
orphaned trainer behind. The death signal is set by util-linux's ``setpriv`` between fork and exec: a
Python ``preexec_fn`` is not safe in a process with gRPC threads (the child can crash before exec).

Where it is so bound (Linux), the trainer also runs in a session of its own, with its niceness given
to that session. Linux shares CPU time between sessions before it looks at niceness (autogroup, on by
default wherever no cgroup hierarchy divides the machine): an agent that shares its trainer's session
is charged for the trainer's CPU time, and on a busy host it then waits for a core however nice the
trainer is. Measured on 2 cores with three trainers starting JAX and checkpointing every step:
healthy agents missed their heartbeats by 0.3 s and more, and one by 0.8 s (past the coordinator's
0.6 s timeout), while the rest of the machine ran on time. In its own session the trainer's priority
orders it against every other session, the agent's included.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

from remesh.agent.core import TrainerExit
from remesh.v1.contract import Env, ExitNote

__all__ = ["Role", "Run", "TrainerProcess", "nice_session", "niced_and_bound"]

log = structlog.get_logger("remesh.agent")


def niced_and_bound(command: Sequence[str], nice: int = 0) -> tuple[list[str], bool]:
    """The command line that runs ``command`` niced and bound to this process's life, and whether
    it is so bound (only then may it leave this process's session: nothing else would stop it)."""
    # ``nice`` execs the command (same pid): every thread the trainer starts inherits the priority.
    niced = shutil.which("nice") if nice else None
    command = [niced, "-n", str(nice), *command] if niced else list(command)
    setpriv = shutil.which("setpriv")
    if sys.platform == "linux" and setpriv:
        return [setpriv, "--pdeathsig", "KILL", "--", *command], True
    return command, False


def nice_session(pid: int, nice: int) -> bool:
    """Give the session led by ``pid`` the niceness ``nice`` where the kernel groups CPU time by
    session (sched(7), "The autogroup feature"); a no-op where it does not. False when the kernel
    refused it for now (it rate-limits these writes, machine-wide: EAGAIN)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except BlockingIOError:
        return False
    except OSError:
        pass  # no autogroup here, or the process is gone
    return True


class Role(enum.Enum):
    """What a trainer process is for. The agent keeps at most one of each."""

    # Holds (or is being given) the host's rank in the current epoch.
    ACTIVE = "active"
    # The warm standby: JAX imported, told rank -1, waiting on the local API; promoted (becomes
    # ACTIVE) when the active one exits for a new epoch.
    STANDBY = "standby"


class Run(enum.Enum):
    """Where a trainer process is in its life."""

    NOT_STARTED = "not started"
    RUNNING = "running"
    # The agent asked it to stop (SIGTERM, SIGKILL after the grace): its exit is no fault.
    STOPPING = "stopping"
    # The agent killed it for making no step progress: its exit is reported as a hang.
    KILLED_HUNG = "killed (hung)"
    EXITED = "exited"


class TrainerProcess:
    """One run of the trainer for one epoch."""

    def __init__(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        epoch: int,
        nice: int = 0,
        role: Role = Role.ACTIVE,
        waiting_nice: int | None = None,
        ranked: bool = True,
    ) -> None:
        self.command = list(command)
        self.role = role
        # Niceness added to the trainer's: on a saturated CPU the agent's heartbeats go first.
        self.nice = nice
        # Its session's niceness while it holds no rank (a spare's trainer, a warm standby): see
        # AgentSettings.standby_nice. None: always ``nice``.
        self.waiting_nice = nice if waiting_nice is None else waiting_nice
        # Whether it holds a rank (given at start: a spare's trainer and a standby are told -1).
        self.ranked = ranked
        self._bound = False
        self.env = dict(env)
        # The epoch it was started for, then the newest it reported running (see Agent._trainer_runs).
        self.epoch = epoch
        # REMESH_TRAINER_SLOT: tells the active process from the warm standby on the local API.
        self.slot = 0
        self.process: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self._stopping = False
        self.hung = False
        # The exit note it left, once read (a 1-tuple: read, and perhaps None).
        self._note: tuple[ExitNote | None] | None = None

    async def start(self) -> None:
        self.started_at = time.monotonic()
        command, bound = niced_and_bound(self.command, self.nice)
        self.process = await asyncio.create_subprocess_exec(
            *command, env={**os.environ, **self.env}, start_new_session=bound
        )
        self._bound = bound
        session_nice = self.nice if self.ranked else self.waiting_nice
        if bound and session_nice:
            await self._nice_session(session_nice)
        log.info(
            "trainer started",
            pid=self.process.pid,
            epoch=self.epoch,
            session_nice=session_nice if bound else None,
            command=" ".join(self.command),
        )

    async def hold_rank(self, ranked: bool) -> None:
        """The process holds a rank now (or no longer): its session gets the trainer's niceness (or
        the waiting one). Retried briefly where the kernel rate-limits the change: a trainer given a
        rank must not join its epoch at a waiting priority."""
        if ranked == self.ranked:
            return
        self.ranked = ranked
        if not self._bound or self.nice == self.waiting_nice or not self.running():
            return
        nice = self.nice if ranked else self.waiting_nice
        if await self._nice_session(nice):
            log.info("trainer session niceness", pid=self.pid, ranked=ranked, nice=nice)

    async def _nice_session(self, nice: int) -> bool:
        """``nice_session``, sent again for up to a second while the kernel refuses it: without
        privileges it takes one such change a tenth of a second, machine-wide, and agents starting
        trainers together on one machine meet that limit."""
        for _ in range(50):
            if nice_session(self.pid, nice):
                return True
            await asyncio.sleep(0.02)
        log.warning("the kernel kept refusing the trainer session's niceness", pid=self.pid, nice=nice)
        return False

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0

    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def run(self) -> Run:
        if self.process is None:
            return Run.NOT_STARTED
        if self.process.returncode is not None:
            return Run.EXITED
        if self.hung:
            return Run.KILLED_HUNG
        return Run.STOPPING if self._stopping else Run.RUNNING

    def promote(self, epoch: int) -> None:
        """The standby takes the active role for ``epoch``; its hang clock starts now."""
        self.role = Role.ACTIVE
        self.epoch = epoch
        self.started_at = time.monotonic()

    async def wait(self) -> TrainerExit:
        assert self.process is not None
        code = await self.process.wait()
        if self._note is None:
            self._note = (self._take_note(),)
        return TrainerExit(self.epoch, code, self._stopping, self.hung, note=self._note[0])

    def _take_note(self) -> ExitNote | None:
        """The exit note the process left (``Env.EXIT_NOTE``), read once and deleted: None where it left
        none (it exited otherwise, or JAX ended it) or one that is not whole (it died writing it)."""
        path = self.env.get(Env.EXIT_NOTE)
        if not path:
            return None
        try:
            text = Path(path).read_text()
        except OSError:
            return None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        try:
            return ExitNote.from_json(text)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("the trainer's exit note is not whole; ignored", pid=self.pid, error=str(exc))
            return None

    async def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if not self.running():
            return
        assert self.process is not None
        self._stopping = True
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()

    def cpu_ticks(self) -> int | None:
        """CPU time the trainer used so far (user + system, in clock ticks); None when unknown."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))

    def kill_hung(self) -> None:
        if self.running():
            assert self.process is not None
            self.hung = True
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

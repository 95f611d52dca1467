"""Runs the trainer command as a child process and watches it.

The trainer shares the agent's process group (a signal to the host reaches both) and is bound to the
agent's life with PR_SET_PDEATHSIG, so a killed agent never leaves an orphaned trainer behind. The
death signal is set by util-linux's ``setpriv`` between fork and exec: a Python ``preexec_fn`` is not
safe in a process with gRPC threads (the child can crash before exec).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

__all__ = [
    "ADDRESS_IN_USE_EXIT_CODE",
    "RESTART_EXIT_CODE",
    "STATE_LOST_EXIT_CODE",
    "TrainerExit",
    "TrainerProcess",
]

log = structlog.get_logger("remesh.agent")

# A trainer that cannot recover in-process (say, its JAX runtime is beyond repair) exits with this
# code (EX_TEMPFAIL) to ask its agent for an immediate restart on the current topology.
RESTART_EXIT_CODE = 75
# The trainer of rank 0 found the epoch's JAX coordination port taken by another process (errno
# EADDRINUSE): the agent reports it, and the coordinator moves the same members to a new port.
ADDRESS_IN_USE_EXIT_CODE = 98
# The trainer found no tier holding its epoch's restore step (EX_DATAERR): reported, never retried.
STATE_LOST_EXIT_CODE = 65


@dataclass(frozen=True)
class TrainerExit:
    epoch: int
    returncode: int
    # True when the agent stopped it on purpose (not a fault).
    stopped: bool
    hung: bool = False


def _bound_to_parent(command: Sequence[str], nice: int = 0) -> list[str]:
    # ``nice`` execs the command (same pid): every thread the trainer starts inherits the priority.
    niced = shutil.which("nice") if nice else None
    command = [niced, "-n", str(nice), *command] if niced else list(command)
    setpriv = shutil.which("setpriv")
    if sys.platform == "linux" and setpriv:
        return [setpriv, "--pdeathsig", "KILL", "--", *command]
    return command


class TrainerProcess:
    """One run of the trainer for one epoch."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], epoch: int, nice: int = 0) -> None:
        self.command = list(command)
        # Niceness added to the trainer's: on a saturated CPU the agent's heartbeats go first.
        self.nice = nice
        self.env = dict(env)
        # The epoch it was started for, then the newest it reported running (see Agent._trainer_runs).
        self.epoch = epoch
        # REMESH_TRAINER_SLOT: tells the active process from the warm standby on the local API.
        self.slot = 0
        self.process: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self._stopping = False
        self.hung = False

    async def start(self) -> None:
        self.started_at = time.monotonic()
        self.process = await asyncio.create_subprocess_exec(
            *_bound_to_parent(self.command, self.nice), env={**os.environ, **self.env}
        )
        log.info("trainer started", pid=self.process.pid, epoch=self.epoch, command=" ".join(self.command))

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0

    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def wait(self) -> TrainerExit:
        assert self.process is not None
        code = await self.process.wait()
        return TrainerExit(self.epoch, code, self._stopping, self.hung)

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

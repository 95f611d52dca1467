"""What every process started by remesh.embedded needs: a free port, a tie to its parent, a clean stop."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys

__all__ = ["bound_to_parent", "free_port", "stop_on_sigterm", "stop_process"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bound_to_parent(command: list[str]) -> list[str]:
    """``command`` run so that it is killed when the process that started it dies (Linux's
    PR_SET_PDEATHSIG through util-linux's setpriv): a launcher killed with SIGKILL leaves nothing
    behind. Elsewhere the command is returned as it is."""
    setpriv = shutil.which("setpriv")
    if sys.platform == "linux" and setpriv:
        return [setpriv, "--pdeathsig", "KILL", "--", *command]
    return command


def stop_on_sigterm() -> None:
    """SIGTERM (from ``timeout``, a scheduler, ``kill``) stops this program the way Ctrl-C does: a
    KeyboardInterrupt in the main thread, so that every ``with`` and ``finally`` that stops a process
    it started runs, instead of the program dying at once and leaving them behind."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def stop_process(proc: subprocess.Popen[bytes] | None, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL once ``grace_s`` has passed."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

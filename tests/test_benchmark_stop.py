"""A benchmark stopped by SIGTERM (``timeout``, a scheduler) stops every process it started: its
coordinator, its Redis and its simulated agents, none of them left running to load the machine
under the next measurement."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat from the state on (state, ppid, ...), or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def _descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root``: pid -> its start time (a reused pid starts later)."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
            started[int(entry)] = fields[19]
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = started[child]
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int, started: str) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z" and fields[19] == started


@pytest.mark.timeout(180)
def test_scale_stopped_by_sigterm_leaves_none_of_its_processes_behind(tmp_path: Path) -> None:
    log = (tmp_path / "scale.log").open("wb")
    bench = subprocess.Popen(
        [sys.executable, "benchmarks/scale.py", "--hosts", "100", "--crashes", "1", "--silent", "0"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        # Its simulated agents run (their processes are the last it starts before it measures).
        wait_for(
            lambda: any("fleet.py" in _cmdline(p) for p in _descendants(bench.pid)),
            120,
            "the benchmark's simulated agents",
        )
        started = _descendants(bench.pid)
        commands = [_cmdline(p) for p in started]
        assert any("redis-server" in c for c in commands), commands
        assert any("remesh.cli coordinator" in c for c in commands), commands
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) != 0
        wait_for(
            lambda: not [p for p, t in started.items() if _alive(p, t)],
            30,
            "every process the benchmark started to stop",
        )
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
        log.close()

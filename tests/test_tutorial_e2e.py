"""The tutorial's second half, as its page says it: the commands of docs/tutorial.md's shell blocks
(the coordinator, two hosts and a spare running the tutorial's script, the operator commands), run as
written but for the coordinator's port (a free one, where the page leaves the default), one host
killed as the page kills it, and what the page then shows: the spare takes the rank, the surviving
trainer goes on in the same process, the job finishes and every agent exits 0."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from remesh.embedded._process import free_port
from tests.procs import Proc, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"


def shell_commands(text: str) -> list[str]:
    """Every command of the page's ``sh`` blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line:
                commands.append(line)
    return commands


def argv(command: str) -> tuple[list[str], str | None]:
    """A page's command as a process: ``remesh``/``python`` from this environment, the repository's
    files by their full path, and the file its output goes to (``> FILE 2>&1``), if any; the
    trailing ``&`` dropped."""
    words = shlex.split(command.rstrip("&").strip())
    out = None
    if ">" in words:
        at = words.index(">")
        out, words = words[at + 1], words[:at]
    words = [w for w in words if w != "2>&1"]
    words = [sys.executable, "-m", "remesh.cli", *words[1:]] if words[0] == "remesh" else words
    # The page's paths are the repository's: the processes run wherever the suite does.
    words = [str(ROOT / w) if w.endswith(".py") and (ROOT / w).exists() else w for w in words]
    return [sys.executable if w == "python" else w for w in words], out


def test_the_tutorials_job_of_two_hosts_and_a_spare_recovers_as_the_page_says(tmp_path: Path) -> None:
    commands = shell_commands(TUTORIAL.read_text())
    started = [c for c in commands if c.startswith(("remesh coordinator", "remesh agent"))]
    assert [c.split()[1] for c in started] == ["coordinator", "agent", "agent", "agent"], started
    port = free_port()
    env = {**os.environ, "REMESH_COORDINATOR": f"127.0.0.1:{port}"}
    env.pop("REMESH_AGENT_ADDRESS", None)
    procs: dict[str, Proc] = {}
    try:
        for command in started:
            args, out = argv(command)
            if args[3] == "coordinator":
                args += ["--listen", f"127.0.0.1:{port}"]
                name = "coordinator"
            else:
                name = args[args.index("--host-id") + 1]
            assert out is None or out == f"{name}.log", command
            procs[name] = Proc(args, tmp_path / f"{name}.log", env=env)

        def run(command: str) -> subprocess.CompletedProcess[str]:
            args, _ = argv(command)
            return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)

        def operator(command: str) -> str:
            done = run(command)
            assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
            return done.stdout

        def events() -> str:
            """The page's `remesh events`; nothing while the coordinator is still starting."""
            done = run("remesh events --insecure")
            return done.stdout if done.returncode == 0 else ""

        wait_for(lambda: re.search(r"epoch_live .* epoch 1 ", events()), 180, "epoch 1 live")
        for command in ("remesh top --insecure --once", "remesh topology --insecure"):
            assert command in commands
            assert "tutorial" in operator(command) or "host-0" in operator(command)
        wait_for(lambda: "step 20:" in procs["host-0"].output(), 120, "host-0 to train")
        assert "kill -9 $HOST1" in commands
        procs["host-1"].signal_group(signal.SIGKILL)  # the agent and, bound to it, its trainer

        def finished() -> str | None:
            log = events()
            return log if "job_finished" in log else None

        log = wait_for(finished, 180, "the job to finish")
        assert re.search(r"topology_changed .* hot spare spare-0 takes rank 1 of host-1", log), log
        assert re.search(r"epoch_live .* epoch 2 ", log), log
        for host in ("host-0", "spare-0"):
            wait_for(lambda h=host: not procs[h].alive(), 60, f"{host}'s agent to exit")
            assert procs[host].popen.returncode == 0, procs[host].output()[-3000:]
        host0 = procs["host-0"].output()
        # The same trainer process went on through both epochs: its warm standby was never promoted,
        # and the one trainer that exited did so after the job finished.
        assert "warm standby trainer promoted" not in host0 and "trainer restarted" not in host0, host0[
            -3000:
        ]
        exits = re.findall(r"trainer exit needs nothing .*reason='([^']*)'", host0)
        assert exits == ["it exited after finishing the job"], host0[-3000:]
        assert "epoch 1: rank 0 of 2" in host0 and "epoch 2: rank 0 of 2" in host0, host0[-3000:]
        assert "finished at step 400" in host0
        assert re.search(
            r"epoch 2: rank 1 of 2, \d+ devices, from step \d+ \(peer\)", procs["spare-0"].output()
        )
        assert "goodput" in operator("remesh goodput --insecure")
    finally:
        for proc in procs.values():
            proc.close()

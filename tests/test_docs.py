"""The documentation: the site builds strictly, the tutorial's script runs, the README's commands exist.

- ``mkdocs build --strict`` (what ``make docs`` and ``make lint`` run) succeeds, and the generated
  reference holds what it is generated for: the API page ``Session.epochs``'s docstring (mkdocstrings
  found the code), the CLI page a flag of ``remesh coordinator`` (the hook ran the parser).
- The script the tutorial includes (``--8<--`` in docs/tutorial.md: the page shows exactly this file)
  runs alone, with the page's arguments and no agent, to its last step, printing the lines the page
  shows.
- Every ``make ...`` and ``remesh ...`` command the README (and every page) shows in a shell block
  names a target the Makefile has, or a subcommand and flags the ``remesh`` parser has: a renamed
  flag or target fails here, not in a reader's shell; and the README's links name files that exist.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from remesh.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"
# The flags of `remesh` itself, before the subcommand.
GLOBAL_FLAGS_WITH_VALUE = {"--log-level"}


def test_the_site_builds_strictly_with_the_generated_references(tmp_path: Path) -> None:
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,  # the snippets' base path is the repository's root
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=100,  # within pytest-timeout's 120 s
    )
    assert built.returncode == 0, built.stderr[-5000:]
    api = (site / "reference" / "api" / "index.html").read_text()
    assert 'id="remesh.elastic.Session.epochs"' in api
    assert "in your own loop" in api  # Session.epochs's docstring, not only its name
    assert 'id="remesh.elastic.Policy"' in api and 'id="remesh.elastic.Epoch.steps"' in api
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "--max-repeated-crashes" in cli and 'id="remesh-coordinator"' in cli
    assert all(f'id="remesh-{name}"' in cli for name in subcommands(build_parser()))
    tutorial = (site / "tutorial" / "index.html").read_text()
    assert "global_batch_size" in tutorial  # the script itself, included


def tutorial_script() -> Path:
    """The file docs/tutorial.md includes (pymdownx.snippets' block form)."""
    included = re.findall(r"^--8<--\n(.+?)\n--8<--$", TUTORIAL.read_text(), flags=re.MULTILINE)
    assert len(included) == 1, included
    return ROOT / included[0].strip()


def alone_on_the_page() -> tuple[list[str], list[str]]:
    """The tutorial's first run (the script's arguments, from the page's command) and the lines the
    page says it prints."""
    page = TUTORIAL.read_text()
    section = page[page.index("## Run it alone") :]
    command = re.search(r"^python examples/tutorial/train\.py (.*)$", section, flags=re.MULTILINE)
    printed = re.search(r"^```text\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    assert command is not None and printed is not None
    return shlex.split(command.group(1)), printed.group(1).splitlines()


def masked(line: str) -> str:
    """A printed line with its loss left out: the page shows one run's values."""
    return re.sub(r"loss \d+\.\d+", "loss X", line)


@pytest.mark.integration
def test_the_tutorials_script_runs_alone_as_the_page_shows(tmp_path: Path) -> None:
    script = tutorial_script()
    assert script == ROOT / "examples" / "tutorial" / "train.py"
    args, printed = alone_on_the_page()
    # Alone: no agent (no REMESH_* at all), CPU, and XLA's flags left to the session, which gives
    # each process devices_per_host virtual devices. A job id of its own: a job run alone refuses a
    # second run of the same id on the host at the same time.
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMESH_") and k != "XLA_FLAGS"}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        REMESH_JOB=f"tutorial-test-{os.getpid()}",
        REMESH_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"),
    )
    ran = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    out = ran.stdout + ran.stderr
    assert ran.returncode == 0, out[-5000:]
    assert "running alone" in out, out[-3000:]  # the session's log line
    # Between the log's lines (each opens with its time), exactly the lines the page shows, losses aside.
    shown = [masked(x) for x in ran.stdout.splitlines() if x and not re.match(r"\d{4}-\d\d-\d\d[ T]", x)]
    assert shown == [masked(x) for x in printed], out[-3000:]


def shown_commands(page: Path) -> list[str]:
    """The commands of a page's shell blocks (```sh, ```bash: not the output samples) that start with
    ``make`` or ``remesh``, each on one line (continuations joined)."""
    commands = []
    for block in re.findall(
        r"^```(?:sh|bash|shell)\n(.*?)^```$", page.read_text(), flags=re.MULTILINE | re.DOTALL
    ):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith(("make ", "remesh ")):
                commands.append(line)
    return commands


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("remesh has no subcommands")


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, flags=re.MULTILINE))


def check_remesh(words: list[str], parser: argparse.ArgumentParser) -> None:
    words = words[1:]
    while words and words[0].startswith("-"):  # remesh's own flags: --log-json, --log-level LEVEL
        flag = words.pop(0)
        assert flag in parser._option_string_actions, f"remesh has no flag {flag}"
        if flag in GLOBAL_FLAGS_WITH_VALUE:
            words.pop(0)
    assert words, "no subcommand"
    commands = subcommands(parser)
    assert words[0] in commands, f"remesh has no subcommand {words[0]!r} (it has {sorted(commands)})"
    sub = commands[words[0]]
    for word in words[1:]:
        if word == "--":  # the trainer command of `remesh agent` follows
            break
        flag = word.strip("[]").split("=")[0]
        if flag.startswith("--"):
            assert flag in sub._option_string_actions, f"remesh {words[0]} has no flag {flag}"


def check_command(command: str, parser: argparse.ArgumentParser, targets: set[str]) -> None:
    words = shlex.split(command, comments=True)
    if words[0] == "make":
        for target in words[1:]:
            if not target.startswith("-") and "=" not in target:
                assert target in targets, f"{command!r}: the Makefile has no target {target!r}"
    else:
        check_remesh(words, parser)


def test_every_command_the_readme_shows_exists() -> None:
    commands = shown_commands(ROOT / "README.md")
    assert any(c.startswith("make demo") for c in commands) and any(
        c.startswith("make test") for c in commands
    )
    assert any(c.startswith("remesh ") for c in commands), commands
    parser, targets = build_parser(), makefile_targets()
    for command in commands:
        check_command(command, parser, targets)


def test_every_command_the_pages_show_exists() -> None:
    """The same check over the site's pages (their shell blocks only: output samples are not run)."""
    parser, targets = build_parser(), makefile_targets()
    checked = 0
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for command in shown_commands(page):
            try:
                check_command(command, parser, targets)
            except AssertionError as exc:
                raise AssertionError(f"{page.relative_to(ROOT)}: {command}: {exc}") from None
            checked += 1
    assert checked >= 20, checked


def test_the_readmes_links_into_the_repository_resolve() -> None:
    """The README is read on its own (on the forge, in the wheel's metadata), outside the site's
    strict build: its links to files of the repository must name files that exist."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10, local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


@pytest.mark.parametrize(
    ("command", "wrong"),
    [
        ("remesh coordinater --job x", "no subcommand"),
        ("remesh coordinator --max-repeated-crash 2", "no flag"),
        ("remesh --log-jsn top", "no flag"),
    ],
)
def test_the_command_check_catches_a_wrong_command(command: str, wrong: str) -> None:
    with pytest.raises(AssertionError, match=wrong):
        check_remesh(shlex.split(command), build_parser())

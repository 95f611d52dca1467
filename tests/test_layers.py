"""What import-linter (``make lint``) cannot see: the benchmarks and the examples are scripts, not
packages, and must use remesh's public modules and names only, like any user's code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/**/*.py")])


def private_imports(source: str) -> list[str]:
    """``remesh`` modules or names starting with an underscore that ``source`` imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules, names = [node.module], [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            if module.split(".")[0] != "remesh":
                continue
            private = [p for p in module.split(".") if p.startswith("_")]
            private += [n for n in names if n.startswith("_")]
            found += [f"{module}: {p}" for p in private]
    return found


def test_the_check_finds_a_private_import() -> None:
    assert private_imports("from remesh.cli._ops import event_dict") == ["remesh.cli._ops: _ops"]
    assert private_imports("from remesh.elastic.session import _join") == ["remesh.elastic.session: _join"]
    assert private_imports("import remesh.views\nfrom jax import _src") == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_use_public_modules_only(script: Path) -> None:
    assert private_imports(script.read_text()) == []

"""MkDocs hook: the command-line reference (docs/reference/cli.md), written at build time.

The page holds one marker line; this hook replaces it with ``remesh --help`` and the ``--help`` of
every subcommand, taken from the parser the ``remesh`` command itself builds
(``remesh.cli.build_parser``). So the reference never drifts from the flags, and a subcommand added
to the parser appears without anyone copying its help.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MARKER = "<!-- remesh-cli-reference -->"
# argparse wraps help text to the terminal's width ($COLUMNS); a fixed one makes the page the same
# wherever it is built.
WIDTH = 100


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_reference())


def cli_reference() -> str:
    """``remesh --help``, then a section per subcommand with its ``--help``, as Markdown."""
    from remesh.cli import build_parser

    parser = build_parser()
    with _columns(WIDTH):
        sections = ["## remesh\n\n" + _fenced(parser.format_help())]
        for name, sub in subcommands(parser):
            sections.append(f"## remesh {name}\n\n" + _fenced(sub.format_help()))
    return "\n\n".join(sections) + "\n"


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Each subcommand's name and parser, in the order ``remesh --help`` lists them."""
    # argparse offers no public way to walk its subparsers: the action that holds them is found
    # among the parser's actions.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def _fenced(text: str) -> str:
    return "```text\n" + text.rstrip() + "\n```"


@contextmanager
def _columns(width: int) -> Iterator[None]:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before

"""``remesh agent`` (placeholder, being written)."""

from __future__ import annotations

from typing import Any


def add_parser(sub: Any) -> None:
    return None

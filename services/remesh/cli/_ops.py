"""Operator commands: members, topology, events, replay, drain (placeholder, being written)."""

from __future__ import annotations

from typing import Any


def add_parsers(sub: Any) -> None:
    return None

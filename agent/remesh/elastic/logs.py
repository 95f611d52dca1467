"""Logging for a training script under remesh: JSON lines when its agent logs JSON.

A trainer runs as the agent's child and writes to the same stream (a pod's log): when the agent was
started with ``--log-json`` it tells its trainers so (``REMESH_LOG_FORMAT=json``), and a script
that calls ``configure_logging()`` logs JSON lines too, instead of mixing console lines into a log
its shipper parses as JSON.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

import structlog

from remesh.v1.contract import Env

__all__ = ["configure_logging"]


def configure_logging(level: str = "info", env: Mapping[str, str] | None = None) -> None:
    """structlog for this process: JSON lines if the agent says so (``REMESH_LOG_FORMAT``), else
    plain console lines; to stderr, ``level`` and above."""
    env = os.environ if env is None else env
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if env.get(Env.LOG_FORMAT) == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )

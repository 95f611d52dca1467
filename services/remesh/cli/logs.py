"""structlog set-up for every remesh command: readable lines on a terminal, JSON on request."""

from __future__ import annotations

import atexit
import logging
import queue
import sys
import threading
from typing import TextIO, cast

import structlog

__all__ = ["configure_logging"]


class _Background:
    """A file for structlog that never blocks its caller: lines go to a queue, a thread writes them.

    The agent's heartbeats run on the same event loop as its logging, and a write to a log file can
    wait on the disk (appending changes the inode, which waits for a journal commit another process's
    fsync started: checkpoints are written beside the logs): two agents once stalled 0.4 and 0.7 s
    together that way and one was declared dead. What is queued is written at exit."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="remesh-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def write(self, text: str) -> None:
        self._lines.put(text)

    def flush(self) -> None:
        pass  # the thread flushes after every line

    def close(self) -> None:
        self._lines.put(None)
        self._thread.join(timeout=2.0)

    def _drain(self) -> None:
        while (text := self._lines.get()) is not None:
            try:
                self._out.write(text)
                self._out.flush()
            except (OSError, ValueError):  # the stream is gone (closed pipe): nothing to tell
                pass


def configure_logging(*, json: bool = False, level: str = "info", background: bool = False) -> None:
    """``background``: log lines are written by a thread, so a slow disk never blocks the caller
    (for the agent, whose heartbeats share its event loop)."""
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*processors, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(
            file=cast(TextIO, _Background(sys.stderr)) if background else sys.stderr
        ),
        cache_logger_on_first_use=True,
    )

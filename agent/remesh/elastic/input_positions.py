"""Every host's input position at the steps whose state is kept, shared among an epoch's members.

With ``IteratorData`` each host's iterator keeps its own position, which only that host knows. At a
step whose state is kept (a snapshot, a checkpoint, the last step), each member posts its
iterator's state, taken after exactly that many batches, to the epoch's coordination service (one
small value, on the loop's thread); the snapshot of that step and rank 0's checkpoint commit gather
every member's in the background (``gather``) and keep them with the state (``DataPosition``). So any
member that holds a step also holds every host's position at it, and a restore that brings the step
back from members that survived, or from a checkpoint, brings the positions back with it, a lost
host's included.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import structlog

from remesh.elastic.data import DataPosition
from remesh.elastic.errors import ElasticError
from remesh.elastic.runtime import Runtime

__all__ = ["InputPositions"]

log = structlog.get_logger("remesh.elastic")

# Posts a member keeps in the coordination service before it takes the oldest back: far more than
# gathers can lag (a snapshot's or a checkpoint's gather is the first thing its thread does), and
# rank 0's process keeps every one of every member.
_POSTS_KEPT = 16
# A gather looks at what the members posted this often while some are missing.
_POLL_S = 0.005


class InputPositions:
    """Posts this member's input position and gathers everyone's, through ``runtime`` (the current
    epoch's), waiting up to ``timeout_s`` for the members that have not posted yet."""

    def __init__(self, runtime: Runtime, timeout_s: float) -> None:
        self.runtime = runtime
        self.timeout_s = timeout_s
        self._posted: collections.deque[int] = collections.deque()

    def begin(self) -> None:
        """An epoch begins: its coordination service holds none of this member's posts."""
        self._posted.clear()

    def post(self, step: int, state: str) -> None:
        """This member's iterator state after ``step`` steps (JSON text), for every member to gather."""
        self.runtime.post_text(_name(step), state)
        self._posted.append(step)
        while len(self._posted) > _POSTS_KEPT:
            self.runtime.withdraw_text(_name(self._posted.popleft()))

    def gather(self, step: int, stop: Callable[[], bool] = lambda: False) -> DataPosition | None:
        """Every member's state after ``step`` steps, once all posted; what was posted when ``stop()``
        holds or ``timeout_s`` passed (not ``whole``: a restore of this step then cannot carry every
        host's position, and takes an earlier one); None once the epoch is left."""
        deadline = time.monotonic() + self.timeout_s
        assignment = self.runtime.assignment
        if assignment is None:
            return None
        states: dict[int, str] = {}
        while True:
            try:
                states = self.runtime.posted_texts(_name(step))
            except (ElasticError, AssertionError):  # the epoch's runtime failed or is gone
                break
            if len(states) >= assignment.world_size or stop() or time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        position = DataPosition(assignment.world_size, states)
        if not position.whole:
            log.warning(
                "input positions of a step not gathered from every member: the step cannot be "
                "restored with them",
                step=step,
                missing=sorted(set(range(assignment.world_size)) - set(states)),
            )
        return position


def _name(step: int) -> str:
    return f"input-{step}"

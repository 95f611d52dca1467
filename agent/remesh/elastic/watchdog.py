"""The trainer's watchdog: blocking work that outlives its epoch ends the process.

The training loop records the blocking work it is in (``Watchdog.blocking``: a step, joining an
epoch, leaving one, finishing the job) and clears it when done. A thread judges that record:

- a **step** blocked ``stall_after_s`` is reported once (the agent tells the coordinator: when every
  other member is blocked like this and one is not, that one stopped taking part and is replaced,
  before the collective times out);
- blocking work still running its **grace** after a newer epoch was announced waits for a dead peer
  (a step in a collective, a join for a member that never comes): the process ends for the agent's
  warm standby to take over at once, with the reason named (``exits.Why``). Where collectives end by
  themselves (CPU: a collective with a dead peer fails after the collective timeout) a step's grace
  outlasts that, so the step fails and the process recovers in place; where they never do (GPU,
  TPU), a step ends the process at once when the new epoch left out a member of its own: it waits
  for a process that is gone.

``Watchdog.judge`` is that judgement, pure (the clock and what the agent said are its arguments);
the thread only reads the record, calls it, and acts. It sleeps until the nearest moment anything
can be due, or until the agent's assignment changes: a few wake-ups a second beside a healthy step.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from remesh.elastic.agent_client import AgentLink, Assignment
from remesh.elastic.exits import Why

__all__ = ["Blocked", "Verdict", "Watchdog", "What"]

# What blocks: a step, or joining, leaving or finishing an epoch.
What = Literal["step", "joining", "leaving", "finishing"]


@dataclass(frozen=True)
class Blocked:
    """Blocking work of ``epoch`` running since ``since`` (monotonic), with ``grace`` seconds after a
    newer epoch is announced."""

    epoch: int
    since: float
    grace: float
    what: What


# Why blocking work that outlived its grace ends the process, by what it was.
_STUCK: dict[What, Why] = {
    "step": Why.STEP_STUCK,
    "joining": Why.JOIN_STUCK,
    "leaving": Why.LEAVE_STUCK,
    "finishing": Why.FINISH_STUCK,
}


@dataclass(frozen=True)
class Verdict:
    """What the watchdog does now: report a stall (blocked this long), end the process (for this
    reason, ``why`` its code), and when to look again at the latest (seconds from now)."""

    stall_s: float | None = None
    exit: str | None = None
    wait_s: float = 0.0
    why: Why | None = None


class Watchdog:
    """The record of blocking work, the thresholds it is judged by, and the thread that judges it.

    ``step_grace_s`` is the grace of a step and of leaving an epoch (a step of it may still be
    running), ``join_grace_s`` that of joining and finishing; None: never ends the process for it.
    ``collectives_end``: a collective waiting for a dead peer fails by itself on this platform (CPU),
    so a step is given its grace even when the new epoch left out a member of its epoch.
    ``steps_done()`` is what a stall report names; ``on_stuck(why, reason)`` ends the process."""

    def __init__(
        self,
        agent: AgentLink,
        *,
        stall_after_s: float,
        step_grace_s: float | None,
        join_grace_s: float | None,
        steps_done: Callable[[], int],
        on_stuck: Callable[[Why, str], object],
        collectives_end: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent = agent
        self.collectives_end = collectives_end
        self.stall_after_s = stall_after_s
        self.graces: dict[What, float | None] = {
            "step": step_grace_s,
            "leaving": step_grace_s,
            "joining": join_grace_s,
            "finishing": join_grace_s,
        }
        self.steps_done = steps_done
        self.on_stuck = on_stuck
        self.clock = clock
        # Nothing blocked: work that begins now is due no sooner than this.
        graces = [g for g in (step_grace_s, join_grace_s) if g is not None]
        self.idle_wait_s = min([stall_after_s, *graces])
        self.blocked: Blocked | None = None
        # (epoch, since) of the blocked step reported last: a step is reported once.
        self.reported: tuple[int, float] | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None

    # ---- the record, kept by the training loop ----------------------------------------------------

    def blocking(self, epoch: int, what: What, since: float | None = None) -> None:
        """Blocking work of ``epoch`` begins (``since``: when it began; now by default)."""
        grace = self.graces[what]
        self.blocked = (
            None if grace is None else Blocked(epoch, self.clock() if since is None else since, grace, what)
        )

    def clear(self) -> None:
        """The blocking work is done."""
        self.blocked = None

    # ---- the judgement ------------------------------------------------------------------------------

    def judge(self, now: float, latest_epoch: int, changed_at: float, lost_a_member: bool) -> Verdict:
        """What to do about the work blocked now, the newest epoch being ``latest_epoch`` (announced at
        ``changed_at``; ``lost_a_member``: it left out a member of the blocked work's epoch)."""
        blocked = self.blocked
        if blocked is None:
            return Verdict(wait_s=self.idle_wait_s)
        due: list[float] = []
        stall_s = None
        if blocked.what == "step" and self.reported != (blocked.epoch, blocked.since):
            if now - blocked.since >= self.stall_after_s:
                self.reported = (blocked.epoch, blocked.since)
                stall_s = now - blocked.since
            else:
                due.append(blocked.since + self.stall_after_s)
        if latest_epoch > blocked.epoch:
            stuck = now - max(blocked.since, changed_at)
            if blocked.what == "step" and lost_a_member and not self.collectives_end:
                # The step needs a process the new epoch left out, and nothing ends a collective
                # on this platform: the grace would only be waited out.
                return Verdict(
                    stall_s,
                    f"{blocked.what} of epoch {blocked.epoch} still blocked when epoch {latest_epoch} left "
                    "out a member of it: it waits in a collective for a process that is gone",
                    why=Why.COLLECTIVE_CANNOT_END,
                )
            if stuck >= blocked.grace:
                return Verdict(
                    stall_s,
                    f"{blocked.what} of epoch {blocked.epoch} still blocked {stuck:.2f}s after epoch "
                    f"{latest_epoch} was announced: it waits for a dead peer",
                    why=_STUCK[blocked.what],
                )
            due.append(now + blocked.grace - stuck)
        # Blocking work that ends and begins again is due later than what is due now.
        return Verdict(stall_s, None, min([self.idle_wait_s, *(d - now for d in due)]))

    # ---- the thread ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="remesh-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The thread ends at its next wake-up (the agent link's close wakes it)."""
        self._stopped = True

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _watch(self) -> None:
        agent = self.agent
        while not self._stopped:
            seen = agent.latest
            blocked = self.blocked
            lost = (
                blocked is not None
                and blocked.what == "step"
                and not self.collectives_end
                and seen.epoch > blocked.epoch
                and agent.lost_a_member(blocked.epoch, seen)
            )
            verdict = self.judge(self.clock(), seen.epoch, agent.changed_at, lost)
            if verdict.stall_s is not None and blocked is not None:
                # In the background: the agent may retry through a leader change, and this thread
                # must stay free to notice a new epoch.
                threading.Thread(
                    target=agent.report_stall,
                    args=(blocked.epoch, self.steps_done(), verdict.stall_s),
                    name="remesh-stall",
                    daemon=True,
                ).start()
            if verdict.exit is not None:
                assert verdict.why is not None
                self.on_stuck(verdict.why, verdict.exit)
                return
            # A new assignment wakes it; so does ``stop`` with the agent link's close.
            agent.wait_until(functools.partial(self._moved_on, seen), max(verdict.wait_s, 0.005))

    def _moved_on(self, seen: Assignment, latest: Assignment) -> bool:
        """Whether there is something new to look at: a new assignment, or the watchdog stopped."""
        return latest is not seen or self._stopped

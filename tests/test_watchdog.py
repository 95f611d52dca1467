"""The trainer's watchdog, on its own: it sleeps until something can be due (no polling beside a
healthy step), reports a step blocked too long once, and ends the process when blocking work
outlives a new epoch by its grace, never sooner. Its judgement is pure (``Watchdog.judge``, a clock
passed in: tested with a fake one); the thread around it runs here against a stand-in agent; the
end-to-end tests run it inside real trainers. Also: the wait for the epoch after a failure."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from remesh.elastic import Policy
from remesh.elastic.agent_client import lost_a_member
from remesh.elastic.exits import Why
from remesh.elastic.session import wait_after
from remesh.elastic.watchdog import Verdict, Watchdog


class Agent:
    """The part of AgentClient the watchdog uses: the latest assignment and a wait for a change."""

    def __init__(self, hosts: tuple[str, ...] = ()) -> None:
        self._latest = SimpleNamespace(epoch=1, hosts=hosts)
        self._hosts = {1: hosts}
        self.changed_at = time.monotonic()
        self._changed = threading.Condition()
        self.stalls: list[tuple[int, int, float]] = []
        self.waits = 0

    @property
    def latest(self) -> Any:
        return self._latest

    def lost_a_member(self, epoch: int, newer: Any) -> bool:
        return lost_a_member(self._hosts.get(epoch, ()), newer.hosts)

    def publish(self, epoch: int, hosts: tuple[str, ...] = ()) -> float:
        with self._changed:
            self._latest = SimpleNamespace(epoch=epoch, hosts=hosts)
            self._hosts[epoch] = hosts
            self.changed_at = time.monotonic()
            self._changed.notify_all()
            return self.changed_at

    def wait_until(self, predicate: Callable[[Any], bool], timeout: float) -> Any:
        with self._changed:
            self.waits += 1
            self._changed.wait_for(lambda: predicate(self._latest), timeout)
            return self._latest

    def report_stall(self, epoch: int, step: int, blocked_s: float) -> None:
        self.stalls.append((epoch, step, blocked_s))


class Stuck:
    """What the watchdog does with a process it ends: recorded here (the real one never returns)."""

    def __init__(self) -> None:
        self.restarts: queue.Queue[tuple[float, str]] = queue.Queue()
        self.whys: list[Why] = []

    def __call__(self, why: Why, reason: str) -> None:
        self.whys.append(why)
        self.restarts.put((time.monotonic(), reason))


def watchdog_of(
    policy: Policy, agent: Any, stuck: Any = None, clock: Any = time.monotonic, platform: str = "tpu"
) -> Watchdog:
    """A watchdog as the session makes it from ``policy`` on ``platform`` (an accelerator unless
    said: collectives that never end by themselves): step 7 is the last one completed."""
    return Watchdog(
        agent,
        stall_after_s=policy.stall_report_after_s,
        step_grace_s=policy.step_exit_after_s(platform),
        join_grace_s=policy.stuck_join_exit_s,
        steps_done=lambda: 7,
        on_stuck=stuck or Stuck(),
        collectives_end=platform == "cpu",
        clock=clock,
    )


class Loop:
    """A training loop's side of a running watchdog: its agent, its record, its restarts."""

    def __init__(self, policy: Policy, hosts: tuple[str, ...] = ()) -> None:
        self.agent = Agent(hosts)
        self.stuck = Stuck()
        self.restarts = self.stuck.restarts
        self.watchdog = watchdog_of(policy, self.agent, self.stuck)


def watched(policy: Policy, hosts: tuple[str, ...] = ()) -> Loop:
    loop = Loop(policy, hosts)
    loop.watchdog.start()
    return loop


def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_blocked_step_is_reported_once_and_a_new_epoch_ends_it_after_its_grace() -> None:
    loop = watched(Policy(stall_report_s=0.3, stuck_step_exit_s=0.4))
    began = time.monotonic()
    loop.watchdog.blocking(1, "step", began)

    until(lambda: bool(loop.agent.stalls))
    time.sleep(0.5)  # the same blocked step is not reported twice
    assert len(loop.agent.stalls) == 1
    epoch, step, blocked_s = loop.agent.stalls[0]
    assert (epoch, step) == (1, 7) and blocked_s >= 0.3
    assert loop.restarts.empty()  # no newer epoch: a slow step is not a dead peer

    announced = loop.agent.publish(2)
    at, reason = loop.restarts.get(timeout=10)
    assert at - announced >= 0.4  # never before the grace has passed
    assert "epoch 2 was announced" in reason and "step of epoch 1" in reason


def test_nothing_blocked_means_no_restart_and_a_few_wakeups() -> None:
    loop = watched(Policy(stall_report_s=1.0, stuck_step_exit_s=0.5, stuck_join_exit_s=2.0))
    time.sleep(0.3)
    loop.agent.publish(2)  # nothing is blocked: the loop will see the epoch at its next step
    time.sleep(1.2)
    assert loop.restarts.empty() and not loop.agent.stalls
    # It slept until something could be due (0.5 s at the soonest), not every few milliseconds.
    assert loop.agent.waits <= 6


def test_work_that_began_after_the_announcement_gets_its_whole_grace() -> None:
    loop = watched(Policy(stall_report_s=5.0, stuck_step_exit_s=0.3, stuck_join_exit_s=0.6))
    loop.agent.publish(2)
    time.sleep(0.4)
    began = time.monotonic()
    loop.watchdog.blocking(1, "joining", began)  # a join of the old epoch, waiting for a member
    at, reason = loop.restarts.get(timeout=10)
    assert at - began >= 0.6
    assert reason.startswith("joining of epoch 1")


def test_a_step_blocked_when_the_new_epoch_leaves_out_a_member_ends_at_once() -> None:
    """Every step is one program over all of its epoch's processes: once a member is gone from the
    new epoch, the grace would only be waited out. An epoch that only adds members keeps it."""
    hosts = ("host-0", "host-1", "host-2")
    grace = 5.0
    loop = watched(Policy(stall_report_s=10.0, stuck_step_exit_s=grace), hosts)
    loop.watchdog.blocking(1, "step")
    announced = loop.agent.publish(2, ("host-0", "spare-0", "host-2"))  # host-1 replaced
    at, reason = loop.restarts.get(timeout=grace / 2)
    assert at - announced < grace
    assert "left out a member" in reason and "step of epoch 1" in reason
    assert loop.stuck.whys == [Why.COLLECTIVE_CANNOT_END]

    grown = watched(Policy(stall_report_s=10.0, stuck_step_exit_s=0.4), hosts)
    grown.watchdog.blocking(1, "step")
    announced = grown.agent.publish(2, (*hosts, "host-3"))  # a host joins: the step can end
    at, reason = grown.restarts.get(timeout=10)
    assert at - announced >= 0.4 and "epoch 2 was announced" in reason


def test_a_closed_sessions_watchdog_ends_when_woken() -> None:
    """``Session.close`` marks the session closed and closes the agent client, which wakes whoever
    waits for an assignment: the watchdog ends then, not a threshold later."""
    loop = watched(Policy(stall_report_s=30.0, stuck_step_exit_s=30.0, stuck_join_exit_s=30.0))
    time.sleep(0.2)
    assert loop.watchdog.alive
    loop.watchdog.stop()
    loop.agent.publish(1)  # a wake-up, as the client's close gives (the same epoch: nothing to judge)
    loop.watchdog.join(timeout=5)
    assert not loop.watchdog.alive and loop.restarts.empty()


def test_a_member_left_out_is_told_only_from_known_members() -> None:
    assert lost_a_member(("a", "b", "c"), ("a", "c"))
    assert lost_a_member(("a", "b"), ("a", "spare"))
    assert not lost_a_member(("a", "b"), ("b", "a", "c"))
    assert not lost_a_member((), ("a",))  # this process never heard the epoch's members
    assert not lost_a_member(("a", "b"), ())


class Announcer:
    """An agent whose new epoch comes on the ``comes_on``-th wait; it records every wait's timeout and
    every failure report."""

    def __init__(self, comes_on: int) -> None:
        self.comes_on = comes_on
        self.timeouts: list[float] = []
        self.reports: list[tuple[int, int]] = []

    def wait_newer(self, epoch: int, timeout: float) -> Any:
        self.timeouts.append(timeout)
        if len(self.timeouts) >= self.comes_on:
            return SimpleNamespace(epoch=epoch + 1)
        time.sleep(timeout)
        return None

    def report_collective_failure(self, epoch: int, step: int, detail: str) -> None:
        self.reports.append((epoch, step))


def test_a_failed_collective_is_said_again_while_no_epoch_comes(monkeypatch: Any) -> None:
    """A coordinator keeps the reports in memory: one that took over meanwhile must hear them again.
    Said after every COLLECTIVE_REPORT_AGAIN_S of waiting, and no more once the epoch came."""
    import remesh.elastic.session as session_module
    from remesh.elastic.errors import PeerFailure, TopologyChanged

    monkeypatch.setattr(session_module, "COLLECTIVE_REPORT_AGAIN_S", 0.1)
    agent = Announcer(comes_on=4)
    newer = wait_after(agent, 3, PeerFailure("Gloo all-reduce timed out"), 30.0, lambda: 14)  # type: ignore[arg-type]
    assert newer is not None and newer.epoch == 4
    assert agent.timeouts == [0.1] * 4
    until(lambda: len(agent.reports) >= 3)  # sent from threads of their own
    time.sleep(0.2)
    assert agent.reports == [(3, 14)] * 3  # after each of the three waits that ended with nothing

    # Nothing to say after a new topology; a wait that runs out ends with None, within its bound.
    quiet = Announcer(comes_on=1000)
    assert wait_after(quiet, 3, TopologyChanged(3, 4), 0.25, lambda: 14) is None  # type: ignore[arg-type]
    assert quiet.reports == [] and len(quiet.timeouts) >= 2
    assert max(quiet.timeouts) <= 0.1 and sum(quiet.timeouts) <= 0.25 + 1e-9


# ---- the judgement alone, on a fake clock ------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_judge_reports_a_blocked_step_once_and_sleeps_until_the_report_is_due() -> None:
    clock = Clock()
    dog = watchdog_of(
        Policy(stall_report_s=1.0, stuck_step_exit_s=0.5, stuck_join_exit_s=2.0), Agent(), clock=clock
    )
    # Nothing blocked: it sleeps for the soonest any threshold could come due.
    assert dog.judge(clock.now, 1, 0.0, False) == Verdict(wait_s=0.5)
    dog.blocking(1, "step")
    assert dog.judge(clock.now + 0.25, 1, 0.0, False) == Verdict(wait_s=0.5)
    assert dog.judge(clock.now + 0.75, 1, 0.0, False).wait_s == 0.25  # the report comes due first
    assert dog.judge(clock.now + 1.5, 1, 0.0, False) == Verdict(stall_s=1.5, wait_s=0.5)
    assert dog.judge(clock.now + 3.0, 1, 0.0, False) == Verdict(wait_s=0.5)  # said once
    # The same step blocked again later is a new one: reported again.
    clock.now += 10
    dog.blocking(1, "step")
    assert dog.judge(clock.now + 1.0, 1, 0.0, False).stall_s == 1.0
    # Joining is not a step blocked on its peers: never reported as a stall.
    dog.blocking(1, "joining")
    assert dog.judge(clock.now + 60, 1, 0.0, False) == Verdict(wait_s=0.5)


def test_judge_ends_the_process_only_after_the_grace_counted_from_the_later_of_work_and_announcement() -> (
    None
):
    clock = Clock()
    dog = watchdog_of(
        Policy(stall_report_s=9.0, stuck_step_exit_s=0.5, stuck_join_exit_s=2.0), Agent(), clock=clock
    )
    dog.blocking(1, "leaving")  # leaving an epoch has a step's grace
    announced = clock.now + 1.0
    assert dog.judge(announced + 0.4, 2, announced, False) == Verdict(wait_s=pytest.approx(0.1))
    verdict = dog.judge(announced + 0.5, 2, announced, False)
    assert verdict.exit is not None and verdict.exit.startswith(
        "leaving of epoch 1 still blocked 0.50s after epoch 2"
    )
    # Work that began after the announcement gets its whole grace.
    dog.blocking(1, "finishing", since=announced + 5.0)  # finishing has a join's grace
    assert dog.judge(announced + 6.9, 2, announced, False).exit is None
    assert dog.judge(announced + 7.0, 2, announced, False).exit is not None
    # An epoch no newer than the work's is never a reason to end it.
    assert dog.judge(announced + 60.0, 1, announced, False).exit is None


def test_judge_ends_a_step_at_once_when_the_new_epoch_left_out_a_member_and_never_for_no_grace() -> None:
    clock = Clock()
    dog = watchdog_of(
        Policy(stall_report_s=9.0, stuck_step_exit_s=5.0, stuck_join_exit_s=None), Agent(), clock=clock
    )
    dog.blocking(1, "step")
    verdict = dog.judge(clock.now + 0.01, 2, clock.now, True)
    assert verdict.exit is not None and "left out a member" in verdict.exit
    # Joining waits for the members that come, not for the one left out; and without a join grace
    # a join is never watched at all.
    dog.blocking(1, "joining")
    assert dog.blocked is None
    assert dog.judge(clock.now + 100, 2, clock.now, True) == Verdict(wait_s=5.0)


def test_the_thread_acts_on_the_verdict_and_stops_once_it_ended_the_process() -> None:
    """The thread reports the stall to the agent (step 7, the last one completed), ends the process
    once, and then looks no more."""
    loop = watched(Policy(stall_report_s=0.05, stuck_step_exit_s=0.1))
    loop.watchdog.blocking(1, "step")
    until(lambda: bool(loop.agent.stalls))
    assert loop.agent.stalls[0][:2] == (1, 7)
    loop.agent.publish(2)
    loop.restarts.get(timeout=10)
    waits = loop.agent.waits
    time.sleep(0.3)
    assert loop.agent.waits == waits and loop.restarts.empty()


def test_judge_gives_a_step_its_grace_where_collectives_end_by_themselves() -> None:
    """On CPU a collective waiting for a dead peer fails after the collective timeout: a step of an
    epoch that lost a member gets its grace (by default that timeout and a second), to fail and
    recover in the same process; only past it does the process end, naming the step stuck."""
    clock = Clock()
    policy = Policy(stall_report_s=9.0, collective_timeout_s=2.0, stuck_join_exit_s=2.0)
    assert policy.step_exit_after_s("cpu") == 3.0 and policy.step_exit_after_s("tpu") == 0.2
    dog = watchdog_of(policy, Agent(), clock=clock, platform="cpu")
    dog.blocking(1, "step")
    announced = clock.now + 0.5
    assert dog.judge(announced + 2.9, 2, announced, True).exit is None
    verdict = dog.judge(announced + 3.0, 2, announced, True)
    assert (
        verdict.why is Why.STEP_STUCK and verdict.exit is not None and "waits for a dead peer" in verdict.exit
    )
    # Each kind of blocking work that outlives its grace names itself.
    for what, why in (
        ("joining", Why.JOIN_STUCK),
        ("leaving", Why.LEAVE_STUCK),
        ("finishing", Why.FINISH_STUCK),
    ):
        dog.blocking(1, what, since=announced)
        assert dog.judge(announced + 10.0, 2, announced, False).why is why

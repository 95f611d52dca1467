"""A machine that stops for seconds (on the accelerator machine, every process stalled 6-7 s while
another one opened the TPU chip) re-forms nothing: the agent does not blame its own pause on the
coordinator, as the coordinator does not blame its own on the members.

The pure ``Pauses`` record first; then a real coordinator and real agents with stand-in trainers,
all stopped at once with SIGSTOP for longer than the agent's 2 s silence timeout and resumed."""

from __future__ import annotations

import os
import signal
import time

import pytest

from remesh.agent.pauses import Pauses
from remesh.embedded.cluster import descendants
from remesh.v1 import coordinator_pb2 as pb
from tests.procs import Cluster, assert_no_events, wait_for

# A stop longer than the agent's coordinator_silence_s (2 s) and its lease (5 s).
STOPPED_S = 6.0


def test_a_late_tick_is_a_pause_and_counts_after_its_start_only() -> None:
    pauses = Pauses(tick_s=0.1, slack_s=0.25)
    start = pauses._last
    pauses.tick(start + 0.1)  # on time
    pauses.tick(start + 0.5)  # 0.3 s late: past the slack
    assert pauses.since(start, start + 0.5) == pytest.approx(0.3)
    assert pauses.since(start + 0.5, start + 0.6) == 0.0, "a pause before the window is not in it"


def test_a_busy_loop_within_the_slack_is_no_pause() -> None:
    pauses = Pauses(tick_s=0.1, slack_s=0.25)
    start = pauses._last
    for i in range(1, 20):
        pauses.tick(start + i * 0.3)  # each tick 0.2 s late
    assert pauses.since(start, start + 6.0) == 0.0


def test_a_pause_under_way_counts_before_the_ticker_runs_again() -> None:
    pauses = Pauses(tick_s=0.1, slack_s=0.25)
    start = pauses._last
    # The process resumed at start + 6.5 and no tick has run yet: a timer that fires first sees it.
    assert pauses.since(start, start + 6.5) == pytest.approx(6.4)


@pytest.mark.integration
def test_a_whole_machine_stopped_past_every_timeout_re_forms_nothing(cluster: Cluster) -> None:
    cluster.start_coordinator("--world-size", "2")
    agents = [cluster.start_agent(h) for h in ("host-0", "host-1")]
    cluster.wait_epoch(1)
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")
    before = cluster.events()
    everything = [p.pid for p in cluster.procs if p.alive()]
    everything += [pid for p in agents for pid in descendants(p.pid)]
    for pid in everything:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(STOPPED_S)
    for pid in everything:
        os.kill(pid, signal.SIGCONT)

    def nobody_judged() -> None:
        assert cluster.topology().epoch == 1
        assert all(m.state == pb.MEMBER_STATE_ALIVE for m in cluster.members().values())

    # Well past the agent's silence timeout and the coordinator's heartbeat timeout after resuming.
    events = assert_no_events(cluster, 5.0, nobody_judged)
    assert events == before
    assert all(a.alive() for a in agents)
    # No agent took its own pause for the coordinator's silence. Whether an agent had to look (its
    # silence timer fired before the keepalive waiting on its socket was read, and it logged "the
    # agent itself was paused") is the scheduler's call on resuming: one fresh-clone suite run had
    # neither agent look, so that line is no condition of this test.
    logs = {a.log_path.name: a.log_path.read_text() for a in agents}
    assert not [name for name, log in logs.items() if "sent nothing for" in log], logs

"""Reliability promises end to end, with real coordinator, agent and trainer processes:

- a burst of failures (hosts SIGKILLed 50 ms apart, three at once) is one recovery, one epoch;
- a trainer's checkpoint commit goes through the agent to the coordinator, which refuses a stale
  epoch; a host of rank 0 paused (SIGSTOP) through an epoch change never commits for its old epoch,
  at pauses of 2, 3 and 4 heartbeat timeouts;
- a member that joined an epoch that is doomed (one of its members died after it was planned)
  moves on to the next epoch in the same process;
- a job that reaches its last step ends with no member declared dead, no epoch after it, and every
  agent exiting 0.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from remesh.coordinator.model import ClusterState, Event, EventType, apply
from remesh.embedded import RedisServer
from remesh.embedded.cluster import descendants
from remesh.v1 import coordinator_pb2 as pb
from tests.procs import Cluster, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
HEARTBEAT_TIMEOUT_S = 0.6  # the coordinator's local preset


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer(appendonly=False) as server:
        yield server


@pytest.fixture
def cluster(tmp_path: Path, redis: RedisServer) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis.url, f"rel-{uuid.uuid4().hex[:8]}")
    try:
        yield c
    finally:
        c.close()


def events_of(cluster: Cluster, type_: int) -> list[pb.Event]:
    return [e for e in cluster.events() if e.type == type_]


def live_epoch(cluster: Cluster) -> int:
    return max((e.epoch for e in events_of(cluster, pb.EVENT_TYPE_EPOCH_LIVE)), default=0)


def wait_live(cluster: Cluster, after: int, timeout: float = 120) -> int:
    return int(
        wait_for(
            lambda: live_epoch(cluster) > after and live_epoch(cluster), timeout, f"epoch > {after} live"
        )
    )


# ---- one recovery per burst (stand-in trainers: the control plane alone) ---------------------------


@pytest.mark.parametrize(
    ("victims", "apart_s", "hosts"),
    [
        # Two lost, one spare: shrink to three, survivors first in their old order.
        (("host-1", "host-2"), 0.05, ("host-0", "host-3", "spare-0")),
        (("host-1", "host-2", "host-3"), 0.0, ("host-0", "spare-0")),
    ],
    ids=["two 50 ms apart", "three at once"],
)
def test_a_burst_of_failures_is_one_epoch(
    cluster: Cluster, victims: tuple[str, ...], apart_s: float, hosts: tuple[str, ...]
) -> None:
    cluster.start_coordinator("--world-size", "4")
    for i in range(4):
        cluster.start_agent(f"host-{i}")
    cluster.start_agent("spare-0", spare=True)
    wait_live(cluster, 0)
    before = cluster.topology().epoch
    for victim in victims:
        cluster.agents[victim].signal_group(signal.SIGKILL)
        time.sleep(apart_s)
    epoch = wait_live(cluster, before)
    # Past the planner's hold and every detector verdict: nothing more comes of this burst.
    time.sleep(1.0)
    published = [e for e in events_of(cluster, pb.EVENT_TYPE_TOPOLOGY_CHANGED) if e.epoch > before]
    assert [e.epoch for e in published] == [before + 1] == [epoch], [e.reason for e in published]
    assert tuple(m.host_id for m in published[0].topology.members) == hosts
    assert {e.host_id for e in events_of(cluster, pb.EVENT_TYPE_MEMBER_DEAD)} == set(victims)


# ---- a trainer without a rank waits at a low priority ----------------------------------------------


def trainer_sessions(agent_pid: int) -> dict[int, int]:
    """The stand-in trainers below an agent, each with its session's niceness (autogroup)."""
    found = {}
    for pid in descendants(agent_pid):
        with contextlib.suppress(OSError):
            if b"remesh.embedded.standin" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found[pid] = int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    return found


@pytest.mark.skipif(
    not Path("/proc/self/autogroup").exists(), reason="the kernel groups no CPU time by session"
)
def test_trainers_without_a_rank_wait_at_the_standby_priority_and_a_rank_gives_them_the_trainers(
    cluster: Cluster,
) -> None:
    """The spare's trainer and each member's warm standby import and wait at niceness 19, so they
    take only the CPU the working trainers leave; the spare's trainer, given a rank by a recovery,
    works at the trainers' 10, in the same process."""
    cluster.start_coordinator("--world-size", "2")
    hosts = [cluster.start_agent(f"host-{i}") for i in range(2)]
    spare = cluster.start_agent("spare-0", spare=True)
    wait_live(cluster, 0)
    # Its one trainer at 19 (waited for: read between its exec and the agent's write, it is at 0).
    wait_for(lambda: list(trainer_sessions(spare.pid).values()) == [19], 30, "the spare's trainer at 19")
    [spare_trainer] = trainer_sessions(spare.pid)
    for host in hosts:  # the active trainer, and beside it (started once it acknowledged) its standby
        wait_for(lambda h=host: sorted(trainer_sessions(h.pid).values()) == [10, 19], 30, "active + standby")
    before = cluster.topology().epoch
    hosts[1].signal_group(signal.SIGKILL)
    wait_live(cluster, before)
    assert "spare-0" in {m.host_id for m in cluster.topology().members}
    wait_for(lambda: trainer_sessions(spare.pid).get(spare_trainer) == 10, 10, "the spare's trainer at 10")


# ---- the arbiter of commits ------------------------------------------------------------------------

COMMITTER = """
import json, os, sys
from remesh.elastic.agent_client import AgentClient
from remesh.elastic.checkpoints import LocalCheckpoints, StaleEpoch
from remesh.elastic.errors import EpochSuperseded
import numpy as np

agent = AgentClient.from_env()
first = agent.wait_until(lambda a: a.rank >= 0, 60)
epoch = first.epoch
store = LocalCheckpoints(sys.argv[1])
state = {"w": np.arange(4.0)}
outcome = {}

def approve(step, ep, tier):
    try:
        agent.commit(ep, step, tier)
    except EpochSuperseded as exc:
        raise StaleEpoch(str(exc)) from exc

store.save(5, epoch, state, approve=approve)
outcome["current"] = "committed"
# Another directory, so the storage fence (raised to this epoch above) cannot answer first.
stale_store = LocalCheckpoints(sys.argv[1] + "-stale")
try:
    stale_store.save(6, epoch - 1, state, approve=approve)
    outcome["stale"] = "committed"
except StaleEpoch as exc:
    outcome["stale"] = str(exc)
outcome["epoch"] = epoch
outcome["viable"] = stale_store.latest_viable()
outcome["trusted"] = store.latest_viable(trusted={(6, epoch - 1)})
outcome["current_viable"] = store.latest_viable(trusted={(5, epoch)})
# Whole or not at all: the test reads the file as soon as it exists.
open(sys.argv[2] + ".tmp", "w").write(json.dumps(outcome))
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
agent.wait_newer(epoch, 3600)
"""


def test_a_commit_goes_through_the_coordinator_which_refuses_a_stale_epoch(cluster: Cluster) -> None:
    """The whole chain in real processes: the checkpoint tier asks the agent's local API, the agent
    asks the coordinator, the coordinator records the accepted commit and refuses the stale one, and
    no marker is written for it."""
    ckpt, out = cluster.tmp / "ckpt", cluster.tmp / "outcome.json"
    cluster.start_coordinator("--world-size", "1")
    cluster.start_agent("host-0", trainer=[sys.executable, "-c", COMMITTER, str(ckpt), str(out)], env=ENV)
    wait_for(out.exists, 90, "the committer's outcome")
    outcome = json.loads(out.read_text())
    assert outcome["current"] == "committed"
    assert "refused by the coordinator" in outcome["stale"] and "stale epoch 0" in outcome["stale"]
    stale = Path(f"{ckpt}-stale")
    assert outcome["viable"] is None  # step 6's files were written, its marker never was
    assert (stale / "step_0000000006" / "state").is_dir()
    assert not (stale / "step_0000000006" / "COMMITTED").exists()
    assert outcome["trusted"] is None  # a reader that trusts only (6, 0) restores nothing of step 5
    assert outcome["current_viable"] == 5
    committed = events_of(cluster, pb.EVENT_TYPE_CHECKPOINT_COMMITTED)
    assert [(e.host_id, e.epoch, dict(e.details)) for e in committed] == [
        ("host-0", outcome["epoch"], {"step": "5", "tier": "local"})
    ]
    coordinator_log = cluster.coordinator.output() if cluster.coordinator else ""
    assert "checkpoint commit refused" in coordinator_log


# ---- the elastic trainer: stale writers, doomed epochs, a clean end --------------------------------


def tinylm(steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "examples.tinylm.train_elastic",
        "--steps", str(steps), "--d-model", "32", "--layers", "1", "--seq-len", "32",
        "--log-every", "10", *extra,
    ]  # fmt: skip


def start_job(cluster: Cluster, command: list[str], hosts: int = 3, spares: int = 1) -> None:
    cluster.start_coordinator("--world-size", str(hosts))
    for i in range(hosts):
        cluster.start_agent(f"host-{i}", trainer=command, env=ENV)
    for i in range(spares):
        cluster.start_agent(f"spare-{i}", spare=True, trainer=command, env=ENV)


def assert_finished_cleanly(cluster: Cluster, timeout: float = 180) -> list[pb.Event]:
    """The job reached its last step: JOB_FINISHED, nothing judged or published after it, and every
    agent still running exits 0 on its own."""
    running = {h: p for h, p in cluster.agents.items() if p.alive()}
    wait_for(lambda: not any(p.alive() for p in running.values()), timeout, "every agent to exit")
    assert {h: p.popen.returncode for h, p in running.items()} == dict.fromkeys(running, 0)
    events = cluster.events()
    finished = [i for i, e in enumerate(events) if e.type == pb.EVENT_TYPE_JOB_FINISHED]
    assert len(finished) == 1, cluster.log_tails()
    after = [
        e
        for e in events[finished[0] :]
        if e.type in (pb.EVENT_TYPE_MEMBER_DEAD, pb.EVENT_TYPE_TOPOLOGY_CHANGED)
    ]
    assert after == []
    return events


def assert_no_stale_commit(events: list[pb.Event], checkpoint_dir: Path) -> int:
    """Every commit marker on storage was accepted by the coordinator, for the epoch that was current
    when it accepted it. Returns how many markers there are."""
    from remesh.coordinator.convert import event_from_pb

    state = ClusterState()
    accepted: set[tuple[int, int]] = set()
    for msg in events:
        event: Event = event_from_pb(msg)
        if event.type is EventType.CHECKPOINT_COMMITTED:
            assert event.epoch == state.epoch, (
                f"commit of epoch {event.epoch} accepted in epoch {state.epoch}"
            )
            accepted.add((int(event.details["step"]), event.epoch))
        state = apply(state, event)
    markers = sorted(checkpoint_dir.glob("step_*/COMMITTED"))
    for marker in markers:
        body = json.loads(marker.read_text())
        assert (body["step"], body["epoch"]) in accepted, f"{marker} was never accepted by the coordinator"
    return len(markers)


@pytest.mark.timeout(420)
def test_a_paused_rank_0_never_commits_for_its_old_epoch(cluster: Cluster) -> None:
    """SIGSTOP the host of rank 0 for 2, 3 and 4 heartbeat timeouts while it checkpoints every step;
    each time it is declared dead and replaced, and whatever its old trainer does after SIGCONT, no
    marker it writes counts unless the coordinator accepted it for the epoch that was current."""
    ckpt = cluster.tmp / "ckpt"
    # Every pause comes as soon as the epoch before is live: all three land before step ~15 (step 7
    # in a run on this machine), and the steps after the last one only end the job.
    start_job(
        cluster,
        tinylm(60, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--step-sleep", "0.05"),
    )
    epoch = wait_live(cluster, 0)
    paused = []
    for factor in (2, 3, 4):
        rank0 = cluster.topology().members[0].host_id
        host = cluster.agents[rank0]
        wait_for(lambda: len(list(ckpt.glob("step_*/COMMITTED"))) > 2, 60, "checkpoints being written")
        host.signal_group(signal.SIGSTOP)
        time.sleep(factor * HEARTBEAT_TIMEOUT_S)
        host.signal_group(signal.SIGCONT)
        paused.append(rank0)
        epoch = wait_live(cluster, epoch)
    events = assert_finished_cleanly(cluster)
    dead = [e.host_id for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD]
    assert dead == paused  # only the paused hosts, once each: no healthy host declared dead
    assert assert_no_stale_commit(events, ckpt) > 0


@pytest.mark.timeout(420)
def test_a_member_that_joined_a_doomed_epoch_moves_on_in_process(cluster: Cluster) -> None:
    """host-1 dies; the spare takes its rank in epoch 2; host-2 dies right after epoch 2 was planned.
    The members waiting for it move to epoch 3 in the same process: no trainer restarts (exit 75),
    epoch 2 never goes live, and the job still ends cleanly."""
    start_job(cluster, tinylm(60, "--step-sleep", "0.05"))
    wait_live(cluster, 0)
    wait_for(lambda: cluster.members()["host-1"].last_step >= 20, 120, "step 20")
    cluster.agents["host-1"].signal_group(signal.SIGKILL)
    cluster.wait_epoch(2)
    cluster.agents["host-2"].signal_group(signal.SIGKILL)
    epoch = wait_live(cluster, 1)
    assert epoch == 3
    events = assert_finished_cleanly(cluster)
    assert not [e for e in events if e.type == pb.EVENT_TYPE_EPOCH_LIVE and e.epoch == 2]
    for host in ("host-0", "spare-0"):
        log = cluster.agents[host].output()
        # (A trainer of epoch 1 may leave with 75 when host-1's death stalls its step: not this.)
        assert "code=75 epoch=2 " not in log, f"{host} restarted a trainer of epoch 2:\n{log[-3000:]}"
        assert "every member came" in log


def trainer_pid(agent_log: str) -> int:
    """The pid of the first trainer an agent started (the one running epoch 1)."""
    import re

    match = re.search(r"trainer started\s+.*?pid=(\d+)", agent_log)
    assert match, agent_log[-2000:]
    return int(match.group(1))


@pytest.mark.timeout(420)
def test_a_frozen_trainer_is_replaced_and_no_healthy_host_is_blamed(cluster: Cluster) -> None:
    """SIGSTOP host-1's trainer only (its agent goes on heartbeating): its peers block in the next
    collective and report it; host-1 reports nothing and is declared dead before the peers'
    collectives time out, and the peers' own aborts are not charged to their hosts."""
    import os

    start_job(cluster, tinylm(60, "--step-sleep", "0.05"))
    wait_live(cluster, 0)
    wait_for(lambda: cluster.members()["host-1"].last_step >= 15, 120, "step 15")
    frozen = trainer_pid(cluster.agents["host-1"].output())
    os.kill(frozen, signal.SIGSTOP)
    try:
        epoch = wait_live(cluster, 1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)
    events = assert_finished_cleanly(cluster)
    dead = [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD]
    assert [e.host_id for e in dead] == ["host-1"], [e.reason for e in dead]
    assert "stopped taking part" in dead[0].reason
    assert epoch == 2


@pytest.mark.timeout(420)
def test_a_collective_that_fails_between_healthy_hosts_reforms_the_same_hosts_in_process(
    cluster: Cluster,
) -> None:
    """host-1's trainer fails the collective after step 15 on its own, as a network failure between
    healthy hosts would (REMESH_FAULT_COLLECTIVE_AT_STEP); its peers block in theirs (and report the
    stall) until it times out. host-1 says its collective failed, then so do they, nobody is lost,
    and the same hosts form epoch 2 within seconds: no host declared dead (host-1 idles waiting, but
    said why, so the stall reports do not blame it), the spare left a spare, the steps restored from
    host memory, and the job ends cleanly. Without the re-form every member would wait out its 30 s
    for an epoch nobody plans, then restart into the old one."""
    command = tinylm(60, "--step-sleep", "0.05")
    cluster.start_coordinator("--world-size", "3")
    for i in range(3):
        env = {**ENV, "REMESH_FAULT_COLLECTIVE_AT_STEP": "15"} if i == 1 else ENV
        cluster.start_agent(f"host-{i}", trainer=command, env=env)
    cluster.start_agent("spare-0", spare=True, trainer=command, env=ENV)
    wait_live(cluster, 0)
    assert wait_live(cluster, 1) == 2
    events = assert_finished_cleanly(cluster)
    assert not [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD]
    changed = [e for e in events if e.type == pb.EVENT_TYPE_TOPOLOGY_CHANGED]
    assert [e.epoch for e in changed] == [1, 2]
    assert [m.host_id for m in changed[1].topology.members] == ["host-0", "host-1", "host-2"]
    assert changed[1].details["decision"] == "reform", changed[1].reason
    # Every member said so (the peers after their 2 s collective timeout), or host-1 did and nobody
    # was lost in the 3 s window: the first on this machine; either is right.
    assert "said a collective of epoch 1 failed" in changed[1].reason
    acks = [e for e in events if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 2]
    assert sorted(e.host_id for e in acks) == ["host-0", "host-1", "host-2"]
    # From host memory: each host its own snapshot (in the process, or from /dev/shm in the warm
    # standby that took over where JAX aborted a trainer on its way out of the epoch), or a peer's
    # where its own of the step was still being copied when it left the epoch (dropped, not waited for).
    assert {e.details["restore_source"] for e in acks} <= {"memory", "host-shm", "peer"}, [
        (e.host_id, e.details["restore_source"]) for e in acks
    ]
    live = next(e for e in events if e.type == pb.EVENT_TYPE_EPOCH_LIVE and e.epoch == 2)
    print(f"epoch 2 published -> live: {live.time - changed[1].time:.2f}s")
    print(f"epoch 2: {changed[1].reason}")
    assert "trainer's collective failed" in cluster.agents["host-1"].output()

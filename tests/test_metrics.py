"""/metrics of every component, scraped from real processes: a coordinator, agents and their stand-in
trainers (which send running totals as the trainer library does). Every endpoint must parse as the
Prometheus text format (prometheus_client's own parser), carry the host and job labels, and move
when the job does: steps add up, a SIGKILLed trainer is counted by cause, and the counters run on
across the restart."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from remesh.agent.metrics import TOTALS
from remesh.embedded.standin import STEP_S
from remesh.v1 import coordinator_pb2 as pb
from tests.procs import Cluster, Proc, wait_for

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample on the endpoint; a line that is not valid exposition format fails the parse."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def metrics_port(proc: Proc) -> int:
    match = re.search(r"metrics_port=(\d+)", proc.output())
    assert match, proc.output()[-2000:]
    return int(match.group(1))


def first_trainer_pid(agent: Proc) -> int:
    match = re.search(r"trainer started\s+.*?pid=(\d+)", agent.output())
    assert match, agent.output()[-2000:]
    return int(match.group(1))


DASHBOARD = Path(__file__).resolve().parent.parent / "deploy/k8s/components/dashboards/remesh-job.json"


def queries(node: Any) -> Iterator[str]:
    """Every PromQL expression of a Grafana dashboard: panel targets, annotations, variables."""
    if isinstance(node, dict):
        for key, item in node.items():
            if key in ("expr", "query", "definition") and isinstance(item, str):
                yield item
            else:
                yield from queries(item)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def test_agents_and_trainers_publish_what_they_do_and_a_killed_trainer_is_counted(
    cluster: Cluster, job_id: str
) -> None:
    coordinator = cluster.start_coordinator("--world-size", "2", "--metrics-port", "0")
    for host in ("host-0", "host-1"):
        cluster.start_agent(host, extra=("--metrics-port", "0"))
    cluster.wait_epoch(1)
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")
    agent = cluster.agents["host-0"]
    port = metrics_port(agent)
    me: Mapping[str, str] = {"host": "host-0", "job_id": job_id}

    def totals_past(steps: float) -> Samples | None:
        s = scrape(port)
        return s if (value(s, "remesh_trainer_steps_total", **me) or 0) > steps else None

    samples = wait_for(lambda: totals_past(10), 30, "host-0's trainer to report 10 timed steps")
    assert value(samples, "remesh_agent_connected", **me) == 1
    assert value(samples, "remesh_agent_epoch", **me) == 1
    assert value(samples, "remesh_agent_rank", **me) in (0, 1)
    assert value(samples, "remesh_agent_registrations_total", **me) == 1
    # The stream's first topology and the job's first epoch name every member: both come whole.
    assert (value(samples, "remesh_agent_topologies_total", **me, sent_as="whole") or 0) >= 1
    assert (value(samples, "remesh_agent_topologies_total", **me, sent_as="delta") or 0) == 0
    assert value(samples, "remesh_agent_trainer_starts_total", **me, role="active") == 1
    assert value(samples, "remesh_trainer_restores_total", **me, source="stand-in") == 1
    assert (value(samples, "remesh_agent_coordinator_call_seconds_count", **me, method="Register") or 0) >= 1
    assert (value(samples, "remesh_agent_coordinator_call_seconds_count", **me, method="AckEpoch") or 0) >= 1
    # The mean step time comes out of the two counters, as a dashboard computes it: at least the
    # stand-in's sleep per step.
    steps = value(samples, "remesh_trainer_steps_total", **me)
    seconds = value(samples, "remesh_trainer_step_seconds_total", **me)
    assert steps is not None and seconds is not None and seconds / steps >= 0.9 * STEP_S
    # Every trainer total is published from the start, with the labels operators filter by.
    for name, _help in TOTALS.values():
        assert value(samples, f"{name}_total", **me) is not None, name
    # The warm standby starts once the active trainer acknowledged its epoch.
    wait_for(lambda: value(scrape(port), "remesh_agent_standby_ready", **me) == 1, 30, "a warm standby")

    os.kill(first_trainer_pid(agent), signal.SIGKILL)

    def counted() -> Samples | None:
        s = scrape(port)
        killed = value(s, "remesh_agent_trainer_exits_total", **me, cause="signal") == 1
        return s if killed and (value(s, "remesh_trainer_steps_total", **me) or 0) > steps + 5 else None

    after = wait_for(counted, 60, "the kill counted and the next trainer's steps added")
    assert (value(after, "remesh_trainer_step_seconds_total", **me) or 0) > seconds
    # The coordinator echoed heartbeats in its keepalives (every 0.5 s of silence): round trips on
    # loopback, well under a second each.
    rtts = value(after, "remesh_agent_heartbeat_rtt_seconds_count", **me) or 0
    assert rtts >= 1 and (value(after, "remesh_agent_heartbeat_rtt_seconds_sum", **me) or 0) / rtts < 1.0
    # The other host's endpoint is its own, and the coordinator's parses too.
    other = scrape(metrics_port(cluster.agents["host-1"]))
    assert value(other, "remesh_agent_connected", host="host-1", job_id=job_id) == 1
    assert value(other, "remesh_agent_connected", **me) is None
    served = scrape(metrics_port(coordinator))
    assert (value(served, "remesh_epoch") or 0) >= 1
    assert (value(served, "remesh_epoch_live_seconds_count") or 0) >= 1  # epoch 1 went live
    # The first host's stream was open when epoch 1 was published: it was handed the epoch, at once.
    handed = value(served, "remesh_topology_delivery_seconds_count") or 0
    assert handed >= 1 and (value(served, "remesh_topology_delivery_seconds_sum") or 0) / handed < 1.0

    # The current epoch and why it exists, for the dashboard's annotations (value: published, in ms).
    # One series, the current epoch's (the killed trainer's host may have made a second one; read
    # again until a scrape did not fall between the two gauges' updates).
    def epoch_info() -> tuple[dict[str, str], float] | None:
        s = scrape(metrics_port(coordinator))
        (info,) = [(dict(labels), v) for (name, labels), v in s.items() if name == "remesh_epoch_info"]
        return info if info[0]["epoch"] == str(int(value(s, "remesh_epoch") or 0)) else None

    labels, published = wait_for(epoch_info, 10, "the epoch info of the current epoch")
    assert labels["reason"] and published > 1e12

    # Every metric the Grafana dashboard (deploy/) queries is served by a live component.
    dashboard = json.loads(DASHBOARD.read_text())
    names = {name for expr in queries(dashboard) for name in re.findall(r"\bremesh_[a-z0-9_]+", expr)}
    exposed = {name for name, _labels in {**served, **after, **other}}
    assert len(names) >= 15 and names <= exposed, sorted(names - exposed)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(t["expr"] for p in panels for t in p["targets"])


def test_the_coordinators_heartbeats_do_not_follow_the_trainers_step_rate(cluster: Cluster) -> None:
    """Two stand-in trainers step every 5 ms, each step a progress report to its agent. The agents
    relay the newest step on their regular heartbeats (every 0.5 s here), not one heartbeat a step:
    the coordinator hears of the steps, and its heartbeat count stays a small fraction of them."""
    coordinator = cluster.start_coordinator(
        "--world-size", "2", "--metrics-port", "0", "--heartbeat-interval", "0.5"
    )
    for host in ("host-0", "host-1"):
        cluster.start_agent(
            host, env={**os.environ, "STAND_IN_STEP_S": "0.005"}, extra=("--no-warm-standby",)
        )
    cluster.wait_epoch(1)
    port = metrics_port(coordinator)

    def steps() -> int:
        return sum(max(m.last_step, 0) for m in cluster.members().values())

    before = steps()
    heartbeats_before = value(scrape(port), "remesh_heartbeats_total") or 0
    wait_for(lambda: steps() >= before + 600, 60, "the coordinator to hear of 600 more steps")
    heartbeats = (value(scrape(port), "remesh_heartbeats_total") or 0) - heartbeats_before
    stepped = steps() - before
    assert heartbeats < stepped / 4, (heartbeats, stepped)

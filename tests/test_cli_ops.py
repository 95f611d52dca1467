"""The operator commands (`remesh members|topology|events|replay|drain`) against a real coordinator.

The pure parts (``--since`` parsing, ages, the replay comparison, the proto round trip that replay
relies on) are tested table-driven first; then the commands run as real processes against a real
coordinator process and a real Redis, with hosts registered and heartbeating over gRPC.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from remesh.cli import build_parser
from remesh.cli.replay_check import compare
from remesh.coordinator import convert
from remesh.coordinator.model import (
    ClusterState,
    Event,
    EventType,
    Member,
    MemberState,
    Role,
    Topology,
    TopologyMember,
)
from remesh.embedded import RedisServer
from remesh.v1 import coordinator_pb2 as pb
from remesh.views import format_age, parse_since, safe
from tests.procs import Cluster, GrpcHost, wait_for

# ---- pure parts -----------------------------------------------------------------------------------

NOW = 1_733_150_000.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", NOW - 30),
        ("10m", NOW - 600),
        ("1h30m", NOW - 5400),
        ("1.5h", NOW - 5400),
        ("2d", NOW - 172800),
        ("1733140000", 1733140000.0),
        ("1733140000.5", 1733140000.5),
        ("0", 0.0),
    ],
)
def test_parse_since(text: str, expected: float) -> None:
    assert parse_since(text, NOW) == pytest.approx(expected)


def test_parse_since_iso_time() -> None:
    assert parse_since("2024-12-02T14:33:20+00:00", NOW) == NOW


@pytest.mark.parametrize("text", ["", "soon", "10x", "-5", "m10"])
def test_parse_since_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="since"):
        parse_since(text, NOW)


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0.2, "just now"),
        (5, "5s ago"),
        (125, "2m ago"),
        (7300, "2h ago"),
        (3 * 86400, "3d ago"),
        (-3, "in the future"),
    ],
)
def test_format_age(seconds: float, expected: str) -> None:
    assert format_age(seconds) == expected


def _member(host: str, **kw: Any) -> Member:
    return Member(host, 1, Role.ACTIVE, MemberState.ALIVE, 2, "10.0.0.1", 0, "first heartbeat", NOW, **kw)


def _topology(*hosts: str, epoch: int = 1) -> Topology:
    return Topology(
        epoch=epoch,
        members=tuple(TopologyMember(h, r, 2, "10.0.0.1") for r, h in enumerate(hosts)),
        mesh_shape=(len(hosts), 2),
        jax_coordinator_address="10.0.0.1:47001",
        restore_step=-1,
        reason="formed",
        created_at=NOW,
        job_id="j",
    )


def test_compare_equal_states_has_no_difference() -> None:
    state = ClusterState(members={"a": _member("a")}, topology=_topology("a"))
    assert compare(state, {"a": _member("a")}, _topology("a")) == []


def test_compare_names_each_differing_field() -> None:
    state = ClusterState(members={"a": _member("a"), "b": _member("b")}, topology=_topology("a", "b"))
    live = {"a": replace(_member("a"), state=MemberState.SUSPECT, reason="silent"), "c": _member("c")}
    diffs = {
        (d.subject, d.field): (d.replayed, d.live) for d in compare(state, live, _topology("a", epoch=2))
    }
    assert diffs[("member a", "state")] == ("alive", "suspect")
    assert diffs[("member a", "reason")] == ("first heartbeat", "silent")
    assert diffs[("member b", "record")] == ("alive, incarnation 1", None)
    assert diffs[("member c", "record")] == (None, "alive, incarnation 1")
    assert diffs[("topology", "epoch")] == (1, 2)
    assert diffs[("topology", "mesh_shape")] == ([2, 2], [1, 2])
    assert ("topology", "members") in diffs
    assert ("member a", "incarnation") not in diffs


def test_compare_missing_topology() -> None:
    diffs = compare(ClusterState(topology=_topology("a")), {}, None)
    assert [(d.subject, d.field, d.replayed, d.live) for d in diffs] == [
        ("topology", "record", "epoch 1", None)
    ]


_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
_times = st.floats(min_value=0, max_value=4e9, allow_nan=False)
_members = st.builds(
    Member,
    host_id=_text,
    incarnation=st.integers(0, 2**40),
    role=st.sampled_from(Role),
    state=st.sampled_from(MemberState),
    device_count=st.integers(0, 65536),
    address=_text,
    rank=st.integers(-1, 4096),
    reason=_text,
    updated_at=_times,
)
_topologies = st.builds(
    Topology,
    epoch=st.integers(1, 2**40),
    members=st.lists(
        st.builds(
            TopologyMember,
            host_id=_text,
            rank=st.integers(0, 4096),
            device_count=st.integers(0, 64),
            address=_text,
        ),
        max_size=4,
    ).map(tuple),
    mesh_shape=st.lists(st.integers(0, 4096), max_size=3).map(tuple),
    jax_coordinator_address=_text,
    restore_step=st.integers(-1, 2**40),
    reason=_text,
    created_at=_times,
    halted=st.booleans(),
    job_id=_text,
)


@given(
    st.builds(
        Event,
        type=st.sampled_from(EventType),
        time=_times,
        epoch=st.integers(0, 2**40),
        reason=_text,
        host_id=_text,
        incarnation=st.integers(0, 2**40),
        member=st.none() | _members,
        topology=st.none() | _topologies,
        details=st.dictionaries(_text, _text, max_size=3),
        id=st.just("1733150000000-0"),
    )
)
def test_event_survives_the_proto_round_trip(event: Event) -> None:
    """`remesh replay` folds events read over gRPC: they must come back exactly as stored."""
    assert convert.event_from_pb(convert.event_to_pb(event)) == event


def test_what_a_client_supplied_reaches_the_terminal_as_plain_text() -> None:
    console = Console(record=True, width=120, force_terminal=True)
    console.print(safe("[bold red]x[/bold red]\x1b]0;owned\x07 ok"))
    text = console.export_text()
    assert "[bold red]x[/bold red]" in text  # markup shown, not applied
    assert "\\x1b]0;owned\\x07" in text  # escapes shown, not sent
    assert "\x1b]0" not in console.export_text(styles=True)


# ---- against a real coordinator --------------------------------------------------------------------


def _form(cluster: Cluster, hosts: list[GrpcHost]) -> None:
    cluster.wait_epoch(1, timeout=15)
    wait_for(
        lambda: all(m.state == pb.MEMBER_STATE_ALIVE for m in cluster.members().values()),
        10,
        "every member alive",
    )


@pytest.fixture(scope="module")
def formed(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Cluster]:
    """One coordinator (world size 2) with host-1 and host-2 alive in epoch 1, shared by the read-only tests."""
    cluster = Cluster(tmp_path_factory.mktemp("ops"), redis_server.url, f"test-ops-{uuid.uuid4().hex[:8]}")
    hosts: list[GrpcHost] = []
    try:
        cluster.start_coordinator("--world-size", "2")
        hosts = [GrpcHost(cluster, "host-1", 41), GrpcHost(cluster, "host-2", 42)]
        _form(cluster, hosts)
        yield cluster
    finally:
        for host in hosts:
            host.stop()
        cluster.close()


@pytest.fixture(autouse=True)
def _operator(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands run as the operator of the test's cluster (its CA, mutual TLS); without a
    cluster, --insecure (the address they are given answers nothing anyway)."""
    for name in (
        "REMESH_COORDINATOR",
        "REMESH_TLS_CA",
        "REMESH_TLS_CERT",
        "REMESH_TLS_KEY",
        "REMESH_INSECURE",
    ):
        monkeypatch.delenv(name, raising=False)
    cluster = next(
        (request.getfixturevalue(f) for f in ("formed", "cluster") if f in request.fixturenames), None
    )
    env = cluster.client_env() if cluster is not None else {"REMESH_INSECURE": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "200"}


def remesh(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "remesh.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def ok(*args: str) -> str:
    result = remesh(*args)
    assert result.returncode == 0, f"remesh {' '.join(args)} exited {result.returncode}:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    return result.stdout


def inproc(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run a command in this process: the same code as `remesh`, without an interpreter start per check."""
    try:
        parsed = build_parser().parse_args(list(args))
        code = parsed.run(parsed)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert isinstance(code, int)
    return code, out, err


def inproc_ok(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, out, err = inproc(capsys, *args)
    assert code == 0, f"remesh {' '.join(args)} exited {code}:\n{err}"
    return out


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_members_json(formed: Cluster) -> None:
    doc = json.loads(ok("members", "--coordinator", formed.address, "--json"))
    assert doc["epoch"] == 1
    members = {m["host_id"]: m for m in doc["members"]}
    assert set(members) == {"host-1", "host-2"}
    assert {m["state"] for m in members.values()} == {"alive"}
    assert {m["role"] for m in members.values()} == {"active"}
    assert sorted(m["rank"] for m in members.values()) == [0, 1]
    assert members["host-1"]["last_step"] == 41
    assert members["host-2"]["incarnation"] == 1
    assert members["host-2"]["device_count"] == 2


def test_members_table_and_state_filter(formed: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    table = inproc_ok(capsys, "members", "--coordinator", formed.address)
    assert "host-1" in table and "host-2" in table and "alive" in table
    assert "epoch 1" in table
    none_dead = json.loads(
        inproc_ok(capsys, "members", "--coordinator", formed.address, "--json", "--state", "dead", "left")
    )
    assert none_dead["members"] == []


def test_topology(formed: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(ok("topology", "--coordinator", formed.address, "--json"))
    assert doc["epoch"] == 1
    assert doc["world_size"] == 2
    assert doc["mesh_shape"] == [2, 2]
    assert doc["restore_step"] == -1
    assert doc["reason"]
    assert doc["jax_coordinator_address"].startswith("127.0.0.1:")
    assert {m["host_id"]: m["rank"] for m in doc["members"]} == {"host-1": 0, "host-2": 1}
    human = inproc_ok(capsys, "topology", "--coordinator", formed.address)
    assert "epoch 1" in human and "host-2" in human and doc["jax_coordinator_address"] in human


def test_events(formed: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    events = json_lines(ok("events", "--coordinator", formed.address, "--json"))
    types = [e["type"] for e in events]
    assert types.count("member_joined") == 2
    assert types.count("topology_changed") == 1
    joined = next(e for e in events if e["type"] == "member_joined" and e["host_id"] == "host-1")
    assert joined["reason"].startswith("registered as active")
    assert joined["member"]["state"] == "joining"
    changed = next(e for e in events if e["type"] == "topology_changed")
    assert changed["epoch"] == 1 and changed["reason"]
    assert changed["topology"]["world_size"] == 2
    assert all(e["id"] for e in events)

    human = inproc_ok(capsys, "events", "--coordinator", formed.address)
    assert len(human.splitlines()) == len(events)
    assert "member_joined" in human and changed["reason"] in human


def test_events_filters(formed: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    address = formed.address
    only_1 = json_lines(ok("events", "--coordinator", address, "--json", "--host", "host-1"))
    assert only_1 and all(e["host_id"] in ("host-1", "") for e in only_1)
    assert "host-2" not in {e["host_id"] for e in only_1}
    assert "topology_changed" in {e["type"] for e in only_1}  # it names host-1

    def events(*args: str) -> list[dict[str, Any]]:
        return json_lines(inproc_ok(capsys, "events", "--coordinator", address, "--json", *args))

    assert [e["type"] for e in events("--type", "topology_changed", "--since", "5m")] == ["topology_changed"]
    assert events("--since", str(time.time() + 3600)) == []
    everything = events()
    assert events("--after", everything[0]["id"]) == everything[1:]
    assert {e["host_id"] for e in events("--host", "host-2", "--type", "member_alive")} == {"host-2"}


def test_replay_matches_the_live_state(formed: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    out = ok("replay", "--coordinator", formed.address)
    assert out.startswith("replay matches the live state (")
    assert "epoch 1)" in out
    doc = json.loads(inproc_ok(capsys, "replay", "--coordinator", formed.address, "--json"))
    assert doc["matches"] is True and doc["differences"] == [] and doc["replayed_epoch"] == 1


def test_unreachable_coordinator_is_one_clear_line() -> None:
    result = remesh("members", "--coordinator", "127.0.0.1:1")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr
    assert "is the coordinator running at 127.0.0.1:1?" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_drain_unknown_host(formed: Cluster) -> None:
    result = remesh("drain", "no-such-host", "--coordinator", formed.address)
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr and "no-such-host" in result.stderr
    assert "remesh members" in result.stderr  # the hint
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("events", "--since", "soon"),
        ("events", "--after", "yesterday"),
        ("members", "--state", "asleep"),
        ("drain",),
    ],
)
def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str], args: tuple[str, ...]) -> None:
    code, _, err = inproc(capsys, *args, "--coordinator", "127.0.0.1:1")
    assert code == 2
    assert "usage:" in err


@pytest.mark.parametrize(
    ("base", "span"),
    [("80", "100"), ("65500", "100"), ("28000", "0")],
    ids=["privileged", "past 65535", "empty"],
)
def test_coordinator_refuses_a_bad_jax_port_range(
    capsys: pytest.CaptureFixture[str], base: str, span: str
) -> None:
    redis = ("--redis", "redis://127.0.0.1:1")
    code, out, err = inproc(capsys, "coordinator", *redis, "--jax-port-base", base, "--jax-port-span", span)
    assert code == 2
    assert "invalid JAX port range" in out + err and "--jax-port-base" in out + err


def test_coordinator_refuses_a_jax_port_base_from_the_environment_that_is_no_number(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REMESH_JAX_PORT_BASE", "high")
    code, _, err = inproc(capsys, "coordinator", "--redis", "redis://127.0.0.1:1")
    assert code == 2
    assert "--jax-port-base" in err and "'high'" in err


def test_drain_is_seen_by_follow_and_replay_still_matches(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster.start_coordinator("--world-size", "2")
    hosts = [GrpcHost(cluster, "host-1", 1), GrpcHost(cluster, "host-2", 1)]
    follower = subprocess.Popen(
        [sys.executable, "-m", "remesh.cli", "events", "--coordinator", cluster.address,
         "--follow", "--json", "--type", "member_draining", "topology_changed"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in follower.stdout or ():
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        _form(cluster, hosts)
        assert json.loads(lines.get(timeout=10))["epoch"] == 1  # the formation, live from the stream

        out = ok("drain", "host-2", "--reason", "kernel upgrade", "--coordinator", cluster.address)
        assert "draining" in out and "kernel upgrade" in out

        drained = json.loads(lines.get(timeout=10))
        assert drained["type"] == "member_draining" and drained["host_id"] == "host-2"
        assert drained["reason"] == "drained by an operator: kernel upgrade"
        shrunk = json.loads(lines.get(timeout=10))
        assert shrunk["type"] == "topology_changed" and shrunk["epoch"] == 2

        follower.send_signal(signal.SIGINT)
        assert follower.wait(10) == 0, follower.stderr.read() if follower.stderr else ""
        assert "Traceback" not in (follower.stderr.read() if follower.stderr else "")

        replayed = inproc_ok(capsys, "replay", "--coordinator", cluster.address)
        assert replayed.startswith("replay matches the live state"), replayed
        again = inproc_ok(capsys, "drain", "host-2", "--coordinator", cluster.address, "--json")
        assert json.loads(again)["state"] == "draining"  # draining twice changes nothing
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(5)
        for host in hosts:
            host.stop()


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    out = inproc(capsys, "--help")[1]
    for command in ("members", "topology", "events", "replay", "drain", "top"):
        assert command in out
    assert "Ctrl-C" in inproc(capsys, "events", "--help")[1]


def test_top_shows_a_running_job_its_step_rate_and_a_failure(cluster: Cluster) -> None:
    """`remesh top --once --json` on a job of stand-in trainers: the step the whole job reached and its
    rate, then, after a host is SIGKILLed, the new epoch and the death among the last events."""
    cluster.start_coordinator("--world-size", "2")
    for host in ("host-0", "host-1"):
        cluster.start_agent(host)
    cluster.start_agent("spare-0", spare=True)
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")

    doc = json.loads(ok("top", "--coordinator", cluster.address, "--once", "--json", "--interval", "1"))
    assert (doc["job_id"], doc["epoch"], doc["epoch_live"], doc["world_size"]) == (cluster.job, 1, True, 2)
    assert doc["members_by_state"] == {"alive": 3}
    steps = {m["host_id"]: m["last_step"] for m in doc["members"] if m["rank"] >= 0}
    assert doc["step"] == min(steps.values()) and doc["step"] > 0
    assert doc["steps_per_s"] > 0  # the stand-ins step every 50 ms
    assert 0 < doc["goodput"] < 1 and doc["badput_s"]["initialization"] > 0  # remesh goodput's figures
    assert "epoch_live" in [e["type"] for e in doc["events"]]
    assert "member_alive" not in [e["type"] for e in doc["events"]]  # too frequent to be news

    cluster.agents["host-1"].kill()
    cluster.wait_epoch(2)
    wait_for(
        lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE and e.epoch == 2 for e in cluster.events()),
        30,
        "epoch 2",
    )
    doc = json.loads(ok("top", "--coordinator", cluster.address, "--once", "--json", "--interval", "0.5"))
    assert (doc["epoch"], doc["epoch_live"], doc["world_size"]) == (2, True, 2)
    assert doc["members_by_state"]["dead"] == 1
    dead = [e for e in doc["events"] if e["type"] == "member_dead"]
    assert [e["host_id"] for e in dead] == ["host-1"]
    # The same on a terminal-less screen: the header names the epoch and its state.
    text = ok("top", "--coordinator", cluster.address, "--once", "--interval", "0.2")
    assert "epoch 2 live" in text and "host-1" in text


def test_goodput_live_on_the_coordinator_and_from_the_log_afterwards_agree(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A job of stand-in trainers loses host-1 (SIGKILL) and recovers onto the spare. `remesh goodput`
    live, the coordinator's gauges, and `remesh goodput --log` of the event log alone at the same time
    and step give the same figures."""
    from tests.test_metrics import metrics_port, scrape, value

    coordinator = cluster.start_coordinator("--world-size", "2", "--metrics-port", "0")
    for host in ("host-0", "host-1"):
        cluster.start_agent(host)
    cluster.start_agent("spare-0", spare=True)
    wait_for(lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE for e in cluster.events()), 30, "epoch 1 live")
    wait_for(lambda: cluster.members()["host-0"].last_step >= 20, 30, "20 steps")
    cluster.agents["host-1"].kill()
    wait_for(
        lambda: any(e.type == pb.EVENT_TYPE_EPOCH_LIVE and e.epoch == 2 for e in cluster.events()),
        30,
        "epoch 2",
    )

    live = json.loads(ok("goodput", "--coordinator", cluster.address, "--json"))
    assert 0 < live["goodput"] < 1 and live["productive_s"] > 0
    badput = live["badput_s"]
    assert badput["initialization"] > 0 and badput["recovery"] > 0 and badput["checkpoint_save"] is None
    assert live["productive_s"] + sum(v for v in badput.values() if v) == pytest.approx(
        live["wall_s"], abs=0.01
    )
    assert [e["epoch"] for e in live["epochs"]] == [1, 2]  # per epoch, and for the whole job
    assert sum(e["productive_s"] for e in live["epochs"]) == pytest.approx(live["productive_s"], abs=0.01)
    (recovery,) = live["recoveries"]
    assert recovery["hosts"] == ["host-1"] and recovery["epoch"] == 2 and recovery["to_live_s"] > 0
    assert recovery["steps_lost"] >= 0 and set(recovery["phases"]) >= {"decide", "restore"}

    log = tmp_path / "job.jsonl"
    log.write_text(ok("events", "--coordinator", cluster.address, "--json"))

    def replayed(now: float, step: int) -> dict[str, Any]:
        return json.loads(
            ok("goodput", "--from-log", str(log), "--now", repr(now), "--step", str(step), "--json")
        )

    # The log alone, as of the live call's time and step: the same figures.
    after = replayed(live["now"], live["current_step"])
    assert {k: v for k, v in after.items() if k != "current_step"} == {
        k: v for k, v in live.items() if k != "current_step"
    }
    # The coordinator's gauges (refreshed every 5 s) say the same once refreshed after the recovery.
    port = metrics_port(coordinator)

    def refreshed() -> Any:
        samples = scrape(port)
        return (
            samples
            if (value(samples, "remesh_goodput_computed_at_seconds") or 0) > recovery["live_at"]
            else None
        )

    gauges = wait_for(refreshed, 20, "the coordinator's goodput refreshed after the recovery")
    # One epoch info series, the new epoch's, with its reason (the dashboard's annotation).
    (info,) = [dict(labels) for (name, labels) in gauges if name == "remesh_epoch_info"]
    assert info["epoch"] == "2" and "spare-0 takes rank 1 of host-1" in info["reason"]
    at, step = value(gauges, "remesh_goodput_computed_at_seconds"), value(gauges, "remesh_goodput_step")
    assert at is not None and step is not None
    figures = replayed(at, int(step))
    assert value(gauges, "remesh_goodput_ratio") == pytest.approx(figures["goodput"], abs=1e-3)
    assert value(gauges, "remesh_productive_seconds") == pytest.approx(figures["productive_s"], abs=1e-3)
    for category, seconds in figures["badput_s"].items():
        if seconds is not None:
            assert value(gauges, "remesh_badput_seconds", category=category) == pytest.approx(
                seconds, abs=1e-3
            )


def test_goodput_from_a_log_that_is_not_one_says_which_line_and_what_to_give(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "job.jsonl"
    bad.write_text('{"type": "member_joined", "time": 1.0, "epoch": 0}\nnot json\n')
    code, out, err = inproc(capsys, "goodput", "--from-log", str(bad))
    assert code == 2 and out == ""
    assert f"{bad}:2 is not an event as `remesh events --json` prints it" in err
    code, _, err = inproc(capsys, "goodput", "--from-log", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "missing.jsonl" in err
    # An event of a type this version does not know is refused the same way, not skipped.
    bad.write_text('{"type": "member_teleported", "time": 1.0, "epoch": 0}\n')
    code, _, err = inproc(capsys, "goodput", "--from-log", str(bad))
    assert code == 2 and ":1 is not an event" in err

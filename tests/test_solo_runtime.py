"""A world of one: an epoch of a single process joins no distributed runtime and opens no socket.

The runtime's own rules first (pure: no JAX runtime, every TCP/UDP socket refused as on an
accelerator host that allows none); then real processes: two that go from epochs of one to an epoch
of two and back (the backend kept, cleared, made again), and a real trainer whose session recovers
in-process from one epoch of one to the next, under a scripted agent on a Unix socket, with the same
backend and a result equal bit for bit to the run without the change; and a trainer without a rank
that traces its step while idle on CPU, but never on an accelerator (whose devices it must not take).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import jax
import jax.extend
import numpy as np
import pytest

from remesh.elastic.agent_client import Assignment
from remesh.elastic.exchange import advertised_host
from remesh.elastic.runtime import Runtime
from remesh.embedded import free_port
from remesh.v1 import agent_pb2 as apb
from remesh.v1 import agent_pb2_grpc as apb_grpc
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.contract import TrainerAssignment

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}

# Loaded first by the trainer scripts below: every TCP/UDP socket is refused as an accelerator host
# refuses it (errno 97), and joining a JAX distributed runtime fails loudly.
NO_NETWORK = textwrap.dedent(
    """
    import errno, socket
    import jax

    class _NoInet(socket.socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None and family in (-1, socket.AF_INET, socket.AF_INET6):
                raise OSError(errno.EAFNOSUPPORT, "no TCP/UDP socket on this host")
            super().__init__(family, type, proto, fileno)

    socket.socket = _NoInet

    def _refused(*args, **kwargs):
        raise AssertionError("a world of one joined a JAX distributed runtime")

    jax.distributed.initialize = _refused
    """
)


def solo(epoch: int) -> Assignment:
    return Assignment(
        epoch=epoch, host_id="host-0", rank=0, world_size=1, jax_coordinator="127.0.0.1:1", restore_step=-1
    )


class _NoInet(socket.socket):
    def __init__(self, family: int = -1, type: int = -1, proto: int = -1, fileno: int | None = None) -> None:
        if fileno is None and family in (-1, socket.AF_INET, socket.AF_INET6):
            raise OSError(errno.EAFNOSUPPORT, "no TCP/UDP socket on this host")
        super().__init__(family, type, proto, fileno)


@pytest.fixture
def no_inet(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as on an accelerator host: no TCP/UDP socket opens, no distributed runtime starts."""
    monkeypatch.setattr(socket, "socket", _NoInet)

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a world of one touched the JAX distributed runtime")

    monkeypatch.setattr(jax.distributed, "initialize", refused)
    monkeypatch.setattr(jax.distributed, "shutdown", refused)
    monkeypatch.setattr(jax.extend.backend, "clear_backends", refused)


# ---- the rules of a world of one (pure) ----------------------------------------------------------


def test_a_world_of_one_agrees_with_itself_at_once_and_opens_no_socket(no_inet: None) -> None:
    runtime = Runtime(init_timeout_s=5)
    runtime.start(solo(1))
    assert runtime.solo
    runtime.barrier("compiled", 0.0)  # no one to wait for: returns at once, even with no time given
    assert runtime.allgather_int("chosen", 7, 0.0) == [7]
    assert runtime.allgather_text("offers", '{"points": []}', 0.0) == ['{"points": []}']
    assert runtime.posted_ints("cadence-5") is None  # nothing posted yet: "missing", as with peers
    runtime.post_int("cadence-5", 3)
    assert runtime.posted_ints("cadence-5") == [3]
    assert runtime.posted_ints("cadence-6") is None
    assert runtime.stop() >= 0 and runtime.assignment is None

    # A new epoch of one starts afresh: what the last one posted is not this one's.
    runtime.start(solo(2))
    assert runtime.posted_ints("cadence-5") is None
    assert runtime.leave_together(0.0) >= 0 and runtime.assignment is None


def test_the_address_this_host_offers_peers_falls_back_to_loopback_where_no_socket_opens(
    no_inet: None,
) -> None:
    assert advertised_host("10.1.2.3:5000") == "127.0.0.1"
    # The address given (Policy.peer_host) is the one offered, whatever the routes say.
    assert advertised_host("10.1.2.3:5000", "10.9.9.9") == "10.9.9.9"


# ---- real processes --------------------------------------------------------------------------------

PAIR = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    from jax._src import xla_bridge
    from remesh.elastic.agent_client import Assignment
    from remesh.elastic.runtime import Runtime, configure_backend

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    configure_backend(1, 5.0, None)
    runtime = Runtime(init_timeout_s=60)

    def epoch(number, world, r):
        return Assignment(epoch=number, host_id=f"host-{rank}", rank=r, world_size=world,
                          jax_coordinator=f"127.0.0.1:{port}", restore_step=-1)

    seen = []
    runtime.start(epoch(1, 1, 0))
    x = jnp.arange(4.0).sum()
    client = jax.devices()[0].client
    runtime.stop()
    seen.append({"x": float(x), "kept": xla_bridge.backends_are_initialized(),
                 "same": jax.devices()[0].client is client})
    runtime.start(epoch(2, 2, rank))
    seen.append({"gathered": runtime.allgather_int("v", 10 + rank, 60),
                 "processes": jax.process_count(), "index": jax.process_index()})
    # Rank 0 hosts the coordination service: it leaves last, or the other aborts disconnecting.
    runtime.leave_together(60)
    runtime.start(epoch(3, 1, 0))
    y = jnp.arange(5.0).sum()
    seen.append({"y": float(y), "processes": jax.process_count(), "index": jax.process_index()})
    runtime.stop()
    print("RESULT " + json.dumps(seen), flush=True)
    """
)


def _result(out: str) -> Any:
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.integration
def test_a_process_goes_from_epochs_of_one_to_an_epoch_of_two_and_back(tmp_path: Path) -> None:
    """Each of two processes trains alone (its backend kept across the stop), then both join one
    runtime (the backend cleared first: JAX initialises only before any), then each is alone again,
    as process 0 of 1 whatever rank it held."""
    script = tmp_path / "pair.py"
    script.write_text(PAIR)
    port = free_port()
    env = {**os.environ, **ENV}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (proc, out) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 0, out[-4000:]
        alone, together, alone_again = _result(out)
        assert alone == {"x": 6.0, "kept": True, "same": True}
        assert together == {"gathered": [10, 11], "processes": 2, "index": rank}
        assert alone_again == {"y": 10.0, "processes": 1, "index": 0}


class ScriptedAgent(apb_grpc.AgentLocalServicer):
    """A local API that keeps host-0 the one member: epoch 1, and with ``switch_at`` epoch 2 (the
    same single member) once a progress report passes that step. Records acknowledgements."""

    def __init__(self, switch_at: int | None) -> None:
        self.switch_at = switch_at
        self.epoch = 1
        self.changed = threading.Condition()
        self.acks: list[tuple[int, int, str]] = []  # (epoch, restored step, source)
        self.finished: list[tuple[int, int]] = []

    def WatchAssignments(
        self, request: apb.WatchAssignmentsRequest, context: grpc.ServicerContext
    ) -> Iterator[apb.Assignment]:
        sent = 0
        while context.is_active():
            with self.changed:
                self.changed.wait_for(functools.partial(self._newer_than, sent), 0.2)
                epoch = self.epoch
            if epoch > sent:
                topology = pb.Topology(epoch=epoch, restore_step=-1 if epoch == 1 else 0)
                yield apb.Assignment(topology=topology, host_id="host-0", rank=0, world_size=1)
                sent = epoch

    def _newer_than(self, epoch: int) -> bool:
        return self.epoch > epoch

    def ReportProgress(
        self, request: apb.ReportProgressRequest, context: grpc.ServicerContext
    ) -> apb.ReportProgressResponse:
        with self.changed:
            if self.switch_at is not None and self.epoch == 1 and request.step >= self.switch_at:
                self.epoch = 2
                self.changed.notify_all()
            return apb.ReportProgressResponse(current_epoch=self.epoch)

    def AckEpoch(self, request: apb.LocalAckRequest, context: grpc.ServicerContext) -> apb.LocalAckResponse:
        with self.changed:
            self.acks.append((request.epoch, request.restored_step, request.restore_source))
        return apb.LocalAckResponse(live=True)

    def Finish(
        self, request: apb.LocalFinishRequest, context: grpc.ServicerContext
    ) -> apb.LocalFinishResponse:
        with self.changed:
            self.finished.append((request.epoch, request.step))
        return apb.LocalFinishResponse()


SOLO_TRAINER = NO_NETWORK + textwrap.dedent(
    """
    import functools, json, sys, time
    import numpy as np
    from examples.tinylm import data, model
    from remesh.elastic import Policy, Session

    out, steps, shm = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    config = model.Config(seq_len=16, d_model=32, n_layers=1, d_mlp=128)
    session = Session(
        init_state=functools.partial(model.init_state, 0, config),
        train_step=functools.partial(model.train_step, config=config),
        batch_for_step=lambda step: data.global_batch(step, 4, 16, 0),
        devices_per_host=1,
        policy=Policy(snapshot_every=1, shm_dir=shm, progress_every_s=0.05),
    )
    clients, ran, restores = [], [], []
    for result in session.run(steps):
        client = jax.devices()[0].client
        if not any(c is client for c in clients):
            clients.append(client)  # held: a backend made again could not reuse a freed one's id
        if not ran or ran[-1][0] != result.epoch:
            restores.append([result.epoch, session.last_restore["step"], session.last_restore["source"]])
        ran.append([result.epoch, result.step])
        time.sleep(0.05)
    np.savez(out + ".npz", *session.final_leaves())
    report = {"ran": ran, "restores": restores, "backends": len(clients),
              "piece_server": session.restorer.serving, "platform": session.platform}
    session.close()
    print("RESULT " + json.dumps(report), flush=True)
    """
)


def _serve(agent: ScriptedAgent, path: Path) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    apb_grpc.add_AgentLocalServicer_to_server(agent, server)
    assert server.add_insecure_port(f"unix:{path}")
    server.start()
    return server


def _run_solo_trainer(
    tmp: Path, name: str, switch_at: int | None, steps: int
) -> tuple[Any, ScriptedAgent, Path]:
    script = tmp / "solo_trainer.py"
    script.write_text(SOLO_TRAINER)
    agent = ScriptedAgent(switch_at)
    server = _serve(agent, tmp / f"{name}.sock")
    given = TrainerAssignment(
        agent_address=f"unix:{tmp / f'{name}.sock'}",
        slot=1,
        host_id="host-0",
        job_id=f"solo-{name}",
        epoch=1,
        rank=0,
        world_size=1,
        jax_coordinator="127.0.0.1:1",
        restore_step=-1,
        device_count=1,
        commits=(),
    )
    out = tmp / name
    (tmp / "shm").mkdir(exist_ok=True)
    try:
        proc = subprocess.run(
            [sys.executable, str(script), str(out), str(steps), str(tmp / "shm")],
            capture_output=True,
            text=True,
            timeout=150,
            env={**os.environ, **ENV, **given.to_env()},
        )
    finally:
        server.stop(None)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return _result(proc.stdout), agent, out.with_suffix(".npz")


@pytest.mark.integration
def test_a_session_recovers_in_process_from_an_epoch_of_one_to_the_next_on_the_same_backend(
    tmp_path: Path,
) -> None:
    steps, switch_at = 24, 6
    report, agent, final = _run_solo_trainer(tmp_path, "switched", switch_at, steps)
    clean, clean_agent, clean_final = _run_solo_trainer(tmp_path, "clean", None, steps)

    # Two epochs in one process: the second restored the newest snapshot from memory (not scratch,
    # not a file), and trained to the end.
    assert [r[0] for r in report["restores"]] == [1, 2], report["restores"]
    (_, restored, source) = report["restores"][1]
    assert source == "memory" and switch_at <= restored < steps, report["restores"]
    assert [(e, s, src) for e, s, src in agent.acks] == [(1, 0, "scratch"), (2, restored, "memory")]
    assert report["ran"][-1] == [2, steps] and agent.finished == [(2, steps)]
    assert [s for e, s in report["ran"] if e == 2] == list(range(restored + 1, steps + 1))
    # One backend throughout (no device re-opened), no piece server, no distributed runtime (the
    # script refuses both), on CPU.
    assert report["backends"] == 1 and not report["piece_server"] and report["platform"] == "cpu"
    # The run without the change: one epoch, the same state at the end, bit for bit.
    assert [r[0] for r in clean["restores"]] == [1] and clean_agent.acks == [(1, 0, "scratch")]
    with np.load(final) as a, np.load(clean_final) as b:
        assert a.files == b.files
        for name in a.files:
            assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


STANDBY = textwrap.dedent(
    """
    import functools, json, threading
    from jax._src import xla_bridge
    from examples.tinylm import data, model
    from remesh.elastic import Policy, Session
    from remesh.elastic.agent_client import Assignment

    class Agent:
        # No rank, then the job halts: the session stands by once and stops.
        def __init__(self):
            self.latest = Assignment(epoch=1, host_id="spare-0", rank=-1, world_size=1,
                                     jax_coordinator="", restore_step=-1)
        def wait_until(self, predicate, timeout):
            self.latest = Assignment(epoch=1, host_id="spare-0", rank=-1, world_size=1,
                                     jax_coordinator="", restore_step=-1, halted=True)
            return self.latest
        def close(self):
            pass

    config = model.Config(seq_len=16, d_model=32, n_layers=1, d_mlp=128)
    session = Session(
        init_state=functools.partial(model.init_state, 0, config),
        train_step=functools.partial(model.train_step, config=config),
        batch_for_step=lambda step: data.global_batch(step, 4, 16, 0),
        devices_per_host=1,
        agent=Agent(),
        policy=Policy(shm_dir=None, stuck_step_exit_s=None, stuck_join_exit_s=None),
    )
    assert list(session.epochs(10)) == []
    print("RESULT " + json.dumps({"platform": session.platform, "traced": session.compiler.traced,
                                   "backend": xla_bridge.backends_are_initialized()}), flush=True)
    session.close()
    """
)


@pytest.mark.integration
@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_a_trainer_without_a_rank_traces_its_step_on_cpu_and_leaves_an_accelerator_alone(
    tmp_path: Path, platform: str
) -> None:
    """On CPU the standby traces the step while idle (a recovery that places it then only compiles);
    on an accelerator it must not: tracing may make a backend, and the device belongs to the trainer
    that holds the rank (a TPU chip opens in one process at a time). No TPU is needed to see it: the
    platform is what the session would open, and it opens nothing while it has no rank."""
    script = tmp_path / "standby.py"
    script.write_text(STANDBY)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ENV, "JAX_PLATFORMS": platform},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = _result(proc.stdout)
    assert report == {"platform": platform, "traced": platform == "cpu", "backend": False}

"""The elastic trainer end to end: real coordinator, agents and JAX trainer processes (tinylm,
3 hosts x 2 CPU devices joined by jax.distributed and gloo), hosts killed with SIGKILL mid-run."""

from __future__ import annotations

import json
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from examples.tinylm import data
from examples.tinylm.train_elastic import checksum
from remesh.elastic.cadence import FIRST_EVERY
from remesh.embedded import FakeGcsServer, RedisServer
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.contract import recovery_id
from tests.procs import Cluster, jax_port, wait_for
from tests.test_metrics import Samples, metrics_port, scrape, value

# Longer than run_job's own waits, so that a job that hangs fails with its logs' tails, not with
# pytest-timeout's bare stack.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
KILL_AT = 15
ENV = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def trainer(final: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "examples.tinylm.train_elastic",
        "--steps", str(STEPS), "--d-model", "64", "--layers", "1", "--seq-len", "32",
        "--log-every", "5", "--step-sleep", "0.05", "--save-final", str(final), *extra,
    ]  # fmt: skip


def run_job(
    tmp: Path,
    redis_url: str,
    *,
    spares: int,
    victim: str | None,
    coordinator_args: tuple[str, ...] = (),
    job: str | None = None,
    trainer_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    host_env: dict[str, dict[str, str]] | None = None,
    command: list[str] | None = None,
    kill_when: Callable[[Cluster], bool] | None = None,
    before_kill: Callable[[Cluster], None] | None = None,
    agent_args: tuple[str, ...] = (),
) -> tuple[Path, Cluster]:
    """Run a 3-host tinylm job to STEPS, SIGKILLing ``victim`` once it passed step KILL_AT (or once
    ``kill_when`` holds, right after ``before_kill``). ``host_env``: more environment for one host's
    agent and trainer; ``command``: another trainer than ``trainer(final, *trainer_args)``."""
    tmp.mkdir(parents=True, exist_ok=True)
    final = tmp / "final.npz"
    cluster = Cluster(tmp, redis_url, job or new_job_id())
    command = command or trainer(final, *trainer_args)
    env = {**ENV, **(env or {})}
    try:
        cluster.start_coordinator("--world-size", "3", *coordinator_args)
        warm = agent_args + (() if victim else ("--no-warm-standby",))  # no failures: no standby needed
        for h in ("host-0", "host-1", "host-2"):
            cluster.start_agent(h, trainer=command, env={**env, **(host_env or {}).get(h, {})}, extra=warm)
        for i in range(spares):
            cluster.start_agent(f"spare-{i}", spare=True, trainer=command, env=env, extra=warm)
        if victim:

            def reached(cluster: Cluster) -> bool:
                member = cluster.members().get(victim)
                return member is not None and member.last_step >= KILL_AT

            when = kill_when or reached
            wait_for(lambda: when(cluster), 120, f"the moment to kill {victim}")
            if before_kill is not None:
                before_kill(cluster)
            cluster.agents[victim].kill()
        # Within the module's 300 s: a clean FSDP run took 139 s to step 35 of 40 while the other
        # worker ran the soak (suite run of 2026-12-07), past the 150 s this was.
        wait_for(final.exists, 220, "the job to finish")
    except TimeoutError as exc:
        tails = cluster.log_tails(25)
        cluster.close()
        raise AssertionError(f"{exc}\n{tails}") from exc
    except BaseException:
        cluster.close()
        raise
    return final, cluster


def run_gcs_job(tmp: Path, redis_url: str, gcs: FakeGcsServer, *trainer_args: str) -> tuple[Path, Cluster]:
    """``run_job`` with one spare, host-1 killed, no host-memory tier, and checkpoints every 5 steps
    in a new bucket of the GCS emulator: every member restores from GCS."""
    bucket = f"e2e-{new_job_id()}"
    gcs.create_bucket(bucket)
    return run_job(
        tmp,
        redis_url,
        spares=1,
        victim="host-1",
        trainer_args=(
            *trainer_args,
            "--no-snapshots",
            "--gcs",
            f"gs://{bucket}/job",
            "--checkpoint-every",
            "5",
        ),
        env=gcs.env(),
    )


def new_job_id() -> str:
    return f"e2e-{uuid.uuid4().hex[:8]}"


def leaves(path: Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer(appendonly=False) as server:
        yield server


@pytest.fixture(scope="module")
def clean_final(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[Path]:
    final, cluster = run_job(tmp_path_factory.mktemp("clean"), redis.url, spares=0, victim=None)
    cluster.close()
    yield final


def steps_logged(cluster: Cluster) -> list[tuple[int, float, int]]:
    """(step, loss, world size) lines the trainers logged, across every agent log."""
    import re

    rows = set()
    for log in cluster.tmp.glob("agent-*.log"):
        for m in re.finditer(r"\] step\s+.*?loss=([\d.]+).*?step=(\d+) world_size=(\d+)", log.read_text()):
            rows.add((int(m.group(2)), float(m.group(1)), int(m.group(3))))
    return sorted(rows)


def scrape_once_heard(cluster: Cluster, host: str, total: str, at_least: float) -> Samples:
    """``host``'s agent's metrics, once they count ``total`` of its trainer at ``at_least``: the
    trainer's totals reach its agent with its progress reports, at most one a second."""
    me = {"host": host, "job_id": cluster.job}
    scraped: list[Samples] = []

    def heard() -> bool:
        scraped[:] = [scrape(metrics_port(cluster.agents[host]))]
        return (value(scraped[0], total, **me) or 0) >= at_least

    wait_for(heard, 10, f"{host}'s agent to hear of {total} >= {at_least}")
    return scraped[0]


def test_a_killed_host_is_replaced_by_the_spare_and_the_result_is_bitwise_equal(
    tmp_path: Path, redis: RedisServer, clean_final: Path
) -> None:
    published: list[Samples] = []

    def scrape_host_0(cluster: Cluster) -> None:
        published.append(scrape_once_heard(cluster, "host-0", "remesh_trainer_steps_total", KILL_AT - 2))

    final, cluster = run_job(
        tmp_path,
        redis.url,
        spares=1,
        victim="host-1",
        before_kill=scrape_host_0,
        agent_args=("--metrics-port", "0"),
    )
    try:
        # What the trainer library sent its agent by then: its steps, timed, and the snapshots of them.
        (samples,) = published
        me = {"host": "host-0", "job_id": cluster.job}
        assert (value(samples, "remesh_trainer_steps_total", **me) or 0) >= KILL_AT - 2
        assert (value(samples, "remesh_trainer_step_seconds_total", **me) or 0) > 0
        assert (value(samples, "remesh_trainer_snapshots_total", **me) or 0) >= 1
        assert (value(samples, "remesh_trainer_snapshot_bytes_total", **me) or 0) > 0
        assert value(samples, "remesh_trainer_restores_total", **me, source="scratch") == 1
        # The trainers' lines about joining epoch 2 carry the recovery's id, as the agents' and the
        # coordinator's do (tests/test_logs.py).
        tag = f"recovery={recovery_id(cluster.job, 2)}"
        for host in ("host-0", "spare-0", "host-2"):
            ready = [line for line in cluster.agents[host].output().splitlines() if "epoch ready" in line]
            assert any(tag in line for line in ready), (host, ready)
            assert not any(tag in line for line in ready if "epoch=1" in line)
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "spare-0", "host-2"]
        events = cluster.events()
        acks = [e for e in events if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 2]
        assert sorted(e.host_id for e in acks) == ["host-0", "host-2", "spare-0"]
        # Every member resumed at one step, from host memory or from a peer that had it: the newest
        # the survivors held (snapshots every FIRST_EVERY steps until the members agree on an
        # interval). The victim was killed past KILL_AT, the survivors within a step of it.
        (step,) = {int(e.details["restored_step"]) for e in acks}
        assert step % FIRST_EVERY == 0 and step >= KILL_AT - FIRST_EVERY, step
        # How far the survivors got before the epoch (what the event log counts as thrown away from):
        # at least the step they restored; the spare ran none.
        reached = {e.host_id: int(e.details["reached_step"]) for e in acks if "reached_step" in e.details}
        assert set(reached) == {"host-0", "host-2"} and max(reached.values()) >= step, reached
        assert all(
            e.details["restore_source"] in ("memory", "host-shm") or "peer" in e.details["restore_source"]
            for e in acks
        )
        for a, b in zip(leaves(final), leaves(clean_final), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.array_equal(a, b), "parameters differ from the run without failure"
    finally:
        cluster.close()


def test_killing_the_host_of_process_0_is_recovered_and_bitwise_equal(
    tmp_path: Path, redis: RedisServer, clean_final: Path
) -> None:
    final, cluster = run_job(tmp_path, redis.url, spares=1, victim="host-0")
    try:
        after = cluster.topology()
        assert after.members[0].host_id == "spare-0"
        for a, b in zip(leaves(final), leaves(clean_final), strict=True):
            assert np.array_equal(a, b)
    finally:
        cluster.close()


def checksum_rows(folder: Path) -> list[dict[str, Any]]:
    """Every line the trainers wrote with --checksums, each with the file (one per process) it came from."""
    rows = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rows.append({**json.loads(line), "file": path.name})
    return rows


def test_without_a_spare_the_job_shrinks_onto_exactly_the_state_it_left(
    tmp_path: Path, redis: RedisServer
) -> None:
    """The state each member restores on the smaller mesh is, bit for bit, the state the run had
    after the step they restore (the newest the survivors held); the input resumes at that step, each of 2 hosts now reading 12
    rows of the same 24 records where 3 read 8, so every step trains on exactly its global batch (no
    record skipped or read twice); then training goes on and the loss keeps falling.

    The trainers write, per step, a checksum of the state the step began from (computed inside the
    jitted step: for an epoch's first step, the state it restored), of the state after it and of the
    global batch the step was given (assembled on the devices from each host's own rows).
    """
    checksums = tmp_path / "checksums"
    final, cluster = run_job(
        tmp_path,
        redis.url,
        spares=0,
        victim="host-2",
        coordinator_args=("--min-world-size", "2"),
        trainer_args=("--checksums", str(checksums)),
    )
    try:
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "host-1"]
        acks = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 2]
        assert sorted(e.host_id for e in acks) == ["host-0", "host-1"]
        # Both restored one step: one the survivors held (snapshots every FIRST_EVERY steps at first),
        # no older than the one before the kill.
        (restore,) = {int(e.details["restored_step"]) for e in acks}
        assert restore % FIRST_EVERY == 0 and restore >= KILL_AT - FIRST_EVERY, restore

        rows = checksum_rows(checksums)
        # The two checksums agree wherever a process ran two steps in a row: the device-side one and
        # the host-side one are the same function of the state.
        by_file: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
        for r in rows:
            by_file.setdefault((str(r["file"]), r["epoch"]), {})[r["step"]] = r
        pairs = [
            (steps[k]["state_out"], steps[k + 1]["state_in"])
            for steps in by_file.values()
            for k in steps
            if k + 1 in steps
        ]
        assert len(pairs) > STEPS and all(a == b for a, b in pairs)

        left = {r["state_out"] for r in rows if r["epoch"] == 1 and r["step"] == restore}
        assert len(left) == 1, f"the members disagree on the state after step {restore}: {left}"
        for host in ("host-0", "host-1"):
            first = min(
                (r for r in rows if r["epoch"] == 2 and str(r["file"]).startswith(f"{host}-")),
                key=lambda r: r["step"],
            )
            assert (first["step"], first["world_size"]) == (restore + 1, 2)
            assert first["state_in"] in left, f"{host} restored another state than step {restore}'s"

        # Every step each process ran, in either epoch, trained on the global batch a clean run
        # reads at that step: the rows the hosts read themselves, put together.
        expected = {s: checksum(np, [data.global_batch(s - 1, 24, 32, 0)]) for s in {r["step"] for r in rows}}
        wrong = [(r["epoch"], r["step"]) for r in rows if r["batch"] != expected[r["step"]]]
        assert not wrong, f"steps that trained on another batch than their own: {wrong[:5]}"
        # Epoch 1 may have gone past the restored step (those steps are trained again, by 2 hosts).
        assert {r["world_size"] for r in rows if r["epoch"] == 2} == {2}
        assert min(r["step"] for r in rows if r["epoch"] == 2) == restore + 1

        logged = steps_logged(cluster)
        assert {ws for _, _, ws in logged} == {3, 2}
        shrunk = [(s, loss) for s, loss, ws in logged if ws == 2]
        assert shrunk and shrunk[-1][0] == STEPS
        assert shrunk[-1][1] < logged[0][1], f"loss did not fall: {logged}"
        assert final.exists()
    finally:
        cluster.close()


def test_a_taken_jax_port_moves_the_job_to_a_new_address_and_blames_no_host(
    tmp_path: Path, redis: RedisServer, clean_final: Path
) -> None:
    """Another process listens on the port of epoch 1 (accepting connections, answering nothing)."""
    job = new_job_id()
    port = jax_port(job, 1)
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("::", port))
        squatter.listen()
        final, cluster = run_job(tmp_path, redis.url, spares=0, victim=None, job=job)
    try:
        events = cluster.events()
        refused = [e for e in events if e.type == pb.EVENT_TYPE_FAULT_REPORTED]
        assert [(e.host_id, e.details["kind"], e.details["epoch"]) for e in refused] == [
            ("host-0", "address_in_use", "1")
        ], [e.reason for e in refused]
        assert f":{port}" in refused[0].reason
        assert not [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD]
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "host-1", "host-2"]
        assert not after.jax_coordinator_address.endswith(f":{port}")
        # Nobody trained in the refused epoch: the run is the clean one.
        for a, b in zip(leaves(final), leaves(clean_final), strict=True):
            assert np.array_equal(a, b)
    finally:
        cluster.close()


# ---- recoveries restored from the checkpoint tiers -----------------------------------------------
# With --no-snapshots no member holds a host-memory snapshot of any step: every member of the new
# epoch, survivors included, restores the newest committed checkpoint at or below the epoch's
# restore step, and runs the steps after it again. Same world size (a hot spare) and the same data
# order, so the result must be the clean run's, bit for bit.


@pytest.fixture(scope="module")
def gcs() -> Iterator[FakeGcsServer]:
    with FakeGcsServer() as server:
        yield server


def assert_same_as_clean(final: Path, clean_final: Path) -> None:
    """Every leaf of the final state (parameters, optimizer state, step counter) is bitwise equal."""
    for a, b in zip(leaves(final), leaves(clean_final), strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert a.tobytes() == b.tobytes(), "the state differs from the run without failure"


def restored(cluster: Cluster, epoch: int) -> dict[str, tuple[int, str]]:
    """host -> (restored step, restore source) from the acknowledgements of ``epoch``."""
    return {
        e.host_id: (int(e.details["restored_step"]), e.details["restore_source"])
        for e in cluster.events()
        if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == epoch
    }


def test_a_recovery_restored_from_gcs_checkpoints_is_bitwise_equal(
    tmp_path: Path, redis: RedisServer, gcs: FakeGcsServer, clean_final: Path
) -> None:
    """Every member of the new epoch, the survivors too, restores the newest checkpoint the GCS
    emulator holds (no snapshots: the members hold nothing in memory); the run ends on the clean run's state."""
    final, cluster = run_gcs_job(tmp_path, redis.url, gcs)
    try:
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "spare-0", "host-2"]
        acks = restored(cluster, 2)
        assert sorted(acks) == ["host-0", "host-2", "spare-0"]
        assert len({s for s, _ in acks.values()}) == 1 and {t for _, t in acks.values()} == {"gcs"}, acks
        # A commit the coordinator accepted in epoch 1 (checkpoints every 5 steps): the newest, or
        # the one before where the newest one's marker was still on its way.
        step = acks["host-0"][0]
        assert step in (accepted := accepted_in(cluster, 1)) and step >= max(accepted) - 5, (step, accepted)
        assert_same_as_clean(final, clean_final)
    finally:
        cluster.close()


def test_snapshots_an_earlier_run_of_the_job_left_on_a_host_are_not_restored(
    tmp_path: Path, redis: RedisServer, clean_final: Path
) -> None:
    """A run of the job (another seed) is cut off while spare-0, a member by then, holds snapshots
    in /dev/shm; the job is launched again under the same id on a fresh coordinator state. When
    host-1 dies, spare-0 joins holding steps newer than any this run reached, of another timeline:
    its trainer deleted them when it started (another agent wrote them), the members restore what
    this run holds, and the result is the clean run's, bit for bit."""
    job = new_job_id()
    shm = Path("/dev/shm") / f"remesh-{job}-spare-0"

    def spare_holds() -> list[int]:
        return sorted(int(p.name.split("_")[1].split(".")[0]) for p in shm.glob("step_*.snap"))

    earlier = Cluster(tmp_path / "earlier", redis.url.rsplit("/", 1)[0] + "/1", job)
    try:
        earlier.start_coordinator("--world-size", "3")
        command = trainer(tmp_path / "earlier.npz", "--seed", "1")
        for h in ("host-0", "host-1", "host-2"):
            earlier.start_agent(h, trainer=command, env=ENV)
        earlier.start_agent("spare-0", spare=True, trainer=command, env=ENV)
        wait_for(
            lambda: (m := earlier.members().get("host-1")) is not None and m.last_step >= 5, 120, "step 5"
        )
        earlier.agents["host-1"].kill()
        wait_for(
            lambda: any(s >= KILL_AT + 10 for s in spare_holds()), 120, "spare-0 to snapshot past step 25"
        )
    finally:
        for proc in reversed(earlier.procs):  # cut off: what the trainers left in /dev/shm stays
            proc.close()
    stale = spare_holds()
    assert max(stale) >= KILL_AT + 10 and not (tmp_path / "earlier.npz").exists(), stale

    final, cluster = run_job(tmp_path / "again", redis.url, spares=1, victim="host-1", job=job)
    try:
        acks = restored(cluster, 2)
        assert sorted(acks) == ["host-0", "host-2", "spare-0"]
        (step,) = {s for s, _ in acks.values()}
        assert step < max(stale), (step, stale)  # this run's own step, not the earlier run's
        said = [
            line
            for line in cluster.agents["spare-0"].output().splitlines()
            if "host-memory snapshots of an earlier agent deleted" in line
        ]
        assert said, cluster.log_tails(20)
        assert_same_as_clean(final, clean_final)
    finally:
        cluster.close()


def accepted_in(cluster: Cluster, epoch: int) -> set[int]:
    """The steps whose checkpoint commits the coordinator accepted in ``epoch``."""
    return {
        int(e.details["step"])
        for e in cluster.events()
        if e.type == pb.EVENT_TYPE_CHECKPOINT_COMMITTED and e.epoch == epoch
    }


def flip_bytes(path: Path) -> None:
    data = path.read_bytes()
    middle = len(data) // 2
    path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 4]) + data[middle + 4 :])


def committed_steps(ckpt: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step_")) for p in ckpt.glob("step_*/COMMITTED"))


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one_and_stays_bitwise_equal(
    tmp_path: Path, redis: RedisServer, clean_final: Path
) -> None:
    """In a running job the newest committed local checkpoint (step 10 or later) is corrupted, then a
    host is killed: the new epoch restores the committed step before it, says so, and trains on to
    the clean result."""
    ckpt = tmp_path / "ckpt"  # one directory every host sees (a shared filesystem)
    corrupted: list[tuple[int, int, str]] = []  # (newest, previous, file)
    published: list[Samples] = []

    def corrupt(cluster: Cluster) -> None:
        published.append(scrape_once_heard(cluster, "host-0", "remesh_trainer_checkpoints_total", 1))
        *_, previous, newest = committed_steps(ckpt)
        step_dir = ckpt / f"step_{newest:010d}"
        files = json.loads((step_dir / "COMMITTED").read_text())["files"]
        name = max(files, key=lambda rel: files[rel]["size"])
        flip_bytes(step_dir / name)
        corrupted.append((newest, previous, name))

    final, cluster = run_job(
        tmp_path,
        redis.url,
        spares=1,
        victim="host-1",
        trainer_args=("--no-snapshots", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"),
        # Killing host-1 stops every member within a step: no newer checkpoint of epoch 1 follows.
        kill_when=lambda _: len(steps := committed_steps(ckpt)) >= 2 and steps[-1] >= 10,
        before_kill=corrupt,
        agent_args=("--metrics-port", "0"),
    )
    try:
        # Rank 0 (host-0) saved the replicated state, and told its agent: saves, bytes, time.
        (samples,) = published
        me = {"host": "host-0", "job_id": cluster.job}
        assert (value(samples, "remesh_trainer_checkpoint_bytes_total", **me) or 0) > 0
        assert (value(samples, "remesh_trainer_checkpoint_save_seconds_total", **me) or 0) > 0
        (newest, previous, name), *_ = corrupted
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "spare-0", "host-2"]
        # The corrupt step was the one to restore: the newest commit the coordinator accepted in
        # epoch 1 (the members hold nothing in memory)...
        assert max(accepted_in(cluster, 1)) == newest
        acks = restored(cluster, 2)
        assert acks == {h: (previous, "local") for h in ("host-0", "spare-0", "host-2")}, acks  # ...not it
        # Rank 0 (host-0) chose the step, and said why.
        fallback = [
            line
            for line in cluster.agents["host-0"].output().splitlines()
            if "corrupt checkpoint: falling back to the previous one" in line
        ]
        assert fallback and all(f"step={newest}" in line and name in line for line in fallback), fallback
        assert max(s for s, _, ws in steps_logged(cluster) if ws == 3) == STEPS
        assert_same_as_clean(final, clean_final)
    finally:
        cluster.close()


SPARSE_SNAPSHOTS = (
    "--snapshot-every", "10", "--checkpoint-every", "4", "--keep-checkpoints", "0", "--step-sleep", "0.3",
)  # fmt: skip


@pytest.mark.parametrize("case", ["newer-checkpoint", "newer-checkpoint-damaged", "on-rank-0s-disk"])
def test_a_checkpoint_newer_than_every_snapshot_is_restored_and_a_damaged_one_falls_back_to_memory(
    tmp_path: Path, redis: RedisServer, clean_final: Path, case: str
) -> None:
    """Snapshots every 10 steps, checkpoints every 4: killed past step 12, the members hold step 10
    in memory and the coordinator accepted a commit of step 12 or later. They restore that
    checkpoint, not the older step they hold (which would replay more steps); where every commit newer
    than step 10 is damaged, or on rank 0's own disk only (each host a checkpoint directory of its
    own), step 10 from memory, not an older checkpoint, and no process restarts over it."""
    own_disks = case == "on-rank-0s-disk"
    ckpt = tmp_path / "ckpt" / "host-0" if own_disks else tmp_path / "ckpt"
    damaged_steps: list[int] = []

    def damage(_: Cluster) -> None:
        for step in committed_steps(ckpt):
            if step > 10:
                step_dir = ckpt / f"step_{step:010d}"
                files = json.loads((step_dir / "COMMITTED").read_text())["files"]
                flip_bytes(step_dir / max(files, key=lambda rel: files[rel]["size"]))
                damaged_steps.append(step)

    final, cluster = run_job(
        tmp_path,
        redis.url,
        spares=1,
        victim="host-1",
        # 0.3 s a step: from the first commit past step 10 to the snapshot of step 20 are 7 steps,
        # time enough for the kill to land between them.
        trainer_args=(
            *SPARSE_SNAPSHOTS,
            "--checkpoint-dir",
            str(tmp_path / "ckpt" / "{host}") if own_disks else str(ckpt),
        ),
        kill_when=lambda _: any(step > 10 for step in committed_steps(ckpt)),
        before_kill=damage if case == "newer-checkpoint-damaged" else None,
    )
    try:
        epochs = {
            step: json.loads((ckpt / f"step_{step:010d}" / "COMMITTED").read_text())["epoch"]
            for step in committed_steps(ckpt)
        }
        newest = max(s for s, e in epochs.items() if e == 1)
        assert 10 < newest < 20, epochs
        acks = restored(cluster, 2)
        members = ("host-0", "spare-0", "host-2")
        if case == "newer-checkpoint":
            assert acks == {h: (newest, "local") for h in members}, acks
        else:
            assert own_disks or (damaged_steps and newest in damaged_steps)
            # The survivors served step 10 from their snapshots; the spare fetched it from them.
            assert {s for s, _ in acks.values()} == {10}, acks
            assert all(t in ("memory", "host-shm") or "peer" in t for _, t in acks.values()), acks
        if own_disks:
            # Rank 0 found the commits on its disk; host-2 and the spare did not, and said so.
            said = [
                line
                for line in cluster.agents["host-0"].output().splitlines()
                if "checkpoint not readable by every member" in line
            ]
            assert said, cluster.log_tails(20)
            # No process restarted over a checkpoint (a survivor stuck in a step of epoch 1 may hand
            # over to its warm standby: that restart names no checkpoint).
            restarts = [
                line
                for agent in cluster.agents.values()
                for line in agent.output().splitlines()
                if "in-process recovery impossible" in line and "why=checkpoint-gone" in line
            ]
            assert not restarts, restarts
        said = [
            line
            for line in cluster.agents["host-0"].output().splitlines()
            if "a committed checkpoint is newer than the newest step the members hold" in line
        ]
        assert said and all("held=10" in line and f"commit={newest}" in line for line in said), said
        assert_same_as_clean(final, clean_final)
    finally:
        cluster.close()


def test_a_host_whose_snapshots_are_slow_holds_the_others_back_rather_than_keep_other_steps(
    tmp_path: Path, redis: RedisServer, clean_final: Path
) -> None:
    """Snapshots every step, and host-2 copies each one slower than a step takes. Were it to skip the
    ones due while its last is on its way, as a job of one host does, its own timing would decide
    which steps it holds: a sharded state's members could then hold no step in common. The loop
    waits instead: host-2 keeps as many snapshots as host-0 (both every step), and the recovery
    takes the newest step, bitwise as if nothing had happened."""
    kept: dict[str, float] = {}

    def count_snapshots(cluster: Cluster) -> None:
        for host in ("host-0", "host-2"):
            samples = scrape_once_heard(cluster, host, "remesh_trainer_steps_total", KILL_AT - 3)
            me = {"host": host, "job_id": cluster.job}
            kept[host] = value(samples, "remesh_trainer_snapshots_total", **me) or 0

    final, cluster = run_job(
        tmp_path,
        redis.url,
        spares=1,
        victim="host-1",
        trainer_args=("--snapshot-every", "1"),
        host_env={"host-2": {"REMESH_FAULT_SNAPSHOT_SHARD_DELAY_S": "0.02"}},
        before_kill=count_snapshots,
        agent_args=("--metrics-port", "0"),
    )
    try:
        # Every step snapshotted on both (the totals reach the agent once a second: a step or two apart).
        assert kept["host-2"] >= KILL_AT - 3 and kept["host-2"] >= kept["host-0"] - 3, kept
        acks = [e for e in cluster.events() if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 2]
        assert sorted(e.host_id for e in acks) == ["host-0", "host-2", "spare-0"]
        (step,) = {int(e.details["restored_step"]) for e in acks}
        assert step >= KILL_AT - 2, step
        for a, b in zip(leaves(final), leaves(clean_final), strict=True):
            assert np.array_equal(a, b), "parameters differ from the run without failure"
    finally:
        cluster.close()

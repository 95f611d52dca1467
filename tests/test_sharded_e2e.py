"""Sharded state end to end: tinylm with its state sharded over every device of every host (FSDP) or
inside replica groups (HSDP), real coordinator, agents and JAX trainer processes, hosts SIGKILLed.

d_model 96 (and a 384-wide MLP) divides by 4, 6 and 8 devices: every weight matrix stays sharded at
every world size these jobs pass through.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import google_crc32c
import pytest

from remesh.elastic.cadence import CALIBRATE_AFTER, FIRST_EVERY, LEAST_EVERY
from remesh.embedded import FakeGcsServer, RedisServer
from remesh.v1 import coordinator_pb2 as pb
from tests.procs import Cluster, wait_for
from tests.test_elastic_e2e import (
    ENV,
    KILL_AT,
    STEPS,
    accepted_in,
    committed_steps,
    flip_bytes,
    leaves,
    new_job_id,
    run_gcs_job,
    run_job,
    steps_logged,
    trainer,
)

# Longer than run_job's own waits (tests.test_elastic_e2e), so that a hang fails with the logs.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FSDP = ("--sharding", "fsdp", "--d-model", "96")


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer(appendonly=False) as server:
        yield server


@pytest.fixture(scope="module")
def clean_fsdp(tmp_path_factory: pytest.TempPathFactory, redis: RedisServer) -> Iterator[tuple[Path, Path]]:
    """A clean FSDP run that also writes sharded checkpoints (every host its own shards)."""
    tmp = tmp_path_factory.mktemp("clean-fsdp")
    ckpt = tmp / "ckpt"
    final, cluster = run_job(
        tmp,
        redis.url,
        spares=0,
        victim=None,
        trainer_args=(*FSDP, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"),
    )
    cluster.close()
    yield final, ckpt


@pytest.fixture(scope="module")
def gcs() -> Iterator[FakeGcsServer]:
    with FakeGcsServer() as server:
        yield server


def acks(cluster: Cluster, epoch: int) -> dict[str, dict[str, int]]:
    """host -> restored bytes per tier, from the acknowledgements of ``epoch``."""
    return {
        e.host_id: json.loads(e.details.get("restored_bytes", "{}"))
        for e in cluster.events()
        if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == epoch
    }


def test_fsdp_a_killed_host_is_restored_from_its_buddy_copy_bitwise_equal(
    tmp_path: Path, redis: RedisServer, clean_fsdp: tuple[Path, Path]
) -> None:
    """FSDP over 3 hosts + 1 spare, snapshots (and buddy copies) every 3 steps: the spare takes the
    killed host's rank, its shards come from the buddy copy a survivor kept (no storage is
    configured at all), the steps after that snapshot are replayed, and the run ends on the clean
    run's state (snapshots every step), bit for bit."""
    final, cluster = run_job(
        tmp_path, redis.url, spares=1, victim="host-1", trainer_args=(*FSDP, "--snapshot-every", "3")
    )
    try:
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "spare-0", "host-2"]
        tiers = acks(cluster, 2)
        assert sorted(tiers) == ["host-0", "host-2", "spare-0"]
        # host-0 kept host-1's shards (rank 0 copies rank 1): the spare takes them from it.
        assert tiers["spare-0"].get("buddy", 0) > 0 and set(tiers["spare-0"]) <= {"buddy", "peer"}, tiers
        for survivor in ("host-0", "host-2"):
            # Its own shards, in the process or (restarted out of a collective with the dead) in /dev/shm.
            assert len(tiers[survivor]) == 1 and set(tiers[survivor]) <= {"memory", "host-shm"}, tiers
        restored = {
            e.details["restored_step"]
            for e in cluster.events()
            if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 2
        }
        assert len(restored) == 1 and (step := int(restored.pop())) % 3 == 0, restored
        assert step >= KILL_AT - 6, step  # the newest step the survivors held: snapshots every 3
        clean, _ = clean_fsdp
        for a, b in zip(leaves(final), leaves(clean), strict=True):
            assert (a.dtype, a.shape) == (b.dtype, b.shape)
            assert a.tobytes() == b.tobytes(), "the state differs from the run without failure"
    finally:
        cluster.close()


def cadences_agreed(cluster: Cluster) -> dict[str, list[tuple[int, int, str]]]:
    """host -> (from_step, every, proposals) of every snapshot cadence its trainers agreed on."""
    found: dict[str, list[tuple[int, int, str]]] = {}
    for log in cluster.tmp.glob("agent-*.log"):
        for line in log.read_text().splitlines():
            if "snapshot cadence agreed" in line:
                fields = dict(re.findall(r"(\w+)=(\[[^\]]*\]|\S+)", line))
                host = log.stem.removeprefix("agent-").rpartition("-")[0]  # agent-<host>-<n>.log
                found.setdefault(host, []).append(
                    (int(fields["from_step"]), int(fields["every"]), fields["proposals"])
                )
    return found


def test_an_automatic_snapshot_cadence_is_agreed_by_every_member_and_restores_bitwise_equal(
    tmp_path: Path, redis: RedisServer, clean_fsdp: tuple[Path, Path]
) -> None:
    """FSDP over 3 hosts + 1 spare with --snapshot-every auto: snapshots every 5 steps at first; at
    step 30 every member posts the interval its own step times call for, and from step 35 all take
    the largest. host-1 is SIGKILLed after that: the restore is a snapshot of the agreed cadence,
    the steps after it are replayed, and the run ends on the clean run's state, bit for bit."""
    first = CALIBRATE_AFTER * FIRST_EVERY
    agreed_from = first + FIRST_EVERY
    final, cluster = run_job(
        tmp_path,
        redis.url,
        spares=1,
        victim="host-1",
        # Slower steps than run_job's: the kill lands between the agreed step and the last.
        trainer_args=(*FSDP, "--snapshot-every", "auto", "--step-sleep", "0.25"),
        kill_when=lambda c: (m := c.members().get("host-1")) is not None and m.last_step >= agreed_from + 1,
    )
    try:
        agreed = cadences_agreed(cluster)
        # Every first-epoch member agreed on the same cadence, from the same step, on the same proposals.
        firsts = {host: runs[0] for host, runs in agreed.items() if host in ("host-0", "host-1", "host-2")}
        assert sorted(firsts) == ["host-0", "host-1", "host-2"], agreed
        assert len(set(firsts.values())) == 1, firsts
        from_step, every, proposals = firsts["host-0"]
        assert from_step == agreed_from and every >= LEAST_EVERY
        assert every == max(LEAST_EVERY, *(int(p) for p in proposals.strip("[]").split(",")))
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["host-0", "spare-0", "host-2"]
        restored = {
            int(e.details["restored_step"])
            for e in cluster.events()
            if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 2
        }
        assert len(restored) == 1 and (step := restored.pop()) >= agreed_from, restored
        assert (step - agreed_from) % every == 0 or step == STEPS, (step, every)
        clean, _ = clean_fsdp
        for a, b in zip(leaves(final), leaves(clean), strict=True):
            assert a.tobytes() == b.tobytes(), "the state differs from the run without failure"
    finally:
        cluster.close()


def test_a_loop_of_the_users_own_loses_rank_0_whose_buddy_copies_are_slower_than_a_step(
    tmp_path: Path, redis: RedisServer, clean_fsdp: tuple[Path, Path]
) -> None:
    """examples/tinylm/train_own_loop.py keeps its own loop (Session.epochs). Every buddy copy host-2
    makes (of rank 0's shards) takes 1 s longer than the loop's own shortest recent step, so longer
    than a step however loaded the machine is (and the loop's wait for it, about 1 s, stays under
    the 2 s a peer's collective waits): copies are made at the same steps on
    every host and never skipped, so host-2's loop waits for them and says so, and every host keeps
    its own snapshots as far back as a copy may lag. host-0 (rank 0) is SIGKILLed: the newest step
    host-2 copied is one every survivor still holds, the spare takes rank 0's shards from that copy,
    and the run ends on the state of the clean run of train_elastic (Session.run), bit for bit: the
    same model, data and steps. (With copies skipped while the one before was on its way, or own
    snapshots kept for only 3 steps, no step was held whole at 256 MB: the job halted.)

    host-1 compiles every epoch's step 3 s later than its peers, longer than a collective waits (2 s):
    its peers wait for it at ``epoch.jit``'s meeting, not in the step's first collective, and no
    trainer reports a fault before host-0 is killed. (With ``jax.jit`` every first step failed.)"""
    final = tmp_path / "final.npz"
    command = [
        sys.executable, "-m", "examples.tinylm.train_own_loop", "--steps", str(STEPS),
        "--d-model", "96", "--layers", "1", "--seq-len", "32", "--step-sleep", "0.05",
        "--save-final", str(final),
        "--snapshot-every", "1",  # a copy due at every step, and each slower than a step
    ]  # fmt: skip
    final, cluster = run_job(
        tmp_path,
        redis.url,
        spares=1,
        victim="host-0",
        command=command,
        host_env={
            "host-1": {"REMESH_FAULT_COMPILE_DELAY_S": "3.0"},
            "host-2": {"REMESH_FAULT_BUDDY_COPY_DELAY_S": "1.0"},
        },
    )
    try:
        after = cluster.topology()
        assert after.epoch == 2 and [m.host_id for m in after.members] == ["spare-0", "host-1", "host-2"]
        events = cluster.events()
        dead = next(i for i, e in enumerate(events) if e.type == pb.EVENT_TYPE_MEMBER_DEAD)
        assert events[dead].host_id == "host-0"
        early = [e.reason for e in events[:dead] if e.type == pb.EVENT_TYPE_FAULT_REPORTED]
        assert early == [], f"faults before host-0 was killed: {early}"
        host1 = "".join(p.read_text(errors="replace") for p in cluster.tmp.glob("agent-host-1-*.log"))
        assert host1.count("step compiled; every member has") >= 2  # in epochs 1 and 2
        tiers = acks(cluster, 2)
        assert tiers["spare-0"].get("buddy", 0) > 0 and set(tiers["spare-0"]) <= {"buddy", "peer"}, tiers
        told = "".join(p.read_text(errors="replace") for p in cluster.tmp.glob("agent-host-2-*.log"))
        assert "buddy copies take longer than the steps between them" in told
        assert "buddy copy not made" not in told.split("epoch=2")[0]  # none skipped before the kill
        clean, _ = clean_fsdp
        for a, b in zip(leaves(final), leaves(clean), strict=True):
            assert a.tobytes() == b.tobytes(), "the state differs from the run without failure"
    finally:
        cluster.close()


def test_fsdp_restored_from_the_shards_every_host_wrote_to_gcs_is_bitwise_equal(
    tmp_path: Path, redis: RedisServer, gcs: FakeGcsServer, clean_fsdp: tuple[Path, Path]
) -> None:
    """No host-memory tier at all (so no buddy copies either): every host writes its own shards
    straight to the GCS emulator every 5 steps, rank 0 commits; after a SIGKILL every member of
    the new epoch reads its shards of the newest commit from GCS, and the run ends bitwise equal."""
    final, cluster = run_gcs_job(tmp_path, redis.url, gcs, *FSDP)
    try:
        after = cluster.topology()
        assert [m.host_id for m in after.members] == ["host-0", "spare-0", "host-2"]
        tiers = acks(cluster, 2)
        assert sorted(tiers) == ["host-0", "host-2", "spare-0"]
        assert all(set(t) == {"gcs"} and t["gcs"] > 0 for t in tiers.values()), tiers
        restored = {
            int(e.details["restored_step"])
            for e in cluster.events()
            if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 2
        }
        assert len(restored) == 1 and (step := restored.pop()) in (accepted := accepted_in(cluster, 1)), (
            restored
        )
        assert step >= max(accepted) - 5, (step, accepted)  # the newest, or the one before it
        clean, _ = clean_fsdp
        for a, b in zip(leaves(final), leaves(clean), strict=True):
            assert a.tobytes() == b.tobytes(), "the state differs from the run without failure"
    finally:
        cluster.close()


def test_fsdp_restored_from_the_pieces_every_host_wrote_to_a_local_directory_is_bitwise_equal(
    tmp_path: Path, redis: RedisServer, clean_fsdp: tuple[Path, Path]
) -> None:
    """No host-memory tier: every 5 steps each host writes its own pieces as one plain file
    (--checkpoint-format pieces), rank 0 commits once all say they wrote. Just before the SIGKILL the
    newest committed step's file of rank 0 is damaged (same size), and so is a commit still on its
    way then: the new epoch's members check the step's files a share each, whoever holds the
    damaged one says so, and every member assembles its shards from the step before the first
    damaged one; the run ends bitwise equal."""
    ckpt = tmp_path / "ckpt"
    damaged: list[int] = []

    def epoch_1_steps() -> list[int]:
        return [
            step
            for step in committed_steps(ckpt)
            if json.loads((ckpt / f"step_{step:010d}" / "COMMITTED").read_text())["epoch"] == 1
        ]

    def damage(step: int) -> None:
        flip_bytes(ckpt / f"step_{step:010d}" / "state" / "process_00000.pieces")
        damaged.append(step)

    def keep_damaging(cluster: Cluster) -> None:
        # A commit on its way at the kill (every member had written, rank 0 not yet committed) may
        # still land, until epoch 2 is published: then the coordinator accepts no commit of epoch
        # 1 any more. Each one is damaged too, so that the restore meets only damaged steps.
        deadline = time.monotonic() + 60
        while True:
            published = cluster.topology().epoch >= 2
            for step in epoch_1_steps():
                if step > damaged[0] and step not in damaged:
                    damage(step)
            if published or time.monotonic() > deadline:
                return
            time.sleep(0.005)

    def damage_the_newest_step(cluster: Cluster) -> None:
        damage(max(epoch_1_steps()))
        watcher.append(threading.Thread(target=keep_damaging, args=(cluster,), daemon=True))
        watcher[0].start()

    watcher: list[threading.Thread] = []
    final, cluster = run_job(
        tmp_path,
        redis.url,
        spares=1,
        victim="host-1",
        # Once two steps are committed, so that the damaged one has one before it (host-1 registered
        # long before: members() holds it).
        kill_when=lambda c: len(committed_steps(ckpt)) >= 2 and c.members()["host-1"].last_step >= KILL_AT,
        before_kill=damage_the_newest_step,
        trainer_args=(
            *FSDP,
            "--no-snapshots",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-format",
            "pieces",
            "--checkpoint-every",
            "5",
        ),
    )
    try:
        tiers = acks(cluster, 2)
        assert sorted(tiers) == ["host-0", "host-2", "spare-0"]
        assert all(set(t) == {"local"} and t["local"] > 0 for t in tiers.values()), tiers
        (restored,) = {
            int(e.details["restored_step"])
            for e in cluster.events()
            if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == 2
        }
        watcher[0].join()
        assert restored == damaged[0] - 5, (restored, damaged)
        said = [
            h
            for h in ("host-0", "host-2", "spare-0")
            if "every member falls back" in cluster.agents[h].output()
        ]
        assert said, "no member said it fell back from the damaged step"
        step_dir = max(p.parent for p in ckpt.glob("step_*/COMMITTED"))
        # One file per process and its writer's digest of it, and no Orbax data beside them.
        assert sorted(p.name for p in (step_dir / "state").iterdir()) == [
            f"process_{r:05d}.pieces{suffix}" for r in range(3) for suffix in ("", ".crc32c")
        ]
        clean, _ = clean_fsdp
        for a, b in zip(leaves(final), leaves(clean), strict=True):
            assert a.tobytes() == b.tobytes(), "the state differs from the run without failure"
    finally:
        cluster.close()


PLAIN_ORBAX = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    path, final = sys.argv[1], sys.argv[2]
    meta = ocp.PyTreeCheckpointer().metadata(path)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))

    def target(m):
        shape = tuple(m.shape)
        spec = P("b") if shape and shape[0] % 2 == 0 else P()
        return jax.ShapeDtypeStruct(shape, m.dtype, sharding=NamedSharding(mesh, spec))

    abstract = jax.tree.map(target, tree)
    state = ocp.PyTreeCheckpointer().restore(
        path, args=ocp.args.PyTreeRestore(item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
    )
    assert not [m for m in sys.modules if m.startswith("remesh")], "remesh was imported"
    restored = jax.tree_util.tree_leaves(state)
    assert all(len(x.sharding.device_set) == 4 for x in restored)
    np.savez(final, *[np.asarray(x) for x in restored])
    print("restored", len(restored), "leaves on", dict(mesh.shape))
    """
)


def test_a_sharded_checkpoint_restores_with_plain_orbax_onto_another_mesh(
    tmp_path: Path, clean_fsdp: tuple[Path, Path]
) -> None:
    """The checkpoint every host wrote its shards into (6 devices, FSDP) restores in a process with no
    remesh import, onto a 2x2 mesh with other shardings, to the values of the run at that step."""
    _, ckpt = clean_fsdp
    step_dir = ckpt / f"step_{STEPS:010d}"
    assert (step_dir / "COMMITTED").is_file()
    marker = json.loads((step_dir / "COMMITTED").read_text())
    # Every process wrote: Orbax keeps one data folder per writing process.
    writers = {p.name for p in (step_dir / "state").glob("ocdbt.process_*")}
    assert len(writers) == 3, writers
    # ... and told the digests of its own files, which the commit took: each is the file's CRC32C.
    told = {}
    for i in range(3):
        told.update(json.loads((step_dir / f"digests.process_{i:05d}.json").read_text()))
    assert {rel.split("/")[1] for rel in told if rel.split("/")[1].startswith("ocdbt.")} == writers
    for rel, entry in marker["files"].items():
        crc = base64.b64encode(google_crc32c.Checksum((step_dir / rel).read_bytes()).digest()).decode()
        assert entry["digest"] == f"crc32c:{crc}", rel
        assert rel not in told or told[rel] == entry, rel
    assert marker["step"] == STEPS
    out = tmp_path / "restored.npz"
    script = tmp_path / "plain_orbax.py"
    script.write_text(PLAIN_ORBAX)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    done = subprocess.run(
        [sys.executable, str(script), str(step_dir / "state"), str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    clean, _ = clean_fsdp
    for a, b in zip(leaves(out), leaves(clean), strict=True):
        assert a.tobytes() == b.tobytes()


def test_hsdp_a_lost_host_comes_from_the_other_group_a_lost_group_shrinks_and_returning_hosts_grow(
    tmp_path: Path, redis: RedisServer
) -> None:
    """HSDP, 2 replica groups of 2 hosts + 1 spare. Kill host-1: the spare takes its rank and its
    shards from the other group's host. Kill both hosts of the second group: no spare is left, the
    job continues on the remaining group, whose hosts hold every shard already, and the loss keeps
    falling. Start those two hosts again: the job grows back to two groups, the returning hosts
    taking their shards from the members that hold them."""
    cluster = Cluster(tmp_path, redis.url, new_job_id())
    final = tmp_path / "final.npz"
    # Snapshots every step: the restore of the grown epoch is then the newest step of all.
    command = trainer(
        final, "--sharding", "hsdp", "--hosts-per-replica", "2", "--d-model", "96", "--snapshot-every", "1"
    )
    command[command.index("--steps") + 1] = "60"
    try:
        cluster.start_coordinator("--world-size", "4", "--min-world-size", "2")
        for h in ("host-0", "host-1", "host-2", "host-3"):
            cluster.start_agent(h, trainer=command, env=ENV)
        cluster.start_agent("spare-0", spare=True, trainer=command, env=ENV)

        def at(host: str, step: int) -> bool:
            member = cluster.members().get(host)
            return member is not None and member.last_step >= step

        wait_for(lambda: at("host-1", KILL_AT), 180, "host-1 at the first kill")
        cluster.agents["host-1"].kill()
        wait_for(lambda: at("spare-0", 30), 120, "the spare to train")
        cluster.agents["host-2"].kill()
        cluster.agents["host-3"].kill()
        wait_for(
            lambda: (
                [m.host_id for m in cluster.topology().members] == ["host-0", "spare-0"] and at("host-0", 38)
            ),
            120,
            "the job to train on one group",
        )
        shrunk_epoch = cluster.topology().epoch
        at_return = cluster.members()["host-0"].last_step
        for h in ("host-2", "host-3"):  # the hosts come back (as spares) and the job grows
            cluster.start_agent(h, trainer=command, env=ENV)
        wait_for(final.exists, 180, "the job to finish")

        replaced = acks(cluster, 2)
        assert replaced["spare-0"].get("peer", 0) > 0 and "buddy" not in replaced["spare-0"], replaced
        shrunk = acks(cluster, shrunk_epoch)
        assert set(shrunk) == {"host-0", "spare-0"}
        # Each survivor already held its group's shards: the new mesh needed no byte from anyone.
        assert all(len(t) == 1 and set(t) <= {"memory", "host-shm"} for t in shrunk.values()), shrunk
        after = cluster.topology()
        members = [m.host_id for m in after.members]
        assert members[:2] == ["host-0", "spare-0"] and sorted(members[2:]) == ["host-2", "host-3"], after
        grown = acks(cluster, after.epoch)
        # The returning hosts' old snapshots (from where they left) do not send the job back.
        steps = {
            int(e.details["restored_step"])
            for e in cluster.events()
            if e.type == pb.EVENT_TYPE_EPOCH_ACKED and e.epoch == after.epoch
        }
        assert len(steps) == 1 and steps.pop() >= at_return, (steps, at_return)
        for host in ("host-2", "host-3"):
            assert grown[host].get("peer", 0) > 0 and set(grown[host]) == {"peer"}, grown
        logged = steps_logged(cluster)
        assert {ws for _, _, ws in logged} == {4, 2}
        two = [(s, loss) for s, loss, ws in logged if ws == 2]
        assert two and two[-1][1] < logged[0][1], logged
        assert max(s for s, _, ws in logged if ws == 4) == 60
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{cluster.log_tails(25)}") from exc
    finally:
        cluster.close()


def test_when_no_tier_holds_any_step_the_job_halts_saying_why_never_at_step_0(
    tmp_path: Path, redis: RedisServer
) -> None:
    """FSDP with no host-memory snapshots, no buddy copies and no checkpoint tier: a killed host's
    shards exist nowhere. The trainers of the new epoch report it, the coordinator halts the job
    with the reason, and no trainer trains from step 0."""
    cluster = Cluster(tmp_path, redis.url, new_job_id())
    command = trainer(tmp_path / "final.npz", *FSDP, "--no-snapshots")
    try:
        cluster.start_coordinator("--world-size", "3")
        for h in ("host-0", "host-1", "host-2"):
            cluster.start_agent(h, trainer=command, env=ENV)
        cluster.start_agent("spare-0", spare=True, trainer=command, env=ENV)
        wait_for(
            lambda: (m := cluster.members().get("host-1")) is not None and m.last_step >= KILL_AT,
            180,
            "host-1 to train",
        )
        cluster.agents["host-1"].kill()
        halted = wait_for(lambda: (t := cluster.topology()).halted and t, 120, "the job to halt")
        assert "no tier holds any step" in halted.reason, halted.reason
        assert f"survivors had completed step {halted.restore_step}" in halted.reason, halted.reason
        assert halted.restore_step >= 1  # the job had completed steps: nobody starts it from scratch
        events = cluster.events()
        lost = [
            e for e in events if e.type == pb.EVENT_TYPE_FAULT_REPORTED and e.details["kind"] == "state_lost"
        ]
        assert lost and all(e.reason.startswith("state_lost") for e in lost)
        assert not [e for e in events if e.type == pb.EVENT_TYPE_MEMBER_DEAD and e.host_id != "host-1"]
        scratch = [
            e
            for e in events
            if e.type == pb.EVENT_TYPE_EPOCH_ACKED
            and e.epoch > 1
            and e.details["restore_source"] == "scratch"
        ]
        assert not scratch, "a trainer started again from step 0"
        assert not (tmp_path / "final.npz").exists()
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{cluster.log_tails(25)}") from exc
    finally:
        cluster.close()

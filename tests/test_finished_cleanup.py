"""A finished job leaves nothing in /dev/shm: the agent deletes the host-memory snapshot directory its
trainers wrote, a spare's too (its standby trainer, stopped when the job finishes, never does).
Real coordinator, real agents; the trainers are small scripts on the agent's local API."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from remesh.v1 import coordinator_pb2 as pb
from remesh.v1.contract import SNAPSHOT_OWNER_FILE, snapshot_dir_name
from tests.procs import Cluster, wait_for

pytestmark = pytest.mark.integration

# Claims its host's snapshot directory as a Session does (the owner file names the agent session);
# with a rank it acknowledges the epoch and, once the spare's directory is there too, finishes the
# job at step 3; without, it waits.
TRAINER = textwrap.dedent(
    f"""
    import os, time
    from pathlib import Path
    import grpc
    from remesh.v1 import agent_pb2 as apb, agent_pb2_grpc as apb_grpc
    from remesh.v1.contract import Env, TrainerAssignment

    given = TrainerAssignment.from_env(os.environ)
    directory = Path("/dev/shm") / f"remesh-{{given.job_id}}-{{given.host_id}}"
    directory.mkdir(exist_ok=True)
    (directory / "{SNAPSHOT_OWNER_FILE}").write_text(os.environ[Env.AGENT_SESSION])
    (directory / "step_3.snap").write_bytes(b"x" * 4096)
    if given.rank < 0:
        time.sleep(600)
    # Finishes once every host's trainer keeps snapshots (the spare's too), so that there is something
    # to delete.
    hosts = os.environ["EVERY_HOST"].split(",")
    while not all((directory.parent / f"remesh-{{given.job_id}}-{{h}}").exists() for h in hosts):
        time.sleep(0.05)
    stub = apb_grpc.AgentLocalStub(grpc.insecure_channel(given.agent_address))
    stub.AckEpoch(apb.LocalAckRequest(epoch=given.epoch, restored_step=-1), timeout=20)
    stub.ReportProgress(apb.ReportProgressRequest(step=3, epoch=given.epoch), timeout=20)
    stub.Finish(apb.LocalFinishRequest(epoch=given.epoch, step=3), timeout=20)
    """
)


def test_a_finished_job_leaves_no_snapshots_in_host_memory_not_even_a_spares(
    cluster: Cluster, tmp_path: Path
) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    cluster.start_coordinator("--world-size", "1")
    env = {**os.environ, "EVERY_HOST": "host-0,spare-0"}
    trainer = [sys.executable, str(script)]
    active = cluster.start_agent("host-0", trainer=trainer, extra=("--no-warm-standby",), env=env)
    spare = cluster.start_agent("spare-0", spare=True, trainer=trainer, extra=("--no-warm-standby",), env=env)
    directories = [Path("/dev/shm") / snapshot_dir_name(cluster.job, h) for h in ("host-0", "spare-0")]
    try:
        wait_for(
            lambda: any(e.type == pb.EVENT_TYPE_JOB_FINISHED for e in cluster.events()),
            60,
            "the job to finish",
        )
        wait_for(lambda: not active.alive() and not spare.alive(), 60, "both agents to exit")
        assert (active.popen.returncode, spare.popen.returncode) == (0, 0), cluster.log_tails()
        assert [d for d in directories if d.exists()] == [], cluster.log_tails()
    finally:
        for d in directories:
            if d.exists():
                for f in d.iterdir():
                    f.unlink()
                d.rmdir()

"""A stand-in trainer: no JAX, just the agent's local API (``python -m remesh.agent.standin``).

It exercises the control plane (tests, the detection benchmark) without the cost of a JAX process.

It reads its assignment from the environment the agent sets, acknowledges its epoch, then reports a
step every STEP_S seconds; on a new epoch it acknowledges that one and carries on from the restore
step. While its host holds no rank (a spare, or shrunk away) it waits in standby; it exits 0 when
the job halts.

Failure injection, keyed on the step: ``STAND_IN_FAIL_AT=STEP:CODE`` exits with CODE on reaching
STEP (in epoch 1 only, so a restarted trainer runs on), ``STAND_IN_FAIL_AT=STEP:hang`` stops reporting progress there.
"""

from __future__ import annotations

import os
import sys
import time

import grpc

from remesh.v1 import agent_pb2 as apb
from remesh.v1 import agent_pb2_grpc as apb_grpc

STEP_S = float(os.environ.get("STAND_IN_STEP_S", "0.05"))


def _injected_failure() -> tuple[int, str] | None:
    raw = os.environ.get("STAND_IN_FAIL_AT", "")
    if not raw:
        return None
    step, _, what = raw.partition(":")
    return int(step), what


def _placed(stub: apb_grpc.AgentLocalStub, after_epoch: int) -> apb.Assignment:
    """Standby until an epoch newer than ``after_epoch`` gives this host a rank."""
    slot = int(os.environ.get("REMESH_TRAINER_SLOT", "0"))
    for assignment in stub.WatchAssignments(apb.WatchAssignmentsRequest(after_epoch=after_epoch, slot=slot)):
        if assignment.topology.halted:
            sys.exit(0)
        if assignment.rank >= 0:
            return assignment
    raise RuntimeError("the agent closed the assignment stream")


def main() -> int:
    stub = apb_grpc.AgentLocalStub(grpc.insecure_channel(os.environ["REMESH_AGENT_ADDRESS"]))
    epoch = int(os.environ["REMESH_EPOCH"])
    step = max(int(os.environ.get("REMESH_RESTORE_STEP", "-1")), 0)
    if int(os.environ["REMESH_RANK"]) < 0:
        assignment = _placed(stub, epoch)
        epoch, step = assignment.topology.epoch, max(assignment.topology.restore_step, 0)
    stub.AckEpoch(apb.LocalAckRequest(epoch=epoch, restored_step=step, restore_source="stand-in"), timeout=5)
    failure = _injected_failure()
    while True:
        time.sleep(STEP_S)
        step += 1
        if failure and epoch == 1 and step >= failure[0]:
            if failure[1] == "hang":
                time.sleep(3600)
            return int(failure[1])
        reply = stub.ReportProgress(apb.ReportProgressRequest(step=step, epoch=epoch), timeout=5)
        if reply.current_epoch > epoch:
            assignment = _placed(stub, epoch)
            epoch = assignment.topology.epoch
            step = max(assignment.topology.restore_step, 0)
            stub.AckEpoch(
                apb.LocalAckRequest(epoch=epoch, restored_step=step, restore_source="stand-in"), timeout=5
            )


if __name__ == "__main__":
    sys.exit(main())

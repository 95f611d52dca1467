"""A stand-in trainer: no JAX, just the agent's local API (``python -m remesh.embedded.standin``).

It exercises the control plane (tests, the detection benchmark) without the cost of a JAX process.

It reads its assignment from the environment the agent sets, acknowledges its epoch, then reports a
step every STEP_S seconds; on a new epoch it acknowledges that one and carries on from the restore
step. While its host holds no rank (a spare, or shrunk away) it waits in standby; it exits 0 when
the job halts.

A transient error from the local API is retried with a bounded backoff, never a reason to exit: the
agent forwards an acknowledgement to the coordinator, which answers UNAVAILABLE while its leader
fails over, and a loaded machine may let a call run past its deadline. A stand-in that exited there
would be reported as a trainer fault and its healthy host evicted. An acknowledgement the
coordinator refuses (a newer epoch superseded it) is logged and dropped: the next progress report
tells the stand-in about the newer epoch.

Failure injection, keyed on the step: ``STAND_IN_FAIL_AT=STEP:CODE`` exits with CODE on reaching
STEP (in epoch 1 only, so a restarted trainer runs on), ``STAND_IN_FAIL_AT=STEP:hang`` stops reporting progress there.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

from remesh.v1 import agent_pb2 as apb
from remesh.v1 import agent_pb2_grpc as apb_grpc
from remesh.v1.contract import TrainerAssignment

STEP_S = float(os.environ.get("STAND_IN_STEP_S", "0.05"))
# Per call: the agent answers from memory, except AckEpoch, which it relays to the coordinator (and
# retries there for up to 8 s). An acknowledgement that runs past this is sent again: the
# coordinator records one per host and epoch.
CALL_TIMEOUT_S = 5.0
# The codes worth another try: no coordinator leads yet (UNAVAILABLE, also from a follower), or the
# machine is too busy to answer in time (DEADLINE_EXCEEDED).
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# How long to keep retrying one call: past a leader failover (a few seconds) with a wide margin. An
# agent that does not answer for this long is gone, and so, shortly, is this process.
RETRY_FOR_S = 30.0
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
# Attempts are bounded by count as well as time (each attempt may take up to CALL_TIMEOUT_S).
RETRY_ATTEMPTS = 50

Reply = TypeVar("Reply")


def _injected_failure() -> tuple[int, str] | None:
    raw = os.environ.get("STAND_IN_FAIL_AT", "")
    if not raw:
        return None
    step, _, what = raw.partition(":")
    return int(step), what


def _say(message: str) -> None:
    print(f"stand-in: {message}", file=sys.stderr, flush=True)


def _retrying(what: str, call: Callable[[], Reply]) -> Reply:
    """``call()``, retried on a transient code with a doubling backoff for up to RETRY_FOR_S."""
    deadline = time.monotonic() + RETRY_FOR_S
    delay = RETRY_FIRST_S
    for attempt in range(1, RETRY_ATTEMPTS + 1):
        try:
            return call()
        except grpc.RpcError as exc:
            code = exc.code()
            if code not in TRANSIENT or attempt == RETRY_ATTEMPTS or time.monotonic() + delay > deadline:
                raise
            _say(f"{what} failed ({code.name}: {exc.details()}); retry {attempt} in {delay:.2f}s")
        time.sleep(delay)
        delay = min(delay * 2, RETRY_MAX_S)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _ack(stub: apb_grpc.AgentLocalStub, epoch: int, step: int) -> None:
    request = apb.LocalAckRequest(epoch=epoch, restored_step=step, restore_source="stand-in")
    try:
        _retrying(f"AckEpoch({epoch})", lambda: stub.AckEpoch(request, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as exc:
        # Refused (FAILED_PRECONDITION: the epoch was superseded) or still failing after RETRY_FOR_S:
        # carry on either way. The next progress report names any newer epoch.
        _say(f"AckEpoch({epoch}) not delivered ({exc.code().name}: {exc.details()}); carrying on")


def _assignments(stub: apb_grpc.AgentLocalStub, after_epoch: int, slot: int) -> Iterator[apb.Assignment]:
    """The agent's assignments, the stream re-opened (bounded) if a transient error breaks it."""
    request = apb.WatchAssignmentsRequest(after_epoch=after_epoch, slot=slot)
    for reopened in range(RETRY_ATTEMPTS):
        try:
            yield from stub.WatchAssignments(request)
            return
        except grpc.RpcError as exc:
            if exc.code() not in TRANSIENT or reopened == RETRY_ATTEMPTS - 1:
                raise
            _say(f"WatchAssignments broke ({exc.code().name}: {exc.details()}); re-opening")
        time.sleep(min(RETRY_FIRST_S * 2**reopened, RETRY_MAX_S))


def _placed(stub: apb_grpc.AgentLocalStub, after_epoch: int) -> apb.Assignment:
    """Standby until an epoch newer than ``after_epoch`` gives this host a rank."""
    slot = TrainerAssignment.from_env(os.environ).slot
    for assignment in _assignments(stub, after_epoch, slot):
        if assignment.topology.halted:
            sys.exit(0)
        if assignment.rank >= 0:
            return assignment
    raise RuntimeError("the agent closed the assignment stream")


def main() -> int:
    given = TrainerAssignment.from_env(os.environ)
    stub = apb_grpc.AgentLocalStub(grpc.insecure_channel(given.agent_address))
    epoch, step = given.epoch, max(given.restore_step, 0)
    if given.rank < 0:
        assignment = _placed(stub, epoch)
        epoch, step = assignment.topology.epoch, max(assignment.topology.restore_step, 0)
    _ack(stub, epoch, step)
    failure = _injected_failure()
    # Running totals, as the trainer library sends them (the agent's remesh_trainer_* metrics).
    totals = apb.TrainerTotals()
    last = time.monotonic()
    while True:
        time.sleep(STEP_S)
        step += 1
        now = time.monotonic()
        totals.steps += 1
        totals.step_seconds += now - last
        last = now
        if failure and epoch == 1 and step >= failure[0]:
            if failure[1] == "hang":
                time.sleep(3600)
            return int(failure[1])
        progress = functools.partial(
            stub.ReportProgress,
            apb.ReportProgressRequest(step=step, epoch=epoch, totals=totals),
            timeout=CALL_TIMEOUT_S,
        )
        reply = _retrying(f"ReportProgress({step})", progress)
        if reply.current_epoch > epoch:
            assignment = _placed(stub, epoch)
            epoch = assignment.topology.epoch
            step = max(assignment.topology.restore_step, 0)
            _ack(stub, epoch, step)
            last = time.monotonic()  # an epoch's first step is not timed


if __name__ == "__main__":
    sys.exit(main())

"""The agent's decisions (remesh.agent.core), each rule on its own: no processes, no gRPC, no clock."""

from __future__ import annotations

import signal

import pytest

from remesh.agent.core import (
    LEASE_FLOOR_S,
    AgentState,
    Do,
    Fault,
    Standing,
    Starts,
    TrainerExit,
    hung,
    lease_lost,
    lease_s,
    on_fault_reply,
    on_topology,
    on_trainer_exit,
    rank_in,
)
from remesh.v1.contract import ADDRESS_IN_USE_EXIT_CODE, RESTART_EXIT_CODE, STATE_LOST_EXIT_CODE

# ---- topology ------------------------------------------------------------------------------------

IDLE = {"current_epoch": 3, "epoch": 4, "halted": False, "halt_reason": "", "trainer_running": False}
FRESH = AgentState()
DONE = FRESH.finished()
# Its trainer died as collateral damage of epoch 4.
WAITING = FRESH.trainer_died_with(4)


@pytest.mark.parametrize(
    ("state", "change", "do", "said"),
    [
        (FRESH, {}, Do.START_TRAINER, "no trainer runs for epoch 4"),
        (FRESH, {"epoch": 2}, Do.NOTHING, "older"),
        (FRESH, {"epoch": 3}, Do.START_TRAINER, "epoch 3"),  # the same epoch again, and nothing runs
        (
            FRESH,
            {"halted": True, "halt_reason": "below the minimum"},
            Do.STOP_ALL_AND_EXIT,
            "below the minimum",
        ),
        (FRESH, {"halted": True, "trainer_running": True}, Do.STOP_ALL_AND_EXIT, "halted"),
        (FRESH, {"trainer_running": True}, Do.NOTHING, "in-process"),
        (DONE, {}, Do.NOTHING, "completed the job"),
        (DONE, {"halted": True}, Do.STOP_ALL_AND_EXIT, "halted"),
        # A trainer that died with epoch 4 as collateral damage starts on epoch 5, not again on 4.
        (WAITING, {}, Do.NOTHING, "newer one"),
        (WAITING, {"epoch": 5}, Do.START_TRAINER, "epoch 5"),
    ],
)
def test_a_topology(state: AgentState, change: dict[str, object], do: Do, said: str) -> None:
    decision = on_topology(state, **{**IDLE, **change})  # type: ignore[arg-type]
    assert decision.do is do and said in decision.reason, decision
    if do is Do.STOP_ALL_AND_EXIT:
        assert decision.exit_code == 3


def test_a_halt_that_is_stale_is_ignored() -> None:
    assert on_topology(FRESH, **{**IDLE, "epoch": 1, "halted": True}).do is Do.NOTHING  # type: ignore[arg-type]


# ---- the agent's state -----------------------------------------------------------------------------


def test_standing_and_the_lease_clock() -> None:
    cut = FRESH.registered(epoch=1, as_spare_listed_with_rank=False).unreachable(10.0)
    assert (cut.standing, cut.lost_at) == (Standing.CUT_OFF, 10.0)
    # Failing again and again does not move the clock: it runs from the first moment.
    assert cut.unreachable(12.0).lost_at == 10.0
    # A follower answered: not cut off, whatever the leader's state; the clock stops.
    assert (cut.answered().standing, cut.answered().lost_at) == (Standing.DISCONNECTED, None)
    back = cut.registered(epoch=2, as_spare_listed_with_rank=False)
    assert (back.standing, back.lost_at, back.unranked_through) == (Standing.CONNECTED, None, 0)


def test_registering_as_a_spare_while_the_epoch_lists_the_old_rank_gives_it_up() -> None:
    state = FRESH.registered(epoch=5, as_spare_listed_with_rank=True)
    assert state.unranked_through == 5
    # A later registration that is not listed keeps what the earlier one gave up.
    assert state.registered(epoch=6, as_spare_listed_with_rank=False).unranked_through == 5


def test_starting_trainers() -> None:
    assert (WAITING.starts, WAITING.restart_after) == (Starts.NEWER_EPOCH, 4)
    assert WAITING.trainer_started().starts is Starts.ANY_EPOCH
    # Once the job completed nothing brings a trainer back.
    assert DONE.trainer_died_with(7).starts is Starts.NEVER
    assert DONE.trainer_started().starts is Starts.NEVER


# ---- rank --------------------------------------------------------------------------------------------


def test_a_host_that_registered_again_holds_no_rank_in_the_epochs_that_still_list_it() -> None:
    # Re-registration (a new incarnation, as a spare) while epoch 5 was current and listed it at rank 2.
    assert rank_in(5, 2, unranked_through=5) == -1
    assert rank_in(4, 2, unranked_through=5) == -1
    assert rank_in(6, 1, unranked_through=5) == 1  # a newer epoch may give it a rank again
    assert rank_in(6, -1, unranked_through=0) == -1


# ---- trainer exits -----------------------------------------------------------------------------------


def exit_of(code: int, *, epoch: int = 4, stopped: bool = False, hung: bool = False, finished: bool = False):  # type: ignore[no-untyped-def]
    return on_trainer_exit(
        DONE if finished else FRESH,
        TrainerExit(epoch, code, stopped, hung),
        current_epoch=6,
        restore_step=120,
        abort_delay_s=0.3,
    )


def test_a_trainer_the_agent_stopped_is_no_fault_whatever_its_code() -> None:
    for code in (0, 1, -9, RESTART_EXIT_CODE):
        assert exit_of(code, stopped=True).do is Do.NOTHING


def test_any_exit_after_the_job_finished_is_no_fault() -> None:
    assert exit_of(-int(signal.SIGABRT), finished=True).do is Do.NOTHING
    assert exit_of(1, finished=True).do is Do.NOTHING


def test_exit_0_finishes_and_the_trainer_is_not_started_again() -> None:
    assert exit_of(0).do is Do.MARK_FINISHED


def test_a_trainer_asking_for_a_fresh_process_is_restarted_without_a_fault() -> None:
    decision = exit_of(RESTART_EXIT_CODE)
    assert decision.do is Do.START_TRAINER and decision.fault is None


@pytest.mark.parametrize(
    ("code", "fault", "said"),
    [
        (ADDRESS_IN_USE_EXIT_CODE, Fault.ADDRESS_IN_USE, "port taken"),
        (STATE_LOST_EXIT_CODE, Fault.STATE_LOST, "survivors were at step 120"),
    ],
)
def test_a_port_taken_or_state_lost_is_charged_to_the_current_epoch(
    code: int, fault: Fault, said: str
) -> None:
    # The trainer started in epoch 4 and never reported moving on: the current epoch (6) is the one.
    decision = exit_of(code)
    assert (decision.do, decision.fault, decision.epoch) == (Do.REPORT_FAULT, fault, 6)
    assert said in decision.reason


def test_an_abort_is_reported_late_so_a_peers_own_failure_arrives_first() -> None:
    decision = exit_of(-int(signal.SIGABRT))
    assert (decision.do, decision.fault, decision.epoch, decision.delay_s) == (
        Do.REPORT_FAULT,
        Fault.TRAINER_EXITED,
        4,
        0.3,
    )


def test_a_crash_is_reported_at_once_for_the_epoch_the_trainer_ran() -> None:
    decision = exit_of(1)
    assert (decision.do, decision.fault, decision.epoch, decision.delay_s) == (
        Do.REPORT_FAULT,
        Fault.TRAINER_EXITED,
        4,
        0.0,
    )
    assert decision.reason == "exit code 1"


def test_a_hung_trainer_is_reported_as_hung_whatever_code_its_kill_left() -> None:
    for code in (-9, RESTART_EXIT_CODE, 0, ADDRESS_IN_USE_EXIT_CODE):
        decision = exit_of(code, hung=True)
        assert (decision.do, decision.fault) == (Do.REPORT_FAULT, Fault.TRAINER_HUNG), code
        assert decision.reason == "no step progress"


# ---- the coordinator's answer to a fault report -----------------------------------------------------


def test_a_host_the_coordinator_declared_dead_waits_to_be_told_to_register_again() -> None:
    assert on_fault_reply(member_dead=True, fault_epoch=4, current_epoch=5).do is Do.NOTHING


def test_collateral_damage_waits_for_the_next_epoch() -> None:
    decision = on_fault_reply(member_dead=False, fault_epoch=4, current_epoch=4)
    assert (decision.do, decision.epoch) == (Do.WAIT_FOR_NEWER_EPOCH, 4)


def test_a_new_epoch_that_arrived_while_the_report_was_on_its_way_starts_the_trainer_at_once() -> None:
    # The race: the report is answered "collateral" after the epoch it waits for is already here;
    # waiting for a newer one would leave the host without a trainer for the whole epoch.
    assert on_fault_reply(member_dead=False, fault_epoch=4, current_epoch=5).do is Do.START_TRAINER


# ---- hang clock and lease ---------------------------------------------------------------------------


def test_the_hang_clock() -> None:
    base = {
        "now": 100.0,
        "timeout_s": 10.0,
        "last_progress": 85.0,
        "started_at": 80.0,
        "ranked": True,
        "running": True,
        "stepped": True,
        "startup_timeout_s": 60.0,
    }
    assert hung(**base)  # 15 s since the last progress
    assert not hung(**{**base, "last_progress": 95.0})
    assert not hung(**{**base, "started_at": 95.0})  # restarted 5 s ago: its clock starts then
    assert not hung(**{**base, "ranked": False})  # a standby waits by design
    assert not hung(**{**base, "running": False})
    assert not hung(**{**base, "timeout_s": 0.0})  # off
    # Before its first step of the epoch the start-up limit applies: compiling is no hang.
    starting = {**base, "stepped": False}
    assert not hung(**starting)
    assert hung(**{**starting, "now": 146.0})  # 61 s since its last progress: past the start-up limit
    assert not hung(**{**starting, "now": 146.0, "startup_timeout_s": 0.0})  # off


def test_the_lease() -> None:
    cut = FRESH.unreachable(94.0)
    base = {"now": 100.0, "lease_s": 5.0, "running": True, "ranked": True}
    decision = lease_lost(cut, **base)  # type: ignore[arg-type]
    assert decision.do is Do.STOP_TRAINER and "6.0s" in decision.reason
    assert lease_lost(FRESH.unreachable(96.0), **base).do is Do.NOTHING  # type: ignore[arg-type]
    assert lease_lost(cut.registered(epoch=3, as_spare_listed_with_rank=False), **base).do is Do.NOTHING  # type: ignore[arg-type]
    assert lease_lost(cut, **{**base, "ranked": False}).do is Do.NOTHING  # type: ignore[arg-type]
    assert lease_lost(cut, **{**base, "running": False}).do is Do.NOTHING  # type: ignore[arg-type]
    assert lease_lost(cut, **{**base, "lease_s": 0.0}).do is Do.NOTHING  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("configured", "heartbeat_timeout_s", "lease"),
    [
        (None, 0.6, LEASE_FLOOR_S),  # the local preset's timeout: the floor (a failover takes seconds)
        (None, 10.0, 10.0),  # the production preset's: as long as the coordinator waits for a verdict
        (None, 60.0, 60.0),  # a fleet's stretched one
        (None, 0.0, LEASE_FLOOR_S),  # not registered yet
        (2.0, 10.0, 2.0),  # --lease wins, below the floor too
        (0.0, 10.0, 0.0),  # --lease 0: no fence
    ],
)
def test_the_lease_derives_from_the_coordinators_heartbeat_timeout_unless_set(
    configured: float | None, heartbeat_timeout_s: float, lease: float
) -> None:
    assert lease_s(configured=configured, heartbeat_timeout_s=heartbeat_timeout_s) == lease

"""The agent's decisions, as pure functions: what to do about a new topology, a trainer that exited,
the coordinator's answer to a fault report, a trainer without progress, a lost coordinator.

Each takes what the agent knows (numbers and flags, no messages, no processes, no clock of its own)
and returns a ``Decision`` with the reason it is logged with; ``remesh.agent.daemon`` carries it out.
Nothing here does I/O or knows the wire format, so every rule is tested on its own
(tests/test_agent_core.py), the races the end-to-end tests found included.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, replace

from remesh.v1.contract import (
    ADDRESS_IN_USE_EXIT_CODE,
    RESTART_EXIT_CODE,
    STATE_LOST_EXIT_CODE,
    ExitNote,
    one_line,
)

__all__ = [
    "LEASE_FLOOR_S",
    "AgentState",
    "Decision",
    "Do",
    "Fault",
    "Standing",
    "Starts",
    "TrainerExit",
    "hung",
    "lease_lost",
    "lease_s",
    "on_fault_reply",
    "on_topology",
    "on_trainer_exit",
    "rank_in",
]


class Do(enum.Enum):
    NOTHING = "nothing"
    # Start the trainer for the current topology (promoting the warm standby where there is one).
    START_TRAINER = "start trainer"
    # The trainer completed the job: from now on its exits are no fault, and it is not started again.
    MARK_FINISHED = "mark finished"
    # Tell the coordinator (ReportFault) and act on its answer (``on_fault_reply``).
    REPORT_FAULT = "report fault"
    # Start no trainer before an epoch newer than ``Decision.epoch``.
    WAIT_FOR_NEWER_EPOCH = "wait for a newer epoch"
    # Stop the trainer (and the standby) and exit with ``Decision.exit_code``.
    STOP_ALL_AND_EXIT = "stop all and exit"
    # Stop the ranked trainer: it may no longer hold its rank.
    STOP_TRAINER = "stop trainer"


class Fault(enum.Enum):
    """What a fault report says happened (the shell maps it onto the protocol's FaultKind)."""

    TRAINER_EXITED = "trainer exited"
    TRAINER_HUNG = "trainer hung"
    ADDRESS_IN_USE = "address in use"
    STATE_LOST = "state lost"
    TRAINER_RESTARTED = "trainer restarted"


@dataclass(frozen=True)
class TrainerExit:
    epoch: int  # the newest epoch the trainer said it runs (faults are charged to it)
    returncode: int
    stopped: bool  # the agent stopped it on purpose
    hung: bool = False  # the agent killed it for making no progress
    # What it said of why it gave up on recovering in place, where it left a note (Env.EXIT_NOTE).
    note: ExitNote | None = None

    @property
    def cause(self) -> str:
        """How it ended, for metrics: stopped (by the agent), hung (killed for it), completed (exit
        0), signal (killed by one), or error (another exit code)."""
        if self.stopped:
            return "stopped"
        if self.hung:
            return "hung"
        if self.returncode == 0:
            return "completed"
        return "signal" if self.returncode < 0 else "error"


@dataclass(frozen=True)
class Decision:
    do: Do
    reason: str
    fault: Fault | None = None
    # The epoch a fault is charged to, or the one to wait past.
    epoch: int = 0
    # Seconds to wait before acting (a report that must not overtake a peer's).
    delay_s: float = 0.0
    exit_code: int = 0


class Standing(enum.Enum):
    """Where the agent stands with the coordinator."""

    # No heartbeat stream, and no clock running against it: not registered yet, or a replica answered
    # (a follower naming the leader: this host is not cut off, whatever the leader's state).
    DISCONNECTED = "disconnected"
    # Registered, with a heartbeat stream open.
    CONNECTED = "connected"
    # No coordinator reachable since ``AgentState.lost_at``: the lease clock runs (``lease_lost``).
    CUT_OFF = "cut off"


class Starts(enum.Enum):
    """Whether the agent starts a trainer for an epoch that has none."""

    ANY_EPOCH = "for any epoch"
    # Its last trainer died as collateral damage of epoch ``AgentState.restart_after``: not before a newer one.
    NEWER_EPOCH = "for a newer epoch only"
    # The job completed: never again.
    NEVER = "never"


@dataclass(frozen=True)
class AgentState:
    """What the agent remembers between events, besides the topology and its trainer processes.
    Every change is one of the methods below, each returning the new state."""

    standing: Standing = Standing.DISCONNECTED
    lost_at: float | None = None
    starts: Starts = Starts.ANY_EPOCH
    restart_after: int = 0
    # Epochs up to this one give this host no rank even where they list it (see ``rank_in``).
    unranked_through: int = 0

    def registered(self, *, epoch: int, as_spare_listed_with_rank: bool) -> AgentState:
        """A coordinator accepted the registration while ``epoch`` was current. Registered again as a
        spare while that epoch still lists this host with a rank (its old incarnation's), the host
        holds no rank in it nor in any older one."""
        unranked = max(self.unranked_through, epoch) if as_spare_listed_with_rank else self.unranked_through
        return replace(self, standing=Standing.CONNECTED, lost_at=None, unranked_through=unranked)

    def unreachable(self, now: float) -> AgentState:
        """The stream broke or no coordinator answered: the lease clock runs from the first such moment."""
        return replace(
            self, standing=Standing.CUT_OFF, lost_at=self.lost_at if self.lost_at is not None else now
        )

    def answered(self) -> AgentState:
        """A replica answered (a follower naming the leader): the host is not cut off."""
        return replace(self, standing=Standing.DISCONNECTED, lost_at=None)

    def finished(self) -> AgentState:
        return replace(self, starts=Starts.NEVER)

    def trainer_died_with(self, epoch: int) -> AgentState:
        if self.starts is Starts.NEVER:
            return self
        return replace(self, starts=Starts.NEWER_EPOCH, restart_after=epoch)

    def trainer_started(self) -> AgentState:
        if self.starts is Starts.NEVER:
            return self
        return replace(self, starts=Starts.ANY_EPOCH, restart_after=0)


def rank_in(epoch: int, listed_rank: int, unranked_through: int) -> int:
    """The rank this host holds in ``epoch``: the one the topology lists, except in epochs up to
    ``unranked_through``. The host registered again (a new process, a new incarnation) while those
    epochs were current: its rank in them went with its old incarnation, even where they list it."""
    return -1 if epoch <= unranked_through else listed_rank


def on_topology(
    state: AgentState,
    *,
    current_epoch: int,
    epoch: int,
    halted: bool,
    halt_reason: str,
    trainer_running: bool,
) -> Decision:
    """A topology arrived on the heartbeat stream."""
    if epoch < current_epoch:
        return Decision(
            Do.NOTHING, f"epoch {epoch} is older than epoch {current_epoch}, which this host runs"
        )
    if halted:
        return Decision(Do.STOP_ALL_AND_EXIT, f"job halted: {halt_reason}", exit_code=3)
    if trainer_running:
        return Decision(Do.NOTHING, "the running trainer takes the new epoch in-process (local API)")
    if state.starts is Starts.NEVER:
        return Decision(Do.NOTHING, "the trainer completed the job: it is not started again")
    if state.starts is Starts.NEWER_EPOCH and epoch <= state.restart_after:
        return Decision(
            Do.NOTHING, f"the trainer died with epoch {state.restart_after}: it starts on a newer one"
        )
    # Spares run their trainer too, in standby (JAX imported, waiting for a rank): a hot spare joins
    # a new epoch without paying for a process start.
    return Decision(Do.START_TRAINER, f"no trainer runs for epoch {epoch}")


def on_trainer_exit(
    state: AgentState, result: TrainerExit, *, current_epoch: int, restore_step: int, abort_delay_s: float
) -> Decision:
    """The active trainer process exited."""
    if result.stopped:
        return Decision(Do.NOTHING, "the agent stopped it")
    if state.starts is Starts.NEVER:
        # It completed the job's last step first: an abort on the way out (JAX's shutdown with a peer
        # already gone) costs nothing and is no fault.
        return Decision(Do.NOTHING, "it exited after finishing the job")
    if not result.hung:
        if result.returncode == 0:
            return Decision(Do.MARK_FINISHED, "the trainer finished its run; it is not restarted")
        if result.returncode == RESTART_EXIT_CODE:
            return Decision(
                Do.START_TRAINER, f"it asked for a fresh process on the current topology{_said(result)}"
            )
        # A trainer that had not yet reported progress still counts as running the epoch it started
        # in: these two are charged to the current one.
        if result.returncode == ADDRESS_IN_USE_EXIT_CODE:
            return Decision(
                Do.REPORT_FAULT,
                "JAX coordination port taken",
                Fault.ADDRESS_IN_USE,
                epoch=max(result.epoch, current_epoch),
            )
        if result.returncode == STATE_LOST_EXIT_CODE:
            return Decision(
                Do.REPORT_FAULT,
                result.note.reason
                if result.note is not None
                else f"the trainer found no tier holding any step of the job (its survivors were at step {restore_step})",
                Fault.STATE_LOST,
                epoch=max(result.epoch, current_epoch),
            )
        if result.returncode == -signal.SIGABRT:
            # JAX aborts every survivor within ~0.2 s when a peer's trainer or rank 0's coordination
            # service dies. Reported at once, the abort could reach the coordinator before the peer's
            # own failure does, and be charged to this healthy host; a moment later it is seen as
            # collateral. A trainer that aborted on its own is charged that much later.
            return Decision(
                Do.REPORT_FAULT,
                f"exit code {result.returncode}",
                Fault.TRAINER_EXITED,
                epoch=result.epoch,
                delay_s=abort_delay_s,
            )
    if result.hung:
        return Decision(Do.REPORT_FAULT, "no step progress", Fault.TRAINER_HUNG, epoch=result.epoch)
    return Decision(
        Do.REPORT_FAULT,
        f"exit code {result.returncode}{_said(result)}",
        Fault.TRAINER_EXITED,
        epoch=result.epoch,
    )


# A fault report's detail is one plain line the coordinator accepts (it refuses control characters,
# and text past 1,024 characters).
_NOTE_CHARS = 800


def _said(result: TrainerExit) -> str:
    """What the trainer's exit note says, as the end of a reason (nothing where it left none): one
    plain line, cut short where long."""
    if result.note is None:
        return ""
    return f" ({one_line(f'{result.note.why}: {result.note.reason}', _NOTE_CHARS)})"


def on_fault_reply(*, member_dead: bool, fault_epoch: int, current_epoch: int) -> Decision:
    """The coordinator answered a fault report."""
    if member_dead:
        return Decision(Do.NOTHING, "the coordinator replaces this host and will ask it to register again")
    if current_epoch > fault_epoch:
        # A newer epoch arrived while the report was on its way: the trainer is collateral damage
        # of that change and starts on it now.
        return Decision(Do.START_TRAINER, f"epoch {current_epoch} is newer than the failed {fault_epoch}")
    return Decision(
        Do.WAIT_FOR_NEWER_EPOCH,
        f"collateral damage: the trainer starts on the epoch after {fault_epoch}",
        epoch=fault_epoch,
    )


def hung(
    *,
    now: float,
    timeout_s: float,
    last_progress: float,
    started_at: float,
    ranked: bool,
    running: bool,
    stepped: bool,
    startup_timeout_s: float,
) -> bool:
    """A ranked trainer that made no step progress for ``timeout_s`` (since its start, or since the
    last progress) is hung. Until its first step of the epoch (``stepped`` false) the limit is
    ``startup_timeout_s`` instead: JAX's start-up, the restore and the compile of a large model are
    no steps, and take minutes. A standby (no rank) waits by design; a limit of 0 turns its clock off."""
    limit = timeout_s if stepped else startup_timeout_s
    if limit <= 0 or not running or not ranked:
        return False
    return now - max(last_progress, started_at) > limit


# The shortest lease this agent derives: a coordinator restart or failover takes seconds (a new
# leader's lease TTL, this agent's reconnect backoff, its registration), and a shorter lease would stop
# healthy trainers on every one. The coordinator grants every member a fresh deadline after one.
LEASE_FLOOR_S = 5.0


def lease_s(*, configured: float | None, heartbeat_timeout_s: float) -> float:
    """How long this agent may be cut off from every coordinator before it stops its ranked trainer.

    ``configured`` (``--lease``; 0 turns the fence off) wins where set. Otherwise as long as the
    coordinator waits before it declares a silent host dead (``heartbeat_timeout_s``, from its last
    RegisterResponse; 0 before any): only from then may it have given this host's rank away, so a
    trainer stopped sooner is stopped for a silence the coordinator rides out. At least
    ``LEASE_FLOOR_S``; the checkpoint fence covers the moments between a verdict and the lease."""
    if configured is not None:
        return configured
    return max(LEASE_FLOOR_S, heartbeat_timeout_s)


def lease_lost(state: AgentState, *, now: float, lease_s: float, running: bool, ranked: bool) -> Decision:
    """No coordinator has been reachable since ``state.lost_at``: past ``lease_s`` the ranked trainer
    may no longer hold its rank (the coordinator may have given it away), so it stops."""
    if lease_s <= 0 or state.standing is not Standing.CUT_OFF or state.lost_at is None:
        return Decision(Do.NOTHING, "nothing to fence")
    if not running or not ranked:
        return Decision(Do.NOTHING, "nothing to fence")
    cut_off = now - state.lost_at
    if cut_off < lease_s:
        return Decision(Do.NOTHING, f"cut off {cut_off:.1f}s, within the {lease_s:g}s lease")
    return Decision(Do.STOP_TRAINER, f"lease lost after {cut_off:.1f}s without a coordinator")

"""Why a trainer process gives up on recovering in place, said so that a user can act on it.

In-process recovery is the normal path: a failed collective or a new epoch ends the epoch, the
session tears the JAX runtime down and joins the next epoch in the same process, which keeps its
snapshots in memory, its devices open and its compilation cache warm. Where that cannot be done, the
process exits and its agent starts a fresh one (the warm standby where there is one). ``Why`` names
the reason with a short code; ``FIXES`` says, for each, what was going on and what to do. Both go
into the trainer's log line and into the **exit note**: one JSON object (``ExitNote``) written to the
file the agent names in ``$REMESH_EXIT_NOTE`` before the process exits, which the agent reads when
the process has ended and records with the job's events. A trainer started without the variable
(run alone, or by an agent that does not ask) writes no note; the log line says it all the same.

What JAX itself ends writes no note: it aborts the process (SIGABRT) before any Python code runs.
Two cases are known, and its agent tells them apart by the new epoch:

- the epoch lost its rank 0, whose process hosts the coordination service every member is connected
  to: JAX ends every other member within a moment ("Terminating process because the JAX
  distributed service detected fatal errors"): ``Why.COORDINATION_SERVICE_LOST``;
- rank 0 survived: on CPU a peer's death in the middle of a collective can leave the survivors out
  of step (one finished the collective, another did not), and gloo ends the one that receives the
  next collective's data ("Received data size doesn't match expected size"):
  ``Why.COLLECTIVE_TORN``. Measured here: about one kill in five with the loop always inside its
  step, none in eight with a pause between steps (``tests/test_in_place.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import sys
import traceback
from collections.abc import Mapping
from types import TracebackType

from remesh.v1.contract import Env, ExitNote
from remesh.v1.contract import one_line as contract_one_line

__all__ = ["EXIT_NOTE_ENV", "FIXES", "ExitNote", "Why", "describe", "note_uncaught", "one_line", "write_note"]

# The file an agent asks its trainer process to leave its exit note in (one per process it starts).
EXIT_NOTE_ENV = Env.EXIT_NOTE


class Why(enum.StrEnum):
    """Why a process could not recover in place (the codes of the log, the note and the event)."""

    # A step of the old epoch was still running past its grace after a new epoch was announced.
    STEP_STUCK = "step-stuck"
    # A step of the old epoch waits in a collective for a member the new epoch left out, on a
    # platform whose collectives never give up (GPU, TPU): only a new process ends it.
    COLLECTIVE_CANNOT_END = "collective-cannot-end"
    # Joining an epoch (JAX's join, the restore, the compile meeting) outlived a newer epoch.
    JOIN_STUCK = "join-stuck"
    # Leaving an epoch (a checkpoint being saved, a snapshot waiting for its step) outlived its grace.
    LEAVE_STUCK = "leave-stuck"
    # Finishing the job (the last barrier) outlived a newer epoch.
    FINISH_STUCK = "finish-stuck"
    # After a failure no new epoch came within Policy.epoch_wait_s.
    NO_NEW_EPOCH = "no-new-epoch"
    # More in-process recoveries than Policy.max_in_process_recoveries.
    RECOVERIES_EXHAUSTED = "recoveries-exhausted"
    # The agent did not answer (an acknowledgement, the report that the job finished).
    AGENT_UNREACHABLE = "agent-unreachable"
    # The checkpoint every member agreed to restore went away before it was read.
    CHECKPOINT_GONE = "checkpoint-gone"
    # Rank 0 found the epoch's JAX coordination port taken (ADDRESS_IN_USE_EXIT_CODE).
    ADDRESS_IN_USE = "address-in-use"
    # No tier holds a step of the job (STATE_LOST_EXIT_CODE: the job halts).
    STATE_LOST = "state-lost"
    # The restored step's input position cannot be carried to this epoch (STATE_LOST_EXIT_CODE).
    DATA_POSITION_LOST = "data-position-lost"
    # Rank 0 of the epoch died, and with it JAX's coordination service: JAX ends every other member
    # with SIGABRT. Never written by a trainer (see the module's docstring): for the agent to record.
    COORDINATION_SERVICE_LOST = "coordination-service-lost"
    # A peer died in the middle of a collective, and gloo ended this survivor (SIGABRT) when the
    # survivors came out of step. Never written by a trainer: for the agent to record.
    COLLECTIVE_TORN = "collective-torn"
    # An exception escaped the training script (written by the hook ``note_uncaught`` installs): no
    # fresh process can help; the coordinator halts the job when it comes back recovery after
    # recovery (``PlannerSettings.max_repeated_crashes``).
    TRAINER_ERROR = "trainer-error"


FIXES: Mapping[Why, str] = {
    Why.STEP_STUCK: (
        "a step (the loop's code from epoch.steps() to epoch.done()) kept running past its grace after "
        "a new epoch; on CPU a collective with a dead peer fails within Policy.collective_timeout_s, so "
        "something else held it: input that blocks, a host callback, a sleep in the loop. Keep such "
        "work short, or raise Policy.stuck_step_exit_s"
    ),
    Why.COLLECTIVE_CANNOT_END: (
        "on this platform JAX cannot cancel a collective waiting for a dead peer: a fresh process is "
        "the only way out. Keep the agent's warm standby (the default) so that one is ready"
    ),
    Why.JOIN_STUCK: (
        "a member of the epoch being joined died or never came, and JAX's join cannot be left; "
        "nothing to fix unless it recurs: then check that the hosts reach each other's JAX ports"
    ),
    Why.LEAVE_STUCK: (
        "leaving the epoch waited for work that needs a dead peer (a sharded checkpoint being saved, "
        "a snapshot of a step that never ends); checkpoint less often if it recurs"
    ),
    Why.FINISH_STUCK: "a member died during the job's last barrier; the job finishes with the others",
    Why.NO_NEW_EPOCH: (
        "no new epoch came after the failure: check `remesh status` (the coordinator reachable, enough "
        "hosts for the smallest world size), or raise Policy.epoch_wait_s"
    ),
    Why.RECOVERIES_EXHAUSTED: (
        "this process recovered in place Policy.max_in_process_recoveries times; a fresh one starts "
        "clean. Raise the limit if that is expected"
    ),
    Why.AGENT_UNREACHABLE: "the agent on this host did not answer: see its log",
    Why.CHECKPOINT_GONE: (
        "the checkpoint chosen by rank 0 was deleted or cut short while the members read it; the next "
        "process chooses again. Keep more checkpoints (max_to_keep) if it recurs"
    ),
    Why.ADDRESS_IN_USE: "another process holds the JAX port; the coordinator moves the job to another",
    Why.STATE_LOST: (
        "no member holds a step in memory and no committed checkpoint is readable: configure a "
        "checkpoint tier (checkpoints=[LocalCheckpoints(...)] or GCS) to survive losing every host"
    ),
    Why.DATA_POSITION_LOST: (
        "the input iterators' positions of the restored step cannot be carried to this epoch; see "
        "remesh.elastic.IteratorData for the rule on a changed world size"
    ),
    Why.COORDINATION_SERVICE_LOST: (
        "rank 0's process hosts JAX's coordination service; JAX ends every member when it dies. The "
        "warm standby takes over; nothing to fix"
    ),
    Why.COLLECTIVE_TORN: (
        "the dead peer left a collective half done, and the CPU collectives (gloo) end a survivor that "
        "finds the others out of step. The warm standby takes over; nothing to fix"
    ),
    Why.TRAINER_ERROR: (
        "the training script raised an exception (the reason names it and the line): fix the script. "
        "A host taking over fails the same way; after `remesh coordinator --max-repeated-crashes` "
        "recoveries in a row with no step completed, the job halts with this error"
    ),
}

# A reason is one line of at most this many characters: it travels in the agent's fault report,
# whose text the coordinator bounds (1,024) and refuses with control characters in it.
REASON_CHARS = 600


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """``text`` as one plain line of at most ``limit`` characters (``contract.one_line``)."""
    return contract_one_line(text, limit)


def describe(exc: BaseException) -> str:
    """An exception in one line a user can act on: its type, its message, and the line of the
    training script it came from (the innermost frame outside installed packages and remesh)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if not _is_library(f.filename)] or frames
    where = (
        f" (at {os.path.basename(ours[-1].filename)}:{ours[-1].lineno} in {ours[-1].name})" if ours else ""
    )
    message = str(exc).strip().splitlines()
    first = message[0] if message else ""
    return one_line(f"{type(exc).__name__}: {first}{where}" if first else f"{type(exc).__name__}{where}")


def _is_library(filename: str) -> bool:
    return (
        "site-packages" in filename
        or "dist-packages" in filename
        or filename.startswith(_REMESH_DIR)
        or filename.startswith("<")
    )


# The remesh package's own directory (its frames are not the training script's).
_REMESH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_hooked = False


def note_uncaught(env: Mapping[str, str] | None = None) -> bool:
    """Leave an exit note (``Why.TRAINER_ERROR``) when an exception escapes the main thread, then
    let the previous hook print it as before; so the agent reports the script's own error, and the
    coordinator can tell a bug that follows the job from a host that failed. Installed once, and
    only where the agent asked for notes. Returns whether the hook is in place."""
    global _hooked
    if _hooked:
        return True
    if not (os.environ if env is None else env).get(EXIT_NOTE_ENV):
        return False
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(exc, KeyboardInterrupt):
            with contextlib.suppress(Exception):
                write_note(ExitNote(Why.TRAINER_ERROR, describe(exc), FIXES[Why.TRAINER_ERROR], 1), env)
        previous(kind, exc, tb)

    sys.excepthook = hook
    _hooked = True
    return True


def write_note(note: ExitNote, env: Mapping[str, str] | None = None) -> bool:
    """Leave ``note`` where the agent asked (``$REMESH_EXIT_NOTE``), whole or not at all (written
    under a temporary name, then renamed). False where nobody asked, or it could not be written: the
    process is on its way out, and the log line says it anyway."""
    path = (os.environ if env is None else env).get(EXIT_NOTE_ENV)
    if not path:
        return False
    note = dataclasses.replace(note, reason=one_line(note.reason))
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(note.to_json())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    return True

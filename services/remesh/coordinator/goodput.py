"""Goodput of a job from its event log alone. Pure: the coordinator computes it live (with the time
now and the step its members reached), and ``remesh goodput --from-log`` computes it afterwards from the
same events; given the same events, time and step, both give the same figures.

Categories follow Google's ml-goodput-measurement. The log gives, per epoch: when it was published
(``topology_changed``, which also records how far the epoch before it got: ``reached_step``), when
every member ran it (``epoch_live``, sent once each member finished its first step), where each
member restored from and how long each phase took (``epoch_acked``), the failures that ended it
(``member_dead`` of one of its members), and the end of the job (``job_finished``, with its step).
From these:

- **productive**: an epoch runs from going live to its first failure signal (or the next epoch, or
  the job's end). Its steps after the first share that time equally; the ones a later epoch kept
  (up to the step it restored) are productive, the rest
- **wasted progress**: trained, then thrown away by the restore.
- **initialization**: the job's first event to its first epoch live.
- **checkpoint restore**: in each recovery, the slowest member's restore.
- **recovery**: the rest of each window from a failure signal to the next epoch live (detection,
  decision, broadcast, re-initialisation, compilation, the first step).
- **checkpoint save**: not known here (the trainers report the time their loop waited for a save to
  their agents: ``remesh_trainer_checkpoint_wait_seconds_total``); ``None``, and inside productive.
- **other**: the rest of the wall time (a halted job, time before the log's first event is not in).

Where an epoch ran but its steps are unknown (none completed after the first), its time is other.
A log cut by compaction (``log_compacted``) covers only what follows the cut.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from remesh.coordinator.model import Event, EventType

__all__ = ["BADPUT", "EVENTS", "EpochRun", "Goodput", "Log", "Recovery", "compute", "keep"]

BADPUT = ("initialization", "recovery", "checkpoint_restore", "checkpoint_save", "wasted_progress", "other")
_TRAINER_PHASES = ("reinit", "restore", "compile", "first_step")
# The events ``compute`` reads, besides the log's first (the job's start).
EVENTS = frozenset(
    {
        EventType.TOPOLOGY_CHANGED,
        EventType.EPOCH_ACKED,
        EventType.EPOCH_LIVE,
        EventType.MEMBER_DEAD,
        EventType.JOB_FINISHED,
        EventType.JOB_HALTED,
    }
)


def keep(kept: list[Event], event: Event) -> None:
    """Append ``event`` to ``kept`` if ``compute`` needs it: a reader following a long log keeps only
    these."""
    if event.type in EVENTS or not kept:
        kept.append(event)


@dataclass(frozen=True)
class Recovery:
    """One recovery: from the first failure signal after an epoch went live to the next epoch live."""

    failed_at: float
    hosts: tuple[str, ...]
    epoch: int  # the epoch that recovered it (0 while none has gone live)
    live_at: float | None
    restored_step: int | None
    steps_lost: int | None
    # detect is not in the log (the fault happened before its signal); decide: signal -> published;
    # then the slowest member's reinit, restore, compile, first_step.
    phases: Mapping[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "failed_at": self.failed_at,
            "hosts": list(self.hosts),
            "epoch": self.epoch,
            "live_at": self.live_at,
            "to_live_s": None if self.live_at is None else round(self.live_at - self.failed_at, 3),
            "restored_step": self.restored_step,
            "steps_lost": self.steps_lost,
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
        }


@dataclass(frozen=True)
class EpochRun:
    """One epoch that went live: how long it ran, its timed steps, and how many of them were kept."""

    epoch: int
    live_at: float
    ran_s: float
    steps: int | None  # None: not known (no later topology or end said how far it got)
    kept: int | None
    productive_s: float
    wasted_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "live_at": self.live_at,
            "ran_s": round(self.ran_s, 3),
            "steps": self.steps,
            "kept": self.kept,
            "productive_s": round(self.productive_s, 3),
            "wasted_s": round(self.wasted_s, 3),
        }


@dataclass(frozen=True)
class Goodput:
    started_at: float
    now: float
    productive_s: float
    badput_s: Mapping[str, float | None]
    recoveries: Sequence[Recovery] = field(default_factory=tuple)
    finished: bool = False
    epochs: Sequence[EpochRun] = field(default_factory=tuple)

    @property
    def wall_s(self) -> float:
        return max(0.0, self.now - self.started_at)

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "started_at": self.started_at,
            "now": self.now,
            "finished": self.finished,
            "wall_s": round(self.wall_s, 3),
            "productive_s": round(self.productive_s, 3),
            "goodput": round(self.goodput, 4),
            "badput_s": {k: None if v is None else round(v, 3) for k, v in self.badput_s.items()},
            "recoveries": [r.to_dict() for r in self.recoveries],
            "epochs": [e.to_dict() for e in self.epochs],
        }


@dataclass
class _Epoch:
    epoch: int
    published_at: float
    restore_step: int
    reached_before: int | None  # how far the previous epoch got, as this one's topology recorded
    hosts: frozenset[str] = frozenset()
    live_at: float | None = None
    # Its members' acknowledgements, read once each as they come: the lowest step restored, the
    # longest of each trainer phase, and how far each host said the epoch before got.
    restored_min: int | None = None
    phases: dict[str, float] | None = None
    reached: dict[str, int | None] = field(default_factory=dict)

    def acknowledged(self, ack: Event) -> None:
        restored = _int(ack.details.get("restored_step"))
        if restored is not None:
            self.restored_min = restored if self.restored_min is None else min(self.restored_min, restored)
        mine = _phases(ack)
        if self.phases is None:
            self.phases = {name: mine.get(name, 0.0) for name in _TRAINER_PHASES}
        else:
            for name in _TRAINER_PHASES:
                self.phases[name] = max(self.phases[name], mine.get(name, 0.0))
        said = _int(ack.details.get("reached_step"))
        before = self.reached.get(ack.host_id)
        self.reached[ack.host_id] = (
            said if before is None else (before if said is None else max(before, said))
        )


def _phases(ack: Event) -> dict[str, float]:
    try:
        raw = json.loads(ack.details.get("phases", "{}"))
    except ValueError:
        return {}
    return {str(k): float(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def compute(
    events: Iterable[Event], now: float, current_step: int | None = None, started_at: float | None = None
) -> Goodput:
    """The job's goodput at ``now`` from its events (in log order). ``current_step``: the furthest
    step a member of the current epoch completed (live); not needed once the job finished.
    ``started_at``: when the job started, where something before its first event knows (a launcher)."""
    # What was known at ``now``: the figures of a time are reproducible from a longer log.
    log = Log()
    for event in sorted((e for e in events if e.time <= now), key=lambda e: e.time):
        log.add(event)
    return log.goodput(now, current_step, started_at)


class Log:
    """What ``compute`` reads of a log, folded as the events come (in log order): an acknowledgement
    is read once into its epoch and not kept, so a ``goodput`` walks epochs and failures, not every
    member's acknowledgement of every epoch. The coordinator keeps one and asks it every few seconds
    (reading each acknowledgement again took its event loop 0.9 s a time at 10,000 members and six
    epochs)."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._epochs: list[_Epoch] = []
        self._by_number: dict[int, _Epoch] = {}
        self._failures: list[Event] = []
        self._end: float | None = None  # the job finished or halted
        self._final_step: int | None = None
        self._finished = False

    def add(self, e: Event) -> None:
        if self._start is None:
            self._start = e.time
        if e.type is EventType.TOPOLOGY_CHANGED and e.topology is not None:
            epoch = _Epoch(
                e.epoch,
                e.time,
                e.topology.restore_step,
                _int(e.details.get("reached_step")),
                frozenset(m.host_id for m in e.topology.members),
            )
            self._epochs.append(epoch)
            self._by_number[e.epoch] = epoch
        elif (
            e.type is EventType.EPOCH_LIVE
            and e.epoch in self._by_number
            and self._by_number[e.epoch].live_at is None
        ):
            self._by_number[e.epoch].live_at = e.time
        elif e.type is EventType.EPOCH_ACKED and e.epoch in self._by_number:
            self._by_number[e.epoch].acknowledged(e)
        elif e.type is EventType.MEMBER_DEAD:  # a trainer fault that kills a member says so too
            self._failures.append(e)
        elif e.type is EventType.JOB_FINISHED and self._end is None:
            self._end, self._final_step, self._finished = e.time, _int(e.details.get("step")), True
        elif e.type is EventType.JOB_HALTED and self._end is None:
            self._end = e.time

    def goodput(
        self, now: float, current_step: int | None = None, started_at: float | None = None
    ) -> Goodput:
        """As ``compute`` of the events added, at ``now`` (every event added is of ``now`` or before)."""
        start = self._start if self._start is not None else now
        if started_at is not None:
            start = min(start, started_at)
        return _goodput(
            start,
            now,
            current_step,
            self._epochs,
            self._failures,
            self._end,
            self._final_step,
            self._finished,
        )


def _goodput(
    start: float,
    now: float,
    current_step: int | None,
    epochs: list[_Epoch],
    failures: list[Event],
    end: float | None,
    final_step: int | None,
    finished: bool,
) -> Goodput:
    now = end if end is not None else now
    # Checkpoint save is not in the log: None in the result, left out of the sums here.
    badput = dict.fromkeys((b for b in BADPUT if b != "checkpoint_save"), 0.0)
    productive = 0.0
    live = [ep for ep in epochs if ep.live_at is not None and ep.live_at <= now]
    if not live:
        badput["initialization"] = now - start
        return Goodput(start, now, 0.0, _with_save_unknown(badput), (), finished)
    assert live[0].live_at is not None
    badput["initialization"] = live[0].live_at - start
    recoveries: list[Recovery] = []
    runs: list[EpochRun] = []
    successors = {a.epoch: b for a, b in itertools.pairwise(epochs)}

    def restored(ep: _Epoch) -> int:
        """The step the epoch's members resumed from (the lowest any of them restored)."""
        return ep.restore_step if ep.restored_min is None else ep.restored_min

    for i, ep in enumerate(live):
        assert ep.live_at is not None
        following = live[i + 1] if i + 1 < len(live) else None
        # The next epoch published after this one (the one that replaced it, live or not) says how far
        # this one got.
        successor = successors.get(ep.epoch)
        # The epoch runs until its first failure signal, else until its successor is published (a
        # drain, a grow), else until the job's end or now.
        limit = successor.published_at if successor is not None else now
        signal = next((f for f in failures if ep.live_at <= f.time < limit and f.host_id in ep.hosts), None)
        ran_until = signal.time if signal is not None else limit
        first = restored(ep) + 1  # completed before the epoch went live
        reached: int | None
        kept_until: int | None
        if successor is not None:
            # As the successor's topology recorded it, from the progress reports it had (at most
            # one a second a member), or as its members said when they acknowledged it: only those
            # that ran this epoch (a host added back says how far it got before it was left out).
            said = [successor.reached[h] for h in ep.hosts if h in successor.reached]
            reached = max((s for s in (successor.reached_before, *said) if s is not None), default=None)
            # What a later epoch kept: the step it restored (none live yet: the step it is to restore).
            kept_until = restored(following) if following is not None else successor.restore_step
        else:
            reached = final_step if finished else current_step
            kept_until = reached
        running = max(0.0, ran_until - ep.live_at)
        steps = (reached - first) if reached is not None else 0
        if steps > 0 and kept_until is not None:
            kept = max(0, min(steps, kept_until - first))
            productive += running * kept / steps
            badput["wasted_progress"] = badput["wasted_progress"] + running * (steps - kept) / steps
            runs.append(
                EpochRun(
                    ep.epoch,
                    ep.live_at,
                    running,
                    steps,
                    kept,
                    running * kept / steps,
                    running * (steps - kept) / steps,
                )
            )
        else:
            badput["other"] = badput["other"] + running
            runs.append(EpochRun(ep.epoch, ep.live_at, running, None, None, 0.0, 0.0))
        if following is None:
            if successor is not None or signal is not None:  # a recovery under way: its window so far
                badput["recovery"] = badput["recovery"] + max(0.0, now - ran_until)
                if signal is not None:
                    recoveries.append(_recovery(signal, failures, now, None, None, reached))
            continue
        assert following.live_at is not None
        window_from = ran_until
        window = max(0.0, following.live_at - window_from)
        phases = dict(following.phases or dict.fromkeys(_TRAINER_PHASES, 0.0))
        restore = min(window, phases["restore"])
        badput["checkpoint_restore"] = badput["checkpoint_restore"] + restore
        badput["recovery"] = badput["recovery"] + window - restore
        if signal is not None:
            phases = {"decide": max(0.0, following.published_at - signal.time), **phases}
            recoveries.append(
                _recovery(
                    signal, failures, following.live_at, following, restored(following), reached, phases
                )
            )
    badput["other"] += max(0.0, (now - start) - productive - sum(badput.values()))
    return Goodput(
        start, now, productive, _with_save_unknown(badput), tuple(recoveries), finished, tuple(runs)
    )


def _with_save_unknown(badput: Mapping[str, float]) -> dict[str, float | None]:
    return {b: None if b == "checkpoint_save" else badput[b] for b in BADPUT}


def _recovery(
    signal: Event,
    failures: Sequence[Event],
    until: float,
    following: _Epoch | None,
    restored_step: int | None,
    reached: int | None,
    phases: Mapping[str, float] | None = None,
) -> Recovery:
    hosts = tuple(dict.fromkeys(f.host_id for f in failures if signal.time <= f.time < until and f.host_id))
    lost = None if restored_step is None or reached is None else max(0, reached - restored_step)
    return Recovery(
        failed_at=signal.time,
        hosts=hosts,
        epoch=following.epoch if following is not None else 0,
        live_at=following.live_at if following is not None else None,
        restored_step=restored_step,
        steps_lost=lost,
        phases=dict(phases or {}),
    )

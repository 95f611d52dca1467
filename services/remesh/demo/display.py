"""What the demo shows while it runs: step, loss, epoch, the members and each recovery phase.

On a terminal it is a live panel (rich) under a scrolling log of membership events; elsewhere (a pipe,
CI, a test) the same events are plain lines with a progress line every few seconds.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from remesh.v1 import coordinator_pb2 as pb

__all__ = ["Display"]

_STYLE = {
    "member_dead": "bold red",
    "member_suspect": "yellow",
    "topology_changed": "bold green",
    "epoch_live": "green",
    "epoch_acked": "cyan",
    "job_halted": "bold red",
    "job_waiting": "yellow",
}
# Too frequent to be news: every host's first heartbeat, every assignment.
_QUIET = {"member_alive", "member_assigned"}
_STATE = {
    pb.MEMBER_STATE_ALIVE: ("alive", "green"),
    pb.MEMBER_STATE_JOINING: ("joining", "cyan"),
    pb.MEMBER_STATE_SUSPECT: ("suspect", "yellow"),
    pb.MEMBER_STATE_DEAD: ("dead", "red"),
    pb.MEMBER_STATE_LEFT: ("left", "dim"),
    pb.MEMBER_STATE_DRAINING: ("draining", "yellow"),
}
_PROGRESS_EVERY_S = 5.0


def _phases_text(details: dict[str, str]) -> str:
    phases = json.loads(details.get("phases", "{}"))
    names = ("reinit", "restore", "compile", "first_step")
    return " ".join(f"{n.replace('_', ' ')} {phases[n]:.2f}s" for n in names if n in phases)


class Display:
    def __init__(self, console: Console | None = None, *, quiet: bool = False, brief: bool = False) -> None:
        """``quiet``: show nothing; ``brief``: only notes, failures and recoveries (for benchmarks)."""
        self.console = console or Console(highlight=False)
        self.quiet = quiet
        self.brief = brief
        self.t0 = time.time()
        self._live: Live | None = None
        self._lock = threading.Lock()
        self._last_progress = 0.0

    def __enter__(self) -> Display:
        self.t0 = time.time()
        if self.console.is_terminal and not (self.quiet or self.brief):
            self._live = Live(Text("starting…"), console=self.console, refresh_per_second=4, transient=True)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _print(self, text: str, style: str | None = None) -> None:
        if self.quiet:
            return
        with self._lock:
            self.console.print(Text(text, style=style or ""), soft_wrap=True)

    def _stamp(self, t: float | None = None) -> str:
        return f"{(t or time.time()) - self.t0:7.2f}s"

    def note(self, text: str) -> None:
        self._print(f"{self._stamp()}  {text}", "dim")

    def failure(self, text: str) -> None:
        self._print(f"{self._stamp()}  >>> {text}", "bold red")

    def recovered(self, t_fail: float, epoch: int, host: str) -> None:
        self._print(
            f"{self._stamp()}  recovered from the loss of {host} in {time.time() - t_fail:.2f}s: "
            f"epoch {epoch} runs on every member",
            "bold green",
        )

    def event(self, e: dict[str, Any]) -> None:
        kind = e["type"]
        if kind in _QUIET or self.brief:
            return
        who = e["host_id"] or f"epoch {e['epoch']}"
        reason = e["reason"]
        if kind == "epoch_acked":
            reason = f"{reason} ({_phases_text(e['details'])})"
        self._print(f"{self._stamp(e['time'])}  {kind:<17} {who:<10} {reason}", _STYLE.get(kind))

    def update(
        self,
        *,
        phase: str,
        latest: dict[str, Any] | None,
        target: int,
        members: list[pb.Member],
        live_epoch: int,
        elapsed: float,
    ) -> None:
        step = latest["step"] if latest else 0
        loss = f"{latest['loss']:.3f}" if latest else "-"
        epoch = latest["epoch"] if latest else live_epoch
        target_text = f"/{target}" if target else ""
        headline = (
            f"{phase}: step {step}{target_text}  loss {loss}  epoch {epoch}  "
            f"world {latest['world_size'] if latest else '-'}  {elapsed:.0f}s"
        )
        if self._live is not None:
            table = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
            for col in ("host", "role", "state", "rank", "step"):
                table.add_column(col)
            for m in sorted(members, key=lambda m: (m.rank < 0, m.rank, m.host_id)):
                name, style = _STATE.get(m.state, ("?", ""))
                role = "active" if m.role == pb.ROLE_ACTIVE else "spare"
                table.add_row(
                    m.host_id,
                    role,
                    Text(name, style=style),
                    str(m.rank) if m.rank >= 0 else "-",
                    str(m.last_step) if m.last_step >= 0 else "-",
                )
            self._live.update(Group(Text(headline, style="bold"), table))
        elif not (self.quiet or self.brief) and time.time() - self._last_progress >= _PROGRESS_EVERY_S:
            self._last_progress = time.time()
            states = ", ".join(
                f"{m.host_id}={_STATE.get(m.state, ('?', ''))[0]}" for m in members if m.rank >= 0
            )
            self._print(f"{self._stamp()}  {headline}  [{states}]")

"""timeline.png: the loss over wall time with each failure and its recovery phases, and membership.

Drawn from the report and the event log alone (matplotlib, no screen needed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_timeline"]

_PHASE_COLORS = {
    "detect": "#d62728",
    "decide": "#ff7f0e",
    "relaunch": "#8c564b",
    "broadcast": "#bcbd22",
    "reinit": "#9467bd",
    "restore+compile": "#1f77b4",
    "first_step": "#2ca02c",
}


def _phase_spans(failure: Mapping[str, Any]) -> list[tuple[str, float, float]]:
    """(name, start, end) in wall time, laid end to end from the failure (restore and compile overlap)."""
    p = failure.get("phases") or {}
    order = [
        ("detect", p.get("detect", 0.0)),
        ("relaunch" if "relaunch" in p else "decide", p.get("relaunch", p.get("decide", 0.0))),
        ("broadcast", p.get("broadcast", 0.0)),
        ("reinit", p.get("reinit", 0.0)),
        ("restore+compile", max(p.get("restore", 0.0), p.get("compile", 0.0))),
        ("first_step", p.get("first_step", 0.0)),
    ]
    # Measured per member, the slowest each time, so the sum may pass the recovery's end: clip there.
    spans, t = [], float(failure["time"])
    end = t + float(failure.get("mttr_s", 0.0))
    for name, length in order:
        spans.append((name, min(t, end), min(t + float(length), end)))
        t += float(length)
    return spans


def _membership(
    events: Sequence[Mapping[str, Any]], t0: float, t_end: float
) -> dict[str, list[tuple[str, float, float]]]:
    """Per host: (kind, start, end) segments, kind 'active' (holds a rank) or 'spare' (up, no rank)."""
    up_since: dict[str, float] = {}
    active: set[str] = set()
    segments: dict[str, list[tuple[str, float, float]]] = {}
    current: dict[str, tuple[str, float]] = {}

    def kind_of(host: str) -> str | None:
        if host in active and host in up_since:
            return "active"
        return "spare" if host in up_since else None

    def settle(t: float) -> None:
        for host in set(up_since) | set(current):
            kind = kind_of(host)
            was = current.get(host)
            if was is not None and was[0] != kind:
                segments.setdefault(host, []).append((was[0], was[1] - t0, t - t0))
                current.pop(host)
            if kind is not None and host not in current:
                current[host] = (kind, t)

    for e in sorted(events, key=lambda e: e["time"]):
        host, kind, t = e.get("host_id", ""), e["type"], float(e["time"])
        if kind in ("member_joined", "member_rejoined", "member_alive") and host:
            up_since.setdefault(host, t)
        elif kind in ("member_dead", "member_left") and host:
            up_since.pop(host, None)
        elif kind == "topology_changed" and e.get("topology"):
            active = {m["host_id"] for m in e["topology"]["members"]}
        else:
            continue
        settle(t)
    for host, (kind, start) in current.items():
        segments.setdefault(host, []).append((kind, start - t0, t_end - t0))
    return segments


def plot_timeline(report: Mapping[str, Any], events: Sequence[Mapping[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    run = report["run"]
    t0, t_end = float(run["started_at"]), float(run["ended_at"])
    segments = _membership(events, t0, t_end)
    hosts = sorted(segments, key=lambda h: (not h.startswith("host"), h))
    fig, (ax_loss, ax_members) = plt.subplots(
        2,
        1,
        sharex=True,
        figsize=(11, 6.5),
        gridspec_kw={"height_ratios": [3, max(1.2, 0.35 * len(hosts))]},
    )
    mode = "in-place recovery (remesh)" if run.get("mode") == "inplace" else "whole-job restart (baseline)"
    g = report["goodput"]
    ax_loss.set_title(
        f"{mode}: {report['summary']['recovered']}/{report['summary']['failures']} failures recovered, "
        f"goodput {g['goodput']:.2f}, steps lost {report['summary']['steps_lost_total']}",
        fontsize=10,
    )
    points = report["loss"]
    if points:
        ax_loss.plot([p["t"] for p in points], [p["loss"] for p in points], ".", ms=2, color="#1f77b4")
    ax_loss.set_ylabel("training loss")
    seen: set[str] = set()
    for f in report["failures"]:
        x = float(f["time"]) - t0
        ax_loss.axvline(x, color="#d62728", ls="--", lw=1)
        ax_loss.annotate(
            f"{'SIGKILL' if f['how'] == 'kill' else 'SIGSTOP'} {f['host_id']}",
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="#d62728",
        )
        if not f.get("recovered"):
            continue
        for name, start, end in _phase_spans(f):
            label = None if name in seen else name.replace("_", " ")
            seen.add(name)
            for ax in (ax_loss, ax_members):
                ax.axvspan(start - t0, end - t0, color=_PHASE_COLORS[name], alpha=0.3, lw=0, label=label)
                label = None
    if seen:
        ax_loss.legend(loc="upper right", fontsize=8, title="recovery phases", title_fontsize=8)
    colors = {"active": "#1f77b4", "spare": "#c7c7c7"}
    for i, host in enumerate(hosts):
        for kind, start, end in segments[host]:
            ax_members.broken_barh([(start, end - start)], (i - 0.35, 0.7), color=colors[kind])
    for e in events:
        if e["type"] == "member_dead" and e.get("host_id") in hosts:
            ax_members.plot(float(e["time"]) - t0, hosts.index(e["host_id"]), "x", color="#d62728", ms=8)
    ax_members.set_yticks(range(len(hosts)), hosts, fontsize=8)
    ax_members.set_ylim(-0.6, len(hosts) - 0.4)
    ax_members.invert_yaxis()
    ax_members.set_xlabel("wall time since the job started (s)")
    ax_members.legend(
        handles=[
            Patch(color=colors["active"], label="holds a rank"),
            Patch(color=colors["spare"], label="spare"),
            plt.Line2D([], [], marker="x", ls="", color="#d62728", label="declared dead"),
        ],
        loc="upper right",
        fontsize=8,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""The coordinator's settings check their own invariants when they are made (in code, by ``replace``,
or by the command line, which turns the refusal into its usage error naming the flags). Pure, but
for the last test, which runs `remesh coordinator` in this process against no Redis at all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from remesh.cli import build_parser
from remesh.coordinator.settings import (
    DetectorSettings,
    HaSettings,
    InvalidSettings,
    PlannerSettings,
    Settings,
)

INVALID: dict[str, tuple[Callable[[], object], str, tuple[str, ...]]] = {
    "no heartbeat interval": (
        lambda: DetectorSettings(heartbeat_interval_s=0.0),
        "invalid heartbeat timings",
        ("heartbeat_interval_s",),
    ),
    "suspected after it is dead": (
        lambda: DetectorSettings(suspect_after_s=0.7, heartbeat_timeout_s=0.6),
        "invalid heartbeat timings",
        ("suspect_after_s", "heartbeat_timeout_s"),
    ),
    "dead between two heartbeats": (
        lambda: DetectorSettings(heartbeat_interval_s=1.0, suspect_after_s=0.3, heartbeat_timeout_s=0.6),
        "invalid heartbeat timings",
        ("heartbeat_timeout_s", "heartbeat_interval_s"),
    ),
    "a negative grace": (
        lambda: DetectorSettings(stream_grace_s=-0.1),
        "invalid heartbeat timings",
        ("stream_grace_s", "failover_grace_s", "stall_verdict_s"),
    ),
    "no heartbeat budget": (
        lambda: DetectorSettings().for_fleet(10, 0.0),
        "invalid heartbeat budget",
        ("beats_per_second", "hosts"),
    ),
    "a negative fleet": (
        lambda: DetectorSettings().for_fleet(-1, 1000.0),
        "invalid heartbeat budget",
        ("beats_per_second", "hosts"),
    ),
    "no world": (lambda: PlannerSettings(world_size=0), "invalid sizes", ("world_size", "min_world_size")),
    "a minimum above the world": (
        lambda: PlannerSettings(world_size=2, min_world_size=3),
        "invalid sizes",
        ("world_size", "min_world_size"),
    ),
    "a negative divisor": (
        lambda: PlannerSettings(world_size_must_divide=-8),
        "invalid sizes",
        ("world_size_must_divide",),
    ),
    "privileged JAX ports": (
        lambda: PlannerSettings(jax_port_base=80),
        "invalid JAX port range",
        ("jax_port_base", "jax_port_span"),
    ),
    "JAX ports past 65535": (
        lambda: PlannerSettings(jax_port_base=65500, jax_port_span=100),
        "invalid JAX port range",
        ("jax_port_base", "jax_port_span"),
    ),
    "no JAX port": (
        lambda: PlannerSettings(jax_port_span=0),
        "invalid JAX port range",
        ("jax_port_base", "jax_port_span"),
    ),
    "a negative wait": (lambda: PlannerSettings(max_wait_s=-1.0), "invalid planner timings", ("max_wait_s",)),
    "a negative re-form count": (
        lambda: PlannerSettings(max_futile_reforms=-1),
        "invalid planner timings",
        ("max_futile_reforms",),
    ),
    "no lease": (lambda: HaSettings(lease_ttl_s=0.0), "invalid lease", ("lease_ttl_s", "keepalive_s")),
    "no keepalive": (lambda: HaSettings(keepalive_s=0.0), "invalid lease", ("lease_ttl_s", "keepalive_s")),
    "no members": (lambda: Settings(max_members=0), "invalid limits", ("max_members",)),
    "too short a log": (lambda: Settings(max_events=9), "invalid limits", ("max_events",)),
    "a negative retention": (
        lambda: Settings(member_retention_s=-1.0),
        "invalid limits",
        ("member_retention_s",),
    ),
    "no host id fits": (lambda: Settings(max_id_length=0), "invalid limits", ("max_id_length",)),
    "by replace too": (
        lambda: replace(PlannerSettings(), world_size=3, min_world_size=4),
        "invalid sizes",
        ("world_size", "min_world_size"),
    ),
}


@pytest.mark.parametrize(("make", "title", "fields"), INVALID.values(), ids=INVALID.keys())
def test_settings_that_contradict_themselves_are_refused_where_they_are_made(
    make: Callable[[], object], title: str, fields: tuple[str, ...]
) -> None:
    with pytest.raises(InvalidSettings) as refused:
        make()
    assert refused.value.title == title
    assert set(fields) <= set(refused.value.fields)
    assert isinstance(refused.value, ValueError) and str(refused.value)


def test_the_presets_and_their_fleet_stretching_hold_their_invariants() -> None:
    for settings in (Settings.local(), Settings.production()):
        for hosts in (1, 100, 10_000):
            detector = settings.detector.for_fleet(hosts, 1000.0)
            assert detector.suspect_after_s <= detector.heartbeat_timeout_s
            settings.planner.covering(detector)  # made, so checked


def test_the_planners_holds_cover_the_detectors_verdicts_and_are_never_shortened() -> None:
    slow = DetectorSettings(
        heartbeat_interval_s=1.0, suspect_after_s=3.0, heartbeat_timeout_s=10.0, stall_verdict_s=30.0
    )
    covered = PlannerSettings().covering(slow)
    # A suspect is judged within 7 s (10 - 3); a stopped member within 30 s (the stall verdict).
    assert covered.suspect_hold_s == pytest.approx(7.2)
    assert covered.reform_after_s == pytest.approx(30.4)
    long = PlannerSettings(suspect_hold_s=20.0, reform_after_s=60.0)
    assert long.covering(slow) == long
    assert PlannerSettings().covering(DetectorSettings()) == PlannerSettings()  # the defaults already do


@pytest.mark.parametrize(
    ("flags", "title", "named"),
    [
        (("--world-size", "2", "--min-world-size", "3"), "invalid sizes", "--min-world-size"),
        (("--heartbeat-budget", "0"), "invalid heartbeat budget", "--heartbeat-budget"),
        (("--fleet-size", "-1"), "invalid heartbeat budget", "--fleet-size"),
        (("--max-events", "5"), "invalid limits", "--max-events"),
        (("--heartbeat-timeout", "0.2"), "invalid heartbeat timings", "--heartbeat-timeout"),
        (("--jax-port-span", "0"), "invalid JAX port range", "--jax-port-span"),
    ],
)
def test_the_command_line_answers_settings_that_contradict_themselves_with_a_usage_error(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], title: str, named: str
) -> None:
    args = build_parser().parse_args(["coordinator", "--redis", "redis://127.0.0.1:1", *flags])
    assert args.run(args) == 2
    out, err = capsys.readouterr()
    assert title in out + err and named in out + err, out + err

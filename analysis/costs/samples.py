"""Which statistic of a measurement's samples stands for it, and the profile's communication measurements as
the points the curves and fits are drawn through."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from analysis.profile_reader import MeasuredEvent, Profile
from harness.plan.events import COMM_KINDS, INTER, INTRA

PLACEMENTS = (INTRA, INTER)
COMPUTE_STATS = ("mean", "median")
BARE_NOTE = "; FSDP2's copies not in it (the bare collective's curve)"  # bare_collective_note's
CommPoints = Mapping[tuple[str, str], Iterable[tuple[float, int, float]]]  # (kind, placement) -> (bytes, group, s)


def check_statistic(name: str) -> None:
    if name not in COMPUTE_STATS:
        raise ValueError(f"unknown compute statistic {name!r}; known: {', '.join(COMPUTE_STATS)}")


def compute_statistic(name: str, mean: float, median: float) -> float:
    """`mean` or `median`, as the compute statistic `name` asks."""
    check_statistic(name)
    return mean if name == "mean" else median


def statistic_of(kind: str, compute_stat: str = "mean") -> str:
    """Which statistic of a measurement's samples stands for it: min for P2P (no queueing), median for a
    collective, `compute_stat` (mean or median) for compute and composites."""
    if kind == "p2p":
        return "min"
    if kind in COMM_KINDS:
        return "median"
    check_statistic(compute_stat)
    return compute_stat


def representative_seconds(measurement: MeasuredEvent, compute_stat: str = "mean") -> float:
    """The time that stands for a measurement (statistic_of)."""
    name = statistic_of(measurement.kind, compute_stat)
    return {"min": measurement.min_s, "median": measurement.median_s}.get(name, measurement.mean_s)


def measured_comm_points(profile: Profile) -> dict[tuple[str, str], list[tuple[float, int, float]]]:
    """(kind, placement) -> [(bytes, group size, seconds)] over every communication measurement but FSDP2's
    (zero > 0: the collective with FSDP2's copies, not the bare one the curves and fits describe)."""
    points: dict[tuple[str, str], list[tuple[float, int, float]]] = {}
    for m in profile.measurements.values():
        if m.kind in COMM_KINDS and m.placement in PLACEMENTS and m.count and not m.content.get("fsdp"):
            points.setdefault((m.kind, m.placement), []).append((m.bytes, m.group_size, representative_seconds(m)))
    return points


def comm_points(profile: Profile,
                extra_points: CommPoints | None = None) -> dict[tuple[str, str], list[tuple[float, int, float]]]:
    """The profile's communication points (measured_comm_points) with `extra_points` (a collective
    benchmark's) after them."""
    points = measured_comm_points(profile)
    for key, extra in (extra_points or {}).items():
        points[key] = list(points.get(key, [])) + list(extra)
    return points


def bare_collective_note(content: Mapping[str, Any]) -> str:
    """An FSDP2 collective (zero > 0) the profile lacks is costed as the bare one, without FSDP2's copies: the
    note its cost says so with ('' for any other event)."""
    return BARE_NOTE if content.get("fsdp") else ""

"""Communication between measured sizes: the measured points of one kind, placement and group size as a curve
(`CommCurve`: straight lines between neighbouring sizes on log-log axes), the source that costs a message the
curve brackets (`InterpolatedSource`), and how well the curves hold where a size was measured
(`held_out_checks`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from analysis.costs.records import INTERPOLATED, Costs, EventCost
from analysis.costs.samples import PLACEMENTS, CommPoints, bare_collective_note, comm_points, representative_seconds
from analysis.costs.source import CostSource
from analysis.profile_reader import Profile
from harness.plan.events import COMM_KINDS, INTER, Event, human_bytes


@dataclass(frozen=True)
class CommCurve:
    """The measured times of one kind of communication at one placement and group size, by size: what a
    message between two measured sizes is costed from."""

    kind: str
    placement: str
    group: int
    sizes: tuple[float, ...]  # ascending, distinct
    seconds: tuple[float, ...]

    def covers(self, nbytes: float) -> bool:
        return len(self.sizes) >= 2 and self.sizes[0] <= nbytes <= self.sizes[-1]

    def interpolate(self, nbytes: float) -> float:
        """Seconds at `nbytes` (within covers()): linear between the neighbouring sizes on log-log axes, so a
        time that grows as a power of the size between them is exact."""
        logs = np.log(np.asarray(self.sizes))
        return float(np.exp(np.interp(math.log(nbytes), logs, np.log(np.asarray(self.seconds)))))

    def neighbours(self, nbytes: float) -> tuple[float, float]:
        index = int(np.searchsorted(np.asarray(self.sizes), nbytes))
        return self.sizes[max(0, index - 1)], self.sizes[min(len(self.sizes) - 1, index)]


def comm_curves(points: CommPoints) -> dict[tuple[str, str, int], CommCurve]:
    """(kind, placement, group) -> its curve, from points with a positive time; two points at one size keep
    their geometric mean."""
    by_key: dict[tuple[str, str, int], dict[float, list[float]]] = {}
    for (kind, placement), pts in points.items():
        for nbytes, group, seconds in pts:
            if seconds > 0 and np.isfinite(seconds) and nbytes > 0:
                by_key.setdefault((kind, placement, int(group)), {}).setdefault(float(nbytes), []).append(seconds)
    curves = {}
    for key, by_size in sorted(by_key.items()):
        sizes = tuple(sorted(by_size))
        curves[key] = CommCurve(*key, sizes, tuple(float(np.exp(np.mean(np.log(by_size[n])))) for n in sizes))
    return curves


class InterpolatedSource(CostSource):
    """A communication event the profile lacks, between two measured sizes of its kind, placement and group
    size: the curve's time there; passes on one no curve brackets."""

    def __init__(self, curves: dict[tuple[str, str, int], CommCurve]):
        self.curves = curves

    def cost(self, eid: str, event: Event, costs: Costs) -> EventCost | None:
        if event.kind not in COMM_KINDS:
            return None
        curve = self.curves.get((event.kind, event.placement or INTER, event.group_size))
        if curve is None or not curve.covers(event.bytes):
            return None
        low, high = curve.neighbours(event.bytes)
        return EventCost(eid, event.name, event.kind, curve.interpolate(event.bytes), INTERPOLATED,
                         note=f"interpolated between the {human_bytes(low)} and {human_bytes(high)} measured"
                              + bare_collective_note(event.content))


@dataclass(frozen=True)
class HeldOutCheck:
    """A needed message costed from the other points of its curve, as if it had not been measured, against
    its own measurement: how well the curve holds between measured sizes."""

    id: str
    kind: str
    placement: str
    group: int
    nbytes: float
    measured_s: float
    interpolated_s: float

    @property
    def rel_error(self) -> float:
        return self.interpolated_s / self.measured_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "placement": self.placement, "group": self.group,
                "bytes": self.nbytes, "measured_s": self.measured_s, "interpolated_s": self.interpolated_s,
                "rel_error": self.rel_error}


def held_out_checks(profile: Profile, extra_points: CommPoints | None = None) -> list[HeldOutCheck]:
    """Every needed communication measurement between two other measured sizes of its kind, placement and
    group, costed from them without its own point (leave-one-out)."""
    points = comm_points(profile, extra_points)
    checks = []
    for eid, m in sorted(profile.measurements.items()):
        if (m.kind not in COMM_KINDS or not m.count or not m.attrs.get("needed") or m.placement not in PLACEMENTS
                or m.content.get("fsdp")):
            continue
        own = (m.bytes, m.group_size, representative_seconds(m))
        others = list(points[(m.kind, m.placement)])
        others.remove(own)
        curve = comm_curves({(m.kind, m.placement): others}).get((m.kind, m.placement, m.group_size))
        if curve is not None and curve.covers(m.bytes) and own[2] > 0:
            checks.append(HeldOutCheck(eid, m.kind, m.placement, m.group_size, float(m.bytes), own[2],
                                       curve.interpolate(m.bytes)))
    return checks

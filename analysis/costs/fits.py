"""Alpha-beta fits of the profile's communication points (per kind and placement), what the calibrated network
model is drawn from; and the last two sources of the chain, for a profile that gives no network model: the fit
(`FitSource`), then nothing at all (`UnavailableSource`: costed 0, with a warning)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from analysis.costs.records import FITTED, UNAVAILABLE, Costs, EventCost
from analysis.costs.samples import CommPoints, bare_collective_note
from analysis.costs.source import CostSource
from analysis.profile_reader import Profile
from harness.plan.events import COMM_KINDS, INTER, INTRA, Event


def comm_features(kind: str, nbytes: float, group: int) -> tuple[float, float]:
    """The (latency, bandwidth) coefficients of alpha and beta for one message or collective."""
    if kind == "p2p":
        return 1.0, float(nbytes)
    if group <= 1 and kind in COMM_KINDS:
        return 0.0, 0.0
    if kind == "allreduce":
        return 2.0 * (group - 1), 2.0 * (group - 1) / group * float(nbytes)
    if kind in ("allgather", "reducescatter"):  # ring: n - 1 steps, each moving a rank's share of the array
        return float(group - 1), (group - 1) / group * float(nbytes)
    if kind == "alltoall":  # every pair at once (analysis.network): one hop, all shares but a rank's own
        return 1.0, (group - 1) / group * float(nbytes)
    raise ValueError(f"no communication model for kind {kind!r}; known: {', '.join(COMM_KINDS)}, alltoall")


@dataclass(frozen=True)
class CommFit:
    """An alpha-beta model of one kind of communication at one placement, and how well it fits its points."""

    kind: str
    placement: str
    alpha_s: float
    beta_s_per_byte: float
    points: int  # measured points with a positive time that the fit used
    mean_rel_error: float  # over those points: mean of |predicted - measured| / measured
    max_rel_error: float
    form: str  # alpha-beta | bandwidth-only | latency-only | zero

    def predict(self, kind: str, nbytes: float, group: int) -> float:
        """Seconds for `kind` of `nbytes` over `group` ranks, with this fit's link alpha and beta."""
        latency, bandwidth = comm_features(kind, nbytes, group)
        return self.alpha_s * latency + self.beta_s_per_byte * bandwidth

    @property
    def bandwidth_bytes_s(self) -> float:
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "placement": self.placement, "alpha_s": self.alpha_s,
                "beta_s_per_byte": self.beta_s_per_byte, "points": self.points,
                "mean_rel_error": self.mean_rel_error, "max_rel_error": self.max_rel_error, "form": self.form}


def fit_alpha_beta(kind: str, placement: str, points: Iterable[tuple[float, int, float]]) -> CommFit:
    """Least-squares alpha, beta >= 0 from (bytes, group size, seconds) points, minimising relative error.

    With one distinct point shape (e.g. one size) alpha and beta cannot both be known: the fit keeps the
    one-parameter form (bandwidth-only first) that matches best.
    """
    rows = [(*comm_features(kind, nbytes, group), seconds) for nbytes, group, seconds in points
            if seconds > 0 and np.isfinite(seconds)]
    if not rows:
        return CommFit(kind, placement, 0.0, 0.0, 0, float("nan"), float("nan"), "zero")
    data = np.array(rows, dtype=np.float64)
    x = data[:, :2] / data[:, 2:3]  # each row scaled by 1/t: residuals are relative errors
    ones = np.ones(len(data))
    candidates: list[tuple[float, float, str]] = []
    if len(data) >= 2 and np.linalg.matrix_rank(x) == 2:
        (alpha, beta), *_ = np.linalg.lstsq(x, ones, rcond=None)
        if alpha >= 0 and beta >= 0:
            candidates.append((float(alpha), float(beta), "alpha-beta"))
    if not candidates:
        for column, form in ((1, "bandwidth-only"), (0, "latency-only")):
            norm = float(np.dot(x[:, column], x[:, column]))
            if norm > 0:
                value = float(np.dot(x[:, column], ones) / norm)
                candidates.append((0.0, value, form) if column == 1 else (value, 0.0, form))
    best = min(candidates, key=lambda c: (float(np.sum((x @ np.array(c[:2]) - 1.0) ** 2)),
                                          candidates.index(c)))
    relative = np.abs(x @ np.array(best[:2]) - 1.0)
    return CommFit(kind, placement, best[0], best[1], len(data), float(relative.mean()), float(relative.max()),
                   best[2])


def comm_fits(points: CommPoints) -> dict[tuple[str, str], CommFit]:
    """(kind, placement) -> the alpha-beta fit of its points."""
    return {key: fit_alpha_beta(key[0], key[1], pts) for key, pts in sorted(points.items())}


def choose_fit(fits: Mapping[tuple[str, str], CommFit], kind: str, placement: str) -> tuple[CommFit | None, str]:
    """The fit for an unmeasured event: same kind and placement, else the other placement, else another kind
    (in COMM_KINDS' order, at the same placement first: the formulas share the link's alpha and beta); fits of
    all-zero measurements come last."""
    other_placement = INTER if placement == INTRA else INTRA
    others = [k for k in COMM_KINDS if k != kind]
    order = ((kind, placement), (kind, other_placement), *((k, placement) for k in others),
             *((k, other_placement) for k in others))
    for need_points in (True, False):
        for key in order:
            fit = fits.get(key)
            if fit is None or bool(fit.points) != need_points:
                continue
            if not fit.points:
                return fit, f"every {key[0]} {key[1]} measurement took 0 s"
            if key == (kind, placement):
                return fit, f"extrapolated with the {kind} {placement} fit"
            return fit, (f"no {kind} measured {placement}: extrapolated with the {key[0]} {key[1]} fit "
                         "(the same link alpha and beta)")
    return None, ""


class FitSource(CostSource):
    """Communication by the nearest alpha-beta fit (choose_fit), marked extrapolated; passes on an event no
    fit covers. Afterwards, warns of each fit an event used (here or as the network model's calibrated link)
    that misses its own points by more than 25%."""

    def __init__(self, fits: Mapping[tuple[str, str], CommFit]):
        self.fits = fits

    def cost(self, eid: str, event: Event, costs: Costs) -> EventCost | None:
        if event.kind not in COMM_KINDS:
            return None
        fit, note = choose_fit(self.fits, event.kind, event.placement or INTER)
        if fit is None:
            return None
        seconds = fit.predict(event.kind, event.bytes, event.group_size)
        return EventCost(eid, event.name, event.kind, seconds, FITTED, (fit.kind, fit.placement),
                         note + bare_collective_note(event.content))

    def finish(self, costs: Costs) -> None:
        for (kind, placement), fit in self.fits.items():
            used = any(c.fit == (kind, placement) for c in costs.events.values())
            if used and fit.points and fit.max_rel_error > 0.25:
                costs.warnings.append(f"the {kind} {placement} fit misses its measured points by up to "
                                      f"{fit.max_rel_error:.0%}; its extrapolations are uncertain")


class UnavailableSource(CostSource):
    """The chain's end for communication: costed 0, marked unavailable, with a warning that the profile
    measured no communication."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.names: list[str] = []

    def cost(self, eid: str, event: Event, costs: Costs) -> EventCost | None:
        if event.kind not in COMM_KINDS:
            return None
        self.names.append(event.name)
        return EventCost(eid, event.name, event.kind, 0.0, UNAVAILABLE, note="no communication measured: costed 0")

    def finish(self, costs: Costs) -> None:
        if self.names:
            costs.warnings.append(
                f"NO COMMUNICATION WAS MEASURED in {self.profile.path.name} (a {self.profile.world_size}-rank "
                f"profile): {len(self.names)} communication event(s) ({', '.join(sorted(set(self.names)))}) "
                "cost 0, so the prediction covers compute only; profile on at least 2 ranks (2 nodes for "
                "inter-node communication) to include it")

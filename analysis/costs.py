"""The duration of every event of a plan, from a profile's measurements. The rules, one per kind of event,
with their reasons, are in docs/analysis.md ("Where durations come from"):

- compute and tensor-parallel composites: the mean of the samples (`compute_stat`: or the median), a compute
  event divided by its measuring rank's speed factor (`rank_speed`: its speed-probe median over the ranks'
  mean); a compute event the profile lacks is a UserError listing it and the command that profiles it;
- GPU forwards and backwards: the same statistic of the host's issue times (`host_issue`); backwards: what
  each further backward() call costs (`backward_call`), which a step pays once;
- P2P: the minimum sample; its post (`send_post`): the median; with the sender computing
  (`sender_busy_extra`): the mean excess over its own time;
- all-reduce: the median; a gradient bucket's averaging and zeroing (`bucket_divide`, `bucket_zero`): the
  compute statistic of their samples, else the rate of the largest all-reduce that has them;
- communication not measured at its size: interpolated on the measured points of its kind, placement and
  group size (`CommCurve`: straight lines between neighbouring sizes on log-log axes) where they bracket its
  size; else (beyond them, or at a group size or placement not measured) the network model
  (analysis.network): the spec's `[[cluster.network]]`, or tiers calibrated from the profile's own points
  (alpha-beta fits per kind and placement, `fit_alpha_beta`), costing the collective by NCCL's algorithms or
  the profiling backend's ring over where its group lies, marked extrapolated; a collective benchmark's
  points (`extra_points`, analysis.collectives) join the profile's; a what-if network (`network_only`) costs
  every communication event by the model;
- data-parallel replica skew (dp > 1): analysis.skew.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from analysis.calibration import device_kind
from analysis.network import Estimate, NetworkModel, calibrated_network, spec_network
from analysis.profile_reader import MeasuredEvent, Profile
from analysis.skew import MachineDrift, ReplicaSkew, machine_drift, replica_skew
from harness.common.errors import UserError
from harness.plan.events import COMM_KINDS, INTER, INTRA, EventPlan, composite_content, event_id, human_bytes
from harness.plan.network import check_tiers, group_span, parse_overrides
from harness.plan.spec import JobSpec, load_spec
from harness.store.hdf5_schema import (
    BACKWARD_CALL_ATTR,
    COMPUTE_PHASE_ATTR,
    DIVIDE_SERIES,
    RANK_SPEED_PROBE_ENV,
    ZERO_SERIES,
    compute_phase_key,
)

PLACEMENTS = (INTRA, INTER)
MEASURED, INTERPOLATED, FITTED, UNAVAILABLE, GIVEN = "measured", "interpolated", "fit", "unavailable", "given"
MODELLED = "network"  # costed by the network model (analysis.network)
CommPoints = Mapping[tuple[str, str], Iterable[tuple[float, int, float]]]  # (kind, placement) -> (bytes, group, s)


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


COMPUTE_STATS = ("mean", "median")


def statistic_of(kind: str, compute_stat: str = "mean") -> str:
    """Which statistic of a measurement's samples stands for it: min for P2P (no queueing), median for a
    collective, `compute_stat` (mean or median) for compute and composites."""
    if kind == "p2p":
        return "min"
    if kind in COMM_KINDS:
        return "median"
    _check_statistic(compute_stat)
    return compute_stat


def representative_seconds(measurement: MeasuredEvent, compute_stat: str = "mean") -> float:
    """The time that stands for a measurement (statistic_of)."""
    name = statistic_of(measurement.kind, compute_stat)
    return {"min": measurement.min_s, "median": measurement.median_s}.get(name, measurement.mean_s)


class SampleSet(NamedTuple):
    """Samples, as the statistic takes them (divided by their rank's speed factor), and the statistic that
    makes one duration of them: what analysis.uncertainty resamples."""

    values: np.ndarray
    statistic: str  # mean | median | min


def _check_statistic(name: str) -> None:
    if name not in COMPUTE_STATS:
        raise ValueError(f"unknown compute statistic {name!r}; known: {', '.join(COMPUTE_STATS)}")


def _statistic(name: str, mean: float, median: float) -> float:
    _check_statistic(name)
    return mean if name == "mean" else median


@dataclass(frozen=True)
class EventCost:
    """One event's duration and where it came from."""

    id: str
    name: str
    kind: str
    seconds: float
    source: str  # measured | interpolated | network | fit | unavailable (costed 0) | given
    fit: tuple[str, str] | None = None  # (kind, placement) of the fit used
    note: str = ""

    @property
    def extrapolated(self) -> bool:
        return self.source in (FITTED, MODELLED, UNAVAILABLE)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "kind": self.kind, "seconds": self.seconds, "source": self.source,
                "fit": "/".join(self.fit) if self.fit else None, "note": self.note}


@dataclass
class Costs:
    """Durations of a plan's events, the communication fits and what the prediction lacks."""

    events: dict[str, EventCost]
    fits: dict[tuple[str, str], CommFit] = field(default_factory=dict)
    # (kind, placement, group size) -> the measured points a message between two of their sizes is costed from
    curves: dict[tuple[str, str, int], CommCurve] = field(default_factory=dict)
    # compute event id -> seconds of the layer with its tensor-parallel all-reduces, measured together
    composites: dict[str, float] = field(default_factory=dict)
    # P2P event id -> extra seconds of a transfer that waits for its receiver while the sender computes
    sender_busy_extra: dict[str, float] = field(default_factory=dict)
    # P2P event id -> the sender's host seconds to post the send, before its device goes on
    send_post: dict[str, float] = field(default_factory=dict)
    # GPU compute event id -> the host's seconds to issue it (its `seconds` are the device's alone)
    host_issue: dict[str, float] = field(default_factory=dict)
    # backward compute event id -> the host's seconds of one backward() call that its samples paid and a
    # step pays once per stage (profiles from before it was measured have none: 0)
    backward_call: dict[str, float] = field(default_factory=dict)
    # data-parallel bucket all-reduce event id -> seconds to divide the bucket by the replica count first
    bucket_divide: dict[str, float] = field(default_factory=dict)
    # data-parallel bucket all-reduce event id -> seconds to zero the bucket for the next iteration
    bucket_zero: dict[str, float] = field(default_factory=dict)
    # the ranks' speed over time in the profile: how far the slowest data-parallel replica lags (analysis.skew)
    replica_skew: ReplicaSkew | None = None
    # per compute phase (profile.h5's key), every profiling rank's speed-probe time over the ranks' mean: the
    # factor its compute samples were divided by (empty: samples as taken)
    rank_speed: dict[str, list[float]] = field(default_factory=dict)
    compute_stat: str = "mean"  # the statistic of a compute event's samples that stands for it (or "given")
    # where durations above came from samples, the samples: event id -> SampleSet, for `events`, `host_issue`
    # and `composites` (what a prediction's interval resamples; analysis.uncertainty)
    sampled: dict[str, dict[str, SampleSet]] = field(
        default_factory=lambda: {"events": {}, "host_issue": {}, "composites": {}})
    warnings: list[str] = field(default_factory=list)
    unmeasured: list[dict[str, str]] = field(default_factory=list)  # needed events without a measurement
    # how well the communication curves hold between measured sizes (held_out_checks; filled by analysis.predict)
    held_out: list[HeldOutCheck] = field(default_factory=list)
    # what costs communication beyond the measured curves (the spec's network or one calibrated from the profile)
    network: NetworkModel | None = None
    # how the machine's speed moved over the profile (analysis.skew), and the kind of device it ran on ('cpu',
    # 'cuda'; '' for durations given by hand): what a prediction's interval adds to its sampling noise
    machine_drift: MachineDrift | None = None
    device: str = ""

    def seconds(self, eid: str) -> float:
        return self.events[eid].seconds

    @property
    def extrapolated(self) -> list[EventCost]:
        """Communication events whose duration came from a fit (or is missing altogether)."""
        return sorted((c for c in self.events.values() if c.extrapolated), key=lambda c: (c.kind, c.name, c.id))

    @property
    def interpolated(self) -> list[EventCost]:
        """Communication events costed between two measured sizes of their kind, placement and group."""
        return sorted((c for c in self.events.values() if c.source == INTERPOLATED),
                      key=lambda c: (c.kind, c.name, c.id))

    @classmethod
    def from_seconds(cls, plan: EventPlan, seconds: Mapping[str, float]) -> Costs:
        """Costs given directly (what-if studies, tests): every event of the plan needs a duration."""
        missing = [eid for eid in plan.events if eid not in seconds]
        if missing:
            raise ValueError(f"no duration for {len(missing)} events: {', '.join(missing[:5])}")
        return cls({eid: EventCost(eid, e.name, e.kind, float(seconds[eid]), GIVEN)
                    for eid, e in plan.events.items()}, compute_stat=GIVEN)


class MissingComputeError(UserError):
    """The profile lacks compute events that the plan needs; lists them and the command that profiles them."""

    def __init__(self, plan: EventPlan, missing: Sequence[str], ranks: int, spec_hint: str):
        self.missing = list(missing)
        s = plan.spec.strategy
        extra = (",sp=true" if s.sp else "") + (f",cp={s.cp}" if s.cp > 1 else "")
        lines = [f"the profile lacks {len(missing)} compute event(s) that {plan.spec.model.name} with "
                 f"dp={s.dp},tp={s.tp},pp={s.pp}{extra},micro={plan.spec.batch.micro} needs:"]
        for eid in missing:
            event = plan.events[eid]
            content = event.content
            signature = dict(content.get("signature", {}))
            detail = [f"{k} {content[k]}" for k in ("micro", "seq") if k in content]
            detail += [f"tp {signature['tp']}"] if "tp" in signature else []
            lines.append(f"  {eid}  {event.name}" + (f"  ({', '.join(detail)})" if detail else ""))
        lines.append(f"profile them with: mpirun -n {ranks} python -m harness profile {spec_hint} -o OUTDIR")
        if spec_hint == "SPEC":
            lines.append(f"  (SPEC: a job spec with this model and strategy: dp = {s.dp}, tp = {s.tp}, pp = {s.pp}, "
                         + ("sp = true, " if s.sp else "") + (f"cp = {s.cp}, " if s.cp > 1 else "")
                         + f"micro = {plan.spec.batch.micro})")
        super().__init__("\n".join(lines))


def measured_comm_points(profile: Profile) -> dict[tuple[str, str], list[tuple[float, int, float]]]:
    """(kind, placement) -> [(bytes, group size, seconds)] over every communication measurement but FSDP2's
    (zero > 0: the collective with FSDP2's copies, not the bare one the curves and fits describe)."""
    points: dict[tuple[str, str], list[tuple[float, int, float]]] = {}
    for m in profile.measurements.values():
        if m.kind in COMM_KINDS and m.placement in PLACEMENTS and m.count and not m.content.get("fsdp"):
            points.setdefault((m.kind, m.placement), []).append((m.bytes, m.group_size, representative_seconds(m)))
    return points


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
    points = measured_comm_points(profile)
    for key, extra in (extra_points or {}).items():
        points[key] = list(points.get(key, [])) + list(extra)
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


def rank_speed_factors(profile: Profile) -> dict[str, list[float]]:
    """Per compute phase, each profiling rank's speed-probe median over the ranks' mean (1.1: that rank took
    10% longer than the ranks' mean); phases with fewer than two usable ranks are left out, and a rank
    without a usable probe gets 1."""
    speeds = profile.environment.get(RANK_SPEED_PROBE_ENV)
    if not isinstance(speeds, dict):
        return {}
    out = {}
    for key, medians in speeds.items():
        if not isinstance(medians, list):
            continue
        values = [float(v) if isinstance(v, (int, float)) and np.isfinite(v) and v > 0 else None for v in medians]
        usable = [v for v in values if v is not None]
        if len(usable) < 2:
            continue
        mean = sum(usable) / len(usable)
        out[str(key)] = [v / mean if v is not None else 1.0 for v in values]
    return out


def _rank_factor(measurement: MeasuredEvent, factors: Mapping[str, list[float]]) -> float | None:
    """The speed factor of the rank that took a compute measurement: 1 where its rank had no usable probe,
    None where its profiling run has no probe in the profile at all."""
    phase = measurement.attrs.get(COMPUTE_PHASE_ATTR)
    per_rank = factors.get(compute_phase_key(phase)) if phase is not None else None
    if per_rank is None or not measurement.ranks:
        return None
    rank = measurement.ranks[0]
    return per_rank[rank] if 0 <= rank < len(per_rank) else 1.0


def network_for(spec: JobSpec, profile: Profile, points: CommPoints | None = None,
                fits: Mapping[tuple[str, str], CommFit] | None = None) -> NetworkModel | None:
    """The target's network: the spec's `[[cluster.network]]`, else tiers calibrated from the profile's points
    (a node of the spec's gpus_per_node, then the rest); None when the profile measured no communication."""
    cluster = spec.cluster
    if points is None:
        points = measured_comm_points(profile)
    if fits is None:
        fits = {key: fit_alpha_beta(key[0], key[1], pts) for key, pts in sorted(points.items())}
    if cluster.network:
        return spec_network(cluster.network)
    return calibrated_network(points, cluster.gpus_per_node, profile.path.name,
                              lambda kind, placement, _: fits[(kind, placement)])


def what_if_network(spec: JobSpec, profile: Profile, what_if: str, points: CommPoints | None = None,
                    fits: Mapping[tuple[str, str], CommFit] | None = None) -> NetworkModel:
    """The network of `--network`: another spec's `[[cluster.network]]` (a TOML path), or 'TIER.FIELD=VALUE,...'
    changes to `spec`'s network (network_for's); UserError when it is neither or breaks a tier's rule."""
    devices = spec.cluster.devices
    if what_if.endswith(".toml") or Path(what_if).is_file():
        other = load_spec(what_if, import_factory=False)
        if not other.cluster.network:
            raise UserError(f"--network {what_if}: that spec has no [[cluster.network]] to take the tiers from")
        check_tiers(other.cluster.network, devices, f"--network {what_if} for {devices} GPUs")
        return NetworkModel(other.cluster.network, origin=f"what-if {what_if}")
    overrides = parse_overrides(what_if)
    base = network_for(spec, profile, points, fits)
    if base is None:
        raise UserError(f"--network {what_if}: {profile.path.name} measured no communication, so it has no network "
                        "to change; give a spec with [[cluster.network]] instead")
    return base.with_overrides(overrides, devices)


def estimate_costs(plan: EventPlan, profile: Profile, spec_hint: str = "SPEC", compute_stat: str = "mean",
                   rank_speed: bool = True, extra_points: CommPoints | None = None,
                   network: NetworkModel | None = None, network_only: bool = False,
                   what_if: str | None = None) -> Costs:
    """The duration of every event of `plan` from `profile` (rules in the module docstring).

    Raises MissingComputeError (a UserError) listing the compute events the profile lacks; `spec_hint`
    is the spec path to show in the command that profiles them. `compute_stat`: mean or median.
    `rank_speed`: refer each compute event to the profiling ranks' mean speed (where the profile has the probe).
    `extra_points`: more communication points (a collective benchmark's), interpolated and fitted with the
    profile's. `network`: the network model beyond the measured curves (default: network_for's); with
    `network_only` (a what-if network) every communication event comes from it. `what_if`: --network's text
    (what_if_network), which sets both.
    """
    _check_statistic(compute_stat)

    def measured(eid: str) -> bool:
        measurement = profile.measurements.get(eid)
        return measurement is not None and measurement.count > 0

    missing = sorted((eid for eid, e in plan.events.items() if e.kind == "compute" and not measured(eid)),
                     key=lambda eid: plan.events[eid].name)
    if missing:
        raise MissingComputeError(plan, missing, max(profile.world_size, 1), spec_hint)
    points = measured_comm_points(profile)
    for key, extra in (extra_points or {}).items():
        points[key] = list(points.get(key, [])) + list(extra)
    fits = {key: fit_alpha_beta(key[0], key[1], pts) for key, pts in sorted(points.items())}
    if what_if:
        network, network_only = what_if_network(plan.spec, profile, what_if, points, fits), True
    network = network or network_for(plan.spec, profile, points, fits)
    costs = Costs(events={}, fits=fits, curves=comm_curves(points), compute_stat=compute_stat,
                  rank_speed=rank_speed_factors(profile) if rank_speed else {}, network=network,
                  machine_drift=machine_drift(profile), device=device_kind(profile.environment))
    # tensor-parallel shards also measured with their all-reduces, as composites
    composites = {eid: m for eid, event in plan.events.items() if event.kind == "compute"
                  and (m := profile.measurements.get(event_id(composite_content(event.content)))) is not None
                  and m.count}
    no_comm_events: list[str] = []
    uncorrected: list[str] = []  # compute events from a profiling run without a probe, where others have one
    for eid, event in plan.events.items():
        if network_only and network is not None and event.kind in COMM_KINDS:
            costs.events[eid] = _modelled(plan, eid, network, "what-if network; ")
            continue
        if measured(eid):
            measurement = profile.measurements[eid]
            seconds = representative_seconds(measurement, compute_stat)
            factor = 1.0
            if event.kind == "compute" and costs.rank_speed and eid not in composites:
                factor = _rank_factor(measurement, costs.rank_speed)
                if factor is None:
                    uncorrected.append(event.name)
                    factor = 1.0
            costs.events[eid] = EventCost(eid, event.name, event.kind, seconds / factor, MEASURED)
            costs.sampled["events"][eid] = SampleSet(measurement.samples_s / factor,
                                                     statistic_of(event.kind, compute_stat))
            host = measurement.host_issue_samples_s if event.kind == "compute" else np.empty(0)
            if host.size:
                costs.host_issue[eid] = _statistic(compute_stat, float(host.mean()), float(np.median(host)))
                costs.sampled["host_issue"][eid] = SampleSet(host, compute_stat)
            call = measurement.attrs.get(BACKWARD_CALL_ATTR) if event.kind == "compute" else None
            if call is not None and np.isfinite(call):
                costs.backward_call[eid] = float(call) / factor
            continue
        reason = profile.unmeasured.get(eid, "not in the profile (its spec or strategy differs from this one)")
        curve = costs.curves.get((event.kind, event.placement or INTER, event.group_size))
        # an FSDP2 collective (zero > 0) the profile lacks is costed as the bare one: without FSDP2's copies
        bare = "; FSDP2's copies not in it (the bare collective's curve)" if event.content.get("fsdp") else ""
        if curve is not None and curve.covers(event.bytes):
            low, high = curve.neighbours(event.bytes)
            costs.events[eid] = EventCost(
                eid, event.name, event.kind, curve.interpolate(event.bytes), INTERPOLATED,
                note=f"interpolated between the {human_bytes(low)} and {human_bytes(high)} measured{bare}")
            continue
        costs.unmeasured.append({"id": eid, "name": event.name, "kind": event.kind, "reason": reason})
        if network is not None:
            cost = _modelled(plan, eid, network, bare.removeprefix("; ") + "; " if bare else "")
            costs.events[eid] = cost
            continue
        fit, note = _choose_fit(fits, event.kind, event.placement or INTER)
        if fit is None:
            costs.events[eid] = EventCost(eid, event.name, event.kind, 0.0, UNAVAILABLE,
                                          note="no communication measured: costed 0")
            no_comm_events.append(event.name)
            continue
        seconds = fit.predict(event.kind, event.bytes, event.group_size)
        costs.events[eid] = EventCost(eid, event.name, event.kind, seconds, FITTED, (fit.kind, fit.placement),
                                      note + bare)
    if uncorrected:
        costs.warnings.append(
            f"{len(uncorrected)} compute event(s) ({', '.join(sorted(set(uncorrected)))}) come from a profiling run "
            f"whose ranks' speeds {profile.path.name} cannot compare (it stopped before all its ranks had written "
            "their speed probe, or fewer than two of its ranks measured compute), so they keep their rank's speed "
            "while the others stand for the ranks' mean; profile again with --force to measure them alike")
    _sender_busy_extras(plan, profile, costs)
    _send_posts(plan, profile, costs)
    if plan.spec.strategy.gradient_replicas > 1:
        _bucket_passes(plan, profile, costs)
        costs.replica_skew = replica_skew(profile)
        if costs.replica_skew is None:
            costs.warnings.append(
                f"{profile.path.name} does not show how its ranks' speeds differ (no compute sample times from "
                "two ranks at the same moments: a profile written before they were recorded, one rank, or too "
                "few repeats), so the prediction has no wait for the slowest data-parallel replica; profile "
                "again on 2 or more ranks with more repeats to include it")
    for eid, composite in composites.items():
        costs.composites[eid] = representative_seconds(composite, compute_stat)
        costs.sampled["composites"][eid] = SampleSet(composite.samples_s, compute_stat)
    if no_comm_events:
        costs.warnings.append(
            f"NO COMMUNICATION WAS MEASURED in {profile.path.name} (a {profile.world_size}-rank profile): "
            f"{len(no_comm_events)} communication event(s) ({', '.join(sorted(set(no_comm_events)))}) cost 0, "
            "so the prediction covers compute only; profile on at least 2 ranks (2 nodes for inter-node "
            "communication) to include it")
    for (kind, placement), fit in fits.items():
        used = any(c.fit == (kind, placement) for c in costs.events.values())
        if used and fit.points and fit.max_rel_error > 0.25:
            costs.warnings.append(f"the {kind} {placement} fit misses its measured points by up to "
                                  f"{fit.max_rel_error:.0%}; its extrapolations are uncertain")
    return costs


def communication_by_tier(plan: EventPlan, costs: Costs) -> dict[str, float]:
    """Each network tier's share of an iteration's communication time, summed over every device (an event's
    seconds x its count), by the outermost tier any of its groups crosses; without a network model, by
    placement."""
    seconds: dict[str, float] = {}
    tiers = costs.network.tiers if costs.network is not None else None
    for eid, event in plan.events.items():
        if event.kind not in COMM_KINDS or eid not in costs.events:
            continue
        if tiers is not None:
            groups = plan.group_ranks.get(eid) or [tuple(range(event.group_size))]
            name = tiers[max(group_span(ranks, tiers).crossing for ranks in groups)].name
        else:
            name = event.placement or INTER
        seconds[name] = seconds.get(name, 0.0) + costs.seconds(eid) * plan.multiplicity[eid]
    total = sum(seconds.values())
    order = [t.name for t in tiers] if tiers is not None else list(PLACEMENTS)
    return {name: seconds[name] / total for name in order if name in seconds} if total > 0 else {}


def slowest_group(plan: EventPlan, eid: str, network: NetworkModel) -> Estimate:
    """The network model's estimate for the slowest of the groups the plan keeps for a communication event (they
    may lie differently on the tiers: one pipeline boundary inside a leaf, the next across the spine)."""
    event = plan.events[eid]
    op = "sendrecv" if event.kind == "p2p" else event.kind
    groups = plan.group_ranks.get(eid) or [tuple(range(event.group_size))]
    return max((network.estimate_group(op, float(event.bytes), ranks) for ranks in groups),
               key=lambda estimate: estimate.seconds)


def _modelled(plan: EventPlan, eid: str, network: NetworkModel, prefix: str = "") -> EventCost:
    """An event costed by the network model, its note naming the algorithm, protocol and tiers."""
    event = plan.events[eid]
    estimate = slowest_group(plan, eid, network)
    fit = network.link_fits.get((event.kind, estimate.span.crossing))
    borrowed = ""
    if fit is not None and fit != (event.kind, network.tiers[estimate.span.crossing].name):
        borrowed = (f"; no {event.kind} measured {network.tiers[estimate.span.crossing].name}: the {fit[0]} {fit[1]} "
                    "fit's link" + (" (the same link alpha and beta)" if fit[0] != event.kind else ""))
    return EventCost(eid, event.name, event.kind, estimate.seconds, MODELLED, fit,
                     f"{prefix}network model ({network.origin}): {estimate.describe(network.tiers)}{borrowed}")


def _sender_busy_extras(plan: EventPlan, profile: Profile, costs: Costs) -> None:
    """Fill costs.sender_busy_extra for the plan's P2P events (rules in the module docstring)."""
    by_placement: dict[str, float] = {}
    measured_extra: dict[str, float] = {}
    for eid, m in profile.measurements.items():
        if m.kind != "p2p" or not m.count or m.sender_busy_samples_s.size == 0:
            continue
        extra = max(0.0, float(m.sender_busy_samples_s.mean()) - representative_seconds(m))
        measured_extra[eid] = extra
        by_placement[m.placement] = max(extra, by_placement.get(m.placement, 0.0))
    for eid, event in plan.events.items():
        if event.kind != "p2p":
            continue
        extra = measured_extra.get(eid, by_placement.get(event.placement or INTER))
        if extra:
            costs.sender_busy_extra[eid] = extra


def _send_posts(plan: EventPlan, profile: Profile, costs: Costs) -> None:
    """Fill costs.send_post for the plan's P2P events (rules in the module docstring)."""
    measured: dict[str, tuple[str, int, float]] = {}  # id -> placement, bytes, median post
    for eid, m in profile.measurements.items():
        posts = m.send_post_samples_s if m.kind == "p2p" and m.count else np.empty(0)
        posts = posts[np.isfinite(posts)]
        if posts.size:
            measured[eid] = (m.placement, m.bytes, float(np.median(posts)))
    for eid, event in plan.events.items():
        if event.kind != "p2p":
            continue
        if eid in measured:
            costs.send_post[eid] = measured[eid][2]
            continue
        placement = event.placement or INTER
        peers = [(abs(math.log(max(nbytes, 1) / max(event.bytes, 1))), post)
                 for p, nbytes, post in measured.values() if p == placement]
        if peers:
            costs.send_post[eid] = min(peers)[1]


def _bucket_passes(plan: EventPlan, profile: Profile, costs: Costs) -> None:
    """Fill costs.bucket_divide and costs.bucket_zero for the plan's gradient-bucket all-reduces (rules in
    the module docstring)."""
    passes = ((DIVIDE_SERIES, costs.bucket_divide, "averaging (the division by the replica count)"),
              (ZERO_SERIES, costs.bucket_zero, "zeroing after the optimizer step"))
    for series, target, what in passes:
        measured = {eid: _statistic(costs.compute_stat, float(samples.mean()), float(np.median(samples)))
                    for eid, m in profile.measurements.items()
                    if m.kind == "allreduce" and m.count and (samples := m.series[series]).size}
        rated = [(profile.measurements[eid].bytes, seconds) for eid, seconds in measured.items()
                 if profile.measurements[eid].bytes > 0]
        largest_bytes, largest_s = max(rated, default=(0, 0.0))
        for program in plan.stages:
            for bucket in program.buckets:
                if bucket.event in measured:
                    target[bucket.event] = measured[bucket.event]
                elif largest_bytes:
                    target[bucket.event] = largest_s / largest_bytes * plan.events[bucket.event].bytes
        if not target and any(program.buckets for program in plan.stages):
            costs.warnings.append(
                f"{profile.path.name} has no all-reduce with `{series}` (written before they were measured), so "
                f"the prediction leaves out each gradient bucket's {what}; profile again to include it")


def _choose_fit(fits: Mapping[tuple[str, str], CommFit], kind: str, placement: str) -> tuple[CommFit | None, str]:
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

"""How far to trust a prediction: the batch time's interval from the profile's own samples (a bootstrap).

Rules (docs/analysis.md, "How far to trust a prediction"):
- every duration the costs took from samples (Costs.sampled: compute events, their host issue times, composites,
  measured P2P and all-reduces) is drawn again as its statistic (mean, median or minimum) of a circular block
  resample of its samples in the order taken (bootstrap_statistics: the machine's drift makes samples in a row
  alike, which a resample of single samples would not keep); each resample is simulated as the prediction is;
- what does not come from an event's own samples stays as predicted: the network model's communication, the
  sender-busy and post times, the buckets' division and zeroing, the replica skew;
- the sampling interval (batch_time_interval) is the 5th, 50th and 95th percentile of the resampled batch times:
  how much the prediction would move with another profile of the same length on the same machine; the search
  tells candidates apart by it (what moves every candidate alike cancels there);
- the prediction's interval (prediction_interval) also holds what moves a run: each resampled batch time is
  drawn CALIBRATION_DRAWS times more, times a factor of the model's own error on held-out runs of the profile's
  device kind (analysis.calibration). Those runs were a profile and then a run on such a machine, so their
  errors hold the machine's drift between the two; only for a kind without them is the factor 1 + the drift
  over this profile (analysis.skew.MachineDrift: its relative standard deviation) x a standard normal draw;
- a prediction without samples (a spec alone, every compute event from a GPU's description) is its batch time times
  the 5th, 50th and 95th percentile of the model's held-out error on published GPU runs predicted so
  (spec_only_interval: analysis/data/gpu_residuals.json, bench/published.py); a spec on more than one node draws
  on the multi-node runs' own held-out errors, and one otherwise outside those runs' domain (wider, more devices)
  on the errors of fits scored outside their own (gpu_residuals_for). A
  GPU profile's prediction does not draw from them (its compute is measured, not modelled): it keeps its kind's
  profiled pairs or the drift. A CPU description's (`processor = "cpu"`, harness device's on a CPU) draws on the
  spec-only errors of bench/device_model.py's pairs instead (analysis/data/cpu_spec_only_residuals.json: a
  calibration, then a run, on the same machine); none where that file has none;
- what makes it as wide as it is (explain_interval): each source (an event's costs from one set of samples)
  moved alone from the 5th to the 95th percentile of its own draws, every other source at its predicted
  value; its share of the variance is the square of the batch time's swing over the sum of every source's.
The generator is seeded, so the same profile gives the same interval every time.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from analysis.calibration import RESIDUALS_PATH, ModelResiduals, model_residuals
from analysis.costs import Costs, SampleSet
from analysis.simulate import batch_time
from harness.plan.events import EventPlan
from harness.plan.precision import BATCHES, MIN_BATCHED
from harness.plan.spec import JobSpec

DEFAULT_RESAMPLES = 200
SEED = 20261201
CALIBRATION_DRAWS = 20  # draws of the run's own factors per resampled batch time
# held-out errors on GPUs: bench/published.py's held-out half of vTrain's single-node A100 runs (spec-only predictions)
GPU_RESIDUALS_PATH = RESIDUALS_PATH.with_name("gpu_residuals.json")
CPU_SPEC_ONLY_RESIDUALS_PATH = RESIDUALS_PATH.with_name("cpu_spec_only_residuals.json")


@dataclass(frozen=True)
class BatchTimeInterval:
    """The batch time's percentiles over `resamples` bootstrap resamples of the profile's samples; a prediction's
    interval (prediction_interval) also holds the machine's drift and the model's error, and keeps `sampling`,
    the bootstrap's alone."""

    p5_s: float
    p50_s: float
    p95_s: float
    resamples: int
    sampling: BatchTimeInterval | None = None
    drift_sigma: float | None = None  # the machine's drift over the profile (held only without `residuals`)
    residuals: str | None = None  # the held-out runs whose errors it holds (ModelResiduals.source)
    beyond_domain: bool = False  # those errors are of predictions beyond the runs fitted on (ModelResiduals.beyond)

    def contains(self, seconds: float) -> bool:
        return self.p5_s <= seconds <= self.p95_s

    @property
    def width(self) -> float:
        """(p95 - p5) / p50: the interval's width relative to its middle."""
        return (self.p95_s - self.p5_s) / self.p50_s if self.p50_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        sampling = self.sampling or self
        return {"batch_time_p5_s": self.p5_s, "batch_time_p50_s": self.p50_s, "batch_time_p95_s": self.p95_s,
                "interval_resamples": self.resamples, "interval_sampling_p5_s": sampling.p5_s,
                "interval_sampling_p95_s": sampling.p95_s, "interval_drift_sigma": self.drift_sigma,
                "interval_model_residuals": self.residuals, "interval_beyond_domain": self.beyond_domain}


def bootstrap_statistics(samples: SampleSet, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`resamples` values of the statistic, each of a circular block resample of the samples in the order taken:
    blocks of n // BATCHES consecutive samples (1 below MIN_BATCHED samples: a plain bootstrap) from random
    starts, wrapping past the end, joined up to n (harness.plan.precision says why samples in a row are not
    independent)."""
    values = samples.values[np.isfinite(samples.values)]
    n = values.size
    if n <= 1:
        return np.full(resamples, float(values[0]) if n else 0.0)
    block = n // BATCHES if n >= MIN_BATCHED else 1
    blocks = -(-n // block)
    starts = rng.integers(0, n, size=(resamples, blocks))
    # circular blocks (wrapping past the last sample) weigh every sample alike, the series' ends included
    index = ((starts[:, :, None] + np.arange(block)) % n).reshape(resamples, blocks * block)[:, :n]
    drawn = values[index]
    if samples.statistic == "mean":
        return drawn.mean(axis=1)
    if samples.statistic == "median":
        return np.median(drawn, axis=1)
    return drawn.min(axis=1)


Draws = dict[str, dict[str, np.ndarray]]  # part of Costs.sampled -> event id -> one value per resample


def draws(costs: Costs, resamples: int, seed: int = SEED) -> Draws:
    """Every sampled duration's `resamples` values, drawn in one order (parts, then event ids, sorted) from one
    seeded generator: the same costs, resamples and seed give the same draws."""
    rng = np.random.default_rng(seed)
    return {part: {eid: bootstrap_statistics(s, resamples, rng) for eid, s in sorted(table.items())}
            for part, table in sorted(costs.sampled.items())}


def costs_with(costs: Costs, values: Mapping[str, Mapping[str, float]]) -> Costs:
    """A copy of `costs` with the durations in `values` (part -> event id -> seconds) replaced."""
    events = dict(costs.events)
    for eid, seconds in values.get("events", {}).items():
        events[eid] = replace(events[eid], seconds=float(seconds))
    host = {**costs.host_issue, **{eid: float(v) for eid, v in values.get("host_issue", {}).items()}}
    composites = {**costs.composites, **{eid: float(v) for eid, v in values.get("composites", {}).items()}}
    return replace(costs, events=events, host_issue=host, composites=composites)


def resampled_costs(costs: Costs, resamples: int, seed: int = SEED, start: int = 0,
                    stop: int | None = None) -> list[Costs]:
    """Copies of `costs` with every sampled duration drawn again (rules above): resamples start..stop-1 of
    `resamples` (all by default; a slice holds the same copies as the whole)."""
    drawn = draws(costs, resamples, seed)
    return [costs_with(costs, {part: {eid: values[r] for eid, values in table.items()}
                               for part, table in drawn.items()})
            for r in range(start, resamples if stop is None else min(stop, resamples))]


def resampled_batch_times(plan: EventPlan, costs: Costs, dp_overlap: bool | None = None,
                          resamples: int = DEFAULT_RESAMPLES, seed: int = SEED, start: int = 0,
                          stop: int | None = None) -> np.ndarray:
    """The simulated batch time of resamples start..stop-1 of `resamples` (slices of one set of draws: joined,
    they are the whole, so the work can be split over processes)."""
    return np.array([batch_time(plan, c, dp_overlap)
                     for c in resampled_costs(costs, resamples, seed, start, stop)], dtype=float)


def interval_of(times: np.ndarray) -> BatchTimeInterval:
    """The 5-50-95 percentiles of resampled batch times."""
    p5, p50, p95 = np.percentile(times, [5, 50, 95])
    return BatchTimeInterval(float(p5), float(p50), float(p95), int(times.size))


def has_samples(costs: Costs) -> bool:
    """Whether any duration came from samples (else there is no interval to give)."""
    return any(costs.sampled.values())


def relative_reach(costs: Costs, resamples: int = DEFAULT_RESAMPLES, seed: int = SEED,
                   cache: dict[tuple[str, str], tuple[float, float]] | None = None) -> tuple[float, float]:
    """(down, up): the largest relative distances from a sampled duration to the 5th and to the 95th percentile
    of its own draws ((0, 0) without samples). With every source at its 5th (95th) percentile at once, the
    batch time is at least (1 - down) (at most (1 + up)) times the prediction: the timeline is monotone in
    its durations and scales with them; the interval, of independent draws, lies inside those corners. Each
    source is drawn from a generator seeded by the source itself, so its figures do not depend on the others,
    and `cache` ((part, event id) -> figures) keeps them across the candidates of one profile and options."""
    cache = {} if cache is None else cache
    down = up = 0.0
    for part, table in costs.sampled.items():
        for eid, samples in table.items():
            key = (part, eid)
            if key not in cache:
                point = _point(costs, part, eid)
                rng = np.random.default_rng([seed, zlib.crc32(f"{part}/{eid}".encode())])
                drawn = bootstrap_statistics(samples, resamples, rng)
                low, high = (float(v) for v in np.percentile(drawn, [5, 95]))
                cache[key] = ((max(0.0, (point - low) / point), max(0.0, (high - point) / point)) if point > 0
                              else (0.0, 0.0))
            down, up = max(down, cache[key][0]), max(up, cache[key][1])
    return down, up


def _point(costs: Costs, part: str, eid: str) -> float:
    """The predicted duration of one sampled source."""
    if part == "events":
        return costs.events[eid].seconds
    return {"host_issue": costs.host_issue, "composites": costs.composites}[part][eid]


def batch_time_interval(plan: EventPlan, costs: Costs, dp_overlap: bool | None = None,
                        resamples: int = DEFAULT_RESAMPLES, seed: int = SEED) -> BatchTimeInterval | None:
    """The batch time's 5-50-95 percentiles over bootstrap resamples (None with no resamples or no samples)."""
    if resamples <= 0 or not has_samples(costs):
        return None
    return interval_of(resampled_batch_times(plan, costs, dp_overlap, resamples, seed))


def prediction_interval(plan: EventPlan, costs: Costs, dp_overlap: bool | None = None,
                        resamples: int = DEFAULT_RESAMPLES, seed: int = SEED) -> BatchTimeInterval | None:
    """The prediction's 90% interval: the sampling interval's resamples times the model's held-out error and the
    machine's drift (module docstring); the sampling interval alone where neither is known; without samples,
    a device-model prediction's spec_only_interval on its processor's held-out spec-only runs; None with no
    resamples, or no samples and no device model (or no held-out runs of its processor)."""
    if resamples <= 0:
        return None
    if not has_samples(costs):
        if costs.device_model is None:
            return None
        residuals = spec_only_residuals(plan.spec, costs.device_model.description.processor)
        if residuals is None:  # GPU runs say nothing of a CPU description's error, nor CPU runs of a GPU's
            return None
        return spec_only_interval(batch_time(plan, costs, dp_overlap), residuals)
    times = resampled_batch_times(plan, costs, dp_overlap, resamples, seed)
    sampling = interval_of(times)
    residuals = model_residuals(costs.device) if costs.device else None
    drift = costs.machine_drift.sigma if costs.machine_drift is not None else None
    if residuals is None and not drift:
        return sampling
    rng = np.random.default_rng([seed, CALIBRATION_DRAWS])
    spread = np.repeat(times, CALIBRATION_DRAWS)
    if residuals is not None:  # their errors hold a run's drift from its profile: not counted twice
        spread = spread * rng.choice(np.asarray(residuals.ratios), size=spread.size)
    else:
        spread = spread * np.clip(1.0 + drift * rng.standard_normal(spread.size), 0.05, None)
    p5, p50, p95 = (float(v) for v in np.percentile(spread, [5, 50, 95]))
    return BatchTimeInterval(p5, p50, p95, int(times.size), sampling, drift,
                             residuals.source if residuals is not None else None)


def spec_only_interval(batch_time_s: float, residuals: ModelResiduals) -> BatchTimeInterval:
    """A prediction without samples (every compute event from the device model): `batch_time_s` times the 5th,
    50th and 95th percentile of the held-out residuals' ratios (run over prediction: spec_only_residuals')."""
    p5, p50, p95 = (batch_time_s * float(v) for v in np.percentile(np.asarray(residuals.ratios), [5, 50, 95]))
    return BatchTimeInterval(p5, p50, p95, 0, residuals=residuals.source, beyond_domain=residuals.beyond)


def interval_coverage_pct(predicted: Sequence[float], measured: Sequence[float], ratios: Sequence[float]) -> float:
    """The share of runs whose measured time lies in [p5, p95] of predicted x the residual ratios (run over
    prediction), in percent: spec_only_interval's rule, for many runs at once."""
    low, high = np.percentile(np.asarray(ratios, float), [5, 95])
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    return float(np.mean((m >= p * low) & (m <= p * high)) * 100.0)


def spec_only_residuals(spec: JobSpec | None, processor: str) -> ModelResiduals | None:
    """The held-out spec-only runs a prediction on a description of `processor` (harness.plan.device.PROCESSORS)
    draws on: published GPU runs (gpu_residuals_for), or bench/device_model.py's CPU pairs."""
    if processor == "gpu":
        return gpu_residuals_for(spec)
    return model_residuals("cpu", CPU_SPEC_ONLY_RESIDUALS_PATH)


def gpu_residuals_for(spec: JobSpec | None, path: Path = GPU_RESIDUALS_PATH) -> ModelResiduals | None:
    """The GPU residuals a spec-only prediction of `spec` draws on: the held-out runs where `spec` lies within their
    domain (or either is unknown); else, for a spec on more than one node, the multi-node held-out runs, and
    otherwise the out-of-domain runs, where the file has them."""
    inside = model_residuals("cuda", path)
    if spec is None or inside is None or inside.domain is None:
        return inside
    if inside.domain.contains(spec.model.hidden, spec.cluster.devices, spec.cluster.nodes):
        return inside
    multi_node = model_residuals("cuda", path, "multi_node_runs") if spec.cluster.nodes > 1 else None
    return multi_node or model_residuals("cuda", path, "beyond_runs") or inside


PART_LABELS = {"events": "", "host_issue": " (host issue)", "composites": " (with its all-reduces)"}
NAMED_SHARE = 0.75  # the explanation names the largest sources until they hold this much of the variance
NAMED_AT_MOST = 2


@dataclass(frozen=True)
class IntervalSource:
    """One sampled duration's part in the interval: the batch time at its draws' 95th percentile less that at
    their 5th, every other duration as predicted, and its share of the variance (swing squared over the sum
    of every source's swing squared)."""

    part: str  # events | host_issue | composites (Costs.sampled)
    event_id: str
    name: str
    swing_s: float
    share: float

    def to_dict(self) -> dict[str, Any]:
        return {"part": self.part, "id": self.event_id, "name": self.name, "swing_s": self.swing_s,
                "share": self.share}


@dataclass(frozen=True)
class IntervalExplanation:
    """What makes an interval as wide as it is: its sources by share, largest first."""

    interval: BatchTimeInterval
    sources: tuple[IntervalSource, ...]

    @property
    def first_order_fraction(self) -> float | None:
        """The sum of the sources' swings squared over the interval's width squared: near 1 where the batch
        time adds its sources' noise up; further off where they interact (a max of two paths); None for a zero
        width."""
        sampling = self.interval.sampling or self.interval
        width = sampling.p95_s - sampling.p5_s
        return sum(s.swing_s ** 2 for s in self.sources) / width ** 2 if width > 0 else None

    @property
    def named(self) -> tuple[IntervalSource, ...]:
        """The largest sources until they hold NAMED_SHARE of the variance, at most NAMED_AT_MOST; none where
        that many hold less (the noise is spread)."""
        out, held = [], 0.0
        for source in self.sources[:NAMED_AT_MOST]:
            out.append(source)
            held += source.share
            if held >= NAMED_SHARE:
                return tuple(out)
        return ()

    def text(self) -> str:
        """One line, the answer first: what makes the interval as wide as it is, and what it leaves out."""
        interval, sampling = self.interval, self.interval.sampling or self.interval
        count = len({s.event_id for s in self.sources})
        noise = f"{count} measured event{'s' if count != 1 else ''}' sampling noise"
        if not any(s.share > 0 for s in self.sources):
            where = "which does not move the batch time"
        elif self.named:
            where = " and ".join(f"{s.name} {s.share:.0%}" for s in self.named) + " of its variance"
        else:
            top = self.sources[0]
            where = f"spread over them (the largest, {top.name}, {top.share:.0%} of its variance)"
        if interval.sampling is None:
            if not any(s.share > 0 for s in self.sources):
                return f"{interval.width:.1%} wide from {noise}, {where}"
            return (f"{interval.width:.1%} wide from {noise}, {where}; it leaves out the machine's drift before a run "
                    "and the model's own error")
        drift = f"{interval.drift_sigma:.1%}" if interval.drift_sigma is not None else "not measured"
        if interval.residuals:
            what = (f"the model's error on {interval.residuals}, which holds a run's drift from its profile (this "
                    f"profile's: {drift})")
        else:
            what = (f"the machine's drift over the profile ({drift}; no held-out runs of this device kind: not the "
                    "model's own error)")
        return f"{interval.width:.1%} wide: {what}, around {sampling.width:.1%} from {noise}, {where}"

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text(), "first_order_fraction": self.first_order_fraction,
                "named": [s.name for s in self.named], "sources": [s.to_dict() for s in self.sources]}


def explain_interval(plan: EventPlan, costs: Costs, interval: BatchTimeInterval | None,
                     dp_overlap: bool | None = None, seed: int = SEED) -> IntervalExplanation | None:
    """Each sampled source's swing and share of the interval (rules above), from the same draws as the
    interval's (its resamples, the same seed); None without an interval. Two simulations a source."""
    if interval is None or not has_samples(costs):
        return None
    drawn = draws(costs, interval.resamples, seed)
    swings = []
    for part, table in drawn.items():
        for eid, values in table.items():
            low, high = np.percentile(values, [5, 95])
            at = [batch_time(plan, costs_with(costs, {part: {eid: float(v)}}), dp_overlap)
                  for v in (low, high)]
            swings.append((part, eid, at[1] - at[0]))
    total = sum(swing ** 2 for _, _, swing in swings)
    sources = [IntervalSource(part, eid, plan.events[eid].name + PART_LABELS.get(part, f" ({part})"), swing,
                              swing ** 2 / total if total > 0 else 0.0) for part, eid, swing in swings]
    sources.sort(key=lambda s: (-s.share, s.name, s.event_id))
    return IntervalExplanation(interval, tuple(sources))

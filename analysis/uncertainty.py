"""How far to trust a prediction: the batch time's interval from the profile's own samples (a bootstrap).

Rules (docs/analysis.md, "How far to trust a prediction"):
- every duration the costs took from samples (Costs.sampled: compute events, their host issue times, composites,
  measured P2P and all-reduces) is drawn again as its statistic (mean, median or minimum) of a circular block
  resample of its samples in the order taken (bootstrap_statistics: the machine's drift makes samples in a row
  alike, which a resample of single samples would not keep); each resample is simulated as the prediction is;
- what does not come from an event's own samples stays as predicted: fits of unmeasured communication, the
  sender-busy and post times, the buckets' division and zeroing, the replica skew;
- the interval is the 5th, 50th and 95th percentile of the resampled batch times: it says how much the
  prediction would move with another profile of the same length on the same machine, not how far the
  machine's state (or the model's assumptions) can move a run.
The generator is seeded, so the same profile gives the same interval every time.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from harness.events import EventPlan
from harness.precision import BATCHES, MIN_BATCHED

from analysis.costs import Costs, SampleSet
from analysis.simulate import simulate

DEFAULT_RESAMPLES = 200
SEED = 20261201


@dataclass(frozen=True)
class BatchTimeInterval:
    """The batch time's percentiles over `resamples` bootstrap resamples of the profile's samples."""

    p5_s: float
    p50_s: float
    p95_s: float
    resamples: int

    def contains(self, seconds: float) -> bool:
        return self.p5_s <= seconds <= self.p95_s

    @property
    def width(self) -> float:
        """(p95 - p5) / p50: the interval's width relative to its middle."""
        return (self.p95_s - self.p5_s) / self.p50_s if self.p50_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"batch_time_p5_s": self.p5_s, "batch_time_p50_s": self.p50_s, "batch_time_p95_s": self.p95_s,
                "interval_resamples": self.resamples}


def bootstrap_statistics(samples: SampleSet, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`resamples` values of the statistic, each of a circular block resample of the samples in the order taken:
    blocks of n // BATCHES consecutive samples (1 below MIN_BATCHED samples: a plain bootstrap) from random
    starts, wrapping past the end, joined up to n (harness.precision says why samples in a row are not independent)."""
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


def resampled_costs(costs: Costs, resamples: int, seed: int = SEED) -> list[Costs]:
    """`resamples` copies of `costs` with every sampled duration drawn again (rules above)."""
    rng = np.random.default_rng(seed)
    drawn = {part: {eid: bootstrap_statistics(s, resamples, rng) for eid, s in sorted(table.items())}
             for part, table in sorted(costs.sampled.items())}
    out = []
    for r in range(resamples):
        events = dict(costs.events)
        for eid, values in drawn.get("events", {}).items():
            events[eid] = replace(events[eid], seconds=float(values[r]))
        host = {**costs.host_issue, **{eid: float(v[r]) for eid, v in drawn.get("host_issue", {}).items()}}
        composites = {**costs.composites, **{eid: float(v[r]) for eid, v in drawn.get("composites", {}).items()}}
        out.append(replace(costs, events=events, host_issue=host, composites=composites))
    return out


def batch_time_interval(plan: EventPlan, costs: Costs, dp_overlap: bool | None = None,
                        resamples: int = DEFAULT_RESAMPLES, seed: int = SEED) -> BatchTimeInterval | None:
    """The batch time's 5-50-95 percentiles over bootstrap resamples (None with no resamples or no samples)."""
    if resamples <= 0 or not any(costs.sampled.values()):
        return None
    times = np.array([simulate(plan, c, dp_overlap).batch_time_s for c in resampled_costs(costs, resamples, seed)])
    p5, p50, p95 = np.percentile(times, [5, 50, 95])
    return BatchTimeInterval(float(p5), float(p50), float(p95), resamples)

"""How precisely a series of samples knows the statistic that stands for it: the half-width of its 95%
confidence interval relative to the statistic. The profiler samples an event until this falls within the asked
precision (docs/profiling.md, "Precision").

Samples taken one after another on a shared machine are not independent: its speed drifts over seconds, and
each event's with it (a block's forward moved 6.65 -> 7.03 ms within a few seconds on the 2-core machine while
copies of it sampled in turn agreed within 0.2%). So the interval is that of **batch means**, the standard
method for a correlated series: the samples, in the order taken, cut into BATCHES consecutive batches, the
statistic of each, and Student's t over those BATCHES values; or, with fewer than MIN_BATCHED samples, the plain
interval: the mean's Student's t (s / sqrt(n)), the median's from the order statistics. A minimum has no
interval of its own and is bounded by the median: it is held to the median's. Fewer than MIN_SAMPLES samples,
or a statistic of 0, know nothing: infinity.
"""
from __future__ import annotations

import math

import numpy as np

CONFIDENCE_Z = 1.959963984540054  # the normal quantile of a two-sided 95% interval
MIN_SAMPLES = 5
BATCHES = 10
MIN_BATCHED = 3 * BATCHES
PRECISION_STATISTICS = ("mean", "median", "min")


def precision_statistic(kind: str) -> str:
    """The statistic a measurement of `kind` is held to: the mean for compute events and composites (the
    analysis's default), the median for communication (an all-reduce's statistic; a P2P's minimum lies below
    it)."""
    return "mean" if kind in ("compute", "composite") else "median"


def t_quantile(dof: int) -> float:
    """Student's t at 97.5% for `dof` degrees of freedom (Cornish-Fisher expansion about the normal: within
    0.3% of the exact value from 4 degrees of freedom up, exact in the limit)."""
    if dof < 1:
        return math.inf
    z, v = CONFIDENCE_Z, float(dof)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3))


def relative_half_width(samples: np.ndarray, statistic: str = "mean") -> float:
    """The 95% confidence interval's half-width over the statistic (0.01: known within 1%); rules above."""
    if statistic not in PRECISION_STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; known: {', '.join(PRECISION_STATISTICS)}")
    x = np.asarray(samples, dtype=np.float64)
    x = x[np.isfinite(x)]
    n = x.size
    if n < MIN_SAMPLES:
        return math.inf
    if n >= MIN_BATCHED:
        of_batch = np.mean if statistic == "mean" else np.median
        values = np.array([of_batch(batch) for batch in np.array_split(x, BATCHES)])
        centre = float(x.mean() if statistic == "mean" else np.median(x))
        half = t_quantile(BATCHES - 1) * float(values.std(ddof=1)) / math.sqrt(BATCHES)
        return half / abs(centre) if centre else math.inf
    if statistic == "mean":
        centre = float(x.mean())
        half = t_quantile(n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
    else:
        x = np.sort(x)
        centre = float(np.median(x))
        # the order statistics j = n/2 - z sqrt(n)/2 and k = 1 + n/2 + z sqrt(n)/2 (1-based, rounded) hold the
        # median between them 95% of the time (the binomial's normal approximation)
        reach = CONFIDENCE_Z * math.sqrt(n) / 2
        lo = max(0, round(n / 2 - reach) - 1)
        hi = min(n - 1, round(n / 2 + reach))
        half = max(centre - float(x[lo]), float(x[hi]) - centre)
    return half / abs(centre) if centre else math.inf


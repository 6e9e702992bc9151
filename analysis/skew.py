"""Replica skew: how far the slowest of k data-parallel replicas is expected to fall behind, from the profile.

Data-parallel replicas run the same work, but each at the speed its device has at that moment; the
gradient all-reduce waits for the slowest. A model that gives every replica the same times misses that
wait (docs/benchmarks.md: on the 2-core CPU machine two replicas finished their backward a
median 51 ms apart in a 600 ms iteration, and dp=2 was predicted short in every trial).

The profile shows the spread: every rank measures its own share of the compute events at the same time
(harness profile's compute phase), and each compute sample carries when it ended (`sample_end_s`). Divided
by its event's median, a sample says how fast its rank ran at that moment. Over a window of W seconds, a
rank's relative speed is the sum of its samples in the window over the sum of their events' medians. At
each window position, the variance of that speed across the ranks (ddof 1) estimates sigma(W)^2, the part
of a replica's speed over W that is its own: a slowdown of the whole machine, shared by every rank at once,
slows all replicas alike and is not in it. Windows span whatever drift and noise the device has at that
time scale, so a replica that computes for W seconds is taken to run at 1 + sigma(W) z, z standard normal,
independently of the others; the slowest of k is then expected

    lag(k, W) = e_k sigma(W)   (a fraction of its compute time)

behind their mean, e_k the expected maximum of k standard normal variables (0.56 for 2, 1.03 for 4, 1.42
for 8). The timeline (analysis.simulate) delays each gradient bucket by that fraction of the compute done
before it. Profiles without sample end times (written before they existed), with fewer than two ranks
measuring compute, or whose ranks never measured at the same moment (a few repeats) give no skew.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from analysis.profile_reader import Profile
from harness.store.hdf5_schema import COMPUTE_PHASE_ATTR

WINDOW_STEP = 0.25  # window positions every quarter window
MIN_COVERAGE = 0.25  # a rank counts at a position when its samples there add up to this share of the window
MAX_POSITIONS = 400


@lru_cache(maxsize=256)
def expected_max_of_normals(k: int) -> float:
    """E[max of k independent standard normal variables] (0 for k = 1)."""
    if k <= 1:
        return 0.0
    x = np.linspace(-9.0, 9.0, 36001)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    density = k * pdf * cdf ** (k - 1)
    return float(np.sum(x * density) * (x[1] - x[0]))


@dataclass(frozen=True)
class RankSpeedSeries:
    """One rank's compute samples in the order they ended: end time (s), sample (s), its event's median (s)."""

    rank: int
    end_s: np.ndarray
    sample_s: np.ndarray
    median_s: np.ndarray

    def speed(self, starts: np.ndarray, window_s: float) -> np.ndarray:
        """Relative time taken (sum of samples over sum of medians) in each window [start, start + window);
        NaN where the samples there cover less than MIN_COVERAGE of the window."""
        cum_sample = np.concatenate(([0.0], np.cumsum(self.sample_s)))
        cum_median = np.concatenate(([0.0], np.cumsum(self.median_s)))
        lo = np.searchsorted(self.end_s, starts, side="left")
        hi = np.searchsorted(self.end_s, starts + window_s, side="left")
        taken = cum_sample[hi] - cum_sample[lo]
        nominal = cum_median[hi] - cum_median[lo]
        out = np.full(len(starts), np.nan)
        enough = nominal >= MIN_COVERAGE * window_s
        out[enough] = taken[enough] / nominal[enough]
        return out


@dataclass
class ReplicaSkew:
    """The ranks' speed series from one profiling run's compute phase; spread and lag per window length."""

    series: list[RankSpeedSeries]
    _cache: dict[float, tuple[float, int]] = field(default_factory=dict, repr=False)

    @property
    def ranks(self) -> list[int]:
        return [s.rank for s in self.series]

    @property
    def span_s(self) -> float:
        """The time all ranks were measuring at once."""
        return max(0.0, min(s.end_s[-1] for s in self.series) - max(s.end_s[0] for s in self.series))

    def spread(self, window_s: float) -> tuple[float, int]:
        """(sigma(W), window positions it came from): the standard deviation of one rank's relative speed
        over `window_s` seconds that the other ranks do not share (0, 0 where no position has two ranks)."""
        if window_s <= 0:
            return 0.0, 0
        key = round(window_s, 4)
        if key not in self._cache:
            self._cache[key] = self._spread(max(key, 1e-4))
        return self._cache[key]

    def _spread(self, window_s: float) -> tuple[float, int]:
        first = max(s.end_s[0] for s in self.series)
        span = min(s.end_s[-1] for s in self.series) - first
        if span <= 0:
            return 0.0, 0
        window_s = min(window_s, span)  # a window longer than the phase: the whole phase
        free = span - window_s
        count = min(MAX_POSITIONS, int(free / (WINDOW_STEP * window_s)) + 1)
        starts = first + np.linspace(0.0, free, count)
        speeds = np.stack([s.speed(starts, window_s) for s in self.series])  # ranks x positions
        usable = np.sum(~np.isnan(speeds), axis=0) >= 2
        if not usable.any():
            return 0.0, 0
        variance = np.nanvar(speeds[:, usable], axis=0, ddof=1)
        return float(math.sqrt(float(np.mean(variance)))), int(usable.sum())

    def lag_fraction(self, replicas: int, window_s: float) -> float:
        """How far behind the replicas' mean the slowest of `replicas` is expected to finish, as a fraction of
        `window_s` seconds of compute."""
        return expected_max_of_normals(replicas) * self.spread(window_s)[0]


def compute_series(profile: Profile) -> list[RankSpeedSeries]:
    """Each rank's compute samples in the order they ended, from the profiling run (compute phase) with the most
    samples; empty without sample end times."""
    by_run: dict[float, dict[int, list[tuple[np.ndarray, np.ndarray, float]]]] = {}
    for m in profile.measurements.values():
        if m.kind != "compute" or not m.count or not m.ranks:
            continue
        ends = m.sample_end_s
        if ends.size != m.count:
            continue
        run = float(m.attrs.get(COMPUTE_PHASE_ATTR, 0.0))
        by_run.setdefault(run, {}).setdefault(m.ranks[0], []).append((ends, m.samples_s, m.median_s))
    if not by_run:
        return []
    ranks = max(by_run.values(), key=lambda per_rank: sum(len(v) for v in per_rank.values()))
    series = []
    for rank, parts in sorted(ranks.items()):
        ends = np.concatenate([p[0] for p in parts])
        samples = np.concatenate([p[1] for p in parts])
        medians = np.concatenate([np.full(p[0].size, p[2]) for p in parts])
        order = np.argsort(ends, kind="stable")
        if medians.sum() > 0:
            series.append(RankSpeedSeries(rank, ends[order], samples[order], medians[order]))
    return series


def replica_skew(profile: Profile) -> ReplicaSkew | None:
    """The speed series of the profile's compute samples (None with fewer than two ranks timed, or ranks that
    never measured at the same time)."""
    series = compute_series(profile)
    if len(series) < 2:
        return None
    skew = ReplicaSkew(series)
    return skew if skew.span_s > 0 else None  # the ranks never measured at the same time (few repeats)


DRIFT_BLOCKS = 4


@dataclass(frozen=True)
class MachineDrift:
    """How the machine's speed moved over the profile: each of DRIFT_BLOCKS equal spans of its compute phase,
    every rank's samples together, as time taken over the events' medians; `sigma` their relative standard
    deviation (ddof 1), what a run at another moment may differ by."""

    block_speeds: tuple[float, ...]
    span_s: float

    @property
    def sigma(self) -> float:
        speeds = np.asarray(self.block_speeds)
        return float(np.std(speeds, ddof=1) / np.mean(speeds)) if speeds.size >= 2 else 0.0

    def to_dict(self) -> dict:
        return {"block_speeds": list(self.block_speeds), "span_s": self.span_s, "sigma": self.sigma}


def machine_drift(profile: Profile, blocks: int = DRIFT_BLOCKS) -> MachineDrift | None:
    """The machine's drift over the profile (MachineDrift); None without sample end times or with fewer than two
    spans holding samples."""
    series = compute_series(profile)
    if not series:
        return None
    ends = np.concatenate([s.end_s for s in series])
    taken = np.concatenate([s.sample_s for s in series])
    nominal = np.concatenate([s.median_s for s in series])
    first, last = float(ends.min()), float(ends.max())
    if last <= first:
        return None
    which = np.minimum(((ends - first) / (last - first) * blocks).astype(int), blocks - 1)
    speeds = tuple(float(taken[which == b].sum() / nominal[which == b].sum()) for b in range(blocks)
                   if nominal[which == b].sum() > 0)
    return MachineDrift(speeds, last - first) if len(speeds) >= 2 else None

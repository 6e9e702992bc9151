"""Interval algebra: sets of half-open time intervals [start, end) and what the analyses ask of them.

One type, `Spans`: a set of intervals in normal form (sorted, disjoint, none empty, touching ones joined),
as two float arrays. Everything is built from it:
- `spans(pairs)` / `spans(starts, ends)`: the normal form of any intervals (overlapping, unsorted, empty);
- `a | b`, `a & b`, `a - b`: union, intersection, difference; `.length`: the total length;
- `clip(a, start, end)`: the part inside a window; `window_edges` and `coverage`: fixed windows and how
  much of each one a set covers;
- `lanes(starts, ends)`: rows for intervals that may overlap, so that none overlap within a row.
numpy only; n log n in the number of intervals, but `lanes`, n x rows.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np


class Spans(NamedTuple):
    """Intervals in normal form: start and end arrays, sorted, disjoint, every end > its start."""

    start: np.ndarray
    end: np.ndarray

    @property
    def length(self) -> float:
        return float(np.sum(self.end - self.start))

    def __len__(self) -> int:
        return len(self.start)

    def pairs(self) -> list[tuple[float, float]]:
        return list(zip(self.start.tolist(), self.end.tolist()))

    def __or__(self, other: Spans) -> Spans:
        return _combine(self, other, np.logical_or)

    def __and__(self, other: Spans) -> Spans:
        return _combine(self, other, np.logical_and)

    def __sub__(self, other: Spans) -> Spans:
        return _combine(self, other, lambda a, b: a & ~b)


EMPTY = Spans(np.zeros(0), np.zeros(0))


def spans(starts: Iterable | np.ndarray, ends: Iterable | np.ndarray | None = None) -> Spans:
    """The normal form of intervals given as (start, end) pairs, or as arrays of starts and ends."""
    if ends is None:
        pairs = np.asarray(list(starts) if not isinstance(starts, np.ndarray) else starts, dtype=np.float64)
        if pairs.size == 0:
            return EMPTY
        start, end = pairs[:, 0], pairs[:, 1]
    else:
        start, end = np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)
    keep = end > start
    start, end = start[keep], end[keep]
    if start.size == 0:
        return EMPTY
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    # a new interval begins where a start lies beyond every earlier end (touching ones are joined)
    first = np.ones(start.size, dtype=bool)
    first[1:] = start[1:] > reach[:-1]
    heads = np.flatnonzero(first)
    tails = np.append(heads[1:] - 1, start.size - 1)
    return Spans(start[heads], reach[tails])


def _combine(a: Spans, b: Spans, keep) -> Spans:
    """The set of points where keep(in a, in b) holds, in normal form."""
    points = np.unique(np.concatenate([a.start, a.end, b.start, b.end]))
    if points.size < 2:
        return EMPTY
    lo, hi = points[:-1], points[1:]
    mid = (lo + hi) / 2
    chosen = keep(_contains(a, mid), _contains(b, mid))
    return spans(lo[chosen], hi[chosen])


def _contains(s: Spans, t: np.ndarray) -> np.ndarray:
    """Whether each time in `t` lies inside `s`."""
    i = np.searchsorted(s.start, t, side="right") - 1
    inside = i >= 0
    inside[inside] = t[inside] < s.end[i[inside]]
    return inside


def clip(s: Spans, start: float, end: float) -> Spans:
    """The part of `s` inside [start, end)."""
    return s & spans([start], [end])


def union_length(pairs: Iterable[tuple[float, float]]) -> float:
    """Total length covered by intervals that may overlap."""
    return spans(pairs).length


def window_edges(start: float, end: float, *, count: int | None = None, width: float | None = None) -> np.ndarray:
    """Edges of fixed windows over [start, end): `count` equal windows, or windows of `width` (the last one
    cut at `end`)."""
    if (count is None) == (width is None):
        raise ValueError("give a window count or a window width")
    if end <= start:
        return np.array([start, start])
    if count is not None:
        if count < 1:
            raise ValueError(f"window count must be at least 1, got {count}")
        return np.linspace(start, end, count + 1)
    if width <= 0:
        raise ValueError(f"window width must be positive, got {width}")
    edges = np.arange(start, end, width, dtype=np.float64)
    return np.append(edges, end)


def coverage(s: Spans, edges: np.ndarray) -> np.ndarray:
    """How long `s` covers each window [edges[i], edges[i+1])."""
    edges = np.asarray(edges, dtype=np.float64)
    before = np.concatenate([[0.0], np.cumsum(s.end - s.start)])  # covered length before each interval

    def covered_until(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(s.start, t, side="right")  # intervals that start by t; the last may hold t
        out = before[i].copy()
        last = i > 0
        overshoot = s.end[i[last] - 1] - t[last]  # the part of that interval after t
        out[last] -= np.maximum(overshoot, 0.0)
        return out
    if len(s) == 0:
        return np.zeros(max(0, edges.size - 1))
    return np.diff(covered_until(edges))


def lanes(starts: Sequence[float], ends: Sequence[float]) -> list[int]:
    """A row (0, 1, ...) for each interval, in the order given, so that no two intervals of a row overlap:
    each, by start, takes the first row free by then."""
    row_ends: list[float] = []
    out = [0] * len(starts)
    for i in sorted(range(len(starts)), key=lambda k: (starts[k], ends[k])):
        row = next((k for k, end in enumerate(row_ends) if end <= starts[i]), None)
        if row is None:
            row = len(row_ends)
            row_ends.append(ends[i])
        else:
            row_ends[row] = ends[i]
        out[i] = row
    return out

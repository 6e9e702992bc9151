"""The interval algebra every analysis builds on: exact answers on intervals whose result is known."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.intervals import EMPTY, clip, coverage, lanes, spans, union_length, window_edges


def test_normal_form_merges_overlapping_and_touching_intervals_and_drops_empty_ones():
    s = spans([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7), (8, 7)])
    assert s.pairs() == [(0.0, 4.0), (5.0, 6.0)]
    assert s.length == 5.0
    assert spans([]).pairs() == [] and len(EMPTY) == 0
    assert spans([2.0, 0.0], [3.0, 1.0]).pairs() == [(0.0, 1.0), (2.0, 3.0)]


def test_union_intersection_difference():
    a, b = spans([(0, 4), (6, 10)]), spans([(2, 7), (9, 12)])
    assert (a | b).pairs() == [(0.0, 12.0)]
    assert (a & b).pairs() == [(2.0, 4.0), (6.0, 7.0), (9.0, 10.0)]
    assert (a - b).pairs() == [(0.0, 2.0), (7.0, 9.0)]
    assert (b - a).pairs() == [(4.0, 6.0), (10.0, 12.0)]
    assert (a & EMPTY).length == 0 and (a - EMPTY).pairs() == a.pairs()


def test_clip_to_a_window():
    assert clip(spans([(0, 4), (6, 10)]), 3, 7).pairs() == [(3.0, 4.0), (6.0, 7.0)]
    assert clip(spans([(0, 1)]), 2, 3).length == 0


def test_union_length_of_overlapping_intervals():
    assert union_length([(0, 2), (1, 3), (10, 11)]) == 4.0


def test_fixed_windows_and_their_coverage():
    assert window_edges(0, 10, count=4).tolist() == [0, 2.5, 5, 7.5, 10]
    assert window_edges(0, 10, width=4).tolist() == [0, 4, 8, 10]
    s = spans([(1, 3), (4, 9)])
    assert coverage(s, window_edges(0, 10, width=4)).tolist() == [2.0, 4.0, 1.0]
    assert coverage(EMPTY, [0, 1, 2]).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        window_edges(0, 1)
    with pytest.raises(ValueError):
        window_edges(0, 1, width=0)


def test_lanes_keep_overlapping_intervals_apart_and_reuse_free_rows():
    # (0,4) row 0; (1,2) overlaps it: row 1; (2,3) fits row 1 again; (5,6) fits row 0
    assert lanes([0, 1, 2, 5], [4, 2, 3, 6]) == [0, 1, 1, 0]
    assert lanes([5, 0], [6, 4]) == [0, 0]  # in the order given, rows by start


intervals = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=12)


def _points(pairs) -> set[int]:
    """The unit cells [k, k+1) covered by integer intervals: a brute-force model of the algebra."""
    return {k for a, b in pairs for k in range(a, b)}


@settings(max_examples=200, deadline=None)
@given(intervals, intervals)
def test_the_algebra_matches_a_brute_force_model(a, b):
    sa, sb = spans(a), spans(b)
    pa, pb = _points(a), _points(b)
    assert sa.length == len(pa)
    assert (sa | sb).length == len(pa | pb)
    assert (sa & sb).length == len(pa & pb)
    assert (sa - sb).length == len(pa - pb)
    edges = np.arange(0, 55, 5, dtype=float)
    assert coverage(sa, edges).tolist() == [len({k for k in pa if lo <= k < lo + 5}) for lo in edges[:-1]]
    starts = [x for x, y in a if y > x]
    ends = [y for x, y in a if y > x]
    rows = lanes(starts, ends)
    for i in range(len(starts)):
        for j in range(i):
            if rows[i] == rows[j]:
                assert ends[i] <= starts[j] or ends[j] <= starts[i]

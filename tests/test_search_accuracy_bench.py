"""bench/search_accuracy.py tells candidates apart and counts the regret as the rounds' paired runs say: the
figures recorded in docs/benchmarks.md come from here."""
from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_search_accuracy", ROOT / "bench" / "search_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# four candidates' runs over three rounds: 0 and 2 overlap, 1 lies between them and 3, 3 is far
MEASURED = [[1.00, 1.10, 1.05], [1.20, 1.30, 1.25], [1.08, 1.15, 1.12], [2.00, 2.10, 2.20]]


def test_runs_tell_apart_only_ranges_that_do_not_overlap(bench):
    assert bench.told_apart(MEASURED[0], MEASURED[1])
    assert not bench.told_apart(MEASURED[0], MEASURED[2])
    assert not bench.told_apart([1.0], [2.0])  # one round tells nothing apart


def test_tiers_group_what_the_runs_cannot_tell_from_the_fastest(bench):
    assert bench.tiers(MEASURED) == [0, 1, 0, 2]
    assert bench.tiers([[1.0], [2.0], [1.5]]) == [0, 0, 0]  # one round: one tier


def test_concordance_counts_only_the_pairs_told_apart(bench):
    # 0-2 is not told apart, so predicting 2 faster than 0 costs nothing; 1 before 3 predicted the wrong way does
    assert bench.concordance([1.1, 2.5, 1.0, 2.0], MEASURED) == (4, 5)
    # 0 and 1 predicted alike (to rounding): not ordered
    assert bench.concordance([1.1, 1.1 * (1 + 1e-15), 1.0, 2.0], MEASURED) == (4, 5)


def test_regret_is_paired_within_each_round(bench):
    # the best measured is 0 (median 1.05); round 0 picked 2 (1.08 / 1.00), round 1 picked 0, round 2 picked 1
    regrets = bench.paired_regret([2, 0, 1], MEASURED)
    assert regrets == pytest.approx([8.0, 0.0, 1.25 / 1.05 * 100 - 100])


def test_figures_mark_a_pick_the_runs_cannot_tell_from_the_best(bench):
    def run(predicted, measured, recommended):
        return {"predicted_s": predicted, "measured_s": measured, "recommended": recommended, "feasible": True,
                "predicted_peak_bytes": 1, "measured_peak_bytes": None, "memory_error_pct": None}
    rounds = [{"a": run(1.0, m0, False), "b": run(0.9, m2, True), "c": run(2.0, m3, False)}
              for m0, m2, m3 in zip(MEASURED[0], MEASURED[2], MEASURED[3])]
    rows = [bench.candidate_row(label, [r[label] for r in rounds]) for label in "abc"]
    figures = bench.paired_figures(rows, rounds, None)
    assert [row["tier"] for row in rows] == [0, 0, 1]
    assert figures["recommended"] == "b" and figures["best_measured"] == "a"
    assert figures["regret_within_noise"] is True
    assert figures["regret_rounds_pct"] == pytest.approx([8.0, 1.15 / 1.10 * 100 - 100, 1.12 / 1.05 * 100 - 100])
    assert figures["regret_pct"] == pytest.approx(1.12 / 1.05 * 100 - 100)
    assert figures["spearman_told_apart"] == pytest.approx(0.866, abs=1e-3)
    assert (figures["concordant_pairs"], figures["told_apart_pairs"]) == (2, 2)

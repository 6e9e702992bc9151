"""The precision of a set of samples (harness.plan.precision) and the prediction's interval (analysis.uncertainty)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.calibration import device_kind, model_residuals
from analysis.costs import Costs, SampleSet
from analysis.simulate import simulate
from analysis.skew import DRIFT_BLOCKS, MachineDrift, machine_drift
from analysis.uncertainty import (
    CALIBRATION_DRAWS,
    SEED,
    BatchTimeInterval,
    batch_time_interval,
    bootstrap_statistics,
    explain_interval,
    interval_of,
    prediction_interval,
    relative_reach,
    resampled_batch_times,
)
from harness.plan.events import build_plan
from harness.plan.precision import CONFIDENCE_Z, precision_statistic, relative_half_width, t_quantile
from harness.plan.spec import loads_spec

SPEC = """
spec_version = 1
[model]
name = "gpt2-small"
layers = 2
hidden = 32
heads = 2
ffn = 64
seq_len = 8
vocab = 64
[batch]
global = 4
micro = 1
[strategy]
dp = 1
tp = 1
pp = 2
schedule = "1f1b"
[cluster]
nodes = 1
gpus_per_node = 2
"""


def test_t_quantile_against_the_table():
    for dof, exact in ((4, 2.776), (9, 2.262), (19, 2.093), (99, 1.984)):
        assert t_quantile(dof) == pytest.approx(exact, rel=3e-3)
    assert t_quantile(0) == math.inf


def test_relative_half_width_of_the_mean_and_the_median():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    # t(4) s / sqrt(n) / mean
    assert relative_half_width(x, "mean") == pytest.approx(t_quantile(4) * math.sqrt(2.5) / math.sqrt(5) / 3)
    # n = 5: the order statistics 1 and 5 bound the median: max(3 - 1, 5 - 3) / 3
    assert relative_half_width(x, "median") == pytest.approx(2 / 3)
    assert relative_half_width(x, "min") == relative_half_width(x, "median")
    assert [precision_statistic(k) for k in ("compute", "composite", "p2p", "allreduce")] == [
        "mean", "mean", "median", "median"]
    assert relative_half_width(np.full(50, 2.0), "mean") == 0.0
    assert relative_half_width(x[:4], "mean") == math.inf  # too few to say
    assert relative_half_width(np.zeros(10), "mean") == math.inf
    with pytest.raises(ValueError, match="unknown statistic"):
        relative_half_width(x, "mode")


def test_more_samples_know_the_mean_better():
    rng = np.random.default_rng(1)
    x = rng.normal(1.0, 0.1, size=4000)
    assert relative_half_width(x[:400], "mean") < relative_half_width(x[:25], "mean")
    # 10% spread known within 1% needs about (1.96 * 0.1 / 0.01)^2 samples; batch means of independent samples
    # give about that interval (their own spread is that of 10 batch means: within 30% here, over 20 series)
    assert math.ceil((CONFIDENCE_Z * 0.1 / 0.01) ** 2) == 385
    widths = [relative_half_width(x[i:i + 385], "mean") for i in range(0, 20 * 180, 180)]
    assert float(np.mean(widths)) == pytest.approx(0.01, rel=0.3)


def test_a_drifting_series_is_known_less_well_than_its_spread_says():
    """Batch means see the drift that independent-sample formulas miss: a slow 10% ramp under 1% noise."""
    rng = np.random.default_rng(2)
    n = 300
    drifting = np.linspace(1.0, 1.1, n) + rng.normal(0, 0.01, n)
    shuffled = rng.permutation(drifting)  # the same values, no order
    assert relative_half_width(drifting, "mean") > 3 * relative_half_width(shuffled, "mean")
    assert relative_half_width(drifting, "median") > 3 * relative_half_width(shuffled, "median")


def test_the_block_bootstrap_keeps_a_drift_the_plain_one_loses():
    rng = np.random.default_rng(3)
    drifting = np.linspace(1.0, 1.1, 300) + rng.normal(0, 0.01, 300)
    spread = lambda values: float(np.std(bootstrap_statistics(SampleSet(values, "mean"), 400,  # noqa: E731
                                                              np.random.default_rng(0))))
    assert spread(drifting) > 2 * spread(rng.permutation(drifting))
    # every sample weighs alike: the resampled means centre on the series' mean
    drawn = bootstrap_statistics(SampleSet(drifting, "mean"), 2000, np.random.default_rng(1))
    assert float(drawn.mean()) == pytest.approx(float(drifting.mean()), rel=1e-3)


def test_bootstrap_statistics():
    rng = np.random.default_rng(0)
    values = np.array([1.0, 2.0, 3.0, 10.0])
    for statistic in ("mean", "median", "min"):
        drawn = bootstrap_statistics(SampleSet(values, statistic), 300, rng)
        assert drawn.shape == (300,) and drawn.min() >= 1.0 and drawn.max() <= 10.0
    assert bootstrap_statistics(SampleSet(values, "mean"), 300, rng).mean() == pytest.approx(4.0, rel=0.1)
    assert (bootstrap_statistics(SampleSet(np.array([2.5]), "mean"), 5, rng) == 2.5).all()


def _sampled_costs(spread: float) -> tuple:
    plan = build_plan(loads_spec(SPEC))
    rng = np.random.default_rng(7)
    costs = Costs.from_seconds(plan, {eid: 1e-3 for eid in plan.events})
    for eid in plan.events:
        samples = 1e-3 * (1 + spread * rng.standard_normal(30)) if spread else np.full(30, 1e-3)
        costs.sampled["events"][eid] = SampleSet(samples, "mean")
    return plan, costs


def test_the_interval_of_exact_samples_is_the_prediction():
    plan, costs = _sampled_costs(0.0)
    interval = batch_time_interval(plan, costs)
    point = simulate(plan, costs).batch_time_s
    assert (interval.p5_s, interval.p50_s, interval.p95_s) == pytest.approx((point, point, point))
    assert interval.width == pytest.approx(0.0, abs=1e-12)


def test_the_interval_widens_with_the_spread_and_is_reproducible():
    plan, narrow = _sampled_costs(0.05)
    _, wide = _sampled_costs(0.3)
    a, b = batch_time_interval(plan, narrow), batch_time_interval(plan, wide)
    assert 0 < a.width < b.width
    assert a.p5_s < a.p50_s < a.p95_s
    assert batch_time_interval(plan, narrow) == a  # seeded
    assert batch_time_interval(plan, narrow, resamples=0) is None


def test_costs_without_samples_have_no_interval():
    plan = build_plan(loads_spec(SPEC))
    assert batch_time_interval(plan, Costs.from_seconds(plan, {eid: 1e-3 for eid in plan.events})) is None
    interval = BatchTimeInterval(1.0, 2.0, 3.0, 10)
    assert interval.to_dict()["batch_time_p95_s"] == 3.0 and interval.width == 1.0
    assert interval.contains(1.0) and interval.contains(3.0) and not interval.contains(3.01)


def test_slices_of_the_resamples_join_up_to_the_whole():
    """The search spreads one interval's resamples over processes: any slice holds the same batch times."""
    plan, costs = _sampled_costs(0.1)
    whole = resampled_batch_times(plan, costs, resamples=50)
    parts = [resampled_batch_times(plan, costs, resamples=50, start=a, stop=a + 17) for a in (0, 17, 34)]
    assert np.array_equal(np.concatenate(parts), whole)
    interval = batch_time_interval(plan, costs, resamples=50)
    assert interval_of(whole) == interval


def test_the_reach_holds_the_interval():
    """Every sampled duration at its own 5th (95th) percentile at once bounds the interval from below (above)."""
    plan, costs = _sampled_costs(0.2)
    T = simulate(plan, costs).batch_time_s
    interval = batch_time_interval(plan, costs)
    down, up = relative_reach(costs)
    assert 0 < down < 0.2 and 0 < up < 0.2
    assert T * (1 - down) < interval.p5_s and interval.p95_s < T * (1 + up)
    cache = {}
    assert relative_reach(costs, cache=cache) == (down, up) and len(cache) == len(costs.sampled["events"])
    _, exact = _sampled_costs(0.0)
    assert relative_reach(exact) == pytest.approx((0.0, 0.0), abs=1e-12)


def test_the_explanation_names_the_event_whose_noise_makes_the_width():
    """One event sampled with a spread, every other exactly: it holds all of the interval's variance."""
    plan, costs = _sampled_costs(0.0)
    noisy = next(eid for eid, e in plan.events.items() if e.name == "gpt2.block.bwd")
    costs.sampled["events"][noisy] = SampleSet(1e-3 * (1 + 0.2 * np.random.default_rng(5).standard_normal(40)),
                                               "mean")
    interval = batch_time_interval(plan, costs)
    explained = explain_interval(plan, costs, interval)
    assert [s.name for s in explained.sources if s.share > 0] == ["gpt2.block.bwd"]
    assert explained.sources[0].share == 1.0 and explained.named == explained.sources[:1]
    assert explained.text() == (f"{interval.width:.1%} wide from {len(plan.events)} measured events' sampling noise, "
                                "gpt2.block.bwd 100% of its variance; it leaves out the machine's drift before a "
                                "run and the model's own error")
    # its swing, from its draws' 5th to 95th percentile, is the width itself: nothing else moves
    assert explained.sources[0].swing_s == pytest.approx(interval.p95_s - interval.p5_s, rel=0.2)
    exact_plan, exact = _sampled_costs(0.0)
    still = explain_interval(exact_plan, exact, batch_time_interval(exact_plan, exact))
    assert still.text().endswith("sampling noise, which does not move the batch time")
    assert still.first_order_fraction is None
    assert explain_interval(plan, costs, None) is None


def test_noise_spread_over_many_events_is_said_to_be_spread():
    """Every event with a 10% spread: the largest two hold 69% of the variance, under the 75% that names them."""
    plan, costs = _sampled_costs(0.1)
    explained = explain_interval(plan, costs, batch_time_interval(plan, costs))
    assert sum(s.share for s in explained.sources) == pytest.approx(1.0)
    assert [s.name for s in explained.sources[:2]] == ["p2p 1KiB intra", "gpt2.block.bwd"]
    assert sum(s.share for s in explained.sources[:2]) == pytest.approx(0.6877, abs=1e-4)
    assert explained.named == ()
    assert "sampling noise, spread over them (the largest, p2p 1KiB intra, 39% of its variance);" in explained.text()


def test_the_model_residuals_are_the_held_out_runs_as_factors(tmp_path):
    residuals = model_residuals("cpu")
    assert len(residuals.ratios) == 96 and residuals.seeds == (20261201, 610975364, 332022879, 304290446)
    assert residuals.ratios[0] == pytest.approx(1 / (1 - 0.087))  # G2's first pair: -8.7%, the run 9.5% longer
    assert model_residuals("cuda") is None  # no held-out GPU runs yet
    assert device_kind({"device": "cuda:3"}) == "cuda" and device_kind({"device": "cpu"}) == "cpu"
    other = tmp_path / "r.json"
    other.write_text('{"kind": "something else"}')
    assert model_residuals("cpu", other) is None


def test_the_prediction_interval_adds_the_model_error_or_the_drift():
    """Exact samples: the sampling interval is the point; the model's held-out errors give the prediction's its
    width, seeded (they hold a run's drift from its profile: this profile's is not added again); a kind of device
    without held-out runs takes the drift instead; with neither, the sampling interval."""
    plan, costs = _sampled_costs(0.0)
    point = simulate(plan, costs).batch_time_s
    assert prediction_interval(plan, costs) == batch_time_interval(plan, costs)  # no device kind: by hand
    costs.device = "cpu"
    interval = prediction_interval(plan, costs)
    ratios = np.asarray(model_residuals("cpu").ratios)
    assert interval.sampling.width == pytest.approx(0.0, abs=1e-12) and interval.drift_sigma is None
    # every resampled time is the point: the interval is the held-out factors' percentiles (20 draws of 200)
    drawn = np.random.default_rng([SEED, CALIBRATION_DRAWS]).choice(ratios, size=200 * CALIBRATION_DRAWS)
    assert (interval.p5_s, interval.p95_s) == pytest.approx(tuple(point * np.percentile(drawn, [5, 95])))
    assert interval.contains(point * float(np.median(ratios)))
    assert prediction_interval(plan, costs) == interval
    costs.machine_drift = MachineDrift((0.9, 1.1), 10.0)  # sigma: 0.1414 / 1
    said = prediction_interval(plan, costs)
    assert said.drift_sigma == pytest.approx(math.sqrt(0.02)) and (said.p5_s, said.p95_s) == (interval.p5_s,
                                                                                              interval.p95_s)
    assert "which holds a run's drift from its profile (this profile's: 14.1%)" in explain_interval(
        plan, costs, said).text()
    costs.device = "cuda"
    drift_only = prediction_interval(plan, costs)
    assert drift_only.residuals is None and drift_only.width == pytest.approx(2 * 1.645 * math.sqrt(0.02), rel=0.1)
    assert "no held-out runs of this device kind" in explain_interval(plan, costs, drift_only).text()


def test_machine_drift_from_the_samples_end_times():
    """Four spans of the compute phase, every rank's samples together: the spans' time taken over the medians."""
    from analysis.profile_reader import load_profile
    from tests.conftest import ROOT

    drift = machine_drift(load_profile(ROOT / "tests/data/pp2-profile.h5"))
    assert len(drift.block_speeds) == DRIFT_BLOCKS
    assert drift.sigma == pytest.approx(0.029359725720357603, rel=1e-9)
    assert MachineDrift((1.0,), 1.0).sigma == 0.0

"""bench/published.py: its statistics, the seeded split, the runs' specs and, on a few runs, the fast path the fit
evaluates against predict_spec's predictions; analysis.uncertainty's spec-only interval."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from analysis.calibration import ModelResiduals, ResidualDomain, model_residuals, ratios_of
from analysis.device_model import DeviceModel
from analysis.report import interval_text
from analysis.uncertainty import gpu_residuals_for, interval_coverage_pct, spec_only_interval
from bench import published
from bench.published import (
    Fold,
    Run,
    Scored,
    beyond_splits,
    error_summary,
    errors_pct,
    group_spearman,
    leave_group_out_coverage,
    max_job_regret_pct,
    print_tables,
    regret_pct,
    residual_domain,
    residuals_document,
    residuals_text,
    set_figures,
    split_half,
)
from harness.plan.device import load_device

needs_data = pytest.mark.skipif(not published.VTRAIN.is_dir(),
                                reason="the shared vTrain data is not beside the project")


def _run(row: int, model_layers: int = 12, gpus: int = 8, measured: float = 100.0, hidden: int = 1024) -> Run:
    return Run("single", row, gpus, 16, 2, hidden, 16, model_layers, 1024, 2, 2, 2, measured)


def test_error_summary_holds_mean_median_p90_and_worst_of_the_absolute_errors():
    errors = errors_pct([110, 90, 100, 150], [100, 100, 100, 100])
    assert list(errors) == [10, -10, 0, 50]
    summary = error_summary(errors)
    assert summary["rows"] == 4
    assert summary["mape_pct"] == pytest.approx(17.5)
    assert summary["median_abs_pct"] == pytest.approx(10.0)
    assert summary["p90_abs_pct"] == pytest.approx(38.0)  # numpy's linear percentile of 0, 10, 10, 50
    assert summary["worst_abs_pct"] == 50
    assert summary["median_signed_pct"] == pytest.approx(5.0)


def test_spearman_ranks_ties_by_their_mean_rank():
    # measured ranks 1, 2.5, 2.5, 4 against predicted 1, 2, 3, 4: Pearson's of the ranks
    rho = group_spearman([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 20.0, 40.0])
    ranks = np.array([1, 2.5, 2.5, 4])
    assert rho == pytest.approx(float(np.corrcoef([1, 2, 3, 4], ranks)[0, 1]))
    assert rho == pytest.approx(0.9486833)
    assert group_spearman([3.0, 2.0, 1.0], [1.0, 2.0, 3.0]) == pytest.approx(-1.0)
    assert group_spearman([1.0], [1.0]) is None
    assert group_spearman([1.0, 1.0], [1.0, 2.0]) is None  # nothing to rank on one side


def test_regret_is_the_fastest_predicteds_measured_time_over_the_best_measured():
    assert regret_pct([1.0, 2.0, 3.0], [100.0, 90.0, 120.0]) == pytest.approx(100 / 90 * 100 - 100)
    assert regret_pct([2.0, 1.0, 3.0], [100.0, 90.0, 120.0]) == 0.0
    assert regret_pct([1.0, 1.0], [110.0, 100.0]) == pytest.approx(10.0)  # a predicted tie: the first listed


def test_the_seeded_split_is_stable_disjoint_complete_and_halves_every_group():
    runs = [_run(i, model_layers=12 + 4 * (i % 3), gpus=(2, 4, 8)[i % 2]) for i in range(61)]
    fit, held = split_half(runs, seed=7)
    assert (fit, held) == split_half(runs, seed=7)
    assert {r.row for r in fit}.isdisjoint({r.row for r in held})
    assert sorted(r.row for r in fit + held) == list(range(61))
    for group in {r.group for r in runs}:
        size = sum(r.group == group for r in runs)
        assert sum(r.group == group for r in fit) == size // 2
    assert split_half(runs, seed=8) != (fit, held)


def test_interval_coverage_counts_the_runs_inside_prediction_times_the_ratios_5th_to_95th_percentile():
    ratios = ratios_of([-50.0, 0.0, 100.0])  # run / prediction: 2, 1, 0.5
    assert ratios == pytest.approx([2.0, 1.0, 0.5])
    low, high = np.percentile(ratios, [5, 95])
    predicted = [100.0, 100.0, 100.0, 100.0]
    measured = [100 * low, 100 * high, 100 * low * 0.99, 100 * high * 1.01]
    assert interval_coverage_pct(predicted, measured, ratios) == pytest.approx(50.0)


def test_spec_only_interval_scales_the_batch_time_by_the_residuals_percentiles(tmp_path):
    residuals = ModelResiduals("cuda", (0.8, 1.0, 1.25), (1,), ("2026-12-03",), "bench/published.py")
    interval = spec_only_interval(2.0, residuals)
    p5, p50, p95 = np.percentile([0.8, 1.0, 1.25], [5, 50, 95]) * 2.0
    assert (interval.p5_s, interval.p50_s, interval.p95_s) == pytest.approx((p5, p50, p95))
    assert interval.residuals.startswith("3 held-out CUDA runs of bench/published.py")
    path = tmp_path / "gpu.json"
    jobs = [{"job": "a", "pair_error_pct": [25.0]}, {"job": "b", "pair_error_pct": [-20.0]}]
    path.write_text(json.dumps({"kind": "distsim-model-residuals", "version": 1, "command": "python bench/published.py",
                                "devices": {"cuda": {"runs": [{"seed": 5, "date": "2026-12-03", "jobs": jobs}]}}}))
    read = model_residuals("cuda", path)
    assert read.ratios == pytest.approx((0.8, 1.25)) and read.bench == "bench/published.py"


def test_the_intervals_residuals_pool_both_folds_and_read_back_as_every_runs_ratio(tmp_path):
    # fold A: +25% and -20% (ratios 0.8, 1.25); fold B: +100% (ratio 0.5)
    folds = (Fold("held-out-half", [_run(0), _run(1)], np.array([25.0, -20.0])),
             Fold("fit-half", [_run(2)], np.array([100.0])))
    document = residuals_document(folds, 7, "fitted on the fit half")
    assert [run["run"] for run in document["devices"]["cuda"]["runs"]] == ["vtrain-single-held-out-half",
                                                                           "vtrain-single-fit-half"]
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(document))
    assert sorted(model_residuals("cuda", path).ratios) == pytest.approx([0.5, 0.8, 1.25])


def test_the_out_of_domain_folds_fit_on_one_end_of_the_runs_and_score_the_rest():
    runs = [_run(i, gpus=g, hidden=h) for i, (g, h) in enumerate([(2, 1024), (8, 1024), (4, 2048), (8, 2048),
                                                                   (2, 1536)])]
    splits = {name: ([r.row for r in fit], [r.row for r in scored]) for name, fit, scored in beyond_splits(runs)}
    assert splits == {"hidden-1024-to-wider": ([0, 1], [2, 3, 4]), "hidden-2048-to-narrower": ([2, 3], [0, 1, 4]),
                      "under-8-gpus-to-8": ([0, 2, 4], [1, 3])}
    assert residual_domain(runs) == ResidualDomain((1024, 2048), (2, 8), 1)
    assert residual_domain(runs + [_run(9, gpus=64)]).nodes == 8
    domain = ResidualDomain((1024, 2048), (2, 8), 1)
    assert domain.contains(2048, 8, 1) and not domain.contains(3072, 8, 1) and not domain.contains(1024, 16, 2)


def test_multi_node_coverage_scores_each_group_on_the_other_groups_errors():
    # two groups: A's runs read 1.0 and 1.3 x their predictions, B's 1.1 and 1.2
    a = [_run(0, gpus=64, measured=100.0), _run(1, gpus=64, measured=130.0)]
    b = [_run(2, gpus=512, measured=110.0), _run(3, gpus=512, measured=120.0)]
    scored = Scored("multi", a + b, np.array([100.0] * 4))
    coverage, by_group = leave_group_out_coverage(scored)
    # A on B's ratios [1.1, 1.2]: neither 1.0 nor 1.3 within; B on A's [1.0, 1.3]: both within
    assert by_group == {(a[0].model, 64): pytest.approx(0.0), (b[0].model, 512): pytest.approx(100.0)}
    assert coverage == pytest.approx(50.0)


def test_a_spec_outside_the_residuals_domain_draws_on_the_out_of_domain_runs(tmp_path):
    folds = [Fold("held-out-half", [_run(0)], np.array([0.0]))]
    beyond = [Fold("hidden-1024-to-wider", [_run(1), _run(2)], np.array([-20.0, 25.0]))]
    multi_node = Fold("held-out", [_run(3, gpus=64)], np.array([-50.0]))
    document = residuals_document(folds, 7, "fitted", beyond, ResidualDomain((1024, 2048), (2, 8), 1), multi_node)
    text = residuals_text(document)
    assert json.loads(text) == document
    job_lines = [json.loads(line.strip().rstrip(",")) for line in text.splitlines() if '"job"' in line]
    assert job_lines == [{"job": run.label, "pair_error_pct": [e]} for run, e in
                         [(_run(0), 0.0), (_run(1), -20.0), (_run(2), 25.0), (_run(3, gpus=64), -50.0)]]
    path = tmp_path / "gpu.json"
    path.write_text(text)
    spec = published.run_spec(_run(0))
    assert gpu_residuals_for(spec, path).ratios == pytest.approx((1.0,))
    wide = dataclasses.replace(spec, model=dataclasses.replace(spec.model, hidden=4096))
    residuals = gpu_residuals_for(wide, path)
    assert residuals.beyond and sorted(residuals.ratios) == pytest.approx([0.8, 1.25])
    assert "2 out-of-domain CUDA runs" in residuals.source and "beyond hidden 1024-2048" in residuals.source
    many = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, nodes=2))
    multi = gpu_residuals_for(many, path)  # on more than one node: the multi-node runs' own held-out errors
    assert not multi.beyond and multi.part == "multi_node_runs" and multi.ratios == pytest.approx((2.0,))
    assert multi.source.startswith("1 multi-node held-out CUDA runs of bench/published.py")
    document["devices"]["cuda"].pop("multi_node_runs")
    path.write_text(residuals_text(document))
    model_residuals.cache_clear()
    assert gpu_residuals_for(many, path).beyond  # a file without them: the out-of-domain runs
    assert gpu_residuals_for(None, path) == model_residuals("cuda", path)


@needs_data
def test_a_run_becomes_its_megatron_spec_on_the_readmes_cluster():
    run = published.read_runs("multi")[0]
    spec = published.run_spec(run)
    assert (spec.strategy.tp, spec.strategy.dp, spec.strategy.pp) == (run.tp, run.dp, run.pp)
    assert spec.strategy.recompute == "full" and spec.strategy.dp_overlap is False
    assert (spec.cluster.nodes, spec.cluster.gpus_per_node) == (run.gpus // 8, 8)
    assert spec.cluster.device == published.DEVICE
    nvlink, ib = spec.cluster.network
    assert ib.bandwidth_gbs == 12.5 and nvlink.size == 8
    assert spec.model.vocab == 50304 and spec.batch.micro == run.micro  # 50,257 padded to 128 x tp (tp = 1)


@needs_data
def test_the_fits_fast_path_predicts_what_predict_spec_predicts(tmp_path):
    single = published.read_runs("single")
    runs = single[:3] + [run for run in single if run.tp == 8][:1] + published.read_runs("multi")[:2]
    assert sum(run.tp > 1 for run in runs) >= 1  # a run with inline collectives, issued on the host
    base = load_device(published.DEVICE)
    # every fitted figure moved, the host's figures from 0 to the fit's start (the step gap to 1 ms on its grid):
    # the fast path plays them as predict_spec does (Costs.host_issue, collective_issue_s and engine_gaps)
    start = {**published.FIT_START, (published.HOST, "step_gap_us"): 1000.0}
    figures = {key: (published.figure_of(base, key) or start[key]) * 1.1 for key in published.FITTED}
    described = dataclasses.replace(published.with_figures(base, figures, "a test"), name="a100-test-fit")
    path = tmp_path / "a100-test-fit.toml"
    path.write_text(described.to_toml())
    times, predictions = published.predict_runs(runs, path)
    fast = published.predict_ms(published.prepare(runs), described)
    assert times == pytest.approx(fast, rel=1e-9)
    assert all(t > 0 for t in times)
    spent = published.time_spent(predictions[-1].timeline)
    assert sum(spent.values()) == pytest.approx(times[-1], rel=1e-6)
    assert spent["compute"] > 0
    # the fitted figures move the prediction: the description is what predict_spec costs from
    assert not np.allclose(times, published.predict_ms(published.prepare(runs), base))
    assert DeviceModel(described).description.curves["gemm"].max_fraction == pytest.approx(
        min(1.0, base.curves["gemm"].max_fraction * 1.1))
    assert described.kernel_issue_s == pytest.approx(published.FIT_START[(published.HOST, "kernel_issue_us")]
                                                      * 1.1e-6)
    assert described.collective_issue_s == pytest.approx(22e-6)
    assert predictions[0].costs.host_issue  # the spec-only prediction was played against the host
    assert all(p.costs.collective_issue_s == pytest.approx(22e-6) for p in predictions)
    # the engine's gap between steps, from the fit's start: predict_spec's costs carry it, as the fast path's do
    assert described.step_gap_s == pytest.approx(1.1e-3)
    assert all(len(p.costs.engine_gaps) == 4 and all(g == pytest.approx(described.step_gap_s)
                                                     for g in p.costs.engine_gaps.values()) for p in predictions)


@needs_data
def test_a_spec_alone_states_its_interval_from_the_gpu_residuals():
    from analysis.predict import predict_spec

    prediction = predict_spec(published.run_spec(published.read_runs("single")[0]), dp_overlap=False)
    interval, batch = prediction.interval, prediction.timeline.batch_time_s
    assert interval is not None and interval.p5_s < batch < interval.p95_s
    assert "held-out CUDA runs of bench/published.py" in interval.residuals
    multi = predict_spec(published.run_spec(published.read_runs("multi")[0]), dp_overlap=False).interval
    assert "109 multi-node held-out CUDA runs of bench/published.py" in multi.residuals
    assert multi.p95_s / multi.p5_s > interval.p95_s / interval.p5_s  # many nodes: wider
    assert interval_text(multi).endswith("wide, with the model's held-out error)")
    spec = published.run_spec(published.read_runs("single")[0])
    wide = dataclasses.replace(spec, model=dataclasses.replace(spec.model, hidden=4096))
    beyond = predict_spec(wide, dp_overlap=False).interval  # one node, wider than the runs: the out-of-domain runs
    assert interval_text(beyond).endswith("wide, with the model's error beyond its held-out runs)")
    assert beyond.to_dict()["interval_beyond_domain"] and not multi.to_dict()["interval_beyond_domain"]


def test_a_jobs_regret_is_among_the_runs_of_one_global_batch(capsys):
    """One model on 8 GPUs at two global batches: the (model, GPUs) group's pick is the quick small batch and right,
    but within the larger batch (one job, five configurations) the pick ran 10% slower than that job's best."""
    small = [dataclasses.replace(_run(i, measured=50.0 + i), global_batch=16) for i in range(5)]
    large = [dataclasses.replace(_run(10 + i, measured=m), global_batch=32)
             for i, m in enumerate((110.0, 100.0, 120.0, 130.0, 140.0))]
    predicted = np.array([50.0, 51, 52, 53, 54, 90, 95, 96, 97, 98])  # the large batch's pick: 110 against 100
    scored = Scored("single_held_out", small + large, predicted)
    figures = set_figures(scored, None, "a test")
    assert figures["max_group_regret_pct"] == pytest.approx(0.0)
    assert figures["max_job_regret_pct"] == pytest.approx(10.0)
    assert max_job_regret_pct(Scored("s", small[:4], predicted[:4])) is None  # under GROUP_MIN_RUNS: not judged
    worst = [{"set": "single_held_out", "run": large[0].label, "error_pct": -18.2, "predicted_ms": 90.0,
              "measured_ms": 110.0, "spent_ms": {"compute": 70.0, "tp": 10.0, "idle": 8.0, "dp": 2.0}}]
    print_tables({"single_held_out": figures}, worst)
    out = capsys.readouterr().out
    assert "job regret%" in out and "idle 8.0" in out


def test_a_limit_too_small_for_the_folds_is_refused(capsys):
    """--limit below MIN_LIMIT would leave a fold or a set without runs: one message, exit 2, nothing predicted."""
    from bench.published import MIN_LIMIT, main

    with pytest.raises(SystemExit) as refused:
        main(["--limit", str(MIN_LIMIT - 1)])
    assert refused.value.code == 2 and f"give at least {MIN_LIMIT}" in capsys.readouterr().err

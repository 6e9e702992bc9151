"""bench/megatron_table.py: Korthikanti et al.'s Table 5, Section 6.3's data-parallel run and Table 4's layer times
as committed, each row's spec through the Megatron importer, a layer's time read off a timeline, and the bench end
to end (its JSON)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from analysis.predict import predict_spec
from bench import megatron_table
from bench.megatron_table import (
    data_parallel_added,
    layer_times_ms,
    main,
    megatron_arguments,
    read_layer_rows,
    read_rows,
    row_spec,
)


def test_the_table_holds_the_papers_eight_iterations_and_the_data_parallel_one():
    rows = read_rows()
    assert [r.source for r in rows] == ["Table 5"] * 8 + ["Section 6.3"]
    last = rows.pop()
    assert (last.model, last.gpus, last.dp, last.global_batch, last.recompute, last.sp, last.measured_s) == (
        "530B", 2240, 8, 2240, "selective", True, 39.15)
    assert [(r.model, r.recompute, r.sp, r.measured_s) for r in rows] == [
        ("22B", "full", False, 1.42), ("22B", "selective", True, 1.10),
        ("175B", "full", False, 18.13), ("175B", "selective", True, 13.75),
        ("530B", "full", False, 49.05), ("530B", "selective", True, 37.83),
        ("1T", "full", False, 94.42), ("1T", "selective", True, 71.49)]
    assert [(r.gpus, r.tp, r.pp, r.global_batch, r.micro) for r in rows[::2]] == [
        (8, 8, 1, 4, 4), (64, 8, 8, 64, 1), (280, 8, 35, 280, 1), (512, 8, 64, 512, 1)]
    assert all(r.gpus == r.tp * r.pp and r.dp == 1 for r in rows)


def test_the_layer_table_holds_table_4():
    assert [(r.experiment, r.recompute, r.sp, r.forward_ms, r.backward_ms) for r in read_layer_rows()] == [
        ("Baseline no recompute", "none", False, 7.7, 11.9), ("Sequence Parallelism", "none", True, 7.2, 11.8),
        ("Baseline with recompute", "full", False, 7.7, 19.5), ("Selective Recompute", "selective", False, 7.7, 13.2),
        ("Selective + Sequence", "selective", True, 7.2, 13.1)]


def test_a_layer_without_recompute_reads_no_recompute_arguments():
    row = dataclasses.replace(read_rows()[0], recompute="none", sp=True)
    assert "--recompute" not in megatron_arguments(row) and "--sequence-parallel" in megatron_arguments(row)
    spec = row_spec(row)
    assert (spec.strategy.recompute, spec.strategy.sp) == ("none", True)


def test_a_layers_time_is_its_passes_on_the_timeline():
    """The 22B without recompute: a block's forward is its compute and its two all-reduces, its backward the
    same; with full recompute the backward adds the forward again."""
    plain = dataclasses.replace(read_rows()[0], recompute="none")
    prediction = predict_spec(row_spec(plain), dp_overlap=False, resamples=0)
    block = next(i for i, layer in enumerate(prediction.plan.layers) if layer.kind == "block")
    passes = {"F": 0.0, "B": 0.0}
    for interval in prediction.timeline.intervals(0):
        if interval.micro == 0 and interval.layer == block:
            passes[interval.name[0]] += (interval.end_s - interval.start_s) * 1e3
    forward, backward = layer_times_ms(prediction)
    assert (forward, backward) == pytest.approx((passes["F"], passes["B"]))
    full = layer_times_ms(predict_spec(row_spec(dataclasses.replace(plain, recompute="full")), dp_overlap=False,
                                       resamples=0))
    assert full == pytest.approx((forward, forward + backward))


def test_what_data_parallelism_added_is_read_against_the_same_layout_on_one_replica():
    results = [{"model": "m", "label": "m x", "tp": 8, "pp": 2, "dp": 1, "gpus": 16, "measured_s": 10.0,
                "predicted_s": 9.0, "spent_ms": {}},
               {"model": "m", "label": "m x", "tp": 8, "pp": 2, "dp": 4, "gpus": 64, "measured_s": 11.0,
                "predicted_s": 9.5, "spent_ms": {"dp": 400.0}},
               {"model": "m", "label": "m y", "tp": 8, "pp": 2, "dp": 4, "gpus": 64, "measured_s": 12.0,
                "predicted_s": 9.5, "spent_ms": {}}]
    assert data_parallel_added(results) == [{"label": "m x", "gpus": 64, "dp": 4, "measured_s": 1.0,
                                             "predicted_s": 0.5, "predicted_dp_allreduce_s": 0.4}]


@pytest.mark.parametrize("index,schedule,chunks,recompute,sp", [
    (0, "1f1b", 1, "full", False), (3, "interleaved-1f1b", 3, "selective", True),
    (4, "interleaved-1f1b", 3, "full", False), (7, "1f1b", 1, "selective", True)])
def test_a_row_becomes_its_megatron_spec_on_selene(index, schedule, chunks, recompute, sp):
    row = read_rows()[index]
    spec = row_spec(row)
    assert "--transformer-impl local" in megatron_arguments(row)
    assert (spec.model.layers, spec.model.hidden, spec.model.heads) == (row.layers, row.hidden, row.heads)
    assert (spec.strategy.dp, spec.strategy.tp, spec.strategy.pp) == (1, row.tp, row.pp)
    assert (spec.strategy.schedule, spec.strategy.chunks) == (schedule, chunks)
    assert (spec.strategy.recompute, spec.strategy.sp) == (recompute, sp)
    assert (spec.batch.micro, spec.batch.global_size) == (row.micro, row.global_batch)
    assert spec.model.attention == "materialized" and spec.model.dtype == "float16"
    assert spec.optimizer.master_weights and spec.model.dropout == 0.1
    assert spec.cluster.device == "a100-80gb" and spec.cluster.gpus_per_node == 8
    nvlink, ib = spec.cluster.network
    assert (nvlink.bandwidth_gbs, nvlink.memory_gbs) == (300, megatron_table.HBM_GBS)
    assert (ib.bandwidth_gbs, ib.rails) == (25, True)


def test_the_bench_predicts_every_row_and_writes_its_figures(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert main(["--json", str(out)]) == 0
    document = json.loads(out.read_text())
    rows = document["rows"]
    assert len(rows) == 9 and document["figures"]["rows"] == 8  # Calculon's figure is for Table 5's eight
    assert [r["measured_s"] for r in rows] == [r.measured_s for r in read_rows()]
    errors = [abs(r["error_pct"]) for r in rows if r["source"] == "Table 5"]
    assert document["figures"]["mape_pct"] == pytest.approx(sum(errors) / 8)
    assert all(0 < r["peak_gib"] < 80 for r in rows)  # every run ran on an 80 GB A100
    assert document["fitted_on"].startswith("nothing")
    [added] = document["data_parallel_added"]
    assert added["measured_s"] == pytest.approx(39.15 - 37.83) and added["dp"] == 8
    assert added["predicted_dp_allreduce_s"] > 0 and added["predicted_s"] > 0
    layers = document["layers"]
    assert [r["measured_ms"]["combined"] for r in layers] == pytest.approx([19.6, 19.0, 27.2, 20.9, 20.3])
    forward = {r["experiment"]: r["predicted_ms"]["forward"] for r in layers}
    assert forward["Baseline no recompute"] == pytest.approx(forward["Baseline with recompute"])
    backward = {r["experiment"]: r["predicted_ms"]["backward"] for r in layers}
    assert backward["Baseline no recompute"] < backward["Selective Recompute"] < backward["Baseline with recompute"]
    passes = [abs(r["error_pct"][key]) for r in layers for key in ("forward", "backward")]
    assert document["layer_figures"]["mape_pct"] == pytest.approx(sum(passes) / 10)
    out = capsys.readouterr().out
    assert "Calculon" in out and "Table 4" in out and "2,240 GPUs" in out


def test_an_unknown_device_is_refused_with_one_message(capsys):
    assert main(["--device", "no-such-gpu"]) == 2
    err = capsys.readouterr().err
    assert "no-such-gpu" in err and "Traceback" not in err

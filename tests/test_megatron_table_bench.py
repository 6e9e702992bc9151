"""bench/megatron_table.py: Korthikanti et al.'s Table 5 as committed, each row's spec through the Megatron
importer, and the bench end to end (its JSON)."""
from __future__ import annotations

import json

import pytest

from bench import megatron_table
from bench.megatron_table import main, megatron_arguments, read_rows, row_spec


def test_the_table_holds_the_papers_eight_iterations():
    rows = read_rows()
    assert [(r.model, r.recompute, r.sp, r.measured_s) for r in rows] == [
        ("22B", "full", False, 1.42), ("22B", "selective", True, 1.10),
        ("175B", "full", False, 18.13), ("175B", "selective", True, 13.75),
        ("530B", "full", False, 49.05), ("530B", "selective", True, 37.83),
        ("1T", "full", False, 94.42), ("1T", "selective", True, 71.49)]
    assert [(r.gpus, r.tp, r.pp, r.global_batch, r.micro) for r in rows[::2]] == [
        (8, 8, 1, 4, 4), (64, 8, 8, 64, 1), (280, 8, 35, 280, 1), (512, 8, 64, 512, 1)]
    assert all(r.gpus == r.tp * r.pp for r in rows)  # data parallelism 1


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
    assert len(rows) == 8 and document["figures"]["rows"] == 8
    assert [r["measured_s"] for r in rows] == [r.measured_s for r in read_rows()]
    errors = [abs(r["error_pct"]) for r in rows]
    assert document["figures"]["mape_pct"] == pytest.approx(sum(errors) / 8)
    assert all(0 < r["peak_gib"] < 80 for r in rows)  # every run ran on an 80 GB A100
    assert document["fitted_on"].startswith("nothing")
    assert "Calculon" in capsys.readouterr().out


def test_an_unknown_device_is_refused_with_one_message(capsys):
    assert main(["--device", "no-such-gpu"]) == 2
    err = capsys.readouterr().err
    assert "no-such-gpu" in err and "Traceback" not in err

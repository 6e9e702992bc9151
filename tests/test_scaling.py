"""`analysis scaling`: speed-up and efficiency by the documented formulas, series, modes and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.activity import RankActivity, RunActivity
from analysis.cli import main
from analysis.intervals import spans
from analysis.scaling import parse_labels, scaling
from harness.common.errors import UserError

DATA = Path(__file__).parent / "data"
MODEL = {"name": "gpt2-small", "layers": 4, "hidden": 32}


def run(source: str, devices: int, iteration_s: float, *, global_batch: int | None = 8, backend="torch-gloo",
        model=MODEL, replica_batch=None) -> RunActivity:
    """A run of `devices` ranks, each computing 3/4 of its span and communicating 1/4."""
    ranks = {r: RankActivity(r, (0.0, 1.0), spans([0.0], [0.75]), spans([0.75], [1.0])) for r in range(devices)}
    return RunActivity(Path(source), "trace.h5", ranks, np.array([iteration_s * 0.9, iteration_s, iteration_s * 1.2]),
                       model=model["name"] if model else None, backend=backend, world_size=devices,
                       global_batch=global_batch,
                       replica_batch=replica_batch or (global_batch // devices if global_batch else None),
                       model_config=dict(model or {}))


def test_strong_scaling_efficiency():
    result = scaling([run("a", 1, 1.0), run("b", 2, 0.6), run("c", 4, 0.4)])
    (series,) = result.series
    assert series.mode == "strong" and series.label == "torch-gloo"
    assert [p.speedup for p in series.points] == pytest.approx([1.0, 1 / 0.6, 2.5])
    assert [p.efficiency_pct for p in series.points] == pytest.approx([100.0, 100 / 1.2, 62.5])
    assert series.points[0].throughput == pytest.approx(8.0)
    assert series.points[1].spread_pct == pytest.approx(30.0)
    assert (series.points[0].compute_pct, series.points[0].communication_pct) == pytest.approx((75.0, 25.0))


def test_weak_scaling_efficiency():
    runs = [run("a", 1, 1.0, global_batch=4), run("b", 2, 1.25, global_batch=8)]
    (series,) = scaling(runs).series
    assert series.mode == "weak"
    assert series.points[1].efficiency_pct == pytest.approx(80.0)
    assert series.points[1].speedup == pytest.approx(1.6)


def test_series_by_backend_and_by_label():
    runs = [run("t1", 1, 1.0), run("t2", 2, 0.8), run("m1", 1, 1.0, backend="mpi4py"),
            run("m2", 2, 0.55, backend="mpi4py")]
    result = scaling(runs)
    assert {s.label: round(s.points[-1].efficiency_pct, 1) for s in result.series} == {"torch-gloo": 62.5,
                                                                                       "mpi4py": 90.9}
    relabelled = scaling(runs, parse_labels(["A=t1,m2", "B=m1,t2"]))
    assert sorted(s.label for s in relabelled.series) == ["A", "B"]


@pytest.mark.parametrize("runs,message", [
    ([run("a", 1, 1.0), run("b", 2, 0.5, model={"name": "llama", "layers": 2})], "one model"),
    ([run("a", 1, 1.0), run("b", 1, 0.9)], "two runs on 1 devices"),
    ([run("a", 1, 1.0, global_batch=4), run("b", 2, 0.9, global_batch=16, replica_batch=2)], "neither"),
    ([run("a", 1, 1.0, global_batch=None, model=None), run("b", 2, 0.6, global_batch=None, model=None)], "--mode"),
])
def test_bad_series(runs, message):
    with pytest.raises(UserError, match=message):
        scaling(runs)


def test_mode_for_traces_without_a_batch():
    runs = [run("a", 1, 1.0, global_batch=None, model=None), run("b", 2, 0.6, global_batch=None, model=None)]
    result = scaling(runs, mode="weak")
    assert result.unit == "iterations/s" and result.series[0].points[1].efficiency_pct == pytest.approx(100 / 0.6)
    assert "do not record their model" in result.notes[0]
    with pytest.raises(UserError, match="--mode weak, but its runs train one global batch"):
        scaling([run("a", 1, 1.0), run("b", 2, 0.6)], mode="weak")


def test_labels_must_name_given_runs_and_parse():
    with pytest.raises(UserError, match="not given"):
        scaling([run("a", 1, 1.0)], parse_labels(["A=zzz"]))
    with pytest.raises(UserError, match="NAME=RUN"):
        parse_labels(["nolabel"])


def test_command_with_a_profile(tmp_path, capsys):
    png, csv = tmp_path / "s.png", tmp_path / "s.csv"
    assert main(["scaling", str(DATA / "pp2-trace.h5"), "--profile", str(DATA / "pp2-profile.h5"), "--png", str(png),
                 "--csv", str(csv), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (point,) = data["series"][0]["runs"]
    assert point["devices"] == 2 and point["predicted_s"] == pytest.approx(0.2288, abs=5e-4)
    assert point["median_s"] == pytest.approx(0.229369, abs=1e-6)
    assert png.read_bytes()[:4] == b"\x89PNG" and csv.read_text().startswith("series,mode,devices")
    assert main(["scaling", str(DATA / "ddp-gloo"), "--profile", str(DATA / "pp2-profile.h5")]) == 2
    assert "profiler traces do not say the strategy" in capsys.readouterr().err


def test_real_runs_of_both_backends_pinned(capsys):
    """tests/data/scaling: one job at dp = 1 and 2, gradients through gloo and through MPI (bench/scaling.py)."""
    runs = sorted(str(p) for p in (DATA / "scaling").glob("dp*.h5"))
    assert len(runs) == 4, runs
    assert main(["scaling", *runs, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "distsim-scaling" and data["throughput_unit"] == "samples/s"
    got = {(s["label"], r["devices"]): (r["median_s"], r["efficiency_pct"], r["compute_pct"], r["communication_pct"])
           for s in data["series"] for r in s["runs"]}
    assert {s["mode"] for s in data["series"]} == {"strong"}
    pinned = {("torch-gloo", 1): (0.654591, 100.0, 99.687, 0.0), ("torch-gloo", 2): (0.346264, 94.522, 97.332, 2.353),
              ("mpi4py", 1): (0.692485, 100.0, 99.687, 0.0), ("mpi4py", 2): (0.346855, 99.823, 96.860, 2.835)}
    assert set(got) == set(pinned)
    for key, (median, efficiency, compute, comm) in pinned.items():
        assert got[key][0] == pytest.approx(median, abs=1e-6)
        assert got[key][1:] == pytest.approx((efficiency, compute, comm), abs=1e-3)
    assert main(["scaling", runs[0], str(DATA / "pp2-trace.h5")]) == 2
    assert "a scaling table compares runs of one model" in capsys.readouterr().err

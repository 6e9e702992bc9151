"""bench/generalization.py draws its jobs deterministically from the seed, every drawn spec loads, and bad
options stop with one message and exit status 2. Nothing here profiles or trains (the bench does that)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from harness.plan.spec import loads_spec
from tests.conftest import ROOT

SCRIPT = ROOT / "bench" / "generalization.py"


def _generalization_module():
    spec = importlib.util.spec_from_file_location("bench_generalization", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("ranks", [2, 4])
def test_drawing_is_deterministic_in_the_seed_and_every_drawn_spec_loads(ranks):
    bench = _generalization_module()
    first = bench.draw_jobs(7, 30, ranks)
    again = bench.draw_jobs(7, 30, ranks)
    other = bench.draw_jobs(8, 30, ranks)
    assert [j.spec.to_dict() for j in first] == [j.spec.to_dict() for j in again]
    assert [j.name for j in first] != [j.name for j in other]
    # the profile's settings go into every spec but draw nothing: the same jobs otherwise
    cheaper = bench.draw_jobs(7, 30, ranks, repeats=5, budget_s=1.0)
    assert [j.name for j in cheaper] == [j.name for j in first]
    for job in first:
        written = loads_spec(job.spec.to_toml(), source=job.name)  # the job.toml each pair profiles and runs
        assert written == job.spec
        assert written.strategy.world == ranks
        model = written.model
        assert model.layers <= 6 and model.hidden <= 320 and model.seq_len <= 128 and model.vocab <= 8192
    families = {j.spec.model.family for j in first}
    assert families <= {"gpt2", "bert", "llama", "user"} and len(families) >= 3


def test_error_interval_is_min_max_below_three_pairs_and_a_bootstrap_of_the_median_from_three():
    bench = _generalization_module()
    assert bench.error_interval([-2.0, 5.0], np.random.default_rng(0)) == ([-2.0, 5.0], "min-max")
    (low, high), method = bench.error_interval([1.0, 2.0, 3.0, 10.0], np.random.default_rng(0))
    assert method == "bootstrap-90" and 1.0 <= low <= 2.5 <= high <= 10.0
    assert bench.spread_pct([0.4]) is None
    assert bench.spread_pct([0.3, 0.4, 0.5]) == pytest.approx(50.0)


def test_a_job_the_meter_cannot_see_counts_by_memtracker_and_says_so():
    bench = _generalization_module()
    job = bench.draw_jobs(7, 1, 2)[0]
    pair = {"batch_time_error_pct": 1.0, "measured_batch_time_s": 0.2, "predicted_batch_time_s": 0.2,
            "device_error_pct": 2.0, "memory_error_pct": None, "measured_in_interval": True}
    unmetered = bench.job_result(job, [pair, pair], 7)
    assert unmetered["memory_error_pct"] is None and unmetered["memory_source"] is None
    metered = bench.job_result(job, [dict(pair, memory_error_pct=0.5)] * 2, 7)
    assert metered["memory_source"] == "meter" and bench.memory_cell(metered) == "0.50"
    tracked = dict(unmetered, memory_error_pct=2.5, memory_source="tracker")
    assert bench.memory_cell(tracked) == "2.50t"
    summary = bench.suite_summary([metered, tracked, unmetered])
    assert summary["memory_max_error_pct"] == 2.5
    assert (summary["memory_tracker_jobs"], summary["memory_unmetered_jobs"]) == (1, 1)


@pytest.mark.parametrize("options, names", [
    (["--seed", "abc"], "--seed"),
    (["--seed", "1.5"], "--seed"),
    (["--jobs", "0"], "--jobs"),
    (["--pairs", "0"], "--pairs"),
    (["--pairs", "two"], "--pairs"),
    (["--ranks", "3"], "--ranks"),
    (["--ranks", "64"], "--ranks"),
])
def test_bad_input_exits_2_with_one_message(options, names):
    result = subprocess.run([sys.executable, str(SCRIPT), *options], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_the_peer_bench_describes_each_job_as_a_user_would_and_refuses_a_missing_peer(tmp_path):
    """bench/peers.py: what llm-analysis is told of a drawn job, which device's peak it is held to, and a missing
    scratch environment is one message, exit 2 (llm-analysis itself is never imported here)."""
    from bench.generalization import draw_jobs
    from bench.peers import describe, largest_device

    job = draw_jobs(20261201, 1, 2)[0]
    described = describe(job)
    m, s = job.spec.model, job.spec.strategy
    assert (described["layers"], described["hidden"], described["ffn"], described["vocab"], described["seq"]) == (
        m.layers, m.hidden, m.ffn, m.vocab, m.seq_len)
    assert (described["dp"], described["tp"], described["pp"], described["micro_batches"]) == (
        s.dp, s.tp, s.pp, job.spec.micro_batches)
    rows = [{"measured_bytes": 10, "error_pct": 1.0}, {"measured_bytes": 30, "error_pct": -2.0},
            {"measured_bytes": 50, "error_pct": None}]
    assert largest_device({"memory": rows})["error_pct"] == -2.0 and largest_device({"memory": []}) is None
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--peer-python",
                           str(tmp_path / "none" / "python")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "install llm-analysis into a scratch environment" in done.stderr

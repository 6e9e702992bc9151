"""The strategy search: every candidate predicted from one profile, sized, checked against memory and ranked."""
from __future__ import annotations

import csv
import json

import pytest

from analysis.cli import main
from analysis.profile_reader import load_profile
from analysis.search import pareto_front, search
from harness.candidates import expand
from harness.spec import load_spec, parse_spec
from tests.test_analysis_helpers import by_name, make_spec, write_handmade_profile

GRID = {"tp": [1, 2], "pp": [1, 2], "micro": [1, 2], "schedule": ["gpipe", "1f1b"]}


def _search_spec(grid=GRID, **kwargs):
    data = json.loads(make_spec(dp=4, micro_batches=4, layers=4, **kwargs).to_json())
    data["search"] = grid
    return parse_spec(data, source="search-test")


def _profile(tmp_path, spec, block_saves: int = 2000, **kwargs):
    """A profile of the whole grid: compute by FLOPs-free names, `block_saves` bytes saved per block forward
    (100 per other forward)."""
    candidates = expand(spec).candidates
    return write_handmade_profile(tmp_path / "profile.h5", spec, by_name({"compute": 1e-3, "gpt2.block.fwd": 4e-3,
                                                                          "gpt2.block.bwd": 8e-3}, default=2e-4),
                                  also=candidates,
                                  activations=lambda e: block_saves if e.content["layer"] == "block" else 100,
                                  environment={"profiling_wall_s": 1.5, "warmup": 1, "repeats": 3}, **kwargs)


def test_every_candidate_is_predicted_and_ranked(tmp_path):
    spec = _search_spec()
    result = search(load_profile(_profile(tmp_path, spec)), jobs=1)
    assert len(result.candidates) == len(expand(spec).candidates) == 16
    times = [c.batch_time_s for c in result.candidates]
    assert all(t > 0 for t in times) and times == sorted(times)
    assert all(c.feasible for c in result.candidates) and result.best is result.candidates[0]
    assert result.candidates[-1].speedup == pytest.approx(1.0)
    assert result.best.speedup == pytest.approx(times[-1] / times[0])
    cost = result.profiling_cost()
    brute = sum(c.spec.strategy.world * 4 * c.batch_time_s for c in result.candidates)
    # the profile held its 2 ranks for 1.5 s of wall time
    assert cost["brute_force_device_s"] == pytest.approx(brute) and cost["fraction"] == pytest.approx(3.0 / brute)


def test_memory_decides_what_fits(tmp_path):
    profile = load_profile(_profile(tmp_path, _search_spec()))
    everything = search(profile, jobs=1)
    peaks = sorted(c.peak_memory_bytes for c in everything.candidates)
    limit = (peaks[0] + peaks[-1]) / 2
    result = search(profile, capacity_bytes=limit, jobs=1)
    fits = [c for c in result.candidates if c.feasible]
    assert 0 < len(fits) < len(result.candidates)
    assert all(c.peak_memory_bytes <= limit for c in fits)
    assert result.candidates[:len(fits)] == fits  # feasible first
    misfit = result.candidates[-1]
    assert not misfit.feasible and misfit.reason.startswith("needs ") and misfit.speedup is None
    by_memory = search(profile, capacity_bytes=limit, sort="memory", jobs=1)
    assert [c.peak_memory_bytes for c in by_memory.candidates if c.feasible] == sorted(c.peak_memory_bytes
                                                                                      for c in fits)
    front = pareto_front(result.candidates)
    assert front and all(not any(o.peak_memory_bytes <= f.peak_memory_bytes and o.throughput_samples_s >
                                 f.throughput_samples_s for o in fits) for f in front)


def test_workers_give_the_same_answer(tmp_path):
    grid = {**GRID, "micro": [1, 2, 4], "schedule": ["gpipe", "1f1b", "interleaved-1f1b"]}
    spec = _search_spec(grid)
    profile = load_profile(_profile(tmp_path, spec))
    alone, pooled = search(profile, jobs=1), search(profile, jobs=2)
    assert len(alone.candidates) >= 24  # enough to spread over processes
    assert [(c.label, c.batch_time_s, c.peak_memory_bytes) for c in alone.candidates] == [
        (c.label, c.batch_time_s, c.peak_memory_bytes) for c in pooled.candidates]


def test_a_candidate_the_profile_did_not_measure_says_so(tmp_path):
    spec = _search_spec()
    path = write_handmade_profile(tmp_path / "profile.h5", make_spec(dp=4, micro_batches=4, layers=4),
                                  by_name({}, 1e-3))  # the spec alone, not its grid
    result = search(load_profile(path), spec, jobs=1)
    unmeasured = [c for c in result.candidates if not c.predicted]
    assert unmeasured and all(c.reason.startswith("not in the profile") and not c.feasible for c in unmeasured)
    assert result.candidates[-len(unmeasured):] == unmeasured
    with pytest.raises(Exception, match="cannot cost any candidate"):
        search(load_profile(path), _search_spec({"tp": [2]}), jobs=1)


def test_the_command_prints_writes_and_answers_in_json(tmp_path, capsys):
    path = _profile(tmp_path, _search_spec())
    best_spec, table, chart = tmp_path / "best.toml", tmp_path / "all.csv", tmp_path / "front.png"
    assert main(["search", str(path), "--top", "3", "--iterations", "1000", "--write-spec", str(best_spec),
                 "--csv", str(table), "--png", str(chart), "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gpt2-small: 16 candidate strategies") and out[1].startswith("best: ")
    assert out[2].startswith("training 1,000 iterations:") and "of running every candidate" in out[3]
    assert any("13 more (--top 0" in line for line in out)
    assert main(["search", str(path), "--json", "--iterations", "1000"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "distsim-search" and len(report["candidates"]) == 16
    best = report["best"]
    for key in ("batch_time_s", "throughput_samples_s", "peak_memory_bytes", "feasible", "reason", "dp", "tp", "pp",
                "micro", "schedule", "gpu_hours"):
        assert key in best
    assert best["gpu_hours"] == pytest.approx(1000 * best["batch_time_s"] * best["gpus"] / 3600)
    written = load_spec(best_spec, import_factory=False)
    assert written.strategy.dp == best["dp"] and written.strategy.pp == best["pp"] and not written.search
    assert written.batch.micro == best["micro"] and written.strategy.schedule == best["schedule"]
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 16 and rows[0]["strategy"] == best["strategy"]
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,words", [(["--memory-gb", "0"], "--memory-gb 0"),
                                        (["--gpus", "3"], "no combination"),
                                        (["--top", "-1"], "--top -1"),
                                        (["--iterations", "0"], "--iterations 0")])
def test_bad_input_is_one_message(tmp_path, capsys, args, words):
    path = _profile(tmp_path, _search_spec())
    assert main(["search", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_a_profile_of_the_grid_costs_every_candidate(tmp_path, project_env):
    """`harness profile` on a spec with [search] measures the union of its candidates' events once, on real MPI
    ranks: the search then predicts every candidate from that one profile, none from missing compute."""
    from tests.helpers import mpirun_harness, tiny_spec_text

    spec = tmp_path / "search.toml"
    spec.write_text(tiny_spec_text(layers=2, hidden=32, heads=4, ffn=64, seq=16, vocab=64, dp=2, global_batch=4,
                                   micro=1, warmup=1, repeats=2) + "[search]\ntp = [1, 2]\npp = [1, 2]\n")
    profiled = mpirun_harness(2, ["profile", str(spec), "-o", str(tmp_path / "out"), "--quiet"], project_env)
    assert profiled.returncode == 0, profiled.stderr
    assert "the union of 3 candidate strategies" in profiled.stdout
    result = search(load_profile(tmp_path / "out"), jobs=1)
    assert sorted(c.label for c in result.candidates) == ["dp=1 tp=1 pp=2 1f1b micro=1 m=4",
                                                          "dp=1 tp=2 pp=1 1f1b micro=1 m=4",
                                                          "dp=2 tp=1 pp=1 1f1b micro=1 m=2"]
    assert all(c.predicted and c.feasible and c.peak_memory_bytes > 0 for c in result.candidates)
    assert not any("activations not measured" in flag for c in result.candidates for flag in c.flags)
    assert result.profiling_cost()["fraction"] > 0

"""The strategy search: every candidate predicted from one profile, sized, checked against memory and ranked."""
from __future__ import annotations

import csv
import json

import pytest

import analysis.search as search_module
from analysis.cli import main
from analysis.commands.search import spec_header
from analysis.profile_reader import load_profile
from analysis.search import CandidateResult, SearchResult, pareto_front, recommend, search
from analysis.uncertainty import BatchTimeInterval
from harness.plan.candidates import expand
from harness.plan.spec import load_spec, parse_spec
from tests.conftest import ROOT
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
    result = search(load_profile(_profile(tmp_path, spec)), jobs=1, exhaustive=True)
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


@pytest.mark.parametrize("grid", [
    GRID,
    {"tp": [1, 2], "pp": [2, 4], "micro": [1, 2], "schedule": ["interleaved-1f1b", "zb-h1", "interleaved-zb"],
     "chunks": [1, 2]},
    {"tp": [1], "pp": [1, 2, 4], "micro": [1, 4], "schedule": ["1f1b"], "recompute": ["none", "full"],
     "zero": [0, 1, 3]},
])
def test_what_cannot_come_near_the_fastest_is_not_simulated(tmp_path, grid):
    """By default a candidate whose least batch time (analysis.simulate.least_batch_time) is over PRUNE_MARGIN
    above the fastest of its device count is listed with that bound and not simulated; the least batch time
    never exceeds the simulated one, and what is simulated is what the exhaustive search gives."""
    spec = _search_spec(grid)
    profile = load_profile(_profile(tmp_path, spec))
    everything, pruned = search(profile, jobs=1, exhaustive=True), search(profile, jobs=1)
    assert all(c.least_batch_time_s <= c.batch_time_s * (1 + 1e-12) for c in everything.candidates)
    exact = {c.label: c.batch_time_s for c in everything.candidates}
    simulated = [c for c in pruned.candidates if c.predicted]
    left = [c for c in pruned.candidates if c.pruned]
    assert len(simulated) + len(left) == len(pruned.candidates) and not any(c.feasible for c in left)
    assert [c.batch_time_s for c in simulated] == [exact[c.label] for c in simulated]
    assert pruned.best.label == everything.best.label
    fastest = {}
    for c in simulated:
        fastest.setdefault(c.spec.strategy.world, c.batch_time_s)
    for c in left:
        assert c.least_batch_time_s > (1 + search_module.PRUNE_MARGIN) * fastest[c.spec.strategy.world]
        assert c.batch_time_s is None and "not simulated (--exhaustive simulates it)" in c.reason
        assert c.indistinguishable_from_best is False and not c.recommended
    # every candidate within the margin of its device count's fastest is simulated, in the same order
    near = [c.label for c in everything.candidates
            if c.batch_time_s <= (1 + search_module.PRUNE_MARGIN) * fastest[c.spec.strategy.world]]
    assert [c.label for c in simulated if c.label in near] == near
    assert [c.label for c in pruned.candidates[len(simulated):]] == [c.label for c in left]  # by their bound
    assert [c.least_batch_time_s for c in left] == sorted(c.least_batch_time_s for c in left)
    if grid is GRID:
        assert left, "the default grid has candidates far from the fastest"


def test_memory_decides_what_fits(tmp_path):
    profile = load_profile(_profile(tmp_path, _search_spec()))
    everything = search(profile, jobs=1, exhaustive=True)
    peaks = sorted(c.peak_memory_bytes for c in everything.candidates)
    limit = (peaks[0] + peaks[-1]) / 2
    result = search(profile, capacity_bytes=limit, jobs=1, exhaustive=True)
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
    # the hand-made profile's samples are exact: pp=1 runs gpipe and 1f1b alike, the same time and memory
    assert out[2] == ("recommended: dp=4 tp=1 pp=1 1f1b micro=2 m=2, the fastest - within its noise (90% intervals "
                      "overlap): dp=4 tp=1 pp=1 gpipe micro=2 m=2 (predicted as fast, 0.3% more memory per device); "
                      "none of them runs on fewer devices")
    assert out[3].startswith("training 1,000 iterations:") and "of running every candidate" in out[4]
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
    # the CSV says what the JSON says
    by_label = {c["strategy"]: c for c in report["candidates"]}
    for row in rows:
        candidate = by_label[row["strategy"]]
        assert row["indistinguishable_from_best"] == str(candidate["indistinguishable_from_best"])
        assert row["recommended"] == str(candidate["recommended"])
        assert row["batch_time_p5_s"] == ("" if candidate["batch_time_p5_s"] is None
                                          else repr(candidate["batch_time_p5_s"]))
    assert sum(row["recommended"] == "True" for row in rows) == 1
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["recommendation"]["memory_headroom_asked"] is False
    assert main(["search", str(path), "--json", "--memory-gb", "80"]) == 0
    limited = json.loads(capsys.readouterr().out)["recommendation"]
    assert limited["memory_headroom_asked"] is True and limited["strategy"] == best["strategy"]


@pytest.mark.parametrize("args,words", [(["--memory-gb", "0"], "--memory-gb 0"),
                                        (["--memory-gb", "inf"], "--memory-gb inf: give each device's memory in GB"),
                                        (["--gpus", "3"], "no combination"),
                                        (["--top", "-1"], "--top -1"),
                                        (["--iterations", "0"], "--iterations 0"),
                                        (["--gpus", "99999999999"], "give a device count from 1 to 1,048,576"),
                                        (["--jobs", "100000"], "--jobs 100000: give 1 to"),
                                        (["--tokens", "inf"], "--tokens inf: give a finite token count")])
def test_bad_input_is_one_message(tmp_path, capsys, args, words):
    path = _profile(tmp_path, _search_spec())
    assert main(["search", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_an_empty_option_is_not_taken_for_one_left_out(tmp_path, capsys):
    """`--network "$UNSET"`: argparse's usage error (exit 2), not a search on the spec's own network."""
    path = _profile(tmp_path, _search_spec())
    with pytest.raises(SystemExit) as exit:
        main(["search", str(path), "--network", ""])
    assert exit.value.code == 2 and "argument --network: empty" in capsys.readouterr().err


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


PP2 = ROOT / "tests" / "data" / "pp2-profile.h5"
PP2_GRID = '\n[search]\nschedule = ["gpipe", "1f1b"]\nrecompute = ["none", "full"]\n'


def _pp2_grid(tmp_path):
    """The committed real profile's spec (tests/data/pp2.toml) with a grid of its schedules and recompute: four
    candidates the profile can cost."""
    path = tmp_path / "grid.toml"
    path.write_text((ROOT / "tests" / "data" / "pp2.toml").read_text() + PP2_GRID)
    return path


def test_on_the_real_profile_the_search_tells_what_it_cannot_tell_apart(tmp_path, capsys):
    """1F1B and GPipe are 0.8% apart, inside each other's 2.7%-wide intervals: indistinguishable, and 1F1B, the
    fastest, also needs less memory. Recompute is 27% slower: out of reach, told apart without resampling."""
    assert main(["search", str(PP2), "--spec", str(_pp2_grid(tmp_path)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema_version"] == 5 and report["interval_resamples"] == 200
    by_label = {c["strategy"]: c for c in report["candidates"]}
    one_f_one_b, gpipe = by_label["dp=1 tp=1 pp=2 1f1b micro=2 m=4"], by_label["dp=1 tp=1 pp=2 gpipe micro=2 m=4"]
    # the fastest's interval is the one `simulate` gives (tests/test_fixtures.py)
    assert (one_f_one_b["batch_time_p5_s"], one_f_one_b["batch_time_p95_s"]) == pytest.approx(
        (0.2259277571700878, 0.23214372876406897), rel=1e-9)
    assert (gpipe["batch_time_p5_s"], gpipe["batch_time_p95_s"]) == pytest.approx(
        (0.22786951717008783, 0.23408548876406898), rel=1e-9)
    assert one_f_one_b["indistinguishable_from_best"] is True and gpipe["indistinguishable_from_best"] is True
    for label in ("dp=1 tp=1 pp=2 1f1b micro=2 m=4 recompute=full", "dp=1 tp=1 pp=2 gpipe micro=2 m=4 recompute=full"):
        slower = by_label[label]
        assert slower["indistinguishable_from_best"] is False and slower["batch_time_p5_s"] is None
        # simulated, or bounded out of the fastest's reach by its least batch time
        assert (slower["batch_time_s"] or slower["least_batch_time_s"]) > 1.25 * one_f_one_b["batch_time_s"]
    assert [c["strategy"] for c in report["candidates"] if c["recommended"]] == [one_f_one_b["strategy"]]
    assert report["recommendation"] == {
        "strategy": one_f_one_b["strategy"], "fastest": one_f_one_b["strategy"],
        "indistinguishable": [one_f_one_b["strategy"], gpipe["strategy"]], "basis": "intervals",
        "memory_saving_fraction": 0.0, "devices_saved": 0, "memory_headroom_asked": False, "preferred_for": [],
        "text": "recommended: dp=1 tp=1 pp=2 1f1b micro=2 m=4, the fastest - within its noise (90% intervals "
                "overlap): dp=1 tp=1 pp=2 gpipe micro=2 m=4 (predicted 0.8% slower, 37% more memory per device); "
                "none of them runs on fewer devices"}
    assert (one_f_one_b["peak_memory_bytes"], gpipe["peak_memory_bytes"]) == (53884928, 73568272)


def test_the_reach_holds_the_intervals_and_workers_give_the_same_ones(tmp_path, monkeypatch):
    profile, spec = load_profile(PP2), load_spec(_pp2_grid(tmp_path), import_factory=False)
    alone = search(profile, spec, jobs=1)
    for c in alone.candidates[:2]:
        low, high = c.reach_s
        assert low < c.interval.p5_s < c.interval.p95_s < high
    assert alone.candidates[0].reach_s == pytest.approx((0.21690820883389092, 0.24460414349457393), rel=1e-9)
    monkeypatch.setattr(search_module, "PARALLEL_INTERVALS_FROM_S", 0.0)  # spread even these over processes
    pooled = search(profile, spec, jobs=2)
    assert [(c.label, c.interval, c.indistinguishable_from_best) for c in pooled.candidates] == [
        (c.label, c.interval, c.indistinguishable_from_best) for c in alone.candidates]


def test_without_resamples_the_search_cannot_tell_and_says_so(tmp_path, capsys):
    assert main(["search", str(PP2), "--spec", str(_pp2_grid(tmp_path)), "--resamples", "0", "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == ("recommended: dp=1 tp=1 pp=2 1f1b micro=2 m=4, the fastest by its prediction - without "
                      "resamples (--resamples 0) or samples the search cannot tell which others are as fast")
    result = search(load_profile(PP2), load_spec(_pp2_grid(tmp_path), import_factory=False), jobs=1, resamples=0)
    assert all(c.indistinguishable_from_best is None and c.interval is None for c in result.candidates)
    assert result.recommendation.basis == "none" and result.candidates[0].recommended


def _candidate(dp: int, pp: int, seconds: float, peak_gb: float, interval: tuple[float, float] | None,
               reach: tuple[float, float] | None, feasible: bool = True) -> CandidateResult:
    """A candidate as the search leaves it, built by hand: its prediction, peak memory, reach and interval."""
    c = CandidateResult(make_spec(dp=dp, pp=pp, micro_batches=4 * pp), batch_time_s=seconds, bubble_fraction=0.1,
                        comm_fraction=0.0, peak_memory_bytes=int(peak_gb * 1e9), feasible=feasible)
    c.reach_s = reach
    if interval is not None:
        c.interval = BatchTimeInterval(interval[0], seconds, interval[1], 200)
    return c


def _noisy_candidates() -> tuple[CandidateResult, ...]:
    """The fastest that fits, one within its noise with 25% less memory, one within reach but told apart (the
    least memory), one out of reach, and a faster one that does not fit."""
    fastest = _candidate(4, 2, 1.00, 80, (0.98, 1.03), (0.95, 1.06))
    close = _candidate(2, 4, 1.02, 60, (1.00, 1.05), (0.97, 1.08))  # overlaps the fastest: 25% less memory
    apart = _candidate(1, 8, 1.10, 10, (1.07, 1.13), (1.04, 1.16))  # within reach, but its interval is clear of it
    far = _candidate(8, 1, 1.50, 5, None, (1.40, 1.60))  # out of reach: no interval needed
    misfit = _candidate(2, 2, 0.90, 200, (0.88, 0.92), (0.85, 0.95), feasible=False)  # faster, but does not fit
    return misfit, fastest, close, apart, far


def test_the_recommendation_is_the_fastest_that_fits_and_names_those_within_its_noise():
    misfit, fastest, close, apart, far = results = _noisy_candidates()
    chosen = recommend(results)
    assert chosen.fastest is fastest and chosen.candidate is fastest and chosen.basis == "intervals"
    assert [c.indistinguishable_from_best for c in results] == [False, True, True, False, False]
    assert [c.recommended for c in results] == [False, True, False, False, False]
    assert chosen.preferred_for == [] and chosen.memory_saving == 0 and chosen.devices_saved == 0
    # less memory within the noise is named, not taken: no memory limit was asked for
    assert chosen.text() == ("recommended: dp=4 tp=1 pp=2 1f1b micro=1 m=8, the fastest - within its noise (90% "
                             "intervals overlap): dp=2 tp=1 pp=4 1f1b micro=1 m=16 (predicted 2.0% slower, 25% less "
                             "memory per device); none of them runs on fewer devices; memory headroom is weighed only "
                             "where --memory-gb asks for it")
    searched = SearchResult(None, None, list(results), [], None, recommendation=chosen)
    assert searched.to_run is fastest  # what --write-spec writes
    assert len(spec_header(searched, "grid/profile.h5").splitlines()) == 1  # the fastest needs no reason
    # headroom asked for without a limit to measure it against counts for nothing
    assert recommend(results, headroom_asked=True).candidate is fastest
    # nothing within reach: told apart without an interval
    alone = _candidate(4, 2, 1.00, 80, None, (0.95, 1.06))
    chosen = recommend([alone, far])
    assert chosen.candidate is alone and chosen.basis == "reach" and far.indistinguishable_from_best is False
    assert recommend([misfit]) is None


def test_with_a_memory_limit_the_one_within_noise_with_more_headroom_is_preferred_and_says_so():
    misfit, fastest, close, apart, far = results = _noisy_candidates()
    chosen = recommend(results, headroom_asked=True, capacity_bytes=100e9)
    assert chosen.candidate is close and chosen.fastest is fastest  # apart has less memory, but is told apart
    assert [c.recommended for c in results] == [False, False, True, False, False]
    assert chosen.preferred_for == ["memory_headroom"] and chosen.memory_saving == pytest.approx(0.25)
    assert chosen.text() == ("recommended: dp=2 tp=1 pp=4 1f1b micro=1 m=16 - within the noise of the fastest, dp=4 "
                             "tp=1 pp=2 1f1b micro=1 m=8 (90% intervals overlap; predicted 2.0% slower), for 25% less "
                             "memory per device (40 GB free of 100 GB, the fastest 20 GB free)")
    assert chosen.to_dict()["memory_headroom_asked"] is True
    searched = SearchResult(None, None, list(results), [], 100e9, recommendation=chosen)
    assert searched.to_run is close
    header = spec_header(searched, "grid/profile.h5")
    assert header.splitlines()[1] == chosen.text()  # where the written candidate is not the fastest
    assert close.spec.to_toml(header).startswith("# The recommended candidate of `python -m analysis search grid/")


def test_fewer_devices_within_the_noise_are_preferred_and_say_what_they_cost():
    misfit, fastest, close, apart, far = results = _noisy_candidates()
    fewer = _candidate(1, 4, 1.03, 60, (1.01, 1.06), (0.98, 1.09))  # 4 devices, as little memory as close
    chosen = recommend([*results, fewer])
    assert chosen.candidate is fewer and chosen.devices_saved == 4 and chosen.preferred_for == ["fewer_devices"]
    assert chosen.text() == ("recommended: dp=1 tp=1 pp=4 1f1b micro=1 m=16 - within the noise of the fastest, dp=4 "
                             "tp=1 pp=2 1f1b micro=1 m=8 (90% intervals overlap; predicted 3.0% slower), for 4 fewer "
                             "devices; also within its noise: dp=2 tp=1 pp=4 1f1b micro=1 m=16 (predicted 2.0% "
                             "slower, 25% less memory per device)")
    # devices first, then headroom: fewer beats close, the same memory on half the devices
    chosen = recommend([*results, fewer], headroom_asked=True, capacity_bytes=100e9)
    assert chosen.candidate is fewer and chosen.preferred_for == ["fewer_devices", "memory_headroom"]
    # fewer devices at more memory per device: taken, and the cost said
    bigger = _candidate(2, 2, 1.01, 90, (0.99, 1.04), (0.96, 1.07))
    chosen = recommend([fastest, bigger])
    assert chosen.candidate is bigger
    assert chosen.text().endswith("(90% intervals overlap; predicted 1.0% slower), for 4 fewer devices, at 12% more "
                                  "memory per device")


def _run(*command: str, ranks: int | None = None):
    """`python ARGS` from the project's root, under the suite's mpirun on `ranks` ranks when given."""
    import os
    import subprocess
    import sys

    launcher = os.environ.get("DISTSIM_MPIRUN") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    prefix = [launcher, "-n", str(ranks)] if ranks else []
    return subprocess.run([*prefix, sys.executable, *command], capture_output=True, text=True, cwd=ROOT, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_an_mpi_launch_spreads_the_candidates_over_its_ranks(tmp_path):
    """Under `mpirun -n 2 python -m mpi4py.futures`, rank 1 evaluates every candidate for rank 0 and the ranking is
    the one the search makes alone; under a plain mpirun each rank would repeat the search: refused."""
    grid = tmp_path / "grid.toml"
    grid.write_text((ROOT / "tests/data/pp2.toml").read_text() + '\n[search]\nschedule = ["gpipe", "1f1b"]\n'
                    'micro = [1, 2]\n')
    args = ["-m", "analysis", "search", str(ROOT / "tests/data/pp2-profile.h5"), "--spec", str(grid), "--json",
            "--quiet", "--resamples", "0"]
    spread, alone = _run("-m", "mpi4py.futures", *args, ranks=2), _run(*args)
    assert spread.returncode == alone.returncode == 0, spread.stderr + alone.stderr
    spread, alone = json.loads(spread.stdout)["candidates"], json.loads(alone.stdout)["candidates"]
    assert [(c["strategy"], c["batch_time_s"]) for c in spread] == [(c["strategy"], c["batch_time_s"]) for c in alone]
    assert sum(c["feasible"] for c in spread) == 2  # the profile's micro-batch size, both schedules
    refused = _run(*args, ranks=2)
    assert refused.returncode == 2 and "python -m mpi4py.futures" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_the_search_never_writes_over_the_spec_it_reads(tmp_path, capsys):
    grid_spec = _search_spec()
    path = _profile(tmp_path, grid_spec)
    spec = tmp_path / "job.toml"
    spec.write_text(grid_spec.to_toml(search=True))
    before = spec.read_text()
    assert main(["search", str(path), "--spec", str(spec), "--write-spec", str(spec)]) == 2
    assert "which this command reads; writing it would lose it" in capsys.readouterr().err
    assert spec.read_text() == before

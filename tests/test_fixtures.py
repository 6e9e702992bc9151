"""Real data, pinned: the numbers simulate, validate and show give on a profile and a run made by the project
on its own machines (tests/data/README.md). A change to the timeline model, the costs or the readers changes a
number here."""
from __future__ import annotations

import csv
import json

import pytest

from analysis.cli import main as analysis_main
from harness.commands.cli import main as harness_main
from tests.conftest import ROOT

DATA = ROOT / "tests" / "data"
PROFILE, TRACE = DATA / "pp2-profile.h5", DATA / "pp2-trace.h5"
EXACT = 1e-9


def _json(main, capsys, *args) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_on_the_real_profile(capsys):
    report = _json(analysis_main, capsys, "simulate", str(PROFILE), "--json")
    assert report["batch_time_s"] == pytest.approx(0.22883617898841035, rel=EXACT)
    assert report["bubble_fraction"] == pytest.approx(0.24892423194356192, rel=EXACT)
    assert report["throughput_samples_s"] == pytest.approx(34.95950699476226, rel=EXACT)
    assert report["events"] == {"unique": 9, "total": 58}
    (s0, s1) = report["stages"]
    assert s0["compute_s"] == pytest.approx(0.15043246325992604, rel=EXACT)
    assert s0["idle_s"] == pytest.approx(0.0774822077284843, rel=EXACT)
    assert s1["compute_s"] == pytest.approx(0.19147113852571562, rel=EXACT)
    assert s1["end_s"] == pytest.approx(0.20489096982908764, rel=EXACT)
    assert s0["comm_s"] == pytest.approx(0.0009215080000000136, rel=1e-6)
    # the bootstrap is seeded: the same profile gives the same interval, its sampling part alone as before, and
    # with the model's error on the held-out CPU runs (analysis/data/model_residuals.json) the prediction's; the
    # machine's drift over the profile (its 4 spans' speeds moved 2.9%) is said, held in those runs' errors
    assert (report["interval_sampling_p5_s"], report["interval_sampling_p95_s"]) == pytest.approx(
        (0.2259277571700878, 0.23214372876406897), rel=EXACT)
    assert (report["batch_time_p5_s"], report["batch_time_p95_s"]) == pytest.approx(
        (0.2016388690022543, 0.3256425136719185), rel=EXACT)
    assert report["interval_drift_sigma"] == pytest.approx(0.029359725720357603, rel=EXACT)
    assert report["interval_model_residuals"].startswith("96 held-out CPU runs of bench/generalization.py")
    assert report["interval_resamples"] == 200
    # what makes it as wide as it is: each event's draws moved alone from their 5th to their 95th percentile
    explained = report["interval_explanation"]
    shares = {s["name"]: s["share"] for s in explained["sources"]}
    assert len(shares) == 9 and sum(shares.values()) == pytest.approx(1.0, rel=EXACT)
    assert shares["gpt2.block.bwd"] == pytest.approx(0.5546540596229492, rel=EXACT)
    assert shares["gpt2.block.fwd"] == pytest.approx(0.34760584321845694, rel=EXACT)
    assert shares["gpt2.head.fwd"] == pytest.approx(0.07061386941797997, rel=EXACT)
    # stage 1 (its optimizer step) ends 24 ms before stage 0: off the critical path, its noise moves nothing
    assert shares["optimizer(2x gpt2.block, gpt2.head)"] == 0.0
    assert explained["named"] == ["gpt2.block.bwd", "gpt2.block.fwd"]  # the two that hold 75% of it
    # the one-at-a-time swings add up to 92% of the interval's width squared: the noise mostly adds up
    assert explained["first_order_fraction"] == pytest.approx(0.9190712760711853, rel=EXACT)


def test_validate_on_the_real_run(capsys):
    result = _json(analysis_main, capsys, "validate", str(TRACE), str(PROFILE), "--json")
    assert result["measured_batch_time_s"] == pytest.approx(0.22936875600000006, rel=EXACT)
    assert result["predicted_batch_time_s"] == pytest.approx(0.22883617898841035, rel=EXACT)
    assert result["batch_time_error_pct"] == pytest.approx(-0.23219248378785626, rel=EXACT)
    assert result["replay_error_pct"] == pytest.approx(-1.9719823457559313, rel=EXACT)
    assert result["measured_in_interval"] is True  # the run's 229.4 ms lies inside 201.6 to 325.6 ms
    assert result["measured_in_sampling_interval"] is True  # and inside the sampling part alone, 225.9 to 232.1
    assert result["in_interval"] is True  # the same, by the generalization suite's name
    assert [d["error_pct"] for d in result["devices"]] == pytest.approx([-2.8676823707926515, 2.735786994945674],
                                                                        rel=EXACT)
    assert len(result["layers"]) == 8 and len(result["measured_iteration_s"]) == 6
    # the meter sees no temporaries: it is held to the peak without them (compared_bytes)
    assert [(r["measured_bytes"], r["compared_bytes"], r["predicted_bytes"]) for r in result["memory"]] == [
        (51792040, 51787776, 53884928), (44961908, 44699652, 48893956)]


def test_show_on_the_real_profile(capsys, tmp_path):
    summary = _json(harness_main, capsys, "show", str(PROFILE), "--json", "--csv", str(tmp_path / "m.csv"))
    assert summary["schema_version"] == 2 and summary["environment"]["cpu_binding"] == "bound"
    by_name = {m["name"]: m for m in summary["measurements"]}
    assert len(by_name) == 10 and by_name["gpt2.block.fwd"]["count"] == 137  # sampled to 2%, 10 at least
    assert all(m["count"] == 10 for m in by_name.values() if m["kind"] == "p2p")
    assert by_name["optimizer(gpt2.embedding, 2x gpt2.block)"]["ranks"] == [1]  # one step over the stage
    assert by_name["gpt2.block.fwd"]["median_s"] == pytest.approx(0.005984268, rel=EXACT)
    assert by_name["gpt2.block.bwd"]["ranks"] == [0]
    # the profiler held the samples to 2% by single samples; batch means, which see the machine's drift, say less
    assert by_name["gpt2.block.bwd"]["precision"] == pytest.approx(0.02850781154239344, rel=EXACT)
    assert by_name["p2p 256KiB intra"]["median_s"] == pytest.approx(0.000144865, rel=EXACT)
    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert {r["name"] for r in rows} == set(by_name)
    assert float(next(r for r in rows if r["name"] == "gpt2.block.fwd")["median_s"]) == pytest.approx(0.005984268)


def test_the_terminal_report_on_the_real_profile(capsys):
    assert analysis_main(["simulate", str(PROFILE)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("batch time   228.836 ms (90% interval 201.639 ms to 325.643 ms, 48.2% wide, with the "
                        "model's held-out error)")
    assert lines[2] == ("interval     48.2% wide: the model's error on 96 held-out CPU runs of bench/generalization.py "
                        "(seeds 20261201, 610975364, 332022879, 304290446; 2026-12-02), which holds a run's drift "
                        "from its profile (this profile's: 2.9%), around 2.7% from 9 measured events' sampling noise, "
                        "gpt2.block.bwd 55% and gpt2.block.fwd 35% of its variance")
    assert lines[5] == "memory       53.9 MB per device at most (stage 0, activations 17.3 MB)"
    assert len(lines) <= 13


def test_the_validation_says_in_one_line_whether_the_run_lies_in_the_interval(capsys):
    assert analysis_main(["validate", str(TRACE), str(PROFILE)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("in interval:")]
    assert lines == ["in interval: yes, the measured median is inside the prediction's 90% interval, 201.639 to "
                     "325.643 ms (48.2% wide, with the model's held-out error)"]
    assert analysis_main(["validate", str(TRACE), str(PROFILE), "--resamples", "0"]) == 0
    out = capsys.readouterr().out
    assert "in interval: not known (no interval: --resamples 0" in out


def test_the_memory_table_shows_the_peak_its_error_is_taken_against(capsys):
    """The meter cannot see a backward's temporaries: the error is against the model's peak of what it sees, and
    the table shows that figure beside the whole peak (53.88 MB against 51.79 on stage 0)."""
    assert analysis_main(["validate", str(TRACE), str(PROFILE), "--resamples", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("peak memory per pipeline stage"))
    assert "error against the predicted peak of what the meter sees" in lines[header]
    assert lines[header + 1].split("  ")[:5] == ["stage", "rank", "measured MB", "predicted MB",
                                                 "predicted, meter's MB"]
    assert lines[header + 3].split() == ["0", "0", "51.79", "53.88", "51.79", "-0.008", "activations"]


COMM_PROFILE = DATA / "dp2pp2-profile.h5"


def test_communication_curves_on_the_real_sweep():
    """The sweep of a real profile (dp2pp2.toml, communication through mpi4py): every need between two measured
    sizes, and each costed from its neighbours as if it had not been measured, against its own measurement."""
    from analysis.costs import held_out_checks
    from analysis.profile_reader import load_profile

    profile = load_profile(COMM_PROFILE)
    checks = {(c.kind, int(c.nbytes)): c for c in held_out_checks(profile)}
    assert {key: round(c.rel_error, 4) for key, c in checks.items()} == {
        ("allreduce", 2099200): 0.0040, ("allreduce", 2228224): -0.0001, ("allreduce", 3159040): -0.1237,
        ("p2p", 262144): 0.0766}
    # what each is costed from: the all-reduces' medians, the P2P's minimum (analysis.costs.statistic_of)
    assert checks[("p2p", 262144)].measured_s == pytest.approx(48.81e-6, abs=5e-9)
    assert checks[("allreduce", 3159040)].measured_s == pytest.approx(1488.4e-6, abs=5e-8)


def test_communication_fits_on_the_real_sweep(capsys):
    assert analysis_main(["simulate", str(COMM_PROFILE), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    fits = {f["kind"]: (f["points"], round(f["mean_rel_error"], 4), round(f["max_rel_error"], 4))
            for f in report["fits"]}
    assert fits == {"allgather": (7, 0.0157, 0.0541), "allreduce": (7, 0.0739, 0.201), "p2p": (4, 0.1832, 0.2666),
                    "reducescatter": (7, 0.1306, 0.4431)}
    assert report["extrapolated"] == [] and report["interpolated"] == []  # its own plan's every message measured
    assert report["batch_time_s"] == pytest.approx(0.17112, abs=5e-6)

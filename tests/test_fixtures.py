"""Real data, pinned: the numbers simulate, validate and show give on a profile and a run made by the project
on its own machines (tests/data/README.md). A change to the timeline model, the costs or the readers changes a
number here."""
from __future__ import annotations

import csv
import json

import pytest

from analysis.cli import main as analysis_main
from harness.cli import main as harness_main
from tests.conftest import ROOT

DATA = ROOT / "tests" / "data"
PROFILE, TRACE = DATA / "pp2-profile.h5", DATA / "pp2-trace.h5"
EXACT = 1e-9


def _json(main, capsys, *args) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_on_the_real_profile(capsys):
    report = _json(analysis_main, capsys, "simulate", str(PROFILE), "--json")
    assert report["batch_time_s"] == pytest.approx(0.2365772060365219, rel=EXACT)
    assert report["bubble_fraction"] == pytest.approx(0.25533445663329185, rel=EXACT)
    assert report["throughput_samples_s"] == pytest.approx(33.81559928797616, rel=EXACT)
    assert report["events"] == {"unique": 10, "total": 62}
    (s0, s1) = report["stages"]
    assert s0["compute_s"] == pytest.approx(0.15066988714670718, rel=EXACT)
    assert s0["idle_s"] == pytest.approx(0.08448875288981472, rel=EXACT)
    assert s1["compute_s"] == pytest.approx(0.19669593051602133, rel=EXACT)
    assert s1["end_s"] == pytest.approx(0.2131734718243002, rel=EXACT)
    assert s0["comm_s"] == pytest.approx(0.0014185660000000083, rel=1e-6)
    # the bootstrap is seeded: the same profile gives the same interval
    assert (report["batch_time_p5_s"], report["batch_time_p95_s"]) == pytest.approx(
        (0.22953993374886172, 0.2435269273028638), rel=EXACT)
    assert report["interval_resamples"] == 200


def test_validate_on_the_real_run(capsys):
    result = _json(analysis_main, capsys, "validate", str(TRACE), str(PROFILE), "--json")
    assert result["measured_batch_time_s"] == pytest.approx(0.22319313050000017, rel=EXACT)
    assert result["predicted_batch_time_s"] == pytest.approx(0.2365772060365219, rel=EXACT)
    assert result["batch_time_error_pct"] == pytest.approx(5.996634173524319, rel=EXACT)
    assert result["replay_error_pct"] == pytest.approx(-0.5867535761816115, rel=EXACT)
    assert result["measured_in_interval"] is False  # the run's 223.2 ms lies below the interval's 229.5 ms
    assert [d["error_pct"] for d in result["devices"]] == pytest.approx([-0.26815544944461367, 7.6786751033795175],
                                                                        rel=EXACT)
    assert len(result["layers"]) == 8 and len(result["measured_iteration_s"]) == 6
    assert [(r["measured_bytes"], r["predicted_bytes"]) for r in result["memory"]] == [(51792040, 51787776),
                                                                                        (44699764, 44699652)]


def test_show_on_the_real_profile(capsys, tmp_path):
    summary = _json(harness_main, capsys, "show", str(PROFILE), "--json", "--csv", str(tmp_path / "m.csv"))
    assert summary["schema_version"] == 2 and summary["environment"]["cpu_binding"] == "bound"
    by_name = {m["name"]: m for m in summary["measurements"]}
    assert len(by_name) == 11 and all(m["count"] == 10 for m in by_name.values())
    assert by_name["gpt2.block.fwd"]["median_s"] == pytest.approx(0.005613703, rel=EXACT)
    assert by_name["gpt2.block.bwd"]["ranks"] == [0]
    assert by_name["p2p 256KiB intra"]["median_s"] == pytest.approx(0.00018910850000000001, rel=EXACT)
    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert {r["name"] for r in rows} == set(by_name)
    assert float(next(r for r in rows if r["name"] == "gpt2.block.fwd")["median_s"]) == pytest.approx(0.005613703)


def test_the_terminal_report_on_the_real_profile(capsys):
    assert analysis_main(["simulate", str(PROFILE)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("batch time   236.577 ms (90% interval 229.540 ms to 243.527 ms, 5.9% wide, from the "
                        "profile's samples)")
    assert lines[4] == "memory       51.8 MB per device at most (stage 0, activations 17.3 MB)"
    assert len(lines) <= 12

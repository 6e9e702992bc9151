"""bench/peers.py calibrates llm-analysis from each job's own profile, as this project is calibrated: the FLOP rate
its compute reached and its measured link. Nothing here profiles, trains or needs llm-analysis."""
from __future__ import annotations

import pytest

from analysis.costs import estimate_costs
from analysis.profile_reader import layers_for, load_profile
from bench.peers import as_gpu, profile_figures
from harness.plan.events import build_plan
from tests.conftest import ROOT

DATA = ROOT / "tests" / "data"


def _fits(path):
    profile = load_profile(path)
    return estimate_costs(build_plan(profile.spec, layers_for(profile, profile.spec)), profile).fits


@pytest.mark.parametrize("name,link", [("pp2-profile.h5", ("p2p", "intra")),  # no all-reduce: the p2p fit
                                       ("dp2pp2-profile.h5", ("allreduce", "intra"))])
def test_the_peer_gets_the_rate_and_link_the_profile_measured(name, link):
    figures = profile_figures(DATA / name)
    fit = _fits(DATA / name)[link]
    assert figures["latency_s"] == fit.alpha_s and figures["bytes_per_s"] == pytest.approx(1 / fit.beta_s_per_byte)
    assert 1e9 < figures["flops_per_s"] < 1e12  # one CPU core's fp32, as the committed 2-rank profiles measured
    gpu = as_gpu(figures, memory_bytes_per_s=5e9)
    assert gpu["peak_fp16_TFLOPS"] == pytest.approx(figures["flops_per_s"] / 1e12)
    assert gpu["intra_node_bandwidth_in_GB_per_sec"] == pytest.approx(figures["bytes_per_s"] / 1e9)
    assert gpu["intra_node_min_message_latency"] == figures["latency_s"] and gpu["hbm_bandwidth_in_GB_per_sec"] == 5


def test_a_job_without_communication_gets_a_link_it_never_uses():
    gpu = as_gpu({"flops_per_s": 5e10, "latency_s": None, "bytes_per_s": None}, memory_bytes_per_s=4e9)
    assert gpu["intra_node_min_message_latency"] == 0 and gpu["intra_node_bandwidth_in_GB_per_sec"] == 4

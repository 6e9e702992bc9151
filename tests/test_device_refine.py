"""`python -m analysis device PROFILE.h5`: a device description refined on a profile's own compute events
(analysis.device_refine), pinned on the committed CPU profile and CPU description (tests/data/README.md)."""
from __future__ import annotations

import json
import math
import tomllib

import pytest

from analysis.device_model import DeviceModel
from analysis.device_refine import (
    HOST,
    LAUNCH,
    MIN_EVENTS,
    RefineEvent,
    coordinate_search,
    figure_name,
    figure_of,
    figure_shares,
    profile_events,
    refine,
    with_figures,
)
from analysis.profile_reader import load_profile
from harness.common.errors import UserError
from harness.plan.device import load_device, parse_device
from harness.plan.kernels import Gemm, MemoryBound
from tests.helpers import write_spec
from tests.test_analysis_helpers import REPO, run_analysis

PROFILE = REPO / "tests" / "data" / "pp2-profile.h5"
CPU = REPO / "tests" / "data" / "cpu-device.toml"


def test_the_profiles_events_are_its_measured_forwards_and_backwards():
    events = profile_events(load_profile(PROFILE))
    assert [e.name for e in events] == ["gpt2.embedding.fwd", "gpt2.embedding.bwd", "gpt2.block.fwd",
                                        "gpt2.block.bwd", "gpt2.head.fwd", "gpt2.head.bwd"]
    # the cost chain's measured seconds (rank speed applied), not the optimizer step; a CPU profile issues nothing
    assert [round(e.measured_s * 1e3, 4) for e in events] == [0.211, 0.5176, 6.1437, 11.7568, 3.8449, 7.1253]
    assert all(e.host_issue_s == 0 for e in events)


def test_an_events_wrappers_are_modelled_as_the_cost_chain_models_them():
    """A refinement's event carries what DeviceModel.wrappers_of reads (its phase, its layer's signature, the
    run's wrapper keys), so a selective-recompute block pays its checkpoint here as in a prediction (on a CPU), and
    the curves are not refitted to absorb it."""
    import dataclasses

    from harness.plan.device import WrapperCost

    events = profile_events(load_profile(PROFILE))
    assert all(dict(e.wrapped).keys() >= {"phase", "signature"} for e in events)
    cpu = load_device(str(CPU))
    wrapped = DeviceModel(dataclasses.replace(cpu, wrappers={"checkpointed": WrapperCost(100e-6, 300e-6)}))
    block = next(e for e in events if e.name == "gpt2.block.bwd")
    selective = dataclasses.replace(block, wrapped=(("phase", "bwd"), ("signature", {"recompute": "selective"})))
    assert selective.modelled_s(wrapped) == pytest.approx(block.modelled_s(DeviceModel(cpu)) + 300e-6)
    assert block.modelled_s(wrapped) == pytest.approx(block.modelled_s(DeviceModel(cpu)))  # not recomputed


def test_refining_the_cpu_description_on_the_pp2_profile():
    refinement = refine(load_device(str(CPU)), profile_events(load_profile(PROFILE)), source="pp2")
    assert refinement.median_abs_pct("before") == pytest.approx(10.760, abs=1e-3)
    assert refinement.median_abs_pct("after") == pytest.approx(3.739, abs=1e-3)
    moved = {figure_name(key): (round(was, 4), round(now, 4)) for key, (was, now) in refinement.figures.items()}
    # the memory-bound kernels of a layer in a run take 1.3x the calibration's bare ones (1.6x before the
    # embedding's own operations were listed, 5x before the backward's gradient accumulation, which the profile's
    # samples run every time); the embedding's forward, all memory-bound, was 64% short before (57% with its
    # positions counted a token each, 75% with one lookup)
    assert moved == {"efficiency.gemm.max_fraction": (1.0, 0.9346),
                     "efficiency.gemm.half_at": (929386.3863, 2091119.3693),
                     "efficiency.memory.max_fraction": (0.9366, 0.7006)}
    refined = refinement.refined
    assert refined.name == "device-refined" and refined.fitted and "refined on pp2's 6 compute events" in \
        refined.fitted_on and refined.fitted_on.startswith("harness device 2026-12-05")
    assert parse_device(tomllib.loads(refined.to_toml())) == refined
    # every other figure as the calibration wrote it
    base = load_device(str(CPU))
    assert refined.curves["sdpa_forward"] == base.curves["sdpa_forward"] and refined.launch_s == base.launch_s
    assert refined.optimizer == base.optimizer and refined.vector_ops == base.vector_ops


def test_a_figure_the_events_cannot_see_stays():
    """Only GEMMs: the memory curve, the attention curves and (at these sizes) the launch hold under 5% of the
    modelled time, so only the GEMM curve moves."""
    base = load_device("a100-80gb")
    gemm = Gemm("g", 4096, 4096, 4096, "bfloat16")
    device = DeviceModel(base)
    events = [RefineEvent(f"e{i}", f"gemm x{i}", (gemm,) * i, device.event_seconds((gemm,) * i) * 1.25)
              for i in (1, 2, 3)]
    shares = figure_shares(device, events)
    assert shares[("gemm", "max_fraction")] > 0.99 and shares[("memory", "max_fraction")] == 0
    refinement = refine(base, events)
    assert set(refinement.figures) == {("gemm", "max_fraction"), ("gemm", "half_at")}
    assert refinement.median_abs_pct("before") == pytest.approx(20.0)  # the model at 1 / 1.25 of each event
    assert refinement.median_abs_pct("after") < 1.0


def test_a_gpu_profiles_host_issue_gives_the_hosts_time_a_kernel():
    """[host] kernel_issue_us: the events' issue seconds over their launches on the description (each kernel one
    launch here): 3 events of 2, 4 and 6 GEMMs issued in 60, 120 and 180 us: 30 us a kernel."""
    base = load_device("a100-80gb")
    gemm = Gemm("g", 1024, 1024, 1024, "bfloat16")
    device = DeviceModel(base)
    events = [RefineEvent(f"e{n}", f"x{n}", (gemm,) * n, device.event_seconds((gemm,) * n), n * 30e-6)
              for n in (2, 4, 6)]
    refinement = refine(base, events)
    assert refinement.refined.kernel_issue_s == pytest.approx(30e-6)
    assert refinement.figures[(HOST, "kernel_issue_us")] == (0.0, pytest.approx(30.0))


def test_the_profiles_engine_gaps_give_the_step_gap():
    """[host] step_gap_us: the mean of the gaps the profile measured between two steps (F->B, B->F, F->F, B->B), in
    microseconds; the iteration's start and end and the optimizer's gap are not between steps; none measured: none."""
    base = load_device("a100-80gb")
    gemm = Gemm("g", 1024, 1024, 1024, "bfloat16")
    device = DeviceModel(base)
    events = [RefineEvent(f"e{n}", f"x{n}", (gemm,) * n, device.event_seconds((gemm,) * n)) for n in (2, 4, 6)]
    gaps = {"F->B": 1e-4, "B->F": 3e-4, "F->F": 2e-4, "B->B": 2e-4, "start": 9e-3, "end": 5e-3, "B->opt": 7e-3}
    refinement = refine(base, events, engine_gaps=gaps)
    assert refinement.refined.step_gap_s == pytest.approx(2e-4)
    assert refinement.figures[(HOST, "step_gap_us")] == (0.0, pytest.approx(200.0))
    assert refine(base, events, engine_gaps={}).refined.step_gap_s == 0.0
    assert refine(base, events, engine_gaps={"start": 1e-3}).refined.step_gap_s == 0.0


def test_the_search_takes_only_moves_that_gain_and_keeps_under_its_ceiling():
    # a bowl at x = 8, y = 1 (log scale), x capped at 4: y 3 -> 1.5 -> 0.75 by halves, then up by 1.1 three times
    def score(figures):
        return (math.log(figures["x"] / 8)) ** 2 + (math.log(figures["y"])) ** 2

    figures, best = coordinate_search({"x": 1.0, "y": 3.0}, score, steps=(2.0, 1.1),
                                      ceilings={"x": 4.0, "y": math.inf})
    assert figures["x"] == pytest.approx(4.0) and figures["y"] == pytest.approx(3.0 / 2 / 2 * 1.1 ** 3)
    assert best == pytest.approx(score(figures))
    stopped, _ = coordinate_search({"x": 1.0, "y": 1.0}, score, steps=(2.0,), ceilings={"x": math.inf, "y": math.inf},
                                   min_gain=10.0)
    assert stopped == {"x": 1.0, "y": 1.0}


def test_figures_by_key_read_and_write_the_description():
    base = load_device("a100-80gb")
    changed = with_figures(base, {("gemm", "max_fraction"): 1.5, (LAUNCH, "us"): 7.0, (HOST, "kernel_issue_us"): 9.0})
    assert changed.curves["gemm"].max_fraction == 1.0  # a fraction is capped at 1
    assert figure_of(changed, (LAUNCH, "us")) == pytest.approx(7.0) and changed.kernel_issue_s == pytest.approx(9e-6)
    assert not changed.fitted and with_figures(base, {}, "x").fitted_on == "x"
    assert [figure_name(k) for k in ((LAUNCH, "us"), (HOST, "kernel_issue_us"), ("gemm", "half_at"))] == \
        ["efficiency.launch_us", "host.kernel_issue_us", "efficiency.gemm.half_at"]


def test_too_few_events_are_refused():
    base = load_device("a100-80gb")
    kernel = MemoryBound("m", 1e6, "bfloat16", op="copy")
    events = [RefineEvent("a", "a", (kernel,), 1e-3)] * (MIN_EVENTS - 1)
    with pytest.raises(UserError, match=f"needs at least {MIN_EVENTS}"):
        refine(base, events, source="tiny.h5")


def test_analysis_device_command_writes_a_description_a_spec_alone_runs_on(tmp_path):
    out = tmp_path / "mine.toml"
    result = run_analysis("device", str(PROFILE), "--device", str(CPU), "-o", str(out), "--quiet")
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first == f"device refined on {PROFILE}'s 6 compute events: median |error| 10.8% -> 3.7%"
    assert "efficiency.memory.max_fraction" in result.stdout and "gpt2.block.bwd" in result.stdout
    written = load_device(str(out))
    assert written.name == "mine" and written.curves["memory"].max_fraction == pytest.approx(0.70063, abs=1e-5)
    assert out.read_text().startswith("# mine: device refined on")
    spec = write_spec(tmp_path / "job.toml")
    spec.write_text(spec.read_text().replace("[cluster]", f'[cluster]\ndevice = "{out}"'))
    simulated = run_analysis("simulate", str(spec), "--json")
    assert simulated.returncode == 0, simulated.stderr
    assert json.loads(simulated.stdout)["batch_time_s"] > 0
    data = json.loads(run_analysis("device", str(PROFILE), "--device", str(CPU), "--json").stdout)
    assert data["version"] == 1 and data["written"] is None and len(data["events"]) == 6
    assert data["median_abs_error_after_pct"] == pytest.approx(3.739, abs=1e-3)
    assert set(data["events"][0]) == {"id", "name", "measured_s", "before_s", "after_s", "host_issue_s"}


@pytest.mark.parametrize("args, message", [
    ([], "names no [cluster] device and no --device was given"),
    (["--device", "a100-80gb"], "was measured on a CPU, and the description 'a100-80gb' describes a GPU"),
    (["--device", "z900"], "--device: unknown device 'z900'"),
    (["--device", str(CPU), "-o", "refined.txt"], "-o refined.txt: a device description is a .toml file"),
])
def test_analysis_device_bad_input(args, message):
    result = run_analysis("device", str(PROFILE), *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr

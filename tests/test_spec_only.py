"""A spec in place of a profile (issue 43): simulate and search from the spec's device and network models alone,
a profile beside a spec mixing sources, the refusals, and the memory's fallback to the activation formulas."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.costs import estimate_costs
from analysis.costs.device_source import DEVICE
from analysis.memory import (
    activation_bytes,
    estimate_memory,
    gradient_bytes,
    in_flight_floor,
    model_state_bytes,
    model_state_floor,
    released_bytes,
)
from analysis.predict import predict_spec
from analysis.profile_reader import load_profile
from analysis.search import search
from analysis.spec_only import is_spec_file, spec_profile
from harness.common.errors import UserError
from harness.plan.activations import formula_activation_bytes
from harness.plan.events import COMM_KINDS, build_plan
from harness.plan.spec import load_spec, loads_spec
from tests.helpers import tiny_spec_text

DATA = Path(__file__).parent / "data"
NETWORK = """
[[cluster.network]]
name = "nvlink"
size = 4
bandwidth_gbs = 300
latency_us = 10

[[cluster.network]]
name = "ib"
size = 1024
bandwidth_gbs = 25
"""
MEMORY_KEYS = ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "total_bytes")


def spec_text(device: str | None = "a100-80gb", network: bool = True, **kwargs) -> str:
    """A tiny GPT-2 on 2 nodes of 4 (dp 2, tp 2, pp 2 by default) with the device and the network's tiers."""
    options = {"dp": 2, "tp": 2, "pp": 2, "nodes": 2, "gpus_per_node": 4, **kwargs}
    text = tiny_spec_text(**options)
    if device:
        text = text.replace(f"gpus_per_node = {options['gpus_per_node']}\n",
                            f"gpus_per_node = {options['gpus_per_node']}\ndevice = \"{device}\"\n")
    return text + (NETWORK if network else "")


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def analysis(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_simulate_from_a_spec_alone(tmp_path, project_env):
    spec = write(tmp_path, spec_text())
    done = analysis("simulate", str(spec), "--json", env=project_env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["batch_time_s"] > 0 and report["profile"] is None and report["spec"] == str(spec)
    assert report["memory"]["peak_bytes"] > 0
    for stage in report["memory"]["stages"]:
        assert all(stage[key] > 0 for key in MEMORY_KEYS)
        assert stage["total_bytes"] >= sum(stage[key] for key in MEMORY_KEYS[:4])
    assert report["memory"]["unmeasured_activations"] == []
    if report["batch_time_p5_s"] is not None:  # no samples: only the device model's held-out residuals give one
        assert report["interval_model_residuals"]
    events = report["event_sources"]
    assert events and {e["source"] for e in events if e["kind"] == "compute"} == {DEVICE}
    assert {e["source"] for e in events if e["kind"] in COMM_KINDS} == {"network"}
    assert set(report["sources"]) == {"compute", "communication"}
    modelled = report["device_model"]
    assert modelled["device"] == "a100-80gb" and len(modelled["events"]) == report["sources"]["compute"][DEVICE]
    assert all(e["kernels"] and e["note"].startswith("device model (a100-80gb)") for e in modelled["events"])
    table = analysis("simulate", str(spec), "--details", "--resamples", "0", env=project_env)
    assert table.returncode == 0, table.stderr
    assert "interval     none: no profile samples" in table.stdout
    assert "from the device model (a100-80gb)" in table.stdout
    assert "device model (a100-80gb, " in table.stdout  # --details' kernel table


def test_search_from_a_spec_alone(tmp_path, project_env):
    spec = write(tmp_path, spec_text() + "\n[search]\ntp = [1, 2]\npp = [1, 2]\nmicro = [1, 2]\n")
    done = analysis("search", str(spec), "--json", "--quiet", "--jobs", "1", env=project_env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["profile"] is None and result["spec"] == str(spec)
    predicted = [c for c in result["candidates"] if c["batch_time_s"] is not None]
    pruned = [c for c in result["candidates"] if c["pruned"]]  # out of the fastest's reach, by their least time
    assert len(predicted) + len(pruned) == len(result["candidates"]) >= 4 and predicted
    assert all(c["least_batch_time_s"] > 1.25 * result["best"]["batch_time_s"] for c in pruned)
    for candidate in predicted:
        assert set(candidate["sources"]["compute"]) == {DEVICE}
        assert set(candidate["sources"].get("communication", {"network": 1})) == {"network"}
        assert candidate["peak_memory_bytes"] > 0 and candidate["memory_stages"][0]["activations_bytes"] > 0
        assert any("from the device model (a100-80gb)" in flag for flag in candidate["flags"])


def test_a_profile_beside_a_spec_costs_what_it_measured(tmp_path, project_env):
    """The committed pp2 profile beside its spec with a device and dp 2: its layers at micro 2 measured, the
    same layers' other passes and the gradient all-reduce modelled."""
    text = (DATA / "pp2.toml").read_text().replace("gpus_per_node = 2", "gpus_per_node = 4\ndevice = \"a100-80gb\"")
    text = text.replace("dp = 1", "dp = 2").replace("global = 8", "global = 16")
    spec = write(tmp_path, text)
    done = analysis("simulate", str(spec), "--profile", str(DATA / "pp2-profile.h5"), "--json", "--resamples", "20",
                    env=project_env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["profile"] == str(DATA / "pp2-profile.h5")
    compute = report["sources"]["compute"]
    assert compute.get("measured", 0) > 0 and compute.get(DEVICE, 0) == 0  # every layer's pass at micro 2 measured
    assert "network" in report["sources"]["communication"] or "fit" in report["sources"]["communication"]
    # another micro-batch size: the profile has none of its compute, the device model costs it all
    spec_micro = write(tmp_path, text.replace("micro = 2", "micro = 4"), "micro4.toml")
    mixed = predict_spec(load_spec(spec_micro, import_factory=False), load_profile(DATA / "pp2-profile.h5"),
                         resamples=0)
    sources = {c.source for c in mixed.costs.events.values() if c.kind == "compute"}
    assert DEVICE in sources and mixed.timeline.batch_time_s > 0
    measured = predict_spec(load_spec(spec, import_factory=False), load_profile(DATA / "pp2-profile.h5"),
                            resamples=0)
    assert all(c.source != DEVICE for c in measured.costs.events.values())
    # the harness's loop timed the measured events between synchronizations: its host waits after a collective
    # wherever a compute event was measured; only a job costed from the description alone runs as Megatron does
    assert measured.costs.host_waits_on_collectives
    assert mixed.costs.host_waits_on_collectives == (sources != {DEVICE})
    # a CPU's measurements beside a GPU's description: said, in the costs' warnings and on stderr
    assert any("pp2-profile.h5 was measured on a CPU" in w and "a100-80gb is a GPU" in w for w in report["warnings"])
    assert "WARNING: pp2-profile.h5 was measured on a CPU" in done.stderr


@pytest.mark.parametrize("text,extra,message", [
    (spec_text(device=None), (), "no profile and no \\[cluster\\] device"),
    (spec_text(network=False), (), "no profile and no \\[\\[cluster.network\\]\\]"),
    (spec_text(device="a100-81gb"), (), "unknown device 'a100-81gb'"),
    (spec_text(), ("--spec", "other.toml"), "is a spec already"),
])
def test_a_spec_alone_is_refused_without_what_it_needs(tmp_path, project_env, text, extra, message):
    spec = write(tmp_path, text)
    for command in ("simulate", "search"):
        done = analysis(command, str(spec), *extra, *(("--quiet",) if command == "search" else ()), env=project_env)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert re.search(message, done.stderr), done.stderr


def test_profile_beside_a_profile_is_refused(project_env):
    done = analysis("simulate", str(DATA / "pp2-profile.h5"), "--profile", str(DATA / "pp2-profile.h5"),
                    env=project_env)
    assert done.returncode == 2 and "is a profile already" in done.stderr


def test_one_device_needs_no_network():
    spec = loads_spec(spec_text(network=False, dp=1, tp=1, pp=1, nodes=1, gpus_per_node=1))
    prediction = predict_spec(spec)
    assert prediction.timeline.batch_time_s > 0
    assert prediction.interval is None or prediction.interval.sampling is None  # no samples to resample
    assert {c.source for c in prediction.costs.events.values()} == {DEVICE}


def test_a_spec_alone_costs_its_communication_from_collective_benchmarks(tmp_path, project_env):
    """--collectives beside a spec without [[cluster.network]]: its all-reduces interpolated on the benchmark's points
    (whatever backend took them), linear here at 1 ns a byte; a size outside them fitted on them."""
    import numpy as np

    from harness.plan.collectives import SizeResult
    from harness.store.collectives_file import CollectivesRun, write_collectives

    spec_path = write(tmp_path, spec_text(network=False, dp=2, tp=1, pp=1, nodes=1, gpus_per_node=2))
    spec = load_spec(spec_path)
    with pytest.raises(UserError, match=r"--collectives FILE.h5"):
        predict_spec(spec)
    sizes = (1_000, 10_000_000_000)
    results = {"allreduce": [SizeResult("allreduce", n, "float32", 2, np.array([n * 1e-9] * 3), 0) for n in sizes]}
    bench = tmp_path / "bench.h5"
    write_collectives(bench, CollectivesRun(bench, "nccl", "all", "intra", [0, 1], "float32", 3, 1, results,
                                            {"device": "cuda"}))
    prediction = predict_spec(spec, collectives=[bench])
    plan, costs = prediction.plan, prediction.costs
    allreduces = [eid for eid, e in plan.events.items() if e.kind == "allreduce"]
    assert allreduces
    for eid in allreduces:
        assert costs.events[eid].source == "interpolated"
        assert costs.events[eid].seconds == pytest.approx(plan.events[eid].bytes * 1e-9, rel=1e-6)
    done = analysis("simulate", str(spec_path), "--collectives", str(bench), "--json", env=project_env)
    assert done.returncode == 0, done.stderr
    sources = {e["source"] for e in json.loads(done.stdout)["event_sources"] if e["kind"] in COMM_KINDS}
    assert sources == {"interpolated"}


def test_the_device_benchs_in_context_collectives_become_a_benchmark_file(tmp_path):
    """bench/device_model.py's "per kind" column: harness device's in-context rows as a collectives file, each kind
    its own points (bytes, ranks, seconds) as analysis.collectives reads them for a spec alone."""
    from analysis.collectives import load, profile_points
    from bench.device_model import kinds_collectives

    rows = [{"op": op, "bytes": n, "ranks": 2, "in_context_s": t, "back_to_back_s": t / 2}
            for op, n, t in (("allreduce", 1024, 1e-3), ("allreduce", 4096, 2e-3), ("reducescatter", 4096, 5e-3))]
    path = kinds_collectives(rows, tmp_path / "c.h5")
    points = profile_points(load([path]), None, "cpu", "SPEC")
    assert points == {("allreduce", "intra"): [(1024.0, 2, 1e-3), (4096.0, 2, 2e-3)],
                      ("reducescatter", "intra"): [(4096.0, 2, 5e-3)]}


def cpu_residuals_file(path: Path, errors_pct: list[float], seed: int = 7) -> Path:
    """A residuals file of one bench/device_model.py run: one job a pair error."""
    path.write_text(json.dumps({
        "kind": "distsim-model-residuals", "version": 1, "what": "test",
        "command": "python bench/device_model.py --seed SEED --jobs 8 --rounds 2 --residuals",
        "devices": {"cpu": {"machine": "test", "runs": [
            {"run": f"dm seed {seed}", "seed": seed, "date": "2026-12-06",
             "jobs": [{"job": f"job{i}", "pair_error_pct": [e]} for i, e in enumerate(errors_pct)]}]}}}))
    return path


def test_a_cpu_description_draws_its_interval_from_cpu_spec_only_runs(tmp_path, monkeypatch):
    """The published spec-only runs are A100 runs: a spec alone on a GPU description draws its interval from them; on
    a CPU description (processor = "cpu", as harness device writes on a CPU) from bench/device_model.py's CPU pairs,
    the batch time times their 5th, 50th and 95th percentile of run / prediction, and none without that file."""
    from analysis import uncertainty
    from harness.plan.device import load_device

    gpu = predict_spec(loads_spec(spec_text()))
    assert gpu.interval is not None and "CUDA runs of bench/published.py" in gpu.interval.residuals
    cpu = write(tmp_path, load_device("a100-80gb").to_toml().replace('title = "', 'processor = "cpu"\ntitle = "'),
                "cpu.toml")
    errors = [-20.0, -10.0, 0.0, 10.0, 25.0]
    monkeypatch.setattr(uncertainty, "CPU_SPEC_ONLY_RESIDUALS_PATH", cpu_residuals_file(tmp_path / "r.json", errors))
    prediction = predict_spec(loads_spec(spec_text(device=str(cpu))))
    assert prediction.costs.device_model.description.processor == "cpu"
    T = prediction.timeline.batch_time_s
    assert T == pytest.approx(gpu.timeline.batch_time_s)  # the same figures
    ratios = [1 / (1 + e / 100) for e in errors]
    interval = prediction.interval
    assert (interval.p5_s, interval.p50_s, interval.p95_s) == pytest.approx(
        [T * float(v) for v in np.percentile(ratios, [5, 50, 95])])
    assert interval.p5_s == pytest.approx(T * (0.8 + 0.2 * (1 / 1.1 - 0.8)))  # by hand: 0.2 of the first gap
    assert "5 held-out CPU runs of bench/device_model.py (seeds 7" in interval.residuals
    monkeypatch.setattr(uncertainty, "CPU_SPEC_ONLY_RESIDUALS_PATH", tmp_path / "none.json")
    assert predict_spec(loads_spec(spec_text(device=str(cpu)))).interval is None


def test_the_device_benchs_interval_is_held_out_by_seed(tmp_path):
    """bench/device_model.py holds a run's pairs against the interval of the residuals file's other seeds, and
    --residuals writes the run's pairs as one entry, a seed's earlier entry replaced."""
    from analysis.calibration import model_residuals
    from bench.device_model import held_out_ratios, interval_coverage, residuals_document, residuals_text

    path = cpu_residuals_file(tmp_path / "r.json", [-20.0, -10.0, 0.0, 10.0, 25.0], seed=7)
    assert held_out_ratios(path, 7).size == 0
    ratios = held_out_ratios(path, 8)
    assert sorted(ratios) == pytest.approx(sorted(1 / (1 + e / 100) for e in (-20.0, -10.0, 0.0, 10.0, 25.0)))
    low, high = np.percentile(ratios, [5, 95])
    rows = [{"name": "a", "pairs": [{"predicted_s": 1.0, "measured_s": low * 1.0001, "error_pct": 0.0},
                                    {"predicted_s": 1.0, "measured_s": high * 1.01, "error_pct": 0.0}]},
            {"name": "b", "pairs": [{"predicted_s": 2.0, "measured_s": 2.0, "error_pct": 0.0}]}]
    held = interval_coverage(rows, ratios)
    assert (held["pairs"], held["inside"], held["residuals"]) == (3, 2, 5)
    assert held["coverage_pct"] == pytest.approx(200 / 3)
    assert interval_coverage(rows, np.array([]))["coverage_pct"] is None
    result = {"seed": 8, "machine": "here", "spec_only": {"rows": [
        {"name": "job a", "pairs": [{"error_pct": -12.345}, {"error_pct": 3.0}]}, {"name": "failed", "pairs": []}]}}
    document = residuals_document(path, result)
    runs = document["devices"]["cpu"]["runs"]
    assert [r["seed"] for r in runs] == [7, 8]
    assert runs[1]["jobs"] == [{"job": "job a", "pair_error_pct": [-12.35, 3.0]}]
    path.write_text(json.dumps(document))
    later = {"rows": [{"name": "job b", "pairs": [{"error_pct": 1.0}]}]}
    again = residuals_document(path, {**result, "spec_only": later})
    assert [r["seed"] for r in again["devices"]["cpu"]["runs"]] == [7, 8]
    assert again["devices"]["cpu"]["runs"][1]["jobs"][0]["job"] == "job b"
    path.write_text(residuals_text(again))  # a job a line, the same document
    assert json.loads(path.read_text()) == again
    assert '{"job": "job b", "pair_error_pct": [1.0]}' in path.read_text()
    model_residuals.cache_clear()
    assert len(model_residuals("cpu", path).ratios) == 6
    fresh = residuals_document(tmp_path / "new.json", result)
    assert fresh["kind"] == "distsim-model-residuals" and fresh["devices"]["cpu"]["machine"] == "here"


def test_the_device_bench_writes_no_residuals_from_a_quick_run(capsys):
    """A --quick calibration is rough: its pairs' errors are not the model's, so --residuals refuses it (exit 2)."""
    from bench.device_model import parse_args

    with pytest.raises(SystemExit) as refused:
        parse_args(["--quick", "--residuals"])
    assert refused.value.code == 2 and "--residuals takes a full run's pairs" in capsys.readouterr().err
    assert parse_args(["--residuals", "--seed", "5"]).residuals


def test_a_factory_model_alone_is_refused():
    text = spec_text(tp=1, dp=4).replace('name = "gpt2-small"', 'factory = "tests.user_model:build"')
    spec = loads_spec(text, import_factory=False)
    with pytest.raises(UserError, match="factory model's layers are its own code"):
        predict_spec(spec)


def test_spec_files_are_told_from_profiles(tmp_path):
    assert is_spec_file(tmp_path / "job.toml") and not is_spec_file(DATA / "pp2-profile.h5")
    other = write(tmp_path, spec_text(), "job.spec")
    assert is_spec_file(other)  # not HDF5 by its first bytes
    assert not is_spec_file(tmp_path)  # a folder: an OUTDIR of harness profile


def test_memory_falls_back_to_the_formulas_and_the_measurement_wins():
    """On the committed profile the formulas give exactly what the meter measured (float32 GPT-2, pp 2), so the
    memory from the spec alone is the profile's; a measurement that differs replaces the formula."""
    profile = load_profile(DATA / "pp2-profile.h5")
    plan = build_plan(profile.spec)
    measured = activation_bytes(profile)
    formulas = formula_activation_bytes(plan)
    assert measured and set(measured) <= set(formulas)
    assert all(formulas[eid] == measured[eid] for eid in measured)
    from_profile = estimate_memory(plan, measured, released_bytes(profile))
    from_spec = estimate_memory(plan, {})
    assert [s.to_dict() for s in from_spec.stages] == [s.to_dict() for s in from_profile.stages]
    assert from_spec.unmeasured == []
    block = next(eid for eid in measured if plan.events[eid].name.endswith("block.fwd"))
    larger = estimate_memory(plan, {**measured, block: measured[block] + 10_000})
    assert larger.peak_bytes > from_profile.peak_bytes  # the measurement wins over the formula


def test_megatron_mixed_precision_model_states():
    """master_weights = true: 2 (bf16 weights) + 4 (fp32 main gradients) + 4 (master) + 8 (Adam) = 18 bytes a
    parameter; with the distributed optimizer (zero = 1) the 12 of master and Adam sharded over dp."""
    base = spec_text(dp=4, tp=1, pp=1, nodes=1, gpus_per_node=4).replace('dtype = "float32"', 'dtype = "bfloat16"')
    text = base + "\n[optimizer]\nname = \"adam\"\nmaster_weights = true\n"
    spec = loads_spec(text)
    assert gradient_bytes(spec) == 4
    plan = build_plan(spec)
    (stage,) = estimate_memory(plan, {}).stages
    params = sum(layer.params for layer in plan.layers)
    assert (stage.weights, stage.gradients, stage.optimizer) == (2 * params, 4 * params, 12 * params)
    distributed = build_plan(loads_spec(text.replace("schedule = ", "zero = 1\nschedule = ")))
    (sharded,) = estimate_memory(distributed, {}).stages
    assert (sharded.weights, sharded.gradients) == (2 * params, 4 * params)
    assert sharded.optimizer == 12 * -(-params // 4)


def test_the_device_source_costs_every_compute_event_of_a_spec_alone():
    spec = loads_spec(spec_text())
    plan = build_plan(spec)
    costs = estimate_costs(plan, spec_profile(spec))
    compute = [c for c in costs.events.values() if c.kind == "compute"]
    assert compute and all(c.source == DEVICE and c.seconds > 0 for c in compute)
    assert set(costs.device_kernels) == {c.id for c in compute}
    for cost in compute:  # the note's time is the kernels' sum
        assert cost.seconds == pytest.approx(sum(k["seconds"] for k in costs.device_kernels[cost.id].breakdown()))
    block = next(c for c in compute if c.name.endswith("block.fwd"))
    assert "GEMM" in block.note and "of the float32 matrix peak" in block.note


def test_a_spec_alone_enqueues_its_collectives_without_the_hosts_wait(tmp_path):
    """Megatron-LM enqueues its tensor-parallel all-reduces and issues on; the harness's train loop (what a profile
    measured) synchronizes after each. With a host slower than the device, the wait would cost each collective's
    time again on the host."""
    import dataclasses

    from analysis.simulate import batch_time
    from harness.plan.device import load_device

    described = dataclasses.replace(load_device("a100-80gb"), name="a100-host-bound-test", kernel_issue_s=200e-6)
    path = write(tmp_path, described.to_toml(), "a100-host.toml")
    spec = loads_spec(spec_text(device=str(path)))
    plan = build_plan(spec)
    costs = estimate_costs(plan, spec_profile(spec))
    assert costs.host_issue and not costs.host_waits_on_collectives
    assert any(layer == -1 for program in plan.stages for layer in program.forward_layers)  # inline collectives
    free = batch_time(plan, costs)
    costs.host_waits_on_collectives = True
    assert batch_time(plan, costs) > free + 1e-5  # each wait costs its collective on the host (10 us or so)
    assert predict_spec(spec, resamples=0).timeline.batch_time_s == pytest.approx(free)


def test_the_host_issues_each_inline_collective_in_the_descriptions_time(tmp_path):
    """[host] collective_issue_us: a host-bound spec alone pays it once an inline collective, on the host's track
    (played as a compute event's issue time is), nothing where the description gives none."""
    import dataclasses

    from analysis.simulate import batch_time
    from harness.plan.device import load_device

    described = dataclasses.replace(load_device("a100-80gb"), name="a100-collective-issue-test", kernel_issue_s=200e-6)
    plain = write(tmp_path, described.to_toml(), "plain.toml")
    issuing = write(tmp_path, dataclasses.replace(described, collective_issue_s=1e-3).to_toml(), "issuing.toml")
    layout = {"pp": 1, "nodes": 1, "gpus_per_node": 4}  # one stage: its steps one after another
    spec = loads_spec(spec_text(device=str(plain), **layout))
    plan = build_plan(spec)
    inline = sum(layer == -1 for layer in plan.stages[0].forward_layers + plan.stages[0].backward_layers)
    costs = estimate_costs(plan, spec_profile(spec))
    assert costs.collective_issue_s == 0.0 and inline > 0
    slow_spec = loads_spec(spec_text(device=str(issuing), **layout))
    slow_plan = build_plan(slow_spec)
    slow = estimate_costs(slow_plan, spec_profile(slow_spec))
    assert slow.collective_issue_s == pytest.approx(1e-3)
    # every collective's millisecond on the host, the device far ahead of it
    assert batch_time(slow_plan, slow) - batch_time(plan, costs) == pytest.approx(inline * spec.micro_batches * 1e-3,
                                                                                  rel=0.05)


def test_a_pipeline_send_posts_waits_and_takes_compute_as_the_description_says(tmp_path):
    """[host] p2p_post_us, p2p_sender_busy_us and p2p_late_us (each with its _per_mib): a spec alone gives each
    pipeline send (pp = 2: the activation and its gradient) its post, its wait for a computing sender and the
    compute a late receive takes, each at the send's bytes, and its batch time grows; a description without them,
    none; a figure already there (a profile's measurement) stays. (The activation and its gradient are one event
    here: the same bytes between the same devices.)"""
    import dataclasses

    from analysis.costs.device_source import price_pipeline_sends
    from analysis.simulate import batch_time
    from harness.plan.device import load_device

    described = dataclasses.replace(load_device("a100-80gb"), name="a100-p2p-test")
    plain = write(tmp_path, described.to_toml(), "plain.toml")
    figures = dataclasses.replace(described, p2p_post_s=1e-4, p2p_post_s_per_mib=2e-4, p2p_sender_busy_s=3e-4,
                                  p2p_sender_busy_s_per_mib=1e-4, p2p_late_s=2e-4, p2p_late_s_per_mib=5e-5)
    sending = write(tmp_path, figures.to_toml(), "sending.toml")
    spec, slow_spec = (loads_spec(spec_text(device=str(path))) for path in (plain, sending))
    plan, slow_plan = build_plan(spec), build_plan(slow_spec)
    costs, slow = estimate_costs(plan, spec_profile(spec)), estimate_costs(slow_plan, spec_profile(slow_spec))
    sends = {eid for program in plan.stages for eid in (program.send_forward, program.send_backward) if eid}
    assert sends and all(plan.events[eid].kind == "p2p" for eid in sends)
    assert not costs.send_post and not costs.sender_busy_extra and not costs.late_transfer_cpu
    for eid in sends:
        mib = plan.events[eid].bytes / (1 << 20)
        assert slow.send_post[eid] == pytest.approx(1e-4 + 2e-4 * mib)
        assert slow.sender_busy_extra[eid] == pytest.approx(3e-4 + 1e-4 * mib)
        assert slow.late_transfer_cpu[eid] == pytest.approx(2e-4 + 5e-5 * mib)
    assert batch_time(slow_plan, slow) > batch_time(plan, costs)
    measured = dict.fromkeys(sends, 7e-3)
    costs.send_post.update(measured)
    price_pipeline_sends(plan, costs, figures)
    assert costs.send_post == measured and set(costs.late_transfer_cpu) == sends


@pytest.mark.parametrize("layout, kinds", [({}, {"allreduce"}),
                                           ({"tp": 1, "cp": 2, "seq": 32}, {"p2p"}),
                                           ({"tp": 1, "cp": 2, "seq": 32, "cp_comm": "allgather"},
                                            {"allgather", "reducescatter"})], ids=["tp", "cp-ring", "cp-allgather"])
def test_an_exchange_in_a_layers_pass_costs_the_descriptions_wait_a_call(tmp_path, layout, kinds):
    """[host] inline_collective_us: a spec alone prices each exchange of a layer's pass (a `tp.` collective, a
    context-parallel ring's send or its all-gather and reduce-scatter; the network model's) at that a call, a
    collective plus its bytes' time on the network model (its estimate less one byte's), a ring's send without
    (its bytes behind its step's compute); the data-parallel and pipeline events, and a description without the
    figure, keep the network model's."""
    import dataclasses

    from analysis.costs.records import MODELLED
    from analysis.network import network_op, spec_network
    from harness.plan.device import load_device

    described = dataclasses.replace(load_device("a100-80gb"), name="a100-inline-test")
    plain = write(tmp_path, described.to_toml(), "plain.toml")
    waiting = write(tmp_path, dataclasses.replace(described, inline_collective_s=1e-3).to_toml(), "waiting.toml")
    spec, slow_spec = (loads_spec(spec_text(device=str(path), **layout)) for path in (plain, waiting))
    plan, slow_plan = build_plan(spec), build_plan(slow_spec)
    costs = estimate_costs(plan, spec_profile(spec))
    slow = estimate_costs(slow_plan, spec_profile(slow_spec))
    prefix = "cp." if "cp" in layout else "tp."
    inline = {eid for program in plan.stages for name, eid in program.tp_events.items() if name.startswith(prefix)}
    assert inline and set(plan.events) == set(slow_plan.events)
    assert {plan.events[eid].kind for eid in inline} == kinds
    network = spec_network(spec.cluster.network)
    for eid, event in plan.events.items():
        if eid in inline:
            ranks = plan.group_ranks[eid][0]
            op = network_op(event.kind)
            bytes_s = (network.estimate_group(op, float(event.bytes), ranks).seconds
                       - network.estimate_group(op, 1.0, ranks).seconds)
            assert costs.events[eid].source == MODELLED and bytes_s > 0
            if event.kind == "p2p":
                assert slow.seconds(eid) == pytest.approx(1e-3)
                assert "a ring's send in a layer's pass on a100-inline-test: 1 ms a call" in slow.events[eid].note
            else:
                assert slow.seconds(eid) == pytest.approx(1e-3 + bytes_s)
                assert "inline in a layer's pass on a100-inline-test: 1 ms a call" in slow.events[eid].note
        else:
            assert slow.seconds(eid) == pytest.approx(costs.seconds(eid))


def test_the_engines_step_gap_idles_the_device_between_its_steps(tmp_path):
    """[host] step_gap_us: a spec alone waits it out between every two steps of a device (Costs.engine_gaps, every
    pair of phases), none before the first; one stage of m micro-batches has 2m steps, so 2m - 1 gaps."""
    import dataclasses

    from analysis.simulate import batch_time
    from harness.plan.device import load_device

    described = dataclasses.replace(load_device("a100-80gb"), name="a100-step-gap-test")
    plain = write(tmp_path, described.to_toml(), "plain.toml")
    gapped = write(tmp_path, dataclasses.replace(described, step_gap_s=2e-3).to_toml(), "gapped.toml")
    layout = {"pp": 1, "nodes": 1, "gpus_per_node": 4}
    spec = loads_spec(spec_text(device=str(plain), **layout))
    plan = build_plan(spec)
    costs = estimate_costs(plan, spec_profile(spec))
    assert costs.engine_gaps == {}
    gap_spec = loads_spec(spec_text(device=str(gapped), **layout))
    gap_plan = build_plan(gap_spec)
    gap_costs = estimate_costs(gap_plan, spec_profile(gap_spec))
    assert gap_costs.engine_gaps == {key: pytest.approx(2e-3) for key in ("F->F", "F->B", "B->F", "B->B")}
    m = spec.micro_batches
    assert m > 1
    assert batch_time(gap_plan, gap_costs) - batch_time(plan, costs) == pytest.approx((2 * m - 1) * 2e-3, rel=1e-6)


def test_a_profiles_measured_engine_gaps_win_over_the_descriptions(tmp_path):
    """A profile given beside a spec whose compute it did not measure leaves every compute event to the
    description, but the engine's gaps it measured (start, end, B->opt too) stay its own."""
    import dataclasses

    from analysis.costs.device_source import run_as_described
    from harness.plan.device import load_device
    from harness.store.hdf5_schema import STEP_GAPS

    gapped = dataclasses.replace(load_device("a100-80gb"), step_gap_s=1e-3)
    spec = loads_spec(spec_text(pp=1, nodes=1, gpus_per_node=4))
    costs = estimate_costs(build_plan(spec), spec_profile(spec))
    measured = {"F->B": 2e-4, "B->F": 3e-4, "start": 5e-4, "end": 1e-4, "B->opt": 2e-4}
    costs.engine_gaps = dict(measured)
    run_as_described(costs, gapped)
    assert costs.engine_gaps == measured
    costs.engine_gaps = {}
    run_as_described(costs, gapped)
    assert costs.engine_gaps == dict.fromkeys(STEP_GAPS, 1e-3)


def test_a_pipeline_hides_the_step_gap_where_a_step_waits_for_its_input(tmp_path):
    """pp = 2, 1F1B: a step that waits for its input (warm-up, cool-down) hides its gap, so the iteration grows by
    more than nothing and less than a gap at each of a device's 2m - 1 transitions."""
    import dataclasses

    from analysis.simulate import batch_time
    from harness.plan.device import load_device

    described = dataclasses.replace(load_device("a100-80gb"), name="a100-pipeline-gap-test")
    plain = write(tmp_path, described.to_toml(), "plain.toml")
    gapped = write(tmp_path, dataclasses.replace(described, step_gap_s=2e-3).to_toml(), "gapped.toml")
    layout = {"dp": 1, "tp": 1, "pp": 2, "nodes": 1, "gpus_per_node": 2}
    times = []
    for path in (plain, gapped):
        spec = loads_spec(spec_text(device=str(path), **layout))
        plan = build_plan(spec)
        times.append(batch_time(plan, estimate_costs(plan, spec_profile(spec))))
    m = spec.micro_batches
    assert 0 < times[1] - times[0] < (2 * m - 1) * 2e-3


def test_the_model_state_floor_is_what_the_last_backward_leaves():
    """18 bytes a parameter of the larger pipeline stage with Megatron's mixed precision; the modelled peak holds
    it and more (the activations), so a search may rule a candidate out by it alone."""
    text = spec_text(dp=2, tp=1, pp=2, nodes=1, gpus_per_node=4).replace('dtype = "float32"', 'dtype = "bfloat16"')
    spec = loads_spec(text + "\n[optimizer]\nname = \"adam\"\nmaster_weights = true\n")
    plan = build_plan(spec)
    stage_params = [sum(plan.layers[i].params for i in stage.layers) for stage in plan.stages]
    assert model_state_floor(spec) == 18 * max(stage_params)
    assert model_state_bytes(spec, 1000) == (2000, 4000, 12000)
    assert model_state_floor(spec) < estimate_memory(plan, {}).peak.total


def test_the_in_flight_floor_holds_the_schedules_micro_batches():
    """Device 0 of a 1F1B pipeline of 2 has 2 micro-batches in flight, GPipe's all 4, a split backward's B begins
    one's end; the floor is its weights and optimizer state beside that many micro-batches of its first chunk's
    saves, and never above the modelled peak (whatever the recompute, ZeRO or schedule)."""
    from harness.plan.activations import held_bytes
    from harness.plan.layers import describe, split_into_stages
    from harness.plan.schedules import device_steps, most_in_flight

    assert [most_in_flight("1f1b", d, 2, 4) for d in (0, 1)] == [2, 1]
    assert [most_in_flight("gpipe", d, 2, 4) for d in (0, 1)] == [4, 4]
    assert most_in_flight("zb-h1", 0, 2, 4) == 2 and most_in_flight("1f1b", 0, 4, 2) == 2
    assert most_in_flight("interleaved-1f1b", 0, 2, 4, 2) == 4  # chunk 0 runs ahead of chunk 1's backwards
    for schedule in ("gpipe", "1f1b"):  # their closed forms are their steps' count
        for pp, m in ((1, 3), (2, 1), (3, 5), (4, 8), (8, 6)):
            for d in range(pp):
                in_flight, most = 0, 0
                for step in device_steps(schedule, d, pp, m):
                    in_flight += 1 if step.phase == "F" else -1
                    most = max(most, in_flight)
                assert most_in_flight(schedule, d, pp, m) == most, (schedule, d, pp, m)
    spec = loads_spec(spec_text(dp=1, tp=1, pp=2, nodes=1, gpus_per_node=2))
    layers = describe(spec)
    stages = split_into_stages(layers, spec.model, 2)
    micro, seq = spec.batch.micro, spec.model.seq_len
    expected = []
    for d, first in ((0, 0), (1, len(stages[0]))):
        weights, _, optimizer = model_state_bytes(spec, sum(layer.params for layer in stages[d]))
        held = sum(held_bytes(spec, layers, i, micro, seq) for i in range(first, first + len(stages[d])))
        expected.append(weights + optimizer + most_in_flight("1f1b", d, 2, spec.micro_batches) * held)
    assert spec.strategy.schedule == "1f1b" and in_flight_floor(spec) == max(expected)
    for extra in ('schedule = "gpipe"', 'schedule = "zb-h1"', 'recompute = "full"', 'recompute = "selective"',
                  'schedule = "interleaved-1f1b"\nchunks = 2', "zero = 1", "zero = 3", "sp = true"):
        split = "zb" in extra or "zero" in extra  # built with tp = 1 only
        text = spec_text(dp=4 if split else 2, tp=1 if split else 2, pp=2, nodes=1, gpus_per_node=8).replace(
            'schedule = "1f1b"', extra if extra.startswith("schedule") else f'schedule = "1f1b"\n{extra}')
        varied = loads_spec(text)
        peak = estimate_memory(build_plan(varied), {}).peak.total
        assert 0 < in_flight_floor(varied) <= peak and model_state_floor(varied) <= peak, extra


def test_a_search_neither_costs_nor_simulates_what_cannot_fit(tmp_path):
    """Under a memory limit between the smallest model-state floor and the others' peaks: what the floor rules out
    is never planned (memory_floor_bytes, no peak), what the peak rules out never simulated; both come after the
    feasible ones, nearest to fitting first, and the JSON groups the grid's rejections by reason."""
    spec_path = write(tmp_path, spec_text(dp=2, tp=1, pp=2, nodes=1, gpus_per_node=4)
                      + "\n[search]\ntp = [1, 2]\npp = [1, 2, 4]\nmicro = [1, 2]\n")
    spec = load_spec(spec_path, import_factory=False)
    profile = spec_profile(spec, spec_path)
    everything = search(profile, spec, jobs=1, resamples=0, exhaustive=True)
    floors = sorted(model_state_floor(c.spec) for c in everything.candidates)
    limit = (floors[0] + floors[-1]) / 2
    result = search(profile, spec, capacity_bytes=limit, jobs=1, resamples=0, exhaustive=True)
    by_floor = [c for c in result.candidates if c.memory_floor_bytes is not None]
    by_peak = [c for c in result.candidates if c.too_large and c.memory_floor_bytes is None]
    fits = [c for c in result.candidates if c.feasible]
    assert by_floor and fits and len(fits) + len(by_floor) + len(by_peak) == len(result.candidates)
    for c in by_floor:
        # the model states' floor, else (a spec's activations being the formulas) the one with the micro-batches
        # in flight
        states = model_state_floor(c.spec)
        assert c.memory_floor_bytes == (states if states > limit else in_flight_floor(c.spec)) > limit
        assert c.peak_memory_bytes is None
        assert c.batch_time_s is None and c.reason.startswith("needs ") and c.reason.endswith("not simulated")
    for c in by_peak:
        assert c.peak_memory_bytes > limit and c.batch_time_s is None and c.reason.endswith("; not simulated")
    for c in fits:  # the same prediction as without the limit
        alike = next(e for e in everything.candidates if e.label == c.label)
        assert (c.batch_time_s, c.peak_memory_bytes) == (alike.batch_time_s, alike.peak_memory_bytes)
    assert result.candidates[:len(fits)] == fits
    rest = [c.memory_floor_bytes or c.peak_memory_bytes for c in result.candidates[len(fits):]]
    assert rest == sorted(rest)
    report = result.to_dict()
    assert report["schema_version"] == 5
    assert sum(group["count"] for group in report["rejected"]) == len(result.rejected) > 0
    assert all(1 <= len(group["choices"]) <= 3 for group in report["rejected"])


def test_the_device_benchs_vs_profile_column_is_the_spec_alone_against_its_pairs_profile():
    """bench/device_model.py's "vs profile" column: per job the median over its pairs of spec-only / profiled - 1
    (the run's time plays no part), summarised as the other columns are (median and p90 of |x|)."""
    from bench.device_model import summary, versus_profile_pct

    pairs = [{"predicted_s": 0.9, "measured_s": 1.2, "profiled_s": 1.0}, {"predicted_s": 1.5, "profiled_s": 1.2},
             {"predicted_s": 2.0, "measured_s": 1.0}]  # the last pair was not profiled
    assert versus_profile_pct(pairs) == pytest.approx((-10.0 + 25.0) / 2)
    assert versus_profile_pct(pairs[2:]) is None
    rows = [{"error_pct": e, "kinds_error_pct": None, "refined_error_pct": None, "profiled_error_pct": None,
             "vs_profile_pct": v, "failed": None} for e, v in ((-20.0, -10.0), (5.0, 30.0), (12.0, None))]
    s = summary(rows)
    assert s["vs_profile_median_abs_error_pct"] == pytest.approx(20.0)
    assert s["vs_profile_p90_abs_error_pct"] == pytest.approx(28.0)  # numpy's linear p90 of 10 and 30
    assert s["median_abs_error_pct"] == pytest.approx(12.0) and s["short"] == 1

"""`python -m harness device` (issue 43, item 6): a --quick run end to end writes a description that parses, round-
trips and costs a spec alone; its fitted curves are sane; the fit reproduces the device model's roofline and
recovers known curves; bad options exit 2 with one message."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tomllib

import numpy as np
import pytest

from analysis.device_model import DeviceModel
from analysis.predict import predict_spec
from harness.commands.cli import main as harness_main
from harness.plan.device import (
    CURVES,
    GB_S,
    REQUIRED_DTYPES,
    TFLOPS,
    US,
    Curve,
    check_output_path,
    in_unit,
    load_device,
    parse_device,
)
from harness.plan.device_fit import Observation, curve_of, fit_description, kernel_seconds
from harness.plan.kernels import Attention, Gemm, MemoryBound
from harness.plan.spec import loads_spec
from tests.conftest import ROOT
from tests.helpers import tiny_spec_text


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `harness device --quick -o mine.toml --json` (a few seconds): (the file, its JSON)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    folder = tmp_path_factory.mktemp("device")
    path = folder / "mine.toml"
    done = subprocess.run([sys.executable, "-m", "harness", "device", "--quick", "-o", str(path), "--json",
                           "--quiet", "--device", "cpu"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return path, json.loads(done.stdout)


def test_quick_run_writes_a_description_that_round_trips(quick_run):
    path, report = quick_run
    description = load_device(str(path))
    assert description.fitted and description.name == "mine"
    assert description.processor == "cpu"  # its spec-only predictions state no interval from the GPU runs
    assert "repeats" in description.fitted_on and "GEMMs" in description.fitted_on
    again = parse_device(tomllib.loads(description.to_toml()), source="again", default_name="mine")
    assert same_description(again, description)
    assert same_description(parse_device(report["description"], default_name="mine"), description)
    assert report["output"] == str(path)
    assert {row["curve"] for row in report["kernels"]} == {*CURVES, "optimizer"}
    for row in report["kernels"]:  # every measured kernel's modelled time is the description's own
        assert row["measured_s"] > 0 and row["modelled_s"] > 0


def same_description(a, b) -> bool:
    """Equal field by field, bit for bit: the file's figures (launch_us, GB/s, TFLOP/s) read back exactly."""
    return a == b


def test_figures_round_trip_exactly_through_the_file():
    """A figure written in the file's unit reads back bit for bit both ways (6.6607 us stays 6.6607)."""
    rng = np.random.default_rng(7)
    for unit in (US, GB_S, TFLOPS):
        for value in rng.lognormal(0, 8, 2000) * unit:
            assert in_unit(float(value), unit) * unit == float(value)
        for written in np.round(rng.uniform(0.1, 1000, 2000), 4):
            assert in_unit(float(written) * unit, unit) == float(written)
    assert in_unit(6.6607 * US, US) == 6.6607


def test_fitted_curves_are_sane(quick_run):
    description = load_device(str(quick_run[0]))
    assert description.launch_s > 0 and description.memory_bandwidth > 0 and description.memory_gb > 0
    for dtype in REQUIRED_DTYPES:
        assert description.matrix_peak[dtype] > 0 and description.vector_peak[dtype] > 0
    sizes = np.logspace(2, 14, 60)
    for name, curve in description.curves.items():
        assert 0 < curve.max_fraction <= 1, name
        fractions = [curve.fraction(float(x), 4096.0) for x in sizes]
        assert all(0 < f <= 1 for f in fractions), name
        assert all(b >= a for a, b in zip(fractions, fractions[1:])), f"{name} is not monotone"
        times = [x / f for x, f in zip(sizes, fractions)]  # a larger kernel never takes less time
        assert all(b >= a * (1 - 1e-9) for a, b in zip(times, times[1:])), f"{name}: time falls with size"


def test_a_spec_alone_is_costed_from_the_written_description(quick_run):
    path = quick_run[0]
    text = tiny_spec_text().replace("gpus_per_node = 1\n", f"gpus_per_node = 1\ndevice = \"{path}\"\n")
    prediction = predict_spec(loads_spec(text, source="job.toml"), resamples=0)
    assert prediction.timeline.batch_time_s > 0


KERNELS = [Gemm("g", 64, 256, 128, "float32"), Gemm("g", 8, 4096, 4096, "bfloat16"),
           Attention("a", "sdpa", 2, 4, 128, 128, 32, "float32"),
           Attention("a", "sdpa", 2, 4, 128, 128, 32, "float16", backward=True),
           Attention("a", "materialized", 1, 8, 64, 64, 64, "float32", launches=3),
           MemoryBound("m", 1e6, "float32"), MemoryBound("m", 3e3, "bfloat16", flops=5e4, launches=4)]


KINDS = [MemoryBound("gelu", 8e6, "float32", op="gelu", elements=1e6),
         MemoryBound("n", 3e3, "bfloat16", op="layer_norm_backward", elements=1e3, launches=2),
         MemoryBound("optimizer.step", 3.2e7, "float32", flops=1.2e7, launches=3, op="adam", elements=1e6,
                     tensors=((1000, 10), (990_000, 1))),
         MemoryBound("optimizer.step", 3.2e7, "float32", flops=1.2e7, launches=3, op="sgd", elements=1e6,
                     tensors=((1_000_000, 1),))]


def test_the_fit_costs_by_the_device_models_roofline():
    """The fit's seconds are the device model's (one roofline, harness.plan.device_fit.kernel_time), an optimizer
    step's bytes scaled to its dtype: a bfloat16 Adam step over the same tensors moves half a float32 one's."""
    from harness.plan.device import OptimizerCost

    device = load_device("h100-sxm")
    measured = dataclasses.replace(device, vector_ops={"gelu": 40.0, "layer_norm_backward": 3.0},
                                   optimizer={"adam": OptimizerCost(9.0, 2.0, 76.0, 7e-6, 6e9),
                                              "sgd": OptimizerCost(0.0, 3.0, 12.0, 4e-6, 9e9)}, causal_tile=64)
    for described in (device, measured):
        model = DeviceModel(described)
        for kernel in KERNELS + KINDS:
            assert kernel_seconds(described, kernel) == model.kernel_seconds(kernel)
    adam = KINDS[2]
    half = dataclasses.replace(adam, dtype="bfloat16")
    model = DeviceModel(measured)
    assert model.kernel_time(half).memory_s == pytest.approx(model.kernel_time(adam).memory_s / 2)
    assert model.kernel_time(adam).memory_s == pytest.approx(1e6 * 76.0 / 6e9)
    assert model.kernel_time(adam).launch_s == pytest.approx((2.0 + 9.0 * 11) * 7e-6)


def test_the_causal_tile_is_the_block_whose_share_matches_the_measured_ratios():
    """causal_tile_of on rows made from a known block (512: a CPU kernel's), on a kernel that skipped nothing up to
    the longest length (the longest), and on one that skips the masked half exactly (the smallest candidate)."""
    from harness.plan.kernels import causal_fraction
    from harness.profile.device_curves import causal_tile_of

    def rows(share):
        return [{"seq": seq, "pass": side, "ratio": share(seq)} for seq in (256, 512, 1024, 2048)
                for side in ("forward", "backward")]
    assert causal_tile_of(rows(lambda seq: causal_fraction(seq, seq, 512))) == 512
    assert causal_tile_of(rows(lambda seq: causal_fraction(seq, seq, 512) * 1.08)) == 512  # noise above it
    assert causal_tile_of(rows(lambda seq: 1.0)) == 2048
    assert causal_tile_of(rows(lambda seq: 0.5)) == 16


def test_a_quick_run_measures_the_causal_tile(quick_run):
    path, report = quick_run
    from harness.profile.device_curves import causal_tile_of

    description = load_device(str(path))
    assert description.causal_tile == causal_tile_of(report["causal"])  # what its rows say
    assert description.format == 2 and "causal_tile" in description.fitted_on
    assert {(row["seq"], row["pass"]) for row in report["causal"]} == {
        (seq, side) for seq in (256, 512, 1024, 2048) for side in ("forward", "backward")}
    assert all(row["causal_s"] > 0 and row["full_s"] > 0 for row in report["causal"])
    # the fit's fused attentions are causal and full in turn: both kinds pin the curve
    fused = [row["kernel"]["causal"] for row in report["kernels"] if row["curve"] == "sdpa_forward"]
    assert True in fused and False in fused


def test_a_kinds_vector_operations_are_its_slope_by_hand():
    """fit_vector_ops: a GELU at 1e4 and 1e5 elements taking 5 us (the launch) + 100 us and + 1,000 us: 1e-8 s an
    element, x a vector peak of 4e9 FLOP/s = 40 operations an element (the fixed time a call left out: the same
    with 30 us more on each); one kernel: its work over its elements; the bandwidth kinds have none."""
    from harness.plan.device_fit import fit_vector_ops

    device = dataclasses.replace(load_device("a100-80gb"), launch_s=5e-6,
                                 vector_peak={d: 4e9 for d in REQUIRED_DTYPES})

    def seen(op, elements, seconds):
        return Observation("memory", MemoryBound(op, 8.0 * elements, "float32", op=op, elements=elements), seconds)

    observations = [seen("gelu", 1e4, 105e-6), seen("gelu", 1e5, 1005e-6), seen("layer_norm", 1e4, 45e-6),
                    seen("rms_norm", 1e4, 135e-6), seen("rms_norm", 1e5, 1035e-6), seen("copy", 1e6, 1e-3)]
    ops = fit_vector_ops(device, observations)
    assert ops["gelu"] == pytest.approx(40.0) and ops["rms_norm"] == pytest.approx(40.0)
    assert ops["layer_norm"] == pytest.approx(40e-6 / 1e4 * 4e9)  # 16
    assert "copy" not in ops


CPU_FIRST_GEMMS = [(16, 32, 32), (241, 40, 35), (525, 553, 95)]  # harness device's fit set on a CPU, (m, n, k)


def test_a_gpus_shapes_are_drawn_as_real_models_have_them():
    """On a GPU every GEMM dimension and attention length drawn is a multiple of 64 (a bfloat16 GEMM of odd ones
    leaves the tensor cores' fast path); a CPU's draw is left as it was (its first GEMMs pinned)."""
    from harness.plan.kernels import Attention, Gemm
    from harness.profile.device_curves import FIT_SEED, FULL, draw_kernels

    gpu = draw_kernels("cuda", "bfloat16", FULL, FIT_SEED)
    gemms = [k for k in gpu if isinstance(k, Gemm)]
    attentions = [k for k in gpu if isinstance(k, Attention)]
    assert len(gemms) == FULL.gemm and len(attentions) == 2 * (FULL.sdpa + FULL.materialized)
    assert all(d % 64 == 0 for g in gemms for d in (g.m, g.n, g.k))
    assert all(a.q_len % 64 == 0 and a.kv_len == a.q_len for a in attentions)
    cpu = [(k.m, k.n, k.k) for k in draw_kernels("cpu", "float32", FULL, FIT_SEED) if isinstance(k, Gemm)]
    assert cpu[:3] == CPU_FIRST_GEMMS


def test_an_optimizers_figures_are_solved_on_its_two_steps():
    """fit_optimizer: counted 9 kernels a tensor, 2 a step, 76 bytes a parameter; the small step (64 tensors of
    256: 578 kernels, 1,245,184 B) and the large one (4 of 262,144: 38 kernels, 79,691,776 B) timed as a device of
    10 us a kernel and 10 GB/s makes them (5.9045184 ms and 8.3491776 ms): both figures come back. Steps that
    would need a negative kernel time: 0 and the large step's bytes over its time."""
    from harness.profile.device_curves import OPTIMIZER_SMALL, SCALES, fit_optimizer

    assert (OPTIMIZER_SMALL, SCALES["cpu"].optimizer_large) == ((64, 256), (4, 262_144))
    counted = {"kernels_per_tensor": 9.0, "kernels_per_step": 2.0, "bytes_per_parameter": 76.0}
    cost = fit_optimizer(counted, 578 * 10e-6 + 1_245_184 / 10e9, 38 * 10e-6 + 79_691_776 / 10e9)
    assert (cost.kernels_per_tensor, cost.kernels_per_step, cost.bytes_per_parameter) == (9.0, 2.0, 76.0)
    assert cost.kernel_s == pytest.approx(10e-6, rel=1e-9) and cost.bandwidth == pytest.approx(10e9, rel=1e-9)
    degenerate = fit_optimizer(counted, 1e-6, 8e-3)
    assert degenerate.kernel_s == 0.0 and degenerate.bandwidth == pytest.approx(79_691_776 / 8e-3)


def test_optimizers_are_counted_as_they_dispatch():
    """count_optimizer on this CPU: torch's one-tensor-at-a-time implementations, as harness train steps them:
    Adam launches several kernels a tensor and moves more than its 4 float32 tensors once each (32 bytes a
    parameter); SGD without momentum one kernel a tensor (the update) reading the parameter and its gradient
    and writing the parameter (12 bytes); with momentum more of both."""
    import torch

    from harness.profile.device_curves import count_optimizer

    cpu = torch.device("cpu")
    adam, sgd, momentum = (count_optimizer(kind, cpu) for kind in ("adam", "sgd", "sgd_momentum"))
    assert adam["kernels_per_tensor"] >= 5 and adam["bytes_per_parameter"] > 32
    assert sgd["kernels_per_tensor"] == 1 and sgd["bytes_per_parameter"] == 12
    assert momentum["kernels_per_tensor"] > 1 and momentum["bytes_per_parameter"] > 12
    for counted in (adam, sgd, momentum):
        assert float(counted["kernels_per_tensor"]).is_integer() and counted["kernels_per_step"] >= 0


def test_a_quick_run_measures_every_kind_and_optimizer(quick_run):
    """The description the quick run wrote is format 2: vector operations for every measured kind, an
    [optimizer.NAME] for every optimizer, each with its counted kernels and bytes."""
    from harness.plan.device import OPTIMIZER_KINDS
    from harness.profile.device_curves import VECTOR_MEASURED

    path, report = quick_run
    description = load_device(str(path))
    assert description.format == 2 and set(description.vector_ops) == set(VECTOR_MEASURED)
    assert all(ops >= 0 for ops in description.vector_ops.values())
    assert set(description.optimizer) == set(OPTIMIZER_KINDS)
    for kind, cost in description.optimizer.items():
        counted = report["optimizer_counts"][kind]
        assert cost.kernels_per_tensor == counted["kernels_per_tensor"] and cost.kernel_s >= 0
    assert report["ranks"] == 1 and report["collectives_in_context"] == []
    assert set(description.launches) == set(VECTOR_MEASURED)
    assert description.launches["layer_norm"] == 1 and description.launches["rms_norm"] > 1


def test_a_quick_run_measures_the_wrappers(quick_run):
    """The CPU's quick run writes [wrappers.checkpointed], [wrappers.fsdp2] (the FSDP2 units over one rank,
    started and ended within the calibration: no world is left) and [wrappers.split_backward], each figure 0 or
    more; only FSDP2's optimizer pays a kernel more, only the split backward's weights' half a weight figure."""
    import torch.distributed as dist

    path, report = quick_run
    wrappers = load_device(str(path)).wrappers
    assert set(wrappers) == {"checkpointed", "fsdp2", "split_backward"}
    assert all(cost.forward_s >= 0 and cost.backward_s >= 0 and cost.weight_s >= 0 for cost in wrappers.values())
    assert wrappers["checkpointed"].optimizer_kernel_s == 0 and wrappers["fsdp2"].optimizer_kernel_s >= 0
    assert wrappers["checkpointed"].weight_s == wrappers["fsdp2"].weight_s == wrappers["split_backward"].forward_s == 0
    assert "[wrappers] the same blocks under torch.utils.checkpoint" in report["description"]["fitted_on"]
    assert not dist.is_initialized()


def test_wrapper_costs_by_hand():
    """Two families: plain forward 1 / 2 ms and forward with backward 3 / 6 ms (backward 2 / 4); checkpointed
    forward 1.2 / 2.4, with backward 4.7 / 9.1 (its backward 3.5 / 6.7, less the plain backward and the forward it
    runs again as wrapped, 1.2 / 2.4, which the plan costs as the forward event: 0.3 / 0.3); FSDP2 forward 1.5 /
    2.3, with backward 3.6 / 6.4 (backward 2.1 / 4.1: 0.1 each); the split backward's forward with the input's half
    2.5 / 5, with both 4 / 8 (halves 1.5 and 1.5 / 3 and 3), its kernels modelled at 2 ms a plain backward, 1.5 the
    input's half and 0.75 the weights' (scaled by the measured plain backward's 2 / 4 ms: x 1 / x 2), so the input's
    half is its kernels (0 / 0 more) and the weights' 0.75 / 1.5 ms more. The medians: checkpointed 0.3 / 0.3 ms,
    FSDP2 0.4 / 0.1 ms, the split 0 / 1.125 ms; a negative median is 0."""
    from harness.plan.device import WrapperCost
    from harness.profile.device_blocks import wrapper_costs

    ms = 1e-3
    modelled = (2 * ms, 1.5 * ms, 0.75 * ms)
    costs = wrapper_costs([3 * ms, 6 * ms], [[1 * ms, 1.2 * ms, 4.7 * ms, 1.5 * ms, 3.6 * ms, 2.5 * ms, 4 * ms],
                                             [2 * ms, 2.4 * ms, 9.1 * ms, 2.3 * ms, 6.4 * ms, 5 * ms, 8 * ms]],
                          [modelled, modelled])
    assert costs["checkpointed"].forward_s == pytest.approx(0.3 * ms)
    assert costs["checkpointed"].backward_s == pytest.approx(0.3 * ms)
    assert costs["fsdp2"].forward_s == pytest.approx(0.4 * ms) and costs["fsdp2"].backward_s == pytest.approx(0.1 * ms)
    split = costs["split_backward"]
    assert split.forward_s == 0 and split.backward_s == pytest.approx(0.0, abs=1e-12)
    assert split.weight_s == pytest.approx(1.125 * ms)
    faster = wrapper_costs([3 * ms], [[1 * ms, 0.9 * ms, 2.5 * ms, 1 * ms, 2.9 * ms, 1.5 * ms, 2.2 * ms]], [modelled])
    assert all(cost == WrapperCost(0.0, 0.0) for cost in faster.values())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_split_kernels_are_the_plain_backwards_in_two_halves(family):
    """The calibration's block through a split backward: its two halves hold the plain backward's kernels, the
    input's gradient add in the first and the parameters' adds in the second, and each norm's weight gradient once
    more in the second; every kernel of the second is on the weights' side."""
    from collections import Counter

    from harness.profile.device_blocks import split_kernels

    plain, inputs, weights = split_kernels(family, "float32")
    again = Counter(inputs + weights) - Counter(plain)
    assert Counter(inputs + weights) - again == Counter(plain)
    assert sorted(k.name for k in again.elements()) == ["norm1.grad_weight", "norm2.grad_weight"]
    assert "input.grad_accumulate" in [k.name for k in inputs]
    assert "grad_accumulate" in [k.name for k in weights] and all(
        k.weight_gradient or k.name == "grad_accumulate" for k in weights)


def test_a_kinds_launches_are_what_its_code_dispatches():
    """count_kind_launches: F.layer_norm and F.gelu are one operation forward and backward; harness.models'
    RMSNorm several (pow, mean, add, rsqrt, two mul) and its backward more; the loss two (log_softmax,
    nll_loss)."""
    import torch

    from harness.profile.device_curves import count_kind_launches

    launches = count_kind_launches("float32", torch.device("cpu"))
    assert launches["layer_norm"] == launches["gelu"] == launches["gelu_backward"] == 1
    assert launches["rms_norm"] == 6 and launches["rms_norm_backward"] > launches["rms_norm"]
    assert launches["cross_entropy"] == 2


def test_the_fit_recovers_known_curves():
    """Observations made by a known description are fitted back from flat curves to within 1% of every time."""
    truth = load_device("a100-80gb")
    truth = dataclasses.replace(truth, curves={**truth.curves, "gemm": Curve(0.8, 3e8, 0.8, 24.0),
                                               "memory": Curve(0.7, 2e6, 0.6)})
    rng = np.random.default_rng(1)
    kernels = [Gemm("g", *(int(x) for x in rng.integers(16, 8192, 3)), "bfloat16") for _ in range(30)]
    kernels += [MemoryBound("m", float(x), "bfloat16") for x in np.logspace(3, 9, 12)]
    kernels += [Attention("a", "sdpa", 2, 16, s, s, 128, "bfloat16", backward=b) for s in (256, 1024, 4096)
                for b in (False, True)]
    observations = [Observation(curve_of(k), k, kernel_seconds(truth, k)) for k in kernels]
    flat = dataclasses.replace(truth, curves={name: Curve(1.0, 0.0) for name in CURVES})
    fitted = fit_description(flat, observations)
    for o in observations:
        assert kernel_seconds(fitted, o.kernel) == pytest.approx(o.seconds, rel=0.01), o.kernel


@pytest.mark.parametrize("args, words", [
    (["--dtype", "float64"], "--dtype"),
    (["--repeats", "0"], "--repeats"),
    (["--repeats", "many"], "--repeats"),
    (["-o", "mine.txt"], ".toml"),
    (["--device", "tpu"], "--device"),
])
def test_bad_options_exit_2_with_one_message(args, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert harness_main(["device", *args, "--quick", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err


def test_a_folder_as_output_is_refused(capsys, tmp_path):
    folder = tmp_path / "out.toml"
    folder.mkdir()
    assert harness_main(["device", "-o", str(folder), "--quick"]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_a_job_spec_is_not_replaced_by_a_description(capsys, tmp_path):
    """A job spec and a description both end in .toml: -o over a spec is refused before calibrating; over an
    earlier description (the same command's output) it is not."""
    spec = tmp_path / "job.toml"
    spec.write_text(tiny_spec_text())
    assert harness_main(["device", "-o", str(spec), "--quick", "--quiet"]) == 2
    assert "exists and is a job spec; writing the description there would replace it" in capsys.readouterr().err
    assert spec.read_text() == tiny_spec_text()
    earlier = tmp_path / "mine.toml"
    earlier.write_text(load_device("h100-sxm").to_toml())
    assert check_output_path(str(earlier)) == earlier


def test_a_description_that_cannot_be_written_is_printed_not_lost():
    """The write fails after the calibration (a path no one can write): the description goes to stdout, then one
    message and exit 2. A missing folder is made."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "harness", "device", "--quick", "--quiet", "--device", "cpu",
                           "-o", "/proc/distsim-no-such/mine.toml"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2 and "the description is printed above instead" in done.stderr
    assert parse_device(tomllib.loads(done.stdout)).matrix_peak["float32"] > 0 and "Traceback" not in done.stderr


def test_a_cpu_launch_is_the_framework_time_beyond_the_kernels_modelled_work():
    """framework_launch: a block's measured seconds less its kernels' modelled work (launches costed 0), over
    the launches harness.plan.kernels lists for it."""
    from harness.profile.device_blocks import framework_launch

    device = load_device("a100-80gb")
    blocks = [KERNELS[:3], KERNELS]
    workless = dataclasses.replace(device, launch_s=0.0)
    measured = [sum(kernel_seconds(workless, k) for k in kernels) + 50e-6 * sum(k.launches for k in kernels)
                + extra for kernels, extra in zip(blocks, (0.0, 1e-3))]
    got = framework_launch(device, list(zip(blocks, measured)))
    assert got[0] == pytest.approx(50e-6, rel=1e-9)
    assert got[1] == pytest.approx(50e-6 + 1e-3 / sum(k.launches for k in KERNELS), rel=1e-9)


def test_a_cpu_description_costs_a_kernel_the_framework_time_it_measured(quick_run):
    """On a CPU the written launch is the framework's time a kernel in tiny built-in blocks (their median), at
    least a bare operator's; the fit's own kernels are held to the bare launch."""
    path, report = quick_run
    launch = report["launch"]
    assert set(launch["framework_s"]) == {"gpt2", "bert", "llama"}
    assert launch["bare_s"] > 0
    expected = max(launch["bare_s"], float(np.median(list(launch["framework_s"].values()))))
    assert load_device(str(path)).launch_s == pytest.approx(expected, rel=1e-12)
    assert "framework" in load_device(str(path)).fitted_on


def test_fsdp2s_unshard_is_fitted_beyond_the_collective_and_the_copies():
    """Units of 1, 8 and 32 tensors at 64 and 256 KiB over 2 ranks whose unshard() took the bare all-gather, the
    copies the description models and 300 us + 20 us a tensor: the fit gives those two back, and still does with one
    unit's wait 1 ms long. A fit that would need a negative time a call (50 us a tensor less 100 us) takes 0 for it;
    one whose extra falls with the tensors (1 ms less 10 us a tensor) 0 a tensor and the median unit's time a call
    (the two 8-tensor units': 920 us)."""
    from harness.plan.kernels import unshard_copies
    from harness.profile.device_ranks import UNSHARD_UNITS, fit_unshard

    device = load_device("a100-80gb")

    def rows(call, per_tensor, late=None):
        out = []
        for index, (tensors, nbytes) in enumerate(UNSHARD_UNITS):
            copies = sum(kernel_seconds(device, k) for k in unshard_copies(nbytes, 2, "float32", tensors))
            out.append({"tensors": tensors, "bytes": nbytes, "ranks": 2,
                        "extra_s": copies + call + per_tensor * tensors + (1e-3 if index == late else 0.0)})
        return out
    assert fit_unshard(device, rows(300e-6, 20e-6)) == pytest.approx((300e-6, 20e-6))
    assert fit_unshard(device, rows(300e-6, 20e-6, late=1)) == pytest.approx((300e-6, 20e-6))
    assert fit_unshard(device, rows(-100e-6, 50e-6)) == pytest.approx((0.0, 50e-6))
    assert fit_unshard(device, rows(1e-3, -10e-6)) == pytest.approx((1e-3 - 10e-6 * 8, 0.0))  # the median unit's


def test_fsdp2s_reduce_is_fitted_beyond_the_backward_the_collective_and_the_copy_in():
    """The same units whose post-backward reduce took their plain backward, the bare reduce-scatter, the copy-in the
    description models and 400 us + 15 us a tensor: the fit gives those two back, with one unit's wait 1 ms long
    too, and 0 a call where that would be negative."""
    from harness.plan.kernels import reduce_copies
    from harness.profile.device_ranks import UNSHARD_UNITS, fit_reduce

    device = load_device("a100-80gb")

    def rows(call, per_tensor, late=None):
        return [{"tensors": tensors, "bytes": nbytes, "ranks": 2,
                 "extra_s": (sum(kernel_seconds(device, k) for k in reduce_copies(nbytes, "float32")) + call
                             + per_tensor * tensors + (1e-3 if index == late else 0.0))}
                for index, (tensors, nbytes) in enumerate(UNSHARD_UNITS)]
    assert fit_reduce(device, rows(400e-6, 15e-6)) == pytest.approx((400e-6, 15e-6))
    assert fit_reduce(device, rows(400e-6, 15e-6, late=4)) == pytest.approx((400e-6, 15e-6))
    assert fit_reduce(device, rows(-100e-6, 50e-6)) == pytest.approx((0.0, 50e-6))


def test_a_pipeline_sends_figures_are_lines_in_its_bytes():
    """fit_p2p: posts of 0.1 + 0.2 ms a MiB, extras of 0.3 ms at every size and late sends' compute of 0.2 + 0.05
    ms a MiB, read back as lines; a falling line's slope is 0 (its mean the intercept); without `late_s` (a system
    whose run-queue wait cannot be read) no p2p_late."""
    from harness.profile.device_ranks import fit_p2p

    sizes = (0.25, 1.0, 4.0)
    rows = [{"bytes": int(mib * (1 << 20)), "post_s": 1e-4 + 2e-4 * mib, "extra_s": 3e-4,
             "late_s": 2e-4 + 5e-5 * mib} for mib in sizes]
    assert fit_p2p(rows) == pytest.approx({"p2p_post_s": 1e-4, "p2p_post_s_per_mib": 2e-4, "p2p_sender_busy_s": 3e-4,
                                           "p2p_sender_busy_s_per_mib": 0.0, "p2p_late_s": 2e-4,
                                           "p2p_late_s_per_mib": 5e-5})
    falling = [{**row, "extra_s": 5e-4 - 1e-4 * mib} for row, mib in zip(rows, sizes)]
    assert fit_p2p(falling)["p2p_sender_busy_s_per_mib"] == 0.0
    assert fit_p2p(falling)["p2p_sender_busy_s"] == pytest.approx(np.mean([5e-4 - 1e-4 * mib for mib in sizes]))
    assert "p2p_late_s" not in fit_p2p([{k: v for k, v in row.items() if k != "late_s"} for row in rows])


def test_an_inline_collective_is_the_passes_time_over_the_group_beyond_alone_a_call():
    """Two passes over 2 ranks, 4 inline all-reduces (5.7 ms against 0.7 alone) and 10 sequence-parallel exchanges
    (10.0 against 1.0): 14 ms over 14 calls, 1 ms a call; never below 0 (a pass over the group that ran faster than
    alone), 0 without calls."""
    from harness.profile.device_ranks import fit_inline_collective

    rows = [{"sp": False, "calls": 4, "ranks": 2, "bytes": 8192, "grouped_s": 5.7e-3, "alone_s": 0.7e-3},
            {"sp": True, "calls": 10, "ranks": 2, "bytes": 8192, "grouped_s": 10.0e-3, "alone_s": 1.0e-3}]
    assert fit_inline_collective(rows) == pytest.approx(1e-3)
    assert fit_inline_collective([{**rows[0], "grouped_s": 0.5e-3}]) == 0.0
    assert fit_inline_collective([]) == 0.0


def test_the_summary_names_the_kinds_the_optimizers_and_the_collectives(tmp_path):
    """harness device's summary (no --json): its curves' table, then the vector operations, each optimizer's
    figures and its steps' error, and with 2 ranks the collectives in context beside back to back."""
    from harness.commands.device import summary
    from harness.plan.device import OptimizerCost

    described = dataclasses.replace(load_device("a100-80gb"), vector_ops={"gelu": 41.7},
                                    optimizer={"adam": OptimizerCost(9.0, 2.0, 76.0, 6.3e-6, 5.5e9)})
    errors = {"memory": {"kernels": 6, "median_abs_error_pct": 10.0, "p90_abs_error_pct": 20.0},
              "optimizer": {"kernels": 6, "median_abs_error_pct": 12.0, "p90_abs_error_pct": 30.0}}
    rows = [{"op": "allreduce", "bytes": 1024, "ranks": 2, "in_context_s": 3e-3, "back_to_back_s": 1e-3,
             "burst_s": 2e-3}]
    text = summary(described, errors, tmp_path / "mine.toml", rows)
    assert "gelu 41.7" in text and "optimizer adam: 9 kernels a tensor, 2 a step, 76 bytes" in text
    assert "6.3 us a kernel" in text and "optimizer steps measured: 6, median |error| 12.0%" in text
    assert "collectives in context on 2 ranks" in text and "allreduce" in text

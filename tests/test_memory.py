"""The memory model against what schedules hold and what ZeRO's accounting says model states take, the meter
that counts a device's bytes, and the model against a real run's peak."""
from __future__ import annotations

import gc
import json

import pytest
import torch

from analysis.memory import backward_moments, estimate_memory, step_copy_bytes, temporary_bytes
from harness.plan.events import build_plan
from harness.plan.spec import parse_spec
from harness.profile.memory import LiveStorages, activation_bytes, backward_temporaries, saving_into
from tests.helpers import mpirun_harness, tiny_spec_text
from tests.test_analysis_helpers import make_spec


def _estimate(spec, block_bytes: int = 10**7):
    """The plan and its memory with every block's forward saving `block_bytes` (the embedding and head none)."""
    plan = build_plan(spec)
    saved = {eid: block_bytes if e.content["layer"] == "block" else 0 for eid, e in plan.events.items()
             if e.kind == "compute" and e.content.get("phase") == "fwd"}
    return plan, estimate_memory(plan, saved)


@pytest.mark.parametrize("schedule,expected", [("gpipe", [8, 8, 8, 8]), ("1f1b", [4, 3, 2, 1])])
def test_micro_batches_in_flight_follow_the_schedule(schedule, expected):
    """GPipe holds every micro-batch, 1F1B at most pp - stage (counted as a backward starts)."""
    _, memory = _estimate(make_spec(pp=4, micro_batches=8, schedule=schedule))
    assert [s.in_flight for s in memory.stages] == expected


def test_interleaving_holds_what_megatron_counts():
    """Interleaved 1F1B's first stage holds 1 + (p - 1) / (p v) times 1F1B's p micro-batches (Korthikanti et al.),
    in chunks of 1 / v of a stage each."""
    p, v = 2, 2
    _, plain = _estimate(make_spec(pp=p, micro_batches=4, layers=4, schedule="1f1b"))
    _, interleaved = _estimate(make_spec(pp=p, micro_batches=4, layers=4, schedule="interleaved-1f1b", chunks=v))
    assert plain.stages[0].in_flight == p
    assert interleaved.stages[0].in_flight / v == pytest.approx(p * (1 + (p - 1) / (p * v)))


@pytest.mark.parametrize("dtype,optimizer,per_parameter", [
    ("float32", {}, 16),  # Adam, fp32: 4 + 4 + 8
    ("bfloat16", {"master_weights": True}, 18),  # Megatron-LM's mixed precision: 2 + 4 (fp32 main grads) + 12
    ("bfloat16", {"master_weights": True, "reduce_dtype": "bfloat16"}, 16),  # --grad-reduce-in-bf16: 2 + 2 + 12
    ("float16", {"master_weights": True}, 16),  # fp16: main gradients in fp16 (their fp32 copy at the step)
    ("float16", {"master_weights": True, "reduce_dtype": "float32"}, 18),  # --accumulate-allreduce-grads-in-fp32
    ("bfloat16", {}, 8),  # 2 + 2 + 4: states in the weights' dtype
    ("float32", {"name": "sgd"}, 12),  # momentum: one state
    ("float32", {"name": "sgd", "momentum": 0.0}, 8)])
def test_model_states_per_parameter(dtype, optimizer, per_parameter):
    data = json.loads(make_spec(dp=2, micro_batches=2).to_json())
    data["model"]["dtype"] = dtype
    data["optimizer"] = {**data["optimizer"], **optimizer}
    spec = parse_spec(data)
    plan, memory = _estimate(spec)
    (stage,) = memory.stages
    params = sum(layer.params for layer in plan.layers)
    assert stage.weights + stage.gradients + stage.optimizer == per_parameter * params


def test_gradients_count_from_the_first_backward_without_data_parallelism():
    """GPipe without data parallelism peaks either with every micro-batch in flight before any gradient exists,
    or after its first backward with the gradients made: the model takes the larger, with the backward's
    temporaries at its worst moment (the head's or the last block's: the head saves nothing here)."""
    for per_micro in (1000, 10**7):  # the block; the embedding and head save nothing, a last stage sends nothing
        spec = make_spec(pp=1, micro_batches=4, schedule="gpipe")
        plan, memory = _estimate(spec, per_micro)
        (stage,) = memory.stages
        weights = sum(layer.params for layer in plan.layers) * 4
        worst = max(made - freed for layer in plan.layers[1:] for made, freed, _ in backward_moments(spec, layer))
        assert stage.metered == max(weights * 3 + 4 * per_micro, weights * 4 + 3 * per_micro)
        assert stage.temporaries > 0 and stage.total == stage.metered + worst
        assert stage.gradients == (weights if per_micro == 1000 else 0)
    _, replicated = _estimate(make_spec(dp=2, micro_batches=4, schedule="gpipe"))
    assert replicated.stages[0].gradients == weights  # buckets persist: gradients from the start


def test_megatrons_main_gradients_are_held_from_the_start_without_data_parallelism():
    """Master weights (Megatron's mixed precision) keep float32 main gradients in buffers made when the model is
    wrapped, zeroed at each step: one micro-batch without data parallelism peaks with all of them beside its
    activations (Korthikanti et al.'s 22B on one DGX: 4 sequences a step, tp 8); without master weights the
    gradients are made by its one backward, as its activations go."""
    data = json.loads(make_spec(pp=1, micro_batches=1).to_json())
    data["model"]["dtype"] = "bfloat16"
    plain = parse_spec(data)
    data["optimizer"] = {**data["optimizer"], "master_weights": True}
    megatron = parse_spec(data)
    for spec, held in ((megatron, True), (plain, False)):
        plan, memory = _estimate(spec)
        (stage,) = memory.stages
        params = sum(layer.params for layer in plan.layers)
        grads = params * (4 if held else 2)
        assert stage.activations > 0
        assert stage.gradients == (grads if held else 0)
        assert stage.metered == (stage.weights + stage.gradients + stage.optimizer + stage.activations
                                 + stage.pipeline + stage.remade)


@pytest.mark.parametrize("zero", [0, 1])
def test_the_optimizer_step_holds_an_fp32_copy_of_16_bit_main_gradients(zero):
    """Megatron's fp16 optimizer copies 16-bit main gradients to fp32 for its master weights at the step
    (main_grad.float()), after the activations are gone: a device whose activations are small peaks there, with
    4 bytes a parameter (of its shard with ZeRO) beside its model states; fp32 main gradients are not copied."""
    data = json.loads(make_spec(dp=2, micro_batches=2, zero=zero).to_json())
    data["model"]["dtype"] = "float16"
    data["model"]["tie_embeddings"] = False  # ZeRO refuses a tied embedding
    data["optimizer"] = {**data["optimizer"], "master_weights": True}
    fp16 = parse_spec(data)
    data["optimizer"]["reduce_dtype"] = "float32"
    fp32 = parse_spec(data)
    for spec, copied in ((fp16, True), (fp32, False)):
        plan, memory = _estimate(spec, 10)  # tiny activations: the step is the peak where it copies
        (stage,) = memory.stages
        params = sum(layer.params for layer in plan.layers)
        copy = 4 * (-(-params // 2) if zero else params) if copied else 0
        assert step_copy_bytes(spec, params) == copy
        states = stage.weights + stage.gradients + stage.optimizer
        if copied:
            assert stage.total == states + copy and stage.temporaries == copy and stage.activations == 0
        else:  # its peak is another moment's
            assert stage.temporaries != copy or stage.activations > 0


def test_a_device_that_does_not_fit_says_by_how_much_and_what_dominates():
    _, memory = _estimate(make_spec(pp=2, micro_batches=4), 1000)
    assert memory.fits(None) and memory.fits(memory.peak_bytes) and not memory.fits(memory.peak_bytes - 1)
    assert "optimizer" in memory.shortfall(1e3) and "1 kB per device" in memory.shortfall(1e3)


def test_a_storage_counts_once_whatever_views_it():
    meter = LiveStorages()
    t = torch.zeros(1000)
    release = meter.hold(t, "weights")
    meter.hold_while(t[10:20], t[10:20], "activations")  # a view: the same storage, still a weight
    assert meter.total == 4000 and meter.live["weights"] == 4000 and meter.live["activations"] == 0
    release()
    gc.collect()
    assert meter.total == 0 and meter.peak == 4000


def test_saved_activations_are_counted_until_the_backward_frees_them():
    meter = LiveStorages()
    layer = torch.nn.Linear(64, 64)
    for p in layer.parameters():
        meter.hold(p, "weights")
    x = torch.randn(8, 64, requires_grad=True)
    with saving_into(meter):
        out = torch.nn.functional.gelu(layer(x))
    assert meter.live["activations"] == 8 * 64 * 4 * 2  # the linear's input and the GELU's input
    out.sum().backward()
    del out
    gc.collect()
    assert meter.live["activations"] == 0
    assert activation_bytes(layer, lambda: torch.randn(8, 64, requires_grad=True),
                            lambda m, x: torch.nn.functional.gelu(m(x))) == 8 * 64 * 4 * 2  # not the weight


def test_a_split_backward_frees_every_saved_activation_after_its_weight_step():
    """stage_backward_input keeps the graph for stage_backward_weight, which runs only the weights' part of it:
    the nodes only the input's gradient ran must still let their saved tensors go (a record holding its node's
    own output kept them alive for good: 3.4 MB a micro-batch of a 2-block stage)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from harness.models import build_layer

    model = parse_spec(make_spec(hidden=64, seq=16).to_dict()).model
    meter = LiveStorages()
    layers = torch.nn.Sequential(*(build_layer(model, "block", tp=1) for _ in range(2)))
    for _ in range(2):
        x = torch.randn(2, 16, 64, requires_grad=True)
        with saving_into(meter):
            out = layers(x)
        assert meter.live["activations"] > 0
        _, groups = stage_backward_input([out], [torch.randn_like(out)], [x], layers.parameters())
        stage_backward_weight(layers.parameters(), groups)
        del out, groups
        gc.collect()
        assert meter.live["activations"] == 0
        assert all(p.grad is not None for p in layers.parameters()) and x.grad is not None


def test_a_backwards_temporaries_are_what_its_operators_make_beyond_the_gradients():
    """Two linears with a GELU between, 8 rows: the worst moment is the last linear's backward, its input's
    gradient (8 x 96 floats) beside its weight's (32 x 96) and its bias's (32) before they are added into the
    gradients that exist already, nothing saved let go of yet. Gradients given for the measurement are taken
    back; one that was there is kept (the same tensor)."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    kept = layers[0].weight.grad = torch.zeros_like(layers[0].weight)
    made = backward_temporaries(layers, lambda: torch.randn(8, 32, requires_grad=True), lambda m, x: m(x))
    assert made == ((8 * 96 + 32 * 96 + 32) * 4, 0, 0, 0)  # no loss: nothing before the output's gradient
    assert layers[0].weight.grad is kept and all(p.grad is None for p in layers[2].parameters())


def test_a_factory_layers_measured_temporaries_are_a_moment_of_its_backward():
    """A factory layer's backward is what the profile measured of it (its worst moment with its weights in use,
    and the last layer's loss's before them, each with what it has let go of by then); without the measurement,
    nothing beyond its start."""
    from harness.plan.activations import BackwardTemporaries
    from harness.plan.layers import LayerDesc

    spec = make_spec(pp=1, layers=3)
    layer = LayerDesc(kind="user", signature=(("family", "user"),), params=100, fwd_flops_per_token=201.0)
    assert backward_moments(spec, layer) == [(0, 0, "start")]
    assert backward_moments(spec, layer, BackwardTemporaries(5000, 300)) == [(0, 0, "start"), (5000, 300, "during")]
    assert backward_moments(spec, layer, BackwardTemporaries(5000, 300, 7000, 20)) == [
        (7000, 20, "before"), (0, 0, "start"), (5000, 300, "during")]


def test_zero3s_worst_backward_moment_is_a_reduce_scatter_as_memtracker_saw_it():
    """ZeRO-3 (bytes by hand; layers in forward order, each (saved, moments, whole, shard, input gradient)): a
    layer's reduce-scatter holds its whole gradients copied into the input, the collective's working copy and
    its output shard beside its input's gradient, its weights let go and its saves freed, and the inputs of the
    layers after it; a built-in head's whole gradients stay through it. The first layer (token ids, no input
    gradient) reduce-scatters once those inputs are let go: its all-gather, beside them, is worse."""
    from analysis.memory import _Layer, _worst_backward_moment

    def layers(head_keeps: bool, embedding_whole: int = 1000) -> list:
        return [_Layer(100, 0, [(0, 0, "start"), (50, 0, "during")], embedding_whole, embedding_whole // 2, 0),
                _Layer(400, 0, [(0, 0, "start"), (300, 0, "during")], 2000, 1000, 80),
                _Layer(600, 0, [(900, 0, "before"), (450, 300, "start"), (1200, 300, "during")], 3000, 1500, 80,
                       head_keeps)]

    # (activations, temporaries, re-made, weights, gradients) beyond the micro-batch's start
    assert _worst_backward_moment(layers(True), zero=3) == (-600, 2 * 3000 + 1500 + 80, 0, 0, 3000)
    # without the head's whole gradients the block's is worse: the head's input (3000) still held beside it
    assert _worst_backward_moment(layers(False), zero=3) == (-600 - 400, 2 * 2000 + 1000 + 80 + 3000, 0, 0, 0)
    # the embedding's all-gather (its buffer beside its weights) with the later layers' inputs (3000 + 2000)
    assert _worst_backward_moment(layers(True, 4000), zero=3) == (-1000, 4000 + 5000, 0, 4000, 0)


def test_a_profile_older_than_the_backwards_temporaries_reads_as_before():
    """The committed profile (written before the measurement): no temporaries, the same estimate as without."""
    from pathlib import Path

    from analysis.memory import activation_bytes, released_bytes
    from analysis.profile_reader import load_profile

    profile = load_profile(Path(__file__).parent / "data" / "pp2-profile.h5")
    plan = build_plan(profile.spec)
    assert temporary_bytes(profile) == {}
    before = estimate_memory(plan, activation_bytes(profile), released_bytes(profile))
    assert estimate_memory(plan, activation_bytes(profile), released_bytes(profile), {}).to_dict() == before.to_dict()
    assert before.peak_bytes > 0


@pytest.mark.parametrize("recompute,schedule,factory,micro_batches", [
    ("none", "gpipe", False, 4), ("full", "gpipe", False, 4), ("none", "zb-h1", False, 4), ("full", "gpipe", True, 4),
    ("none", "interleaved-zb", True, 1)])
def test_the_model_meets_a_real_runs_peak(tmp_path, project_env, recompute, schedule, factory, micro_batches):
    """Profile and train one pipeline job on 2 ranks: each stage's predicted peak is within 1% of what the run
    held (the model and the run count the same parts; tests/README: docs/analysis.md, Memory). A factory
    model's last layer is recomputed too, and the loss after it keeps its log-probabilities (once 12% short
    here); within 2%, as the model knows nothing of a factory layer's backward (here one b s h, 1.1%, held as
    a backward's moment). A device's gradients are counted chunk by chunk as their backward makes them: one
    micro-batch of interleaved-zb once had both chunks' counted from the first W (the suite's job: 6.6% over,
    now 0.4%); here within the issue's 3%, as the first stage's W makes its token table's gradient while its
    output and received gradient are still held, a moment the model leaves out (2.4%)."""
    spec = tmp_path / "job.toml"
    text = tiny_spec_text(layers=4, hidden=64, heads=4, ffn=256, seq=32, vocab=1024 if factory else 256, pp=2,
                          global_batch=2 * micro_batches, micro=2, schedule=schedule, warmup=1, repeats=2,
                          recompute=recompute)
    spec.write_text(text.replace('name = "gpt2-small"', 'factory = "tests.user_model:build"') if factory else text)
    profiled = mpirun_harness(2, ["profile", str(spec), "-o", str(tmp_path / "out"), "--quiet"], project_env)
    assert profiled.returncode == 0, profiled.stderr
    trained = mpirun_harness(2, ["train", str(spec), "-o", str(tmp_path / "run"), "--iterations", "3"], project_env)
    assert trained.returncode == 0, trained.stderr
    from analysis.cli import main
    from analysis.profile_reader import load_profile
    from analysis.trace_reader import read_trace
    from analysis.validate import validate

    profile = load_profile(tmp_path / "out")
    backwards = {eid for eid, m in profile.measurements.items()
                 if m.kind == "compute" and m.content.get("phase") == "bwd"}
    assert set(temporary_bytes(profile)) == backwards  # stored in the profile, read back
    result = validate(read_trace(tmp_path / "run"), profile)
    assert len(result.memory) == 2
    for row in result.memory:
        assert abs(row["error_pct"]) < (1.0 if not factory else 2.0 if micro_batches > 1 else 3.0), row
        assert row["measured_parts"]["weights"] == row["predicted_parts"]["weights"]
    assert main(["validate", str(tmp_path / "run"), str(tmp_path / "out")]) == 0

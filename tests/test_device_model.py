"""Devices as data (harness.plan.device), the kernels of the built-in layers (harness.plan.kernels) and the
roofline that costs them (analysis.device_model): every formula on hand-computed cases, the shipped descriptions,
and the refusals (exit 2, one message naming the file and the field)."""
from __future__ import annotations

import dataclasses
import tomllib
from collections import Counter

import pytest

from analysis.device_model import DeviceModel
from harness.commands.cli import main as harness_main
from harness.common.errors import SpecError, UserError
from harness.plan.device import (
    CURVES,
    REQUIRED_DTYPES,
    Curve,
    DeviceDescription,
    OptimizerCost,
    WrapperCost,
    load_device,
    parse_device,
    shipped_devices,
)
from harness.plan.events import OPTIMIZER_BYTES_PER_PARAMETER, build_plan
from harness.plan.kernels import (
    NORM_KINDS,
    Attention,
    Gemm,
    MemoryBound,
    PassShape,
    event_kernels,
    kernels_flops,
    layer_kernels,
    reduce_kernels,
    unshard_kernels,
    unshard_tensors,
)
from harness.plan.layers import describe, fused_softmax
from harness.plan.spec import loads_spec
from tests.helpers import tiny_spec_text

SHIPPED = ("a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200")
# the datasheets' figures (docs/devices.md): HBM GB, HBM GB/s, dense bfloat16 matrix TFLOP/s
DATASHEETS = {"a100-40gb": (40, 1555, 312), "a100-80gb": (80, 2039, 312), "h100-sxm": (80, 3350, 989.5),
              "h200": (141, 4800, 989.5), "b200": (180, 8000, 2250)}


def flat_device(**changes) -> DeviceDescription:
    """A device whose curves are flat (half_at 0): matrix 100 TFLOP/s at 50% (GEMMs, attention), vector 10 TFLOP/s,
    1 TB/s of HBM at 80%, 5 us a launch; its ridge is 50e12 / 0.8e12 = 62.5 FLOPs a byte."""
    flat = {name: Curve(max_fraction=0.5, half_at=0.0) for name in CURVES}
    flat["memory"] = Curve(max_fraction=0.8, half_at=0.0)
    values = dict(name="flat", title="flat", memory_gb=16.0, memory_bandwidth=1e12,
                  matrix_peak={d: 100e12 for d in REQUIRED_DTYPES}, vector_peak={d: 10e12 for d in REQUIRED_DTYPES},
                  launch_s=5e-6, curves=flat)
    return DeviceDescription(**{**values, **changes})


def spec_of(name="gpt2-small", hidden=32, heads=4, ffn=64, seq=16, vocab=128, micro=2, tp=1, cp=1, cp_comm="ring",
            extra_strategy="", kv_heads=None):
    text = tiny_spec_text(name=name, hidden=hidden, heads=heads, ffn=ffn, seq=seq, vocab=vocab, micro=micro, tp=tp,
                          cp=cp, cp_comm=cp_comm, layers=2, global_batch=4)
    if kv_heads:
        text = text.replace("dtype = ", f"kv_heads = {kv_heads}\ndtype = ")
    return loads_spec(text.replace("[cluster]", extra_strategy + "[cluster]"))


# --- the kernels' formulas --------------------------------------------------------------------------------------------

def test_gemm_flops_and_bytes():
    gemm = Gemm("x", m=128, n=256, k=64, dtype="bfloat16")
    assert gemm.flops == 2 * 128 * 256 * 64 == 4_194_304
    assert gemm.bytes == (128 * 64 + 64 * 256 + 128 * 256) * 2 == 114_688
    batched = Gemm("x", m=128, n=256, k=64, dtype="float32", batch=3)
    assert batched.flops == 3 * 4_194_304 and batched.bytes == 3 * 57_344 * 4


def test_attention_flops_and_bytes():
    forward = Attention("a", "sdpa", batch=2, heads=4, q_len=16, kv_len=32, head_dim=8, dtype="bfloat16")
    assert forward.flops == 4 * 2 * 4 * 16 * 32 * 8 == 131_072
    # q, k, v read and the output written: 2 x 4 x 8 x (16 + 32 + 32 + 16) elements of 2 bytes
    assert forward.bytes == 2 * 4 * 8 * 2 * (16 + 32) * 2 == 12_288
    backward = Attention("a", "sdpa", 2, 4, 16, 32, 8, "bfloat16", backward=True)
    assert backward.flops == 262_144
    assert backward.bytes == 2 * 4 * 8 * (4 * 16 + 4 * 32) * 2 == 24_576  # q, o, do, dq and k, v, dk, dv
    materialized = Attention("a", "materialized", 2, 4, 16, 32, 8, "bfloat16")
    # the scores' matrix (2 x 4 x 16 x 32) written, read, written, read
    assert materialized.bytes == 12_288 + 4 * (2 * 4 * 16 * 32) * 2 == 45_056
    assert Attention("a", "materialized", 2, 4, 16, 32, 8, "bfloat16", backward=True).bytes == \
        24_576 + 7 * (2 * 4 * 16 * 32) * 2


def test_curve_fractions():
    curve = Curve(max_fraction=0.8, half_at=1e9)
    assert curve.fraction(1e9) == pytest.approx(0.4)
    assert curve.fraction(3e9) == pytest.approx(0.8 * 3 / 4)
    assert curve.fraction(0) == 0.0
    assert Curve(0.8, 1e9, steepness=2.0).fraction(2e9) == pytest.approx(0.8 / (1 + 0.25))
    assert Curve(0.8, 1e9, half_dim=16).fraction(1e9, smallest_dim=16) == pytest.approx(0.2)
    assert Curve(0.8, 0.0).fraction(1.0) == 0.8  # flat: no ramp


# --- the roofline -----------------------------------------------------------------------------------------------------

def test_roofline_compute_bound_gemm():
    model = DeviceModel(flat_device())
    gemm = Gemm("big", 4096, 4096, 4096, "bfloat16")
    time = model.kernel_time(gemm)
    assert time.compute_s == pytest.approx(2 * 4096 ** 3 / 50e12)
    assert time.memory_s == pytest.approx(3 * 4096 ** 2 * 2 / 0.8e12)
    assert time.bound == "compute"
    assert model.kernel_seconds(gemm) == pytest.approx(5e-6 + 2 * 4096 ** 3 / 50e12)


def test_roofline_memory_bound_gemm_and_kernel():
    model = DeviceModel(flat_device())
    skinny = Gemm("skinny", 4096, 4096, 1, "bfloat16")  # 2 x 4096^2 FLOPs on 2 x (2 x 4096 + 4096^2) bytes
    time = model.kernel_time(skinny)
    assert time.bound == "memory"
    assert model.kernel_seconds(skinny) == pytest.approx(5e-6 + (2 * 4096 + 4096 ** 2) * 2 / 0.8e12)
    norm = MemoryBound("norm", 8e6, "bfloat16", flops=1e6, launches=2)  # 1e6 / 10e12 s against 8e6 / 0.8e12 s
    assert model.kernel_seconds(norm) == pytest.approx(2 * 5e-6 + 1e-5)
    heavy = MemoryBound("loss", 8e6, "bfloat16", flops=1e9)  # past the vector ridge: 1e9 / 10e12
    assert model.kernel_seconds(heavy) == pytest.approx(5e-6 + 1e-4)
    assert model.event_seconds([skinny, norm]) == pytest.approx(model.kernel_seconds(skinny)
                                                                 + model.kernel_seconds(norm))


def test_a_causal_kernels_share_by_hand():
    """causal_fraction: each query's keys up to its own, rounded up to a whole block."""
    from harness.plan.kernels import causal_fraction

    assert causal_fraction(32, 32, 512) == 1.0  # one block: the whole square, masked
    assert causal_fraction(1024, 1024, 512) == 0.75  # (512 x 512 + 512 x 1024) / 1024^2
    assert causal_fraction(10, 10, 4) == pytest.approx(0.68)  # (4 x 4 + 4 x 8 + 2 x 10) / 100
    assert causal_fraction(4, 4, 1) == pytest.approx(10 / 16)  # (1 + 2 + 3 + 4) / 16
    assert causal_fraction(2048, 2048, 0) == 0.5  # no block: the masked half skipped
    assert causal_fraction(512, 1024, 64) == 0.5  # a context-parallel ring's chunk
    bert = Attention("a", "sdpa", 1, 2, 64, 64, 32, "float32", causal=False)
    assert bert.executed_flops(512) == bert.executed_flops(0) == bert.flops
    mask = Attention("a", "materialized", 1, 2, 64, 64, 32, "float32")
    assert mask.executed_flops(16) == mask.flops


def test_roofline_attention_and_curves():
    model = DeviceModel(flat_device())
    causal = Attention("a", "sdpa", 8, 16, 2048, 2048, 128, "bfloat16")
    full = Attention("a", "sdpa", 8, 16, 2048, 2048, 128, "bfloat16", causal=False)
    # a fused kernel skips the masked half; the materialised one computes the whole square
    assert model.kernel_time(causal).compute_s == pytest.approx(causal.flops / 2 / 50e12)
    assert model.kernel_time(full).compute_s == pytest.approx(full.flops / 50e12)
    # with key blocks of 512 (2,048 keys: 4 blocks), the queries of block j compute j x 512 keys: 10 / 16 of the square
    tiled = DeviceModel(dataclasses.replace(flat_device(), causal_tile=512))
    assert tiled.kernel_time(causal).compute_s == pytest.approx(causal.flops * 10 / 16 / 50e12)
    assert tiled.kernel_time(full).compute_s == pytest.approx(full.flops / 50e12)
    materialized = Attention("a", "materialized", 8, 16, 2048, 2048, 128, "bfloat16", launches=3)
    assert model.kernel_time(materialized).compute_s == pytest.approx(full.flops / 50e12)
    assert model.kernel_time(materialized).launch_s == pytest.approx(15e-6)
    # a ramped GEMM curve: at half_at FLOPs half of max_fraction, times the smallest dimension's factor
    ramped = DeviceModel(flat_device(curves={**flat_device().curves, "gemm": Curve(0.5, 2 * 64 ** 3, half_dim=64)}))
    assert ramped.kernel_time(Gemm("g", 64, 64, 64, "float16")).compute_s == \
        pytest.approx(2 * 64 ** 3 / (100e12 * 0.25 * 0.5))
    # the memory curve by bytes
    slow = DeviceModel(flat_device(curves={**flat_device().curves, "memory": Curve(0.8, 8e6)}))
    assert slow.kernel_time(MemoryBound("m", 8e6, "float32")).memory_s == pytest.approx(8e6 / 0.4e12)


def test_dtype_picks_its_peak():
    device = flat_device(matrix_peak={"float32": 20e12, "bfloat16": 100e12, "float16": 100e12})
    model = DeviceModel(device)
    assert model.kernel_time(Gemm("g", 4096, 4096, 4096, "float32")).compute_s == pytest.approx(2 * 4096 ** 3 / 10e12)


# --- the kernels of the built-in layers -------------------------------------------------------------------------------

CONFIGS = [dict(name="gpt2-small"), dict(name="bert-base"), dict(name="llama-1b", kv_heads=2),
           dict(name="gpt2-small", tp=2, extra_strategy="sp = true\n"), dict(name="llama-1b", tp=2, cp=2),
           dict(name="bert-base", tp=2, extra_strategy="sp = true\n"),
           dict(name="gpt2-small", tp=2, extra_strategy="vocab_parallel = false\n"),
           dict(name="gpt2-small", cp=2, cp_comm="allgather")]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}".strip() for k, v in c.items()))
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_kernel_flops_agree_with_the_layers(config, recompute):
    spec = spec_of(**config)
    for attention in ("sdpa", "materialized"):
        shape = PassShape(micro=2, seq=spec.model.seq_len // spec.strategy.cp, recompute=recompute,
                          attention=attention)
        for layer in describe(spec):
            forward = layer.fwd_flops(shape.micro, shape.seq)
            assert kernels_flops(layer_kernels(layer, shape, "fwd")) == pytest.approx(forward, rel=1e-12)
            assert kernels_flops(layer_kernels(layer, shape, "bwd")) == pytest.approx(2 * forward, rel=1e-12)
            # a split backward's halves hold the whole backward's kernels, and its norms' weight gradients again
            split = Counter(layer_kernels(layer, shape, "bwd_input") + layer_kernels(layer, shape, "bwd_weight"))
            again = split - Counter(layer_kernels(layer, shape, "bwd"))
            assert split - again == Counter(layer_kernels(layer, shape, "bwd"))
            norms = [k.name for k in layer_kernels(layer, shape, "fwd") if getattr(k, "op", "") in NORM_KINDS]
            assert sorted(k.name for k in again.elements()) == sorted(f"{n}.grad_weight" for n in norms)
            assert all(k.weight_gradient for k in layer_kernels(layer, shape, "bwd_weight"))
    # and every compute event of the plan, from its content alone
    plan = build_plan(spec)
    for event in plan.events.values():
        if event.kind == "compute":
            assert kernels_flops(event_kernels(event.content)) == pytest.approx(event.cost, rel=1e-12), event.name


def test_block_kernels_by_hand():
    """GPT-2, hidden 32, 4 heads, ffn 64, 2 x 16 tokens, float32, tp 2 with sequence parallelism."""
    spec = spec_of(tp=2, extra_strategy="sp = true\n")
    block = describe(spec)[1]
    kernels = {k.name: k for k in layer_kernels(block, PassShape(micro=2, seq=16), "fwd")}
    assert list(kernels) == ["norm1", "qkv.gathered", "qkv", "attention", "context_copy", "proj", "proj.scattered",
                             "residual1", "norm2", "mlp.gathered", "fc1", "gelu", "fc2", "mlp.scattered", "residual2"]
    assert (kernels["qkv"].m, kernels["qkv"].n, kernels["qkv"].k) == (32, 48, 32)
    assert (kernels["proj"].m, kernels["proj"].n, kernels["proj"].k) == (32, 32, 16)
    assert (kernels["fc1"].m, kernels["fc1"].n, kernels["fc1"].k) == (32, 32, 32)
    assert (kernels["fc2"].m, kernels["fc2"].n, kernels["fc2"].k) == (32, 32, 32)
    attention = kernels["attention"]
    shape = (attention.batch, attention.heads, attention.q_len, attention.kv_len, attention.head_dim)
    assert shape == (2, 2, 16, 16, 8)
    assert attention.causal and attention.kind == "sdpa"
    assert kernels["norm1"].bytes == 2 * (32 // 2) * 32 * 4  # sp: seq / tp tokens, read and written
    assert kernels["residual1"].bytes == 3 * 16 * 32 * 4
    assert kernels["gelu"].bytes == 2 * 32 * 32 * 4
    backward = {k.name: k for k in layer_kernels(block, PassShape(micro=2, seq=16), "bwd")}
    grad_input, grad_weight = backward["qkv.grad_input"], backward["qkv.grad_weight"]
    assert (grad_input.m, grad_input.n, grad_input.k) == (32, 32, 48)
    assert (grad_weight.m, grad_weight.n, grad_weight.k) == (32, 48, 32) and grad_weight.weight_gradient
    assert backward["norm1.grad"].bytes == 1.5 * kernels["norm1"].bytes
    assert backward["attention.grad"].backward
    # sp's exchanges copy the whole sequence's 32 tokens x 32 once each (read and written): forward a gathered buffer
    # out before each column linear and the partial sums in before each reduce-scatter; backward the column linear's
    # two (its input's gradient into a reduce-scatter's buffer, its input gathered again) and the scatter's gather
    whole = 2 * 32 * 32 * 4
    for name in ("qkv.gathered", "proj.scattered", "mlp.gathered", "mlp.scattered"):
        assert (kernels[name].bytes, kernels[name].launches, kernels[name].op) == (whole, 1, "copy")
    for name, copies in (("qkv.gathered", 2), ("proj.scattered", 1), ("mlp.gathered", 2), ("mlp.scattered", 1)):
        assert (backward[f"{name}.grad"].bytes, backward[f"{name}.grad"].launches) == (copies * whole, copies)
    without = {k.name for k in layer_kernels(describe(spec_of(tp=2))[1], PassShape(micro=2, seq=16), "fwd")}
    assert not any(name.endswith(("gathered", "scattered")) for name in without)


def test_sequence_parallel_embedding_and_head_by_hand():
    """With sp the embedding reduce-scatters its 32 tokens' rows (the partial sums copied into the buffer once)
    and the head norms its sequence shard of 16 tokens, then gathers all 32 (the buffer copied out once)."""
    spec = spec_of(tp=2, extra_strategy="sp = true\n")
    embedding, head = describe(spec)[0], describe(spec)[-1]
    shape, whole = PassShape(micro=2, seq=16), 2 * 32 * 32 * 4
    forward = [k.name for k in layer_kernels(embedding, shape, "fwd")]
    assert forward[forward.index("embedding.outside_zeroed") + 1] == "embedding.scattered"
    kernels = {k.name: k for k in layer_kernels(head, shape, "fwd")}
    assert list(kernels)[:3] == ["final_norm", "head.gathered", "logits"]
    assert kernels["final_norm"].bytes == 2 * 16 * 32 * 4 and kernels["head.gathered"].bytes == whole
    assert kernels["logits"].m == 32


def test_llama_block_kernels_by_hand():
    spec = spec_of(name="llama-1b", kv_heads=2)
    kernels = {k.name: k for k in layer_kernels(describe(spec)[1], PassShape(micro=2, seq=16), "fwd")}
    assert kernels["qkv"].n == (4 + 2 * 2) * 8
    assert kernels["rotary"].bytes == kernels["repeat_kv"].bytes == 2 * 32 * (4 + 2) * 8 * 4
    assert kernels["gate_up"].n == 2 * 64 and kernels["down"].k == 64
    assert kernels["swiglu"].bytes == 3 * 32 * 64 * 4


def test_embedding_and_head_kernels_by_hand():
    """GPT-2's embedding runs what harness.models' Embedding dispatches (embedding, embedding of the positions,
    add): 2 x 16 tokens of hidden 32 in float32, the token lookup its 32 ids and rows read and written, the 16
    positions' likewise, the add the tokens' rows read and written and the positions' read (broadcast over the
    micro-batch); the layer's h FLOPs a token on the lookup. Its backward: the add's, each lookup's, and each
    table's dense gradient zeroed (the vocabulary's 128 rows, the positions' 16)."""
    spec = spec_of()  # GPT-2, vocab 128, hidden 32, 32 tokens, float32
    embedding, head = describe(spec)[0], describe(spec)[-1]
    lookup, positions, add = layer_kernels(embedding, PassShape(2, 16), "fwd")
    assert (lookup.name, positions.name, add.name) == ("embedding.lookup", "embedding.positions",
                                                       "embedding.add_positions")
    assert lookup.flops == 32 * 32 and positions.flops == add.flops == 0
    assert lookup.bytes == 32 * (8 + 2 * 32 * 4) and positions.bytes == 16 * (8 + 2 * 32 * 4)
    assert add.bytes == (2 * 32 + 16) * 32 * 4 and add.elements == 32 * 32
    backward = layer_kernels(embedding, PassShape(2, 16), "bwd")
    assert [k.name for k in backward] == ["embedding.add_positions.grad", "embedding.positions.grad",
                                          "embedding.lookup.grad", "embedding.table_grad_fill",
                                          "embedding.positions_grad_fill"]
    assert backward[-2].bytes == 128 * 32 * 4 and backward[-1].bytes == 16 * 32 * 4
    norm, logits, loss = layer_kernels(head, PassShape(2, 16), "fwd")
    assert (logits.m, logits.n, logits.k) == (32, 128, 32)
    assert loss.flops == 5 * 32 * 128 and loss.bytes == 3 * 32 * 128 * 4


def test_a_vocabulary_shards_embedding_by_hand():
    """BERT's embedding split by vocabulary over tp = 2 with sequence parallelism and dropout 0.1, 2 x 16 tokens of
    hidden 32, float32, as harness.models' Embedding runs it: the ids moved into the shard and masked (sub, lt, ge,
    or, masked_fill: 5 launches, 70 bytes a token, no gradient), the lookup, the rows outside the shard zeroed (a
    copy and a fill), the partial sums copied into the reduce-scatter's buffer; after it a rank's 2 x 8 tokens get
    its 8 positions (lookup and add), the token type's row added, the LayerNorm and the dropout."""
    text = tiny_spec_text(name="bert-base", hidden=32, heads=4, ffn=64, seq=16, vocab=128, micro=2, tp=2, layers=2,
                          global_batch=4).replace("[strategy]\n", "[strategy]\nsp = true\n")
    spec = loads_spec(text.replace('dtype = "float32"', 'dtype = "float32"\ndropout = 0.1'))
    embedding = describe(spec)[0]
    forward = {k.name: k for k in layer_kernels(embedding, PassShape(2, 16, dropout=0.1), "fwd")}
    assert list(forward) == ["embedding.vocab_mask", "embedding.lookup", "embedding.outside_zeroed",
                             "embedding.scattered", "embedding.positions", "embedding.add_positions",
                             "embedding.add_token_type", "embedding.norm", "embedding.dropout"]
    mask = forward["embedding.vocab_mask"]
    assert (mask.launches, mask.bytes, mask.elements) == (5, 32 * 70, 32)
    assert forward["embedding.outside_zeroed"].bytes == 32 * (4 * 32 * 4 + 1)
    assert forward["embedding.scattered"].bytes == 2 * 32 * 32 * 4
    assert forward["embedding.positions"].elements == 8 * 32  # this rank's half of the sequence
    assert forward["embedding.add_positions"].bytes == (2 * 16 + 8) * 32 * 4
    assert forward["embedding.add_token_type"].bytes == (2 * 16 + 1) * 32 * 4
    assert forward["embedding.dropout"].bytes == 16 * 32 * (2 * 4 + 1)
    backward = [k.name for k in layer_kernels(embedding, PassShape(2, 16, dropout=0.1), "bwd")]
    assert "embedding.vocab_mask.grad" not in backward and backward[-2:] == [
        "embedding.table_grad_fill", "embedding.positions_grad_fill"]
    assert layer_kernels(embedding, PassShape(2, 16, dropout=0.1), "bwd")[-2].elements == 64 * 32  # the shard's rows


def test_a_16_bit_heads_loss_runs_on_float32_logits_torchs_or_megatrons():
    """The logits made float32 (2 + 4 bytes a logit), then torch's log-softmax (3 float32 passes) or, for a head
    split by vocabulary or a Megatron-LM loss, Megatron-LM's max, shift, exponential, sum and division (8 passes, 5
    launches) whose backward scales the saved softmax in place (2 passes, 1 launch)."""
    logits = 32 * 128  # 2 x 16 tokens, vocab 128

    def head_of(text_change="", tp=1):
        text = tiny_spec_text(hidden=32, heads=4, ffn=64, seq=16, vocab=128, micro=2, tp=tp, layers=2, global_batch=4)
        spec = loads_spec(text.replace('dtype = "float32"', 'dtype = "bfloat16"' + text_change))
        return describe(spec)[-1]

    _, _, upcast, loss = layer_kernels(head_of(), PassShape(2, 16), "fwd")
    assert (upcast.name, upcast.bytes, upcast.dtype) == ("logits_float32", logits * (2 + 4), "bfloat16")
    assert (loss.bytes, loss.dtype, loss.launches) == (3 * logits * 4, "float32", 1)
    assert layer_kernels(head_of(), PassShape(2, 16), "bwd")[0].bytes == 1.5 * 3 * logits * 4
    megatron = head_of('\ncross_entropy = "megatron"')
    assert ("cross_entropy", "megatron") in megatron.signature
    *_, loss = layer_kernels(megatron, PassShape(2, 16), "fwd")
    assert (loss.bytes, loss.launches) == (8 * logits * 4, 5)
    grad = layer_kernels(megatron, PassShape(2, 16), "bwd")[0]
    assert (grad.op, grad.bytes, grad.launches) == ("cross_entropy_backward", 2 * logits * 4, 1)
    split = head_of(tp=2)  # split by vocabulary: Megatron-LM's loss over the shard's 64 entries
    *_, loss = layer_kernels(split, PassShape(2, 16), "fwd")
    assert (loss.bytes, loss.launches) == (8 * logits // 2 * 4, 5)
    assert "cross_entropy" not in dict(split.signature)
    float32_head = describe(spec_of())[-1]
    assert [k.name for k in layer_kernels(float32_head, PassShape(2, 16), "fwd")] == \
        ["final_norm", "logits", "cross_entropy"]  # float32 logits: nothing to convert


@pytest.mark.parametrize("micro, heads, seq, fused", [
    (1, 2, 1024, False), (2, 2, 1024, True), (1, 4, 1024, True), (3, 2, 1024, False), (1, 4, 128, False),
    (2, 4, 128, True), (2, 2, 4100, False), (8, 2, 16, False)])
def test_megatrons_fused_softmax_or_its_float32_fallback(micro, heads, seq, fused):
    """Megatron-LM's FusedScaleMaskSoftmax takes 16-bit scores of 16 < keys <= 4096 (multiples of 4) when micro x
    local heads is a multiple of its batches a block (4 from 128 keys on, 8 below); else the softmax runs in float32:
    4 more launches and 32 more bytes a score forward (36 against the fused 4), 34 backward (40 against 6)."""
    assert fused_softmax(2, micro * heads, seq, seq) is fused
    assert fused_softmax(4, micro * heads, seq, seq)  # no fused kernel, no fallback: the softmax as it is
    # a padding mask (BERT's): the queries, not micro x heads, a multiple of the batches a block (micro x heads of 4)
    assert fused_softmax(2, 4, 64, 64, causal=False) and not fused_softmax(2, 4, 60, 60, causal=False)
    assert not fused_softmax(2, 2, 64, 64, causal=False)
    spec = loads_spec(tiny_spec_text(hidden=32 * heads, heads=heads, ffn=64, seq=seq, vocab=128, micro=micro,
                                     layers=2, global_batch=micro).replace('dtype = "float32"', 'dtype = "float16"'))
    block = describe(spec)[1]
    shape = PassShape(micro, seq, attention="materialized")
    names = {k.name: k for k in layer_kernels(block, shape, "fwd")}
    assert ("attention_softmax_float32" in names) is not fused
    if not fused:
        scores = micro * heads * seq * seq
        extra = names["attention_softmax_float32"]
        assert (extra.bytes, extra.launches) == (32 * scores, 4)
        grad = next(k for k in layer_kernels(block, shape, "bwd") if k.name == "attention_softmax_float32.grad")
        assert (grad.bytes, grad.launches) == (34 * scores, 4)


def test_attention_kinds_context_parallel_and_selective_recompute():
    # a ring of 2 (GPT-2, 4 heads of 8, 2 x 8 local tokens in chunks of 4): rank 1 runs the most blocks, step 0 its
    # own chunks (1, 2) as chunk 1 against 1 (masked) and chunk 2 against 1 and 2 (masked), step 1 rank 0's (0, 3)
    # as chunk 1 against 0 and chunk 2 against 0: 3 and 2 of the 4 chunk pairs of a step's square
    spec = spec_of(cp=2)
    block = describe(spec)[1]
    kernels = {k.name: k for k in layer_kernels(block, PassShape(2, 8), "fwd") if k.name.startswith("ring.")}
    assert list(kernels) == ["ring.setup", "ring.masks", "ring.attention.0", "ring.merge.0", "ring.attention.1",
                             "ring.merge.1"]
    steps = [kernels["ring.attention.0"], kernels["ring.attention.1"]]
    assert [(k.kind, k.q_len, k.kv_len, k.launches, k.computed, k.diagonal) for k in steps] == \
        [("sdpa", 8, 8, 2, 0.25, 0.5), ("sdpa", 8, 8, 2, 0.5, 0.0)]
    assert sum(k.flops for k in steps) == 4 * 2 * 4 * 8 * 16 * 8  # the whole square, as the layer counts it
    # the diagonal chunks whole in key blocks of 512 (a CPU's), half without a tile (Megatron-Core's flash kernels)
    assert steps[0].executed_flops(512) == 0.75 * steps[0].flops
    assert steps[0].executed_flops(0) == 0.5 * steps[0].flops
    assert [kernels[f"ring.merge.{i}"].launches for i in (0, 1)] == [20, 20]
    assert kernels["ring.masks"].launches == 4 + 6  # the diagonal chunk's mask, and a full chunk's beside one
    materialized = PassShape(2, 8, attention="materialized")
    forward = [k for k in layer_kernels(block, materialized, "fwd") if isinstance(k, Attention)]
    backward = [k for k in layer_kernels(block, materialized, "bwd") if isinstance(k, Attention)]
    assert [(k.kind, k.dtype, k.launches) for k in forward] == [("materialized", "float32", 6)] * 2
    assert [k.launches for k in backward] == [10, 10]
    assert {"ring.scores.0", "ring.scores.1"} <= {k.name for k in layer_kernels(block, materialized, "fwd")}
    # a causal all-gather's mask is a tensor: every score of the gathered square computed
    gathered = spec_of(cp=2, cp_comm="allgather")
    attention, = [k for k in layer_kernels(describe(gathered)[1], PassShape(2, 8), "fwd") if isinstance(k, Attention)]
    assert (attention.kv_len, attention.executed_flops(512)) == (16, attention.flops)
    one = describe(spec_of())[1]
    dropped = [k.name for k in layer_kernels(one, PassShape(2, 16, attention="materialized", dropout=0.1), "fwd")]
    assert {"attention_dropout", "dropout1", "dropout2"} <= set(dropped)
    selective = PassShape(2, 16, recompute="selective")
    attention_flops = next(k for k in layer_kernels(one, selective, "fwd") if isinstance(k, Attention)).flops
    assert kernels_flops(layer_kernels(one, selective, "bwd")) == \
        pytest.approx(2 * one.fwd_flops(2, 16) + attention_flops)


def test_optimizer_kernels():
    plan = build_plan(spec_of())
    step = next(e for e in plan.events.values() if e.content.get("phase") == "optimizer")
    kernel, = event_kernels(step.content)
    params = step.content["params"]
    assert kernel.flops == 12 * params and kernel.bytes == params * OPTIMIZER_BYTES_PER_PARAMETER
    assert kernel.launches == 4  # the embedding, 2 blocks, the head


def test_an_optimizer_steps_in_the_weights_dtype():
    """A bfloat16 job's optimizer steps its bfloat16 weights and states (harness train keeps no other copy): half a
    float32 step's bytes, the event's and its kernel's, and on a description measured tensor by tensor the counted
    float32 bytes scaled alike; with master weights it steps float32 copies. Adam's event keeps its id."""
    from harness.plan.device import OptimizerCost

    def step_of(spec):
        event = next(e for e in build_plan(spec).events.values() if e.content.get("phase") == "optimizer")
        return event, event_kernels(event.content)[0]

    text = tiny_spec_text(layers=2, global_batch=4)
    full_event, full = step_of(loads_spec(text))
    half_event, half = step_of(loads_spec(text.replace('dtype = "float32"', 'dtype = "bfloat16"')))
    params = full_event.content["params"]
    assert (full.dtype, half.dtype) == ("float32", "bfloat16") and half_event.content["params"] == params
    assert half.bytes == params * OPTIMIZER_BYTES_PER_PARAMETER / 2 == half_event.traffic
    assert "master_weights" not in half_event.content
    master_event, master = step_of(loads_spec(text.replace('dtype = "float32"', 'dtype = "bfloat16"')
                                              .replace("[cluster]", "[optimizer]\nmaster_weights = true\n[cluster]")))
    assert master_event.content["master_weights"] is True and master.dtype == "float32"
    assert master.bytes == params * OPTIMIZER_BYTES_PER_PARAMETER
    measured = DeviceModel(flat_device(optimizer={"adam": OptimizerCost(0.0, 1.0, 52.0, 0.0, 1e9)}))
    assert measured.kernel_time(half).memory_s == pytest.approx(params * 26 / 1e9)
    assert measured.kernel_time(full).memory_s == pytest.approx(params * 52 / 1e9)


def test_layers_without_kernels_are_refused():
    spec = loads_spec(tiny_spec_text(name="mixtral-8x7b", hidden=32, heads=4, ffn=64, layers=2, global_batch=4)
                      .replace("dtype = ", "kv_heads = 4\nexperts = 4\ntop_k = 2\nexpert_ffn = 32\ndtype = "))
    moe = describe(spec)[1]
    with pytest.raises(UserError, match="Mixture-of-Experts"):
        layer_kernels(moe, PassShape(2, 16), "fwd")
    with pytest.raises(UserError, match="factory model"):
        event_kernels({"layer": "user", "signature": {}, "micro": 1, "seq": 1, "phase": "fwd"})


# --- the shipped descriptions and the spec ----------------------------------------------------------------------------

def test_shipped_descriptions_load_and_validate():
    assert set(SHIPPED) <= set(shipped_devices())
    for name in SHIPPED:
        device = load_device(name)
        memory_gb, bandwidth_gbs, bf16_tflops = DATASHEETS[name]
        assert (device.name, device.memory_gb) == (name, memory_gb)
        assert device.memory_bandwidth == bandwidth_gbs * 1e9
        assert device.matrix_peak["bfloat16"] == pytest.approx(bf16_tflops * 1e12)
        assert not device.fitted  # starting values until a fit (docs/devices.md)
        assert set(device.curves) == set(CURVES)
        assert all(0 < curve.max_fraction <= 1 for curve in device.curves.values())
        # what a fit writes back loads as the same description
        assert parse_device(tomllib.loads(device.to_toml()), source="refit") == device
        odd = dataclasses.replace(device, name='a "b"\nc\\d', fitted_on="tab\there")  # what --name may hold
        assert parse_device(tomllib.loads(odd.to_toml()), source="refit") == odd
        model = DeviceModel.named(name)
        big = Gemm("g", 8192, 8192, 8192, "bfloat16")
        achieved = big.flops / model.kernel_seconds(big)
        assert 0.3 * device.matrix_peak["bfloat16"] < achieved < device.matrix_peak["bfloat16"]


def test_spec_device_sets_the_memory(tmp_path):
    text = tiny_spec_text().replace("[cluster]", "[cluster]\ndevice = \"h200\"")
    spec = loads_spec(text)
    assert spec.cluster.device == "h200" and spec.cluster.device_memory_gb == 141
    given = loads_spec(text.replace("[cluster]", "[cluster]\ndevice_memory_gb = 100"))
    assert given.cluster.device_memory_gb == 100  # the spec's own figure wins
    assert loads_spec(spec.to_toml()) == spec
    assert spec.with_changes(micro=1).cluster.device == "h200"
    mine = tmp_path / "mine.toml"
    mine.write_text(load_device("a100-40gb").to_toml().replace('name = "a100-40gb"', 'name = "mine"'))
    assert loads_spec(text.replace('"h200"', f'"{mine}"')).cluster.device_memory_gb == 40
    assert loads_spec(tiny_spec_text()).cluster.device is None


# --- refusals ---------------------------------------------------------------------------------------------------------

def description_text(**replace) -> str:
    text = load_device("a100-80gb").to_toml()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("old, new, field, message", [
    ("max_fraction = 0.8\n", "max_fration = 0.8\n", "efficiency.gemm.max_fration", "unknown field"),
    ("memory_bandwidth_gb_s = 2039.0", "memory_bandwidth_gb_s = -2039.0", "datasheet.memory_bandwidth_gb_s",
     "finite number above 0"),
    ("launch_us = 4.0", "launch_us = -1.0", "efficiency.launch_us", "0 or more"),
    # finite but no device's: a typo or a unit (a time of 1e300 s, or a figure printed with 300 digits)
    ("memory_bandwidth_gb_s = 2039.0", "memory_bandwidth_gb_s = 1e300", "datasheet.memory_bandwidth_gb_s",
     "beyond any device's figure .* check the unit"),
    ("tfloat32 = 156.0", "tfloat32 = 1e-300", "datasheet.matrix_tflops.tfloat32", "from 1e-09 to 1e.15"),
    ("launch_us = 4.0", "launch_us = 1e20", "efficiency.launch_us", r"give one at most 1e\+15"),
    ("max_fraction = 0.8\n", "max_fraction = 5e-324\n", "efficiency.gemm.max_fraction", "from 1e-09"),
    ("max_fraction = 0.8\n", "max_fraction = 1.5\n", "efficiency.gemm.max_fraction", "at most 1"),
    ("steepness = 1.0\n", "steepness = 1000.0\n", "efficiency.gemm.steepness", "at most 8 .a steeper curve is a step"),
    ("format = 1", "format = 3", "format", "unsupported device format"),
    ("fitted = false\n", "fitted = false\n[vector_ops]\ngelu = 3.0\n", "vector_ops", "format 2 table"),
    ("fitted = false\n", "fitted = false\nhost = 5\n", "host", "must be a table"),
    ("fitted = false\n", "fitted = false\n[host]\ncollective_issue_us = -3.0\n", "host.collective_issue_us",
     "0 or more"),
    ("fitted = false\n", "fitted = false\n[host]\nstep_gap_us = -1.0\n", "host.step_gap_us", "0 or more"),
    ("fitted = false\n", "fitted = false\n[host]\ninline_collective_us = 900.0\n", "host.inline_collective_us",
     "a format 2 field"),
    ("fitted = false\n", "fitted = false\n[host]\np2p_late_us = 180.0\n", "host.p2p_late_us", "a format 2 field"),
    ("fitted = false\n", "fitted = false\n[host]\np2p_post_us_per_mib = 240.0\n", "host.p2p_post_us_per_mib",
     "a format 2 field"),
    ("fitted = false\n", "fitted = false\nprocessor = \"tpu\"\n", "processor", "must be one of gpu, cpu"),
    ("format = 1\n", "\n", "format", "is missing; a description starts with format = 1"),
    ("launch_us = 4.0", "launch_us = 4.0\ncausal_tile = 128", "efficiency.causal_tile", "a format 2 field"),
    ("launch_us = 4.0", "launch_us = 4.0\ncausal_tile = 12.5", "efficiency.causal_tile", "a whole number of keys"),
    ("launch_us = 4.0", "launch_us = 4.0\ncausal_tile = -64", "efficiency.causal_tile", "from 0 .none"),
    ("launch_us = 4.0", "launch_us = 4.0\ncausal_tile = true", "efficiency.causal_tile", "got True"),
    ("launch_us = 4.0", "launch_us = 4.0\ncausal_tile = 2097152", "efficiency.causal_tile", "to 1,048,576"),
])
def test_bad_descriptions_name_file_and_field(tmp_path, old, new, field, message):
    path = tmp_path / "bad.toml"
    path.write_text(description_text(**{old: new}))
    with pytest.raises(SpecError, match=message) as caught:
        load_device(str(path))
    assert caught.value.field == field and caught.value.source == str(path)
    assert str(path) in str(caught.value) and f"[{field}]" in str(caught.value)
    assert str(caught.value).count(f"[{field}]") == 1  # the place once, not again in the message


def test_unknown_name_and_missing_file(tmp_path):
    with pytest.raises(SpecError, match="unknown device 'a100-99gb'; shipped: a100-40gb") as caught:
        load_device("a100-99gb")
    assert caught.value.field == "cluster.device"
    with pytest.raises(SpecError, match="not found"):
        load_device(str(tmp_path / "absent.toml"))
    with pytest.raises(SpecError, match="is a folder; give the description's TOML file"):
        load_device(str(tmp_path))
    for value in (5, ""):
        with pytest.raises(SpecError, match="must be a device name") as caught:
            load_device(value)
        assert caught.value.field == "cluster.device"
    with pytest.raises(SpecError, match=r"job.toml: \[cluster.device\] device description .*h100.toml. not found"):
        loads_spec(tiny_spec_text().replace("[cluster]", f"[cluster]\ndevice = \"{tmp_path}/h100.toml\""),
                   source="job.toml")


def test_cli_refuses_bad_devices_with_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(description_text(**{"memory_gb = 80.0": "memory_gb = -80.0"}))
    for device, expected in (("a100-99gb", "[cluster.device] unknown device 'a100-99gb'"),
                             (str(bad), f"{bad}: [datasheet.memory_gb] must be a finite number above 0")):
        spec = tmp_path / "spec.toml"
        spec.write_text(tiny_spec_text().replace("[cluster]", f"[cluster]\ndevice = \"{device}\""))
        assert harness_main(["events", str(spec)]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# --- the host's issue time ([host] kernel_issue_us) ----------------------------------------------------------------

def test_host_issue_time_is_the_launches_times_the_descriptions_figure():
    """A GPT-2 block's forward is 11 launches fused (3 for materialised attention), its backward 15 (attention's
    gradient 5 materialised): 2 per GEMM, 1 per other kernel."""
    model = DeviceModel(flat_device(kernel_issue_s=50e-6))
    spec = spec_of()
    plan = build_plan(spec)
    block = {plan.events[e].content["phase"]: plan.events[e] for e in plan.events
             if plan.events[e].name.startswith("gpt2.block")}
    assert model.issue_seconds(event_kernels(block["fwd"].content)) == pytest.approx(11 * 50e-6)
    assert model.issue_seconds(event_kernels(block["bwd"].content)) == pytest.approx(15 * 50e-6)
    materialized = build_plan(loads_spec(tiny_spec_text(layers=2, model={"attention": "materialized"})))
    fwd, bwd = (next(e for e in materialized.events.values() if e.name == f"gpt2.block.{phase}")
                for phase in ("fwd", "bwd"))
    assert model.issue_seconds(event_kernels(fwd.content)) == pytest.approx(13 * 50e-6)
    assert model.issue_seconds(event_kernels(bwd.content)) == pytest.approx(19 * 50e-6)
    assert DeviceModel(flat_device()).issue_seconds(event_kernels(fwd.content)) == 0.0  # no figure: no host time


def test_the_processor_round_trips_and_is_a_gpu_unless_said():
    cpu = flat_device(processor="cpu")
    text = cpu.to_toml()
    assert 'processor = "cpu"' in text and parse_device(tomllib.loads(text)) == cpu
    assert "processor" not in flat_device().to_toml()
    assert all(load_device(name).processor == "gpu" for name in SHIPPED)


def test_host_figure_round_trips_and_is_optional():
    described = flat_device(kernel_issue_s=72e-6)
    text = described.to_toml()
    assert "[host]\nkernel_issue_us = 72.0" in text
    assert parse_device(tomllib.loads(text)).kernel_issue_s == pytest.approx(72e-6)
    assert "[host]" not in flat_device().to_toml()
    assert all(load_device(name).kernel_issue_s == 0.0 for name in SHIPPED)
    both = flat_device(kernel_issue_s=72e-6, collective_issue_s=25e-6)
    assert "[host]\nkernel_issue_us = 72.0\ncollective_issue_us = 25.0" in both.to_toml()
    assert parse_device(tomllib.loads(both.to_toml())) == both
    assert all(load_device(name).collective_issue_s == 0.0 for name in SHIPPED)
    gapped = flat_device(step_gap_s=1.5e-3)
    assert "[host]\nstep_gap_us = 1500.0" in gapped.to_toml()
    assert parse_device(tomllib.loads(gapped.to_toml())) == gapped
    assert all(load_device(name).step_gap_s == 0.0 for name in SHIPPED)
    inline = flat_device(inline_collective_s=9e-4)  # a CPU calibration's: format 2
    assert inline.format == 2 and "[host]\ninline_collective_us = 900.0" in inline.to_toml()
    assert parse_device(tomllib.loads(inline.to_toml())) == inline
    assert all(load_device(name).inline_collective_s == 0.0 for name in SHIPPED)


def test_a_cpus_pipeline_send_figures_round_trip_and_give_a_line_in_the_bytes():
    """[host] p2p_post_us, p2p_sender_busy_us and p2p_late_us, each with its _per_mib (format 2): a send of half a
    MiB posts in 100 + 0.5 x 200 us, waits 300 + 0.5 x 100 us more for a computing sender and, received late, takes
    150 + 0.5 x 60 us from each end; none on the shipped GPUs."""
    sends = flat_device(p2p_post_s=1e-4, p2p_post_s_per_mib=2e-4, p2p_sender_busy_s=3e-4,
                        p2p_sender_busy_s_per_mib=1e-4, p2p_late_s=1.5e-4, p2p_late_s_per_mib=6e-5)
    text = sends.to_toml()
    assert sends.format == 2 and "[host]\np2p_post_us = " in text and "\np2p_late_us_per_mib = " in text
    assert parse_device(tomllib.loads(text)) == sends
    half = float(1 << 19)
    assert sends.p2p_post(half) == pytest.approx(200e-6)
    assert sends.p2p_sender_busy(half) == pytest.approx(350e-6)
    assert sends.p2p_late(half) == pytest.approx(180e-6)
    assert all(load_device(name).p2p_late(half) == 0.0 == load_device(name).p2p_post(half) for name in SHIPPED)
    with pytest.raises(SpecError, match="0 or more") as caught:
        parse_device({**tomllib.loads(text), "host": {"p2p_late_us": -1.0}})
    assert caught.value.field == "host.p2p_late_us"


def test_a_host_bound_spec_alone_runs_as_fast_as_its_host_issues(tmp_path):
    """One device, 2 GPT-2 blocks, one micro-batch, 1 ms of host time a kernel against microseconds on the device:
    the forward step is the host's 28 launches (embedding 3: the lookup, the positions' and their add; blocks 2 x
    11; head 3: norm, logits, loss) and the backward its 39 (head 4, blocks 2 x 15, embedding 5: the add's, both
    lookups' gradients and both tables' fills), one after another; the device's time and the optimizer add a
    little."""
    from analysis.predict import predict_spec

    path = tmp_path / "slow-host.toml"
    path.write_text(load_device("a100-80gb").to_toml() + "\n[host]\nkernel_issue_us = 1000.0\n")
    text = tiny_spec_text(layers=2, global_batch=2, micro=2).replace("[cluster]", f"[cluster]\ndevice = \"{path}\"")
    spec = loads_spec(text)
    host_bound = predict_spec(spec, resamples=0)
    device_bound = predict_spec(loads_spec(text.replace(str(path), "a100-80gb")), resamples=0)
    assert device_bound.timeline.batch_time_s < 5e-3
    issue = host_bound.costs.host_issue
    assert sorted(round(s * 1e3) for s in issue.values()) == sorted([3, 11, 3, 5, 15, 4])
    assert host_bound.timeline.batch_time_s == pytest.approx(67e-3, abs=device_bound.timeline.batch_time_s)
    assert host_bound.timeline.batch_time_s > 67e-3


# --- format 2: memory-bound kinds, the optimizer tensor by tensor, collectives in context ---------------------------

WRAPPED = dict(wrappers={"checkpointed": WrapperCost(100e-6, 300e-6), "fsdp2": WrapperCost(200e-6, 50e-6, 10e-6),
                         "split_backward": WrapperCost(0.0, 400e-6, weight_s=700e-6)},
               optimizer={"adam": OptimizerCost(9.0, 2.0, 76.0, 3e-6, 5e9)})


def test_a_wrapped_layers_framework_time_by_hand():
    """[wrappers] checkpointed 100 / 300 us, fsdp2 200 / 50 us and 10 us an optimizer kernel, split_backward 400 us
    the input's half and 700 us the weights': a forward of a layer both wrap 300 us, its backward 350 us; a split
    backward's input half of an FSDP2 layer 450 us (FSDP2's and the split's), its weights' half 700 us (the
    split's alone); an unwrapped layer nothing; an Adam step over FSDP2's shards of 3 tensors 10 us x (2 + 9 x 3)."""
    model = DeviceModel(flat_device(processor="cpu", **WRAPPED))
    both = {"checkpointed": True, "fsdp2": True}
    assert model.wrapper_seconds({"phase": "fwd", **both}, []) == pytest.approx(300e-6)
    assert model.wrapper_seconds({"phase": "bwd", **both}, []) == pytest.approx(350e-6)
    assert model.wrapper_seconds({"phase": "bwd_input", "fsdp2": True}, []) == pytest.approx(450e-6)
    assert model.wrapper_seconds({"phase": "bwd_weight", **both}, []) == pytest.approx(700e-6)
    assert model.wrappers_of({"phase": "bwd_weight", "fsdp2": True}) == ["fsdp2", "split_backward"]
    selective = {"signature": {"family": "gpt2", "recompute": "selective"}}  # its attention core checkpointed
    assert model.wrapper_seconds({"phase": "fwd", **selective}, []) == pytest.approx(100e-6)
    assert model.wrapper_seconds({"phase": "bwd", **selective}, []) == pytest.approx(300e-6)
    assert model.wrapper_seconds({"phase": "fwd"}, []) == 0.0
    step = MemoryBound("optimizer.step", 2_100 * 32.0, "float32", flops=12 * 2_100.0, launches=3, op="adam",
                       elements=2_100.0, tensors=((1_000, 2), (100, 1)))
    assert model.wrapper_seconds({"phase": "optimizer", "fsdp2": True}, [step]) == pytest.approx(290e-6)
    assert DeviceModel(flat_device()).wrapper_seconds({"phase": "fwd", **both}, []) == 0.0  # none described


UNSHARD = WrapperCost(200e-6, 50e-6, 10e-6, unshard_s=300e-6, unshard_tensor_s=20e-6, reduce_s=400e-6,
                      reduce_tensor_s=30e-6)


def test_fsdp2_unshard_by_hand():
    """A ZeRO all-gather of a GPT-2 block's unit (hidden 32, ffn 64: 12 parameter tensors) of 40,000 bytes over 2
    ranks: its shards copied in (2 x 20,000 bytes read and written) and out into the whole tensors (2 x 40,000),
    a copy a tensor each. On flat_device (0.8 TB/s, 5 us a launch): (40,000 + 80,000) / 0.8e12 s + 2 x 12 x 5 us =
    120.15 us of copies; [wrappers.fsdp2] unshard 300 us + 20 us a tensor: 540 us of framework."""
    content = {"bytes": 40_000, "group": 2, "dtype": "float32",
               "fsdp": {"layer": "block", "signature": describe(spec_of())[1].signature}}
    copy_in, copy_out = unshard_kernels(content)
    assert unshard_tensors(content) == 12
    assert (copy_in.bytes, copy_in.launches, copy_in.op) == (40_000, 12, "copy")
    assert (copy_out.bytes, copy_out.launches, copy_out.elements) == (80_000, 12, 10_000)
    copies, framework = DeviceModel(flat_device(wrappers={"fsdp2": UNSHARD})).unshard_seconds(content)
    assert copies == pytest.approx(120_000 / 0.8e12 + 24 * 5e-6)
    assert framework == pytest.approx(300e-6 + 12 * 20e-6)
    assert DeviceModel(flat_device()).unshard_seconds(content)[1] == 0.0  # none described: the copies alone
    unknown = {**content, "fsdp": {"layer": "user", "signature": {}}}  # a factory's layer: its tensors unknown
    assert unshard_tensors(unknown) == 1 and unshard_kernels(unknown)[0].launches == 1


def test_fsdp2_reduce_by_hand():
    """A ZeRO reduce-scatter of the same unit's 40,000 bytes of gradients over 2 ranks: the whole gradients copied
    into its input by one op (2 x 40,000 bytes read and written; the shards it writes are views). On flat_device:
    80,000 / 0.8e12 s + 5 us = 5.1 us of copy-in; [wrappers.fsdp2] reduce 400 us + 30 us a tensor: 760 us."""
    content = {"bytes": 40_000, "group": 2, "dtype": "float32",
               "fsdp": {"layer": "block", "signature": describe(spec_of())[1].signature}}
    (copy_in,) = reduce_kernels(content)
    assert (copy_in.bytes, copy_in.launches, copy_in.op, copy_in.elements) == (80_000, 1, "copy", 10_000)
    copies, framework = DeviceModel(flat_device(wrappers={"fsdp2": UNSHARD})).reduce_seconds(content)
    assert copies == pytest.approx(80_000 / 0.8e12 + 5e-6)
    assert framework == pytest.approx(400e-6 + 12 * 30e-6)
    assert DeviceModel(flat_device()).reduce_seconds(content)[1] == 0.0  # none described: the copy-in alone


def test_an_unmeasured_zero_collective_gains_fsdp2s_work_and_keeps_its_note():
    """with_fsdp2 on an all-gather interpolated between a profile's bare points: its seconds plus the unshard's,
    its note the interpolation's with the unshard's in place of "not in it"; a reduce-scatter so with the reduce's;
    a measured one and an all-gather outside ZeRO as they are."""
    from analysis.costs.device_source import with_fsdp2
    from analysis.costs.records import EventCost
    from harness.plan.events import Event

    content = {"bytes": 40_000, "group": 2, "dtype": "float32",
               "fsdp": {"layer": "block", "signature": describe(spec_of())[1].signature}}
    model = DeviceModel(flat_device(wrappers={"fsdp2": UNSHARD}))
    gather = Event("g", "allgather", "allgather 39KiB x2 intra fsdp", content, cost=40_000.0)
    cost = EventCost("g", gather.name, "allgather", 1e-3, "interpolated",
                     note="interpolated between the 32KiB and 64KiB measured; FSDP2's copies not in it (the bare "
                          "collective's curve)")
    done = with_fsdp2(model, gather, cost)
    assert done.seconds == pytest.approx(1e-3 + sum(model.unshard_seconds(content)))
    assert done.note == ("interpolated between the 32KiB and 64KiB measured; FSDP2's unshard on the device model "
                         "(flat): copies 0.12 ms, framework 0.54 ms")
    measured = dataclasses.replace(cost, source="measured")
    assert with_fsdp2(model, gather, measured) is measured
    scatter = dataclasses.replace(gather, kind="reducescatter")
    reduced = with_fsdp2(model, scatter, cost)
    assert reduced.seconds == pytest.approx(1e-3 + sum(model.reduce_seconds(content)))
    assert reduced.note == ("interpolated between the 32KiB and 64KiB measured; FSDP2's reduce on the device model "
                            "(flat): copy-in 0.0051 ms, framework 0.76 ms")
    plain = dataclasses.replace(gather, content={k: v for k, v in content.items() if k != "fsdp"})
    assert with_fsdp2(model, plain, cost) is cost


def test_a_spec_alone_costs_a_zero_all_gather_with_fsdp2s_unshard(tmp_path):
    """A spec-only ZeRO-3 job: each all-gather costs the network model's collective plus FSDP2's unshard on the
    device (its copies and [wrappers.fsdp2]'s time), each reduce-scatter plus FSDP2's reduce (its copy-in and
    [wrappers.fsdp2]'s time), and says so."""
    from analysis.predict import predict_spec

    def costed(description):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.toml"
        path.write_text(description.to_toml())
        text = tiny_spec_text(layers=2, global_batch=4, dp=2, zero=3)
        text += '\n[[cluster.network]]\nname = "node"\nsize = 2\nbandwidth_gbs = 10\nlatency_us = 10\n'
        return predict_spec(loads_spec(text.replace("[cluster]", f"[cluster]\ndevice = \"{path}\"")), resamples=0)

    plain, unsharded = costed(flat_device()), costed(flat_device(wrappers={"fsdp2": UNSHARD}))
    model = DeviceModel(flat_device(wrappers={"fsdp2": UNSHARD}))
    gathers = [eid for eid, e in plain.plan.events.items() if e.kind == "allgather"]
    assert gathers
    for eid, event in plain.plan.events.items():
        if event.kind not in ("allgather", "reducescatter"):
            continue
        bare = plain.costs.network.estimate_group(event.kind, float(event.bytes), tuple(range(2))).seconds
        if event.kind == "allgather":
            copies, framework = model.unshard_seconds(event.content)
            assert plain.costs.seconds(eid) == pytest.approx(bare + copies)
            assert unsharded.costs.seconds(eid) == pytest.approx(bare + copies + framework)
            assert "FSDP2's unshard on the device model (flat): copies" in unsharded.costs.events[eid].note
            assert "not in it" not in unsharded.costs.events[eid].note
        else:
            copies, framework = model.reduce_seconds(event.content)
            assert plain.costs.seconds(eid) == pytest.approx(bare + copies)
            assert unsharded.costs.seconds(eid) == pytest.approx(bare + copies + framework)
            assert "FSDP2's reduce on the device model (flat): copy-in" in unsharded.costs.events[eid].note
            assert "not in it" not in unsharded.costs.events[eid].note


@pytest.mark.parametrize("processor", ["cpu", "gpu"])
def test_a_zero_3_full_recompute_job_pays_its_wrappers_on_the_device_or_the_host(tmp_path, processor):
    """Every compute event of a ZeRO-3, full-recompute GPT-2 job (each layer checkpointed and an FSDP2 unit, its
    optimizer over the shards) costs its kernels plus its wrappers: on a CPU in the device's time (the framework
    runs on the cores that compute; --details lists them as a row), on a GPU a layer's in the host's issue time and
    the optimizer step's in its time (a step is costed by its time alone); the same description without
    [wrappers] costs the kernels alone."""
    from analysis.predict import predict_spec

    costs = {}
    for label, extra in (("bare", {"optimizer": WRAPPED["optimizer"]}), ("wrapped", WRAPPED)):
        path = tmp_path / f"{label}.toml"
        path.write_text(flat_device(processor=processor, **extra).to_toml())
        text = tiny_spec_text(layers=2, global_batch=4, dp=2, zero=3, recompute="full")
        text += '\n[[cluster.network]]\nname = "node"\nsize = 2\nbandwidth_gbs = 10\nlatency_us = 10\n'
        costs[label] = predict_spec(loads_spec(text.replace("[cluster]", f"[cluster]\ndevice = \"{path}\"")),
                                    resamples=0).costs
    wrapped = DeviceModel(flat_device(processor=processor, **WRAPPED))
    plan = build_plan(loads_spec(tiny_spec_text(layers=2, global_batch=4, dp=2, zero=3, recompute="full")))
    compute = {eid: e for eid, e in plan.events.items() if e.kind == "compute"}
    assert {e.content["phase"] for e in compute.values()} == {"fwd", "bwd", "optimizer"}
    for eid, event in compute.items():
        extra = wrapped.wrapper_seconds(event.content, event_kernels(event.content, "full"))
        assert extra > 0, event.name
        seconds = costs["wrapped"].seconds(eid) - costs["bare"].seconds(eid)
        issue = costs["wrapped"].host_issue.get(eid, 0.0) - costs["bare"].host_issue.get(eid, 0.0)
        on_device = processor == "cpu" or event.content["phase"] == "optimizer"
        assert seconds == pytest.approx(extra if on_device else 0.0), event.name
        assert issue == pytest.approx(0.0 if on_device else extra), event.name
        rows = costs["wrapped"].device_kernels[eid].breakdown()
        assert (rows[-1]["type"] == "wrapper") == on_device and sum(r["seconds"] for r in rows) == pytest.approx(
            costs["wrapped"].seconds(eid))

def test_memory_bound_kernels_carry_their_kind_and_elements():
    """GPT-2 (hidden 32, ffn 64, 2 x 16 tokens, tp 1): each memory-bound kernel's kind and elements; a backward's
    kind is the forward's + _backward with the same elements; LLaMA's norms are RMSNorm, its MLP SwiGLU."""
    spec = spec_of()
    embedding, block, head = describe(spec)[0], describe(spec)[1], describe(spec)[-1]
    shape = PassShape(micro=2, seq=16)
    kinds = {k.name: (k.op, k.elements) for k in layer_kernels(block, shape, "fwd") if isinstance(k, MemoryBound)}
    assert kinds == {"norm1": ("layer_norm", 32 * 32), "context_copy": ("copy", 32 * 32),
                     "residual1": ("add", 32 * 32), "norm2": ("layer_norm", 32 * 32), "gelu": ("gelu", 32 * 64),
                     "residual2": ("add", 32 * 32)}
    backward = {k.name: (k.op, k.elements) for k in layer_kernels(block, shape, "bwd") if isinstance(k, MemoryBound)}
    assert backward["gelu.grad"] == ("gelu_backward", 32 * 64)
    assert backward["norm1.grad"] == ("layer_norm_backward", 32 * 32)
    lookup, positions, add = layer_kernels(embedding, shape, "fwd")
    assert [(k.op, k.elements) for k in (lookup, positions, add)] == [("embedding", 32 * 32), ("embedding", 16 * 32),
                                                                       ("add", 32 * 32)]
    fill = layer_kernels(embedding, shape, "bwd")[-2]
    assert (fill.op, fill.elements) == ("fill", 128 * 32)
    norm, _, loss = layer_kernels(head, shape, "fwd")
    assert (norm.op, loss.op, loss.elements) == ("layer_norm", "cross_entropy", 32 * 128)
    llama = {k.name: (k.op, k.elements) for k in layer_kernels(describe(spec_of(name="llama-1b", kv_heads=2))[1],
                                                                  shape, "fwd") if isinstance(k, MemoryBound)}
    assert llama["norm1"] == ("rms_norm", 32 * 32) and llama["swiglu"] == ("swiglu", 32 * 64)
    assert llama["rotary"] == ("rotary", 32 * (4 + 2) * 8) and llama["repeat_kv"][0] == "copy"


def test_vector_ops_cost_a_kind_by_its_arithmetic_where_measured():
    """flat_device: vector 10 TFLOP/s, 0.8 TB/s. A GELU of 1e6 elements, 8e6 bytes: 1e-5 s of memory; with 200
    vector operations an element its compute is 1e6 x 200 / 10e12 = 2e-5 s, which bounds it; with 2, 2e-7 s
    and the memory bounds it. A kind not in the table, and a kernel of no kind, are costed by bytes and FLOPs."""
    gelu = MemoryBound("gelu", 8e6, "float32", op="gelu", elements=1e6)
    model = DeviceModel(flat_device(vector_ops={"gelu": 200.0, "layer_norm": 2.0}))
    time = model.kernel_time(gelu)
    assert time.compute_s == pytest.approx(2e-5) and time.memory_s == pytest.approx(1e-5)
    assert time.seconds == pytest.approx(5e-6 + 2e-5) and time.bound == "compute"
    norm = MemoryBound("norm1", 8e6, "float32", op="layer_norm", elements=1e6)
    assert model.kernel_time(norm).compute_s == pytest.approx(2e-7)
    assert model.kernel_seconds(norm) == pytest.approx(5e-6 + 1e-5)
    several = DeviceModel(flat_device(launches={"layer_norm": 6.0}))  # 6 operations a call, each 5 us to launch
    assert several.kernel_time(norm).launch_s == pytest.approx(30e-6)
    assert several.issue_seconds([norm, gelu]) == 0.0  # no [host]: the host keeps ahead
    issuing = DeviceModel(flat_device(launches={"layer_norm": 6.0}, kernel_issue_s=2e-6))
    assert issuing.issue_seconds([norm, gelu]) == pytest.approx(7 * 2e-6)
    other = MemoryBound("loss", 8e6, "float32", flops=5e6, op="cross_entropy", elements=1e6)
    assert model.kernel_time(other).compute_s == pytest.approx(5e6 / 10e12)  # its counted FLOPs
    assert model.kernel_seconds(other) == DeviceModel(flat_device()).kernel_seconds(other)


def test_an_optimizer_measured_tensor_by_tensor_by_hand():
    """[optimizer.adam] 9 kernels a tensor, 2 a step, 72 bytes a parameter, 10 us a kernel beyond its bytes, 5 GB/s;
    tensors 2 x 1,000 and 1 x 100,000 elements (102,000 parameters): 2 + 9 x 3 = 29 kernels, 290 us, and
    102,000 x 72 = 7.344 MB at 5 GB/s, 1,468.8 us. The foreach form (0 a tensor, 12 a step): 120 us + 1,468.8 us.
    Without the table, or without tensors: the format-1 kernel (32 bytes a parameter, one launch a layer)."""
    import dataclasses

    from harness.plan.device import OptimizerCost

    step = MemoryBound("optimizer.step", 102_000 * 32.0, "float32", flops=12 * 102_000.0, launches=3, op="adam",
                       elements=102_000.0, tensors=((1_000, 2), (100_000, 1)))
    single = OptimizerCost(kernels_per_tensor=9.0, kernels_per_step=2.0, bytes_per_parameter=72.0, kernel_s=10e-6,
                           bandwidth=5e9)
    model = DeviceModel(flat_device(optimizer={"adam": single}))
    time = model.kernel_time(step)
    assert time.launch_s == pytest.approx(290e-6) and time.memory_s == pytest.approx(1468.8e-6)
    assert model.kernel_seconds(step) == pytest.approx(1758.8e-6) and time.bound == "memory"
    foreach = dataclasses.replace(single, kernels_per_tensor=0.0, kernels_per_step=12.0)
    assert DeviceModel(flat_device(optimizer={"adam": foreach})).kernel_seconds(step) == pytest.approx(1588.8e-6)
    plain = DeviceModel(flat_device())
    assert plain.kernel_seconds(step) == pytest.approx(3 * 5e-6 + 102_000 * 32 / 0.8e12)
    assert model.kernel_seconds(dataclasses.replace(step, tensors=())) == plain.kernel_seconds(step)
    assert DeviceModel(flat_device(optimizer={"sgd": single})).kernel_seconds(step) == plain.kernel_seconds(step)


def test_optimizer_kernels_carry_the_parameter_tensors():
    """GPT-2 (hidden 32, ffn 64, vocab 128, seq 16, untied): the embedding's 2 tables, a block's 12 tensors, the
    head's final LayerNorm and projection; with ZeRO over dp = 2 each tensor's first dimension halved."""
    plan = build_plan(spec_of())
    step = next(e for e in plan.events.values() if e.content.get("phase") == "optimizer")
    kernel, = event_kernels(step.content)
    assert kernel.op == "adam" and kernel.elements == step.content["params"]
    assert sum(e * c for e, c in kernel.tensors) == step.content["params"]
    assert sum(c for _, c in kernel.tensors) == 2 + 2 * 12 + 3  # tokens, positions; 12 a block; norm, projection
    runs = dict(kernel.tensors)
    assert runs[3 * 32 * 32] == 2 and runs[64 * 32] == 4  # qkv weight; fc1 and fc2 weights of both blocks
    assert runs[128 * 32] == 2 and runs[16 * 32] == 1 and runs[32] == 14  # token table, projection; positions
    sgd = event_kernels({**step.content, "optimizer": "sgd", "momentum": 0.9})[0]
    assert sgd.op == "sgd_momentum" and event_kernels({**step.content, "optimizer": "sgd"})[0].op == "sgd"
    sharded = event_kernels({**step.content, "shard": 2})[0]
    assert dict(sharded.tensors)[3 * 32 * 32 // 2] == 2  # (96, 32) -> (48, 32)
    assert dict(sharded.tensors)[16] == 14  # a bias or norm of 32: 16


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
def test_parameter_tensor_shapes_are_the_models(family):
    """harness.plan.kernels.parameter_tensor_shapes against the layers harness.models builds (tp = 1), and their
    sum against LayerDesc.params at tp = 2."""
    import math

    from harness.models.transformer import build_layer
    from harness.plan.kernels import parameter_tensor_shapes
    from harness.plan.layers import describe_builtin
    from harness.plan.spec import ModelSpec

    model = ModelSpec(name="x", family=family, layers=1, hidden=64, heads=4, kv_heads=2 if family == "llama" else 4,
                      ffn=96, seq_len=32, vocab=80, dtype="float32")
    for layer in describe_builtin(model, 1):
        built = [tuple(p.shape) for p in build_layer(model, layer.kind).parameters() if p.requires_grad]
        assert sorted(built) == sorted(parameter_tensor_shapes(layer.kind, dict(layer.signature))), layer.kind
    for layer in describe_builtin(model, 2, vocab_parallel=True):
        shapes = parameter_tensor_shapes(layer.kind, dict(layer.signature))
        assert sum(math.prod(s) for s in shapes) == layer.params, layer.kind


def test_format_2_round_trips_and_format_1_stays_format_1():
    """A description with [vector_ops] and [optimizer.NAME] writes format = 2 and reads back equal; every shipped
    one has neither and still writes format = 1."""
    from harness.plan.device import OptimizerCost

    described = flat_device(vector_ops={"gelu": 12.5, "gelu_backward": 30.0}, launches={"rms_norm": 6.0},
                            optimizer={"adam": OptimizerCost(9.0, 2.0, 76.0, 6.6607e-6, 5.4321e9)},
                            wrappers={"checkpointed": WrapperCost(206e-6, 201e-6),
                                      "fsdp2": WrapperCost(356e-6, 18.2e-6, 13.7e-6, unshard_s=312.5e-6,
                                                           unshard_tensor_s=6.5e-6, reduce_s=406.25e-6,
                                                           reduce_tensor_s=14.5e-6)})
    text = described.to_toml()
    assert text.startswith("format = 2") and "[vector_ops]" in text and "[optimizer.adam]" in text
    assert "[launches]\nrms_norm = 6.0" in text
    assert "[wrappers.checkpointed]\nforward_us = 206.0\nbackward_us = 201.00000000000003\n" in text  # 201e-6 exactly
    assert ("[wrappers.fsdp2]\nforward_us = 356.0\nbackward_us = 18.2\noptimizer_kernel_us = 13.7\nunshard_us = 312.5\n"
            "unshard_tensor_us = 6.5\nreduce_us = 406.25\nreduce_tensor_us = 14.5\n") in text
    assert flat_device(wrappers={"fsdp2": WrapperCost(1e-6, 0.0)}).format == 2
    split = flat_device(wrappers={"split_backward": WrapperCost(0.0, 330e-6, weight_s=390e-6)})
    assert "[wrappers.split_backward]\nforward_us = 0.0\nbackward_us = 330.0\nweight_us = 390.0\n" in split.to_toml()
    assert parse_device(tomllib.loads(split.to_toml()), default_name="flat") == split
    assert parse_device(tomllib.loads(text), default_name="flat") == described
    for name in SHIPPED:
        shipped = load_device(name)
        assert shipped.format == 1 and not shipped.vector_ops and not shipped.optimizer and not shipped.launches
        assert shipped.to_toml().startswith("format = 1")


@pytest.mark.parametrize("name", SHIPPED)
def test_kinds_change_nothing_on_a_description_without_the_tables(name):
    """Every kernel of a GPT-2, a LLaMA and a BERT job (the optimizer step included) costs the same on a shipped
    description with its kinds, elements and tensors as without them (the format-1 kernels)."""
    import dataclasses

    model = DeviceModel(load_device(name))
    for spec in (spec_of(), spec_of(name="llama-1b", kv_heads=2), spec_of(name="bert-base")):
        plan = build_plan(spec)
        for event in plan.events.values():
            if event.kind != "compute":
                continue
            for kernel in event_kernels(event.content):
                bare = dataclasses.replace(kernel, op="", elements=0.0, tensors=()) \
                    if isinstance(kernel, MemoryBound) else kernel
                assert model.kernel_time(kernel) == model.kernel_time(bare), kernel.name


def test_a_causal_tile_round_trips_and_makes_format_2():
    described = dataclasses.replace(load_device("a100-80gb"), causal_tile=128)
    assert described.format == 2 and "causal_tile = 128\n" in described.to_toml()
    assert parse_device(tomllib.loads(described.to_toml()), default_name="a100-80gb") == described
    assert load_device("a100-80gb").format == 1 and "causal_tile" not in load_device("a100-80gb").to_toml()


@pytest.mark.parametrize("table, field, message", [
    ("[vector_ops]\ngelu = -3.0\n", "vector_ops.gelu", "0 or more"),
    ("[vector_ops]\ngelu_forward = 3.0\n", "vector_ops.gelu_forward", "unknown field"),
    ("[optimizer.lamb]\nkernels_per_tensor = 9.0\n", "optimizer.lamb", "unknown field"),
    ("[optimizer.adam]\nkernels_per_tensor = 9.0\nbytes_per_parameter = 72.0\nkernel_us = 3.0\n"
     "bandwidth_gb_s = 5.0\npasses = 9\n", "optimizer.adam.passes", "unknown field"),
    ("[optimizer.adam]\nkernels_per_tensor = 9.0\nkernel_us = 3.0\nbandwidth_gb_s = 5.0\n",
     "optimizer.adam.bytes_per_parameter", "required"),
    ("[optimizer.adam]\nkernels_per_tensor = 9.0\nbytes_per_parameter = 72.0\nkernel_us = 3.0\n",
     "optimizer.adam.bandwidth_gb_s", "required"),
    ("[optimizer.adam]\nkernels_per_tensor = 9.0\nbytes_per_parameter = 72.0\nkernel_us = 3.0\n"
     "bandwidth_gb_s = 0.0\n", "optimizer.adam.bandwidth_gb_s", "above 0"),
    ("[optimizer.adam]\nkernels_per_tensor = 0.0\nbytes_per_parameter = 72.0\nkernel_us = 3.0\n"
     "bandwidth_gb_s = 5.0\n", "optimizer.adam.kernels_per_tensor", "launches kernels"),
    ("[optimizer]\nadam = 3\n", "optimizer.adam", "must be a table"),
    ("[launches]\nrms_norm = 0.0\n", "launches.rms_norm", "above 0"),
    ("[launches]\nnorm = 6.0\n", "launches.norm", "unknown field"),
    ("[wrappers.fsdp]\nforward_us = 1.0\nbackward_us = 1.0\n", "wrappers.fsdp", "unknown field"),
    ("[wrappers.fsdp2]\nforward_us = -1.0\nbackward_us = 1.0\n", "wrappers.fsdp2.forward_us", "0 or more"),
    ("[wrappers.checkpointed]\nforward_us = 1.0\n", "wrappers.checkpointed.backward_us", "required"),
    ("[wrappers.checkpointed]\nforward_us = 1.0\nbackward_us = 1.0\nrecompute_us = 3.0\n",
     "wrappers.checkpointed.recompute_us", "unknown field"),
    ("[wrappers]\nfsdp2 = 3\n", "wrappers.fsdp2", "must be a table"),
    ("[wrappers.checkpointed]\nforward_us = 1.0\nbackward_us = 1.0\nunshard_us = 3.0\n",
     "wrappers.checkpointed.unshard_us", r"only \[wrappers.fsdp2\]"),
    ("[wrappers.fsdp2]\nforward_us = 1.0\nbackward_us = 1.0\nunshard_tensor_us = -3.0\n",
     "wrappers.fsdp2.unshard_tensor_us", "0 or more"),
    ("[wrappers.split_backward]\nforward_us = 1.0\nbackward_us = 1.0\nreduce_us = 3.0\n",
     "wrappers.split_backward.reduce_us", r"only \[wrappers.fsdp2\]"),
    ("[wrappers.fsdp2]\nforward_us = 1.0\nbackward_us = 1.0\nreduce_tensor_us = -3.0\n",
     "wrappers.fsdp2.reduce_tensor_us", "0 or more"),
])
def test_bad_format_2_tables_name_file_and_field(tmp_path, table, field, message):
    path = tmp_path / "bad.toml"
    path.write_text(description_text(**{"format = 1": "format = 2"}) + "\n" + table)
    with pytest.raises(SpecError, match=message) as caught:
        load_device(str(path))
    assert caught.value.field == field and caught.value.source == str(path)


def test_a_tier_fitted_to_collectives_in_context_recovers_its_figures():
    """analysis.device_model.in_context_tier: collectives costed by a known one-tier gloo network (1 GB/s, 1 ms,
    grid points; its reduce-scatter an all-reduce, as gloo runs it) are fitted back exactly from the in-context
    column; the back-to-back column is fitted alike."""
    from analysis.device_model import in_context_tier
    from analysis.network import spec_network
    from harness.plan.network import NetworkTier, contiguous_span

    bandwidth, latency = 1.0, 10 ** (60 / 20)
    tiers = (NetworkTier("gloo", 2, bandwidth, latency),)
    model, span = spec_network(tiers, "gloo"), contiguous_span(2, tiers)
    rows = [{"op": op, "bytes": size, "ranks": 2, "in_context_s": model.estimate(op, size, span).seconds,
             "back_to_back_s": model.estimate(op, size, span).seconds / 2}
            for op in ("allreduce", "allgather", "reducescatter") for size in (1 << 10, 1 << 16, 1 << 22)]
    tier = in_context_tier(rows)
    assert (tier["name"], tier["size"]) == ("gloo", 2)
    assert tier["bandwidth_gbs"] == pytest.approx(bandwidth) and tier["latency_us"] == pytest.approx(latency)
    assert tier["rms_log_error"] == pytest.approx(0.0, abs=1e-9) and tier["points"] == 9
    assert in_context_tier(rows, column="back_to_back_s")["rms_log_error"] < 0.2


def test_a_curve_far_below_its_half_point_is_slow_not_an_overflow():
    """The ramp goes through its logarithm: a kernel 1e300 times below the half point at the steepest allowed curve
    gets the least fraction, above 0 (a finite, huge time), not an OverflowError."""
    from harness.plan.device import MAX_STEEPNESS, Curve

    curve = Curve(max_fraction=0.5, half_at=1e300, steepness=MAX_STEEPNESS)
    assert 0 < curve.fraction(1.0) < 1e-300
    assert Curve(max_fraction=0.5, half_at=100.0, steepness=2.0).fraction(100.0) == pytest.approx(0.25, rel=1e-12)
    assert Curve(max_fraction=0.5, half_at=100.0, steepness=2.0).fraction(1000.0) == pytest.approx(0.5 / 1.01,
                                                                                                   rel=1e-12)


def accumulation_spec(device: str = "", **strategy) -> object:
    """tiny_spec_text's GPT-2 (hidden 32, ffn 64: a block of 12 tensors and 8,544 parameters) at 4 micro-batches a
    replica, with `strategy` lines added and a `[cluster] device`."""
    lines = "".join(f"{key} = {str(value).lower()}\n" for key, value in strategy.items())
    cluster = f'[cluster]\ndevice = "{device}"\n' if device else "[cluster]\n"
    return loads_spec(tiny_spec_text(global_batch=8, micro=2).replace("[cluster]\n", lines + cluster))


def block_content(spec, phase: str) -> dict:
    plan = build_plan(spec)
    return next(e.content for e in plan.events.values()
                if e.kind == "compute" and e.content.get("layer") == "block" and e.content.get("phase") == phase)


def test_a_layers_backward_accumulates_its_gradients_by_hand():
    """(m - 1) / m of an add over the block's 8,544 parameters (hidden 32, ffn 64: 4 x 32 x 32 + 2 x 32 x 64 =
    8,192 weights, 3 x 32 + 32 + 64 + 32 biases, two norms of 2 x 32), float32: the new gradient read, the
    accumulated one read and written, 12 bytes a parameter, 12 tensors."""
    from harness.plan.kernels import (
        accumulation_kernels,
        accumulation_share,
        event_kernels,
        job_event_kernels,
        shard_elements,
        shard_shape,
    )

    spec = accumulation_spec()
    assert spec.micro_batches == 4 and accumulation_share(spec) == 0.75
    backward = block_content(spec, "bwd")
    [add] = accumulation_kernels(backward, 0.75)
    assert (add.name, add.op, add.dtype) == ("grad_accumulate", "add", "float32")
    assert add.elements == 0.75 * 8544 and add.bytes == 0.75 * 8544 * 12 and add.launches == 0.75 * 12
    assert job_event_kernels(backward, spec) == event_kernels(backward) + [add]
    # the forward, no share, Megatron's fusion: nothing
    assert accumulation_kernels(block_content(spec, "fwd"), 0.75) == []
    assert accumulation_kernels(backward, 0.0) == []
    fused = accumulation_spec(grad_accumulation_fusion=True)
    assert accumulation_share(fused) == 0.0 and job_event_kernels(backward, fused) == event_kernels(backward)
    # ZeRO 2 adds into the shard's gradients (each tensor's first dimension split over dp = 2); master weights add a
    # 16-bit gradient into float32 ones: 2 + 2 x 4 bytes a parameter
    [sharded] = accumulation_kernels(backward, 1.0, shard=2)
    assert sharded.elements == 4272
    # FSDP2's split of one tensor: its first dimension rounded up (a 3 x 5 weight over 2: a 2 x 5 shard)
    assert shard_shape((3, 5), 2) == (2, 5) and shard_elements((3, 5), 2) == 10 and shard_shape((7,), 1) == (7,)
    [main] = accumulation_kernels(dict(backward, signature={**dict(backward["signature"]), "dtype": "bfloat16"}),
                                  1.0, main_gradients="float32")
    assert main.bytes == 8544 * 10 and main.dtype == "bfloat16"
    # fp16 weights' main gradients in fp16 (Megatron's without --accumulate-allreduce-grads-in-fp32): 2 + 2 x 2
    [fp16] = accumulation_kernels(dict(backward, signature={**dict(backward["signature"]), "dtype": "float16"}),
                                  1.0, main_gradients="float16")
    assert fp16.bytes == 8544 * 6
    # a split backward: the weights' half adds, the input's half computes no parameter's gradient
    assert accumulation_kernels(dict(backward, phase="bwd_weight"), 0.75) == [add]
    assert accumulation_kernels(dict(backward, phase="bwd_input"), 0.75) == []


def test_the_jobs_accumulation_follows_its_micro_batches_zero_and_master_weights():
    """Through job_event_kernels and a prediction's costing (whose cache holds one event id for specs that differ
    only in these): ZeRO 2 adds into the gradients' shard, 4 micro-batches add 3/4 of the time, 8 add 7/8,
    Megatron's main gradients every time."""
    from analysis.predict import predict_spec
    from harness.plan.kernels import job_event_kernels

    def added(spec):
        prediction = predict_spec(spec, resamples=0)
        [eid] = [e for e, ev in prediction.plan.events.items()
                 if ev.content.get("layer") == "block" and ev.content.get("phase") == "bwd"]
        [add] = [k for k in prediction.costs.device_kernels[eid].kernels if k.name == "grad_accumulate"]
        assert [add] == [k for k in job_event_kernels(prediction.plan.events[eid].content, spec)
                         if k.name == "grad_accumulate"]
        return eid, add

    four = added(accumulation_spec("a100-80gb"))
    eight = added(loads_spec(tiny_spec_text(global_batch=16, micro=2).replace(
        "[cluster]\n", '[cluster]\ndevice = "a100-80gb"\n')))
    assert four[0] == eight[0]  # one event, two costings
    assert (four[1].elements, eight[1].elements) == (0.75 * 8544, 0.875 * 8544)
    zero = dict(dp=2, zero=2)
    text = tiny_spec_text(global_batch=16, micro=2, **zero).replace("[cluster]\n", '[cluster]\ndevice = "a100-80gb"\n')
    text += '\n[[cluster.network]]\nname = "node"\nsize = 2\nbandwidth_gbs = 10\nlatency_us = 10\n'
    assert added(loads_spec(text))[1].elements == 0.75 * 8544 / 2
    master = tiny_spec_text(global_batch=8, micro=2).replace('dtype = "float32"', 'dtype = "bfloat16"').replace(
        "[cluster]\n", '[cluster]\ndevice = "a100-80gb"\n') + "[optimizer]\nmaster_weights = true\n"
    main = added(loads_spec(master))[1]
    assert main.elements == 8544 and main.bytes == 8544 * (2 + 2 * 4)


def test_a_spec_alone_costs_the_accumulation_unless_fused():
    """The add is listed and costed after every backward of a spec alone, and Megatron's fusion removes exactly it."""
    from analysis.predict import predict_spec

    added = predict_spec(accumulation_spec("a100-80gb"), resamples=0)
    fused = predict_spec(accumulation_spec("a100-80gb", grad_accumulation_fusion=True), resamples=0)
    model = DeviceModel(load_device("a100-80gb"))
    for eid, costing in added.costs.device_kernels.items():
        extra = [k for k in costing.kernels if k.name == "grad_accumulate"]
        phase = added.plan.events[eid].content.get("phase")
        assert len(extra) == (1 if phase == "bwd" else 0), eid
        assert costing.seconds == pytest.approx(fused.costs.device_kernels[eid].seconds
                                                + sum(model.kernel_seconds(k) for k in extra))
    assert added.timeline.batch_time_s > fused.timeline.batch_time_s

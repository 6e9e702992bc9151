"""Saved activations from formulas (harness.plan.activations): each term by hand for the built-in layers,
Korthikanti et al. (2022)'s published per-layer forms for the materialised softmax with dropout, and every formula
held against the meter that a profile measures with (harness.profile.memory) on the layers as profiling builds them."""
from __future__ import annotations

import pytest

from harness.common.errors import UserError
from harness.plan.activations import (
    formula_activation_bytes,
    formula_released_bytes,
    held_bytes,
    kept_bytes,
    layer_terms,
    released_bytes,
    saved_bytes,
)
from harness.plan.events import build_plan
from harness.plan.layers import LayerDesc, input_bytes
from harness.plan.spec import loads_spec
from tests.helpers import tiny_spec_text

B, S, H, A, VOCAB = 2, 16, 32, 4, 256  # micro, seq, hidden, heads, vocab of the hand-computed cases
T = B * S
MOE = "experts = 4\ntop_k = 2\nexpert_ffn = 64"


def _spec(name: str = "gpt2-small", dtype: str = "float32", tp: int = 1, sp: bool = False, cp: int = 1,
          cp_comm: str = "ring", model: str = "", strategy: str = "", dp: int = 1, pp: int = 1,
          schedule: str = "1f1b", recompute: str = "none", hidden: int = H, seq: int = S, heads: int = A):
    text = tiny_spec_text(name=name, dp=dp, tp=tp, pp=pp, cp=cp, cp_comm=cp_comm, layers=2 * pp, hidden=hidden,
                          heads=heads, ffn=4 * hidden, seq=seq, vocab=VOCAB, micro=B, global_batch=4 * B,
                          schedule=schedule, recompute=recompute)
    strategy += ("vocab_parallel = true\n" if tp > 1 else "") + ("sp = true\n" if sp else "")
    text = text.replace("[strategy]\n", "[strategy]\n" + strategy).replace("\nheads = ", f"\n{model}\nheads = ", 1)
    return loads_spec(text.replace('dtype = "float32"', f'dtype = "{dtype}"'))


def _layer(spec, kind: str) -> LayerDesc:
    plan = build_plan(spec)
    return next(layer for layer in plan.layers if layer.kind == kind)


def _saved(spec, kind: str, **options) -> int:
    return saved_bytes(spec, _layer(spec, kind), B, S // spec.strategy.cp, **options)


# ---- by hand ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)])
def test_a_gpt2_block_saves_its_inputs_qkv_logsumexp_and_mlp_hidden(tp, sp):
    d, ts, f = 2, T // tp if sp else T, 4 * H // tp
    by_hand = (2 * ts * H * d  # the two LayerNorms' inputs (block input, residual)
               + 4 * ts * d  # their mean and rstd
               + 2 * ts * H * d  # the attention's and the MLP's inputs (the norms' outputs)
               + T * 3 * H // tp * d  # q, k, v: views of the QKV output
               + B * A // tp * S * 4  # SDPA's float32 logsumexp
               + T * H // tp * d  # the attention's output, the projection's input
               + 2 * T * f * d)  # GELU's input and output
    assert _saved(_spec(dtype="bfloat16", tp=tp, sp=sp), "block") == by_hand


def test_a_llama_block_with_grouped_query_attention_saves_the_repeated_keys_and_values():
    spec = _spec("llama-1b", "bfloat16", model="kv_heads = 2")
    d, hd, f = 2, H // A, 4 * H
    norm = T * H * (2 * 4 + d) + T * 4  # input cast to float32 twice, normalised product in d; float32 rsqrt
    by_hand = (2 * norm + 2 * T * H * d  # two RMSNorms; their outputs, the attention's and the MLP's inputs
               + 2 * S * hd * d  # rotary cos and sin, for the queries and the keys
               + 3 * T * H * d  # rotated queries, keys and values repeated from 2 to 4 heads
               + B * A * S * 4  # logsumexp
               + 2 * T * H * d  # the output (head-major, as the contiguous queries) and its token-major copy
               + 4 * T * f * d)  # SwiGLU: gate-and-up output, SiLU, product
    assert _saved(spec, "block") == by_hand
    # without grouping the values stay a view of the QKV output (3 h) beside the rotated queries and keys
    plain = _spec("llama-1b", "bfloat16", model=f"kv_heads = {A}")
    assert _saved(plain, "block") - by_hand == (2 * H + 3 * H - 3 * H) * T * d


def test_a_moe_block_saves_the_router_the_routed_rows_and_the_combine():
    spec = _spec(model=MOE)
    d, experts, routed = 4, 4, 2 * T  # float32; top-2 of 4 even experts, no capacity limit
    attention = (2 * T * H * d + 4 * T * d + T * H * d + 3 * T * H * d + B * A * S * 4 + T * H * d)
    moe = (T * H * d  # the gate's (float32) input, the norm's output
           + T * experts * 4  # the router's probabilities
           + 2 * routed * 8 + 3 * routed * 4  # each pair's token and expert, its probability, sum and weight
           + routed * H * d  # the rows the experts take
           + 2 * routed * 64 * d  # each expert's GELU input and output (expert_ffn 64)
           + 2 * routed * H * 4)  # the combine's rows and their weighted product
    assert _saved(spec, "block") == attention + moe
    assert layer_terms(spec, _layer(spec, "block"), B, S)["router probabilities"] == T * experts * 4


@pytest.mark.parametrize("tp", [1, 2])
def test_the_head_saves_its_norm_projection_input_and_the_float32_log_probabilities(tp):
    spec = _spec(dtype="bfloat16", tp=tp)
    d, vocab = 2, VOCAB // tp
    loss = T * vocab * 4 + T * 8 + (T if tp > 1 else 4)  # log-probabilities, targets, a mask or the scalar weight
    assert _saved(spec, "head") == T * H * d + 2 * T * d + T * H * d + loss
    head = _layer(spec, "head")
    assert released_bytes(spec, head, B, S) == loss  # the loss is above the projection's weight
    assert kept_bytes(spec, head, B, S) == T * H * d + T * vocab * d  # the norm's and the logits' gradients


def test_the_embedding_saves_ids_and_positions_and_lets_all_go_as_a_last_layer():
    spec = _spec(tp=2)
    embedding = _layer(spec, "embedding")
    assert saved_bytes(spec, embedding, B, S) == T * 8 + T + S * 8  # masked ids, the mask, the positions buffer
    assert released_bytes(spec, embedding, B, S) == saved_bytes(spec, embedding, B, S)
    assert kept_bytes(spec, embedding, B, S) == 0


def test_recompute_full_keeps_a_blocks_input_and_the_head_what_it_saves():
    spec = _spec(dtype="bfloat16", recompute="full")
    layers = build_plan(spec).layers
    block, head = 1, len(layers) - 1
    assert held_bytes(spec, layers, block, B, S) == input_bytes(spec, layers, block) == T * H * 2
    assert held_bytes(spec, layers, head, B, S) == saved_bytes(spec, layers[head], B, S)
    assert held_bytes(spec, layers, 0, B, S) == saved_bytes(spec, layers[0], B, S)


# ---- Korthikanti et al. 2022 --------------------------------------------------------------------------------

@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_materialised_softmax_with_dropout_is_korthikanti_et_als_count(tp, sp):
    """Per layer in 16-bit with dropout: s b h (34 + 5 a s / h) at t = 1, s b h (10 + 24 / t + 5 a s / (h t))
    with tp, s b h (34 / t + 5 a s / (h t)) with sp; the norms' statistics, which they leave out, aside. (At 256
    keys Megatron-LM's fused softmax takes every shape here, which their count assumes.)"""
    s, h, a = 256, 64, 8
    spec = _spec(dtype="bfloat16", tp=tp, sp=sp, hidden=h, seq=s, heads=a)
    terms = layer_terms(spec, _layer(spec, "block"), B, s, attention="materialized", dropout=0.1)
    counted = sum(terms.values()) - terms["norm statistics"]
    sbh, t = s * B * h, tp
    if sp:
        assert counted * t == sbh * 34 + 5 * a * s * s * B
    elif tp == 1:
        assert counted == sbh * 34 + 5 * a * s * s * B
    else:
        assert counted * t == sbh * (10 * t + 24) + 5 * a * s * s * B
    # flash keeps a logsumexp instead of the s x s matrices, and no attention dropout mask
    flash = layer_terms(spec, _layer(spec, "block"), B, s, dropout=0.1)
    assert "attention softmax" not in flash and flash["attention logsumexp"] == B * a // tp * s * 4


def test_megatrons_float32_softmax_fallback_keeps_its_float32_output():
    """Where Megatron-LM's fused softmax does not take the shape (2 micro-batches x 2 local heads over 64 keys: not a
    multiple of 8), its float32 fallback saves the softmax's float32 output (4 bytes a score, not 2); without dropout
    the bmm keeps the 16-bit copy beside it."""
    s, h, a = 64, 64, 8
    spec = _spec(dtype="bfloat16", tp=4, hidden=h, seq=s, heads=a)
    scores = B * (a // 4) * s * s
    dropped = layer_terms(spec, _layer(spec, "block"), B, s, attention="materialized", dropout=0.1)
    assert dropped["attention softmax"] == scores * 4 and dropped["attention dropout"] == scores * (1 + 2)
    plain = layer_terms(spec, _layer(spec, "block"), B, s, attention="materialized")
    assert plain["attention softmax"] == scores * (4 + 2)
    fused = _spec(dtype="bfloat16", tp=2, hidden=h, seq=s, heads=a)  # 2 x 4 local heads: the fused kernel's
    assert layer_terms(fused, _layer(fused, "block"), B, s, attention="materialized")["attention softmax"] == \
        B * (a // 2) * s * s * 2


def test_dropout_masks_are_one_byte_per_hidden_element():
    spec = _spec(dtype="bfloat16", tp=2, sp=True)
    block = _layer(spec, "block")
    assert saved_bytes(spec, block, B, S, dropout=0.1) - saved_bytes(spec, block, B, S) == 2 * T // 2 * H


def test_bad_options_and_factory_layers_are_refused():
    spec = _spec()
    block = _layer(spec, "block")
    with pytest.raises(UserError, match="attention"):
        saved_bytes(spec, block, B, S, attention="eager")
    with pytest.raises(UserError, match="dropout"):
        saved_bytes(spec, block, B, S, dropout=1.5)
    user = LayerDesc(kind="user", signature=(("class", "Mixer"),), params=1, fwd_flops_per_token=1.0, index=3)
    with pytest.raises(UserError, match="factory model"):
        saved_bytes(spec, user, B, S)


def test_the_formulas_are_keyed_as_the_profile_is():
    """Every built-in forward and input-gradient event of the plan, once, by its event id."""
    plan = build_plan(_spec(schedule="zb-h1", pp=2))
    formula, released = formula_activation_bytes(plan), formula_released_bytes(plan)
    wanted = {e for program in plan.stages for e in program.forward + program.backward
              if plan.events[e].kind == "compute" and plan.events[e].content["phase"] in ("fwd", "bwd_input")}
    assert set(formula) == wanted
    assert set(released) == {e for e in wanted if plan.events[e].content["phase"] == "bwd_input"}
    assert all(value > 0 for eid, value in formula.items())


# ---- against the meter --------------------------------------------------------------------------------------

def _metered(spec) -> list[tuple[str, str, int, int]]:
    """(event id, what, formula, meter) for every forward (what: its name, saved bytes) and input-gradient event
    (its name + " kept", " released") of the plan, each layer built and run as profiling does
    (harness.profile.compute)."""
    import torch

    from harness.profile.compute import _forward, _make_layer
    from harness.profile.memory import activation_bytes, kept_for_weights

    torch.manual_seed(0)
    plan = build_plan(spec)
    formula, released = formula_activation_bytes(plan), formula_released_bytes(plan)
    rows = []
    for eid, value in formula.items():
        event = plan.events[eid]
        content = dict(event.content, last=event.content["layer"] == "head")
        layer, make_input = _make_layer(spec, content, torch.device("cpu"))

        def forward(module, x, content=content):
            return _forward(spec, module, x, content)

        if content["phase"] == "fwd":
            rows.append((eid, event.name, value, activation_bytes(layer, make_input, forward)))
        else:
            kept, let_go = kept_for_weights(layer, make_input, forward)
            rows += [(eid, event.name + " kept", value, kept), (eid, event.name + " released", released[eid], let_go)]
    return rows


FAMILIES = [("gpt2-small", ""), ("bert-base", ""), ("llama-1b", "kv_heads = 2")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("name", "model"), FAMILIES)
@pytest.mark.parametrize(("tp", "sp", "cp", "cp_comm"), [(1, False, 1, "ring"), (2, False, 1, "ring"),
                                                         (2, True, 1, "ring"), (1, False, 2, "ring"),
                                                         (1, False, 2, "allgather")])
def test_the_formulas_are_what_the_meter_measures(name, model, dtype, tp, sp, cp, cp_comm):
    """Exact for every built-in layer (a tied head aside, below)."""
    for _, event, formula, meter in _metered(_spec(name, dtype, tp=tp, sp=sp, cp=cp, cp_comm=cp_comm, model=model)):
        assert formula == meter, event


@pytest.mark.parametrize(("name", "model"), FAMILIES)
def test_a_split_backwards_kept_and_released_bytes_are_what_the_meter_measures(name, model):
    for _, event, formula, meter in _metered(_spec(name, "bfloat16", model=model, schedule="zb-h1", pp=2)):
        assert formula == meter, event


@pytest.mark.parametrize(("name", "dtype"), [("gpt2-small", "float32"), ("llama-1b", "bfloat16")])
def test_a_moe_blocks_formula_is_within_2_percent_of_the_meter(name, dtype):
    """Exact with ep = 1; with ep > 1 the profile's stand-in for the other ranks (LocalExperts) saves two index
    tensors a real all-to-all does not (8 bytes a row), which the formula, a real rank's, leaves out."""
    for ep, extra in ((1, ""), (2, "\nshared_experts = 1")):
        spec = _spec(name, dtype, model=MOE + extra, dp=ep, strategy=f"ep = {ep}\n" if ep > 1 else "")
        for _, event, formula, meter in _metered(spec):
            if ep == 1 or "block" not in event:
                assert formula == meter, event
            else:
                assert formula == pytest.approx(meter, rel=0.02) and formula < meter, event


def test_a_tied_heads_projection_weight_is_a_weight_to_the_meter():
    """A tied head's projection weight is the embedding's parameter in a real run; profiled alone it is a
    buffer that takes a gradient (a weight held, not owned), which the meter counts as a weight, not as saved:
    the head saves as an untied one does, to the byte."""
    metered = {event: (formula, meter) for _, event, formula, meter in _metered(_spec(model="tie_embeddings = true"))}
    untied = {event: meter for _, event, _, meter in _metered(_spec())}
    formula, meter = metered["gpt2.head.fwd"]
    assert meter == formula == untied["gpt2.head.fwd"] == 41476  # was 41476 + VOCAB * H * 4 with the buffer


def test_a_built_in_layers_measured_backward_temporaries_meet_its_formulas_worst_moment():
    """What the profile measures of a backward (harness.profile.memory.backward_temporaries) against the
    formulas' moments (analysis.memory.backward_moments), GPT-2 in float32: a block's worst is its MLP's last
    projection, its input's and its weight's gradients, (T + h) F d, nothing let go of; a head's loss's is the
    log-probabilities' gradient and the logits' (2 T V x 4) and the loss's own scalar gradient (4), its targets
    and scalar (T x 8 + 4) let go of, and once the logits' gradient reaches the head its projection's, the
    logits' gradient, its weight's and its input's (T V + V h + T h) d beside the scalar's, the
    log-probabilities (T V x 4) let go of too."""
    import torch

    from analysis.memory import backward_moments
    from harness.profile.compute import _forward, _make_layer
    from harness.profile.memory import backward_temporaries

    spec = _spec()
    plan = build_plan(spec)
    measured, formulas = {}, {}
    for event in plan.events.values():
        content = event.content
        if event.kind != "compute" or content.get("phase") != "bwd" or content["layer"] == "embedding":
            continue
        content = dict(content, last=content["layer"] == "head")
        layer, make_input = _make_layer(spec, content, torch.device("cpu"))
        measured[content["layer"]] = backward_temporaries(layer, make_input,
                                                          lambda m, x, c=content: _forward(spec, m, x, c))
        formulas[content["layer"]] = backward_moments(spec, _layer(spec, content["layer"]))
    loss_freed = T * 8 + 4
    assert measured == {"block": ((T + H) * 4 * H * 4, 0, 0, 0),
                        "head": ((T * VOCAB + VOCAB * H + T * H) * 4 + 4, T * VOCAB * 4 + loss_freed,
                                 2 * T * VOCAB * 4 + 4, loss_freed)}
    assert formulas == {"block": [(0, 0, "start"), ((T + H) * 4 * H * 4, 0, "during")],
                        "head": [(2 * T * VOCAB * 4, 0, "before"), (T * VOCAB * 4, T * VOCAB * 4, "start"),
                                 ((T * VOCAB + VOCAB * H + T * H) * 4, T * VOCAB * 4, "during")]}


def test_the_memory_model_from_formulas_is_the_one_from_the_meter():
    """analysis.memory's peak, every part, from the formulas as from the metered bytes (a split backward's
    kept and released bytes included), keyed alike."""
    from analysis.memory import estimate_memory

    spec = _spec("llama-1b", "bfloat16", model="kv_heads = 2", schedule="zb-h1", pp=2)
    plan = build_plan(spec)
    rows = _metered(spec)
    activations = {eid: meter for eid, what, _, meter in rows if not what.endswith(" released")}
    released = {eid: meter for eid, what, _, meter in rows if what.endswith(" released")}
    from_formulas = estimate_memory(plan, formula_activation_bytes(plan), formula_released_bytes(plan))
    assert from_formulas.to_dict() == estimate_memory(plan, activations, released).to_dict()
    assert from_formulas.peak.activations > 0



@pytest.mark.parametrize(("name", "dtype", "extra"), [("gpt2-small", "float32", ""),
                                                      ("llama-1b", "bfloat16", "\nshared_experts = 1")])
def test_a_moe_blocks_kept_and_released_bytes_are_what_the_meter_measures(name, dtype, extra):
    """No schedule splits a MoE block's backward yet (the spec refuses it); its formulas are held to the meter
    all the same, for when one does."""
    import torch

    from harness.profile.compute import _forward, _make_layer
    from harness.profile.memory import kept_for_weights

    spec = _spec(name, dtype, model=MOE + extra)
    plan = build_plan(spec)
    eid = next(e for e in plan.stages[0].forward if plan.events[e].content.get("layer") == "block")
    content = dict(plan.events[eid].content, last=False)
    layer, make_input = _make_layer(spec, content, torch.device("cpu"))
    kept, released = kept_for_weights(layer, make_input, lambda module, x: _forward(spec, module, x, content))
    block = _layer(spec, "block")
    assert (kept_bytes(spec, block, B, S), released_bytes(spec, block, B, S)) == (kept, released)

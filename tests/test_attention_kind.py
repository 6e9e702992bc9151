"""[model] attention: fused (sdpa) or materialised scores, from the spec through the layers' signatures, the kernels
the device model costs, the built-in block that runs it, and Megatron's arguments that say it; the refusals."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.common.errors import SpecError
from harness.models.transformer import TransformerBlock
from harness.plan.events import build_plan
from harness.plan.importers.megatron import from_megatron
from harness.plan.kernels import Attention, event_kernels
from harness.plan.spec import loads_spec
from tests.helpers import tiny_spec_text


def spec_text(attention: str | None = None, **kwargs) -> str:
    return tiny_spec_text(layers=2, model={"attention": attention} if attention else None, **kwargs)


def test_the_default_is_fused_and_a_materialized_spec_round_trips():
    assert loads_spec(spec_text()).model.attention == "sdpa"
    spec = loads_spec(spec_text("materialized"))
    assert spec.model.attention == "materialized"
    assert loads_spec(spec.to_toml()) == spec
    assert "attention" not in loads_spec(spec_text("sdpa")).to_dict()["model"]  # the default is not written


def test_the_block_signature_says_materialized_and_its_kernels_follow():
    """GPT-2, hidden 32, 4 heads, micro 2 x seq 16, float32: the materialised forward's scores are
    2 x 4 x 16 x 16 elements, written and read 4 times (7 in the backward), over q, k, v and the output."""
    fused, materialized = (build_plan(loads_spec(spec_text(kind))) for kind in (None, "materialized"))
    blocks = {kind: next(e for e in plan.events.values() if e.name == "gpt2.block.fwd")
              for kind, plan in (("sdpa", fused), ("materialized", materialized))}
    assert dict(blocks["materialized"].content["signature"])["attention"] == "materialized"
    assert "attention" not in dict(blocks["sdpa"].content["signature"])  # fused plans keep their event ids
    assert blocks["sdpa"].id != blocks["materialized"].id
    attention = next(k for k in event_kernels(blocks["materialized"].content) if isinstance(k, Attention))
    assert (attention.kind, attention.launches) == ("materialized", 3)
    tensors = 2 * 4 * 8 * 2 * (16 + 16)  # b heads d x (q + out, k + v) x seq
    assert attention.bytes == (tensors + 2 * 4 * 16 * 16 * 4) * 4
    fused_attention = next(k for k in event_kernels(blocks["sdpa"].content) if isinstance(k, Attention))
    assert fused_attention.kind == "sdpa" and fused_attention.bytes == tensors * 4


@pytest.mark.parametrize("causal_family", ["gpt2-small", "bert-base"])
def test_the_materialized_core_computes_what_the_fused_one_does(causal_family):
    torch.manual_seed(0)
    fused_spec = loads_spec(spec_text(name=causal_family))
    block = TransformerBlock(fused_spec.model)
    materialized = TransformerBlock(loads_spec(spec_text("materialized", name=causal_family)).model)
    materialized.load_state_dict(block.state_dict())
    x = torch.randn(2, 16, 32, requires_grad=True)
    y = torch.randn(2, 16, 32)
    out = block(x)
    (out * y).sum().backward()
    grad, x.grad = x.grad.clone(), None
    out_materialized = materialized(x)
    (out_materialized * y).sum().backward()
    assert torch.allclose(out, out_materialized, atol=1e-5)
    assert torch.allclose(grad, x.grad, atol=1e-5)


@pytest.mark.parametrize("micro, fallback", [(1, True), (4, False)])
def test_16_bit_scores_megatrons_fused_kernel_does_not_take_are_softmaxed_in_float32(monkeypatch, micro, fallback):
    """Two heads of 64 keys: micro x heads = 2 is not a multiple of the fused kernel's 8 batches a block, so the
    block masks and softmaxes its bfloat16 scores in float32 (Megatron-LM's fallback); at micro 4 it does not. Either
    way the probabilities are bfloat16 and the output is the fused attention's within bfloat16's precision."""
    seen = []
    softmax = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda x, dim: seen.append(x.dtype) or softmax(x, dim=dim))
    text = spec_text("materialized", hidden=32, heads=2, seq=64, micro=micro, global_batch=micro)
    spec = loads_spec(text.replace('dtype = "float32"', 'dtype = "bfloat16"'))
    torch.manual_seed(0)
    materialized = TransformerBlock(spec.model)
    fused = TransformerBlock(loads_spec(spec.to_toml().replace('attention = "materialized"\n', "")).model)
    fused.load_state_dict(materialized.state_dict())
    x = torch.randn(micro, 64, 32, dtype=torch.bfloat16)
    out = materialized(x)
    assert seen == [torch.float32 if fallback else torch.bfloat16] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, fused(x), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("change, field, message", [
    ('attention = "flash"', "model.attention", "unknown value 'flash'; expected one of sdpa, materialized"),
    ('attention = "materialized"\n[cp]', "model.attention", "materialized attention with cp = 2 is not built"),
])
def test_refusals_name_the_field(change, field, message):
    text = spec_text(cp=2 if "[cp]" in change else 1, global_batch=4)
    text = text.replace("vocab = 128", "vocab = 128\n" + change.replace("\n[cp]", ""))
    with pytest.raises(SpecError, match=message) as caught:
        loads_spec(text)
    assert caught.value.field == field


def test_a_factory_model_is_refused_an_attention_kind():
    text = spec_text("materialized").replace('name = "gpt2-small"', 'factory = "tests.user_model:build"')
    with pytest.raises(SpecError, match="a factory model's attention is its own code") as caught:
        loads_spec(text, import_factory=False)
    assert caught.value.field == "model.attention"


@pytest.mark.parametrize("field, value", [("attention", "materialised"), ("cross_entropy", "megatron-lm")])
def test_the_cli_refuses_an_unknown_kind_with_exit_2(tmp_path, project_env, field, value):
    """[model] attention's and cross_entropy's (tests/test_cross_entropy_kind.py) unknown values."""
    path = tmp_path / "spec.toml"
    path.write_text(tiny_spec_text(layers=2, model={field: value}))
    result = subprocess.run([sys.executable, "-m", "harness", "events", str(path)], capture_output=True, text=True,
                            env=project_env, timeout=120)
    assert result.returncode == 2
    assert f"[model.{field}] unknown value '{value}'" in result.stderr and "Traceback" not in result.stderr


MEGATRON = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --micro-batch-size 2 "
            "--global-batch-size 16 --vocab-size 50257 --fp16")


@pytest.mark.parametrize("extra, kind, noted", [
    ("--checkpoint-activations", "materialized", True),  # Megatron-DeepSpeed's spelling: its local attention
    ("--deepspeed --use-flash-attn-v2", "sdpa", False),
    ("--transformer-impl local", "materialized", False),
    ("--transformer-impl transformer_engine", "sdpa", False),
    ("--attention-backend unfused", "materialized", False),
    ("--attention-backend flash", "sdpa", False),
    ("--checkpoint-activations --context-parallel-size 2", "sdpa", False),  # cp needs Transformer Engine
    ("", "sdpa", True),  # today's Megatron-LM: Transformer Engine's fused attention
])
def test_megatrons_arguments_say_the_attention_kind(extra, kind, noted):
    imported = from_megatron(f"{MEGATRON} {extra}", gpus=8)
    assert imported.spec.model.attention == kind
    assert any(note.startswith("attention ") for note in imported.notes) == noted
    assert not any("attn" in item or "attention-backend" in item or "transformer-impl" in item
                   for item in imported.not_modelled + imported.unknown)


@pytest.mark.parametrize("extra, dropout, listed", [
    ("", 0.1, False),  # Megatron's default for both
    ("--hidden-dropout 0 --attention-dropout 0", 0.0, False),
    ("--hidden-dropout 0.2 --attention-dropout 0.05", 0.05, True),  # one probability: the attention's
])
def test_megatrons_dropout_becomes_the_specs(extra, dropout, listed):
    imported = from_megatron(f"{MEGATRON} {extra}", gpus=8)
    assert imported.spec.model.dropout == dropout
    assert any(line.startswith("--hidden-dropout") for line in imported.not_modelled) == listed


def test_megatrons_dropout_is_refused_at_one_and_dropped_with_context_parallelism():
    from harness.common.errors import UserError

    with pytest.raises(UserError, match="--attention-dropout must be a probability below 1, got 1"):
        from_megatron(f"{MEGATRON} --attention-dropout 1", gpus=8)
    ring = from_megatron(f"{MEGATRON} --context-parallel-size 2", gpus=8)
    assert ring.spec.model.dropout == 0.0 and ring.spec.strategy.cp == 2
    assert any(line.startswith("dropout (--hidden-dropout, --attention-dropout): dropout with cp = 2 is not built")
               for line in ring.not_modelled)

"""[model] cross_entropy: a whole head's loss, torch's cross_entropy or Megatron-LM's vocabulary-parallel one (which a
head split by vocabulary always runs), from the spec through the head's signature, the built-in head that runs it,
the memory model and Megatron's arguments; the refusals."""
from __future__ import annotations

import pytest
import torch

from analysis.memory import backward_moments
from harness.common.errors import SpecError
from harness.models.transformer import Head
from harness.plan.events import build_plan
from harness.plan.importers.megatron import from_megatron
from harness.plan.spec import loads_spec
from tests.helpers import tiny_spec_text


def spec_text(cross_entropy: str | None = None, **kwargs) -> str:
    return tiny_spec_text(layers=2, model={"cross_entropy": cross_entropy} if cross_entropy else None, **kwargs)


def test_the_default_is_torchs_and_megatrons_round_trips_into_the_heads_signature():
    assert loads_spec(spec_text()).model.cross_entropy == "torch"
    spec = loads_spec(spec_text("megatron"))
    assert spec.model.cross_entropy == "megatron" and loads_spec(spec.to_toml()) == spec
    assert "cross_entropy" not in loads_spec(spec_text("torch")).to_dict()["model"]  # the default is not written
    torch_head, megatron_head = (build_plan(loads_spec(spec_text(kind))).layers[-1] for kind in (None, "megatron"))
    assert dict(megatron_head.signature)["cross_entropy"] == "megatron"
    assert "cross_entropy" not in dict(torch_head.signature)  # torch's plans keep their event ids
    split = build_plan(loads_spec(spec_text("megatron", tp=2, global_batch=4))).layers[-1]
    assert "cross_entropy" not in dict(split.signature)  # a split head runs Megatron-LM's loss whatever it says


@pytest.mark.parametrize("name", ["gpt2-small", "llama-1b"])
def test_megatrons_loss_on_a_whole_head_is_torchs_loss_and_gradient(name):
    torch.manual_seed(0)
    heads = {kind: Head(loads_spec(spec_text(kind, name=name)).model) for kind in ("torch", "megatron")}
    heads["megatron"].load_state_dict(heads["torch"].state_dict())
    x = torch.randn(2, 16, 32)
    targets = torch.randint(0, 128, (2, 16))
    results = {}
    for kind, head in heads.items():
        hidden = x.clone().requires_grad_()
        loss = head.loss(head(hidden), targets)
        loss.backward()
        results[kind] = loss.detach(), hidden.grad
    torch.testing.assert_close(results["megatron"][0], results["torch"][0])
    torch.testing.assert_close(results["megatron"][1], results["torch"][1])


def test_the_memory_model_gives_megatrons_whole_head_the_split_heads_moments():
    """torch's loss holds the log-probabilities' gradient and the logits' made from it before the head's backward
    (2 x b s V x 4 bytes); Megatron-LM's turns its saved softmax into the logits' gradient in place: nothing."""
    plans = {kind: build_plan(loads_spec(spec_text(kind))) for kind in ("torch", "megatron")}
    moments = {kind: backward_moments(plan.spec, plan.layers[-1]) for kind, plan in plans.items()}
    assert moments["torch"][0] == (2 * 2 * 16 * 128 * 4, 0, "before")
    assert moments["megatron"][0] == (0, 0, "before")
    assert moments["torch"][1:] == moments["megatron"][1:]


def test_refusals_name_the_field():
    with pytest.raises(SpecError, match="unknown value 'fused'; expected one of torch, megatron") as caught:
        loads_spec(spec_text("fused"))
    assert caught.value.field == "model.cross_entropy"
    factory = spec_text("megatron").replace('name = "gpt2-small"', 'factory = "tests.user_model:build"')
    with pytest.raises(SpecError, match="a factory model's loss is its own code") as caught:
        loads_spec(factory, import_factory=False)
    assert caught.value.field == "model.cross_entropy"


def test_megatrons_arguments_say_megatrons_loss_and_list_its_16_bit_one():
    arguments = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --micro-batch-size 2 "
                 "--global-batch-size 16 --vocab-size 50257 --fp16")
    assert from_megatron(arguments, gpus=8).spec.model.cross_entropy == "megatron"
    imported = from_megatron(arguments + " --fp16-lm-cross-entropy", gpus=8)
    assert any(line.startswith("--fp16-lm-cross-entropy") for line in imported.not_modelled)

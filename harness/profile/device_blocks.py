"""The tiny built-in blocks `harness device` times a training pass's framework on, plain and as a run wraps a layer,
and what is read from them.

Rules:
- a block (FRAMEWORK_FAMILIES at FRAMEWORK_SIZES) runs as a training pass runs it, forward and backward through
  nn.Module and autograd (framework_block), with the kernels harness.plan.kernels lists for that pass; it is small
  enough that its kernels' own work is a small part of its time, within the fitted kernels' smallest sizes (no
  curve extrapolated). Its time beyond its kernels' modelled work over their launches is the framework's time a
  kernel (framework_launch: a CPU's `launch_us`; on a GPU the host's issue time, harness.profile.device_curves);
- the same blocks as a run wraps a layer (wrapper_runners): under torch.utils.checkpoint as full recompute runs it,
  as an FSDP2 unit over this rank alone as a ZeRO job runs it (harness.profile.sharded), and through a zero-bubble
  schedule's split backward (stage_backward_input, then _weight), each forward and forward-and-backward against the
  plain block's in the same rounds. A wrapper's seconds a forward and a backward beyond the layer's own are
  [wrappers.NAME] (wrapper_costs: their median over the families; a checkpoint's backward net of the forward it
  runs again, which the model costs as kernels; each of the split's two halves net of its own kernels,
  split_kernels).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from harness.models.transformer import TORCH_DTYPES
from harness.plan.device import DeviceDescription, WrapperCost
from harness.plan.device_fit import kernel_seconds
from harness.plan.kernels import Kernel, MemoryBound, PassShape, accumulation_kernels, layer_kernels
from harness.plan.layers import describe_builtin
from harness.plan.spec import DTYPES, ModelSpec

# on a CPU, the blocks a training pass's per-kernel framework time is measured on: small enough that their kernels'
# own work is a small part of their time, within the fitted kernels' smallest sizes (no curve extrapolated)
FRAMEWORK_FAMILIES = ("gpt2", "bert", "llama")
FRAMEWORK_SIZES = {"hidden": 64, "heads": 2, "ffn": 128, "seq_len": 32, "vocab": 64, "micro": 1}


def framework_model(family: str, dtype: str) -> ModelSpec:
    sizes = FRAMEWORK_SIZES
    return ModelSpec(name=f"{family}-framework", family=family, layers=1, hidden=sizes["hidden"],
                     heads=sizes["heads"], kv_heads=1 if family == "llama" else sizes["heads"], ffn=sizes["ffn"],
                     seq_len=sizes["seq_len"], vocab=sizes["vocab"], dtype=dtype)


def framework_input(dtype: str, device: torch.device) -> torch.Tensor:
    sizes = FRAMEWORK_SIZES
    return torch.randn(sizes["micro"], sizes["seq_len"], sizes["hidden"], dtype=TORCH_DTYPES[dtype], device=device,
                       requires_grad=True)


def _passes(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[Callable[[], object], ...]:
    """(a forward of `layer` on `x` as a training pass runs it, a forward and its backward)."""
    def forward():
        return layer(x)

    def forward_backward():
        out = layer(x)
        out.backward(torch.ones_like(out))
        return out
    return forward, forward_backward


def framework_block(family: str, dtype: str, device: torch.device) -> tuple[Callable[[], object], list[Kernel]]:
    """A tiny built-in block of `family` (FRAMEWORK_SIZES) as a training pass runs it, forward and backward
    through nn.Module and autograd: (a closure that runs it once, the kernels harness.plan.kernels lists for
    that pass)."""
    from harness.models.transformer import build_layer

    model = framework_model(family, dtype)
    block = build_layer(model, "block").to(device)
    desc = next(layer for layer in describe_builtin(model, 1) if layer.kind == "block")
    shape = PassShape(micro=FRAMEWORK_SIZES["micro"], seq=FRAMEWORK_SIZES["seq_len"])
    kernels = layer_kernels(desc, shape, "fwd") + split_kernels(family, dtype)[0]
    return _passes(block, framework_input(dtype, device))[1], kernels


def split_kernels(family: str, dtype: str) -> tuple[list[Kernel], list[Kernel], list[Kernel]]:
    """framework_block's block's backward, whole and split (wrapper_runners' split): the kernels of its plain
    backward, of the input's half and of the weights' half, as harness.plan.kernels lists them, each with the
    gradient adds run after run makes in it (the input's in the first half, the parameters' in the second:
    stage_backward_input and _weight add into .grad), listed so that the framework's time holds none (a job lists
    its own accumulation, harness.plan.kernels.job_event_kernels)."""
    desc = next(layer for layer in describe_builtin(framework_model(family, dtype), 1) if layer.kind == "block")
    shape = PassShape(micro=FRAMEWORK_SIZES["micro"], seq=FRAMEWORK_SIZES["seq_len"])
    inputs = FRAMEWORK_SIZES["micro"] * FRAMEWORK_SIZES["seq_len"] * FRAMEWORK_SIZES["hidden"]
    input_add = MemoryBound("input.grad_accumulate", 3.0 * inputs * DTYPES[dtype], dtype, op="add",
                            elements=float(inputs))

    def weights_added(phase: str) -> list[Kernel]:
        return accumulation_kernels({"layer": "block", "signature": desc.signature, "phase": phase}, 1.0)
    return (layer_kernels(desc, shape, "bwd") + weights_added("bwd") + [input_add],
            layer_kernels(desc, shape, "bwd_input") + [input_add],
            layer_kernels(desc, shape, "bwd_weight") + weights_added("bwd_weight"))


# the runners of wrapper_runners, in order: the plain block's forward, then each wrapper's forward and forward with
# backward (the split backward's: forward with the input's half, and with both halves); the plain block's forward
# and backward is framework_block's
WRAPPER_PASSES = ("plain", "checkpointed", "fsdp2", "split_backward")


def wrapper_runners(family: str, dtype: str, device: torch.device) -> list[Callable[[], object]]:
    """A tiny built-in block of `family` (framework_block's size) as a run wraps a layer (module docstring): its
    plain forward, then per wrapper (WRAPPER_PASSES[1:]) its forward and its forward with backward; for the split
    backward its forward with the input's half (stage_backward_input) and with both halves. The FSDP2 unit is over
    this rank alone (harness.profile.sharded: call within its leaving_no_world)."""
    from harness.models import checkpointed, split_backward
    from harness.models.transformer import build_layer
    from harness.profile.sharded import shard_alone

    model = framework_model(family, dtype)
    x = framework_input(dtype, device)
    block = build_layer(model, "block").to(device)
    unit = shard_alone(build_layer(model, "block").to(device), device)
    backward_input, backward_weight = split_backward()

    def split(weights: bool) -> Callable[[], object]:
        def run():
            out = block(x)
            _, groups = backward_input([out], [torch.ones_like(out)], [x], block.parameters())
            if weights:
                backward_weight(block.parameters(), groups)
            return out
        return run
    return [_passes(block, x)[0], *_passes(lambda y: checkpointed(block, y), x), *_passes(unit, x),
            split(False), split(True)]


def wrapper_costs(plain_forward_backward: Sequence[float], passes: Sequence[Sequence[float]],
                  split_modelled: Sequence[tuple[float, float, float]]) -> dict[str, WrapperCost]:
    """[wrappers] from the families' measured seconds: `plain_forward_backward` each family's plain block forward
    and backward (framework_block's), `passes` its wrapper_runners' seconds. A wrapper's forward is its forward
    less the plain one; its backward its backward (its forward and backward less its forward) less the plain
    backward, and for a checkpoint less the forward it runs again too, as wrapped (the plan runs that forward
    again as the layer's forward event, wrapper and all). The split backward's halves (the input's: its forward
    with that half less the plain forward; the weights': the rest) each less its own kernels: `split_modelled` the
    family's modelled seconds of split_kernels' (plain backward, input's half, weights' half), scaled by the
    measured plain backward over its modelled one (what the model leaves out of a plain pass is not the split's).
    The median over the families, at least 0."""
    names = WRAPPER_PASSES[1:]
    forward, backward, weight = ({name: [] for name in names} for _ in range(3))
    for both, (plain, *wrapped), modelled in zip(plain_forward_backward, passes, split_modelled):
        plain_backward = both - plain
        for i, name in enumerate(names):
            ahead, whole = wrapped[2 * i], wrapped[2 * i + 1]
            if name == "split_backward":
                whole_modelled, input_modelled, weight_modelled = modelled
                scale = plain_backward / whole_modelled if whole_modelled > 0 else 1.0
                forward[name].append(0.0)
                backward[name].append(ahead - plain - scale * input_modelled)
                weight[name].append(whole - ahead - scale * weight_modelled)
                continue
            forward[name].append(ahead - plain)
            backward[name].append(whole - ahead - plain_backward - (ahead if name == "checkpointed" else 0.0))
            weight[name].append(0.0)

    def median(values: list[float]) -> float:
        return max(0.0, float(np.median(values)))
    return {name: WrapperCost(median(forward[name]), median(backward[name]), weight_s=median(weight[name]))
            for name in names}


def framework_launch(description: DeviceDescription, blocks: Sequence[tuple[list[Kernel], float]]) -> list[float]:
    """Per block (kernels, measured seconds), its seconds a launch beyond its kernels' modelled work on
    `description` (launches costed 0): a list in the blocks' order."""
    workless = dataclasses.replace(description, launch_s=0.0)
    return [(seconds - sum(kernel_seconds(workless, k) for k in kernels))
            / sum(description.kernel_launches(k) for k in kernels) for kernels, seconds in blocks]


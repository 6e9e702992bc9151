"""Compute events: build one layer (a tensor-parallel shard) and time its forward, backward or optimizer step.

The layer runs alone: a tensor-parallel shard's collectives are measured as their own events.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from harness.models import TORCH_DTYPES, build_layer
from harness.models.transformer import Head
from harness.profilers.timer import synchronize, time_region
from harness.spec import JobSpec


def _make_layer(spec: JobSpec, content: dict, device: torch.device) -> tuple[torch.nn.Module, Callable]:
    """The layer of a compute event and a function returning a fresh input for it."""
    model = spec.model
    kind = content["layer"]
    signature = content["signature"]
    micro, seq = content.get("micro", spec.batch.micro), content.get("seq", model.seq_len)
    dtype = TORCH_DTYPES[model.dtype]
    if kind == "user":
        from harness.layers import describe
        from harness.models.user import load_factory_layers

        descs = describe(spec)
        index = next(d.index for d in descs if dict(d.signature) == signature)
        layer = load_factory_layers(model)[index]
        if index == 0:
            return layer.to(device), lambda: torch.randint(0, model.vocab, (micro, seq), device=device)
        features = descs[index - 1].out_features
        layer = layer.to(device)
        return layer, lambda: torch.randn(micro, seq, *features, device=device, dtype=dtype, requires_grad=True)
    layer = build_layer(model, kind, tp=int(signature.get("tp", 1))).to(device)
    if kind == "embedding":
        return layer, lambda: torch.randint(0, model.vocab, (micro, seq), device=device)
    return layer, lambda: torch.randn(micro, seq, model.hidden, device=device, dtype=dtype, requires_grad=True)


def _forward(spec: JobSpec, layer: torch.nn.Module, x: torch.Tensor, content: dict) -> torch.Tensor:
    out = layer(x)
    if content.get("last"):  # the model's last layer: the loss is part of its forward
        targets = torch.randint(0, spec.model.vocab, out.shape[:2], device=out.device)
        return Head.loss(out, targets)
    return out


def measure_compute(spec: JobSpec, content: dict, device: torch.device, warmup: int, repeats: int) -> np.ndarray:
    """Samples (seconds) of one compute event: phase fwd, bwd or optimizer of one layer."""
    layer, make_input = _make_layer(spec, content, device)
    phase = content["phase"]
    samples = np.empty(repeats, dtype=np.float64)
    if phase == "optimizer":
        optimizer = torch.optim.Adam(layer.parameters(), lr=1e-4)
        for p in layer.parameters():
            p.grad = torch.randn_like(p)
        for i in range(warmup + repeats):
            t = time_region(optimizer.step, device)
            if i >= warmup:
                samples[i - warmup] = t
        return samples
    is_last = content["layer"] == "head" or (content["layer"] == "user" and _is_last_user_layer(spec, content))
    content = dict(content, last=is_last)
    for i in range(warmup + repeats):
        x = make_input()
        if phase == "fwd":
            t = time_region(lambda: _forward(spec, layer, x, content), device)
        else:
            out = _forward(spec, layer, x, content)
            grad = None if out.dim() == 0 else torch.randn_like(out)
            synchronize(device)
            t = time_region(lambda: out.backward(grad), device)
            layer.zero_grad(set_to_none=True)
        if i >= warmup:
            samples[i - warmup] = t
    return samples


def _is_last_user_layer(spec: JobSpec, content: dict) -> bool:
    from harness.layers import describe

    descs = describe(spec)
    return dict(descs[-1].signature) == content["signature"]

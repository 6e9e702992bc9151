"""Users' models: `factory = "module:function"` in the spec (contract in docs/spec.md).

The factory is called as function(model: ModelSpec) and returns the model as a sequence of layers
(list, tuple, nn.Sequential or nn.ModuleList). The first layer takes token ids, a LongTensor of shape
(micro, seq_len) with values in [0, vocab); every later layer takes the previous layer's output (one
tensor); the last returns logits of shape (micro, seq_len, vocab), trained with cross-entropy.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch
from torch import nn

from harness.common.errors import SpecError
from harness.plan.layers import LayerDesc
from harness.plan.spec import JobSpec, ModelSpec


def load_factory_layers(model: ModelSpec) -> list[nn.Module]:
    """Call the user's factory and return its layers, checking the contract."""
    module_name, _, func_name = (model.factory or "").partition(":")
    factory = getattr(importlib.import_module(module_name), func_name)
    try:
        built = factory(model)
    except SystemExit as exc:  # would end every rank's run without a word
        raise SpecError(f"factory {model.factory!r} called sys.exit({exc.code!r}); return the layers instead",
                        field="model.factory") from None
    except Exception as exc:
        raise SpecError(f"factory {model.factory!r} raised {type(exc).__name__}: {exc}",
                        field="model.factory") from exc
    if isinstance(built, nn.Module) and not isinstance(built, (nn.Sequential, nn.ModuleList)):
        raise SpecError(f"factory {model.factory!r} returned one {type(built).__name__}; return a sequence of "
                        "layers (list, nn.Sequential or nn.ModuleList) so it can be split into stages",
                        field="model.factory")
    try:
        layers: Sequence = list(built)
    except TypeError:  # not iterable: an int, None, a tensor of no dimensions
        layers = []
    if not layers or not all(isinstance(layer, nn.Module) for layer in layers):
        raise SpecError(f"factory {model.factory!r} must return a non-empty sequence of torch.nn.Module, got "
                        f"{type(built).__name__}", field="model.factory")
    if len(layers) != model.layers:
        raise SpecError(f"factory {model.factory!r} returned {len(layers)} layers but the spec says "
                        f"layers = {model.layers}; set layers to {len(layers)}", field="model.layers")
    return list(layers)


def describe_user_model(spec: JobSpec) -> list[LayerDesc]:
    """Describe a factory model's layers by building it on the meta device and tracing shapes."""
    model = spec.model
    with torch.device("meta"):
        layers = load_factory_layers(model)
        x: torch.Tensor = torch.zeros(spec.batch.micro, model.seq_len, dtype=torch.long)
        out: list[LayerDesc] = []
        first_index: dict[tuple, int] = {}
        for index, layer in enumerate(layers):
            in_shape = tuple(x.shape[2:]) if x.dim() > 2 else ()
            in_dtype = str(x.dtype).removeprefix("torch.")
            try:
                x = layer(x)
            except Exception as exc:
                raise SpecError(f"layer {index} ({type(layer).__name__}) failed on an input of shape "
                                f"{tuple(x.shape)}: {exc}", field="model.factory") from exc
            if not isinstance(x, torch.Tensor):
                raise SpecError(f"layer {index} ({type(layer).__name__}) must return one tensor",
                                field="model.factory")
            params = sum(p.numel() for p in layer.parameters())
            shapes = tuple(tuple(p.shape) for p in layer.parameters())
            signature = (("family", "user"), ("class", f"{type(layer).__module__}.{type(layer).__qualname__}"),
                         ("param_shapes", repr(shapes)), ("in_features", repr(in_shape)), ("in_dtype", in_dtype),
                         ("dtype", model.dtype))
            index_first = first_index.setdefault(signature, index)
            kind = "user"
            out.append(LayerDesc(kind=kind, signature=signature, params=params,
                                 fwd_flops_per_token=2.0 * params + 1.0, out_features=tuple(x.shape[2:]),
                                 index=index_first))
        if tuple(x.shape) != (spec.batch.micro, model.seq_len, model.vocab):
            raise SpecError(f"the last layer must return logits of shape (micro, seq_len, vocab) = "
                            f"{(spec.batch.micro, model.seq_len, model.vocab)}, got {tuple(x.shape)}",
                            field="model.factory")
    return out


def factory_layers(spec: JobSpec) -> list[LayerDesc] | None:
    """A factory model's layer descriptions, traced with torch, for the plan; None for a built-in model (the plan
    describes those from the spec alone)."""
    if spec.model.family != "user":
        return None
    try:
        return describe_user_model(spec)
    except SpecError as exc:  # the factory's refusal, said with the spec that names it
        if exc.source is not None or not spec.source:
            raise
        raise SpecError(str(exc).split("] ", 1)[-1], field=exc.field, source=spec.source) from None

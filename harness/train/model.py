"""The model of a training run: deterministic full layers, their tensor-parallel shards, the data, and a
single-process reference that the parallel run must reproduce.

Every layer is first built whole (tp = 1) from a seed derived from (run seed, layer position), then cut
into this rank's Megatron shard. So a run's weights do not depend on its strategy: any dp x tp x pp run of
a spec starts from the same model as `reference_losses`, and their losses agree up to float rounding.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from harness.common.errors import UserError
from harness.models import TORCH_DTYPES, build_layer, make_optimizer
from harness.models.context import split_sequence
from harness.models.transformer import Head, cross_entropy
from harness.models.user import factory_layers
from harness.plan.layers import LayerDesc, sequence_shards, user_input
from harness.plan.routing import moe_index_of
from harness.plan.spec import JobSpec, ModelSpec

_ROW_PARALLEL = ("proj.weight", "fc2.weight", "down.weight")
_VOCAB_PARALLEL = ("tokens.weight", "out.weight", "out.bias")  # an embedding's and a head's, split by vocabulary


def layer_seed(seed: int, position: int) -> int:
    """The torch seed of the layer at `position` (0 = embedding) for run seed `seed`."""
    return (seed * 1_000_003 + position * 7_919 + 17) % (2**63 - 1)


def dropout_seed(seed: int, pp_rank: int) -> int:
    """The seed of torch's global generator, which dropout draws from, on pipeline rank `pp_rank` for run seed
    `seed`: every tensor- and data-parallel rank of a stage alike, as Megatron-LM seeds it (seed + 100 x its
    pipeline rank), so that a tensor-parallel group's replicated activations stay equal."""
    return (seed * 1_000_003 + 100 * pp_rank + 29) % (2**63 - 1)


def _column_sections(name: str, model: ModelSpec) -> list[int] | None:
    """How a column-parallel weight's output rows are grouped (each group is split over tp separately)."""
    head_dim = model.hidden // model.heads
    if name.startswith("qkv."):
        if model.family == "llama":
            return [model.heads * head_dim, model.kv_heads * head_dim, model.kv_heads * head_dim]
        return [model.hidden] * 3
    if name.startswith("gate_up."):
        return [model.ffn, model.ffn]
    if name.startswith("fc1."):
        return [model.ffn]
    return None


def shard_tensor(name: str, full: torch.Tensor, model: ModelSpec, tp: int, tp_index: int) -> torch.Tensor:
    """Rank `tp_index`'s shard of parameter `name` of a whole transformer block, or of a whole embedding or head
    split by vocabulary (Megatron layout)."""
    if name in _VOCAB_PARALLEL:
        return full.chunk(tp, dim=0)[tp_index]
    sections = _column_sections(name, model)
    if sections is not None:
        parts = torch.split(full, sections, dim=0)
        return torch.cat([part.chunk(tp, dim=0)[tp_index] for part in parts], dim=0)
    if name in _ROW_PARALLEL:
        return full.chunk(tp, dim=1)[tp_index]
    return full  # replicated: norms, row-parallel biases


def build_full_layer(model: ModelSpec, kind: str, seed: int, position: int, tied: bool = False,
                     selective: bool = False) -> nn.Module:
    """A whole (tp = 1) built-in layer, initialised from its own seed; the global RNG is left untouched. With
    tie_embeddings a head that keeps a copy of the token table (`tied` false: another pipeline stage holds the
    embedding) starts from the embedding's weights, as Megatron-LM initializes it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, position))
        moe_layer = moe_index_of(model, position) if kind == "block" else None
        layer = build_layer(model, kind, 1, None, tied=tied, moe_layer=moe_layer, selective=selective)
    if kind == "head" and model.tie_embeddings and not tied:
        with torch.no_grad():
            layer.out.weight.copy_(build_full_layer(model, "embedding", seed, 0).tokens.weight)
    return layer


def replicated(name: str, model: ModelSpec) -> bool:
    """Whether parameter `name` of a built-in layer is held whole by every tensor-parallel rank (shard_tensor)."""
    return name not in _VOCAB_PARALLEL and name not in _ROW_PARALLEL and _column_sections(name, model) is None


def build_shard(model: ModelSpec, kind: str, seed: int, position: int, tp: int, tp_index: int, group,
                tied: bool = False, sp: bool = False, context: dict | None = None,
                experts: dict | None = None, selective: bool = False) -> nn.Module:
    """This rank's layer: the whole layer for tp = 1; else shard `tp_index` of `tp` cut from it (a block's
    Megatron shard, an embedding's or head's by vocabulary); `tied`: a head to tie to the embedding; `sp`:
    sequence-parallel; `context`: context parallelism's build_layer arguments (cp, cp_group, cp_rank, cp_comm);
    `experts`: expert parallelism's (ep, ep_group, ep_rank): a MoE block holding ep rank's experts of the whole;
    `selective`: a block whose attention core is recomputed in the backward."""
    full = build_full_layer(model, kind, seed, position, tied, selective)
    if tp == 1 and not context and not experts:
        return full
    moe_layer = moe_index_of(model, position) if kind == "block" else None
    with torch.random.fork_rng(devices=[]):
        shard = build_layer(model, kind, tp, group, tp_index, tied, sp, **(context or {}), moe_layer=moe_layer,
                            **(experts or {}), selective=selective)
    full_params = dict(full.named_parameters())
    with torch.no_grad():
        if experts and shard.moe is not None:
            shard.moe.load_experts_from(full.moe)
        for name, param in shard.named_parameters():
            if name.startswith("moe."):
                continue
            piece = shard_tensor(name, full_params[name], model, tp, tp_index)
            if piece.shape != param.shape:
                raise RuntimeError(f"cannot shard {name}: whole {tuple(full_params[name].shape)} gives "
                                   f"{tuple(piece.shape)}, the shard has {tuple(param.shape)}")
            param.copy_(piece)
    return shard


def build_user_layers(model: ModelSpec, seed: int) -> list[nn.Module]:
    """A factory model's layers, built under the run seed."""
    from harness.models.user import load_factory_layers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, 0))
        return load_factory_layers(model)


def build_layers(spec: JobSpec, layers: Sequence[LayerDesc], positions: Sequence[int], seed: int, tp_index: int = 0,
                 group=None, device: torch.device | str = "cpu", whole: bool = False, cp_index: int = 0,
                 cp_group=None, ep_index: int = 0, ep_group=None) -> dict[int, nn.Module]:
    """The modules at `positions` (indexes into the plan's layers) for tensor-parallel rank `tp_index` and
    context-parallel rank `cp_index` of `cp_group` (`whole`: the unsharded layers, whatever the spec's tp and cp);
    a tied head among them holds the embedding's token table (tie_embeddings on one pipeline stage)."""
    out: dict[int, nn.Module] = {}
    if spec.model.family == "user":
        every = build_user_layers(spec.model, seed)
        for position in positions:
            out[position] = every[position].to(device)
        return out
    for position in positions:
        signature = dict(layers[position].signature)
        shards = 1 if whole else int(signature.get("tp", 1))  # a replicated embedding or head: 1
        cp = 1 if whole else int(signature.get("cp", 1))
        context = {"cp": cp, "cp_group": cp_group, "cp_rank": cp_index,
                   "cp_comm": str(signature.get("cp_comm", "ring"))} if cp > 1 else None
        ep = 1 if whole else int(signature.get("ep", 1))
        experts = {"ep": ep, "ep_group": ep_group, "ep_rank": ep_index} if ep > 1 else None
        out[position] = build_shard(spec.model, layers[position].kind, seed, position, shards, tp_index, group,
                                    tied=bool(signature.get("tied", False)),
                                    sp=bool(signature.get("sp", False)) and not whole, context=context,
                                    experts=experts, selective=signature.get("recompute") == "selective").to(device)
        if signature.get("tied"):
            out[position].tie(out[0].tokens.weight)  # the embedding: a tied head is on its stage
    return out


def activation_spec(spec: JobSpec, layers: Sequence[LayerDesc], first_position: int) -> tuple[tuple[int, ...],
                                                                                                 torch.dtype]:
    """Shape and dtype of the activation entering the layer at `first_position` (> 0) of a micro-batch (with
    sequence parallelism, this rank's seq / tp tokens of it)."""
    micro, seq = spec.batch.micro, spec.model.seq_len // spec.strategy.cp
    if spec.model.family != "user":
        return (micro, seq // sequence_shards(spec), spec.model.hidden), TORCH_DTYPES[spec.model.dtype]
    features, dtype_name = user_input(layers[first_position], spec.model.dtype)
    dtype = getattr(torch, dtype_name)
    if not dtype.is_floating_point:
        raise UserError(f"the pipeline cuts the model before layer {first_position}, whose input is {dtype}: "
                        "activations passed between stages must be floating point (change layers or pp)")
    return (micro, seq, *features), dtype


def make_tokens(spec: JobSpec, seed: int, iteration: int = 0) -> torch.Tensor:
    """Random token ids of the whole global batch, (global, seq + 1): inputs are [:, :-1], targets [:, 1:]."""
    generator = torch.Generator().manual_seed((seed * 7_777_777 + 1_234_567 + iteration) % (2**63 - 1))
    return torch.randint(0, spec.model.vocab, (spec.batch.global_size, spec.model.seq_len + 1),
                         generator=generator, dtype=torch.long)


def micro_batch(tokens: torch.Tensor, spec: JobSpec, dp_index: int, micro: int,
                cp_index: int | None = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets) of micro-batch `micro` of data-parallel replica `dp_index`: with context parallelism the
    tokens of rank `cp_index`, its two zigzag chunks of the sequence (harness.models.context); None: all of them."""
    size = spec.batch.micro
    start = (dp_index * spec.micro_batches + micro) * size
    rows = tokens[start:start + size]
    ids, targets = rows[:, :-1], rows[:, 1:]
    cp = spec.strategy.cp
    if cp > 1 and cp_index is not None:
        ids, targets = split_sequence(ids, cp, cp_index, 1), split_sequence(targets, cp, cp_index, 1)
    return ids, targets


def loss_of(logits: torch.Tensor, targets: torch.Tensor, last: nn.Module | None = None) -> torch.Tensor:
    """Next-token cross-entropy (float32), averaged over the micro-batch's tokens: a built-in `last` layer's
    own loss (vocabulary-parallel where the head is split by vocabulary), else over whole logits."""
    if isinstance(last, Head):
        return last.loss(logits, targets)
    return cross_entropy(logits, targets)


def reference_losses(spec: JobSpec, iterations: int, *, seed: int = 0, lr: float = 1e-3, fresh_data: bool = False,
                     layers: Sequence[LayerDesc] | None = None) -> list[float]:
    """Train the whole model in this process (no parallelism) and return the loss of every iteration.

    The same initial weights, data and optimizer steps as `harness train` with any strategy of the spec: the
    loss of a parallel run must match these up to float rounding.
    """
    from harness.plan.events import build_plan

    if layers is None:
        layers = build_plan(spec, factory_layers(spec)).layers
    modules = build_layers(spec, layers, range(len(layers)), seed, whole=True)
    ordered = [modules[i] for i in range(len(layers))]
    if spec.model.tie_embeddings:  # one weight, whichever stages the parallel run puts the two on
        ordered[-1].tie(ordered[0].tokens.weight)
    # one, as harness train steps it: the spec's (SGD without momentum shows a gradient's scale, Adam hides it)
    params = [p for m in ordered for p in m.parameters()]
    optimizer = make_optimizer(spec.optimizer.name, spec.optimizer.momentum, params, lr)
    dp, m = spec.strategy.dp, spec.micro_batches
    torch.manual_seed(dropout_seed(seed, 0))  # the first stage's, as harness train seeds it
    losses = []
    for iteration in range(iterations):
        tokens = make_tokens(spec, seed, iteration if fresh_data else 0)
        for module in ordered:
            module.zero_grad(set_to_none=True)
        total = 0.0
        for d in range(dp):
            for i in range(m):
                x, targets = micro_batch(tokens, spec, d, i, cp_index=None)
                for module in ordered:
                    x = module(x)
                loss = loss_of(x, targets)
                (loss / (dp * m)).backward()
                total += float(loss.detach())
        optimizer.step()
        losses.append(total / (dp * m))
    return losses

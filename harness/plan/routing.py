"""How a Mixture-of-Experts router spreads a micro-batch's tokens over the experts, deterministically, so that
a prediction and a real run (harness train's forced router) see the same token counts. Pure Python.

- Shares: `uniform` (1 / experts each), `zipf:S` (expert i, from 1, gets a share proportional to 1 / i^S) or a
  measured histogram (`file:PATH`: JSON `{"experts": E, "layers": [[tokens per expert], ...]}`, one list for every
  MoE layer or one for all), normalised to sum 1.
- Counts: of T tokens each routed to top_k distinct experts, an expert gets its share of the T x top_k
  assignments (largest remainders), at most T (a token goes to an expert once: what a share would put beyond
  T goes to the others, in proportion); with a capacity factor c > 0 at most ceil(c x T x top_k / experts),
  the rest dropped, not rerouted (those tokens keep fewer experts).
- The table: token t goes to the top_k experts with the most assignments still to make (ties to the lower
  index), so every count is met and a token's experts are distinct.
- Expert parallelism: ep rank j holds experts [j E / ep, (j + 1) E / ep); every rank routes its own tokens by
  the same table, so rank i sends rank j the tokens of j's experts and rank j receives ep times that.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from harness.common.errors import SpecError


def parse_routing(text: str, experts: int, moe_layers: int, histogram=None) -> tuple[tuple[float, ...], ...]:
    """Check a [model] routing against the experts and MoE layers; the measured histogram it names (per MoE
    layer; a stored spec's `expert_histogram`, which wins over re-reading the file), else () for a rule."""
    kind, _, arg = text.partition(":")
    if kind == "uniform" and not arg:
        return ()
    if kind == "zipf":
        try:
            skew = float(arg)
        except ValueError:
            skew = float("nan")
        if not math.isfinite(skew) or skew <= 0:
            raise SpecError(f"zipf:S needs a skew S > 0 (expert i gets a share proportional to 1 / i^S), got {text!r}",
                            field="model.routing")
        return ()
    if kind != "file" or not arg:
        raise SpecError(f"unknown routing {text!r}; give uniform, zipf:S (S > 0) or file:PATH (a JSON histogram "
                        "of tokens per expert, docs/spec.md)", field="model.routing")
    if histogram is None:
        try:
            data = json.loads(Path(arg).read_text())
        except OSError as exc:
            raise SpecError(f"cannot read the routing file {arg}: {exc.strerror}", field="model.routing") from None
        except (ValueError, RecursionError) as exc:
            raise SpecError(f"the routing file {arg} is not JSON: {str(exc)[:200] or type(exc).__name__}",
                            field="model.routing") from None
        if not isinstance(data, dict) or "layers" not in data:
            raise SpecError(f"the routing file {arg} must hold {{\"experts\": E, \"layers\": [[tokens per expert], "
                            "...]}", field="model.routing")
        if data.get("experts", experts) != experts:
            raise SpecError(f"the routing file {arg} is for {data.get('experts')} experts, the model has {experts}",
                            field="model.routing")
        histogram = data["layers"]
    layers = [list(layer) for layer in histogram] if isinstance(histogram, (list, tuple)) else None
    if not layers or any(len(layer) != experts for layer in layers) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
            for layer in layers for v in layer) or any(sum(layer) <= 0 for layer in layers):
        raise SpecError(f"the routing histogram must be lists of {experts} token counts (numbers of 0 or more, not all "
                        f"0), one for each of the {moe_layers} MoE layers or one for all", field="model.routing")
    if len(layers) not in (1, moe_layers):
        raise SpecError(f"the routing histogram has {len(layers)} layers; the model has {moe_layers} MoE layers: give "
                        "one list for each, or one for all", field="model.routing")
    return tuple(tuple(float(v) for v in layer) for layer in layers)


def expert_shares(routing: str, experts: int, histogram: tuple[tuple[float, ...], ...] = (),
                  moe_layer: int = 0) -> tuple[float, ...]:
    """Each expert's share of the assignments in MoE layer `moe_layer` (0 = the first MoE block)."""
    kind, _, arg = routing.partition(":")
    if kind == "zipf":
        weights = [1.0 / (i + 1) ** float(arg) for i in range(experts)]
    elif kind == "file":
        weights = list(histogram[moe_layer if len(histogram) > 1 else 0])
    else:
        weights = [1.0] * experts
    total = sum(weights)
    return tuple(w / total for w in weights)


def expert_counts(shares: tuple[float, ...], tokens: int, top_k: int, capacity_factor: float = 0.0) -> tuple[int, ...]:
    """Tokens each expert gets of `tokens` routed to top_k experts each (module docstring)."""
    experts = len(shares)
    total = tokens * top_k
    counts = [0] * experts
    open_ = set(range(experts))
    while open_ and sum(counts) < total:  # water-filling: what a full expert cannot take goes to the others by share
        left = total - sum(counts)
        weight = sum(shares[e] for e in open_)
        if weight <= 0:
            break
        exact = {e: left * shares[e] / weight for e in open_}
        for e in open_:
            counts[e] += min(int(exact[e]), tokens - counts[e])
        rest = total - sum(counts)
        for e in sorted((e for e in open_ if counts[e] < tokens), key=lambda e: (-(exact[e] % 1), e))[:rest]:
            counts[e] += 1
        full = {e for e in open_ if counts[e] >= tokens}
        if not full:
            break
        open_ -= full
    if sum(counts) != total:
        raise ValueError(f"{tokens} tokens cannot go to {top_k} distinct of {experts} experts by shares {shares}")
    if capacity_factor > 0:  # what an expert cannot take is dropped, not sent elsewhere
        cap = math.ceil(capacity_factor * total / experts)
        counts = [min(c, cap) for c in counts]
    return tuple(counts)


def route_table(counts: tuple[int, ...], tokens: int, top_k: int) -> list[tuple[int, ...]]:
    """Each token's experts (distinct, at most top_k), meeting `counts` (module docstring)."""
    left = list(counts)
    table = []
    for _ in range(tokens):
        # the experts with the most left: one that needs every token left is always among them
        order = sorted((e for e in range(len(left)) if left[e] > 0), key=lambda e: (-left[e], e))
        chosen = tuple(sorted(order[:top_k]))
        for e in chosen:
            left[e] -= 1
        table.append(chosen)
    if any(left):
        raise ValueError(f"the counts {counts} cannot be met by {tokens} tokens of top {top_k}")
    return table


def rank_tokens(counts: tuple[int, ...], ep: int) -> tuple[int, ...]:
    """Tokens of one rank's micro-batch each ep rank's experts take (what every rank sends each of them)."""
    per = len(counts) // ep
    return tuple(sum(counts[j * per:(j + 1) * per]) for j in range(ep))


def router(model, moe_index: int):
    """The route of MoE layer `moe_index` of a ModelSpec: T -> each of T tokens' experts (harness.models.moe)."""
    shares = expert_shares(model.routing, model.experts, model.expert_histogram, moe_index)
    tables: dict[int, list[tuple[int, ...]]] = {}

    def route(tokens: int) -> list[tuple[int, ...]]:
        if tokens not in tables:
            tables[tokens] = route_table(expert_counts(shares, tokens, model.top_k, model.capacity_factor), tokens,
                                         model.top_k)
        return tables[tokens]
    return route


def moe_tag(model, moe_index: int) -> str:
    """What a MoE layer's all-to-alls' names carry where layers route differently (a histogram per layer: their
    messages differ), '#' and its index; else nothing (every layer's are one event)."""
    return f"#{moe_index}" if len(model.expert_histogram) > 1 else ""


def moe_index_of(model, block: int) -> int | None:
    """The MoE layer index (0 = the first MoE block) of block `block` (1 = the first), None for a dense one."""
    return block // model.moe_every - 1 if model.is_moe_block(block) else None

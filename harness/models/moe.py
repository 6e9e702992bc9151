"""Mixture-of-Experts MLP with expert parallelism (ep): a gate, top-k routing, and experts spread over ep ranks.

Routing. The gate's logits and softmax are float32 (float64 inputs stay float64). Which experts a token goes to
is not the gate's top-k but a route table, `route(T)`: for each of the T local tokens the tuple of distinct
expert ids it goes to (top_k of them, fewer where a capacity dropped some, possibly none), so that a simulation
controls the load each expert sees. A token's weights are its chosen experts' probabilities renormalized to sum
to 1 over them (Mixtral); a token with no expert gets nothing from the routed part.

Assumption: `route` is deterministic and the same on every ep rank, and every rank has the same T, so every
rank routes its own tokens by one table and knows every other rank's send counts without exchanging split
sizes. The table is taken once per token count and cached (the last count's).

Layout. The `experts` experts are split into ep consecutive blocks: expert e lives on ep rank e // (experts / ep).
A rank's local expert j is the whole model's expert `first_expert + j`; its weights are row j of every stacked
expert parameter (`fc1_weight[j]`, ... see `expert_parameters`). Shared experts (DeepSeek) are one always-on
FFN of width shared_experts * expert_ffn, replicated on every ep rank.

Forward: the (token, expert) assignments sorted by expert (stable by token) give the permuted tokens; an
all-to-all with uneven splits dispatches them to the ranks owning their experts; each local expert computes on
the rows it received from every source (grouped by expert); the reverse all-to-all combines them back; they
are un-permuted, weighted and summed per token, and the shared experts' output added. The backward runs the
two all-to-alls in reverse. Each is run through harness.models.tp.hooked under its name (and the layer's `tag`):
DISPATCH, COMBINE
forward, COMBINE_GRAD, DISPATCH_GRAD backward (in that order).

With ep = 1 nothing is communicated. `LocalExperts(ep, rank)` stands in for the group when one rank's share is
profiled alone: no communication, but the same shapes and copies: the "received" rows are the rank's own
permuted tokens repeated or cut to the count it would receive, so the experts compute at their real token
counts, and the rows "sent back" likewise.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from harness.models.tp import hooked

DISPATCH, COMBINE = "ep.dispatch", "ep.combine"
DISPATCH_GRAD, COMBINE_GRAD = "ep.dispatch_grad", "ep.combine_grad"

Route = Callable[[int], Sequence[Sequence[int]]]
ACTIVATIONS = ("gelu", "swiglu")


class LocalExperts(NamedTuple):
    """A stand-in for an ep group of `ep` ranks seen from `rank`, with no communication (module docstring)."""
    ep: int
    rank: int = 0


def table_counts(route_table: Sequence[Sequence[int]], experts: int) -> list[int]:
    """How many of the table's tokens go to each expert."""
    counts = [0] * experts
    for chosen in route_table:
        for e in chosen:
            counts[e] += 1
    return counts


def send_counts(route_table: Sequence[Sequence[int]], experts: int, ep: int) -> list[int]:
    """How many token rows a rank routing its tokens by route_table sends to each ep rank (itself included)."""
    per_rank = _experts_per_rank(experts, ep)
    counts = table_counts(route_table, experts)
    return [sum(counts[r * per_rank:(r + 1) * per_rank]) for r in range(ep)]


def _experts_per_rank(experts: int, ep: int) -> int:
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive integer, got {ep!r}")
    if experts < 1 or experts % ep:
        raise ValueError(f"{experts} experts do not split evenly over ep = {ep} ranks")
    return experts // ep


def _check_table(table: Sequence[Sequence[int]], tokens: int, experts: int, top_k: int) -> list[tuple[int, ...]]:
    if len(table) != tokens:
        raise ValueError(f"the route table has {len(table)} entries for {tokens} tokens")
    checked = []
    for t, chosen in enumerate(table):
        chosen = tuple(int(e) for e in chosen)
        if len(chosen) > top_k or len(set(chosen)) != len(chosen) or any(not 0 <= e < experts for e in chosen):
            raise ValueError(f"token {t} is routed to {chosen}: at most top_k = {top_k} distinct experts "
                             f"in [0, {experts}) are allowed")
        checked.append(chosen)
    return checked


def _ffn(x: torch.Tensor, activation: str, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One expert's FFN: gelu (fc1 weight, fc1 bias, fc2 weight, fc2 bias) or swiglu (gate_up weight, down
    weight; the gate first, as harness.models.transformer)."""
    if activation == "swiglu":
        gate, up = F.linear(x, params[0]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, params[1])
    return F.linear(F.gelu(F.linear(x, params[0], params[1])), params[2], params[3])


def _all_to_all(x: torch.Tensor, group, send: list[int], recv: list[int], name: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    hooked(name, lambda: dist.all_to_all_single(out, x, recv, send, group=group))
    return out


class _AllToAll(torch.autograd.Function):
    """Rows split by `send` go to the group's ranks in order, `recv` rows come from each; the backward sends the
    gradient back the reverse way."""

    @staticmethod
    def forward(ctx, x, group, send, recv, name, grad_name):
        ctx.group, ctx.send, ctx.recv, ctx.grad_name = group, send, recv, grad_name
        return _all_to_all(x, group, send, recv, name)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.recv, ctx.send, ctx.grad_name), None, None, None, None, None


def _resize_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A copy of x's rows repeated or cut to `rows` (zeros if x has none): what a stand-in "receives"."""
    if x.shape[0] == 0:
        return x.new_zeros((rows,) + tuple(x.shape[1:]))
    return x.index_select(0, torch.arange(rows, device=x.device) % x.shape[0])


class _Layout(NamedTuple):
    """Index tensors and split sizes derived from one route table."""
    token: torch.Tensor  # (assignments,) the token of each assignment, sorted by expert, stable by token
    expert: torch.Tensor  # (assignments,) its expert
    send: list[int]  # rows sent to each ep rank
    recv: list[int]  # rows received from each ep rank
    grouped_counts: list[int]  # rows each local expert computes, every source's together
    regroup: torch.Tensor  # received rows (by source, then expert) -> grouped by expert, then source
    ungroup: torch.Tensor  # its inverse


class MoEMLP(nn.Module):
    """A Mixture-of-Experts MLP over (batch, seq, hidden), this ep rank's experts (module docstring).

    Parameters: `gate` (hidden -> experts, no bias); the local experts stacked along dim 0: gelu `fc1_weight`
    (E, expert_ffn, hidden), `fc1_bias` (E, expert_ffn), `fc2_weight` (E, hidden, expert_ffn), `fc2_bias`
    (E, hidden); swiglu `gate_up_weight` (E, 2 * expert_ffn, hidden), `down_weight` (E, hidden, expert_ffn);
    E = experts / ep. Shared experts, if any: the same names prefixed `shared_`, without the E dimension.
    """

    def __init__(self, hidden: int, expert_ffn: int, experts: int, top_k: int, route: Route, *,
                 shared_experts: int = 0, activation: str = "gelu", ep: int = 1, ep_group=None, ep_rank: int = 0,
                 dtype=None, tag: str = ""):
        super().__init__()
        per_rank = _experts_per_rank(experts, ep)
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if shared_experts < 0:
            raise ValueError(f"shared_experts must be >= 0, got {shared_experts}")
        if not 0 <= ep_rank < ep:
            raise ValueError(f"ep_rank must be in [0, {ep}), got {ep_rank}")
        if isinstance(ep_group, LocalExperts):
            if tuple(ep_group) != (ep, ep_rank):
                raise ValueError(f"{ep_group} does not match ep = {ep}, ep_rank = {ep_rank}")
        elif ep_group is not None:
            size, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
            if (size, rank) != (ep, ep_rank):
                raise ValueError(f"the ep group has {size} ranks and this is its rank {rank}; "
                                 f"expected ep = {ep}, ep_rank = {ep_rank}")
        elif ep > 1:
            raise ValueError(f"ep = {ep} needs an ep_group: a process group, or LocalExperts({ep}, {ep_rank}) to "
                             "profile this rank's share alone")
        self.hidden, self.expert_ffn, self.experts, self.top_k = hidden, expert_ffn, experts, top_k
        self.route, self.shared_experts, self.activation = route, shared_experts, activation
        self.ep, self.ep_group, self.ep_rank = ep, ep_group, ep_rank
        self.tag = tag  # appended to the all-to-alls' names: which MoE layer's, where layers' differ
        self.local_experts, self.first_expert = per_rank, ep_rank * per_rank
        self._layouts: dict[tuple[int, torch.device], _Layout] = {}

        self.gate = nn.Linear(hidden, experts, bias=False, dtype=dtype)
        nn.init.normal_(self.gate.weight, std=0.02)
        self._expert_names = self._ffn_parameters("", (per_rank,), expert_ffn, dtype)
        self._shared_names = (self._ffn_parameters("shared_", (), shared_experts * expert_ffn, dtype)
                              if shared_experts else [])

    def _ffn_parameters(self, prefix: str, lead: tuple[int, ...], width: int, dtype) -> list[str]:
        h = self.hidden
        if self.activation == "swiglu":
            shapes = {"gate_up_weight": (2 * width, h), "down_weight": (h, width)}
        else:
            shapes = {"fc1_weight": (width, h), "fc1_bias": (width,), "fc2_weight": (h, width), "fc2_bias": (h,)}
        for name, shape in shapes.items():
            param = nn.Parameter(torch.zeros(lead + shape, dtype=dtype))
            if name.endswith("weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2) if name.startswith(("fc2", "down")) else 0.02)
            setattr(self, prefix + name, param)
        return [prefix + name for name in shapes]

    # ---- parameters and sizes -----------------------------------------------------------------------------------

    @property
    def expert_ids(self) -> range:
        """The whole model's ids of this rank's experts: local expert j is expert_ids[j]."""
        return range(self.first_expert, self.first_expert + self.local_experts)

    def expert_parameters(self) -> list[nn.Parameter]:
        """The local experts' stacked parameters (row j of each is local expert j's), in _ffn's order."""
        return [getattr(self, name) for name in self._expert_names]

    def shared_parameters(self) -> list[nn.Parameter]:
        """The shared experts' parameters (empty without shared experts), replicated on every ep rank."""
        return [getattr(self, name) for name in self._shared_names]

    @torch.no_grad()
    def load_experts_from(self, whole: MoEMLP) -> None:
        """Copy the gate, the shared experts and this rank's experts from a whole (ep = 1) MoEMLP of the same
        sizes."""
        sizes = ("hidden", "expert_ffn", "experts", "shared_experts", "activation")
        if whole.ep != 1 or any(getattr(whole, s) != getattr(self, s) for s in sizes):
            raise ValueError("load_experts_from needs an ep = 1 MoEMLP with the same "
                             + ", ".join(f"{s} = {getattr(self, s)}" for s in sizes))
        self.gate.weight.copy_(whole.gate.weight)
        for mine, theirs in zip(self.shared_parameters(), whole.shared_parameters()):
            mine.copy_(theirs)
        for mine, theirs in zip(self.expert_parameters(), whole.expert_parameters()):
            mine.copy_(theirs[self.first_expert:self.first_expert + self.local_experts])

    def route_table(self, tokens: int) -> list[tuple[int, ...]]:
        """The checked route table for `tokens` local tokens."""
        return _check_table(self.route(tokens), tokens, self.experts, self.top_k)

    def tokens_received(self, tokens: int) -> list[int]:
        """Rows each local expert computes when every ep rank has `tokens` tokens (every rank's together)."""
        counts = table_counts(self.route_table(tokens), self.experts)
        return [self.ep * counts[e] for e in self.expert_ids]

    # ---- forward ------------------------------------------------------------------------------------------------

    def _layout(self, tokens: int, device: torch.device) -> _Layout:
        key = (tokens, device)
        if key not in self._layouts:
            table = self.route_table(tokens)
            pairs = sorted(((e, t) for t, chosen in enumerate(table) for e in chosen))
            counts = table_counts(table, self.experts)
            local = [counts[e] for e in self.expert_ids]
            per_source = sum(local)
            starts = [sum(local[:j]) for j in range(len(local))]
            regroup = [s * per_source + starts[j] + i
                       for j in range(len(local)) for s in range(self.ep) for i in range(local[j])]
            regroup_t = torch.tensor(regroup, dtype=torch.long, device=device)
            self._layouts = {key: _Layout(  # one token count at a time: a layer sees one shape
                token=torch.tensor([t for _, t in pairs], dtype=torch.long, device=device),
                expert=torch.tensor([e for e, _ in pairs], dtype=torch.long, device=device),
                send=send_counts(table, self.experts, self.ep), recv=[per_source] * self.ep,
                grouped_counts=[self.ep * c for c in local], regroup=regroup_t,
                ungroup=torch.argsort(regroup_t))}
        return self._layouts[key]

    def _exchange(self, rows: torch.Tensor, send: list[int], recv: list[int], name: str,
                  grad_name: str) -> torch.Tensor:
        if isinstance(self.ep_group, LocalExperts):
            return _resize_rows(rows, sum(recv))
        return _AllToAll.apply(rows, self.ep_group, send, recv, name, grad_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.hidden)
        layout = self._layout(flat.shape[0], flat.device)
        acc = torch.promote_types(flat.dtype, torch.float32)
        probs = torch.softmax(F.linear(flat.to(acc), self.gate.weight.to(acc)), dim=-1)
        chosen = probs[layout.token, layout.expert]
        total = torch.zeros(flat.shape[0], dtype=acc, device=flat.device).index_add(0, layout.token, chosen)
        weights = chosen / total[layout.token]

        rows = flat.index_select(0, layout.token)
        communicates = self.ep > 1 or isinstance(self.ep_group, LocalExperts)
        if communicates:
            rows = self._exchange(rows, layout.send, layout.recv, DISPATCH + self.tag, DISPATCH_GRAD + self.tag)
            rows = rows.index_select(0, layout.regroup)
        params = list(zip(*(p.unbind(0) for p in self.expert_parameters())))  # one stack in the backward
        out = torch.cat([_ffn(part, self.activation, params[j])
                         for j, part in enumerate(rows.split(layout.grouped_counts))])
        if communicates:
            out = out.index_select(0, layout.ungroup)
            out = self._exchange(out, layout.recv, layout.send, COMBINE + self.tag, COMBINE_GRAD + self.tag)

        routed = torch.zeros(flat.shape, dtype=acc, device=flat.device)
        routed = routed.index_add(0, layout.token, out.to(acc) * weights.unsqueeze(-1)).to(flat.dtype)
        if self.shared_experts:
            routed = routed + _ffn(flat, self.activation, self.shared_parameters())
        return routed.view(shape)

"""The Mixture-of-Experts MLP with expert parallelism (harness.models.moe).

Serially: ep = 1 against a naive per-token loop (each token's experts weighted by their renormalized
probabilities, plus the shared experts), output and gradients in float64, gelu and swiglu; a token with no
expert gets only the shared part; bfloat16 in, bfloat16 out; the send and receive counts pinned on a small
table; the LocalExperts stand-in computes each expert at the rows it would receive; bad arguments refused.
Under mpirun (any world size of 2 or more, the world as the ep group, 2 experts per rank, top 2 of a skewed
table, different tokens on every rank): each rank's output and gradients equal a whole (ep = 1) model's on its
tokens, each local expert's gradient the sum over ranks of the whole model's, and the hook sees the two
all-to-alls forward and their two gradients backward.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.models import moe
from harness.models.moe import (
    COMBINE,
    COMBINE_GRAD,
    DISPATCH,
    DISPATCH_GRAD,
    LocalExperts,
    MoEMLP,
    send_counts,
    table_counts,
)
from harness.models.tp import set_collective_hook

HIDDEN, FFN = 8, 12


def skewed_route(experts: int, top_k: int = 2):
    """A deterministic, uneven table: the first choice crowds the first three experts, every fifth token lost
    one expert to a capacity and every seventh both."""
    def route(tokens: int) -> list[tuple[int, ...]]:
        table = []
        for t in range(tokens):
            first = t % min(3, experts)
            second = (experts - 1 - 2 * t) % experts
            chosen = (first,) if second == first else (first, second)
            if t % 7 == 6:
                chosen = ()
            elif t % 5 == 4:
                chosen = chosen[-1:]
            table.append(chosen[:top_k])
        return table
    return route


def _params(layer: MoEMLP) -> list[torch.nn.Parameter]:
    return [layer.gate.weight, *layer.expert_parameters(), *layer.shared_parameters()]


def naive(layer: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the sum over its experts of weight * expert(x), weights the chosen experts' softmax
    probabilities renormalized over them, plus the shared experts' FFN."""
    flat = x.reshape(-1, layer.hidden)
    table = layer.route(flat.shape[0])
    experts = layer.expert_parameters()
    rows = []
    for t, token in enumerate(flat):
        probs = torch.softmax(layer.gate.weight.to(torch.float64) @ token.to(torch.float64), dim=-1)
        out = torch.zeros(layer.hidden, dtype=torch.float64)
        total = sum(probs[e] for e in table[t])
        for e in table[t]:
            if layer.activation == "swiglu":
                gate, up = (experts[0][e] @ token).chunk(2)
                y = experts[1][e] @ (F.silu(gate) * up)
            else:
                y = experts[2][e] @ F.gelu(experts[0][e] @ token + experts[1][e]) + experts[3][e]
            out = out + probs[e] / total * y.to(torch.float64)
        if layer.shared_experts:
            shared = layer.shared_parameters()
            if layer.activation == "swiglu":
                gate, up = (shared[0] @ token).chunk(2)
                out = out + shared[1] @ (F.silu(gate) * up)
            else:
                out = out + shared[2] @ F.gelu(shared[0] @ token + shared[1]) + shared[3]
        rows.append(out.to(x.dtype))
    return torch.stack(rows).view(x.shape)


def _run(fn, layer: MoEMLP, x: torch.Tensor, grad: torch.Tensor):
    """fn(layer, x) and the gradients of x and of the layer's parameters (then cleared)."""
    x = x.clone().requires_grad_(True)
    out = fn(layer, x)
    out.backward(grad)
    grads = [x.grad] + [p.grad.clone() for p in _params(layer)]
    layer.zero_grad(set_to_none=True)
    return out.detach(), grads


def _run_hooked(layer, x, grad):
    """_run of the layer's forward with the collective hook recording every collective's name."""
    seen: list[str] = []
    set_collective_hook(lambda name, run: (seen.append(name), run()))
    try:
        out, grads = _run(MoEMLP.__call__, layer, x, grad)
    finally:
        set_collective_hook(None)
    return out, grads, seen


def _inputs(shape, seed: int, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2)]


# ---- ep = 1 ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("shared", [0, 2])
def test_it_equals_a_per_token_loop(activation, shared):
    torch.manual_seed(0)
    layer = MoEMLP(HIDDEN, FFN, 4, 2, skewed_route(4), shared_experts=shared, activation=activation,
                   dtype=torch.float64)
    for p in _params(layer):  # larger weights, so that the gate and the activations matter
        torch.nn.init.normal_(p, std=0.5)
    x, grad = _inputs((2, 7, HIDDEN), seed=1)
    got, got_grads, seen = _run_hooked(layer, x, grad)
    expected, expected_grads = _run(naive, layer, x, grad)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert seen == []  # ep = 1 communicates nothing


def test_a_token_without_experts_gets_only_the_shared_part():
    layer = MoEMLP(HIDDEN, FFN, 4, 2, lambda t: [()] * t, shared_experts=1, dtype=torch.float64)
    x = torch.randn(1, 3, HIDDEN, dtype=torch.float64)
    shared = layer.shared_parameters()
    expected = F.linear(F.gelu(F.linear(x, shared[0], shared[1])), shared[2], shared[3])
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(MoEMLP(HIDDEN, FFN, 4, 2, lambda t: [()] * t)(x.float()), torch.zeros(1, 3, HIDDEN))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_bfloat16_in_bfloat16_out(activation):
    torch.manual_seed(0)
    whole = MoEMLP(HIDDEN, FFN, 4, 2, skewed_route(4), shared_experts=1, activation=activation)
    layer = MoEMLP(HIDDEN, FFN, 4, 2, skewed_route(4), shared_experts=1, activation=activation,
                   dtype=torch.bfloat16)
    with torch.no_grad():
        for mine, theirs in zip(_params(layer), _params(whole)):
            theirs.copy_(mine)
    x = torch.randn(2, 5, HIDDEN).to(torch.bfloat16)
    out = layer(x.requires_grad_(True))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and all(p.grad.dtype == torch.bfloat16 for p in _params(layer))
    torch.testing.assert_close(out.float(), whole(x.detach().float()), rtol=2e-2, atol=2e-3)


# ---- counts ---------------------------------------------------------------------------------------------------

def test_send_and_receive_counts_on_a_small_table():
    table = [(0, 3), (3,), (), (1, 2), (0, 1), (3, 2)]
    assert table_counts(table, 4) == [2, 2, 2, 3]
    assert send_counts(table, 4, 1) == [9]
    assert send_counts(table, 4, 2) == [4, 5]
    assert send_counts(table, 4, 4) == [2, 2, 2, 3]
    for rank, received in ((0, [4, 4]), (1, [4, 6])):
        layer = MoEMLP(HIDDEN, FFN, 4, 2, lambda t: table, ep=2, ep_group=LocalExperts(2, rank), ep_rank=rank)
        assert layer.tokens_received(6) == received
        assert list(layer.expert_ids) == [2 * rank, 2 * rank + 1]
    with pytest.raises(ValueError, match="do not split evenly"):
        send_counts(table, 4, 3)


def test_local_experts_compute_at_the_rows_they_would_receive(monkeypatch):
    route = skewed_route(8)
    calls: list[tuple[int, ...]] = []
    ffn = moe._ffn
    monkeypatch.setattr(moe, "_ffn", lambda x, activation, params: (calls.append(tuple(x.shape)),
                                                                     ffn(x, activation, params))[1])
    x = torch.randn(2, 9, HIDDEN, requires_grad=True)
    table = route(18)
    for rank in range(4):
        layer = MoEMLP(HIDDEN, FFN, 8, 2, route, activation="swiglu", ep=4, ep_group=LocalExperts(4, rank),
                       ep_rank=rank)
        calls.clear()
        seen: list[str] = []
        set_collective_hook(lambda name, run, seen=seen: (seen.append(name), run()))
        try:
            out = layer(x)
            out.sum().backward()
        finally:
            set_collective_hook(None)
        counts = table_counts(table, 8)
        assert layer.tokens_received(18) == [4 * counts[e] for e in range(2 * rank, 2 * rank + 2)]
        assert calls == [(n, HIDDEN) for n in layer.tokens_received(18)]
        assert out.shape == x.shape and seen == []  # a stand-in communicates nothing
        assert all(p.grad is not None and p.grad.shape == p.shape for p in layer.expert_parameters())
        x.grad = None


def test_bad_arguments_are_refused():
    route = skewed_route(4)
    with pytest.raises(ValueError, match="do not split evenly"):
        MoEMLP(HIDDEN, FFN, 4, 2, route, ep=3, ep_group=LocalExperts(3))
    with pytest.raises(ValueError, match="needs an ep_group"):
        MoEMLP(HIDDEN, FFN, 4, 2, route, ep=2)
    with pytest.raises(ValueError, match="does not match"):
        MoEMLP(HIDDEN, FFN, 4, 2, route, ep=2, ep_group=LocalExperts(2, 1), ep_rank=0)
    with pytest.raises(ValueError, match="activation"):
        MoEMLP(HIDDEN, FFN, 4, 2, route, activation="relu")
    with pytest.raises(ValueError, match="top_k"):
        MoEMLP(HIDDEN, FFN, 4, 5, route)
    with pytest.raises(ValueError, match="at most top_k = 1 distinct"):
        MoEMLP(HIDDEN, FFN, 4, 1, route)(torch.zeros(1, 2, HIDDEN))
    with pytest.raises(ValueError, match="3 entries for 2 tokens"):
        MoEMLP(HIDDEN, FFN, 4, 1, lambda t: [(0,)] * 3)(torch.zeros(1, 2, HIDDEN))
    whole = MoEMLP(HIDDEN, FFN, 4, 2, route, activation="swiglu")
    with pytest.raises(ValueError, match="same"):
        MoEMLP(HIDDEN, FFN, 4, 2, route, ep=2, ep_group=LocalExperts(2)).load_experts_from(whole)


# ---- under mpirun ---------------------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_expert_parallel_equals_the_whole_model(activation):
    """The world is the ep group; each rank's tokens differ. Output, x, gate and shared gradients equal the
    whole model's on the rank's tokens; each local expert's gradient the sum over ranks of the whole model's."""
    import torch.distributed as dist
    from mpi4py import MPI

    from harness.runtime.distributed import destroy_process_group, init_process_group
    from launcher.topology import discover

    comm = MPI.COMM_WORLD
    ep, rank = comm.Get_size(), comm.Get_rank()
    experts = 2 * ep
    init_process_group(comm, discover(comm), torch.device("cpu"), timeout_s=120)
    try:
        group = dist.new_group(list(range(ep)))
        route = skewed_route(experts)
        torch.manual_seed(0)  # the same whole model on every rank
        whole = MoEMLP(HIDDEN, FFN, experts, 2, route, shared_experts=1, activation=activation,
                       dtype=torch.float64)
        for p in _params(whole):
            torch.nn.init.normal_(p, std=0.5)
        layer = MoEMLP(HIDDEN, FFN, experts, 2, route, shared_experts=1, activation=activation, ep=ep,
                       ep_group=group, ep_rank=rank, dtype=torch.float64)
        layer.load_experts_from(whole)
        x, grad = _inputs((2, 9, HIDDEN), seed=100 + rank)

        table = route(18)
        assert len(set(send_counts(table, experts, ep))) > 1  # uneven
        assert sum(layer.tokens_received(18)) == ep * send_counts(table, experts, ep)[rank]

        got, got_grads, seen = _run_hooked(layer, x, grad)
        assert seen == [DISPATCH, COMBINE, COMBINE_GRAD, DISPATCH_GRAD]
        expected, expected_grads = _run(MoEMLP.__call__, whole, x, grad)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)

        n_experts = len(layer.expert_parameters())
        got_x, got_gate, got_experts, got_shared = (got_grads[0], got_grads[1], got_grads[2:2 + n_experts],
                                                    got_grads[2 + n_experts:])
        ref_x, ref_gate, ref_experts, ref_shared = (expected_grads[0], expected_grads[1],
                                                    expected_grads[2:2 + n_experts], expected_grads[2 + n_experts:])
        for a, b in [(got_x, ref_x), (got_gate, ref_gate), *zip(got_shared, ref_shared)]:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        mine = slice(layer.first_expert, layer.first_expert + layer.local_experts)
        for a, b in zip(got_experts, ref_experts):
            dist.all_reduce(b, group=group)
            torch.testing.assert_close(a, b[mine], rtol=1e-10, atol=1e-12)

        # bfloat16 in and out, through the same all-to-alls, against the whole model in bfloat16
        whole16 = MoEMLP(HIDDEN, FFN, experts, 2, route, shared_experts=1, activation=activation,
                         dtype=torch.bfloat16)
        layer16 = MoEMLP(HIDDEN, FFN, experts, 2, route, shared_experts=1, activation=activation, ep=ep,
                         ep_group=group, ep_rank=rank, dtype=torch.bfloat16)
        whole16.load_experts_from(whole)
        layer16.load_experts_from(whole)
        out16 = layer16(x.to(torch.bfloat16))
        assert out16.dtype == torch.bfloat16
        torch.testing.assert_close(out16, whole16(x.to(torch.bfloat16)), rtol=2e-2, atol=2e-2)
    finally:
        destroy_process_group()

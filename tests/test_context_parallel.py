"""Context parallelism (harness.models.context): the zigzag layout, the ring's schedule and its causal work, and
ring and all-gather attention against whole-sequence F.scaled_dot_product_attention.

Serially: the chunks and positions each rank holds, split/merge, the ring pinned for cp = 3, every causal
chunk pair computed exactly once and the same work on every rank, and cp = 1 (no group) equal to plain
attention with its gradients. Under mpirun (any world size of 2 or more, the world as the cp group): each
rank's output and q, k, v gradients equal the whole sequence's at its positions, causal and not, float64 and a
bfloat16 forward, and the hook sees every exchange.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from harness.models.context import (ALLGATHER, DIAGONAL, FULL, KV, KV_GRAD, REDUCE_SCATTER, SKIP, RingStep,
                                    allgather_attention, local_positions, merge_sequence, pair_kind,
                                    rank_work, ring_attention, ring_steps, split_sequence, step_pairs,
                                    zigzag_chunks)

BATCH, HEADS, CHUNK, HEAD_DIM = 2, 2, 4, 8


# ---- layout ---------------------------------------------------------------------------------------------------

def test_zigzag_pairs_the_first_chunks_with_the_last():
    assert [zigzag_chunks(2, r) for r in range(2)] == [(0, 3), (1, 2)]
    assert [zigzag_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert zigzag_chunks(1, 0) == (0, 1)


@pytest.mark.parametrize("cp, rank", [(0, 0), (-1, 0), (2, 2), (2, -1), (2.0, 0), (True, 0), (2, None)])
def test_zigzag_refuses_bad_arguments(cp, rank):
    with pytest.raises(ValueError, match="cp must|rank must"):
        zigzag_chunks(cp, rank)


def test_local_positions_and_their_checks():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    assert sorted(torch.cat([local_positions(24, 3, r) for r in range(3)]).tolist()) == list(range(24))
    with pytest.raises(ValueError, match="2 \\* cp = 4 equal chunks"):
        local_positions(10, 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_then_merge_is_the_identity(cp):
    x = torch.arange(2 * 3 * 2 * cp * 5).reshape(2, 3, 2 * cp * 5)
    parts = [split_sequence(x, cp, r, dim=-1) for r in range(cp)]
    for r, part in enumerate(parts):
        assert torch.equal(part, x[..., local_positions(x.shape[-1], cp, r)])
    assert torch.equal(merge_sequence(parts, cp, dim=-1), x)
    with pytest.raises(ValueError, match="one part per rank"):
        merge_sequence(parts[:-1] if cp > 1 else parts * 2, cp, dim=-1)


# ---- schedule -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q, kv, causal, kind", [(1, 0, True, FULL), (1, 1, True, DIAGONAL), (0, 1, True, SKIP),
                                                 (0, 1, False, FULL), (1, 1, False, FULL)])
def test_pair_kind(q, kv, causal, kind):
    assert pair_kind(q, kv, causal) == kind


def test_the_ring_for_three_ranks():
    # chunks: rank 0 holds (0, 5), rank 1 (1, 4), rank 2 (2, 3); keys and values move to rank + 1
    assert ring_steps(3) == [
        [RingStep(0, (0, 5), 1, 2), RingStep(1, (1, 4), 2, 0), RingStep(2, (2, 3), 0, 1)],
        [RingStep(2, (2, 3), 1, 2), RingStep(0, (0, 5), 2, 0), RingStep(1, (1, 4), 0, 1)],
        [RingStep(1, (1, 4), None, None), RingStep(2, (2, 3), None, None), RingStep(0, (0, 5), None, None)]]
    assert ring_steps(1) == [[RingStep(0, (0, 1), None, None)]]
    assert step_pairs(3, 1, 1, causal=True) == [(1, 0, FULL), (1, 5, SKIP), (4, 0, FULL), (4, 5, SKIP)]
    assert step_pairs(3, 1, 0, causal=True) == [(1, 1, DIAGONAL), (1, 4, SKIP), (4, 1, FULL), (4, 4, DIAGONAL)]


@pytest.mark.parametrize("cp", range(1, 9))
def test_every_chunk_pair_is_computed_once_and_every_rank_works_alike(cp):
    for causal in (True, False):
        seen = [(q, kv, kind) for r, step in itertools.product(range(cp), range(cp))
                for q, kv, kind in step_pairs(cp, r, step, causal)]
        assert sorted((q, kv) for q, kv, _ in seen) == list(itertools.product(range(2 * cp), repeat=2))
        assert all(kind == pair_kind(q, kv, causal) for q, kv, kind in seen)
        assert {rank_work(cp, r, causal) for r in range(cp)} == {2.0 * cp if causal else 4.0 * cp}


def test_step_pairs_refuses_a_step_out_of_the_ring():
    with pytest.raises(ValueError, match="step must"):
        step_pairs(2, 0, 2, causal=True)


# ---- attention ------------------------------------------------------------------------------------------------

def _full_qkv(seq: int, dtype=torch.float64) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output's gradient over the whole sequence, the same on every rank."""
    generator = torch.Generator().manual_seed(11)
    return tuple(torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator, dtype=torch.float64).to(dtype)
                 for _ in range(4))


def _reference(q, k, v, grad, causal: bool):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _local_run(attention, shares, grad, **kwargs):
    q, k, v = (t.clone().requires_grad_(True) for t in shares)
    out = attention(q, k, v, **kwargs)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("attention", [ring_attention, allgather_attention])
def test_without_a_group_it_is_plain_attention(attention, causal):
    q, k, v, grad = _full_qkv(7)
    for got, expected in zip(_local_run(attention, (q, k, v), grad, group=None, causal=causal),
                             _reference(q, k, v, grad, causal)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_float32_inputs_give_float32_outputs_and_gradients():
    q, k, v, grad = _full_qkv(6, torch.float32)
    results = _local_run(ring_attention, (q, k, v), grad, group=None, causal=True)
    assert {t.dtype for t in results} == {torch.float32}
    for got, expected in zip(results, _reference(q, k, v, grad, True)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_mismatched_shapes_are_refused():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="share one shape"):
        ring_attention(q, torch.zeros(1, 1, 4, 8), q, None, causal=True)


# ---- under mpirun ---------------------------------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
def test_ring_and_allgather_attention_match_the_whole_sequence():
    """The world is the cp group: every rank's output and gradients, both ways and with and without the causal
    mask, equal the whole sequence's attention at its positions; the hook sees each exchange by name."""
    import torch.distributed as dist
    from mpi4py import MPI

    from harness.distributed import destroy_process_group, init_process_group
    from launcher.topology import discover

    comm = MPI.COMM_WORLD
    cp, rank = comm.Get_size(), comm.Get_rank()
    init_process_group(comm, discover(comm), torch.device("cpu"), timeout_s=120)
    try:
        group = dist.new_group(list(range(cp)))
        full = _full_qkv(2 * cp * CHUNK)
        q, k, v, grad = (split_sequence(t, cp, rank, dim=2) for t in full)
        for causal in (True, False):
            expected = [split_sequence(t, cp, rank, dim=2) for t in _reference(*full, causal)]
            for attention, names in ((ring_attention, {KV: 2 * (cp - 1), KV_GRAD: cp}),
                                     (allgather_attention, {ALLGATHER: 1, REDUCE_SCATTER: 1})):
                seen: list[str] = []
                got = _local_run(attention, (q, k, v), grad, group=group, causal=causal,
                                 hook=lambda name, run: (seen.append(name), run()))
                for what, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11,
                                               msg=f"{attention.__name__} causal={causal} {what}")
                assert {name: seen.count(name) for name in set(seen)} == names

        # bfloat16 in, float32 statistics inside: the forward within bfloat16's rounding
        shares16 = [t.to(torch.bfloat16) for t in (q, k, v)]
        expected = split_sequence(F.scaled_dot_product_attention(*(t.to(torch.bfloat16).double() for t in full[:3]),
                                                                 is_causal=True), cp, rank, dim=2)
        for attention in (ring_attention, allgather_attention):
            out = attention(*shares16, group=group, causal=True)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2, msg=attention.__name__)
    finally:
        destroy_process_group()

"""Context parallelism (harness.models.context): the zigzag layout, the ring's schedule and its causal work, and
ring and all-gather attention against whole-sequence F.scaled_dot_product_attention.

Serially: the chunks and positions each rank holds, split/merge, the ring pinned for cp = 3, every causal
chunk pair computed exactly once and the same work on every rank, and cp = 1 (no group) equal to plain
attention with its gradients. Under mpirun (any world size of 2 or more, the world as the cp group): each
rank's output and q, k, v gradients equal the whole sequence's at its positions, causal and not, float64 and a
bfloat16 forward, and the hook sees every exchange. Then [strategy] cp and cp_comm: the plan's exchanges per block
(the ring's sends and gradient hops, or the all-gather and its reduce-scatter), the work, pipeline and gradient
groups split over cp, the rank order, the refusals (exit 2), and a profiled share's stand-in ring.
"""
from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from harness.models.context import (
    ALLGATHER,
    DIAGONAL,
    FULL,
    KV,
    KV_GRAD,
    REDUCE_SCATTER,
    SKIP,
    RingStep,
    allgather_attention,
    local_positions,
    merge_sequence,
    pair_kind,
    rank_work,
    ring_attention,
    ring_steps,
    split_sequence,
    step_pairs,
    zigzag_chunks,
)

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


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp", [2, 3])
def test_a_ring_computes_alike_fused_and_materialised(cp, causal):
    """One rank's ring alone (a LocalRing: each "received" block a copy of its own) gives the same output and
    gradients whether its blocks run the CPU's fused kernel or materialise their scores."""
    from harness.models.context import LocalRing, fused_blocks

    q, k, v, grad = _full_qkv(2 * cp * CHUNK)
    assert fused_blocks(q, materialized=False) and not fused_blocks(q, materialized=True)
    for rank in range(cp):
        fused = _local_run(ring_attention, (q, k, v), grad, group=LocalRing(cp, rank), causal=causal)
        materialised = _local_run(ring_attention, (q, k, v), grad, group=LocalRing(cp, rank), causal=causal,
                                  materialized=True)
        for what, a, b in zip(("out", "dq", "dk", "dv"), fused, materialised):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"rank {rank} {what}")


# what a ring dispatches that computes nothing: views and a dtype query
VIEWS = frozenset({"slice", "expand", "view", "unsqueeze", "_unsafe_view", "transpose", "unbind", "alias", "detach",
                   "promote_types"})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("materialized", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp", [2, 3])
def test_the_rings_kernel_listing_launches_what_the_ring_dispatches(cp, causal, materialized, dtype):
    """harness.plan.kernels.ring_attention_kernels, forward and backward, lists as many launches as the ring of
    the rank it picks dispatches, 16-bit casts included (a real group's exchange posts P2P where a LocalRing clones:
    its clones left out)."""
    from harness.models.context import LocalRing
    from harness.plan.kernels import MemoryBound, ring_attention_kernels
    from harness.plan.kernels import _gradients as gradients
    from harness.plan.ring import ring_blocks
    from harness.profile.device_curves import count_dispatched

    rank, _ = ring_blocks(cp, causal)
    q, k, v, grad = (t.to(getattr(torch, dtype)).requires_grad_(i < 3) for i, t in enumerate(_full_qkv(2 * CHUNK)))
    out = []
    forward, _ = count_dispatched(lambda: out.append(ring_attention(q, k, v, LocalRing(cp, rank), causal,
                                                                    materialized=materialized)), leave_out=VIEWS)
    backward, _ = count_dispatched(lambda: out[0].backward(grad), leave_out=VIEWS)
    clones = (cp - 1, 2 * cp - 1)  # the LocalRing's stand-in exchanges, forward and backward
    kernels = ring_attention_kernels(BATCH, HEADS, HEAD_DIM, 2 * CHUNK, cp, causal, dtype, materialized)
    assert sum(k.launches for k in kernels) == forward - clones[0]
    assert sum(g.launches for k in kernels for g in gradients(k)) == backward - clones[1]
    assert all(isinstance(k, MemoryBound) or k.name.startswith("ring.attention.") for k in kernels)


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

    from harness.runtime.distributed import destroy_process_group, init_process_group
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
            ring = {KV: 2 * (cp - 1), KV_GRAD: cp}
            for label, attention, names in (("fused ring", ring_attention, ring),
                                            ("materialised ring", partial(ring_attention, materialized=True), ring),
                                            ("all-gather", allgather_attention, {ALLGATHER: 1, REDUCE_SCATTER: 1})):
                seen: list[str] = []
                got = _local_run(attention, (q, k, v), grad, group=group, causal=causal,
                                 hook=lambda name, run, seen=seen: (seen.append(name), run()))
                for what, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"{label} causal={causal} {what}")
                assert {name: seen.count(name) for name in set(seen)} == names

        # bfloat16 in, float32 statistics inside: the forward within bfloat16's rounding
        shares16 = [t.to(torch.bfloat16) for t in (q, k, v)]
        expected = split_sequence(F.scaled_dot_product_attention(*(t.to(torch.bfloat16).double() for t in full[:3]),
                                                                 is_causal=True), cp, rank, dim=2)
        for label, attention in (("fused ring", ring_attention),
                                 ("materialised ring", partial(ring_attention, materialized=True)),
                                 ("all-gather", allgather_attention)):
            out = attention(*shares16, group=group, causal=True)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2, msg=label)
    finally:
        destroy_process_group()


# ---- the spec and the plan ([strategy] cp, cp_comm) ------------------------------------------------------------
MICRO, SEQ, HIDDEN = 2, 32, 32


def _plan_spec(cp: int = 2, tp: int = 1, dp: int = 1, pp: int = 1, cp_comm: str = "ring", seq: int = SEQ,
               name: str = "gpt2-small", extra: str = "", model_extra: str = "", schedule: str = "1f1b"):
    from harness.plan.spec import loads_spec
    from tests.helpers import tiny_spec_text

    text = tiny_spec_text(name=name, cp=cp, tp=tp, dp=dp, pp=pp, cp_comm=cp_comm, schedule=schedule, layers=4,
                          hidden=HIDDEN, heads=4,
                          ffn=64, seq=seq, vocab=256, micro=MICRO, global_batch=4 * MICRO * dp)
    return loads_spec(text.replace("[strategy]\n", f"[strategy]\n{extra}").replace("[model]\n",
                                                                                 f"[model]\n{model_extra}"))


def _block_items(plan, pass_: str) -> list[tuple[str, int, str]]:
    """The first block's forward or backward: (kind, bytes, dtype) of its compute and the exchanges after it."""
    program = plan.stages[0]
    items = list(zip(program.forward, program.forward_layers) if pass_ == "fwd"
                 else zip(program.backward, program.backward_layers))
    for i, (_, index) in enumerate(items):
        if index >= 0 and plan.layers[index].kind == "block":
            out = [("compute", 0, "")]
            for other, other_index in items[i + 1:]:
                if other_index >= 0:
                    break
                event = plan.events[other]
                out.append((event.kind, event.bytes, event.content["dtype"]))
            return out
    raise AssertionError("no block")


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_sends_keys_and_values_cp_minus_1_times_and_the_gradients_home(cp):
    from harness.plan.events import build_plan

    plan = build_plan(_plan_spec(cp=cp))
    local = MICRO * SEQ // cp
    kv = ("p2p", local * 2 * HIDDEN * 4, "float32")  # keys and values of the rank's tokens
    grads = ("p2p", local * 2 * HIDDEN * 4, "float32")  # their gradients, float32
    assert _block_items(plan, "fwd") == [("compute", 0, "")] + [kv] * (cp - 1)
    assert _block_items(plan, "bwd") == [("compute", 0, "")] + [kv] * (cp - 1) + [grads] * cp
    block = next(e for e in plan.events.values() if e.name == "gpt2.block.fwd")
    assert block.content["seq"] == SEQ // cp, "a rank computes its seq / cp tokens"
    # each of the cp ranks sends to the next: per micro-batch and block, cp - 1 forward and cp - 1 backward, and
    # the gradients cp times; in float32 a gradient's message is a key-and-value message: one event for both
    kv_id = plan.stages[0].tp_events["cp.kv"]
    assert plan.stages[0].tp_events["cp.kv_grad"] == kv_id
    assert plan.multiplicity[kv_id] == cp * plan.spec.micro_batches * 4 * (2 * (cp - 1) + cp)


def test_the_all_gather_variant_gathers_the_whole_sequence_once_each_way():
    from harness.plan.events import build_plan

    plan = build_plan(_plan_spec(cp=2, cp_comm="allgather"))
    whole = MICRO * SEQ * 2 * HIDDEN * 4
    assert _block_items(plan, "fwd") == [("compute", 0, ""), ("allgather", whole, "float32")]
    assert _block_items(plan, "bwd") == [("compute", 0, ""), ("reducescatter", whole, "float32")]
    assert all(plan.events[e].group_size == 2 for n, e in plan.stages[0].tp_events.items() if n.startswith("cp."))


def test_the_work_the_pipeline_and_the_gradients_split_over_cp():
    from harness.plan.events import build_plan

    plain, plan = build_plan(_plan_spec(cp=1, dp=2, pp=2)), build_plan(_plan_spec(cp=2, dp=2, pp=2))
    block, whole = plan.layers[1], plain.layers[1]
    assert block.fwd_flops(MICRO, SEQ // 2) * 2 == whole.fwd_flops(MICRO, SEQ), "the same work, split evenly"
    send, plain_send = plan.events[plan.stages[0].send_forward], plain.events[plain.stages[0].send_forward]
    assert send.bytes * 2 == plain_send.bytes
    # the gradients are averaged over dp x cp = 4 ranks, the buckets as large as without cp
    assert {plan.events[b.event].group_size for b in plan.stages[0].buckets} == {4}
    assert [b.nbytes for b in plan.stages[0].buckets] == [b.nbytes for b in plain.stages[0].buckets]
    # ranks: tp fastest, then cp, then dp, then pp (Megatron-Core)
    ordered = build_plan(_plan_spec(cp=2, tp=2, dp=2, pp=2))
    assert [ordered.rank_of(0, t, 0, c) for c in range(2) for t in range(2)] == [0, 1, 2, 3]
    assert ordered.rank_of(1, 0, 0, 0) == 4 and ordered.rank_of(0, 0, 1, 0) == 8
    assert [(ordered.coords(r), ordered.cp_index(r)) for r in (3, 6, 13)] == [
        ((0, 1, 0), 1), ((1, 0, 0), 1), ((1, 1, 1), 0)]


@pytest.mark.parametrize("kwargs, field, words", [
    (dict(cp=3, seq=SEQ), "strategy.cp", "must divide seq_len / 2"),
    (dict(cp=2, extra="zero = 1\n", dp=2), "strategy.zero", "not built"),
    (dict(cp=2, pp=2, schedule="zb-h1"), "strategy.schedule", "not built"),
    (dict(cp=2, pp=2, model_extra="tie_embeddings = true\n"), "model.tie_embeddings", "not built"),
    (dict(cp=2, tp=4, seq=36, extra="sp = true\n"), "model.seq_len", "seq_len / cp (18) must be divisible by tp"),
    (dict(cp=2, extra='cp_comm = "all"\n'), "strategy.cp_comm", "ring"),
])
def test_context_parallelism_that_cannot_run_is_refused(kwargs, field, words):
    from harness.common.errors import SpecError

    if "cp_comm = " in kwargs.get("extra", ""):  # the test's own cp_comm line is the one in question
        kwargs = {**kwargs, "cp_comm": "all"}
        kwargs.pop("extra")
    with pytest.raises(SpecError) as info:
        _plan_spec(**kwargs)
    assert f"[{field}]" in str(info.value) and words in str(info.value)


def test_a_factory_models_attention_cannot_be_split(tmp_path, project_env):
    import subprocess
    import sys

    from tests.helpers import tiny_spec_text

    path = tmp_path / "job.toml"
    text = tiny_spec_text(cp=2, seq=32).replace('name = "gpt2-small"', 'factory = "tests.user_model:build"')
    path.write_text(text)
    result = subprocess.run([sys.executable, "-m", "harness", "events", str(path)], capture_output=True, text=True,
                            env=project_env, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "[strategy.cp]" in result.stderr and "factory model's attention" in result.stderr
    wrong = tmp_path / "world.toml"
    wrong.write_text(tiny_spec_text(cp=2, seq=32).replace("gpus_per_node = 2", "gpus_per_node = 1"))
    result = subprocess.run([sys.executable, "-m", "harness", "events", str(wrong)], capture_output=True, text=True,
                            env=project_env, timeout=60)
    assert result.returncode == 2 and "dp x tp x cp x pp = 1 x 1 x 2 x 1 = 2 must equal" in result.stderr


def test_a_profiled_share_runs_rank_0s_ring_steps_alone(monkeypatch):
    """Profiled alone (no group), a context-parallel block runs rank 0's ring steps on copies of its own keys and
    values: every step's blocks of rank 0 (as the real ring computes them), no communication, a backward."""
    from harness.models import build_layer, context

    spec = _plan_spec(cp=2)
    block = build_layer(spec.model, "block", cp=2)
    x = torch.randn(MICRO, SEQ // 2, HIDDEN, requires_grad=True)
    computed = []
    real_blocks = context._blocks

    def counted(cp, rank, step, causal, s_local, device):
        computed.append((rank, step))
        return real_blocks(cp, rank, step, causal, s_local, device)

    monkeypatch.setattr(context, "_blocks", counted)
    out = block(x)
    assert computed == [(0, 0), (0, 1)]  # the forward's two steps, as rank 0 of a ring of 2
    out.sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape


def test_context_parallel_blocks_are_profiled_as_composites_on_cp_ranks():
    """tp = 1: each block's forward and backward also run with their ring on cp real ranks; not the embedding,
    whose cp is its positions'; with tp > 1 too the embedding and the head keep their tp composites and a block
    both tensor- and context-parallel has none."""
    from harness.plan.events import build_plan
    from launcher.placement import place
    from launcher.topology import Topology

    one_node = Topology(0, 4, (0,) * 4, ("a",) * 4)
    composites = place(build_plan(_plan_spec(cp=2)).unique(), one_node).composites
    assert sorted((t.content["layer"], t.content["phase"], t.ranks) for t in composites) == [
        ("block", "bwd", (0, 1)), ("block", "fwd", (0, 1))]
    both = place(build_plan(_plan_spec(cp=2, tp=2)).unique(), one_node).composites
    assert sorted((t.content["layer"], t.content["phase"], len(t.ranks)) for t in both) == [
        ("embedding", "bwd", 2), ("embedding", "fwd", 2), ("head", "bwd", 2), ("head", "fwd", 2)]


def test_in_16_bits_keys_and_values_travel_in_the_models_dtype_and_their_gradients_in_float32():
    from harness.plan.events import build_plan
    from harness.plan.spec import loads_spec
    from tests.helpers import tiny_spec_text

    spec = loads_spec(tiny_spec_text(cp=2, layers=4, hidden=HIDDEN, heads=4, ffn=64, seq=SEQ, vocab=256, micro=MICRO,
                                     global_batch=4 * MICRO).replace('dtype = "float32"', 'dtype = "bfloat16"'))
    plan = build_plan(spec)
    local = MICRO * SEQ // 2
    assert _block_items(plan, "bwd") == [("compute", 0, ""), ("p2p", local * 2 * HIDDEN * 2, "bfloat16"),
                                         ("p2p", local * 2 * HIDDEN * 4, "float32"),
                                         ("p2p", local * 2 * HIDDEN * 4, "float32")]
    events = plan.stages[0].tp_events
    assert events["cp.kv"] != events["cp.kv_grad"]


def test_with_dp_1_the_cp_ranks_average_their_gradients_in_buckets_the_memory_model_holds():
    """cp = 2 with dp = 1: the two ranks hold the same parameters, so the plan has gradient buckets over them, and
    the memory model holds every gradient from the start (DDP's buckets), as harness train allocates them."""
    from analysis.memory import estimate_memory
    from harness.plan.events import build_plan

    plan = build_plan(_plan_spec(cp=2))
    assert plan.stages[0].buckets and {plan.events[b.event].group_size for b in plan.stages[0].buckets} == {2}
    stage = estimate_memory(plan, {}).stages[0]
    assert stage.gradients == sum(layer.params for layer in plan.layers) * 4

"""The pieces `harness train`'s engine is composed of, on one process: which gradients each after-backward sum
takes (grad_sync.stage_grad_sums), which parameters each data-parallel bucket holds, what the memory meter
holds across an iteration, and the point-to-point tags and shapes."""
from __future__ import annotations

import pytest
import torch

from harness.plan.events import build_plan
from harness.plan.spec import loads_spec
from harness.train.grad_sync import StageGradSum, bucket_parameters, stage_grad_sums, sum_in_place
from harness.train.memory_meter import MemoryMeter
from harness.train.model import build_layers, replicated
from harness.train.recorder import DeviceClock, Recorder
from tests.test_train import spec_text

MOE = "experts = 4\ntop_k = 2\nexpert_ffn = 32\n"
TP_GROUP, TIE_GROUP, EXPERT_GROUP = "tp-group", "tie-group", "expert-group"  # handed through, never used here


def _stages(text: str, pp_index: int = 0, tp_index: int = 0):
    """spec, plan and the stage modules of pipeline rank `pp_index`, every parameter with a gradient of its own."""
    spec = loads_spec(text)
    plan = build_plan(spec)
    s = spec.strategy
    local = [vs for vs in range(s.virtual_stages) if vs % s.pp == pp_index]
    positions = [p for vs in local for p in plan.stages[vs].layers]
    modules = build_layers(spec, plan.layers, positions, seed=0, tp_index=tp_index)
    for index, param in enumerate(p for m in modules.values() for p in m.parameters()):
        param.grad = torch.full_like(param, float(index + 1))
    return spec, plan, modules, {vs: [modules[p] for p in plan.stages[vs].layers] for vs in local}


def _sums(spec, plan, stage_modules):
    return stage_grad_sums(spec, plan, stage_modules, tp_group=TP_GROUP, tie_group=TIE_GROUP,
                           expert_dp_group=EXPERT_GROUP)


@pytest.mark.parametrize("pp_index", [0, 1])
def test_tied_embeddings_over_stages_sum_the_token_table_and_the_heads_copy(pp_index):
    spec, plan, modules, stage_modules = _stages(spec_text(pp=2, layers=2, micro=1, global_batch=4, tie=True),
                                                 pp_index)
    (grad_sum,) = _sums(spec, plan, stage_modules)
    (vs,) = stage_modules
    ends = stage_modules[vs]
    weight = ends[0].tokens.weight if vs == 0 else ends[-1].out.weight
    assert (grad_sum.name, grad_sum.phase, grad_sum.group, grad_sum.divide) == ("tie.allreduce", "tie", TIE_GROUP, 1)
    assert grad_sum.event == plan.stages[vs].tie != ""
    assert len(grad_sum.grads) == 1 and grad_sum.grads[0] is weight.grad


def test_sequence_parallel_sums_only_the_replicated_parameters_that_have_gradients():
    spec, plan, modules, stage_modules = _stages(spec_text(tp=2, layers=2, micro=2, global_batch=4, sp=True))
    without = next(p for m in stage_modules[0] for n, p in m.named_parameters() if replicated(n, spec.model))
    without.grad = None
    (grad_sum,) = _sums(spec, plan, stage_modules)
    expected = [p.grad for m in stage_modules[0] for n, p in m.named_parameters()
                if replicated(n, spec.model) and p.grad is not None]
    sharded = [n for m in stage_modules[0] for n, _ in m.named_parameters() if not replicated(n, spec.model)]
    assert sharded and expected
    assert (grad_sum.name, grad_sum.phase, grad_sum.group) == ("tp.sequence_grads", "tp", TP_GROUP)
    assert grad_sum.event == plan.stages[0].sequence_grads != ""
    assert [id(g) for g in grad_sum.grads] == [id(g) for g in expected]
    # without sp, nothing is summed after the buckets
    spec, plan, _, stage_modules = _stages(spec_text(tp=2, layers=2, micro=2, global_batch=4))
    assert _sums(spec, plan, stage_modules) == []


@pytest.mark.parametrize("dp,ep,summed_over", [(2, 2, None), (2, 1, EXPERT_GROUP), (4, 2, EXPERT_GROUP)])
def test_experts_are_summed_over_their_holders_and_divided_by_the_replicas(dp, ep, summed_over):
    """dp = ep: every rank holds its own experts, which it only divides; dp > ep: the dp / ep ranks holding the same
    experts sum theirs (the plan's expert_grads)."""
    text = spec_text(dp=dp, layers=2, micro=1, global_batch=2 * dp, moe=MOE, ep=ep)
    spec, plan, modules, stage_modules = _stages(text)
    (grad_sum,) = _sums(spec, plan, stage_modules)
    experts = [p.grad for m in stage_modules[0] if getattr(m, "moe", None) is not None
               for p in m.moe.expert_parameters()]
    assert experts and [id(g) for g in grad_sum.grads] == [id(g) for g in experts]
    assert (grad_sum.name, grad_sum.phase, grad_sum.divide, grad_sum.group) == ("ep.expert_grads", "ep", dp,
                                                                                 summed_over)
    assert bool(grad_sum.event) == (summed_over is not None)


def test_one_replica_sums_nothing():
    spec, plan, _, stage_modules = _stages(spec_text(dp=1, layers=2, micro=1, global_batch=2, moe=MOE))
    assert _sums(spec, plan, stage_modules) == []


def test_a_local_sum_divides_in_place_and_records_a_row_only_for_a_plan_event():
    grads = (torch.full((2, 3), 4.0), torch.full((5,), 8.0))
    recorder = Recorder()
    clock = DeviceClock(torch.device("cpu"))
    StageGradSum("ep.expert_grads", "ep", "ep_grads", 0, "", None, 4, grads).run(clock, recorder)
    assert torch.equal(grads[0], torch.ones(2, 3)) and torch.equal(grads[1], torch.full((5,), 2.0))
    assert recorder.rows == []
    StageGradSum("ep.expert_grads", "ep", "ep_grads", 1, "e7", None, 2, grads).run(clock, recorder)
    (row,) = recorder.rows
    assert row[3:9] == ("allreduce", "ep.expert_grads", "ep", "e7", 1, -1)
    StageGradSum("tie.allreduce", "tie", "tie", 0, "e8", None, 1, ()).run(clock, recorder)  # nothing to sum
    assert len(recorder.rows) == 1


def test_sum_in_place_keeps_shapes():
    tensors = [torch.arange(6.0).view(2, 3), torch.arange(3.0)]
    sum_in_place(tensors, None, 3)
    assert tensors[0].shape == (2, 3) and torch.allclose(tensors[0], torch.arange(6.0).view(2, 3) / 3)


@pytest.mark.parametrize("extra", [{}, {"tie": True}, {"moe": MOE}])
def test_every_trainable_parameter_is_in_exactly_one_bucket_but_the_experts(extra):
    text = spec_text(dp=2, layers=2, micro=1, global_batch=4, **extra).replace(
        "[strategy]\n", "[strategy]\nbucket_mb = 0.005\n")
    spec, plan, modules, stage_modules = _stages(text)
    experts = {id(p) for m in modules.values() if getattr(m, "moe", None) is not None
               for p in m.moe.expert_parameters()}
    buckets = bucket_parameters(plan, 0, modules, False, experts, set())
    assert len(buckets) == len(plan.stages[0].buckets) > 1
    held = [id(p) for bucket in buckets for p in bucket]
    trainable = {id(p) for m in modules.values() for p in m.parameters() if p.requires_grad}
    assert len(held) == len(set(held)) and set(held) == trainable - experts
    # the backward makes the head's gradients first: the first bucket holds them
    head = modules[max(modules)]
    assert {id(p) for p in head.parameters() if p.requires_grad} <= {id(p) for p in buckets[0]}


def test_the_meter_holds_a_made_gradient_until_the_next_iteration_and_optimizer_states_for_good():
    layer = torch.nn.Linear(16, 16)
    meter = MemoryMeter()
    meter.hold_weights(layer.parameters())
    meter.watch_gradients(layer.parameters())
    weights = meter.total
    layer(torch.ones(2, 16)).sum().backward()
    assert meter.live["gradients"] == weights
    layer(torch.ones(2, 16)).sum().backward()  # accumulated into the same storages: counted once
    assert meter.live["gradients"] == weights
    optimizer = torch.optim.Adam(layer.parameters())
    optimizer.step()
    meter.hold_optimizer_states(optimizer)
    meter.hold_optimizer_states(optimizer)
    states = meter.live["optimizer"]
    assert states >= 2 * weights
    for param in layer.parameters():
        param.grad = None
    meter.release_gradients()
    assert meter.live["gradients"] == 0 and meter.live["optimizer"] == states


def test_p2p_tags_are_distinct_and_every_received_tensor_has_a_shape():
    from harness.plan.schedules import virtual_stage
    from harness.runtime.inflight import Completer
    from harness.train.p2p import StageLinks

    spec = loads_spec(spec_text(pp=2, layers=4, chunks=2, schedule="interleaved-1f1b", micro=1, global_batch=4))
    plan = build_plan(spec)
    s = spec.strategy
    for pp_index in range(s.pp):
        local = [virtual_stage(c, pp_index, s.pp) for c in range(s.chunks)]
        links = StageLinks(spec=spec, plan=plan, rank=plan.rank_of(0, 0, pp_index, 0), local_vs=local,
                           clock=DeviceClock(torch.device("cpu")), recorder=Recorder(), memory=MemoryMeter(),
                           completer=Completer(poll=False, timeout_s=1))
        tags = [links._tag(vs, micro, backward) for vs in range(s.virtual_stages)
                for micro in range(spec.micro_batches) for backward in (False, True)]
        assert len(tags) == len(set(tags))
        wanted = {vs for vs in local if vs > 0} | {vs + 1 for vs in local if vs < s.virtual_stages - 1}
        assert set(links.act_spec) == wanted


def test_any_run_seed_draws_tokens_and_small_ones_draw_as_before():
    """make_tokens reduces its generator's seed as layer_seed does: a seed of 10^13 or -1 runs, and a small seed
    draws what it drew before the reduction."""
    from harness.train.model import make_tokens
    from tests.helpers import tiny_spec_text

    spec = loads_spec(tiny_spec_text())
    for seed in (10 ** 13, -1, 2 ** 70):
        assert make_tokens(spec, seed).shape == (spec.batch.global_size, spec.model.seq_len + 1)
    before = torch.randint(0, spec.model.vocab, (spec.batch.global_size, spec.model.seq_len + 1),
                           generator=torch.Generator().manual_seed(5 * 7_777_777 + 1_234_567 + 2), dtype=torch.long)
    assert torch.equal(make_tokens(spec, 5, iteration=2), before)

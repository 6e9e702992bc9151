"""The strategies that trade memory against time, activation recompute (recompute = "full") and ZeRO (zero = 1 to 3,
through FSDP2), through the spec, the event flows, the timeline, the memory model, the replay and the search."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from analysis.costs import Costs
from analysis.memory import estimate_memory
from analysis.profile_reader import load_profile
from analysis.search import search
from analysis.simulate import BACKWARD, RECOMPUTE, simulate
from harness.common.errors import SpecError, UserError
from harness.plan.events import build_plan
from harness.plan.layers import input_bytes
from harness.plan.spec import loads_spec, parse_spec
from tests.helpers import tiny_spec_text
from tests.test_analysis_helpers import make_spec
from tests.test_search import _profile as grid_profile


def plan_of(**kwargs):
    return build_plan(loads_spec(tiny_spec_text(**kwargs)))


# ---- spec ------------------------------------------------------------------------------------------------------
def test_recompute_is_none_unless_asked():
    assert loads_spec(tiny_spec_text()).strategy.recompute == "none"
    spec = loads_spec(tiny_spec_text(recompute="full"))
    assert spec.strategy.recompute == "full"
    assert loads_spec(spec.to_toml()) == spec  # round-trips


def test_unknown_recompute_is_refused():
    with pytest.raises(SpecError, match=r"\[strategy.recompute\] unknown value 'some'; expected one of none, "
                                        "selective, full"):
        loads_spec(tiny_spec_text(recompute="some"))


def test_recompute_is_a_search_dimension():
    from harness.plan.candidates import candidate_label, expand

    data = json.loads(make_spec(dp=2, micro_batches=4, layers=4).to_json())
    data["search"] = {"pp": [1, 2], "recompute": ["none", "full"]}
    grid = expand(parse_spec(data, source="t"))
    assert sorted(candidate_label(c) for c in grid.candidates) == [
        "dp=1 tp=1 pp=2 1f1b micro=1 m=8", "dp=1 tp=1 pp=2 1f1b micro=1 m=8 recompute=full",
        "dp=2 tp=1 pp=1 1f1b micro=1 m=4", "dp=2 tp=1 pp=1 1f1b micro=1 m=4 recompute=full"]
    data["search"] = {"recompute": ["none", "partial"]}
    with pytest.raises(SpecError, match=r"\[search.recompute\] unknown value 'partial'"):
        parse_spec(data, source="t")


# ---- events ----------------------------------------------------------------------------------------------------
def test_a_recomputing_backward_runs_each_blocks_forward_before_its_backward():
    """pp = 2, tp = 2, 4 blocks: a backward step runs, per block in reverse, its forward again (with its two
    tensor-parallel all-reduces) and then its backward; the embedding and the head (with the loss) are not
    recomputed."""
    none, full = plan_of(layers=4, pp=2, tp=2, global_batch=4, micro=1), \
        plan_of(layers=4, pp=2, tp=2, global_batch=4, micro=1, recompute="full")
    names = [(full.events[e].name, again) for e, again in zip(full.stages[1].backward, full.stages[1].backward_again)]
    tp = ("allreduce 2KiB x2 intra", False)
    assert names == [("gpt2.head.bwd", False), tp,  # the vocabulary-parallel head's input gradient, all-reduced
                     ("gpt2.block.fwd", True), ("allreduce 2KiB x2 intra", True), ("allreduce 2KiB x2 intra", True),
                     ("gpt2.block.bwd", False), tp, tp,
                     ("gpt2.block.fwd", True), ("allreduce 2KiB x2 intra", True), ("allreduce 2KiB x2 intra", True),
                     ("gpt2.block.bwd", False), tp, tp]
    def names(plan, ids):
        return [plan.events[e].name for e in ids]

    for plain, again in zip(none.stages, full.stages):
        assert names(full, [e for e, redo in zip(again.backward, again.backward_again) if not redo]) == \
            names(none, plain.backward)
        assert names(full, again.forward) == names(none, plain.forward)
    # each block's forward runs twice per micro-batch, its all-reduces three times (forward, recompute, backward);
    # a recomputed block's events are their own (it runs under torch.utils.checkpoint), the others' the same
    m, devices = full.spec.micro_batches, 2
    block_fwd, plain_fwd = (next(e for e in plan.events.values() if e.name == "gpt2.block.fwd")
                            for plan in (full, none))
    embedding_fwd = next(e for e in full.events.values() if e.name == "gpt2.embedding.fwd")
    assert block_fwd.content == {**plain_fwd.content, "checkpointed": True}
    assert full.multiplicity[block_fwd.id] == 2 * none.multiplicity[plain_fwd.id] == 2 * 4 * m * devices
    assert full.multiplicity[embedding_fwd.id] == none.multiplicity[embedding_fwd.id]
    tp_id = next(e.id for e in full.events.values() if e.kind == "allreduce" and e.name == tp[0])
    # 4 blocks x 2 all-reduces per pass, one tensor-parallel group per stage; the embedding's forward and the
    # head's backward one each, not recomputed
    assert (none.multiplicity[tp_id], full.multiplicity[tp_id]) == (2 * 4 * 2 * m + 2 * m, 3 * 4 * 2 * m + 2 * m)
    checkpointed = {e.id for e in full.events.values() if e.content.get("checkpointed")}
    assert {full.events[e].name for e in checkpointed} == {"gpt2.block.fwd", "gpt2.block.bwd"}
    assert set(full.events) - checkpointed == set(none.events) - {plain_fwd.id, next(
        e.id for e in none.events.values() if e.name == "gpt2.block.bwd")}  # nothing else new to profile


def test_the_device_flow_marks_the_recomputed_forward():
    """Stage 0's first backward step: the gradient received, then per block in reverse its forward again (R) and
    its backward (B), then the embedding's backward (not recomputed)."""
    plan = plan_of(layers=4, pp=2, global_batch=2, micro=1, recompute="full")
    flow = list(plan.device_flow(0))
    first_backward = next(i for i, (_, phase, _, _) in enumerate(flow) if phase in ("R", "B"))
    step = flow[first_backward - 1:first_backward + 5]
    assert [(phase, plan.events[e].name) for e, phase, _, _ in step] == [
        ("recv", "p2p 2KiB intra"), ("R", "gpt2.block.fwd"), ("B", "gpt2.block.bwd"), ("R", "gpt2.block.fwd"),
        ("B", "gpt2.block.bwd"), ("B", "gpt2.embedding.bwd")]
    # every device's flows add up to the plan's multiplicities
    counts = Counter(e for rank in range(plan.spec.strategy.world) for e, phase, _, _ in plan.device_flow(rank)
                     if phase != "recv")
    assert counts == +plan.multiplicity


def test_buckets_stay_ready_after_their_own_gradients():
    """A data-parallel bucket is ready after the backward items that make its gradients, past the recompute."""
    none, full = plan_of(layers=2, dp=2, global_batch=4, micro=1), \
        plan_of(layers=2, dp=2, global_batch=4, micro=1, recompute="full")
    # one bucket (tiny model), ready after the last backward item, the embedding's, past two recomputed blocks
    assert [b.ready_after for b in full.stages[0].buckets] == [b.ready_after + 2 for b in none.stages[0].buckets] \
        == [len(full.stages[0].backward) - 1]


# ---- timeline --------------------------------------------------------------------------------------------------
def _costs(plan, seconds):
    return Costs.from_seconds(plan, {eid: seconds.get(event.name, 0.0) for eid, event in plan.events.items()})


def test_the_backward_step_pays_the_forward_again():
    """One device, 2 blocks: forward 1 ms per block, backward 2 ms; with recompute each backward step takes the
    blocks' forward again (2 ms) and the timeline shows it as recompute before the backward."""
    seconds = {"gpt2.block.fwd": 1e-3, "gpt2.block.bwd": 2e-3}
    none, full = plan_of(layers=2, global_batch=2, micro=1), plan_of(layers=2, global_batch=2, micro=1,
                                                                   recompute="full")
    plain, again = simulate(none, _costs(none, seconds)), simulate(full, _costs(full, seconds))
    assert plain.batch_time_s == pytest.approx(2 * (2e-3 + 4e-3))
    assert again.batch_time_s == pytest.approx(2 * (2e-3 + 2e-3 + 4e-3))
    first_backward = [i for i in again.intervals(0) if i.micro == 0 and i.category in (RECOMPUTE, BACKWARD)
                      and i.end_s > i.start_s]
    assert [(i.category, i.name.split()[0], i.layer) for i in first_backward] == [
        (RECOMPUTE, "R", 2), (BACKWARD, "B", 2), (RECOMPUTE, "R", 1), (BACKWARD, "B", 1)]


# ---- memory ----------------------------------------------------------------------------------------------------
def _saved(plan, block_bytes=10**6, other=1000):
    return {eid: block_bytes if e.content["layer"] == "block" else other for eid, e in plan.events.items()
            if e.kind == "compute" and e.content.get("phase") == "fwd"}


def test_recompute_keeps_the_block_inputs_and_remakes_one_block():
    """GPipe over pp = 2 with 4 micro-batches in flight: each holds, per block, its input (2 kB) instead of its
    saved activations (1 MB); in a backward, one block's are re-made. Both stages peak in their second backward, as
    a block is re-made: 3 micro-batches in flight, the gradients made (more than one micro-batch holds)."""
    kwargs = dict(layers=4, pp=2, global_batch=4, micro=1, schedule="gpipe")
    none, full = plan_of(**kwargs), plan_of(**kwargs, recompute="full")
    other = 10_000  # the embedding's and the head's: the head's more than the log-probabilities it lets go of
    plain, again = estimate_memory(none, _saved(none, other=other)), estimate_memory(full, _saved(full, other=other))
    spec = full.spec
    block_input = spec.batch.micro * spec.model.seq_len * spec.model.hidden * 4
    assert input_bytes(spec, full.layers, 1) == block_input == 2048
    output = block_input  # stage 0 holds its output until its gradient returns
    first, last = again.stages
    # stage 0: the embedding, two blocks' inputs, the output; stage 1: two inputs, the head
    assert (first.activations, first.in_flight, first.gradients) == (3 * (other + 2 * block_input + output) + 10**6,
                                                                     3, first.weights)
    # stage 1 runs its head's backward first: by the time a block is re-made, the head's are gone
    assert (last.activations, last.in_flight, last.gradients) == (3 * (2 * block_input + other) + 10**6 - other, 3,
                                                                  last.weights)
    tokens = spec.batch.micro * spec.model.seq_len
    block_temporaries = (tokens + spec.model.hidden) * spec.model.ffn * 4  # its MLP's last projection's gradients
    assert first.temporaries == last.temporaries == block_temporaries
    # without recompute, stage 1 peaks in its first backward, the head's projection making its gradients with its
    # float32 log-probabilities let go
    log_probabilities = tokens * spec.model.vocab * 4
    assert [s.activations for s in plain.stages] == [4 * (other + 2 * 10**6 + output),
                                                     4 * (2 * 10**6 + other) - log_probabilities]
    for a, b in zip(plain.stages, again.stages):
        assert (a.weights, a.optimizer) == (b.weights, b.optimizer)
    assert again.peak_bytes < plain.peak_bytes


def test_recompute_where_nothing_is_saved_is_refused():
    plan = plan_of(layers=2, global_batch=2, micro=1, recompute="full")
    with pytest.raises(UserError, match=r"recompute = 'full': the layers of stage 0 save no activations for their "
                                        r"backward \(as profiled\)"):
        estimate_memory(plan, _saved(plan, block_bytes=0))


# ---- search ----------------------------------------------------------------------------------------------------
def test_the_search_finds_the_strategy_that_only_fits_with_recompute(tmp_path):
    """Blocks that save 1 MB each fit nowhere in the memory given, unless recomputed; the search ranks the
    recomputing candidates, slower, as the only feasible ones."""
    data = json.loads(make_spec(dp=2, micro_batches=4, layers=4).to_json())
    data["search"] = {"pp": [1, 2], "recompute": ["none", "full"]}
    spec = parse_spec(data, source="search-test")
    profile = load_profile(grid_profile(tmp_path, spec, block_saves=10**6))
    everything = search(profile, jobs=1)
    peaks = {c.label: c.peak_memory_bytes for c in everything.candidates}
    recomputing = [label for label in peaks if "recompute=full" in label]
    limit = (max(peaks[label] for label in recomputing) + min(v for k, v in peaks.items() if k not in recomputing)) / 2
    result = search(profile, capacity_bytes=limit, jobs=1)
    fits = {c.label for c in result.candidates if c.feasible}
    assert fits == set(recomputing) and len(fits) == 2
    assert result.best.label in recomputing
    plain = {c.label: c.batch_time_s for c in everything.candidates}
    for label in recomputing:  # recompute costs the forward again
        assert plain[label] > plain[label.replace(" recompute=full", "")]


# ---- ZeRO (FSDP2) ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    (dict(zero=3), r"\[strategy.zero\] zero = 3 shards over the data-parallel replicas, and dp = 1 has one"),
    (dict(zero=1, dp=2, tp=2, global_batch=8), r"\[strategy.zero\] zero = 1 with tensor parallelism \(tp > 1\) is "
                                                r"not built"),
    (dict(zero=4, dp=2), r"\[strategy.zero\] must be a ZeRO stage, one of 0, 1, 2, 3")])
def test_zero_that_makes_no_sense_is_refused(kwargs, message):
    with pytest.raises(SpecError, match=message):
        loads_spec(tiny_spec_text(**kwargs))


def _zero_plan(zero, **kwargs):
    return plan_of(layers=2, dp=2, global_batch=8, micro=1, zero=zero, **kwargs)  # m = 4


@pytest.mark.parametrize("zero,gathers,scatters", [(1, 1, 1), (2, 1, 4), (3, 8, 4)])
def test_zero_collectives_per_layer_and_iteration(zero, gathers, scatters):
    """Per layer and iteration: zero 1 and 2 gather the weights in the first forward, zero 3 in every forward and
    backward (m = 4); zero 1 reduce-scatters in the last backward, zero 2 and 3 in every one. No buckets."""
    plan = _zero_plan(zero)
    program = plan.stages[0]
    assert program.buckets == []
    per_micro = [Counter(plan.events[e].kind for e in program.forward_of(mb)[0] + program.backward_of(mb, 4)[0])
                 for mb in range(4)]
    layers = len(program.layers)  # embedding, 2 blocks, head: every one has weights
    assert sum(c["allgather"] for c in per_micro) == gathers * layers
    assert sum(c["reducescatter"] for c in per_micro) == scatters * layers
    flow = Counter(plan.events[e].kind for e, _, _, _ in plan.device_flow(0))
    assert (flow["allgather"], flow["reducescatter"], flow["allreduce"]) == (gathers * layers, scatters * layers, 0)
    counts = Counter(e for rank in range(2) for e, _, _, _ in plan.device_flow(rank))
    for eid, event in plan.events.items():  # a collective is one call per group, listed by both members
        assert counts[eid] == plan.multiplicity[eid] * (2 if event.kind in ("allgather", "reducescatter") else 1)


def test_zero3_gathers_before_and_scatters_after_each_layer():
    program = _zero_plan(3).stages[0]
    plan = _zero_plan(3)
    forward = [plan.events[e].kind[:6] if plan.events[e].kind != "compute" else plan.events[e].name
               for e in program.forward]
    assert forward == ["allgat", "gpt2.embedding.fwd", "allgat", "gpt2.block.fwd", "allgat", "gpt2.block.fwd",
                       "allgat", "gpt2.head.fwd"]
    backward = [plan.events[e].kind[:6] if plan.events[e].kind != "compute" else plan.events[e].name
                for e in program.backward]
    assert backward[:6] == ["allgat", "gpt2.head.bwd", "reduce", "allgat", "gpt2.block.bwd", "reduce"]
    (optimizer,) = program.optimizer
    assert plan.events[optimizer].content["shard"] == 2 and plan.events[optimizer].name.endswith("shard 1/2")


def test_zero_memory_follows_zero_s_accounting():
    """Model states per device against ZeRO's (Rajbhandari et al.; K = 12, bf16 with fp32 master weights) with
    Megatron-LM's fp32 main gradients, at the peak without the backward's temporaries (nothing saved: the model
    states alone): stage 1 `6P + 12P/N` (Megatron-LM's distributed optimizer), stage 2 `2P + 16P/N`, stage 3 the
    12P/N optimizer part plus a gradient shard 4P/N (its weight shard is the fp32 master): their worst moment, a
    layer's reduce-scatter, holds its whole gradients only as the reduce-scatter's input (a temporary), and under
    zero 3 not its whole weights (let go). Zero 2 and 3 also hold, as temporaries, the reduce-scatter input of
    every layer whose backward has run, until the backward ends (FSDP2, every layer its own root)."""
    def states(zero):
        data = json.loads(make_spec(dp=4, micro_batches=4, layers=4, recompute="none").to_json())
        data["model"]["dtype"] = "bfloat16"
        data["optimizer"] = {**data["optimizer"], "master_weights": True}
        data["strategy"]["zero"] = zero
        plan = build_plan(parse_spec(data, source="t"))
        (stage,) = estimate_memory(plan, _saved(plan, block_bytes=0, other=0)).stages
        P = sum(layer.params for layer in plan.layers)
        return stage, P, plan.layers[0].params
    N = 4
    (s0, P, first), (s1, *_), (s2, *_), (s3, *_) = (states(z) for z in range(4))
    assert s0.metered == 18 * P
    assert s1.metered == 6 * P + 12 * -(-P // N)
    assert s2.metered == 2 * P + 16 * -(-P // N)
    assert s3.metered == 16 * -(-P // N)
    for stage in (s2, s3):  # as the first layer's backward runs, every later layer's gradients wait whole
        assert stage.temporaries >= 2 * (P - first)


def test_the_search_finds_the_strategy_that_only_fits_with_zero(tmp_path):
    """Weights and Adam states too large for the memory given fit only with ZeRO 3, whose collectives cost
    time: the search ranks the zero = 3 candidate, slower, as the only feasible one."""
    data = json.loads(make_spec(dp=4, micro_batches=2, layers=4).to_json())
    data["search"] = {"zero": [0, 1, 2, 3]}
    spec = parse_spec(data, source="search-test")
    profile = load_profile(grid_profile(tmp_path, spec, block_saves=100))
    everything = {c.label: c for c in search(profile, jobs=1).candidates}
    assert len(everything) == 4
    peaks = {label: c.peak_memory_bytes for label, c in everything.items()}
    order = sorted(peaks, key=peaks.get)
    # zero 3 least, no ZeRO most; zero 1 and 2 between, in either order (zero 2's reduce-scatter inputs in every
    # backward against zero 1's whole gradients: 1.80 against 1.70 MB here)
    ranked = [label.rsplit(" ", 1)[-1] for label in order]
    assert ranked[0] == "zero=3" and ranked[-1] == "m=2" and set(ranked[1:3]) == {"zero=1", "zero=2"}
    limit = (peaks[order[0]] + peaks[order[1]]) / 2
    result = search(profile, capacity_bytes=limit, jobs=1)
    assert [c.label for c in result.candidates if c.feasible] == [order[0]]
    assert everything[order[0]].batch_time_s > everything[order[-1]].batch_time_s  # its collectives cost time


def test_the_timeline_shows_zero_collectives_inline():
    """zero 3, every event 1 ms: each layer's forward step item waits for its weights, in the step."""
    plan = _zero_plan(3)
    timeline = simulate(plan, Costs.from_seconds(plan, {eid: 1e-3 for eid in plan.events}))
    from analysis.simulate import ZERO_ALLGATHER, ZERO_REDUCESCATTER

    first = [i for i in timeline.intervals(0) if i.micro == 0]
    kinds = Counter(i.category for i in first)
    assert kinds[ZERO_ALLGATHER] == 8 and kinds[ZERO_REDUCESCATTER] == 4  # 4 layers: forward and backward
    gather = next(i for i in first if i.category == ZERO_ALLGATHER)
    assert gather.layer == 0 and gather.name.startswith("F zero allgather")


def test_zero1_steps_differ_in_the_first_forward_and_the_last_backward():
    """zero 1, every event 1 ms, 4 layers: the first forward gathers each layer's weights (8 ms against 4), the
    last backward reduce-scatters each layer's gradients (8 ms against 4)."""
    plan = _zero_plan(1)
    timeline = simulate(plan, Costs.from_seconds(plan, {eid: 1e-3 for eid in plan.events}))
    durations = {(r.phase, r.micro): r.end_s - r.start_s for r in timeline.pipeline[0].steps}
    assert durations == pytest.approx({("F", 0): 8e-3, ("F", 1): 4e-3, ("F", 2): 4e-3, ("F", 3): 4e-3,
                                       ("B", 0): 4e-3, ("B", 1): 4e-3, ("B", 2): 4e-3, ("B", 3): 8e-3})
    usage = timeline.pipeline[0].usage  # the inline collectives are exposed communication
    assert usage.comm_s == pytest.approx(8e-3) and usage.compute_s == pytest.approx(32e-3 + 1e-3)


def test_a_replay_takes_the_distinct_steps_from_their_own_micro_batches():
    """A run twice as slow as predicted in every step: the replay keeps zero 1's first forward and last backward
    apart from the others instead of averaging them in."""
    from types import SimpleNamespace

    from analysis.validate import replay_stage_costs

    plan = _zero_plan(1)
    timeline = simulate(plan, Costs.from_seconds(plan, {eid: 1e-3 for eid in plan.events}))
    steps = {(0, "F", 0): [16e-3], (0, "B", 3): [16e-3]} | {(0, "F", i): [8e-3] for i in (1, 2, 3)} \
        | {(0, "B", i): [8e-3] for i in (0, 1, 2)}
    (replayed,) = replay_stage_costs(SimpleNamespace(devices={}), timeline, np.array([0]), steps)
    assert (replayed.forward_s, replayed.first_forward.seconds) == pytest.approx((8e-3, 16e-3))
    assert (replayed.backward_s, replayed.last_backward.seconds) == pytest.approx((8e-3, 16e-3))
    assert replayed.first_forward.comm_s == pytest.approx(8e-3)  # its gathers' predicted share, stretched


# ---- zero-bubble schedules (zb-h1, interleaved-zb) -------------------------------------------------------------
def test_zb_h1_order_pinned():
    """ZB-H1 over pp = 2 with 4 micro-batches, as torch.distributed.pipelining orders it (the MPI test compares
    with its real schedule): the first device runs each W right after its B, the last defers W by one."""
    from harness.plan.schedules import device_steps

    def text(stage):
        return " ".join(f"{s.phase}{s.micro}" for s in device_steps("zb-h1", stage, 2, 4))

    assert text(0) == "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3"
    assert text(1) == "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"


@pytest.mark.parametrize("schedule,chunks", [("zb-h1", 1), ("interleaved-zb", 2), ("interleaved-zb", 3)])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 4), (2, 6), (3, 3), (4, 8), (4, 2)])
def test_zero_bubble_steps_run_every_f_b_and_w_once_in_dependency_order(schedule, chunks, pp, m):
    from harness.plan.schedules import device_steps

    for stage in range(pp):
        steps = device_steps(schedule, stage, pp, m, chunks)
        assert Counter(steps) == Counter((p, c, i) for p in "FBW" for c in range(chunks) for i in range(m))
        position = {step: k for k, step in enumerate(steps)}
        for c in range(chunks):
            for i in range(m):
                assert position[("F", c, i)] < position[("B", c, i)] < position[("W", c, i)]


@pytest.mark.parametrize("kwargs,message", [
    (dict(schedule="zb-h1", chunks=2, pp=2, layers=4), r"\[strategy.chunks\] chunks = 2 needs an interleaved "
                                                       r"schedule \(interleaved-1f1b or interleaved-zb\)"),
    (dict(schedule="zb-h1", pp=2, tp=2, global_batch=4), r"\[strategy.tp\] zb-h1 with tp = 2 is not built"),
    (dict(schedule="zb-h1", pp=2, dp=2, zero=1, global_batch=8), r"\[strategy.zero\] zb-h1 with zero = 1 is not "
                                                                 r"built"),
    (dict(schedule="interleaved-zb", pp=2, layers=4, recompute="full"), r"\[strategy.recompute\] interleaved-zb "
                                                                        r"with recompute = 'full' is not built"),
    (dict(schedule="zb-h1", pp=2, global_batch=5, micro=1), r"\[batch.global\] zb-h1 runs the micro-batches in "
                                                            r"rounds of micro-batches // pp \(2\)")])
def test_zero_bubble_combinations_not_built_are_refused(kwargs, message):
    with pytest.raises(SpecError, match=message):
        loads_spec(tiny_spec_text(**kwargs))


def test_a_split_backward_computes_input_then_weight_gradients():
    """Past the first stage, B runs each layer's input gradient (stage_backward_input) and W its weights'; the
    first stage's B is empty and its W the whole backward, as torch.distributed.pipelining runs them."""
    plan = plan_of(layers=4, pp=2, dp=2, global_batch=16, micro=2, schedule="zb-h1")
    first, last = plan.stages

    def names(ids):
        return [plan.events[e].name for e in ids]

    assert first.backward == [] and names(first.weight) == ["gpt2.block.bwd"] * 2 + ["gpt2.embedding.bwd"]
    assert names(last.backward) == ["gpt2.head.bwd_input"] + ["gpt2.block.bwd_input"] * 2
    assert names(last.weight) == ["gpt2.head.bwd_weight"] + ["gpt2.block.bwd_weight"] * 2
    assert last.weight_layers == last.backward_layers == [5, 4, 3]
    # no whole backward made for a layer past the first stage: a profile measures only what is run
    assert all(plan.multiplicity[eid] > 0 for eid in plan.events)
    assert sorted(e.name for e in plan.events.values() if e.kind == "compute" and "bwd" in e.name) == [
        "gpt2.block.bwd", "gpt2.block.bwd_input", "gpt2.block.bwd_weight", "gpt2.embedding.bwd",
        "gpt2.head.bwd_input", "gpt2.head.bwd_weight"]
    # W items are one forward's FLOPs, as B's; every device's flow counts them as the plan does
    head_in, head_w = (plan.events[e] for e in (last.backward[0], last.weight[0]))
    assert head_in.cost == head_w.cost == plan.events[last.forward[-1]].cost
    per_phase = Counter(phase for rank in range(4) for _, phase, _, _ in plan.device_flow(rank))
    assert per_phase["W"] == 2 * 4 * (3 + 3) and per_phase["B"] == 2 * 4 * 3
    # the buckets are launched after the last micro-batch's W (one call over the stage)
    flow = list(plan.device_flow(2))
    dp_at = [k for k, (_, phase, _, _) in enumerate(flow) if phase == "dp"]
    assert len(dp_at) == len(last.buckets) > 0
    assert [phase for _, phase, _, micro in flow[dp_at[0] - len(last.weight):dp_at[0]]] == ["W"] * len(last.weight)
    assert dp_at == list(range(dp_at[0], dp_at[0] + len(dp_at))) and flow[dp_at[0] - 1][3] == 3


@pytest.mark.parametrize("F,B,W", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4), (3, 6)])
def test_zb_h1_bubble_is_f_plus_b_minus_w_per_stage(F, B, W, pp, m):
    """One block per stage, nothing else costs: ZB-H1 takes m (F + B + W) + (pp - 1)(F + B - W) (Qi et al.,
    W <= B), where 1F1B takes m (F + B + W) + (pp - 1)(F + B + W); the first stage's W is its whole backward."""
    seconds = {"gpt2.block.fwd": F, "gpt2.block.bwd_input": B, "gpt2.block.bwd_weight": W, "gpt2.block.bwd": B + W}
    kwargs = dict(layers=pp, pp=pp, global_batch=m, micro=1)
    zb, one = plan_of(**kwargs, schedule="zb-h1"), plan_of(**kwargs, schedule="1f1b")
    assert simulate(zb, _costs(zb, seconds)).batch_time_s == pytest.approx(m * (F + B + W) + (pp - 1) * (F + B - W))
    assert simulate(one, _costs(one, seconds)).batch_time_s == pytest.approx((m + pp - 1) * (F + B + W))


def test_the_timeline_shows_w_steps_after_their_b():
    from analysis.simulate import BACKWARD_WEIGHT

    seconds = {"gpt2.block.fwd": 1.0, "gpt2.block.bwd_input": 1.0, "gpt2.block.bwd_weight": 1.0,
               "gpt2.block.bwd": 2.0}
    plan = plan_of(layers=2, pp=2, global_batch=4, micro=1, schedule="zb-h1")
    timeline = simulate(plan, _costs(plan, seconds))
    last = timeline.pipeline[1]
    assert [(r.phase, r.micro) for r in last.steps][:5] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0)]
    weights = [i for i in timeline.intervals(1) if i.category == BACKWARD_WEIGHT and i.end_s > i.start_s]
    assert [(i.name.split()[0], i.micro, i.layer, i.end_s - i.start_s) for i in weights] == [
        ("W", i, 2, 1.0) for i in range(4)]
    ends = {(r.phase, r.micro): r.end_s for r in last.steps}
    assert all(ends[("B", i)] <= next(r.start_s for r in last.steps if r.phase == "W" and r.micro == i)
               for i in range(4))


def test_a_split_backward_holds_activations_until_its_w():
    """ZB-H1's last stage defers each W by one micro-batch: two hold their activations at once (1F1B: one), and
    between its B and W a micro-batch also holds what the B kept for the W (the measured bwd_input bytes)."""
    kwargs = dict(layers=2, pp=2, global_batch=4, micro=1)
    zb, one = plan_of(**kwargs, schedule="zb-h1"), plan_of(**kwargs, schedule="1f1b")
    kept = {eid: 300 for eid, e in zb.events.items() if e.content.get("phase") == "bwd_input"}
    head = 10_000  # saved by the head: more than its float32 log-probabilities, which its backward lets go of
    split = estimate_memory(zb, {**_saved(zb, other=head), **kept})
    plain = estimate_memory(one, _saved(one, other=head))
    assert [s.in_flight for s in plain.stages] == [2, 1]
    assert [s.in_flight for s in split.stages] == [2, 2]
    last = split.stages[1]
    # at its peak (inside micro-batch 1's B, micro-batch 0's W not yet run): two micro-batches' activations
    # (block, head) and what micro-batch 0's B kept (block and head: 300 B each), as the head's projection makes
    # its gradients (the temporaries) with its log-probabilities let go
    spec = zb.spec
    b, seq, vocab, hidden = spec.batch.micro, spec.model.seq_len, spec.model.vocab, spec.model.hidden
    log_probabilities = b * seq * vocab * 4
    assert last.activations == 2 * (10**6 + head) + 2 * 300 - log_probabilities
    assert last.temporaries == b * seq * vocab * 4 + (vocab + b * seq) * hidden * 4
    # less what micro-batch 0's B let go of as it ended, above the stage's last weight (the head's loss part, as
    # measured); micro-batch 1's B still holds its own at the peak, its end
    head_input = next(e for e, ev in zb.events.items() if ev.name == "gpt2.head.bwd_input")
    released = estimate_memory(zb, {**_saved(zb, other=head), **kept}, {head_input: 200}).stages[1]
    assert released.activations == last.activations - 200


def test_w_steps_show_in_the_perfetto_trace_and_the_gantt_chart(tmp_path):
    import gzip

    from analysis.cli import main as analysis_main
    from analysis.plot import timeline_bars
    from analysis.predict import predict
    from analysis.simulate import BACKWARD_WEIGHT
    from tests.test_analysis_helpers import by_name, write_handmade_profile

    spec = make_spec(pp=2, micro_batches=4, schedule="zb-h1")
    times = {"gpt2.block.fwd": 1e-3, "gpt2.block.bwd": 2e-3, "gpt2.block.bwd_input": 1e-3,
             "gpt2.block.bwd_weight": 1e-3}
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name(times))
    trace, png = tmp_path / "t.json.gz", tmp_path / "t.png"
    assert analysis_main(["simulate", str(path), "--trace", str(trace), "--png", str(png)]) == 0
    weights = [e for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
               if e.get("cat") == BACKWARD_WEIGHT]
    assert {e["pid"] for e in weights} == {0, 1} and all(e["name"].startswith("W ") for e in weights)
    assert png.stat().st_size > 0
    bars = timeline_bars(predict(path).timeline, 1)
    assert len(bars[BACKWARD_WEIGHT]) == 4  # one bar per W step, as for F and B


def test_a_middle_stage_lets_its_output_go_at_the_end_of_its_b():
    """torch's stage_backward_input detaches a stage's output: past the first stage it is gone once B ends,
    while the saved activations wait for W. Middle stage of ZB-H1 over pp = 3, 6 micro-batches: the peak holds
    every micro-batch whose W has not run (saved + kept) and the outputs only of those whose B has not."""
    from harness.plan.schedules import device_steps

    plan = plan_of(layers=3, pp=3, global_batch=6, micro=1, schedule="zb-h1")
    kept = {eid: 300 for eid, e in plan.events.items() if e.content.get("phase") == "bwd_input"}
    middle = estimate_memory(plan, {**_saved(plan), **kept}).stages[1]
    output = plan.events[plan.stages[1].send_forward].bytes
    spec = plan.spec
    temporaries = (spec.batch.micro * spec.model.seq_len + spec.model.hidden) * spec.model.ffn * 4  # the block's
    live, best = 0, (0, 0)  # (activations + temporaries, activations) at the highest moment
    for step in device_steps("zb-h1", 1, 3, 6):
        if step.phase == "B":  # its worst moment: the block's gradients made, before it keeps its 300 B
            best = max(best, (live + temporaries, live))
        live += {"F": 10**6 + output, "B": 300, "W": -(10**6 + 300)}[step.phase]
        best = max(best, (live, live))  # the B's end is before its output goes
        live -= output if step.phase == "B" else 0
    assert (middle.activations, middle.temporaries) == (best[1], temporaries)
    assert middle.activations < 3 * (10**6 + output + 300)  # not every output held until its W


def test_a_split_step_pays_one_call_past_the_head():
    """A stage runs each half of the split in one call over its layers; the profile called it per layer. Every
    item of a B or W step but the first sheds its layer's further-call cost, the head first (its cost is 0,
    unmeasurable: a head cannot follow itself), so both blocks after it shed theirs."""
    from analysis.simulate import stage_costs

    plan = plan_of(layers=4, pp=2, global_batch=4, micro=1, schedule="zb-h1")
    seconds = {"gpt2.block.bwd_input": 5e-3, "gpt2.block.bwd_weight": 4e-3, "gpt2.head.bwd_input": 2e-3,
               "gpt2.head.bwd_weight": 1e-3}
    costs = _costs(plan, seconds)
    for eid, event in plan.events.items():
        if event.content.get("phase") in ("bwd_input", "bwd_weight"):
            costs.backward_call[eid] = 0.0 if event.content["layer"] == "head" else (
                7e-4 if event.content["phase"] == "bwd_input" else 4e-4)
    last = stage_costs(plan, costs)[1]
    assert last.backward_s == pytest.approx(2e-3 + 2 * (5e-3 - 7e-4))
    assert last.weight.seconds == pytest.approx(1e-3 + 2 * (4e-3 - 4e-4))

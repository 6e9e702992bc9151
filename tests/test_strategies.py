"""The strategies that trade memory against time: activation recompute (recompute = "full") through the
spec, the event flows, the timeline, the memory model and the search."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from analysis.costs import Costs
from analysis.memory import estimate_memory
from analysis.profile_reader import load_profile
from analysis.search import search
from analysis.simulate import BACKWARD, RECOMPUTE, simulate
from harness.errors import SpecError, UserError
from harness.events import build_plan
from harness.layers import input_bytes
from harness.spec import loads_spec, parse_spec
from tests.helpers import tiny_spec_text
from tests.test_analysis_helpers import by_name, make_spec, write_handmade_profile


def plan_of(**kwargs):
    return build_plan(loads_spec(tiny_spec_text(**kwargs)))


# ---- spec ------------------------------------------------------------------------------------------------------
def test_recompute_is_none_unless_asked():
    assert loads_spec(tiny_spec_text()).strategy.recompute == "none"
    spec = loads_spec(tiny_spec_text(recompute="full"))
    assert spec.strategy.recompute == "full"
    assert loads_spec(spec.to_toml()) == spec  # round-trips


@pytest.mark.parametrize("value,message", [
    ("selective", r"\[strategy.recompute\] selective recompute \(attention only, as Megatron-LM\) is not built"),
    ("some", r"\[strategy.recompute\] unknown value 'some'; expected one of none, full")])
def test_unknown_recompute_is_refused(value, message):
    with pytest.raises(SpecError, match=message):
        loads_spec(tiny_spec_text(recompute=value))


def test_recompute_is_a_search_dimension():
    from harness.candidates import candidate_label, expand

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
def test_a_recomputing_backward_runs_the_blocks_forward_first():
    """pp = 2, tp = 2, 4 blocks: each backward step first runs its stage's two blocks forward again, with their
    tensor-parallel all-reduces; the embedding and the head (with the loss) are not recomputed."""
    none, full = plan_of(layers=4, pp=2, tp=2, global_batch=4, micro=1), \
        plan_of(layers=4, pp=2, tp=2, global_batch=4, micro=1, recompute="full")
    for plain, again in zip(none.stages, full.stages):
        blocks = [i for i, layer in zip(plain.forward, plain.forward_layers)
                  if layer < 0 or full.layers[layer].kind == "block"]
        assert again.recompute == len(blocks) == 6  # two blocks, each with two all-reduces
        assert again.backward == blocks + plain.backward
        assert again.forward == plain.forward
    names = [full.events[e].name for e in full.stages[0].backward[:3]]
    assert names == ["gpt2.block.fwd", "allreduce 2KiB x2 intra", "allreduce 2KiB x2 intra"]
    # each block's forward runs twice per micro-batch, its all-reduces three times (forward, recompute, backward)
    m, devices = full.spec.micro_batches, 2
    block_fwd = next(e for e in full.events.values() if e.name == "gpt2.block.fwd")
    embedding_fwd = next(e for e in full.events.values() if e.name == "gpt2.embedding.fwd")
    assert full.multiplicity[block_fwd.id] == 2 * none.multiplicity[block_fwd.id] == 2 * 4 * m * devices
    assert full.multiplicity[embedding_fwd.id] == none.multiplicity[embedding_fwd.id]
    (tp,) = [e.id for e in full.events.values() if e.kind == "allreduce"]
    # 4 blocks x 2 all-reduces per pass, one tensor-parallel group per stage
    assert (none.multiplicity[tp], full.multiplicity[tp]) == (2 * 4 * 2 * m, 3 * 4 * 2 * m)
    assert set(full.events) == set(none.events)  # nothing new to profile


def test_the_device_flow_marks_the_recomputed_forward():
    """Stage 0's first backward step: the gradient received, its two blocks again (R), then the backward (B) of
    the blocks and the embedding (which is not recomputed)."""
    plan = plan_of(layers=4, pp=2, global_batch=2, micro=1, recompute="full")
    flow = list(plan.device_flow(0))
    first_backward = next(i for i, (_, phase, _, _) in enumerate(flow) if phase in ("R", "B"))
    phases = [phase for _, phase, _, _ in flow[first_backward - 1:first_backward + 5]]
    assert phases == ["recv", "R", "R", "B", "B", "B"]
    names = [plan.events[e].name for e, _, _, _ in flow[first_backward:first_backward + 5]]
    assert names == ["gpt2.block.fwd", "gpt2.block.fwd", "gpt2.block.bwd", "gpt2.block.bwd", "gpt2.embedding.bwd"]
    # every device's flows add up to the plan's multiplicities
    counts = Counter(e for rank in range(plan.spec.strategy.world) for e, phase, _, _ in plan.device_flow(rank)
                     if phase != "recv")
    assert counts == +plan.multiplicity


def test_buckets_stay_ready_after_their_own_gradients():
    """A data-parallel bucket is ready after the backward items that make its gradients, past the recompute."""
    none, full = plan_of(layers=2, dp=2, global_batch=4, micro=1), \
        plan_of(layers=2, dp=2, global_batch=4, micro=1, recompute="full")
    shift = full.stages[0].recompute
    assert shift == 2
    assert [b.ready_after for b in full.stages[0].buckets] == [b.ready_after + shift for b in none.stages[0].buckets]


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
    assert [(i.category, i.name.split()[0]) for i in first_backward] == [
        (RECOMPUTE, "R"), (RECOMPUTE, "R"), (BACKWARD, "B"), (BACKWARD, "B")]


# ---- memory ----------------------------------------------------------------------------------------------------
def _saved(plan, block_bytes=10**6, other=1000):
    return {eid: block_bytes if e.content["layer"] == "block" else other for eid, e in plan.events.items()
            if e.kind == "compute" and e.content.get("phase") == "fwd"}


def test_recompute_keeps_the_block_inputs_and_remakes_one_block():
    """GPipe over pp = 2 with 4 micro-batches in flight: each holds, per block, its input (2 kB) instead of its
    saved activations (1 MB); as a backward starts, one block's are re-made. Both stages peak as their second
    backward starts: 3 micro-batches in flight, the gradients made (more than one micro-batch holds)."""
    kwargs = dict(layers=4, pp=2, global_batch=4, micro=1, schedule="gpipe")
    none, full = plan_of(**kwargs), plan_of(**kwargs, recompute="full")
    plain, again = estimate_memory(none, _saved(none)), estimate_memory(full, _saved(full))
    spec = full.spec
    block_input = spec.batch.micro * spec.model.seq_len * spec.model.hidden * 4
    assert input_bytes(spec, full.layers, 1) == block_input == 2048
    output = block_input  # stage 0 holds its output until its gradient returns
    first, last = again.stages
    # stage 0: the embedding saves 1000 B, two blocks keep their inputs, the output; stage 1: two inputs, the head
    assert (first.activations, first.in_flight, first.gradients) == (3 * (1000 + 2 * block_input + output) + 10**6,
                                                                     3, first.weights)
    assert (last.activations, last.in_flight, last.gradients) == (3 * (2 * block_input + 1000) + 10**6, 3,
                                                                  last.weights)
    assert [s.activations for s in plain.stages] == [4 * (1000 + 2 * 10**6 + output), 4 * (2 * 10**6 + 1000)]
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
    from harness.candidates import expand

    path = write_handmade_profile(tmp_path / "profile.h5", spec,
                                  by_name({"compute": 1e-3, "gpt2.block.fwd": 4e-3, "gpt2.block.bwd": 8e-3},
                                          default=2e-4),
                                  also=expand(spec).candidates,
                                  activations=lambda e: 10**6 if e.content["layer"] == "block" else 100,
                                  environment={"profiling_wall_s": 1.5, "warmup": 1, "repeats": 3})
    profile = load_profile(path)
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

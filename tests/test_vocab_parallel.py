"""Vocabulary-parallel embedding, head and cross-entropy under tensor parallelism ([strategy] vocab_parallel):
the plan's events and all-reduces, the spec's rules, the memory they save, and (under mpirun) the shards' loss
and gradients against the whole layers'."""
from __future__ import annotations

import pytest

from harness.common.errors import SpecError
from harness.plan.events import build_plan
from harness.plan.layers import HIDDEN_ALLREDUCE, LOSS_MAX, LOSS_SUMS
from harness.plan.spec import loads_spec
from tests.helpers import tiny_spec_text

MICRO, SEQ, HIDDEN, VOCAB = 2, 16, 32, 1024


def _spec(tp: int = 1, pp: int = 1, vocab_parallel: bool | None = None, vocab: int = VOCAB, name: str = "gpt2-small",
          extra: str = ""):
    text = tiny_spec_text(name=name, tp=tp, pp=pp, layers=4, hidden=HIDDEN, heads=4, ffn=64, seq=SEQ, vocab=vocab,
                          micro=MICRO, global_batch=4 * MICRO)
    if vocab_parallel is not None:
        text = text.replace("[strategy]\n", f"[strategy]\nvocab_parallel = {str(vocab_parallel).lower()}\n")
    return loads_spec(text.replace("[model]\n", f"[model]\n{extra}"))


def _pass_items(plan, layer_kind: str, pass_: str) -> list[tuple[str, int, int]]:
    """The items of `layer_kind`'s forward or backward as (kind, bytes, group): the layer's own compute event
    (bytes 0) and the all-reduces that follow it up to the next layer's."""
    for program in plan.stages:
        items = list(zip(program.forward, program.forward_layers) if pass_ == "fwd"
                     else zip(program.backward, program.backward_layers))
        for i, (eid, index) in enumerate(items):
            if index >= 0 and plan.layers[index].kind == layer_kind:
                out = [(plan.events[eid].kind, 0, 0)]
                for other, other_index in items[i + 1:]:
                    if other_index >= 0:
                        break
                    event = plan.events[other]
                    out.append((event.kind, event.bytes, event.group_size))
                return out
    raise AssertionError(f"no {layer_kind} in the plan")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_head_and_embedding_run_their_share_and_all_reduce_it(tp):
    plan = build_plan(_spec(tp=tp))
    hidden = MICRO * SEQ * HIDDEN * 4
    tokens = MICRO * SEQ
    sharded = [("allreduce", hidden, tp)] if tp > 1 else []
    assert _pass_items(plan, "embedding", "fwd") == [("compute", 0, 0)] + sharded
    assert _pass_items(plan, "embedding", "bwd") == [("compute", 0, 0)]
    # the loss's maximum, then its sum of exponentials with the target's logit (float32, per token)
    assert _pass_items(plan, "head", "fwd") == [("compute", 0, 0)] + (
        [("allreduce", 4 * tokens, tp), ("allreduce", 8 * tokens, tp)] if tp > 1 else [])
    assert _pass_items(plan, "head", "bwd") == [("compute", 0, 0)] + sharded
    head = plan.layers[-1]
    assert head.params == 2 * HIDDEN + VOCAB // tp * HIDDEN
    assert plan.layers[0].params == (VOCAB // tp + SEQ) * HIDDEN
    # the head's forward FLOPs shrink with its share of the vocabulary
    flops = {tp_: build_plan(_spec(tp=tp_)).layers[-1].fwd_flops(MICRO, SEQ) for tp_ in (1, tp)}
    assert flops[tp] == pytest.approx(flops[1] / tp)
    program = plan.stages[-1]
    assert set(program.tp_events) == ({HIDDEN_ALLREDUCE, LOSS_MAX, LOSS_SUMS} if tp > 1 else set())


def test_replicated_layout_kept_with_vocab_parallel_false():
    replicated = build_plan(_spec(tp=2, vocab_parallel=False))
    assert _pass_items(replicated, "head", "fwd") == [("compute", 0, 0)]
    assert _pass_items(replicated, "head", "bwd") == [("compute", 0, 0)]
    assert replicated.layers[-1].params == 2 * HIDDEN + VOCAB * HIDDEN
    sharded = build_plan(_spec(tp=2))
    assert sharded.unique_events == replicated.unique_events + 2  # the loss's two all-reduces
    # tp = 1: vocab_parallel is accepted and changes nothing
    assert build_plan(_spec(tp=1, vocab_parallel=True)).events.keys() == \
        build_plan(_spec(tp=1, vocab_parallel=False)).events.keys()


def test_a_vocabulary_tp_does_not_divide_is_padded_as_megatron_pads_it():
    """1,001 at tp = 4 is padded to a multiple of 128 x 4 = 512: 1,024 rows, each shard's 256 costed; the spec
    still states the tokenizer's 1,001, so another tp pads it afresh."""
    spec = _spec(tp=4, vocab=1001)
    assert (spec.model.vocab, spec.model.unpadded_vocab) == (1024, 1001)
    assert build_plan(spec).layers[-1].params == 2 * HIDDEN + 1024 // 4 * HIDDEN
    assert spec.to_dict()["model"]["vocab"] == 1001
    assert spec.with_changes(tp=1, dp=4).model.vocab == 1001  # tp = 1 divides it: nothing to pad by default
    assert build_plan(_spec(tp=4, vocab=1001, vocab_parallel=False)).layers[-1].params == 2 * HIDDEN + 1001 * HIDDEN


def test_a_stored_spec_without_the_field_reads_as_the_replicated_layout():
    """Profiles and traces written before vocab_parallel existed measured replicated heads."""
    from harness.store.profile_reader import parse_spec_offline

    data = _spec(tp=2).to_dict()
    assert data["strategy"]["vocab_parallel"] is True
    del data["strategy"]["vocab_parallel"]
    assert parse_spec_offline(data, "old profile").strategy.vocab_parallel is False


@pytest.mark.parametrize("name", ["gpt2-small", "bert-base", "llama-1b"])
def test_the_logits_memory_shrinks_by_tp(name):
    """What the head's forward saves for its backward (the float32 softmax of its logits) as measured on the
    layer (harness.profile.memory), and the memory model's backward temporaries of the head: split by tp."""
    import torch

    from analysis.memory import backward_moments
    from harness.profile.compute import ComputeRunner
    from harness.profile.memory import activation_bytes

    saved, temporaries = {}, {}
    for tp in (1, 2, 4):
        plan = build_plan(_spec(tp=tp, name=name))
        (event,) = [e for e in plan.events.values() if e.name.endswith("head.fwd")]
        runner = ComputeRunner(plan.spec, event.content, torch.device("cpu"), copies=1)
        saved[tp] = activation_bytes(runner.layers[0], runner.make_input,
                                     lambda module, x: module.loss(module(x), torch.randint(0, VOCAB, (MICRO, SEQ))))
        temporaries[tp] = max(t for t, _, _ in backward_moments(plan.spec, plan.layers[-1]))
    logits = MICRO * SEQ * VOCAB * 4
    for tp in (2, 4):
        # the saved softmax is 1/tp of the whole vocabulary's; the rest (the head's input, the targets) stays
        assert saved[1] - saved[tp] == pytest.approx(logits * (1 - 1 / tp), rel=0.02)
        assert temporaries[tp] < temporaries[1] / tp * 1.2


def test_the_memory_model_counts_the_head_share():
    from analysis.memory import estimate_memory

    peaks = {}
    for vocab_parallel in (True, False):
        plan = build_plan(_spec(tp=2, pp=2, vocab_parallel=vocab_parallel))
        last = estimate_memory(plan, {}).stages[-1]
        peaks[vocab_parallel] = last
    head = VOCAB * HIDDEN * 4
    assert peaks[False].weights - peaks[True].weights == head // 2
    assert peaks[False].gradients - peaks[True].gradients == head // 2


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["gpt2-small", "bert-base", "llama-1b"])
def test_shards_loss_and_gradients_match_the_whole_layers(name):
    """Every rank of the world holds one vocabulary shard (tp = the world size): the embedding's output, the
    loss, the gradient at the head's input and every parameter's gradient (a shard's: its rows of the whole
    one's) agree with the whole embedding's and head's within float tolerance."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from harness.runtime.distributed import destroy_process_group, init_process_group
    from harness.train.model import build_full_layer, build_shard, shard_tensor
    from launcher.topology import discover

    comm = MPI.COMM_WORLD
    tp, rank = comm.Get_size(), comm.Get_rank()
    model = _spec(name=name, vocab=64 * tp).model
    init_process_group(comm, discover(comm), torch.device("cpu"), timeout_s=120)
    try:
        group = dist.new_group(list(range(tp)))
        generator = torch.Generator().manual_seed(7)
        ids = torch.randint(0, model.vocab, (MICRO, SEQ), generator=generator)
        targets = torch.randint(0, model.vocab, (MICRO, SEQ), generator=generator)
        results = {}
        for layout, (embedding, head) in {
                "whole": (build_full_layer(model, "embedding", 3, 0), build_full_layer(model, "head", 3, 1)),
                "shard": (build_shard(model, "embedding", 3, 0, tp, rank, group),
                          build_shard(model, "head", 3, 1, tp, rank, group))}.items():
            hidden = embedding(ids)
            hidden.retain_grad()
            loss = head.loss(head(hidden), targets)
            loss.backward()
            results[layout] = (loss.detach(), hidden.detach(), hidden.grad, embedding, head)
        (loss, hidden, grad, *whole), (shard_loss, shard_hidden, shard_grad, *shards) = \
            results["whole"], results["shard"]
        assert shard_loss.item() == pytest.approx(loss.item(), rel=1e-5)
        torch.testing.assert_close(shard_hidden, hidden, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(shard_grad, grad, rtol=1e-4, atol=1e-7)
        for full_module, shard_module in zip(whole, shards):
            full_params = dict(full_module.named_parameters())
            for param_name, param in shard_module.named_parameters():
                expected = shard_tensor(param_name, full_params[param_name].grad, model, tp, rank)
                torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-7, msg=param_name)
    finally:
        destroy_process_group()


# ---- tie_embeddings: the head's projection is the embedding's token table ----------------------------------------
TIE = "tie_embeddings = true\n"


def test_a_tied_head_on_the_embeddings_stage_holds_no_projection_of_its_own():
    tied, untied = build_plan(_spec(tp=2, extra=TIE)), build_plan(_spec(tp=2))
    assert dict(tied.layers[-1].signature)["tied"] is True
    assert tied.layers[-1].params == untied.layers[-1].params - VOCAB // 2 * HIDDEN
    assert not any(program.tie for program in tied.stages)
    from analysis.memory import estimate_memory

    saved = untied.layers[-1].params * 4
    saved -= tied.layers[-1].params * 4
    (one_weight,), (two,) = estimate_memory(tied, {}).stages, estimate_memory(untied, {}).stages
    assert (two.weights - one_weight.weights, two.gradients - one_weight.gradients) == (saved, saved)


@pytest.mark.parametrize("tp,pp,dp", [(1, 2, 1), (2, 2, 1), (1, 4, 2), (2, 4, 2)])
def test_the_tied_copies_on_the_first_and_last_stage_all_reduce_their_gradients(tp, pp, dp):
    spec = loads_spec(tiny_spec_text(tp=tp, pp=pp, dp=dp, layers=pp, hidden=HIDDEN, heads=4, ffn=64, seq=SEQ,
                                     vocab=VOCAB, micro=MICRO, global_batch=4 * MICRO * dp)
                      .replace("[model]\n", f"[model]\n{TIE}"))
    plan = build_plan(spec)
    tie = plan.events[plan.stages[0].tie]
    assert plan.stages[-1].tie == tie.id and not any(p.tie for p in plan.stages[1:-1])
    assert (tie.kind, tie.bytes, tie.group_size) == ("allreduce", VOCAB // tp * HIDDEN * 4, 2)
    assert plan.multiplicity[tie.id] == dp * tp  # one call per pair of ends, once an iteration
    assert "tied" not in dict(plan.layers[-1].signature)  # each end keeps its copy
    for rank in range(spec.strategy.world):
        phases = [phase for _, phase, _, _ in plan.device_flow(rank)]
        stage = plan.coords(rank)[2]
        if stage in (0, pp - 1):
            assert phases.count("tie") == 1 and phases.index("tie") == phases.index("opt") - 1
        else:
            assert "tie" not in phases


def test_the_tie_waits_for_both_ends_and_delays_their_optimizer():
    """pp = 2: both devices' optimizer steps start after the tie's all-reduce, which starts once the later of
    the two is done with its backward."""
    from analysis.costs import Costs
    from analysis.simulate import simulate

    plain, tied = (build_plan(_spec(pp=2, extra=extra)) for extra in ("", TIE))
    timelines = []
    for plan in (plain, tied):
        seconds = {eid: {"compute": 1e-3, "p2p": 1e-4}.get(e.kind, 5e-3) for eid, e in plan.events.items()}
        timelines.append(simulate(plan, Costs.from_seconds(plan, seconds)))
    before, after = timelines
    first, last = after.pipeline
    assert first.tie.start_s == last.tie.start_s == pytest.approx(max(d.optimizer_start_s for d in before.pipeline))
    assert first.optimizer_start_s == last.optimizer_start_s == pytest.approx(first.tie.end_s)
    assert first.tie.end_s - first.tie.start_s == pytest.approx(5e-3)
    assert after.batch_time_s == pytest.approx(before.batch_time_s + 5e-3)
    assert any(i.name.startswith("tie allreduce") for i in after.intervals(0))


@pytest.mark.parametrize("strategy, words", [
    (dict(dp=2, zero=1), "tie_embeddings with zero = 1 is not built"),
    (dict(pp=2, schedule="zb-h1"), "tie_embeddings with zb-h1 is not built")])
def test_ties_that_are_not_built_are_refused(strategy, words):
    text = tiny_spec_text(layers=2, global_batch=8, **strategy).replace("[model]\n", f"[model]\n{TIE}")
    with pytest.raises(SpecError, match=words):
        loads_spec(text)
    with pytest.raises(SpecError, match="a factory model ties its own weights"):
        loads_spec(text.replace('name = "gpt2-small"', 'factory = "tests.user_model:build"'))

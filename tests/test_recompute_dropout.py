"""Megatron-LM's dropout and its recompute options: selective (the attention core run again in the backward) and
partial full recompute (recompute_layers, recompute_method), planned, metered against the formulas, modelled and
trained.

The MPI tests run as `mpirun -n 2 python -m mpi4py -m pytest --with-mpi -m mpi tests/test_recompute_dropout.py`.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from harness.common.errors import SpecError
from harness.plan.spec import loads_spec
from tests.helpers import tiny_spec_text


def _text(*, model: str = "", strategy: str = "", **kwargs) -> str:
    """tests.helpers.tiny_spec_text with lines added to [model] and [strategy]."""
    text = tiny_spec_text(**kwargs)
    return text.replace("[model]\n", "[model]\n" + model, 1).replace("[strategy]\n", "[strategy]\n" + strategy, 1)


def _spec(**kwargs):
    return loads_spec(_text(**kwargs))


# ---- the spec -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field,words", [
    (dict(model="dropout = 1.0\n"), "[model.dropout]", "probability"),
    (dict(model="dropout = -0.1\n"), "[model.dropout]", "probability"),
    (dict(model="dropout = true\n"), "[model.dropout]", "probability"),
    (dict(model="dropout = 0.1\n", cp=2), "[model.dropout]", "context-parallel"),
    (dict(strategy="recompute_layers = 2\n"), "[strategy.recompute_layers]", "recompute = 'full'"),
    (dict(strategy="recompute_method = \"block\"\n", recompute="selective"), "[strategy.recompute_method]",
     "recompute = 'full'"),
    (dict(strategy="recompute_method = \"every\"\n", recompute="full"), "[strategy.recompute_method]",
     "uniform, block"),
    (dict(strategy="recompute_layers = 3\n", recompute="full", pp=2), "[strategy.recompute_layers]",
     "2 blocks"),
    (dict(strategy="recompute_layers = 0\n", recompute="full"), "[strategy.recompute_layers]", ">= 1"),
    (dict(recompute="selective", cp=2), "[strategy.recompute]", "cp = 2"),
    (dict(recompute="selective", schedule="zb-h1", pp=2), "[strategy.recompute]", "zb-h1"),
])
def test_bad_values_are_refused_with_their_field(kwargs, field, words):
    with pytest.raises(SpecError) as caught:
        _spec(**kwargs)
    assert field in str(caught.value) and words in str(caught.value)


def test_a_factory_model_has_no_dropout_or_attention_core_to_recompute():
    factory = 'factory = "tests.user_model:build"'
    text = tiny_spec_text().replace('name = "gpt2-small"', factory)
    with pytest.raises(SpecError, match=r"\[model.dropout\].*its own dropout"):
        loads_spec(text.replace("[model]\n", "[model]\ndropout = 0.1\n"), import_factory=False)
    with pytest.raises(SpecError, match=r"\[strategy.recompute\].*factory model's attention"):
        loads_spec(text.replace("[strategy]\n", "[strategy]\nrecompute = \"selective\"\n"), import_factory=False)


def test_cli_refuses_with_exit_status_2(tmp_path, project_env):
    path = tmp_path / "bad.toml"
    path.write_text(_text(strategy="recompute_layers = 2\n"))
    result = subprocess.run([sys.executable, "-m", "harness", "events", str(path)], capture_output=True, text=True,
                            env=project_env, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "[strategy.recompute_layers]" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_defaults_leave_the_spec_and_its_events_as_they_were():
    """dropout = 0 and full recompute of every block (uniform, 1) are the defaults: the spec's JSON, its layers'
    signatures and so its event ids are those of a spec that does not name them."""
    from harness.plan.events import build_plan

    plain = _spec(recompute="full")
    named = _spec(recompute="full", model="dropout = 0.0\n",
                  strategy="recompute_layers = 1\nrecompute_method = \"uniform\"\n")
    assert named.to_json() == plain.to_json()
    assert list(build_plan(named).events) == list(build_plan(plain).events)
    spec = _spec(model="dropout = 0.1\n", recompute="full", strategy="recompute_layers = 2\n")
    again = loads_spec(spec.to_toml())
    assert again == spec and again.model.dropout == 0.1 and again.strategy.recompute_layers == 2
    # another recompute mode leaves the full recompute's choice of blocks behind
    assert spec.with_changes(recompute="none").strategy.recompute_layers == 1


# ---- the plan ---------------------------------------------------------------------------------------------------

def _backward(spec, stage: int = 0):
    """(layer, 'R' or 'B') of each compute item of stage `stage`'s backward, in order."""
    from harness.plan.events import build_plan

    plan = build_plan(spec)
    items, layers, again = plan.stages[stage].backward_of(0, spec.micro_batches)
    return plan, [(index, "R" if redo else "B") for eid, index, redo in zip(items, layers, again) if index >= 0]


def test_uniform_recompute_runs_each_chunk_again_before_its_backward():
    """layers 4, pp 1: the embedding (0), blocks 1-4, the head (5); chunks of 2 blocks: (1, 2) and (3, 4), each
    chunk's forwards again before its last block's backward, then the chunk's backwards in reverse."""
    _, order = _backward(_spec(recompute="full", strategy="recompute_layers = 2\n"))
    assert order == [(5, "B"), (3, "R"), (4, "R"), (4, "B"), (3, "B"), (1, "R"), (2, "R"), (2, "B"), (1, "B"),
                     (0, "B")]
    _, order = _backward(_spec(recompute="full", strategy="recompute_layers = 3\n"))  # chunks (1, 2, 3) and (4)
    assert order == [(5, "B"), (4, "R"), (4, "B"), (1, "R"), (2, "R"), (3, "R"), (3, "B"), (2, "B"), (1, "B"),
                     (0, "B")]


def test_block_recompute_runs_the_first_blocks_of_each_stage_again():
    """pp 2, 4 blocks: stage 0 holds the embedding and blocks 1-2, stage 1 blocks 3-4 and the head; block method,
    1 layer: block 1 on stage 0 and block 3 on stage 1 run again, the others keep what they save."""
    spec = _spec(recompute="full", pp=2, strategy="recompute_layers = 1\nrecompute_method = \"block\"\n")
    plan, first = _backward(spec, 0)
    _, second = _backward(spec, 1)
    assert first == [(2, "B"), (1, "R"), (1, "B"), (0, "B")]
    assert second == [(5, "B"), (4, "B"), (3, "R"), (3, "B")]
    # blocks 1 and 3 run under torch.utils.checkpoint, their own forward event, twice a micro-batch each; blocks
    # 2 and 4 share the plain one, once
    checkpointed = plan.stages[0].forward[plan.stages[0].forward_layers.index(1)]
    plain = plan.stages[0].forward[plan.stages[0].forward_layers.index(2)]
    assert plan.events[checkpointed].content["checkpointed"] is True
    assert "checkpointed" not in plan.events[plain].content
    assert plan.multiplicity[checkpointed] == 4 * spec.micro_batches
    assert plan.multiplicity[plain] == 2 * spec.micro_batches


def test_selective_recompute_costs_the_attention_core_in_the_backward():
    """A selectively recomputed block is its own event, its backward 2 forwards' FLOPs plus its attention core's
    forward (QK^T and attention x V: 4 b s^2 h / tp); nothing runs again as a step of its own."""
    from harness.plan.kernels import event_kernels, kernels_flops

    micro, seq, hidden = 2, 16, 32
    plain, order = _backward(_spec(micro=micro))
    spec = _spec(micro=micro, recompute="selective")
    plan, selective_order = _backward(spec)
    assert selective_order == order and all(step == "B" for _, step in order)
    block, plain_block = plan.layers[1], plain.layers[1]
    assert dict(block.signature)["recompute"] == "selective" and "recompute" not in dict(plain_block.signature)
    forward, backward = (next(e for e in plan.events.values()
                              if e.content.get("phase") == phase and e.content["layer"] == "block")
                         for phase in ("fwd", "bwd"))
    assert backward.cost == 2 * forward.cost + 4 * micro * seq * seq * hidden
    assert set(plan.events) != set(plain.events)  # the selective block's own events
    # the device model's kernels count the same (harness.plan.kernels: the attention forward again in the backward)
    assert kernels_flops(event_kernels(backward.content)) == pytest.approx(backward.cost, rel=1e-12)


def test_dropout_is_in_the_signatures_of_the_layers_that_run_it():
    from harness.plan.layers import describe

    layers = describe(_spec(model="dropout = 0.1\n"))
    assert [dict(layer.signature).get("dropout") for layer in layers] == [0.1, 0.1, 0.1, 0.1, 0.1, None]


# ---- the meter against the formulas -------------------------------------------------------------------------------

@pytest.mark.parametrize("family,kv_heads", [("gpt2", None), ("llama", None), ("llama", 2), ("bert", None)])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_meter_measures_what_the_formulas_say(family, kv_heads, dropout, recompute):
    """A built layer's saved bytes as harness.profile.memory meters them, against harness.plan.activations: on a
    CPU dropout saves its mask in the dtype (mask_bytes = d) and attention with dropout runs torch's math path;
    a selectively recomputed block keeps of its attention core the inputs alone."""
    import torch

    from harness.models.transformer import build_layer
    from harness.plan.activations import attention_core_bytes, saved_bytes
    from harness.plan.layers import describe
    from harness.profile.memory import activation_bytes

    kv = f"kv_heads = {kv_heads}\n" if kv_heads else ""
    spec = _spec(name=family, micro=2, model=f"dropout = {dropout}\n{kv}", recompute=recompute)
    micro, seq, hidden = 2, spec.model.seq_len, spec.model.hidden
    options = dict(attention="math", mask_bytes=spec.model.dtype_bytes)
    inputs = {"embedding": lambda: torch.randint(0, spec.model.vocab, (micro, seq)),
              "block": lambda: torch.randn(micro, seq, hidden, requires_grad=True)}
    for layer in describe(spec)[:2]:  # the embedding and a block
        torch.manual_seed(0)
        module = build_layer(spec.model, layer.kind, selective=recompute == "selective")
        measured = activation_bytes(module, inputs[layer.kind], lambda m, x: m(x))
        assert measured == saved_bytes(spec, layer, micro, seq, **options), (layer.kind, family, dropout, recompute)
    if recompute == "selective" and not dropout:  # what the core saved without selective recompute: its re-made
        whole = build_layer(spec.model, "block")
        measured_whole = activation_bytes(whole, inputs["block"], lambda m, x: m(x))
        assert measured_whole - measured == attention_core_bytes(spec, describe(spec)[1], micro, seq) > 0


# ---- the memory model ---------------------------------------------------------------------------------------------

def _memory(**kwargs):
    from analysis.memory import estimate_memory
    from harness.plan.activations import formula_activation_bytes, formula_released_bytes
    from harness.plan.events import build_plan

    spec = _spec(global_batch=8, micro=8, seq=128, **kwargs)
    plan = build_plan(spec)
    activations = formula_activation_bytes(plan)
    return spec, plan, activations, estimate_memory(plan, activations, formula_released_bytes(plan)).stages[0]


def test_partial_recompute_keeps_what_megatron_keeps():
    """One micro-batch of 8 x 128 tokens, pp 1, 4 blocks. The metered peak (what saved-tensor hooks see: no re-made
    activations, no temporaries) is the after-forward moment: uniform chunks of 2 keep 2 blocks' inputs where
    chunks of 1 keep 4; block 2 keeps blocks 1 and 2's inputs and blocks 3 and 4's saves. A chunk's backward
    re-makes both blocks'."""
    from harness.plan.layers import input_bytes

    spec, plan, activations, every = _memory(recompute="full")
    _, _, _, chunks = _memory(recompute="full", strategy="recompute_layers = 2\n")
    _, _, _, first = _memory(recompute="full", strategy="recompute_layers = 2\nrecompute_method = \"block\"\n")
    kept_input = input_bytes(spec, plan.layers, 1)
    block_saves = activations[plan.stages[0].forward[plan.stages[0].forward_layers.index(1)]]
    assert every.metered - chunks.metered == 2 * kept_input
    assert first.metered - every.metered == 2 * (block_saves - kept_input)
    assert chunks.remade == 2 * block_saves and every.remade == block_saves


def test_selective_recompute_saves_no_attention_core_and_remakes_it_in_the_backward():
    from harness.plan.activations import attention_core_bytes

    _, _, _, whole = _memory()
    spec, plan, activations, selective = _memory(recompute="selective")
    core = attention_core_bytes(spec, plan.layers[1], spec.batch.micro, spec.model.seq_len)
    assert core > 0
    assert whole.metered - selective.metered == 4 * core  # every block's, one micro-batch in flight
    assert selective.temporaries >= core


def test_dropout_masks_are_memory():
    from harness.plan.activations import MASK_BYTES

    _, _, _, plain = _memory()
    spec, _, _, dropped = _memory(model="dropout = 0.1\n")
    tokens, hidden = spec.batch.micro * spec.model.seq_len, spec.model.hidden
    # two masks a block (4 blocks) and one after the embedding, a bool each in the formulas' default
    assert dropped.metered - plain.metered == (2 * 4 + 1) * tokens * hidden * MASK_BYTES


# ---- the search ---------------------------------------------------------------------------------------------------

def test_search_grid_takes_the_new_recompute_values():
    from harness.plan.candidates import candidate_label, expand

    spec = loads_spec(_text(recompute="full", strategy="recompute_layers = 2\n")
                      + '[search]\nrecompute = ["none", "selective", "full"]\n')
    grid = expand(spec)
    assert [c.strategy.recompute for c in grid.candidates] == ["none", "selective", "full"]
    assert [c.strategy.recompute_layers for c in grid.candidates] == [1, 1, 2]
    assert candidate_label(grid.candidates[2]).endswith("recompute=full uniform:2")
    with pytest.raises(SpecError, match=r"\[search.recompute\]"):
        loads_spec(_text() + '[search]\nrecompute = ["partial"]\n')


# ---- harness train on 2 ranks ---------------------------------------------------------------------------------------

def _train(text: str, rundir, seed: int = 0):
    from mpi4py import MPI

    from harness.train.runner import run_training

    comm = MPI.COMM_WORLD
    spec = loads_spec(text)
    result = run_training(spec, comm, rundir, 3, 1, seed=seed, timeout_s=120)
    return spec, comm.bcast(np.asarray(result.losses) if comm.Get_rank() == 0 else None, root=0)


def _shared(tmp_path):
    """The rank 0's folder for every rank; the jobs here are 2-rank jobs (tp = 2 or pp = 2), so another world size
    skips (pytest-mpi 0.6 has no max_size)."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() != 2:
        pytest.skip(f"a 2-rank job does not fit {MPI.COMM_WORLD.Get_size()} ranks")
    return MPI.COMM_WORLD.bcast(str(tmp_path) if MPI.COMM_WORLD.Get_rank() == 0 else None, root=0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)])
def test_training_with_dropout_is_seeded_and_recompute_keeps_its_masks(tmp_path, layout):
    """Dropout 0.1 on 2 ranks: finite losses, the same for the same seed, another for another seed; recompute
    (selective, and full in chunks of 2 blocks) runs the forward again with the masks it drew, so the losses are
    the run's without recompute."""
    shared = _shared(tmp_path)
    base = dict(model="dropout = 0.1\n", layers=4, **layout)
    _, plain = _train(_text(**base), f"{shared}/plain")
    _, again = _train(_text(**base), f"{shared}/again")
    _, other = _train(_text(**base), f"{shared}/other", seed=1)
    _, selective = _train(_text(recompute="selective", **base), f"{shared}/selective")
    _, chunks = _train(_text(recompute="full", strategy="recompute_layers = 2\n", **base), f"{shared}/chunks")
    assert np.all(np.isfinite(plain)) and len(plain) == 3
    np.testing.assert_array_equal(plain, again)
    assert not np.allclose(plain, other)
    np.testing.assert_allclose(selective, plain, rtol=1e-6)
    np.testing.assert_allclose(chunks, plain, rtol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_training_without_dropout_is_as_before(tmp_path):
    """dropout = 0 named in the spec runs what a spec without it runs: the same losses, bit for bit, and the
    single-process reference's."""
    from harness.train.model import reference_losses

    shared = _shared(tmp_path)
    spec, named = _train(_text(model="dropout = 0.0\n", pp=2), f"{shared}/named")
    _, plain = _train(_text(pp=2), f"{shared}/plain")
    np.testing.assert_array_equal(named, plain)
    np.testing.assert_allclose(plain, reference_losses(spec, 3), rtol=1e-3)

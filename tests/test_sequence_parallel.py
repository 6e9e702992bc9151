"""Sequence parallelism ([strategy] sp, Megatron-LM's, Korthikanti et al. 2022): the plan's all-gathers and
reduce-scatters in place of the tensor-parallel all-reduces, the pipeline's and replicated gradients' bytes, the
spec's rules, the activations it saves against Korthikanti et al.'s formula, and (under mpirun) the shards' loss
and gradients against the whole layers'."""
from __future__ import annotations

import subprocess
import sys

import pytest

from harness.common.errors import SpecError
from harness.plan.events import build_plan
from harness.plan.layers import SEQ_ALLGATHER, SEQ_REDUCESCATTER, replicated_params
from harness.plan.spec import loads_spec
from tests.helpers import tiny_spec_text

MICRO, SEQ, HIDDEN, VOCAB = 2, 16, 32, 1024


def _spec(tp: int = 2, pp: int = 1, sp: bool = True, name: str = "gpt2-small", seq: int = SEQ,
          strategy: str = "", dtype: str = "float32", hidden: int = HIDDEN, recompute: str = "none"):
    text = tiny_spec_text(name=name, tp=tp, pp=pp, layers=4, hidden=hidden, heads=4, ffn=4 * hidden, seq=seq,
                          vocab=VOCAB, micro=MICRO, global_batch=4 * MICRO, recompute=recompute)
    text = text.replace("[strategy]\n", f"[strategy]\nsp = {str(sp).lower()}\n{strategy}")
    return loads_spec(text.replace('dtype = "float32"', f'dtype = "{dtype}"'))


def _items(plan, kind: str, pass_: str) -> list[tuple[str, int]]:
    """The first `kind` layer's forward or backward: (its compute, then its collectives as (kind, bytes))."""
    for program in plan.stages:
        items = list(zip(program.forward, program.forward_layers) if pass_ == "fwd"
                     else zip(program.backward, program.backward_layers))
        for i, (_, index) in enumerate(items):
            if index >= 0 and plan.layers[index].kind == kind:
                out = [("compute", 0)]
                for other, other_index in items[i + 1:]:
                    if other_index >= 0:
                        break
                    out.append((plan.events[other].kind, plan.events[other].bytes))
                return out
    raise AssertionError(f"no {kind} in the plan")


@pytest.mark.parametrize("tp", [2, 4])
def test_each_all_reduce_becomes_an_all_gather_and_a_reduce_scatter(tp):
    plan = build_plan(_spec(tp=tp))
    whole = MICRO * SEQ * HIDDEN * 4  # the whole array's bytes, as nccl-tests counts a gather or scatter
    ag, rs = ("allgather", whole), ("reducescatter", whole)
    assert _items(plan, "block", "fwd") == [("compute", 0), ag, rs, ag, rs]
    # per half: the output gradient gathered, the column linear's input gradient scattered, its input gathered again
    assert _items(plan, "block", "bwd") == [("compute", 0), ag, rs, ag, ag, rs, ag]
    assert _items(plan, "embedding", "fwd") == [("compute", 0), rs]
    assert _items(plan, "embedding", "bwd") == [("compute", 0), ag]
    tokens = MICRO * SEQ
    assert _items(plan, "head", "fwd") == [("compute", 0), ag, ("allreduce", 4 * tokens), ("allreduce", 8 * tokens)]
    assert _items(plan, "head", "bwd") == [("compute", 0), rs]
    assert all(plan.events[e].group_size == tp for e in plan.stages[0].tp_events.values())
    assert set(plan.stages[0].tp_events) >= {SEQ_ALLGATHER, SEQ_REDUCESCATTER}
    # the same compute as plain tensor parallelism: only the blocks' signatures say sp
    plain = build_plan(_spec(tp=tp, sp=False))
    assert [layer.fwd_flops(MICRO, SEQ) for layer in plan.layers] == [
        layer.fwd_flops(MICRO, SEQ) for layer in plain.layers]
    assert all(dict(layer.signature).get("sp") for layer in plan.layers)
    assert not any(dict(layer.signature).get("sp") for layer in plain.layers)


def test_the_pipeline_sends_a_sequence_shard_and_replicated_gradients_are_all_reduced():
    plan = build_plan(_spec(tp=2, pp=2))
    plain = build_plan(_spec(tp=2, pp=2, sp=False))
    send = plan.events[plan.stages[0].send_forward]
    assert send.bytes * 2 == plain.events[plain.stages[0].send_forward].bytes == MICRO * SEQ * HIDDEN * 4
    model = plan.spec.model
    for program in plan.stages:
        layers = [plan.layers[i] for i in program.layers]
        event = plan.events[program.sequence_grads]
        assert (event.kind, event.group_size) == ("allreduce", 2)
        assert event.bytes == sum(replicated_params(model, layer.kind) for layer in layers) * 4
    # GPT-2: a block's two LayerNorms and two row-parallel biases; the positions; the head's final LayerNorm
    assert replicated_params(model, "block") == 6 * HIDDEN
    assert replicated_params(model, "embedding") == SEQ * HIDDEN
    assert replicated_params(model, "head") == 2 * HIDDEN
    assert all(program.sequence_grads is None for program in plain.stages)
    flow = [(plan.events[e].name, phase) for e, phase, _, _ in plan.device_flow(0)]
    assert flow[-2][1] == "tp" and flow[-1][1] == "opt", "the replicated gradients before the optimizer step"


def test_recompute_runs_a_blocks_forward_collectives_again():
    plan = build_plan(_spec(tp=2, recompute="full"))
    plain = build_plan(_spec(tp=2))
    gather = plan.stages[0].tp_events[SEQ_ALLGATHER]
    # 4 blocks x (2 forward + 4 backward) + the embedding's backward + the head's forward, per micro-batch, on
    # one tp group; recompute adds each block's 2 forward gathers again
    micro_batches = plan.spec.micro_batches
    assert plain.multiplicity[gather] == micro_batches * (4 * 6 + 2)
    assert plan.multiplicity[gather] == micro_batches * (4 * 8 + 2)


@pytest.mark.parametrize("strategy, seq, field, words", [
    ("", SEQ, "strategy.sp", "tp = 1 has none"),
    ("vocab_parallel = false\n", SEQ, "strategy.sp", "vocab_parallel = true"),
    ("", 18, "model.seq_len", "divisible by tp (4)"),
])
def test_sequence_parallelism_that_cannot_run_is_refused(strategy, seq, field, words):
    tp = 1 if "tp = 1" in words else 4
    with pytest.raises(SpecError) as info:
        _spec(tp=tp, seq=seq, strategy=strategy)
    assert f"[{field}]" in str(info.value) and words in str(info.value)


def test_the_command_line_refuses_sp_without_tp_with_exit_2(tmp_path, project_env):
    path = tmp_path / "job.toml"
    path.write_text(tiny_spec_text().replace("[strategy]\n", "[strategy]\nsp = true\n"))
    result = subprocess.run([sys.executable, "-m", "harness", "events", str(path)], capture_output=True, text=True,
                            env=project_env, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "[strategy.sp]" in result.stderr and "set tp > 1, or sp = false" in result.stderr


@pytest.mark.parametrize("tp", [2, 4])
def test_the_saved_activations_shrink_as_korthikanti_et_al_write(tp):
    """Korthikanti et al. (2022), per layer: tp alone saves s b h (10 + 24 / t + 5 a s / (h t)) bytes in 16-bit,
    with sp s b h (34 / t + 5 a s / (h t)): sp divides the 10 s b h the tp ranks all held by t. Of those 10, 2 are
    dropout masks, which this tool's blocks do not have; the other 8 (both LayerNorms' inputs, the attention's and
    the MLP's input) must shrink by 8 s b h (1 - 1/t) bytes, within 5%, as profiled."""
    import torch

    from harness.models import build_layer
    from harness.profile.memory import activation_bytes

    b, s, h = 2, 64, 128
    saved = {}
    for sp in (False, True):
        spec = _spec(tp=tp, sp=sp, seq=s, hidden=h, dtype="bfloat16")
        block = build_layer(spec.model, "block", tp=tp, sp=sp)
        tokens = s // tp if sp else s
        saved[sp] = activation_bytes(
            block, lambda tokens=tokens: torch.randn(b, tokens, h, dtype=torch.bfloat16, requires_grad=True),
            lambda m, x: m(x))
    formula = 8 * s * b * h * (1 - 1 / tp)
    assert saved[False] - saved[True] == pytest.approx(formula, rel=0.05)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["gpt2-small", "bert-base", "llama-1b"])
def test_shards_loss_and_gradients_match_the_whole_layers(name):
    """Every rank of the world is one tp rank with sp (tp = the world size): the loss, the gradient of every
    parameter (a shard's: its part of the whole one's; a replicated one's once the group sums it) agree with the
    whole embedding's, block's and head's."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from harness.runtime.distributed import destroy_process_group, init_process_group
    from harness.train.model import build_full_layer, build_shard, replicated, shard_tensor
    from launcher.topology import discover

    comm = MPI.COMM_WORLD
    tp, rank = comm.Get_size(), comm.Get_rank()
    heads = 4 * tp
    text = tiny_spec_text(name=name, tp=tp, layers=1, hidden=8 * heads, heads=heads, ffn=16 * heads, seq=4 * tp,
                          vocab=64 * tp, micro=MICRO, global_batch=MICRO)
    if name == "llama-1b":  # grouped-query attention
        text = text.replace("\nheads = ", f"\nkv_heads = {heads // 2}\nheads = ", 1)
    model = loads_spec(text.replace("[strategy]\n", "[strategy]\nsp = true\n")).model
    init_process_group(comm, discover(comm), torch.device("cpu"), timeout_s=120)
    try:
        group = dist.new_group(list(range(tp)))
        generator = torch.Generator().manual_seed(11)
        ids = torch.randint(0, model.vocab, (MICRO, model.seq_len), generator=generator)
        targets = torch.randint(0, model.vocab, (MICRO, model.seq_len), generator=generator)
        kinds = ("embedding", "block", "head")
        whole = [build_full_layer(model, kind, 5, position) for position, kind in enumerate(kinds)]
        shards = [build_shard(model, kind, 5, position, tp, rank, group, sp=True)
                  for position, kind in enumerate(kinds)]
        losses = []
        for layers in (whole, shards):
            x = ids
            for layer in layers[:-1]:
                x = layer(x)
            loss = layers[-1].loss(layers[-1](x), targets)
            loss.backward()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
        for full_module, shard_module in zip(whole, shards):
            full_params = dict(full_module.named_parameters())
            for param_name, param in shard_module.named_parameters():
                grad = param.grad
                if replicated(param_name, model):
                    grad = grad.clone()
                    dist.all_reduce(grad, group=group)
                expected = shard_tensor(param_name, full_params[param_name].grad, model, tp, rank)
                torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=param_name)
    finally:
        destroy_process_group()

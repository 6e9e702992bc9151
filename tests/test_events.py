"""Events and de-duplication: counts against hand-computed cases, stable ids, collapsing rules."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from harness.common.errors import SpecError, UserError
from harness.plan.events import build_plan
from harness.plan.layers import describe_builtin
from harness.plan.schedules import Step, device_steps
from harness.plan.spec import loads_spec
from tests.helpers import tiny_spec_text


def plan_of(**kwargs):
    return build_plan(loads_spec(tiny_spec_text(**kwargs)))


def test_hand_computed_pp2_m4_1f1b_dp2():
    # 4 blocks over pp=2 (2 per stage), dp=2, 4 micro-batches, one node of 4 devices.
    plan = plan_of(layers=4, pp=2, dp=2, global_batch=16, micro=2, schedule="1f1b")
    assert plan.spec.micro_batches == 4
    kinds = plan.summary()["by_kind"]
    # compute: (emb 8 + blocks 32 + head 8) x (fwd, bwd) + one optimizer step per device (2 per stage), each
    # stage's its own event (embedding and 2 blocks, 2 blocks and head)
    assert kinds["compute"] == {"unique": 8, "total": 2 * (8 + 32 + 8) + 4}
    # P2P: 2 pairs x 4 micro-batches x (activation, gradient); both directions carry the same bytes: one event
    assert kinds["p2p"] == {"unique": 1, "total": 16}
    # one gradient bucket per stage (tiny model), one data-parallel group per stage
    assert kinds["allreduce"] == {"unique": 2, "total": 2}
    assert plan.total_events == 100 + 16 + 2
    assert sum(plan.multiplicity.values()) == plan.total_events
    assert plan.summary()["dedup_ratio"] == pytest.approx(118 / 11)
    names = [plan.events[eid].name for program in plan.stages for eid in program.optimizer]
    assert names == ["optimizer(gpt2.embedding, 2x gpt2.block)", "optimizer(2x gpt2.block, gpt2.head)"]


def test_tensor_parallel_collectives_counted_per_group_call():
    plan = plan_of(layers=2, tp=2, global_batch=4, micro=2)  # m = 2, one TP group
    tp_events = sorted((e for e in plan.events.values() if e.kind == "allreduce"), key=lambda e: -e.bytes)
    assert len(tp_events) == 3 and {e.group_size for e in tp_events} == {2} and {e.placement for e in tp_events} == \
        {"intra"}
    # hidden-sized: 2 blocks x (2 forward + 2 backward), the embedding's forward and the head's backward, x 2
    # micro-batches x 1 group; the vocabulary-parallel loss's two, once a forward
    assert [plan.multiplicity[e.id] for e in tp_events] == [20, 2, 2]


def test_flows_of_all_devices_add_up_to_the_totals():
    plan = plan_of(layers=4, pp=2, dp=2, tp=2, global_batch=16, micro=2, nodes=2, gpus_per_node=4)
    per_kind = Counter()
    for rank in range(plan.spec.strategy.world):
        for eid, phase, _, _ in plan.device_flow(rank):
            kind = plan.events[eid].kind
            if phase == "recv":
                continue  # each transfer counts once, at its send
            per_kind[kind] += 1
    s = plan.spec.strategy
    totals = {k: v["total"] for k, v in plan.summary()["by_kind"].items()}
    assert per_kind["compute"] == totals["compute"]
    assert per_kind["p2p"] == totals["p2p"]
    # a collective is one group call but every member's flow lists it
    tp_calls = sum(n for eid, n in plan.multiplicity.items() if plan.events[eid].content.get("group") == s.tp)
    dp_calls = totals["allreduce"] - tp_calls
    assert per_kind["allreduce"] == tp_calls * s.tp + dp_calls * s.dp


def test_inter_node_placement_of_pipeline_pairs():
    # tp=2 x dp=2 fill a node of 4: pipeline neighbours (4 ranks apart) sit on different nodes.
    plan = plan_of(layers=4, pp=2, dp=2, tp=2, global_batch=16, micro=2, nodes=2, gpus_per_node=4)
    p2p = [e for e in plan.events.values() if e.kind == "p2p"]
    assert [e.placement for e in p2p] == ["inter"]
    dp = [e for e in plan.events.values() if e.kind == "allreduce" and e.group_size == 2 and e.bytes > 20000]
    assert dp and all(e.placement == "intra" for e in dp)


def test_identical_layers_collapse_and_different_shapes_do_not():
    small = plan_of(layers=8, micro=2, global_batch=4)
    assert len([e for e in small.events.values() if e.name == "gpt2.block.fwd"]) == 1
    other = plan_of(layers=8, micro=1, global_batch=4)
    ids_small = {e.id for e in small.events.values() if e.kind == "compute" and "optimizer" not in e.name}
    ids_other = {e.id for e in other.events.values() if e.kind == "compute" and "optimizer" not in e.name}
    assert not ids_small & ids_other
    # the optimizer step does not depend on the micro-batch: the same event
    opt = lambda p: {e.id for e in p.events.values() if "optimizer" in e.name}  # noqa: E731
    assert opt(small) == opt(other)


def test_ids_stable_across_processes(project_env):
    code = ("from harness.plan.events import build_plan; from harness.plan.spec import loads_spec; "
            "from tests.helpers import tiny_spec_text; import json; "
            "print(json.dumps(sorted(build_plan(loads_spec(tiny_spec_text(layers=4, pp=2, dp=2, global_batch=16)))"
            ".events)))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=project_env,
                           check=True).stdout for _ in range(2)]
    here = sorted(plan_of(layers=4, pp=2, dp=2, global_batch=16).events)
    assert json.loads(runs[0]) == json.loads(runs[1]) == here


def test_sixteen_thousand_devices_are_not_materialised():
    text = tiny_spec_text(layers=96, hidden=12288, heads=96, ffn=49152, seq=2048, vocab=51200, dp=256, tp=8, pp=8,
                          global_batch=16384, micro=1, nodes=2048, gpus_per_node=8)
    plan = build_plan(loads_spec(text))
    assert plan.spec.micro_batches == 64
    assert plan.unique_events < 20
    assert plan.total_events > 3e7  # tens of millions of events, never a list of them


def test_a_factory_model_needs_its_layers_handed_to_the_plan():
    """The plan stays pure: it never traces a factory model itself."""
    text = tiny_spec_text(layers=4).replace('name = "gpt2-small"', 'factory = "tests.user_model:build"')
    with pytest.raises(UserError, match="factory model"):
        build_plan(loads_spec(text))


def test_a_factory_that_returns_no_layers_is_refused():
    from harness.models.user import factory_layers

    text = tiny_spec_text(layers=4).replace('name = "gpt2-small"', 'factory = "tests.user_model:not_layers"')
    with pytest.raises(UserError, match="must return a non-empty sequence of torch.nn.Module, got int"):
        factory_layers(loads_spec(text))


def test_a_factory_that_exits_is_refused_with_a_message():
    """sys.exit in a factory is a SystemExit, not an Exception: it would end the run with status 0 and no word."""
    from harness.models.user import factory_layers

    text = tiny_spec_text(layers=4).replace('name = "gpt2-small"', 'factory = "tests.user_model:exits"')
    with pytest.raises(UserError, match=r"called sys.exit\(0\); return the layers instead"):
        factory_layers(loads_spec(text))


def test_user_factory_model_events():
    from harness.models.user import factory_layers

    text = tiny_spec_text(layers=4, pp=2, global_batch=4).replace('name = "gpt2-small"',
                                                                     'factory = "tests.user_model:build"')
    spec = loads_spec(text)
    plan = build_plan(spec, factory_layers(spec))
    fwd = [e for e in plan.events.values() if e.name.endswith(".fwd")]
    assert len(fwd) == 3  # embedding, one mixer for both identical mixers, projection
    assert {s.virtual_stage: len(s.layers) for s in plan.stages} == {0: 2, 1: 2}


def test_param_counts_match_the_torch_models():


    from harness.models import build_layer
    from harness.plan.spec import MODEL_PRESETS

    for name in ("gpt2-small", "bert-base", "llama-1b"):
        spec = loads_spec(tiny_spec_text(name=name, layers=2, hidden=64, heads=16, ffn=96, tp=2, global_batch=4))
        for vocab_parallel in (True, False):
            layers = describe_builtin(spec.model, tp=2, vocab_parallel=vocab_parallel)
            for desc in (layers[0], layers[1], layers[-1]):
                module = build_layer(spec.model, desc.kind, tp=int(dict(desc.signature).get("tp", 1)))
                assert sum(p.numel() for p in module.parameters()) == desc.params, (name, desc.kind, vocab_parallel)
        assert MODEL_PRESETS[name]["family"] == spec.model.family


def test_one_f_one_b_order():
    assert device_steps("1f1b", 0, 2, 4) == [Step("F", 0, 0), Step("F", 0, 1), Step("B", 0, 0), Step("F", 0, 2),
                                             Step("B", 0, 1), Step("F", 0, 3), Step("B", 0, 2), Step("B", 0, 3)]
    assert device_steps("1f1b", 1, 2, 2) == [Step("F", 0, 0), Step("B", 0, 0), Step("F", 0, 1), Step("B", 0, 1)]


@pytest.mark.parametrize("schedule, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                              ("interleaved-1f1b", 3)])
@pytest.mark.parametrize("pp, m", [(1, 3), (2, 4), (4, 8)])
def test_every_schedule_runs_each_step_once_forward_first(schedule, chunks, pp, m):
    for stage in range(pp):
        steps = device_steps(schedule, stage, pp, m, chunks)
        assert sorted(steps) == sorted(Step(ph, c, i) for ph in "FB" for c in range(chunks) for i in range(m))
        for c in range(chunks):
            for i in range(m):
                assert steps.index(Step("F", c, i)) < steps.index(Step("B", c, i))


def test_user_model_pipeline_transfers_carry_the_stage_output():
    from harness.models.user import factory_layers

    text = tiny_spec_text(layers=4, pp=2, global_batch=4, micro=2, seq=16).replace('name = "gpt2-small"',
                                                                                   'factory = "tests.user_model:build"')
    spec = loads_spec(text)
    plan = build_plan(spec, factory_layers(spec))
    (p2p,) = [e for e in plan.events.values() if e.kind == "p2p"]
    assert p2p.bytes == 2 * 16 * 32 * 4  # micro x seq x width (the factory's default 32) x float32


def test_byte_sizes_keep_three_significant_digits():
    from harness.plan.events import human_bytes

    assert [human_bytes(n) for n in (512, 1536, 65536, 1321472, 1353216)] == \
        ["512B", "1.5KiB", "64KiB", "1.26MiB", "1.29MiB"]  # two gradient buckets keep apart
    assert human_bytes(1023692) == "1000KiB"  # 999.7 KiB: never "1e+03KiB"
    assert human_bytes(5 * 2**40) == "5120GiB"


def test_an_optimizer_step_names_its_optimizer_unless_it_is_adam():
    """Adam, the default, adds nothing to an optimizer step's content (profiles of Adam jobs keep their ids);
    SGD's steps are events of their own."""
    adam = build_plan(loads_spec(tiny_spec_text()))
    sgd = build_plan(loads_spec(tiny_spec_text() + '[optimizer]\nname = "sgd"\nmomentum = 0.5\n'))
    steps = lambda plan: {e.id: e.content for e in plan.events.values() if e.content.get("phase") == "optimizer"}  # noqa: E731
    assert all("optimizer" not in c for c in steps(adam).values())
    assert all(c["optimizer"] == "sgd" and c["momentum"] == 0.5 for c in steps(sgd).values())
    assert not set(steps(adam)) & set(steps(sgd))
    assert set(adam.events) - set(steps(adam)) == set(sgd.events) - set(steps(sgd))  # the rest is the same


def test_harness_train_refuses_master_weights():
    from harness.common.errors import UserError
    from harness.train.runner import check_run

    spec = loads_spec(tiny_spec_text().replace('dtype = "float32"', 'dtype = "bfloat16"')
                      + "[optimizer]\nmaster_weights = true\n")
    with pytest.raises(UserError, match="master_weights = true is for the memory model only"):
        check_run(spec, 1, 3, 1)


def test_one_devices_flow_through_the_command(tmp_path, capsys):
    """`harness events SPEC --device RANK`: the rank is a number, not a file the registry checks."""
    from harness.commands.cli import main as harness_main
    from tests.helpers import tiny_spec_text

    spec = tmp_path / "job.toml"
    spec.write_text(tiny_spec_text(dp=2, layers=2, micro=1, global_batch=2))
    assert harness_main(["events", str(spec), "--device", "1"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_harness_train_refuses_the_fused_gradient_accumulation():
    from harness.common.errors import UserError
    from harness.train.runner import check_run

    spec = loads_spec(tiny_spec_text().replace("[cluster]", "grad_accumulation_fusion = true\n[cluster]"))
    with pytest.raises(UserError, match="grad_accumulation_fusion = true is Megatron-LM's fused"):
        check_run(spec, 1, 3, 1)


def test_float32_gradient_reductions_carry_four_bytes_an_element():
    """Megatron's main gradients of bf16 weights (master weights; reduce_dtype's default then, float32): the
    data-parallel buckets, the tied embedding's and sequence parallelism's all-reduces carry twice the bytes of
    reduce_dtype = "bfloat16"; the activations, the tensor-parallel and pipeline transfers do not change."""
    def plan(reduce: str) -> dict:
        text = tiny_spec_text(dp=2, tp=2, pp=2, global_batch=8).replace(
            'dtype = "float32"', 'dtype = "bfloat16"\ntie_embeddings = true')
        text = text.replace("[cluster]", "sp = true\ndp_overlap = false\n[cluster]")
        spec = loads_spec(text + "[optimizer]\nmaster_weights = true\n" + reduce)
        built = build_plan(spec)
        reductions = [b.event for s in built.stages for b in s.buckets]
        reductions += [e for s in built.stages for e in (s.tie, s.sequence_grads) if e not in reductions]
        assert built.stages[0].tie and built.stages[0].sequence_grads
        return {"reductions": [(built.events[e].content["bytes"], built.events[e].content["dtype"])
                               for e in reductions],
                "other": sorted(e for e in built.events if e not in reductions
                                and built.events[e].kind != "compute")}

    model, fp32 = plan('reduce_dtype = "bfloat16"\n'), plan("")
    assert fp32 == plan('reduce_dtype = "float32"\n')
    assert [(2 * nbytes, "float32") for nbytes, _ in model["reductions"]] == fp32["reductions"]
    assert all(dtype == "bfloat16" for _, dtype in model["reductions"])
    assert model["other"] == fp32["other"]


@pytest.mark.parametrize("dtype,extra,words", [
    ("bfloat16", 'reduce_dtype = "float32"\n', "master_weights = true keeps float32 main gradients"),
    ("float16", 'master_weights = true\nreduce_dtype = "bfloat16"\n', "got 'bfloat16'"),
    ("float32", 'reduce_dtype = "float64"\n', "unknown value 'float64'")])
def test_a_reduce_dtype_that_is_not_the_models_or_megatrons_is_refused(dtype, extra, words):
    text = tiny_spec_text().replace('dtype = "float32"', f'dtype = "{dtype}"') + "[optimizer]\n" + extra
    with pytest.raises(SpecError, match=words) as caught:
        loads_spec(text)
    assert caught.value.field == "optimizer.reduce_dtype"


def test_a_reduce_dtype_round_trips_and_the_models_own_is_left_unwritten():
    text = tiny_spec_text().replace('dtype = "float32"', 'dtype = "bfloat16"') + "[optimizer]\nmaster_weights = true\n"
    plain = loads_spec(text)  # Megatron's default for bf16 weights
    assert (plain.reduce_dtype, plain.reduce_bytes) == ("float32", 4) and "reduce_dtype" not in plain.to_toml()
    fp16 = loads_spec(text.replace('dtype = "bfloat16"', 'dtype = "float16"'))
    assert fp16.reduce_dtype == "float16"  # and for fp16 ones
    bf16 = loads_spec(text + 'reduce_dtype = "bfloat16"\n')
    assert (bf16.reduce_dtype, bf16.reduce_bytes) == ("bfloat16", 2)
    assert loads_spec(bf16.to_toml()) == bf16 and loads_spec(plain.to_toml()) == plain
    assert loads_spec(tiny_spec_text()).reduce_dtype == "float32"  # a float32 model's own


def test_a_zero_reduce_scatter_carries_the_reduce_dtype_and_its_all_gather_the_weights():
    def collectives(reduce: str) -> dict:
        text = tiny_spec_text(dp=2, zero=1).replace('dtype = "float32"', 'dtype = "bfloat16"')
        built = build_plan(loads_spec(text + "[optimizer]\nmaster_weights = true\n" + reduce))
        return {kind: sorted((e.content["bytes"], e.content["dtype"]) for e in built.events.values()
                             if e.kind == kind) for kind in ("allgather", "reducescatter")}

    model, fp32 = collectives('reduce_dtype = "bfloat16"\n'), collectives("")
    assert model["allgather"] == fp32["allgather"] and model["reducescatter"]
    assert fp32["reducescatter"] == [(2 * nbytes, "float32") for nbytes, _ in model["reducescatter"]]

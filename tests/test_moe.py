"""Mixture-of-Experts jobs ([model] experts, [strategy] ep): the router's token counts under each routing, the
spec's rules (exit 2), the presets against their published sizes, and the plan of a MoE block: its slowest ep
rank's compute, its all-to-alls, the experts out of the data-parallel buckets, a mixed dense and MoE stack."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.common.errors import SpecError
from harness.plan.events import build_plan
from harness.plan.layers import EP_COMBINE, EP_COMBINE_GRAD, EP_DISPATCH, EP_DISPATCH_GRAD, describe, moe_load
from harness.plan.routing import expert_counts, expert_shares, rank_tokens, route_table
from harness.plan.spec import loads_spec
from tests.helpers import tiny_spec_text

MICRO, SEQ, HIDDEN = 2, 16, 32
TOKENS = MICRO * SEQ


def _spec(moe: str = "experts = 4\ntop_k = 2\nexpert_ffn = 48\n", ep: int = 2, dp: int = 2, extra: str = "",
          name: str = "gpt2-small", layers: int = 4, **kwargs):
    text = tiny_spec_text(name=name, dp=dp, layers=layers, hidden=HIDDEN, heads=4, ffn=64, seq=SEQ, vocab=128,
                          micro=MICRO, global_batch=4 * MICRO * dp, **kwargs)
    text = text.replace("[model]\n", f"[model]\n{moe}", 1)
    return loads_spec(text.replace("[strategy]\n", f"[strategy]\nep = {ep}\n{extra}"))


# ---- the router ----------------------------------------------------------------------------------------------
def test_token_counts_per_routing_are_pinned():
    assert expert_counts(expert_shares("uniform", 4), TOKENS, 2) == (16, 16, 16, 16)
    # zipf:1.2 over 4 experts: shares 0.53, 0.23, 0.14, 0.10 of 64 assignments; an expert takes a token once, so
    # expert 0 stops at 32 and its excess goes to the others by their shares
    assert expert_counts(expert_shares("zipf:1.2", 4), TOKENS, 2) == (32, 15, 10, 7)
    # a capacity factor of 1.0 drops what an expert cannot take (16 each), it does not reroute it
    assert expert_counts(expert_shares("zipf:1.2", 4), TOKENS, 2, 1.0) == (16, 15, 10, 7)
    assert expert_counts(expert_shares("file", 3, ((1.0, 0.0, 3.0),)), 8, 1) == (2, 0, 6)
    assert rank_tokens((32, 15, 10, 7), 2) == (47, 17) and rank_tokens((32, 15, 10, 7), 4) == (32, 15, 10, 7)


@pytest.mark.parametrize("routing, capacity", [("uniform", 0.0), ("zipf:1.2", 0.0), ("zipf:2.0", 1.25),
                                               ("zipf:0.5", 0.0)])
def test_the_route_table_meets_the_counts_with_distinct_experts(routing, capacity):
    counts = expert_counts(expert_shares(routing, 8), TOKENS, 3, capacity)
    table = route_table(counts, TOKENS, 3)
    assert len(table) == TOKENS and all(len(set(t)) == len(t) <= 3 for t in table)
    assert tuple(sum(e in t for t in table) for e in range(8)) == counts


def test_each_ep_ranks_load_and_the_slowest_one_set_the_blocks_cost():
    spec = _spec(moe='experts = 4\ntop_k = 2\nexpert_ffn = 48\nrouting = "zipf:1.2"\n')
    counts, per_rank = moe_load(spec.model, 2, TOKENS, 0)
    assert per_rank == (47, 17)
    block = describe(spec)[1]
    signature = dict(block.signature)
    # rank 0 is the slowest: its experts 0 and 1 get 32 and 15 tokens from each of the 2 ranks
    assert (signature["ep_rank"], signature["received"]) == (0, "(64, 30)")
    assert block.ep_forward == ((EP_DISPATCH, 2 * 47 * HIDDEN * 4, "float32"), (EP_COMBINE, 2 * 47 * HIDDEN * 4,
                                                                                  "float32"))
    assert [n for n, _, _ in block.ep_backward] == [EP_COMBINE_GRAD, EP_DISPATCH_GRAD]
    uniform = dict(describe(_spec())[1].signature)
    assert uniform["received"] == "(32, 32)"


# ---- the spec's rules ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("moe, ep, dp, extra, field, words", [
    ("experts = 4\n", 3, 3, "", "strategy.ep", "must divide the experts"),
    ("experts = 4\n", 4, 2, "", "strategy.ep", "must divide dp"),
    ("", 2, 2, "", "strategy.ep", "the model has none"),
    ("experts = 4\ntop_k = 5\n", 1, 2, "", "model.top_k", "between 1 and 4"),
    ("experts = 4\ntop_k = 0\n", 1, 2, "", "model.top_k", "must be >= 1"),
    ("experts = 4\ncapacity_factor = -1\n", 1, 2, "", "model.capacity_factor", "0 or more"),
    ('experts = 4\nrouting = "zipf:0"\n', 1, 2, "", "model.routing", "S > 0"),
    ('experts = 4\nrouting = "zipf:-1"\n', 1, 2, "", "model.routing", "S > 0"),
    ('experts = 4\nrouting = "lumpy"\n', 1, 2, "", "model.routing", "unknown routing"),
    ("top_k = 2\n", 1, 2, "", "model.top_k", "set experts > 0"),
    ("experts = 4\n", 1, 1, "", "strategy.tp", "not built"),
    ("experts = 4\n", 1, 2, "zero = 1\n", "strategy.zero", "not built"),
    ("experts = 4\nmoe_every = 5\n", 1, 2, "", "model.moe_every", "none would be"),
    ("experts = 4\nexpert_histogram = [[1, 1, 1, 1]]\n", 1, 2, "", "model.expert_histogram", "file:PATH"),
])
def test_mixture_of_experts_that_cannot_run_is_refused(moe, ep, dp, extra, field, words):
    tp = 2 if field == "strategy.tp" else 1
    with pytest.raises(SpecError) as info:
        _spec(moe=moe, ep=ep, dp=dp, extra=extra, tp=tp)
    assert f"[{field}]" in str(info.value) and words in str(info.value)


def test_a_routing_file_must_match_the_experts_and_layers(tmp_path):
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({"experts": 4, "layers": [[1, 2, 3, 4], [4, 3, 2, 1]]}))
    with pytest.raises(SpecError, match="4 MoE layers"):
        _spec(moe=f'experts = 4\nrouting = "file:{path}"\n')
    path.write_text(json.dumps({"experts": 8, "layers": [[1] * 8]}))
    with pytest.raises(SpecError, match="for 8 experts, the model has 4"):
        _spec(moe=f'experts = 4\nrouting = "file:{path}"\n')
    path.write_text(json.dumps({"experts": 4, "layers": [[1, 2, 3, 4], [4, 3, 2, 1]]}))
    spec = _spec(moe=f'experts = 4\nrouting = "file:{path}"\nmoe_every = 2\n')
    # the spec keeps the histogram: stored (a profile, a trace) it reads without the file
    path.unlink()
    again = loads_spec(spec.to_toml())
    assert again.model.expert_histogram == ((1.0, 2.0, 3.0, 4.0), (4.0, 3.0, 2.0, 1.0))
    blocks = [dict(layer.signature) for layer in describe(again)[1:-1]]
    assert [b.get("moe_layer") for b in blocks] == [None, 0, None, 1]


def test_the_command_line_refuses_a_bad_ep_with_exit_2(tmp_path, project_env):
    path = tmp_path / "job.toml"
    path.write_text(tiny_spec_text(dp=2).replace("[model]\n", "[model]\nexperts = 3\n")
                    .replace("[strategy]\n", "[strategy]\nep = 2\n"))
    result = subprocess.run([sys.executable, "-m", "harness", "events", str(path)], capture_output=True, text=True,
                            env=project_env, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "[strategy.ep] ep (2) must divide the experts (3)" in result.stderr


def test_the_presets_hold_their_published_parameter_counts():
    """Mixtral 8x7B: 46.7 B parameters (Jiang et al. 2024), all 8 experts of every block on one rank; DeepSeek-MoE
    16B's, less its dense first block."""
    text = tiny_spec_text(name="mixtral-8x7b").replace("layers = 4\nhidden = 32\nheads = 4\nffn = 64\nseq_len = 16\n"
                                                       "vocab = 128\n", "")
    mixtral = loads_spec(text.replace("[model]\n", "[model]\nseq_len = 4096\n"))
    total = sum(layer.params for layer in describe(mixtral))
    assert total == pytest.approx(46.7e9, rel=0.01)
    # DeepSeek-MoE 16B: 16.4 B (Dai et al. 2024), whose first block is dense; here every block is MoE, which adds
    # one MoE block's experts less a dense MLP's (about 0.5 B)
    deepseek = loads_spec(text.replace('name = "mixtral-8x7b"', 'name = "deepseek-moe-16b"'))
    assert (deepseek.model.experts, deepseek.model.top_k, deepseek.model.shared_experts) == (64, 6, 2)
    assert sum(layer.params for layer in describe(deepseek)) == pytest.approx(16.4e9 + 0.5e9, rel=0.01)


# ---- the plan ----------------------------------------------------------------------------------------------------
def _items(plan, index: int, pass_: str) -> list[tuple[str, int]]:
    program = plan.stages[0]
    items = list(zip(program.forward, program.forward_layers) if pass_ == "fwd"
                 else zip(program.backward, program.backward_layers))
    start = [i for i, (_, layer) in enumerate(items) if layer == index][0]
    out = [(plan.events[items[start][0]].kind, 0)]
    for eid, layer in items[start + 1:]:
        if layer >= 0:
            break
        out.append((plan.events[eid].kind, plan.events[eid].bytes))
    return out


def test_a_moe_block_dispatches_and_combines_and_a_dense_one_does_not():
    plan = build_plan(_spec(moe="experts = 4\ntop_k = 2\nexpert_ffn = 48\nmoe_every = 2\n"))
    message = 2 * 32 * HIDDEN * 4  # ep x the tokens a rank sends its busiest peer (32 of the uniform 64) x h x d
    assert _items(plan, 1, "fwd") == [("compute", 0)]  # block 1: dense
    assert _items(plan, 2, "fwd") == [("compute", 0), ("alltoall", message), ("alltoall", message)]
    assert _items(plan, 2, "bwd") == [("compute", 0), ("alltoall", message), ("alltoall", message)]
    dense, moe = plan.layers[1], plan.layers[2]
    assert moe.expert_params == 2 * (2 * HIDDEN * 48 + 48 + HIDDEN)  # 2 of the 4 experts on each ep rank
    assert moe.params - moe.expert_params == dense.params - (2 * HIDDEN * 64 + 64 + HIDDEN) + HIDDEN * 4
    # the buckets hold everything but the experts; with ep = dp no rank shares an expert: nothing more to reduce
    bucketed = sum(b.nbytes for b in plan.stages[0].buckets)
    assert bucketed == sum(layer.params - layer.expert_params for layer in plan.layers) * 4
    assert plan.stages[0].expert_grads is None


def test_experts_replicated_over_dp_ep_ranks_all_reduce_their_gradients():
    plan = build_plan(_spec(ep=1, dp=2))
    event = plan.events[plan.stages[0].expert_grads]
    assert (event.kind, event.group_size) == ("allreduce", 2)
    assert event.bytes == sum(layer.expert_params for layer in plan.layers) * 4
    assert [phase for _, phase, _, _ in plan.device_flow(0)][-2:] == ["ep", "opt"]


def test_moe_blocks_are_profiled_as_composites_on_ep_ranks():
    """Each MoE block's forward and backward also run with their all-to-alls on ep real ranks, every rank its own
    experts, so that the slowest rank and the ranks' skew are in the sample; a dense block has none."""
    from launcher.placement import place
    from launcher.topology import Topology

    plan = build_plan(_spec(moe="experts = 4\ntop_k = 2\nexpert_ffn = 48\nmoe_every = 2\n"))
    composites = place(plan.unique(), Topology(0, 2, (0, 0), ("a", "a"))).composites
    assert sorted((t.content["layer"], t.content["phase"], t.ranks, "experts" in t.content["signature"])
                  for t in composites) == [("block", "bwd", (0, 1), True), ("block", "fwd", (0, 1), True)]


def test_a_moe_preset_with_no_experts_is_its_dense_form():
    text = tiny_spec_text(name="mixtral-8x7b", layers=2, hidden=32, heads=4, ffn=64, seq=16, vocab=128)
    dense = loads_spec(text.replace("[model]\n", "[model]\nexperts = 0\nkv_heads = 4\n", 1))
    assert not dense.model.moe and "experts" not in dense.to_dict()["model"]

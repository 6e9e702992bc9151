"""In-context compute samples: stage chains, their measurement, the store round trip, the costs preferring them."""
from __future__ import annotations

import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from analysis.costs import estimate_costs
from analysis.costs.measured import rank_factor
from analysis.memory import _with_twins, activation_bytes, estimate_memory, released_bytes, temporary_bytes
from analysis.profile_reader import load_profile
from analysis.trace_reader import read_trace
from analysis.validate import layer_kind_ratios, validate
from bench.layer_kinds import pooled
from harness.plan.events import build_plan, composite_content, event_id, unwrapped_twin
from harness.plan.spec import loads_spec
from harness.profile import in_context
from harness.profile.in_context import MIN_ROUNDS, measure_chains, stage_chains
from harness.profile.run import chains_of_rank
from harness.store.hdf5_schema import IN_CONTEXT_SERIES
from tests.conftest import ROOT
from tests.helpers import mpirun_harness, tiny_spec_text

FIXTURE = ROOT / "tests" / "data" / "pp2-profile.h5"


def _plan(**kwargs):
    text = tiny_spec_text(layers=kwargs.pop("layers", 2), hidden=32, heads=4, ffn=64, seq=16, vocab=64, **kwargs)
    return build_plan(loads_spec(text))


def test_a_stage_chain_is_its_forwards_its_backwards_in_reverse_and_its_optimizer():
    plan = _plan()
    (chain,) = stage_chains([plan])
    names = lambda ids: [plan.events[e].name for e in ids]  # noqa: E731
    assert names(chain.forward) == ["gpt2.embedding.fwd", "gpt2.block.fwd", "gpt2.block.fwd", "gpt2.head.fwd"]
    assert names(chain.backward) == ["gpt2.head.bwd", "gpt2.block.bwd", "gpt2.block.bwd", "gpt2.embedding.bwd"]
    assert plan.events[chain.optimizer].content["phase"] == "optimizer"
    two = stage_chains([_plan(pp=2)])
    assert len(two) == 2 and all(len(c.forward) == 2 and len(c.backward) == 2 and c.optimizer for c in two)
    # the same stages in two plans are one chain each
    assert stage_chains([_plan(pp=2), _plan(pp=2)]) == two
    # a split backward: the first stage's W is its whole backward, the others' B and W events apart
    plan = _plan(pp=2, schedule="zb-h1")
    first, second = stage_chains([plan])
    assert names(first.backward) == ["gpt2.block.bwd", "gpt2.embedding.bwd"] and not first.weight
    assert names(second.backward) == ["gpt2.head.bwd_input", "gpt2.block.bwd_input"]
    assert names(second.weight) == ["gpt2.head.bwd_weight", "gpt2.block.bwd_weight"]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_every_position_of_a_chain_is_timed_each_round(schedule):
    plan = _plan(pp=2, schedule=schedule)
    chains = stage_chains([plan])
    contents = {eid: e.content for eid, e in plan.events.items()}
    skipped = []
    samples = measure_chains(plan.spec, chains, contents, torch.device("cpu"), warmup=1, repeats=MIN_ROUNDS,
                             budget_s=0.0, on_skip=lambda chain, why: skipped.append(why))
    assert not skipped
    wanted = {eid for chain in chains for eid in chain.events}
    assert set(samples) == wanted
    for eid, values in samples.items():
        positions = sum(list(chain.forward).count(eid) + list(chain.backward).count(eid)
                        + list(chain.weight).count(eid) + (chain.optimizer == eid) for chain in chains)
        assert values.shape == (positions * MIN_ROUNDS,) and (values > 0).all()


def test_a_chain_waits_for_its_device_where_harness_trains_clock_does(monkeypatch):
    """The backward and the optimizer start on a synchronized device, as each step of harness train does (its clock
    synchronizes at every step's start): on a GPU their first kernels then wait for the host, as the run's do."""
    plan = _plan()
    (chain,) = stage_chains([plan])
    contents = {eid: e.content for eid, e in plan.events.items()}
    runner = in_context.ChainRunner(plan.spec, chain, contents, torch.device("cpu"))
    order = []
    clock_mark = runner.clock.mark
    monkeypatch.setattr(runner.clock, "mark", lambda: order.append("mark") or clock_mark())
    monkeypatch.setattr(in_context, "synchronize", lambda device: order.append("sync"))
    runner.run()
    marks_before = [order[:i].count("mark") for i, item in enumerate(order) if item == "sync"]
    forwards = len(chain.forward) + 1  # a mark before the first forward and after each
    # before the backward's start mark, before the optimizer's (after the backward's end), and at the run's end
    assert marks_before == [forwards, forwards + 2 + len(chain.backward) - 1, forwards + 2 + len(chain.backward) + 1]


def test_a_recomputing_stage_runs_its_groups_under_checkpoint_and_times_each_forward_twice(monkeypatch):
    """recompute = "full" in chunks of 2 blocks: the chain runs each chunk under torch.utils.checkpoint, as harness
    train does; a recomputed block's forward is sampled in the forward and again inside the backward (the plan
    costs it twice), its backward once, less the forwards again."""
    text = tiny_spec_text(layers=4, hidden=32, heads=4, ffn=64, seq=16, vocab=64, recompute="full")
    plan = build_plan(loads_spec(text.replace('recompute = "full"\n', 'recompute = "full"\nrecompute_layers = 2\n')))
    (chain,) = stage_chains([plan])
    assert chain.groups == ((1, 2), (3, 4))
    assert all(plan.events[chain.forward[p]].content["checkpointed"] for group in chain.groups for p in group)
    assert not plan.events[chain.forward[0]].content.get("checkpointed")
    ran = []
    real = in_context.checkpointed
    monkeypatch.setattr(in_context, "checkpointed", lambda function, *args: ran.append(1) or real(function, *args))
    contents = {eid: e.content for eid, e in plan.events.items()}
    samples = measure_chains(plan.spec, [chain], contents, torch.device("cpu"), warmup=1, repeats=MIN_ROUNDS,
                             budget_s=0.0)
    assert len(ran) == 2 * (1 + MIN_ROUNDS)  # two groups a run: the warm-up and the timed rounds
    block_fwd, block_bwd = chain.forward[1], chain.backward[1]
    assert samples[block_fwd].shape == (4 * 2 * MIN_ROUNDS,)  # 4 blocks, each forward and again
    assert samples[block_bwd].shape == (4 * MIN_ROUNDS,)
    assert (samples[block_fwd] > 0).all() and (samples[block_bwd] > 0).all()


def test_a_profile_without_checkpointed_events_costs_them_from_their_twins_with_a_warning():
    """The committed profile predates checkpointed events: a full-recompute plan of its spec takes a recomputed
    block's costs from the same block's samples without the checkpoint, and says so."""
    profile = load_profile(FIXTURE)
    text = (ROOT / "tests" / "data" / "pp2.toml").read_text()
    plan = build_plan(loads_spec(text.replace('schedule = "1f1b"', 'schedule = "1f1b"\nrecompute = "full"')))
    plain = estimate_costs(build_plan(profile.spec), profile)
    costs = estimate_costs(plan, profile)
    checkpointed = [eid for eid, e in plan.events.items() if e.content.get("checkpointed")]
    assert {plan.events[e].name for e in checkpointed} == {"gpt2.block.fwd", "gpt2.block.bwd"}
    for eid in checkpointed:
        twin = unwrapped_twin(plan.events[eid])
        assert eid not in profile.measurements and costs.seconds(eid) == plain.seconds(twin)
    assert any("torch.utils.checkpoint" in w and "profile the spec again" in w for w in costs.warnings)
    assert not any("checkpoint" in w for w in plain.warnings)
    # what a recomputed block's forward saves is its unwrapped twin's, as measured
    saved = activation_bytes(profile)
    block_fwd = next(e for e in checkpointed if plan.events[e].content["phase"] == "fwd")
    assert _with_twins(plan, saved)[block_fwd] == saved[unwrapped_twin(plan.events[block_fwd])] > 0
    assert not estimate_memory(plan, saved, released_bytes(profile), temporary_bytes(profile)).unmeasured


def test_in_context_samples_survive_the_store_and_the_costs_prefer_them(tmp_path):
    path = tmp_path / "profile.h5"
    shutil.copy(FIXTURE, path)
    before = load_profile(FIXTURE)
    plan = build_plan(before.spec)
    old = estimate_costs(plan, before)
    compute = [eid for eid, e in plan.events.items() if e.kind == "compute"]
    chosen = compute[0]
    in_context = before.measurements[chosen].samples_s[:7] * 1.5
    with h5py.File(path, "a") as f:  # as the profiler writes it: one more dataset in the measurement's group
        f["measurements"][chosen].create_dataset(IN_CONTEXT_SERIES, data=in_context, fletcher32=True)
    after = load_profile(path)
    assert np.array_equal(after.measurements[chosen].in_context_samples_s, in_context)
    assert all(not after.measurements[e].in_context_samples_s.size for e in compute if e != chosen)
    costs = estimate_costs(plan, after)
    factor = old.seconds(chosen) / before.measurements[chosen].mean_s  # the rank's speed factor, unchanged
    assert costs.seconds(chosen) == pytest.approx(in_context.mean() * factor)
    assert costs.isolated == {chosen: pytest.approx(old.seconds(chosen))}
    assert "in context" in costs.events[chosen].note and "alone" in costs.events[chosen].note
    assert chosen not in costs.backward_call  # it ran inside the stage's one backward() call
    assert all(costs.seconds(e) == old.seconds(e) for e in plan.events if e != chosen)


def test_profiles_without_in_context_samples_are_costed_as_before():
    profile = load_profile(FIXTURE)
    plan = build_plan(profile.spec)
    costs = estimate_costs(plan, profile)
    assert not costs.isolated
    for eid, event in plan.events.items():
        if event.kind == "compute":
            measurement = profile.measurements[eid]
            factor = rank_factor(measurement, costs.rank_speed) or 1.0
            assert not measurement.in_context_samples_s.size and costs.events[eid].note == ""
            assert costs.seconds(eid) == pytest.approx(measurement.mean_s / factor, rel=1e-12)
            np.testing.assert_allclose(costs.sampled["events"][eid].values, measurement.samples_s / factor,
                                       rtol=1e-12)


def test_every_rank_times_a_chain_while_the_chains_are_timed():
    chains = ["a", "b", "c"]
    # as many chains as ranks or more: a disjoint share each, every chain once
    assert [chains_of_rank(chains, r, 2) for r in range(2)] == [["a", "c"], ["b"]]
    assert [chains_of_rank(chains, r, 3) for r in range(3)] == [["a"], ["b"], ["c"]]
    # fewer: no rank waits while another times (a run computes on every device at once)
    assert [chains_of_rank(chains, r, 8) for r in range(8)] == [[c] for c in "abcabcab"]
    assert [chains_of_rank(["a"], r, 2) for r in range(2)] == [["a"], ["a"]]
    assert chains_of_rank([], 1, 2) == []


def _profiled(tmp_path, project_env, ranks: int = 2, **spec):
    """`harness profile` of tiny_spec_text(**spec) on `ranks` ranks under mpirun: (its result, the profile)."""
    path = tmp_path / "job.toml"
    path.write_text(tiny_spec_text(**spec))
    out = tmp_path / "out"
    result = mpirun_harness(ranks, ["profile", str(path), "-o", str(out), "--quiet"], project_env)
    assert result.returncode == 0, result.stderr
    return result, load_profile(out / "profile.h5")


def test_a_one_stage_job_times_its_chain_on_every_rank(tmp_path, project_env):
    _, profile = _profiled(tmp_path, project_env, layers=1, hidden=32, heads=4, ffn=64, seq=16, vocab=64, dp=2,
                           global_batch=4, micro=2, warmup=1, repeats=3)
    assert profile.environment["in_context_chains"] == 1
    (chain,) = stage_chains([build_plan(profile.spec)])
    for eid, measurement in profile.measurements.items():
        if measurement.kind == "compute":  # both ranks' rounds, each at least MIN_ROUNDS
            positions = list(chain.forward).count(eid) + list(chain.backward).count(eid) + (chain.optimizer == eid)
            assert measurement.in_context_samples_s.size >= 2 * MIN_ROUNDS * positions


def test_a_backward_window_is_taken_less_the_post_backwards_inside_it():
    runner = in_context.ChainRunner.__new__(in_context.ChainRunner)  # its clock and spans only (CPU seconds)
    runner.clock = in_context._Clock(torch.device("cpu"))
    runner.post_backwards, runner.syncing = [(0, 1.0, 1.5), (1, 2.8, 3.2)], True
    # windows [3, 4], [2, 3], [0, 2] (marks latest first): a span across a boundary is shared by overlap
    np.testing.assert_allclose(runner._less_post_backwards(0.0, [4.0, 3.0, 2.0, 0.0]), [0.8, 0.8, 1.5])
    runner.syncing = False  # a backward that reduce-scatters nothing keeps its post-backwards, as the run's does
    np.testing.assert_allclose(runner._less_post_backwards(0.0, [4.0, 3.0, 2.0, 0.0]), [1.0, 1.0, 2.0])
    runner.post_backwards, runner.syncing = [], True
    np.testing.assert_allclose(runner._less_post_backwards(0.0, [4.0, 3.0, 2.0, 0.0]), [1.0, 1.0, 2.0])


def test_a_zero_job_s_profile_times_its_chain_on_both_ranks_and_leaves_none_out(tmp_path, project_env):
    """End to end through `harness profile` (its pair, the sharded units and their agreed rounds are
    tests/test_profile_mpi.py's)."""
    spec = tmp_path / "job.toml"
    spec.write_text(tiny_spec_text(layers=1, hidden=32, heads=4, ffn=64, seq=16, vocab=64, dp=2, global_batch=8,
                                   micro=2, warmup=1, repeats=3, zero=2))
    out = tmp_path / "out"
    result = mpirun_harness(2, ["profile", str(spec), "-o", str(out), "--quiet"], project_env)
    assert result.returncode == 0, result.stderr
    assert "could not run here" not in result.stdout
    profile = load_profile(out / "profile.h5")
    (chain,) = stage_chains([build_plan(profile.spec)])
    for eid, measurement in profile.measurements.items():
        if measurement.kind == "compute":  # both ranks' rounds, each at least MIN_ROUNDS
            positions = list(chain.forward).count(eid) + list(chain.backward).count(eid) + (chain.optimizer == eid)
            samples = measurement.in_context_samples_s
            assert samples.size >= 2 * MIN_ROUNDS * positions and samples.size % (2 * positions) == 0
            assert (samples > 0).all()
    # each reduce-scatter as its unit's post-backwards in the pair's chain (zero 2: every backward), costed so
    scatters = {eid: m for eid, m in profile.measurements.items()
                if m.kind == "reducescatter" and m.content.get("fsdp")}  # not the sweep's bare ones
    assert scatters and all(m.in_context_samples_s.size >= 2 * MIN_ROUNDS for m in scatters.values())
    costs = estimate_costs(build_plan(profile.spec), profile)
    for eid, measurement in scatters.items():
        assert costs.seconds(eid) == float(np.median(measurement.in_context_samples_s))
        assert costs.isolated[eid] == measurement.median_s


def test_a_context_parallel_job_times_its_blocks_with_their_ring_in_the_pairs_chain(tmp_path, project_env):
    """cp = 2 on 2 ranks: the pair runs the stage chain with its blocks on the pair (the ring exchanged between
    them, as the run's cp group exchanges it); each block's forward and backward there is a sample of its
    composite, not of the block alone, and the costs take the composites from them (the composite alone kept)."""
    result, profile = _profiled(tmp_path, project_env, layers=2, hidden=32, heads=4, ffn=64, seq=32, vocab=64, cp=2,
                                global_batch=2, micro=1, warmup=1, repeats=3)
    assert "could not run here" not in result.stdout
    composites = {eid: m for eid, m in profile.measurements.items() if m.kind == "composite"}
    assert {m.content["phase"] for m in composites.values()} == {"fwd", "bwd"}
    # both ranks' rounds, two blocks each
    assert all(m.in_context_samples_s.size >= 2 * 2 * MIN_ROUNDS and (m.in_context_samples_s > 0).all()
               for m in composites.values())
    plan = build_plan(profile.spec)
    blocks = [eid for eid, e in plan.events.items() if e.kind == "compute" and e.content.get("layer") == "block"]
    assert all(not profile.measurements[eid].in_context_samples_s.size for eid in blocks)  # no ring: not theirs
    others = [eid for eid, m in profile.measurements.items() if m.kind == "compute" and eid not in blocks]
    assert others and all(profile.measurements[eid].in_context_samples_s.size for eid in others)
    costs = estimate_costs(plan, profile)
    assert set(costs.isolated_composites) == set(blocks)
    for eid in blocks:
        samples = profile.measurements[event_id(composite_content(plan.events[eid].content))].in_context_samples_s
        assert costs.composites[eid] == pytest.approx(samples.mean())


@pytest.mark.parametrize("ranks", [1, 2])
def test_profile_times_its_stage_chains_in_context(tmp_path, project_env, ranks):
    spec = tmp_path / "job.toml"
    spec.write_text(tiny_spec_text(layers=2, hidden=32, heads=4, ffn=64, seq=16, vocab=64, pp=2, global_batch=4,
                                   micro=2, warmup=1, repeats=3))
    out = tmp_path / "out"
    result = mpirun_harness(ranks, ["profile", str(spec), "-o", str(out), "--quiet"], project_env)
    assert result.returncode == 0, result.stderr
    assert "in context: 2 stage chains" in result.stdout
    profile = load_profile(out / "profile.h5")
    assert profile.environment["in_context_chains"] == 2 and profile.environment["in_context_wall_s"] > 0
    compute = {eid: m for eid, m in profile.measurements.items() if m.kind == "compute"}
    assert compute and all(m.in_context_samples_s.size >= MIN_ROUNDS and (m.in_context_samples_s > 0).all()
                           for m in compute.values())
    costs = estimate_costs(build_plan(profile.spec), profile)
    assert set(costs.isolated) == set(compute)
    show = subprocess.run([sys.executable, "-m", "harness", "show", str(out / "profile.h5")], capture_output=True,
                          text=True, env=project_env)
    assert show.returncode == 0 and "in context" in show.stdout.splitlines()[1]


def test_validate_sums_the_layer_rows_up_per_event_kind():
    result = validate(read_trace(ROOT / "tests" / "data" / "pp2-trace.h5"), load_profile(FIXTURE))
    kinds = {row["kind"]: row for row in layer_kind_ratios(result.layers)}
    assert set(kinds) == {f"{layer} {phase}" for layer in ("embedding", "block", "head") for phase in ("fwd", "bwd")}
    blocks = [r["measured_s"] / r["predicted_s"] for r in result.layers if r["name"] == "gpt2.block.fwd"]
    assert kinds["block fwd"]["rows"] == len(blocks) == 2
    assert kinds["block fwd"]["ratio_median"] == pytest.approx(float(np.median(blocks)))
    assert kinds["block fwd"]["ratio_min"] == pytest.approx(min(blocks))
    assert result.to_dict()["layer_kinds"] == layer_kind_ratios(result.layers)


def test_the_suite_report_pools_every_validation_s_layer_rows_per_kind():
    report = validate(read_trace(ROOT / "tests" / "data" / "pp2-trace.h5"), load_profile(FIXTURE)).to_dict()
    one = {row["kind"]: row for row in pooled({"a": report})}
    two = {row["kind"]: row for row in pooled({"a": report, "b": report})}
    for kind in report["layer_kinds"]:
        name = kind["kind"]
        assert one[name]["rows"] == kind["rows"] and one[name]["ratio_median"] == pytest.approx(kind["ratio_median"])
        assert two[name]["jobs"] == 2 and two[name]["rows"] == 2 * kind["rows"]
        assert two[name]["above_one"] == 2 * one[name]["above_one"]

"""A [search] grid's candidates: every valid combination, the spec's own rules deciding, rejections kept."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.common.errors import SpecError, UserError
from harness.plan.candidates import candidate_label, expand
from harness.plan.events import build_plan, events_to_profile
from harness.plan.spec import loads_spec, parse_spec
from tests.helpers import tiny_spec_text


def _spec(search: str, **kwargs):
    return loads_spec(tiny_spec_text(**kwargs) + "[search]\n" + search)


def test_without_dp_in_the_grid_dp_fills_the_devices():
    grid = expand(_spec('tp = [1, 2]\npp = [1, 2, 4]\n', dp=4, global_batch=16, micro=1))
    assert sorted((c.strategy.dp, c.strategy.tp, c.strategy.pp) for c in grid.candidates) == [
        (1, 1, 4), (1, 2, 2), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    (rejected,) = grid.rejected  # tp 2 x pp 4 = 8 > 4 devices
    assert rejected.reason == "4 devices are not a multiple of tp x pp = 8"
    assert all(c.cluster.devices == 4 for c in grid.candidates)


def test_a_listed_dp_must_use_the_device_count_and_gpus_varies_it():
    grid = expand(_spec('dp = [1, 2, 4]\n', dp=2, global_batch=16, micro=1))
    assert [c.strategy.dp for c in grid.candidates] == [2]
    assert {r.reason for r in grid.rejected} == {
        "dp x tp x pp = 1 devices, not the 2 of the search (list gpus in [search] to vary the device count)",
        "dp x tp x pp = 4 devices, not the 2 of the search (list gpus in [search] to vary the device count)"}
    grid = expand(_spec('gpus = [1, 2, 4]\n', dp=2, global_batch=16, micro=1))
    assert [(c.strategy.world, c.cluster.nodes, c.cluster.gpus_per_node) for c in grid.candidates] == [
        (1, 1, 1), (2, 1, 2), (4, 2, 2)]  # the node size stays 2: 4 devices are 2 nodes
    assert [c.strategy.world for c in expand(_spec('gpus = [1, 2, 4]\n', dp=2, global_batch=16), gpus=4)
            .candidates] == [4]


def test_the_spec_rules_decide_and_each_rejection_keeps_its_reason():
    grid = expand(_spec('gpus = [3]\npp = [1, 3]\nmicro = [1, 3]\n', global_batch=6, layers=4))
    assert [(c.strategy.dp, c.strategy.pp, c.batch.micro) for c in grid.candidates] == [(3, 1, 1)]
    reasons = {r.label(): r.reason for r in grid.rejected}
    assert "layers (4) must be divisible by pp = 3" in reasons["gpus=3 tp=1 pp=3 micro=1 schedule=1f1b"]
    assert "global (6) must be divisible by dp x micro" in reasons["gpus=3 tp=1 pp=1 micro=3 schedule=1f1b"]


def test_chunks_apply_to_interleaved_schedules_only():
    grid = expand(_spec('pp = [2]\nschedule = ["1f1b", "interleaved-1f1b"]\nchunks = [2, 4]\n', pp=2, layers=8,
                        global_batch=8, micro=1))
    assert sorted(candidate_label(c) for c in grid.candidates) == [
        "dp=1 tp=1 pp=2 1f1b micro=1 m=8", "dp=1 tp=1 pp=2 interleaved-1f1b chunks=2 micro=1 m=8",
        "dp=1 tp=1 pp=2 interleaved-1f1b chunks=4 micro=1 m=8"]
    assert not grid.rejected


def test_chunks_without_an_interleaved_schedule_are_refused():
    with pytest.raises(UserError, match=r"\[search\] chunks = \[2, 4\] applies to the interleaved schedules only"):
        expand(_spec('pp = [2]\nschedule = ["1f1b", "gpipe"]\nchunks = [2, 4]\n', pp=2, layers=8, global_batch=8,
                     micro=1))


def test_no_valid_combination_names_the_first_reasons():
    with pytest.raises(UserError, match="no combination of the \\[search\\] grid is a valid job .*pp = 3"):
        expand(_spec('pp = [3]\n', layers=4))
    with pytest.raises(UserError, match="--gpus 0"):
        expand(_spec('pp = [1]\n'), gpus=0)
    with pytest.raises(UserError, match="not the 3 of the search"):  # --gpus that no candidate can use
        expand(_spec('dp = [1, 2]\n', global_batch=8), gpus=3)


@pytest.mark.parametrize("line,words", [("dp = []", "[search.dp] must be a non-empty list"),
                                        ("dp = 2", "[search.dp] must be a non-empty list"),
                                        ('tp = ["two"]', "[search.tp] must be an integer"),
                                        ('schedule = ["zigzag"]', "[search.schedule] unknown value 'zigzag'"),
                                        ("colour = [1]", "[search] unknown key 'colour'")])
def test_a_bad_grid_is_one_message(line, words):
    with pytest.raises(SpecError) as info:
        _spec(line + "\n")
    assert words in str(info.value)


def test_the_union_of_a_search_is_each_event_once():
    spec = _spec('tp = [1, 2]\npp = [1, 2]\nmicro = [1, 2]\n', dp=4, global_batch=16, micro=1)
    unique, grid = events_to_profile(spec)
    plans = [build_plan(c) for c in grid.candidates]
    assert set(unique.events) == set().union(*(p.events for p in plans))
    assert unique.separate == sum(p.unique_events for p in plans) > len(unique)
    assert unique.summary()["total_events"] == sum(p.total_events for p in plans)


def test_harness_events_reports_the_union(tmp_path, project_env):
    path = tmp_path / "search.toml"
    path.write_text(tiny_spec_text(dp=4, global_batch=16, micro=1) + "[search]\ntp = [1, 2]\npp = [1, 2, 4]\n")
    result = subprocess.run([sys.executable, "-m", "harness", "events", str(path), "--json"], capture_output=True,
                            text=True, env=project_env, timeout=60)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["candidates"] == 5 and summary["rejected"] == 1
    assert summary["cross_candidate_ratio"] > 1 and summary["unique_events"] < summary["separate_unique_events"]
    text = subprocess.run([sys.executable, "-m", "harness", "events", str(path)], capture_output=True, text=True,
                          env=project_env, timeout=60).stdout
    assert "a search of 5 candidate strategies (1 combinations rejected)" in text and "fewer to profile" in text


def test_auto_fills_every_open_field_with_every_value():
    """`auto`: every factorization of the devices and every micro-batch size that divides the batch over dp; the
    fields the grid lists keep their values; the spec's rules reject the rest, each with its reason."""
    spec = _spec('auto = true\nschedule = ["1f1b"]\nrecompute = ["none"]\nzero = [0]\nsp = [false]\ncp = [1]\n',
                 dp=4, global_batch=8)
    grid = expand(spec)
    shapes = {(c.strategy.dp, c.strategy.tp, c.strategy.pp) for c in grid.candidates}
    assert shapes == {(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4)}
    assert sorted(c.batch.micro for c in grid.candidates if c.strategy.dp == 4) == [1, 2]
    assert sorted(c.batch.micro for c in grid.candidates if c.strategy.tp == 4) == [1, 2, 4, 8]
    assert {c.strategy.schedule for c in grid.candidates} == {"1f1b"}
    assert len(grid) + len(grid.rejected) == 20 and all(r.reason for r in grid.rejected)
    # without the listed fields: every schedule, recompute and ZeRO stage too; `--auto` asks the same of any grid
    everything = expand(_spec('auto = true\n', dp=4, global_batch=8))
    assert {c.strategy.zero for c in everything.candidates} == {0, 1, 2, 3}
    assert {c.strategy.recompute for c in everything.candidates} == {"none", "selective", "full"}
    assert {c.strategy.schedule for c in everything.candidates} >= {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}
    assert all(c.strategy.tp == 1 for c in everything.candidates if c.strategy.zero)
    # sequence parallelism on and off where there is a tensor-parallel group, and only there
    assert {c.strategy.sp for c in everything.candidates if c.strategy.tp > 1} == {False, True}
    assert not any(c.strategy.sp for c in everything.candidates if c.strategy.tp == 1)
    # and every context-parallel size that divides the devices and half the sequence (16 tokens)
    assert {c.strategy.cp for c in everything.candidates} == {1, 2, 4}
    plain = _spec('tp = [1]\n', dp=4, global_batch=8)
    assert len(expand(plain)) == 1 and {c.strategy.tp for c in expand(plain, auto=True).candidates} == {1}
    assert loads_spec(spec.to_toml(search=True)).search.auto


def test_a_candidate_is_what_parsing_its_spec_gives():
    """Candidates are built from the parsed spec (JobSpec.with_strategy), not parsed again: each equals its own spec
    parsed from plain data, vocabulary padding and node count included, and a rejection keeps the rule parsing
    would name."""
    spec = loads_spec(tiny_spec_text(dp=4, global_batch=16, micro=1, vocab=250)
                      + "[search]\nauto = true\n")
    grid = expand(spec)
    assert len(grid) > 20 and grid.rejected
    for candidate in grid.candidates:
        again = parse_spec(candidate.to_dict(), source=candidate.source, import_factory=False)
        assert again == candidate and again.to_toml() == candidate.to_toml()
    padded = [c for c in grid.candidates if c.strategy.tp > 1 and c.model.vocab != 250]
    assert padded and all(c.model.unpadded_vocab == 250 for c in padded)
    for rejected in grid.rejected[:200]:
        choice = dict(rejected.choice)
        data = spec.to_dict()
        data.pop("search")
        strategy = {k: v for k, v in choice.items() if k not in ("gpus", "micro")}
        data["strategy"] = {**data["strategy"], **strategy}
        if choice.get("recompute", "full") != "full":
            data["strategy"].pop("recompute_layers", None)
            data["strategy"].pop("recompute_method", None)
        data["batch"]["micro"] = choice["micro"]
        with pytest.raises(SpecError) as caught:
            parse_spec(data, source="grid")
        assert str(caught.value).endswith(rejected.reason)

"""The job spec: valid specs load into typed objects; every invalid one exits 2 naming its field."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.common.errors import SpecError
from harness.plan.spec import MODEL_PRESETS, load_spec, loads_spec, parse_strategy_overrides
from tests.helpers import tiny_spec_text, write_spec

ISSUE_EXAMPLE = """
[model]
name = "gpt2-small"
layers = 12
hidden = 768
heads = 12
ffn = 3072
seq_len = 1024
vocab = 50304
dtype = "float32"
[batch]
global = 64
micro = 4
[strategy]
dp = 2
tp = 2
pp = 2
schedule = "1f1b"
[cluster]
nodes = 2
gpus_per_node = 4
[profile]
warmup = 3
repeats = 10
"""


def test_issue_example_loads():
    spec = loads_spec(ISSUE_EXAMPLE)
    assert spec.model.hidden == 768 and spec.model.family == "gpt2"
    assert spec.strategy.world == 8 == spec.cluster.devices
    assert spec.micro_batches == 64 // (2 * 4)
    assert spec.profile.repeats == 10


def test_round_trip_through_dict():
    from harness.plan.spec import parse_spec

    spec = loads_spec(ISSUE_EXAMPLE)
    again = parse_spec(spec.to_dict())
    assert again.to_dict() == spec.to_dict()


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_is_valid(name):
    spec = loads_spec(tiny_spec_text(name=name, layers=4, hidden=64, heads=4, ffn=128))
    assert spec.model.name == name


def test_llama_shrink_keeps_grouped_query_ratio():
    spec = loads_spec(tiny_spec_text(name="llama-1b", layers=2, hidden=64, heads=8, ffn=128))
    assert spec.model.kv_heads == 1  # llama-1b has 32 heads over 4 kv heads: ratio 8


def _error(text: str) -> str:
    with pytest.raises(SpecError) as info:
        loads_spec(text, source="job.toml")
    return str(info.value)


@pytest.mark.parametrize("change, field, words", [
    (dict(name="gpt5"), "model.name", "unknown model"),
    (dict(dp=2, tp=1, pp=1, gpus_per_node=4), "strategy", "must equal"),
    (dict(layers=3, pp=2), "model.layers", "divisible by pp"),
    (dict(layers=4, pp=2, schedule="interleaved-1f1b", chunks=4, global_batch=8, micro=1),
     "model.layers", "pp x chunks"),
    (dict(heads=3, hidden=48, tp=2), "model.heads", "divisible by tp"),
    (dict(ffn=66, tp=4, heads=4, hidden=32), "model.ffn", "divisible by tp"),
    (dict(global_batch=10, micro=4), "batch.global", "divisible by dp x micro"),
    (dict(micro=0), "batch.micro", ">= 1"),
    (dict(layers=-2), "model.layers", ">= 1"),
    (dict(schedule="zigzag"), "strategy.schedule", "unknown value"),
])
def test_invalid_specs_name_the_field(change, field, words):
    message = _error(tiny_spec_text(**change))
    assert f"[{field}]" in message and words in message and "job.toml" in message


def test_values_of_the_wrong_kind_or_past_their_bound_are_refused():
    """A model name that is not a string (TOML lets it be an array or a table), and a timeout past a week (what
    torch's process groups and Python's waits can hold), each one message naming the field."""
    text = tiny_spec_text()
    for value in ("[4]", "{ a = 1 }"):
        message = _error(text.replace('name = "gpt2-small"', f"name = {value}"))
        assert "[model.name]" in message and "give a built-in model name" in message
    for timeout in ("1e10", "1e-9"):
        message = _error(text + f"timeout_s = {timeout}\n")
        assert "[profile.timeout_s]" in message and "must be from 1 to 604800" in message
    message = _error(text.replace("repeats = 3", "repeats = 1000000000000"))
    assert "[profile.repeats]" in message and "at most 1,000,000" in message


def test_unknown_dtype():
    assert "[model.dtype]" in _error(tiny_spec_text().replace('dtype = "float32"', 'dtype = "float8"'))


def test_unknown_key_and_section():
    message = _error(tiny_spec_text().replace("[batch]", "[batch]\ncolour = 3"))
    assert "unknown key 'colour'" in message and "[batch]" in message
    assert "unknown section" in _error(tiny_spec_text() + "\n[extras]\nx = 1\n")


def test_malformed_toml_names_the_line():
    message = _error(tiny_spec_text().replace("layers = 4", "layers = = 4"))
    assert "malformed TOML" in message and "line 4" in message


@pytest.mark.parametrize("text", ["a = " + "[" * 5000, "[model]\nlayers = " + "9" * 5000])
def test_toml_past_pythons_limits_is_malformed_not_a_traceback(text):
    """Tables nested past Python's recursion and an integer past its 4,300 digits raise RecursionError and
    ValueError inside tomllib, not TOMLDecodeError: one message all the same."""
    assert "a number thousands of digits long, or tables nested thousands deep" in _error(text)


def test_interleaved_needs_micro_batches_multiple_of_pp():
    message = _error(tiny_spec_text(layers=8, pp=2, schedule="interleaved-1f1b", chunks=2, global_batch=6, micro=2))
    assert "[batch.global]" in message and "multiple of pp" in message


def test_chunks_without_interleaving():
    assert "[strategy.chunks]" in _error(tiny_spec_text(layers=4, pp=2, chunks=2))


def test_factory_that_cannot_be_imported():
    text = tiny_spec_text().replace('name = "gpt2-small"', 'factory = "no_such_module_xyz:build"')
    assert "[model.factory]" in _error(text) and "cannot import" in _error(text)
    text = tiny_spec_text().replace('name = "gpt2-small"', 'factory = "json:no_such_function"')
    assert "has no callable" in _error(text)
    text = tiny_spec_text().replace('name = "gpt2-small"', 'factory = "tests.exiting_module:build"')
    assert "called sys.exit(0) as it was imported" in _error(text)


def test_factory_model_rejects_tensor_parallelism():
    text = tiny_spec_text(tp=2).replace('name = "gpt2-small"', 'factory = "tests.user_model:build"')
    assert "[strategy.tp]" in _error(text)


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "nope.toml")


def test_strategy_overrides_change_the_cluster():
    spec = loads_spec(ISSUE_EXAMPLE)
    bigger = spec.with_changes(**parse_strategy_overrides("dp=8,schedule=gpipe"))
    assert bigger.strategy.dp == 8 and bigger.strategy.schedule == "gpipe"
    assert bigger.cluster.devices == 32 and bigger.cluster.gpus_per_node == 4
    with pytest.raises(SpecError, match="unknown field"):
        spec.with_changes(colour=3)
    for text, words in (("tp=x", "[strategy.tp] must be an integer, got 'x'"), ("dp=", "[strategy.dp] must be an "
                                                                                    "integer, got ''")):
        with pytest.raises(SpecError) as caught:  # a degree that is no number is named, not a TypeError
            spec.with_changes(**parse_strategy_overrides(text))
        assert words in str(caught.value)
    for text, words in (("tp=2,dp=2,tp=4", "tp is given twice"), ("network=ib", "network is a table of tiers")):
        with pytest.raises(SpecError, match=words):
            parse_strategy_overrides(text)


def test_a_spec_takes_its_network_tiers_from_code():
    """with_changes(network=[...]) is the programmatic way to set the tiers (bench/device_model.py writes its
    calibrated tier so); only --strategy's key=value cannot say a list of tables."""
    tier = {"name": "node", "size": 64, "bandwidth_gbs": 1.5, "latency_us": 40.0}
    spec = loads_spec(ISSUE_EXAMPLE).with_changes(network=[tier])
    assert [(t.name, t.size, t.bandwidth_gbs, t.latency_us) for t in spec.cluster.network] == [("node", 64, 1.5, 40.0)]


def test_positive_figures_are_finite():
    text = tiny_spec_text(budget_s="inf")
    assert "[profile.budget_s] must be a positive, finite number, got inf" in _error(text)


def test_cli_exit_status_2_without_traceback(tmp_path, project_env):
    bad = write_spec(tmp_path / "bad.toml", name="gpt5")
    result = subprocess.run([sys.executable, "-m", "harness", "events", str(bad)], capture_output=True, text=True,
                            env=project_env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "[model.name]" in result.stderr and "unknown model 'gpt5'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_spec_that_is_not_text(tmp_path):
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SpecError, match="not UTF-8"):
        load_spec(path)


def test_switching_to_interleaved_takes_its_default_chunks():
    spec = loads_spec(tiny_spec_text(layers=8, pp=2, global_batch=8, micro=2))
    assert spec.with_changes(schedule="interleaved-1f1b").strategy.chunks == 2
    assert spec.with_changes(schedule="interleaved-1f1b", chunks=4).strategy.chunks == 4


def test_mpi4py_backend_refuses_bfloat16():
    text = tiny_spec_text(extra='backend = "mpi4py"\n').replace('dtype = "float32"', 'dtype = "bfloat16"')
    assert "[profile.backend]" in _error(text)


@pytest.mark.parametrize("old,new,field", [("layers = 4", "layers = 100000000", "[model.layers]"),
                                           ("seq_len = 16", "seq_len = 1000000000", "[model.seq_len]"),
                                           ("global = 8", "global = 10000000", "[batch.global]")])
def test_sizes_past_any_real_job_are_refused_at_once(tmp_path, project_env, old, new, field):
    """A million layers or a billion-token sequence: one message, exit 2, not hours of event generation."""
    text = tiny_spec_text(seq=16, global_batch=8)
    assert old in text
    path = tmp_path / "huge.toml"
    path.write_text(text.replace(old, new))
    result = subprocess.run([sys.executable, "-m", "harness", "events", str(path)], capture_output=True, text=True,
                            env=project_env, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert field in result.stderr and ("more than this tool models" in result.stderr
                                       or "more than the timeline simulates" in result.stderr)


def test_many_identical_layers_share_their_events():
    """The events stage is built on unique events: 10,000 identical blocks are still one forward and one
    backward event, with the multiplicities of all of them, and the device's one optimizer step names them as
    one run."""
    from harness.plan.events import build_plan

    plan = build_plan(loads_spec(tiny_spec_text(layers=10_000)))
    blocks = [e for e in plan.events.values() if e.name.startswith("gpt2.block")]
    assert len(blocks) == 2
    assert {plan.multiplicity[e.id] for e in blocks} == {10_000 * plan.spec.micro_batches}
    (step,) = [e for e in plan.events.values() if e.content["phase"] == "optimizer"]
    assert step.name == "optimizer(gpt2.embedding, 10000x gpt2.block, gpt2.head)" and plan.multiplicity[step.id] == 1
    assert [count for _, count in step.content["layers"]] == [1, 10_000, 1]


def test_grad_accumulation_fusion_is_a_flag_written_only_when_set():
    plain = loads_spec(tiny_spec_text())
    assert not plain.strategy.grad_accumulation_fusion and "grad_accumulation_fusion" not in plain.to_dict()["strategy"]
    fused = loads_spec(tiny_spec_text().replace("[cluster]", "grad_accumulation_fusion = true\n[cluster]"))
    assert fused.to_dict()["strategy"]["grad_accumulation_fusion"] is True
    assert loads_spec(fused.to_toml()) == fused
    with pytest.raises(SpecError, match=r"\[strategy.grad_accumulation_fusion\] must be true or false, got 'yes'"):
        loads_spec(tiny_spec_text().replace("[cluster]", 'grad_accumulation_fusion = "yes"\n[cluster]'))


def test_a_spec_path_that_is_no_toml_file_is_one_message(tmp_path):
    """A missing path, a folder, bytes that are not UTF-8, and an endless stream (/dev/zero is read no further
    than MAX_SPEC_BYTES): a SpecError each, naming the path."""
    from harness.plan.spec import load_spec

    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe")
    cases = [(tmp_path / "none.toml", "spec file not found"), (tmp_path, "is a folder"), (binary, "is not UTF-8")]
    if Path("/dev/zero").exists():
        cases.append((Path("/dev/zero"), "far beyond any job spec"))
    for path, words in cases:
        with pytest.raises(SpecError, match=words) as info:
            load_spec(path)
        assert str(path) in str(info.value)

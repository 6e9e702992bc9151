"""The compute profiler on one process: round-robin samples, cold-cache copies, accumulated gradients."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.plan.events import build_plan, event_id, unwrapped_twin
from harness.plan.spec import loads_spec
from harness.profile import compute
from harness.profile.compute import (
    ComputeRunner,
    backward_call_times,
    heavy_light_order,
    last_level_cache_bytes,
    measure_backward_call,
    measure_compute_share,
    measure_split_call,
)
from tests.helpers import tiny_spec_text


def _plan():
    return build_plan(loads_spec(tiny_spec_text(layers=2, hidden=64, heads=4, ffn=128, seq=16, vocab=128)))


def test_round_robin_samples_every_event():
    plan = _plan()
    contents = {eid: e.content for eid, e in plan.events.items() if e.kind == "compute"}
    rounds = []
    samples = measure_compute_share(plan.spec, contents, torch.device("cpu"), warmup=1, repeats=3,
                                    on_round=rounds.append)
    assert set(samples) == set(contents)
    assert all(s.samples_s.shape == (3,) and (s.samples_s > 0).all() for s in samples.values())
    assert all(s.host_issue_s is None for s in samples.values())  # on a CPU the host is the device
    assert rounds == [len(contents)] * 3  # one sample of every event per round


def test_cpu_runner_rotates_copies_larger_than_the_cache():
    plan = _plan()
    (fwd,) = [e for e in plan.events.values() if e.name == "gpt2.block.fwd"]
    runner = ComputeRunner(plan.spec, fwd.content, torch.device("cpu"))
    weights = sum(p.numel() * p.element_size() for p in runner.layers[0].parameters())
    assert len(runner.layers) > 1 and len({id(layer) for layer in runner.layers}) == len(runner.layers)
    assert len(runner.layers) * weights * 2 >= min(2 * last_level_cache_bytes(), 16 * weights * 2)
    assert all(runner.sample() > 0 for _ in range(len(runner.layers) + 1))


def test_a_checkpointed_forward_runs_under_checkpoint_and_its_memory_is_the_plain_forwards(monkeypatch):
    """A recomputed block's forward is timed as harness train runs it, under torch.utils.checkpoint; what its
    forward saves is measured without it (the memory model counts a recomputed layer's activations itself)."""
    plan = build_plan(loads_spec(tiny_spec_text(layers=2, hidden=64, heads=4, ffn=128, seq=16, vocab=128,
                                                recompute="full")))
    contents = {e.id: e.content for e in plan.events.values() if e.name == "gpt2.block.fwd"}
    (content,) = contents.values()
    assert content["checkpointed"] is True
    ran = []
    real = compute.checkpointed
    monkeypatch.setattr(compute, "checkpointed", lambda function, *args: ran.append(1) or real(function, *args))
    runner = ComputeRunner(plan.spec, content, torch.device("cpu"), copies=1)
    assert runner.sample() > 0 and len(ran) == 1
    (taken,) = measure_compute_share(plan.spec, contents, torch.device("cpu"), warmup=1, repeats=2).values()
    plain = [e.content for e in _plan().events.values() if e.name == "gpt2.block.fwd"][0]
    (untaken,) = measure_compute_share(_plan().spec, {"plain": plain}, torch.device("cpu"), warmup=1,
                                       repeats=2).values()
    assert taken.activation_bytes == untaken.activation_bytes > 0


ZERO_RUNNER = """
import json, sys, torch
from torch.distributed.fsdp import FSDPModule
from harness.plan.events import build_plan
from harness.plan.spec import loads_spec
from harness.profile.compute import ComputeRunner, measure_compute_share
plan = build_plan(loads_spec(sys.stdin.read()))
out = {}
for event in plan.events.values():
    if event.kind == "compute" and event.content["phase"] in ("fwd", "bwd"):
        runner = ComputeRunner(plan.spec, event.content, torch.device("cpu"), copies=2)
        taken = measure_compute_share(plan.spec, {event.id: event.content}, torch.device("cpu"), 1, 2)[event.id]
        out[event.name] = [all(isinstance(layer, FSDPModule) for layer in runner.layers),
                           isinstance(runner.memory_layer, FSDPModule), runner.sample() > 0,
                           taken.activation_bytes]
    elif event.kind == "compute":
        from torch.distributed.tensor import DTensor
        runner = ComputeRunner(plan.spec, event.content, torch.device("cpu"), copies=2)
        out["optimizer"] = [all(isinstance(p, DTensor) and isinstance(p.grad, DTensor)
                                for params in runner.layers for p in params.parameters()), runner.sample() > 0]
print(json.dumps(out))
"""


@pytest.mark.parametrize("zero", [1, 3])
def test_a_zero_jobs_layers_are_timed_as_fsdp2_units_and_their_memory_without(zero, project_env):
    """A ZeRO job's layer events say their level and run as FSDP2 units (over a one-rank group: a process of its
    own, which starts torch.distributed); what a forward saves is the plain layer's."""
    import json
    import subprocess
    import sys

    text = tiny_spec_text(layers=2, hidden=32, heads=4, ffn=64, seq=16, vocab=64, dp=2, global_batch=4, micro=1,
                          zero=zero)
    plain = build_plan(loads_spec(tiny_spec_text(layers=2, hidden=32, heads=4, ffn=64, seq=16, vocab=64, dp=2,
                                                 global_batch=4, micro=1)))
    plan = build_plan(loads_spec(text))
    layers = [e for e in plan.events.values() if e.kind == "compute" and e.content["phase"] != "optimizer"]
    assert layers and all(e.content["fsdp2"] is True for e in layers)
    assert {e.name for e in layers} == {e.name for e in plain.events.values()
                                       if e.kind == "compute" and e.content["phase"] != "optimizer"}
    assert all("fsdp2" not in e.content for e in plain.events.values())
    result = subprocess.run([sys.executable, "-c", ZERO_RUNNER], input=text, capture_output=True, text=True,
                            env=project_env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ran = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(ran) >= {"gpt2.block.fwd", "gpt2.block.bwd", "gpt2.head.fwd"}
    # the optimizer steps FSDP2's shards, DTensors (their dispatch made the runs' steps 2-7 times plain tensors');
    # a profile from before costs it from its twin of plain tensors
    assert ran.pop("optimizer") == [True, True]
    (step,) = [e for e in plan.events.values() if e.kind == "compute" and e.content["phase"] == "optimizer"]
    assert step.content["fsdp2"] is True and step.content["shard"] == 2
    assert unwrapped_twin(step) == event_id({k: v for k, v in step.content.items() if k != "fsdp2"})
    for name, (wrapped, memory_wrapped, sampled, _) in ran.items():
        assert wrapped and not memory_wrapped and sampled, name
    plain_saved = measure_compute_share(plain.spec, {e.id: e.content for e in plain.events.values()
                                                     if e.name == "gpt2.block.fwd"}, torch.device("cpu"), 1, 2)
    assert ran["gpt2.block.fwd"][3] == next(iter(plain_saved.values())).activation_bytes > 0


def test_a_later_world_gets_its_own_one_rank_group(project_env):
    """A profile's end destroys its world; a ZeRO layer in a later one (the same process) gets a group of it."""
    import subprocess
    import sys

    script = (
        "import torch, torch.distributed as dist\n"
        "from torch.distributed.fsdp import FSDPModule\n"
        "from harness.profile.sharded import shard_alone\n"
        "first = shard_alone(torch.nn.Linear(4, 4), torch.device('cpu'))\n"
        "dist.destroy_process_group()\n"
        "second = shard_alone(torch.nn.Linear(4, 4), torch.device('cpu'))\n"
        "second(torch.randn(2, 4)).sum().backward()\n"
        "print(isinstance(first, FSDPModule) and isinstance(second, FSDPModule))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=project_env,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("True"), result.stderr[-2000:]


def test_backward_samples_accumulate_gradients():
    plan = _plan()
    (bwd,) = [e for e in plan.events.values() if e.name == "gpt2.block.bwd"]
    runner = ComputeRunner(plan.spec, bwd.content, torch.device("cpu"), copies=1)
    runner.sample()
    first = [p.grad.clone() for p in runner.layers[0].parameters()]
    runner.sample()
    assert any(not torch.allclose(a, p.grad) for a, p in zip(first, runner.layers[0].parameters()))
    assert np.isfinite(runner.sample())


def test_a_backward_sample_consumes_the_forward_run_at_the_previous_sample():
    """As in a pipeline, other work runs between a micro-batch's forward and its backward: the runner runs
    the copy's next forward right after timing a backward, so the next backward finds its activations cold."""
    plan = _plan()
    (bwd,) = [e for e in plan.events.values() if e.name == "gpt2.block.bwd"]
    runner = ComputeRunner(plan.spec, bwd.content, torch.device("cpu"), copies=1)
    order = []
    layer = runner.layers[0]
    layer.register_forward_hook(lambda *_: order.append("F"))
    layer.register_full_backward_hook(lambda *_: order.append("B"))
    runner.sample()
    runner.sample()
    assert order == ["F", "B", "F", "B", "F"]


class _FakeIssue:
    """Stands in for timer.time_issued on a CPU: the host needs `host_s` to issue a chain; a lead shorter
    than that (or any lead, for a layer that synchronizes) leaves the sample not ahead."""

    def __init__(self, host_s: float, synchronizes: bool = False):
        self.host_s, self.synchronizes, self.leads = host_s, synchronizes, []

    def __call__(self, run, device, lead_s):
        from harness.profile.timer import IssuedSample

        self.leads.append(lead_s)
        run()
        ahead = lead_s > self.host_s and not self.synchronizes
        waited = lead_s if self.synchronizes else 0.0  # a synchronizing layer waits out the spin
        return IssuedSample(device_s=0.004, host_s=self.host_s + waited, ahead=ahead)


def _gpu_like_runner(monkeypatch, phase: str, fake: _FakeIssue) -> ComputeRunner:
    import harness.profile.compute as compute

    plan = _plan()
    (event,) = [e for e in plan.events.values() if e.name == f"gpt2.block.{phase}"]
    runner = ComputeRunner(plan.spec, event.content, torch.device("cpu"), copies=1)
    monkeypatch.setattr(compute, "time_issued", fake)
    runner.issued, runner.chain = True, 4
    return runner


def test_issued_forward_is_retaken_with_a_longer_lead_and_counted_per_layer(monkeypatch):
    from harness.profile.compute import MIN_LEAD_S

    fake = _FakeIssue(host_s=0.003)
    runner = _gpu_like_runner(monkeypatch, "fwd", fake)
    assert runner.sample() == pytest.approx(0.001)  # 4 ms for a chain of 4
    assert fake.leads == pytest.approx([MIN_LEAD_S, 0.006])  # retaken with twice the issue time
    first, last = runner._issue_marks_ns  # the host time per layer is that of the chain's later issues
    assert last > first and runner.last_host_s == pytest.approx((last - first) / 1e9 / 3)
    runner.sample()
    assert fake.leads[-1] == pytest.approx(0.006)  # twice the last issue time, no retry needed


def test_a_chained_samples_host_time_leaves_out_its_cold_first_issue(monkeypatch):
    import harness.profile.compute as compute

    runner = _gpu_like_runner(monkeypatch, "fwd", _FakeIssue(host_s=0.003))
    clock = [0]
    monkeypatch.setattr(compute.time, "perf_counter_ns", lambda: clock[0])

    def issue(nanoseconds):  # issuing takes this long on the (fake) host clock
        clock[0] += nanoseconds
        return nanoseconds

    run = runner._chained([9_000_000, 1_000_000, 2_000_000, 3_000_000], issue)
    assert run() == [9_000_000, 1_000_000, 2_000_000, 3_000_000]
    assert runner._host_issue_s(0.015, chain=4) == pytest.approx(0.002)  # (1 + 2 + 3) ms / 3, not 15 / 4
    assert runner._host_issue_s(0.015, chain=1) == 0.015  # one issue: its own time


def test_issued_backward_is_never_retaken(monkeypatch):
    fake = _FakeIssue(host_s=0.003)
    runner = _gpu_like_runner(monkeypatch, "bwd", fake)
    runner.sample()
    assert len(fake.leads) == 1  # the graph is consumed: only the next sample gets the longer lead
    runner.sample()
    assert fake.leads[1] > fake.leads[0]


def test_a_layer_that_synchronizes_is_timed_alone_and_the_lead_stays_bounded(monkeypatch):
    from harness.profile.compute import MAX_LEAD_S

    fake = _FakeIssue(host_s=0.003, synchronizes=True)
    runner = _gpu_like_runner(monkeypatch, "fwd", fake)
    for _ in range(6):
        runner.sample()
    assert max(fake.leads) <= MAX_LEAD_S
    assert runner.waits_for_device and not runner.issued and runner.chain == 1
    calls = len(fake.leads)
    seconds = runner.sample()  # timed alone now
    assert len(fake.leads) == calls and runner.last_host_s == seconds > 0


def test_heavy_light_order_puts_every_short_event_after_a_long_one():
    assert heavy_light_order({"a": 5.0, "b": 1.0, "c": 3.0, "d": 2.0}) == ["a", "b", "c", "d"]
    assert heavy_light_order({"x": 1.0, "y": 9.0, "z": 4.0}) == ["y", "x", "z"]
    assert heavy_light_order({"only": 2.0}) == ["only"]
    assert heavy_light_order({"p": 0.0, "q": 0.0}) == ["p", "q"]  # no warm-up: the given order


def test_rounds_sample_in_heavy_light_order_of_the_warm_up(monkeypatch):
    plan = _plan()
    contents = {eid: e.content for eid, e in plan.events.items() if e.kind == "compute"}
    sampled = []
    real_sample = ComputeRunner.sample

    def spy(runner):
        seconds = real_sample(runner)
        sampled.append((runner, seconds))
        return seconds

    monkeypatch.setattr(ComputeRunner, "sample", spy)
    measure_compute_share(plan.spec, contents, torch.device("cpu"), warmup=1, repeats=1)
    by_runner = {id(runner): runner for runner, _ in sampled}
    eid_of = {key: next(eid for eid, content in contents.items()
                        if {k: v for k, v in runner.content.items() if k != "last"} == content)
              for key, runner in by_runner.items()}
    timed = [eid_of[id(runner)] for runner, _ in sampled[-len(contents):]]
    warm, warm_count = {}, {}
    for runner, seconds in sampled[:-len(contents)]:
        warm[eid_of[id(runner)]] = seconds  # its last warm-up sample
        warm_count[id(runner)] = warm_count.get(id(runner), 0) + 1
    assert timed == heavy_light_order(warm)
    assert warm[timed[1]] == min(warm.values())  # the shortest runs right after the longest
    # every copy of a layer ran once before the warm-up proper: a copy's first run touches fresh memory
    assert all(warm_count[key] == len(runner.layers) + 1 for key, runner in by_runner.items())
    assert any(len(runner.layers) > 1 for runner in by_runner.values())


def test_backward_samples_carry_the_cost_of_one_backward_call():
    plan = _plan()
    contents = {eid: e.content for eid, e in plan.events.items() if e.kind == "compute"}
    samples = measure_compute_share(plan.spec, contents, torch.device("cpu"), warmup=1, repeats=2)
    calls = {contents[eid]["phase"]: s.backward_call_s for eid, s in samples.items()}
    assert calls["fwd"] is None and calls["optimizer"] is None
    assert 0.0 <= calls["bwd"] < 0.05  # tens of microseconds on a CPU
    assert len({s.backward_call_s for eid, s in samples.items() if contents[eid]["phase"] == "bwd"}) == 1


def test_measure_backward_call_is_a_small_nonnegative_time():
    seconds = measure_backward_call(torch.device("cpu"), repeats=5)
    assert np.isfinite(seconds) and 0.0 <= seconds < 0.05


def test_a_composite_sample_starts_when_the_last_member_started():
    """Member A leaves the barrier at 0 and waits 2 ms for B at the first all-reduce (its own time 11 ms);
    B starts at 2 and takes 9 ms: the layer, as in a step where both arrive together, takes 9 ms."""
    from harness.profile.comm import composite_samples

    starts, ends = np.array([[0.0, 5.0], [2.0, 5.5]]), np.array([[11.0, 12.0], [11.0, 13.0]])
    assert composite_samples(starts.max(axis=0), ends.max(axis=0)) == pytest.approx([9.0, 7.5])


def test_backward_call_times_run_both_ways_over_the_same_layers():
    """Both timings run over every layer: each layer's parameters get gradients."""
    torch.manual_seed(0)
    modules = [torch.nn.Linear(8, 8) for _ in range(3)]
    many, one = backward_call_times(modules, lambda: torch.randn(4, 8, requires_grad=True), torch.device("cpu"),
                                    loss=lambda out: out.square().mean())
    assert many > 0 and one > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for m in modules for p in m.parameters())


def test_a_split_backward_is_timed_in_its_two_parts():
    """zb-h1: a block's bwd_input sample computes its input's gradient and no weight's, its bwd_weight sample the
    weights' (after an untimed bwd_input at the previous sample); bwd_input's measurement records what it keeps
    for the W (profilers.memory.kept_for_weights), a forward's what it saves."""
    from harness.profile.memory import activation_bytes, kept_for_weights

    plan = build_plan(loads_spec(tiny_spec_text(layers=2, pp=2, hidden=64, heads=4, ffn=128, seq=16, vocab=128,
                                                schedule="zb-h1")))
    events = {e.name: e for e in plan.events.values()}
    inputs = ComputeRunner(plan.spec, events["gpt2.block.bwd_input"].content, torch.device("cpu"), copies=1)
    assert inputs.sample() > 0
    assert all(p.grad is None for p in inputs.layers[0].parameters())
    weights = ComputeRunner(plan.spec, events["gpt2.block.bwd_weight"].content, torch.device("cpu"), copies=1)
    assert weights.sample() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in weights.layers[0].parameters())
    contents = {e.id: e.content for name, e in events.items() if name.startswith("gpt2.block.")}
    samples = measure_compute_share(plan.spec, contents, torch.device("cpu"), warmup=0, repeats=2)
    measured = samples[events["gpt2.block.bwd_input"].id]
    layer, make_input = inputs.layers[0], inputs.make_input
    kept, released = kept_for_weights(layer, make_input, lambda module, x: module(x))
    assert (measured.activation_bytes, measured.released_bytes) == (kept, released) == (kept, 0)
    assert 0 < kept < activation_bytes(layer, make_input, lambda module, x: module(x))
    assert samples[events["gpt2.block.bwd_weight"].id].activation_bytes is None
    # what a further call of each half costs on the block, chained with itself (the timeline sheds it from
    # every such item of a step but the first); a head cannot follow itself: none
    for name in ("gpt2.block.bwd_input", "gpt2.block.bwd_weight"):
        assert 0 <= samples[events[name].id].backward_call_s < samples[events[name].id].samples_s.max()
    head = ComputeRunner(plan.spec, events["gpt2.head.bwd_input"].content, torch.device("cpu"), copies=1)
    assert measure_split_call(head, torch.device("cpu")) is None


def test_a_heads_input_gradient_lets_go_of_the_loss_part():
    """Above a head's last weight is the loss: once stage_backward_input has run and the loss is dropped, the
    log-probabilities it saved (micro x seq x vocab floats) go, which a stage's last layer then no longer holds."""
    from harness.profile.memory import kept_for_weights

    plan = build_plan(loads_spec(tiny_spec_text(layers=2, pp=2, hidden=64, heads=4, ffn=128, seq=16, vocab=128,
                                                micro=2, schedule="zb-h1")))
    (event,) = [e for e in plan.events.values() if e.name == "gpt2.head.bwd_input"]
    runner = ComputeRunner(plan.spec, event.content, torch.device("cpu"), copies=1)
    targets = torch.randint(0, 128, (2, 16))
    kept, released = kept_for_weights(runner.layers[0], runner.make_input,
                                      lambda module, x: module.loss(module(x), targets))
    assert released >= 2 * 16 * 128 * 4 and kept >= 2 * 16 * 128 * 4  # log-probs go; the logits' gradient stays

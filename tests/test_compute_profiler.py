"""The compute profiler on one process: round-robin samples, cold-cache copies, accumulated gradients."""
from __future__ import annotations

import numpy as np
import torch

from harness.events import build_plan
from harness.profilers.compute import ComputeRunner, last_level_cache_bytes, measure_compute_share
from harness.spec import loads_spec
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

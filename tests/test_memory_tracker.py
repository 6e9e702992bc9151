"""The memory model against PyTorch's own accounting (torch.distributed._tools.mem_tracker.MemTracker), which
sees every storage an operator makes, the backward's temporaries included: one device trains the project's
model with the real engine under it, the model predicts from the profiler's own activation measurements."""
from __future__ import annotations

import gc

import pytest
import torch

from analysis.memory import estimate_memory
from harness.plan.events import build_plan
from harness.plan.spec import parse_spec
from harness.profile.compute import measure_compute_share
from harness.profile.memory import pytorch_tracker, tracker_peak
from harness.train.engine import PipelineEngine
from harness.train.model import build_layers, make_tokens
from tests.test_analysis_helpers import make_spec


def _one_device(schedule: str, micro: int):
    data = make_spec(pp=1, micro_batches=4, micro=micro, layers=2, schedule=schedule, hidden=64, seq=32).to_dict()
    data["model"]["vocab"] = 512
    return parse_spec(data)


@pytest.mark.parametrize("schedule,micro", [("gpipe", 2), ("1f1b", 2), ("gpipe", 1)])
def test_the_model_meets_pytorchs_own_peak(schedule, micro):
    """GPipe peaks in its first backward with every micro-batch in flight, 1F1B with one and the gradients
    made; micro = 1 moves the head's worst moment from its loss to its projection. The model is within 2% of
    MemTracker's peak, and its temporaries are what MemTracker counts as such at its peak within 10%."""
    spec = _one_device(schedule, micro)
    plan = build_plan(spec)
    forwards = {eid: e.content for eid, e in plan.events.items()
                if e.kind == "compute" and e.content.get("phase") == "fwd"}
    measured = measure_compute_share(spec, forwards, torch.device("cpu"), warmup=0, repeats=1)
    memory = estimate_memory(plan, {eid: m.activation_bytes for eid, m in measured.items()})
    (stage,) = memory.stages
    modules = build_layers(spec, plan.layers, plan.stages[0].layers, seed=0)
    engine = PipelineEngine(spec=spec, plan=plan, rank=0, device=torch.device("cpu"), modules=modules)
    tokens = make_tokens(spec, 0)
    try:
        with pytorch_tracker() as tracker:
            tracker.track_external(*modules.values())
            for iteration in range(3):
                engine.run_iteration(iteration, tokens)
    finally:
        engine.close()
    peak = tracker_peak(tracker)
    assert peak["optstate"] > 0 and peak["parameter"] == stage.weights
    assert abs(stage.total - peak["total"]) / peak["total"] < 0.02, (stage.to_dict(), peak)
    assert stage.temporaries == pytest.approx(peak["temp"], rel=0.1)
    # the meter, which leaves temporaries out, is met by the model's peak without them
    assert abs(stage.metered - engine.memory.peak) / engine.memory.peak < 0.01


def test_a_stage_input_is_freed_under_the_tracker():
    """A leaf input (a later pipeline stage's received activation) is let go after its backward under the
    tracker, as without it: the tracker's module hooks on it would otherwise keep every micro-batch's alive."""
    import weakref

    from harness.models import build_layer

    block = build_layer(_one_device("gpipe", 2).model, "block")
    inputs = []
    with pytorch_tracker() as tracker:
        for _ in range(3):
            x = torch.randn(2, 32, 64, requires_grad=True)
            inputs.append(weakref.ref(x))
            block(x).sum().backward()
            del x
            gc.collect()
    assert not any(ref() is not None for ref in inputs)
    assert tracker_peak(tracker)["temp"] > 0


def test_the_trackers_peak_leaves_out_the_meta_device():
    """A factory model is described by tracing it on the meta device, inside harness train and so inside the
    tracker: MemTracker counts those tensors, which hold no memory, under the meta device."""
    with pytorch_tracker() as tracker:
        with torch.device("meta"):
            traced = torch.nn.Linear(256, 256)
            traced(torch.zeros(4, 256))
        real = torch.nn.Linear(64, 64)
        real(torch.zeros(4, 64)).sum().backward()
    peak = tracker_peak(tracker)
    real_params = sum(p.numel() * p.element_size() for p in real.parameters())
    assert peak["parameter"] == real_params
    assert peak["total"] < 256 * 256 * 4  # the meta layer's weight alone would be more
    assert any(torch.device(d).type == "meta" for d in tracker.get_tracker_snapshot("peak"))  # it was counted there

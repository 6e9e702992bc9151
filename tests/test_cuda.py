"""The GPU paths: CUDA-event timing with the host ahead, the runner's host issue times, the layer clock of
`harness train --layer-times`, a one-GPU profile end to end. They run where torch sees a CUDA device
(bench/gpu_check.sh runs them there) and skip elsewhere."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import h5py
import pytest
import torch

from harness.plan.events import build_plan
from harness.plan.spec import loads_spec
from harness.profile.compute import ComputeRunner
from harness.profile.timer import can_time_issued, time_issued, time_region
from harness.store.hdf5_io import plain
from harness.store.hdf5_schema import HOST_ISSUE_SERIES
from tests.helpers import tiny_spec_text, write_spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_time_issued_times_the_device_alone_with_the_host_ahead():
    device = torch.device("cuda", 0)
    assert can_time_issued(device)
    x = torch.randn(256, 256, device=device)
    run = lambda: [x.mul_(1.0) for _ in range(200)]  # noqa: E731 (many tiny kernels: launch-bound alone)
    for _ in range(3):
        run()
    issued = [time_issued(run, device, lead_s=0.05) for _ in range(5)]
    isolated = sorted(time_region(run, device) for _ in range(5))[2]
    assert all(s.ahead for s in issued)
    device_s = sorted(s.device_s for s in issued)[2]
    host_s = sorted(s.host_s for s in issued)[2]
    assert 0 < device_s < isolated  # the launch gaps are gone
    assert host_s > device_s  # 200 launches take the host longer than the GPU needs for them
    assert not time_issued(run, device, lead_s=1e-7).ahead  # too short a lead is noticed


def test_gpu_runner_notes_host_issue_for_forward_and_backward_only():
    spec = loads_spec(tiny_spec_text(hidden=64, ffn=128, seq=32))
    plan = build_plan(spec)
    device = torch.device("cuda", 0)
    for event in plan.events.values():
        runner = ComputeRunner(spec, event.content, device)
        seconds = [runner.sample() for _ in range(3)]
        assert all(s > 0 for s in seconds), event.name
        if event.content["phase"] == "optimizer":
            assert not runner.issued and runner.last_host_s is None
        else:
            assert runner.issued and runner.chain > 1 and runner.last_host_s > 0, event.name


def test_one_gpu_profile_stores_host_issue_and_the_prediction_uses_it(tmp_path, project_env):
    spec = write_spec(tmp_path / "job.toml", hidden=64, ffn=128, seq=32, repeats=3,
                      extra='device = "cuda"\n')
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "harness", "profile", str(spec), "-o", str(out), "--quiet"],
                         env=project_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    with h5py.File(out / "profile.h5") as f:
        assert plain(f["environment"].attrs["device"]).startswith("cuda:")
        for eid, g in f["measurements"].items():
            phase = json.loads(plain(g.attrs["content_json"]))["phase"]
            assert (HOST_ISSUE_SERIES in g) == (phase in ("fwd", "bwd")), eid
            if HOST_ISSUE_SERIES in g:
                assert g[HOST_ISSUE_SERIES].shape == g["samples_s"].shape
    report = subprocess.run([sys.executable, "-m", "analysis", "simulate", str(out / "profile.h5"), "--json"],
                            env=project_env, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    rows = json.loads(report.stdout)["compute_host_issue"]
    assert rows and all(r["host_issue_s"] > 0 and r["device_s"] > 0 for r in rows)


def test_layer_clock_reads_cuda_events_as_host_nanoseconds():
    from harness.train.layer_times import LayerClock

    clock = LayerClock(torch.device("cuda"))
    torch.cuda.synchronize()
    start_ns = time.perf_counter_ns()
    anchor = clock.mark()
    torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time, whatever the clock rate
    mark = clock.mark()
    torch.cuda.synchronize()
    host_ns = time.perf_counter_ns() - start_ns
    gpu_ns = clock.to_ns(start_ns, anchor, mark) - start_ns
    assert 0 < gpu_ns <= host_ns + 1_000_000


def test_a_chains_backward_spans_the_step_as_harness_trains_clock_reads_it():
    """In context on a GPU: the chain's backward samples of a stage add up to its backward step timed the way
    harness train's clock reads it (synchronized at its start and end), the host's start of autograd's engine
    included (the device idles through it in the run)."""
    from harness.profile.compute import _forward
    from harness.profile.in_context import ChainRunner, stage_chains

    spec = loads_spec(tiny_spec_text(hidden=64, ffn=128, seq=32))
    plan = build_plan(spec)
    (chain,) = stage_chains([plan])
    contents = {eid: e.content for eid, e in plan.events.items()}
    device = torch.device("cuda", 0)
    runner = ChainRunner(spec, chain, contents, device)
    for _ in range(3):
        runner.run()
    backward = set(chain.backward)  # backward events only: each sample of theirs is a backward's
    in_chain = sorted(sum(sum(seconds) for eid, seconds in runner.run().items() if eid in backward)
                      for _ in range(15))[7]
    steps = []
    for _ in range(15):
        x = runner.make_input()
        for layer, content in zip(runner.layers, runner.contents):
            x = _forward(spec, layer, x, content)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        x.backward(None if x.dim() == 0 else torch.randn_like(x))
        torch.cuda.synchronize(device)
        steps.append(time.perf_counter() - start)
    step = sorted(steps)[7]
    assert 0.75 < in_chain / step < 1.25, (in_chain, step)

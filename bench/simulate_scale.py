"""Benchmark: simulate one iteration of a 16,384-GPU GPT-3-like job from a synthetic profile.

dp=256 x tp=8 x pp=8 on 2,048 nodes of 8 GPUs; 96 layers, hidden 12288, 96 heads, ffn 49152, seq 2048,
micro-batch 1, global batch 16384 (64 micro-batches per pipeline), from a synthetic 2-node profile
(bench/synthetic.py), so the data-parallel all-reduce over 256 ranks is extrapolated by the alpha-beta fit.

    python bench/simulate_scale.py [--runs N] [--keep DIR]

Prints each phase's time (the best of N runs) and events simulated per second; exits 1 if loading the
profile and simulating take 1 s or more.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.costs import estimate_costs  # noqa: E402
from analysis.devices import select_devices  # noqa: E402
from analysis.profile_reader import layers_for, load_profile, resolve_spec  # noqa: E402
from analysis.report import summary  # noqa: E402
from analysis.simulate import simulate  # noqa: E402
from bench.synthetic import write_synthetic_profile  # noqa: E402
from harness.plan.events import build_plan  # noqa: E402
from harness.plan.spec import parse_spec  # noqa: E402

SPEC = {
    "model": {"name": "gpt2-xl", "layers": 96, "hidden": 12288, "heads": 96, "ffn": 49152, "seq_len": 2048,
              "vocab": 51200, "dtype": "bfloat16"},
    "batch": {"global": 16384, "micro": 1},
    "strategy": {"dp": 256, "tp": 8, "pp": 8, "schedule": "1f1b", "dp_overlap": True},
    "cluster": {"nodes": 2048, "gpus_per_node": 8},
    "profile": {"warmup": 5, "repeats": 20},
}
def timed(function, runs: int):
    best, result = float("inf"), None
    for _ in range(runs):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="repeat each phase, keep the best (default 5)")
    parser.add_argument("--keep", type=Path, help="write the synthetic profile here and keep it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = (args.keep or Path(tmp)) / "profile.h5"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic_profile(path, parse_spec(SPEC, source="bench"), np.random.default_rng(0))
        t_load, profile = timed(lambda: load_profile(path), args.runs)
        spec = resolve_spec(profile)
        t_plan, plan = timed(lambda: build_plan(spec, layers_for(profile, spec)), args.runs)
        t_costs, costs = timed(lambda: estimate_costs(plan, profile), args.runs)
        t_sim, timeline = timed(lambda: simulate(plan, costs), args.runs)
        all_ranks, _ = select_devices(spec, "all")
        t_expand, report = timed(lambda: summary(timeline, all_ranks, "all", path), args.runs)
        total = t_load + t_plan + t_costs + t_sim
    s = spec.strategy
    steps = sum(len(d.steps) for d in timeline.pipeline)
    print(f"{s.world:,} GPUs: dp={s.dp} tp={s.tp} pp={s.pp} {s.schedule}, {spec.model.layers} layers, "
          f"{spec.micro_batches} micro-batches; {plan.unique_events} unique events, {plan.total_events:,} in the "
          f"iteration; {steps} pipeline steps simulated")
    print(f"predicted batch time {timeline.batch_time_s:.3f} s, {timeline.throughput_tokens_s:,.0f} tokens/s, "
          f"bubble {timeline.bubble_fraction:.1%}; {len(costs.extrapolated)} extrapolated events, fit errors "
          + ", ".join(f"{k}/{p} {f.max_rel_error:.1%}" for (k, p), f in costs.fits.items()))
    for name, seconds in (("load profile.h5", t_load), ("build plan", t_plan), ("cost events", t_costs),
                          ("simulate", t_sim), ("per-device summary of all 16,384 devices", t_expand)):
        print(f"  {name:<42} {seconds * 1e3:8.2f} ms")
    print(f"  {'load + plan + costs + simulate':<42} {total * 1e3:8.2f} ms")
    print(f"events per second: {plan.total_events / t_sim:,.0f} (simulate), "
          f"{plan.total_events / total:,.0f} (load to timeline)")
    if len(report["devices"]) != s.world:
        print("error: the summary does not cover every device", file=sys.stderr)
        return 1
    if total >= 1.0:
        print(f"error: {total:.3f} s is over the 1 s budget", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

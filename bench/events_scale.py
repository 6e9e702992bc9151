"""Event generation at scale: a 16,384-GPU job (dp=256, tp=8, pp=8, 96 layers, 64 micro-batches), and the
same job with ever more identical layers.

Prints the time to build the unique-event table and the de-duplication ratio (target: well under 1 s), then
the build time per layer as the layer count grows to the spec's limit (identical layers share their events:
it should stay flat, a few microseconds).
Run: .venv/bin/python bench/events_scale.py
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.plan.events import build_plan  # noqa: E402
from harness.plan.spec import loads_spec  # noqa: E402

SPEC = """
[model]
name = "gpt2-xl"          # GPT-3-175B sizes on the GPT-2 family
layers = 96
hidden = 12288
heads = 96
ffn = 49152
seq_len = 2048
vocab = 51200             # GPT-3 padded for tp = 8 as Megatron-LM pads it (a multiple of 128 x tp)
[batch]
global = 16384
micro = 1
[strategy]
dp = 256
tp = 8
pp = 8
schedule = "{schedule}"
{chunks}
[cluster]
nodes = 2048
gpus_per_node = 8
"""


def main() -> None:
    print(f"{'schedule':<18} {'build (ms, median of 5)':>24} {'unique':>7} {'total events':>14} {'dedup ratio':>14}")
    for schedule, chunks in (("1f1b", ""), ("interleaved-1f1b", "chunks = 2")):
        spec = loads_spec(SPEC.format(schedule=schedule, chunks=chunks))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            plan = build_plan(spec)
            times.append(time.perf_counter() - t0)
        s = plan.summary()
        print(f"{schedule:<18} {statistics.median(times) * 1e3:>24.1f} {s['unique_events']:>7} "
              f"{s['total_events']:>14,} {s['dedup_ratio']:>14,.0f}")
    t0 = time.perf_counter()
    flow = sum(1 for _ in plan.device_flow(spec.strategy.world - 1))
    print(f"materialising one device's flow on demand: {flow} events in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    print(f"\n{'layers':>8} {'build (ms)':>11} {'us per layer':>13} {'unique':>7}")
    for layers in (96, 1_024, 8_192, 65_536):
        text = SPEC.format(schedule="1f1b", chunks="").replace("layers = 96", f"layers = {layers}")
        spec = loads_spec(text)
        t0 = time.perf_counter()
        plan = build_plan(spec)
        elapsed = time.perf_counter() - t0
        print(f"{layers:>8,} {elapsed * 1e3:>11.1f} {elapsed / layers * 1e6:>13.2f} {plan.unique_events:>7}")


if __name__ == "__main__":
    main()

"""The machine's own drift: the same fixed work on every core, timed over a minute, in windows.

Accuracy figures mean little without the noise floor they were measured on. Each core runs one process that
repeats a fixed piece of work (matrix products over weights larger than the last-level cache, one thread,
as a profiled layer is) and times every repeat. The table shows each core's median per window; the summary
gives the spread of the window medians (max over min), their relative standard deviation, and how much
the two cores differ in the same window (what data-parallel replicas see as skew at their all-reduce).
Run: .venv/bin/python bench/machine_noise.py [--seconds 60] [--window 5] [--cores N]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import numpy as np


def _probe(seconds: float, start_at: float, out: mp.Queue) -> None:
    import torch

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    activations = torch.randn(256, 1024, generator=generator)
    weights = [torch.randn(1024, 1024, generator=generator) for _ in range(12)]  # 48 MiB: beyond a 32 MiB L3
    while time.time() < start_at:  # start together, so the windows line up across cores
        time.sleep(0.001)
    samples = []
    while time.time() < start_at + seconds:
        t0 = time.perf_counter()
        for w in weights:
            activations @ w
        samples.append((time.time() - start_at, time.perf_counter() - t0))
    out.put((os.getpid(), samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=5.0, help="seconds per window")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="processes, one per core")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    start_at = time.time() + 3.0
    procs = [ctx.Process(target=_probe, args=(args.seconds, start_at, queue)) for _ in range(args.cores)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    windows = int(np.ceil(args.seconds / args.window))
    table = np.full((len(results), windows), np.nan)
    for core, (_, samples) in enumerate(results):
        for w in range(windows):
            inside = [d for t, d in samples if w * args.window <= t < (w + 1) * args.window]
            if inside:
                table[core, w] = np.median(inside)
    print(f"median ms of the fixed work per {args.window:g} s window, one row per core:")
    for core in range(len(results)):
        print(f"  core {core}: " + " ".join(f"{v * 1e3:6.1f}" for v in table[core]))
    flat = table[~np.isnan(table)]
    print(f"window medians: spread (max/min) {flat.max() / flat.min():.3f}, relative std "
          f"{flat.std() / flat.mean() * 100:.1f}%")
    if len(results) > 1:
        skew = (np.nanmax(table, axis=0) - np.nanmin(table, axis=0)) / np.nanmean(table, axis=0) * 100
        print(f"between cores in the same window: median {np.median(skew):.1f}%, max {skew.max():.1f}%")


if __name__ == "__main__":
    main()

"""Benchmark: how the time and memory of `analysis breakdown` grow with the size of a PyTorch profiler trace.

Writes synthetic Kineto traces of one rank, GPU-like (kernels on two streams: compute, NCCL, memcpy, with the
CPU operators that launch them) and CPU-like (nested operators on a main thread, gloo's thread alongside), of
growing numbers of events, and times `analysis breakdown` on each in a fresh process: reading the trace,
the breakdown, and the peak resident memory over that of the same process before reading. For scale, the peak
of `json.load` of the same file is measured too.

    python bench/breakdown_scale.py [--events 10000,100000,1000000] [--keep DIR]

Prints one row per trace; exits 1 if any trace needs more than 3 times its JSON size in memory.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.common.output import format_table  # noqa: E402

MEMORY_LIMIT = 3.0  # peak memory over JSON size

MEASURE = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[3])
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
if sys.argv[1] == "json":
    before = rss()
    start = time.perf_counter()
    with open(sys.argv[2]) as f:
        data = json.load(f)
    seconds = time.perf_counter() - start
else:
    from analysis.activity import load_run
    from analysis.breakdown import breakdown
    import analysis.breakdown, numpy
    before = rss()
    start = time.perf_counter()
    run = load_run(sys.argv[2])
    read = time.perf_counter() - start
    result = breakdown(run)
    seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "peak_bytes": peak - before, "read_s": read if sys.argv[1] != "json" else None}))
"""


def write_trace(path: Path, events: int, gpu: bool, seed: int = 0) -> int:
    """A trace of about `events` complete events; returns how many it holds."""
    rng = random.Random(seed)
    written = 0
    t = 1_000_000.0
    with path.open("w") as f:
        f.write('{"schemaVersion": 1, "deviceProperties": [], '
                '"distributedInfo": {"backend": "%s", "rank": 0, "world_size": 8}, "traceEvents": [\n'
                % ("nccl" if gpu else "gloo"))
        first = True

        def put(event: dict) -> None:
            nonlocal first, written
            f.write(("" if first else ",\n") + json.dumps(event))
            first = False
            written += 1
        steps = max(1, events // 2000)
        per_step = events // steps
        for step in range(steps):
            start = t
            for i in range(per_step // 2 if gpu else per_step // 4):
                dur = rng.uniform(5, 50)
                if gpu:
                    put({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t,
                         "dur": 3.0, "args": {"correlation": written}})
                    kind = rng.random()
                    name, cat, tid = (("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 20) if kind < 0.1 else
                                      ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 7) if kind < 0.15 else
                                      ("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 7))
                    put({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": t + 4, "dur": dur,
                         "args": {"device": 0, "stream": tid, "correlation": written, "grid": [1, 1, 1]}})
                    t += dur * 0.9
                else:
                    put({"ph": "X", "cat": "user_annotation", "name": "DistributedDataParallel.forward", "pid": 1,
                         "tid": 1, "ts": t, "dur": 3 * dur, "args": {"External id": written}})
                    put({"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 1, "tid": 1, "ts": t + 1,
                         "dur": dur, "args": {"External id": written, "Sequence number": i}})
                    put({"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 1, "tid": 1,
                         "ts": t + dur + 2, "dur": 5.0, "args": {"External id": written}})
                    put({"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 2,
                         "ts": t + dur + 4, "dur": 2 * dur, "args": {"External id": written}})
                    t += 3.5 * dur
            put({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                 "ts": start, "dur": t - start, "args": {}})
            t += 100
        f.write('\n], "traceName": "synthetic"}\n')
    return written


def measure(what: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, what, str(path), str(REPO)], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", default="10000,100000,1000000",
                        help="trace sizes in complete events, comma separated (default 10000,100000,1000000)")
    parser.add_argument("--keep", type=Path, help="write the traces here and keep them")
    args = parser.parse_args()
    sizes = [int(s) for s in args.events.split(",")]
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for gpu in (True, False):
            for size in sizes:
                path = folder / f"rank-0-{'gpu' if gpu else 'cpu'}-{size}.json"
                count = write_trace(path, size, gpu)
                mb = path.stat().st_size / 1e6
                ours, baseline = measure("breakdown", path), measure("json", path)
                ratio = ours["peak_bytes"] / path.stat().st_size
                worst = max(worst, ratio)
                rows.append(("GPU" if gpu else "CPU", count, f"{mb:.1f}", f"{ours['read_s']:.2f}",
                             f"{ours['seconds']:.2f}", f"{count / ours['seconds'] / 1e3:.0f}",
                             f"{ours['peak_bytes'] / 1e6:.0f}", f"{ratio:.2f}",
                             f"{baseline['peak_bytes'] / 1e6:.0f}",
                             f"{baseline['peak_bytes'] / path.stat().st_size:.1f}"))
                if not args.keep:
                    path.unlink()
    print(format_table(("trace", "events", "JSON MB", "read s", "total s", "k events/s", "peak MB", "peak/size",
                        "json.load MB", "json.load/size"), rows,
                       title="analysis breakdown on one rank's synthetic Kineto trace (a fresh process each)"))
    print(f"worst peak memory: {worst:.2f}x the trace's JSON size (limit {MEMORY_LIMIT:.0f}x)")
    return 0 if worst <= MEMORY_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())

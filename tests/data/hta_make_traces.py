"""Make tests/data/hta_ddp/: two ranks' synthetic Kineto traces of a data-parallel GPU job, built to exercise every
rule of HolisticTraceAnalysis's temporal breakdown and reader (tests/test_hta_figures.py pins HTA 0.5.0's figures
on them).

    python tests/data/hta_make_traces.py tests/data/hta_ddp

Each rank runs three profiler steps (CPU `ProfilerStep#1-3`). In each step the CPU loads data (the GPU may idle),
then launches (`cudaLaunchKernel`,
`cudaMemsetAsync`, `cudaMemcpyAsync`, `cudaStreamSynchronize`, each tied to its GPU event by a correlation id)
a memset, forward kernels, then backward kernels with an NCCL all-reduce on its own stream that starts once the
fourth one ends and outlasts them, then, once it ends, a CUB batch-memcpy kernel (HTA counts it as neither
compute nor communication), a device-to-host copy and
a stream synchronisation; `## forward ##` and `## backward ##` GPU annotations cover the two passes. The GPU
idles while the CPU loads data, but in step 2, shorter on the CPU: the work launched late in it still runs
after step 3 has begun there. Rank 0
writes times with fractions of a microsecond (HTA rounds them), rank 1 whole microseconds and, as newer
profilers do, a GPU `ProfilerStep#3` annotation that starts after the CPU's (HTA cuts at the later one).
Durations come from a seeded generator: the same files every time.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

STEPS = 3
ORIGIN_US = 5_000_000  # small absolute times keep fractions of a microsecond exact in float64
GPU_PID, COMPUTE_STREAM, NCCL_STREAM = 0, 7, 20


class Rank:
    def __init__(self, rank: int, fractional: bool):
        self.rank, self.fractional = rank, fractional
        self.random = random.Random(1000 + rank)
        self.events: list[dict] = []
        self.correlation = 1000 * (rank + 1)
        self.stream_free = {COMPUTE_STREAM: 0.0, NCCL_STREAM: 0.0}

    def time(self, us: float) -> float | int:
        return round(us, 3) if self.fractional else int(round(us))

    def jitter(self, low: float, high: float) -> float:
        value = self.random.uniform(low, high)
        return value if self.fractional else float(round(value))

    def complete(self, cat: str, name: str, ts: float, dur: float, pid, tid, **args) -> dict:
        event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": self.time(ts),
                 "dur": self.time(dur), "args": args}
        self.events.append(event)
        return event

    def launch(self, runtime: str, cat: str, name: str, cpu_ts: float, dur: float, stream: int,
               queue_us: float = 6.0, after: float = 0.0) -> tuple[float, float]:
        """A CPU launch call and the GPU event it starts on `stream` once the stream is free (and not before
        `after`); its (start, end)."""
        self.correlation += 1
        self.complete("cuda_runtime", runtime, cpu_ts, 4.0, 100 + self.rank, 1, correlation=self.correlation)
        start = max(cpu_ts + queue_us, self.stream_free[stream] + 1.5, after)
        end = start + dur
        self.stream_free[stream] = end
        self.complete(cat, name, start, dur, GPU_PID, stream, device=0, stream=stream, correlation=self.correlation)
        return start, end

    def step(self, number: int, start: float, length: float) -> None:
        cpu = 100 + self.rank
        self.complete("user_annotation", f"ProfilerStep#{number}", start, length, cpu, 1)
        now = start + 8 + self.jitter(40, 100)  # the data loader's time: the GPU may idle meanwhile
        memset, _ = self.launch("cudaMemsetAsync", "gpu_memset", "Memset (Device)", now, 2.4, COMPUTE_STREAM)
        if number == STEPS and self.rank == 1:  # a GPU-side step mark, as newer profilers write
            self.complete("gpu_user_annotation", f"ProfilerStep#{number}", memset, length, GPU_PID, COMPUTE_STREAM)
        now += 10
        forward = []
        for _ in range(4):
            self.complete("cpu_op", "aten::addmm", now, 14, cpu, 1)
            forward.append(self.launch("cudaLaunchKernel", "kernel", "volta_sgemm_128x64_nn", now + 3,
                                       self.jitter(40, 90), COMPUTE_STREAM))
            now += 22
        self.complete("gpu_user_annotation", "## forward ##", forward[0][0], forward[-1][1] - forward[0][0], GPU_PID,
                      COMPUTE_STREAM)
        backward, reduced = [], 0.0
        for layer in range(5):
            self.complete("cpu_op", "aten::mm", now, 12, cpu, 1)
            backward.append(self.launch("cudaLaunchKernel", "kernel", "volta_sgemm_64x64_nt", now + 2,
                                        self.jitter(50, 110), COMPUTE_STREAM))
            if layer == 3:  # DDP's bucket all-reduce once its gradients are made, on its own stream
                self.complete("cpu_op", "c10d::allreduce_", now + 6, 10, cpu, 1)
                _, reduced = self.launch("cudaLaunchKernel", "kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                                         now + 8, self.jitter(150, 260), NCCL_STREAM, queue_us=self.jitter(5, 40),
                                         after=backward[-1][1])
            now += 20
        self.complete("gpu_user_annotation", "## backward ##", backward[0][0], backward[-1][1] - backward[0][0],
                      GPU_PID, COMPUTE_STREAM)
        self.launch("cudaLaunchKernel", "kernel", "void cub::detail::batch_memcpy::BatchMemcpyKernel", now,
                    self.jitter(8, 15), COMPUTE_STREAM, after=reduced)  # the optimizer waits for the all-reduce
        now += 10
        _, copied = self.launch("cudaMemcpyAsync", "gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", now,
                                self.jitter(10, 20), COMPUTE_STREAM)
        now += 10
        self.correlation += 1
        self.complete("cuda_runtime", "cudaStreamSynchronize", now, max(copied - now, 1.0) + 3, cpu, 1,
                      correlation=self.correlation)
        self.complete("cuda_sync", "Stream Sync", now + 1, max(copied - now, 1.0) + 2, GPU_PID, COMPUTE_STREAM,
                      device=0, stream=COMPUTE_STREAM, correlation=self.correlation)


def make_rank(rank: int) -> dict:
    maker = Rank(rank, fractional=rank == 0)
    start = ORIGIN_US + (0.437 if rank == 0 else 0)
    for number in range(1, STEPS + 1):
        # the GPU keeps up with the CPU but in step 2, whose work runs on into step 3
        length = maker.jitter(760, 800) if number == 2 else maker.jitter(900, 980)
        maker.step(number, start, length)
        start += length + maker.jitter(2, 5)
    events = sorted(maker.events, key=lambda e: (e["ts"], -e["dur"]))
    events.append({"ph": "M", "name": "thread_name", "pid": GPU_PID, "tid": NCCL_STREAM, "ts": ORIGIN_US,
                   "args": {"name": "stream 20"}})
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
            "deviceProperties": [{"id": 0, "name": "synthetic GPU"}], "traceEvents": events}


def main(out: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        (folder / f"rank-{rank}.json").write_text(json.dumps(make_rank(rank), indent=0) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent / "hta_ddp"))

"""The host time a pipeline's P2P costs a step in `harness train`, against what the profile measures (prints a table).

    mpirun --bind-to core -n 2 .venv/bin/python -m mpi4py bench/p2p_host_cost.py [--kib 32] [--repeats 300]

Per repeat, interleaved and with the order alternated, on a torch.distributed gloo pair:
  post, as profiled    the sender's time in `dist.isend` with the receiver waiting (harness.profile.comm's post sample)
  post, as the run     the same through the run's path (harness.runtime.inflight.post_send, which the profile
                       now times too: detach and contiguous, isend, the memory count's hold, the Completer's
                       hand-off to its watcher thread)
  transfer             half a ping-pong's round trip (the profile's P2P sample, which the timeline charges from
                       the later of the send and the receive's post)
  late receive         the receiver's time in a receive it posts 3 ms after the send (the run's receive: a
                       buffer, its hold, irecv and wait), which the timeline charges as the transfer alone
The run's cost beyond the profile's, per step that sends and per step that receives late, is what a timeline
without it leaves out (docs/benchmarks-log/in-context.md).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from harness.profile.memory import LiveStorages
from harness.runtime.inflight import Completer, post_send

SEND_DELAY_S = 0.002  # the sender posts this long after the barrier, the receiver already waiting
LATE_RECEIVE_S = 0.003  # the receiver posts this long after the sender's send
WARMUP = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=32, help="message size in KiB (default 32)")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        raise SystemExit("bench/p2p_host_cost.py: run it on 2 ranks (mpirun -n 2)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(comm.bcast(29500 + os.getpid() % 1000 if rank == 0 else None, root=0)))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    data = torch.randn(args.kib * 256)
    back = torch.empty_like(data)
    completer, meter = Completer(poll=False, timeout_s=60), LiveStorages()
    samples: dict[str, list[float]] = {"post, as profiled": [], "post, as the run": [], "transfer": [],
                                       "late receive": []}
    for i in range(WARMUP + args.repeats):
        keep = i >= WARMUP
        for mode in (("bare", "run") if i % 2 else ("run", "bare")):
            comm.Barrier()
            if rank == 0:
                time.sleep(SEND_DELAY_S)
                start = time.perf_counter_ns()
                if mode == "bare":
                    work = dist.isend(data, 1, tag=4 * i)
                    posted = time.perf_counter_ns()
                    work.wait()
                else:
                    pending = post_send(data, 1, {"tag": 4 * i + 1}, completer, meter, start)
                    posted = time.perf_counter_ns()
                    completer.wait(pending)
                if keep:
                    name = "post, as profiled" if mode == "bare" else "post, as the run"
                    samples[name].append((posted - start) / 1e9)
            else:
                dist.recv(back, 0, tag=4 * i + (mode == "run"))
        comm.Barrier()  # a ping-pong: the transfer
        start = time.perf_counter_ns()
        if rank == 0:
            dist.send(data, 1, tag=4 * i + 2)
            dist.recv(back, 1, tag=4 * i + 2)
            if keep:
                samples["transfer"].append((time.perf_counter_ns() - start) / 2e9)
        else:
            dist.recv(back, 0, tag=4 * i + 2)
            dist.send(back, 0, tag=4 * i + 2)
        comm.Barrier()  # a receive posted after its send
        if rank == 0:
            dist.isend(data, 1, tag=4 * i + 3).wait()
        else:
            time.sleep(LATE_RECEIVE_S)
            start = time.perf_counter_ns()
            buffer = torch.empty_like(data)
            meter.hold_while(buffer, buffer, "activations")
            dist.irecv(buffer, src=0, tag=4 * i + 3).wait()
            if keep:
                samples["late receive"].append((time.perf_counter_ns() - start) / 1e9)
    gathered = comm.gather(samples, root=0)
    completer.close()
    dist.destroy_process_group()
    if rank == 0:
        merged = {name: [v for part in gathered for v in part[name]] for name in samples}
        print(f"P2P of {args.kib} KiB between 2 ranks, gloo, {args.repeats} repeats (medians, p90)")
        print("| what | median us | p90 us |")
        print("|---|---|---|")
        for name, values in merged.items():
            print(f"| {name} | {np.median(values) * 1e6:.0f} | {np.percentile(values, 90) * 1e6:.0f} |")
        post = np.median(merged["post, as the run"]) - np.median(merged["post, as profiled"])
        receive = np.median(merged["late receive"]) - np.median(merged["transfer"])
        print(f"left out of a timeline per step: {post * 1e6:.0f} us after one that sends, "
              f"{receive * 1e6:.0f} us before one whose input waited for its receive")


if __name__ == "__main__":
    main()

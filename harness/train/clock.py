"""Clock alignment of the ranks of a run: Cristian's algorithm over MPI ping-pongs (mpi4py and numpy only).

Rank 0 exchanges `samples` ping-pongs with every other rank in turn; for each it keeps the exchange with the
smallest round trip and estimates offset = t_rank - (t0 + t1) / 2 (the rank's clock minus rank 0's; the
error is at most half that round trip). Ranks on rank 0's host share its clock when `perf_counter` is the
system-wide CLOCK_MONOTONIC (Linux): their applied offset is exactly 0 and the estimate is kept only as a
check of the method. Two syncs (before and after training) give a linear drift correction.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import numpy as np

_TAG = 7301


def shared_host_clock() -> bool:
    """True when perf_counter reads a clock shared by every process of the host."""
    info = time.get_clock_info("perf_counter")
    return "CLOCK_MONOTONIC" in info.implementation and "RAW" not in info.implementation


@dataclass
class ClockSync:
    """One sync of every rank's clock against rank 0 (nanoseconds of each rank's perf_counter_ns)."""

    reference_ns: int  # rank 0's clock at the sync
    measured_ns: np.ndarray  # estimated offset of every rank (rank clock - rank 0 clock)
    rtt_ns: np.ndarray  # round trip of the chosen exchange (0 for rank 0)
    applied_ns: np.ndarray  # the offset used: 0 on rank 0's host with a shared clock, else the estimate
    method: list[str]  # "reference" | "same-host" | "cristian"


def sync_clocks(comm, samples: int = 20) -> ClockSync:
    """Collective: estimate every rank's clock offset to rank 0; every rank gets the whole result."""
    rank, size = comm.Get_rank(), comm.Get_size()
    same_host = comm.allgather(socket.gethostname())
    shared = comm.allgather(shared_host_clock())
    out = np.zeros(1, dtype=np.int64)
    back = np.zeros(1, dtype=np.int64)
    measured = np.zeros(size, dtype=np.int64)
    rtts = np.zeros(size, dtype=np.int64)
    comm.Barrier()
    reference = time.perf_counter_ns() if rank == 0 else 0
    for peer in range(1, size):
        if rank == 0:
            best_rtt, best_offset = None, 0
            for k in range(samples + 2):  # two warm-up exchanges
                t0 = time.perf_counter_ns()
                comm.Send(out, dest=peer, tag=_TAG)
                comm.Recv(back, source=peer, tag=_TAG)
                t1 = time.perf_counter_ns()
                if k < 2:
                    continue
                rtt = t1 - t0
                if best_rtt is None or rtt < best_rtt:
                    best_rtt, best_offset = rtt, int(back[0]) - (t0 + t1) // 2
            measured[peer], rtts[peer] = best_offset, best_rtt
        elif rank == peer:
            for _ in range(samples + 2):
                comm.Recv(back, source=0, tag=_TAG)
                back[0] = time.perf_counter_ns()
                comm.Send(back, dest=0, tag=_TAG)
    measured, rtts, reference = comm.bcast((measured, rtts, reference) if rank == 0 else None, root=0)
    applied = measured.copy()
    method = ["reference"] + ["cristian"] * (size - 1)
    for r in range(1, size):
        if same_host[r] == same_host[0] and shared[r] and shared[0]:
            applied[r] = 0
            method[r] = "same-host"
    return ClockSync(int(reference), measured, rtts, applied, method)


class Timebase:
    """Converts a rank's perf_counter_ns to seconds on rank 0's clock since `zero_ns` (rank 0's clock).

    With two syncs the offset is interpolated linearly in time (clock drift over the run).
    """

    def __init__(self, rank: int, zero_ns: int, first: ClockSync, last: ClockSync | None = None):
        self.rank = rank
        self.zero_ns = zero_ns
        self.offset0 = int(first.applied_ns[rank])
        self.t0 = first.reference_ns
        if last is not None and last.reference_ns > first.reference_ns:
            self.slope = (int(last.applied_ns[rank]) - self.offset0) / (last.reference_ns - first.reference_ns)
        else:
            self.slope = 0.0

    def seconds(self, local_ns: np.ndarray | int) -> np.ndarray:
        # Solve local = t + offset0 + slope * (t - t0) for t on rank 0's clock; differences in int64 first.
        since_sync = np.asarray(local_ns, dtype=np.int64) - np.int64(self.offset0 + self.t0)
        t_minus_zero = (self.t0 - self.zero_ns) + since_sync.astype(np.float64) / (1.0 + self.slope)
        return t_minus_zero / 1e9

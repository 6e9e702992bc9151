"""Collective benchmarks the nccl-tests way: operations, sizes and bandwidths (pure Python and numpy).

Rules (nccl-tests' PERFORMANCE.md, docs/collectives.md):
- a size is the bytes of the whole array: for all-gather the gathered output, for reduce-scatter the input
  that is scattered, for all-to-all one rank's whole send buffer; a rank of an n-rank all-gather sends
  size / n;
- a size is a whole number of elements, and for all-gather, reduce-scatter and all-to-all a whole number of
  elements per rank (`round_size`);
- algorithm bandwidth = size / time; bus bandwidth = algorithm bandwidth x the operation's factor
  (`BUS_FACTORS`), which makes figures comparable with the hardware's peak whatever the rank count;
  GB = 1e9 bytes;
- an iteration's time is that of its slowest rank; a size's time is the mean over its iterations.

`harness collectives` measures (harness.profile.collectives), `harness.store.collectives_file` stores, and the
analysis reads and compares (analysis.collectives) with these same definitions.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.common.errors import UserError

OPS = ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall", "sendrecv")
SPLIT_OPS = frozenset({"allgather", "reducescatter", "alltoall"})  # a size holds one share per rank
GROUPS = ("all", "intra", "inter")
ELEMENT_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4}
# the profile's kinds of communication that a benchmark operation measures too (analysis.costs)
PROFILE_KINDS = {"allreduce": "allreduce", "allgather": "allgather", "reducescatter": "reducescatter",
                 "sendrecv": "p2p", "alltoall": "alltoall"}
GB = 1e9
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _ring(n: int) -> float:
    return (n - 1) / n


BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 2 * _ring(n),
    "allgather": _ring,
    "reducescatter": _ring,
    "alltoall": _ring,
    "broadcast": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


def bus_factor(op: str, ranks: int) -> float:
    return BUS_FACTORS[op](ranks)


def parse_size(text: str, what: str) -> int:
    """'8', '64K', '64M', '1G' (powers of 1,024, as nccl-tests reads them) -> bytes; bad text is a UserError."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise UserError(f"{what}: {text!r} is not a size; give bytes as a whole number with an optional K, M or G "
                        "(powers of 1,024), e.g. 8, 64K, 64M")
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value <= 0:
        raise UserError(f"{what}: {text!r} is not a positive size")
    return value


MAX_SWEEP_SIZES = 10_000  # a sweep's sizes at most: each is measured (or modelled) and printed


def sweep_sizes(begin: int, end: int, factor: float) -> list[int]:
    """begin, begin x factor, ... up to end (nccl-tests' -b -e -f); end itself closes the sweep."""
    if begin > end:
        raise UserError(f"the smallest size (-b {begin}) is above the largest (-e {end}); give -b <= -e")
    if not factor > 1:
        raise UserError(f"-f {factor}: the factor between sizes must be above 1 (nccl-tests uses 2)")
    steps = math.log(end / begin) / math.log(factor) if end > begin else 0.0
    count = min(steps + 1, end - begin + 1)  # whole bytes: no more sizes than there are between the two
    if count > MAX_SWEEP_SIZES:
        raise UserError(f"-f {factor}: from {begin:,} to {end:,} bytes that is about {count:,.0f} sizes, more than "
                        f"{MAX_SWEEP_SIZES:,}; give a larger factor (nccl-tests uses 2)")
    sizes, size = [], float(begin)
    while size <= end * (1 + 1e-9):
        rounded = int(round(size))
        if not sizes or rounded > sizes[-1]:
            sizes.append(rounded)
        size = max(size * factor, rounded + 0.75)  # at least the next whole byte: a factor near 1 cannot stall
    if sizes[-1] < end:
        sizes.append(end)
    return sizes


def round_size(op: str, nbytes: int, dtype: str, ranks: int) -> int:
    """The nearest size of whole elements (and, for the split operations, whole elements per rank), at
    least one element per rank."""
    unit = ELEMENT_BYTES[dtype] * (ranks if op in SPLIT_OPS else 1)
    return max(unit, int(nbytes / unit + 0.5) * unit)  # halves up


def element_count(nbytes: int, dtype: str) -> int:
    return nbytes // ELEMENT_BYTES[dtype]


@dataclass(frozen=True)
class SizeResult:
    """One operation at one size: every timed iteration's time (its slowest rank), and how many output
    elements the check found wrong (summed over the ranks)."""

    op: str
    nbytes: int
    dtype: str
    ranks: int
    samples_s: np.ndarray
    wrong: int

    @property
    def elements(self) -> int:
        return element_count(self.nbytes, self.dtype)

    @property
    def mean_s(self) -> float:
        return float(np.mean(self.samples_s))

    @property
    def median_s(self) -> float:
        return float(np.median(self.samples_s))

    @property
    def algbw_gbs(self) -> float:
        return self.nbytes / self.mean_s / GB if self.mean_s > 0 else float("inf")

    @property
    def busbw_gbs(self) -> float:
        return self.algbw_gbs * bus_factor(self.op, self.ranks)

    def row(self) -> dict[str, Any]:
        """The nccl-tests columns, times in microseconds (JSON and the tables)."""
        s = self.samples_s
        return {"op": self.op, "bytes": self.nbytes, "count": self.elements, "type": self.dtype,
                "time_us": self.mean_s * 1e6, "median_us": self.median_s * 1e6,
                "min_us": float(s.min()) * 1e6, "max_us": float(s.max()) * 1e6,
                "p99_us": float(np.percentile(s, 99)) * 1e6, "algbw_gbs": self.algbw_gbs,
                "busbw_gbs": self.busbw_gbs, "wrong": self.wrong}


TABLE_HEADERS = ("size B", "count", "type", "time us", "min us", "max us", "p99 us", "algbw GB/s", "busbw GB/s",
                 "#wrong")


def table_rows(results: list[SizeResult]) -> list[list[Any]]:
    rows = []
    for r in results:
        row = r.row()
        rows.append([row["bytes"], row["count"], row["type"], row["time_us"], row["min_us"], row["max_us"],
                     row["p99_us"], row["algbw_gbs"], row["busbw_gbs"], row["wrong"]])
    return rows


def average_busbw(results: list[SizeResult]) -> float:
    """nccl-tests' closing "Avg bus bandwidth": the plain mean of every size's bus bandwidth."""
    values = [r.busbw_gbs for r in results if np.isfinite(r.busbw_gbs)]
    return float(np.mean(values)) if values else float("nan")


def expected_output(op: str, rank: int, ranks: int, elements: int) -> np.ndarray:
    """What rank `rank` of `ranks` holds after `op` at a size of `elements` (the whole array's, as sizes are
    counted) when every rank q starts with input_values(q, ...):
    the check of every size (nccl-tests' #wrong). Small integers, exact in every ELEMENT_BYTES type up to
    128 ranks."""
    if op == "allreduce":
        return sum(input_values(q, elements) for q in range(ranks))
    if op == "allgather":
        share = elements // ranks
        return np.concatenate([input_values(q, share) for q in range(ranks)])
    if op == "reducescatter":
        share = elements // ranks
        return sum(input_values(q, elements)[rank * share:(rank + 1) * share] for q in range(ranks))
    if op == "broadcast":
        return input_values(0, elements)
    if op == "alltoall":
        share = elements // ranks
        return np.concatenate([input_values(q, elements)[rank * share:(rank + 1) * share] for q in range(ranks)])
    if op == "sendrecv":
        return input_values((rank - 1) % ranks, elements)
    raise ValueError(f"unknown operation {op!r}")


def input_values(rank: int, elements: int) -> np.ndarray:
    """Rank `rank`'s input before the check: (rank + i) mod 3 at element i."""
    return ((np.arange(elements, dtype=np.int64) + rank) % 3).astype(np.float64)


def input_elements(op: str, nbytes: int, dtype: str, ranks: int) -> tuple[int, int]:
    """(elements of a rank's input buffer, elements of its output buffer) for `op` at size `nbytes`."""
    total = element_count(nbytes, dtype)
    if op == "allgather":
        return total // ranks, total
    if op == "reducescatter":
        return total, total // ranks
    return total, total

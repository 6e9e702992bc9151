"""One run of `harness collectives` as its user reads it: nccl-tests' tables with the answer first, or JSON for
scripts (definitions: harness.plan.collectives; the documents: docs/collectives.md). The analysis prints one run so
too and builds its side-by-side comparisons on it (analysis.collectives).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harness.common.output import format_table
from harness.plan.collectives import TABLE_HEADERS, average_busbw, bus_factor, table_rows
from harness.store.collectives_file import CollectivesRun

JSON_SCHEMA_VERSION = 1  # the documents of run_json and of analysis.collectives.compare_json (docs/collectives.md)
FACTOR_TEXT = {"allreduce": "2(n-1)/n", "allgather": "(n-1)/n", "reducescatter": "(n-1)/n", "alltoall": "(n-1)/n",
               "broadcast": "1", "sendrecv": "1"}


def wrong_outputs(run: CollectivesRun) -> int:
    """How many output elements of the run's operations were wrong, all sizes together."""
    return sum(r.wrong for results in run.results.values() for r in results)


def run_json(run: CollectivesRun, notes: Sequence[str] = ()) -> dict[str, Any]:
    """One run for scripts: what and where, every operation's rows (SizeResult.row) and averages."""
    return {"schema_version": JSON_SCHEMA_VERSION, **run.summary(), "label": run.label, "notes": list(notes),
            "environment": run.environment,
            "ops": {op: {"bus_factor": bus_factor(op, len(run.ranks)), "avg_busbw_gbs": average_busbw(results),
                         "wrong": sum(r.wrong for r in results), "rows": [r.row() for r in results]}
                    for op, results in run.results.items()},
            "wrong": wrong_outputs(run)}


def run_report(run: CollectivesRun, notes: Sequence[str] = ()) -> str:
    """The answer first (each operation's average bus bandwidth, whether every output was right), then one
    nccl-tests table per operation, each closed by its #wrong and average bus bandwidth."""
    n = len(run.ranks)
    wrong = wrong_outputs(run)
    averages = ", ".join(f"{op} {average_busbw(results):.3g}" for op, results in run.results.items())
    lines = [f"avg bus bandwidth (GB/s): {averages}",
             f"{run.backend} on {n} ranks ({run.placement}-node: {','.join(map(str, run.ranks))}), {run.dtype}, "
             f"{run.iters} iterations after {run.warmup} warm-up; "
             + ("every output checked and right" if not wrong else f"{wrong} WRONG output element(s): see #wrong"),
             "time: mean over iterations of the slowest rank; algbw = size / time; busbw = algbw x the operation's "
             "factor (nccl-tests); GB = 1e9 bytes"]
    lines += [f"note: {note}" for note in notes]
    for op, results in run.results.items():
        lines += ["", format_table(TABLE_HEADERS, table_rows(results),
                                   title=f"{op} (bus factor {FACTOR_TEXT[op]} = {bus_factor(op, n):.3f})"),
                  f"# wrong: {sum(r.wrong for r in results)}    avg bus bandwidth: {average_busbw(results):.4g} GB/s"]
    if run.path.name != "-":
        lines += ["", f"results: {run.path}"]
    return "\n".join(lines)

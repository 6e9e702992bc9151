"""Collective benchmark results read and compared: the runs side by side, bus bandwidth against size as a picture,
and as communication points for a profile's costs (definitions: harness.plan.collectives; one run's tables and JSON:
harness.store.collectives_report; the command: `python -m analysis collectives`).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.common.errors import UserError
from harness.common.output import format_table
from harness.plan.collectives import OPS, PROFILE_KINDS, average_busbw
from harness.store.collectives_file import CollectivesRun, read_collectives
from harness.store.collectives_report import JSON_SCHEMA_VERSION, run_json, wrong_outputs


def load(paths: Sequence[str | Path]) -> list[CollectivesRun]:
    """Benchmark files, each checked (harness.store.collectives_file); the same file twice is bad input."""
    seen: set[Path] = set()
    runs = []
    for path in paths:
        resolved = Path(path).resolve()
        if resolved in seen:
            raise UserError(f"{path} is given twice; give each benchmark file once")
        seen.add(resolved)
        runs.append(read_collectives(path))
    return runs


def profile_points(runs: Sequence[CollectivesRun], profile_backend: str | None, profile_device: str,
                   profile_name: str) -> dict[tuple[str, str], list[tuple[float, int, float]]]:
    """Benchmark results as communication points of a profile's kinds (harness.plan.collectives.PROFILE_KINDS:
    send/recv as P2P, at its minimum; the collectives at their median, as analysis.costs takes a profile's),
    keyed (kind, placement) with (bytes, group size, seconds). A run on another backend or device than the
    profile's (`profile_backend` None: a spec alone, whose network they are), or with wrong outputs, is bad
    input."""
    points: dict[tuple[str, str], list[tuple[float, int, float]]] = {}
    for run in runs:
        device = str(run.environment.get("device", "?"))
        if profile_backend is not None and (run.backend != profile_backend or device != profile_device):
            raise UserError(f"{run.path} was measured with {run.backend} on {device}, {profile_name} with "
                            f"{profile_backend} on {profile_device}; give a benchmark of the profile's backend "
                            f"and device (harness collectives --backend {profile_backend.removeprefix('torch-')})")
        wrong = wrong_outputs(run)
        if wrong:
            raise UserError(f"{run.path} has {wrong} wrong output element(s): its times are not of working "
                            "collectives; run the benchmark again")
        for op, results in run.results.items():
            kind = PROFILE_KINDS.get(op)
            if kind is None:
                continue
            for r in results:
                seconds = float(r.samples_s.min()) if kind == "p2p" else r.median_s
                points.setdefault((kind, run.placement), []).append((float(r.nbytes), len(run.ranks), seconds))
    return points


def _labels(runs: Sequence[CollectivesRun]) -> list[str]:
    """Each run's label, made unique with its file name where two runs share one."""
    labels = [run.label for run in runs]
    return [f"{label} ({run.path.name})" if labels.count(label) > 1 else label for label, run in zip(labels, runs)]


def compare_rows(runs: Sequence[CollectivesRun]) -> tuple[list[str], list[list[Any]]]:
    """One row per (operation, size) any run measured; per run its time (us) and bus bandwidth (GB/s),
    '-' where it did not measure that size."""
    labels = _labels(runs)
    headers = ["op", "size B"] + [h for label in labels for h in (f"{label} us", f"{label} busbw")]
    rows = []
    for op in [op for op in OPS if any(op in run.results for run in runs)]:
        by_run = [{r.nbytes: r for r in run.results.get(op, [])} for run in runs]
        for nbytes in sorted({size for sizes in by_run for size in sizes}):
            row: list[Any] = [op, nbytes]
            for sizes in by_run:
                r = sizes.get(nbytes)
                row += [r.mean_s * 1e6, r.busbw_gbs] if r is not None else ["-", "-"]
            rows.append(row)
    return headers, rows


def compare_report(runs: Sequence[CollectivesRun]) -> str:
    """The runs side by side: each operation's average bus bandwidth per run first, then every size."""
    labels = _labels(runs)
    ops = [op for op in OPS if any(op in run.results for run in runs)]
    summary = [[label] + [average_busbw(run.results[op]) if op in run.results else "-" for op in ops]
               + [wrong_outputs(run), str(run.path)] for label, run in zip(labels, runs)]
    headers, rows = compare_rows(runs)
    return "\n\n".join([format_table(["run"] + [f"{op} GB/s" for op in ops] + ["#wrong", "file"], summary,
                                     title="average bus bandwidth per run (nccl-tests' definition; GB = 1e9 bytes)"),
                        format_table(headers, rows,
                                     title="time (mean of the slowest rank) and bus bandwidth per size")])


def compare_json(runs: Sequence[CollectivesRun]) -> dict[str, Any]:
    return {"schema_version": JSON_SCHEMA_VERSION, "runs": [run_json(run) for run in runs]}


def write_png(path: str | Path, runs: Sequence[CollectivesRun]) -> Path:
    """Bus bandwidth against size (log-log), one line per operation and run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    styles = ["-", "--", ":", "-."]
    for index, (label, run) in enumerate(zip(_labels(runs), runs)):
        for op, results in run.results.items():
            sizes = np.array([r.nbytes for r in results], dtype=float)
            busbw = np.array([r.busbw_gbs for r in results], dtype=float)
            colour = f"C{OPS.index(op) % 10}" if op in OPS else None
            ax.plot(sizes, busbw, styles[index % len(styles)], marker=".", color=colour, label=f"{op}, {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("collective bus bandwidth against size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    from analysis.plot import save

    return save(fig, path)

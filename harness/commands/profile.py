"""`python -m harness profile SPEC -o OUTDIR`: profile the unique events on the ranks of an MPI job.

Run under mpirun or srun, best as `python -m mpi4py -m harness profile ...` so an exception on any rank
aborts all of them. Rank 0 prints progress and the summary; the result is OUTDIR/profile.h5.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from harness.commands.cli import default_spec_path
from harness.common.errors import UserError
from harness.common.output import format_seconds
from harness.common.subcommands import non_empty
from harness.plan.events import events_to_profile
from harness.plan.precision import MIN_SAMPLES
from harness.plan.spec import load_spec, vocab_padding_note
from harness.runtime.mpi_errors import AgreedError, stop_agreed, stop_on_error

NAME = "profile"
HELP = "profile the unique events of a job spec on the ranks of this MPI job (writes OUTDIR/profile.h5)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", nargs="?", default=None, help="TOML job spec (default: the built-in demo job)")
    parser.add_argument("-o", "--output", required=True, metavar="OUTDIR", type=non_empty,
                        help="folder for rank files and profile.h5")
    parser.add_argument("--force", action="store_true", help="measure everything again, ignoring what is stored")
    parser.add_argument("--backend", choices=("torch", "mpi4py"), help="communication backend (overrides the spec)")
    parser.add_argument("--repeats", type=int, help="timed repeats per event (overrides the spec)")
    parser.add_argument("--warmup", type=int, help="untimed warm-up runs per event (overrides the spec)")
    parser.add_argument("--precision", metavar="P",
                        help="sample each event until its 95%% confidence interval is within P of the statistic the "
                             "analysis uses: 0.02 or 2%% (default: the spec's, 2%%); --repeats is then a minimum")
    parser.add_argument("--budget-s", dest="budget_s", metavar="S",
                        help="seconds each phase may spend sampling beyond the repeats (default: the spec's, 60)")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def precision_option(text: str | None) -> float | None:
    """--precision's value: '0.02' or '2%' -> 0.02 (validated with the spec's rule, harness.plan.spec)."""
    if text is None:
        return None
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise UserError(f"--precision: {text!r} is not a fraction (0.02) or a percentage (2%)") from None


def budget_option(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:
        raise UserError(f"--budget-s: {text!r} is not a positive, finite number of seconds")
    return value


def run(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from harness.profile.run import check_outdir, run_profile
    from harness.store.folder_lock import FolderLock, clear_for_this_job, command_line
    from harness.train.engine_gaps import measure_engine_gaps

    comm = MPI.COMM_WORLD
    spec = unique = grid = None
    outdir = Path(args.output)
    error: UserError | None = None
    lock: FolderLock | None = None
    try:
        spec = load_spec(args.spec or default_spec_path())
        changes = {k: v for k, v in (("backend", args.backend), ("repeats", args.repeats), ("warmup", args.warmup),
                                     ("precision", precision_option(args.precision)),
                                     ("budget_s", budget_option(args.budget_s))) if v is not None}
        if changes:
            spec = spec.with_changes(**changes)
        check_outdir(outdir)
        unique, grid = events_to_profile(spec, _factory_layers(spec))
        if comm.Get_rank() == 0:  # one job at a time in a folder; held until this process ends
            lock = FolderLock(outdir, command_line()).acquire()
    except UserError as exc:
        error = exc
    try:
        status = stop_on_error(comm, error)  # any rank's bad input stops every rank; rank 0 says what is wrong
        if status is not None:
            return status
        if lock is not None:
            clear_for_this_job(lock, "harness profile")
        result = run_profile(spec, outdir, comm=comm, force=args.force, show_progress=not args.quiet,
                             events=unique, engine_gaps=measure_engine_gaps)
    except AgreedError as exc:  # a full disk, say: every rank stops, rank 0 says why
        return stop_agreed(comm, exc)
    finally:
        if lock is not None:
            lock.release()
    if result is None:
        return 0
    print(summary_text(spec, grid, unique, result, comm.Get_size()))
    if result.binding_note:
        print(f"NOTE: {result.binding_note}")
    padding = vocab_padding_note(spec)
    if padding:
        print(padding)
    sys.stdout.flush()
    return 0


def summary_text(spec, grid, unique, result, ranks: int) -> str:
    """What the profile measured, what it could not, and whether it met its precision: one short line each (the
    events that missed are listed by `harness show --missed`)."""
    what = f"the union of {len(grid)} candidate strategies of " if spec.search else ""
    lines = [f"profiled {what}{spec.model.name} on {ranks} ranks: {result.measured} measurements taken, "
             f"{result.skipped} already stored, {len(result.unmeasured)} unmeasurable here; wall time "
             f"{format_seconds(result.wall_s)}, device time {format_seconds(result.device_seconds)}"]
    by_reason: dict[str, list[str]] = {}
    for eid, why in sorted(result.unmeasured.items(), key=lambda item: unique.events[item[0]].name):
        by_reason.setdefault(why, []).append(unique.events[eid].name)
    for why, names in by_reason.items():  # the analysis extrapolates them (docs/analysis.md)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        lines.append(f"  unmeasured here, to be extrapolated: {shown}: {why}")
    missed = result.missed_precision
    if missed:
        lines.append(f"  {len(missed)} of {result.measured + result.skipped} events missed the precision of "
                     f"{result.precision:.1%} (worst {_precision_text(missed[0][1])}; `harness show {result.path}` "
                     "lists each); a larger --budget-s into the same folder measures them again")
    else:
        lines.append(f"  every event is known within {result.precision:.1%} (95% interval of its mean, or median for "
                     "communication)")
    if result.in_context_chains:  # what timing the stage chains added (docs/profiling.md, "In context")
        share = result.in_context_wall_s / result.compute_wall_s if result.compute_wall_s > 0 else 0.0
        lines.append(f"  in context: {result.in_context_chains} stage chains timed in "
                     f"{format_seconds(result.in_context_wall_s)}, {share:.0%} on top of the compute phase's "
                     f"{format_seconds(result.compute_wall_s)}")
    for skipped in result.in_context_skipped:
        lines.append(f"  in context: a chain that could not run here keeps its events' isolated samples: {skipped}")
    lines.append(f"profile: {result.path}")
    return "\n".join(lines)


def _precision_text(reached: float) -> str:
    return f"{reached:.1%}" if math.isfinite(reached) else f"unknown, under {MIN_SAMPLES} samples"


def _factory_layers(spec):
    """A factory model's layer descriptions (torch is loaded only for one)."""
    if spec.model.family != "user":
        return None
    from harness.models.user import factory_layers

    return factory_layers(spec)

"""`mpirun -n N python -m mpi4py -m harness train SPEC -o RUNDIR`: real training iterations, traced per device.

N must equal dp x tp x pp of the spec. The trace (RUNDIR/trace.h5, docs/train.md) holds every device's
intervals of the events the simulator predicts, on a common timebase, for `analysis validate`.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from harness.commands.cli import default_spec_path
from harness.common.errors import UserError
from harness.common.subcommands import non_empty
from harness.plan.spec import MAX_TIMEOUT_S, MIN_TIMEOUT_S
from harness.runtime.mpi_errors import AgreedError, stop_agreed, stop_on_error

NAME = "train"
HELP = "run real hybrid-parallel training iterations of a spec under MPI and trace every device (trace.h5)"


MAX_THREADS = 1024  # torch threads a rank: more than any node's cores (it ran the host out of processes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from harness.train.runner import DEFAULT_ITERATIONS, DEFAULT_WARMUP

    parser.add_argument("spec", nargs="?", default=None, help="TOML job spec (default: the built-in demo job)")
    parser.add_argument("-o", "--output", required=True, metavar="RUNDIR", type=non_empty,
                        help="folder for rank-NNNNN.trace.h5 and the merged trace.h5 (created if missing)")
    parser.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS, metavar="K",
                        help=f"training iterations to run (default {DEFAULT_ITERATIONS})")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, metavar="W",
                        help=f"how many of the first iterations are marked warm-up (default {DEFAULT_WARMUP})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    parser.add_argument("--fresh-data", action="store_true",
                        help="draw a new random batch every iteration (default: train on one fixed batch)")
    parser.add_argument("--no-barrier", action="store_true",
                        help="let iterations run into each other (default: all ranks start each iteration together)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="where to run (default: the spec's profile.device)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--layer-times", action="store_true",
                        help="also trace every layer of every forward and backward step, for analysis validate's "
                             "per-layer table (on a GPU with CUDA events)")
    parser.add_argument("--backend", choices=("torch", "mpi4py"), default="torch",
                        help="what all-reduces the data-parallel gradients: torch.distributed (default: gloo, NCCL on "
                             "a GPU) or MPI through mpi4py; tensor-parallel and P2P stay on torch.distributed")
    parser.add_argument("--torch-profiler", metavar="DIR", type=non_empty,
                        help="also record the measured iterations with torch.profiler into DIR/rank-<rank>.json "
                             "(Kineto traces for Perfetto, TensorBoard, HolisticTraceAnalysis, analysis breakdown)")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="communication timeout in seconds (default: the spec's profile.timeout_s)")


def run(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from harness.plan.spec import load_spec
    from harness.store.folder_lock import FolderLock, clear_for_this_job, command_line
    from harness.train.runner import check_run, run_training

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    spec = None
    error: UserError | None = None
    lock: FolderLock | None = None
    try:
        spec = load_spec(args.spec or default_spec_path())
        if not 1 <= args.threads <= MAX_THREADS:
            raise UserError(f"--threads must be from 1 to {MAX_THREADS}, got {args.threads:,}")
        if args.timeout_s is not None and not MIN_TIMEOUT_S <= args.timeout_s <= MAX_TIMEOUT_S:
            raise UserError(f"--timeout-s must be from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} seconds (a week), got "
                            f"{args.timeout_s}")
        if not 0 < args.lr < math.inf:
            raise UserError(f"--lr must be a positive learning rate, got {args.lr}")
        check_run(spec, comm.Get_size(), args.iterations, args.warmup, args.backend, args.layer_times)
        if spec.model.factory:  # the user's layers built (on the meta device) before any rank starts training
            from harness.models.user import factory_layers

            factory_layers(spec)
        if (args.device or spec.profile.device) == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UserError("--device cuda (or profile.device = 'cuda') but torch sees no CUDA device here")
        if rank == 0:
            for folder, what in ((args.torch_profiler, "profiler trace folder"), (args.output, "run folder")):
                try:
                    if folder is not None:
                        Path(folder).mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise UserError(f"cannot create the {what} {folder}: {exc.strerror}; give a folder this job "
                                    "can create") from None
            lock = FolderLock(args.output, command_line()).acquire()  # one job at a time in a run folder
    except UserError as exc:
        error = exc
    try:
        status = stop_on_error(comm, error)
        if status is not None:
            return status
        if lock is not None:
            clear_for_this_job(lock, "harness train")
        assert spec is not None
        run_training(spec, comm, args.output, args.iterations, args.warmup, seed=args.seed, lr=args.lr,
                     fresh_data=args.fresh_data, barrier=not args.no_barrier, device=args.device,
                     timeout_s=args.timeout_s, threads=args.threads, report=True, layer_times=args.layer_times,
                     dp_backend=args.backend, torch_profiler=args.torch_profiler, abort_on_error=True)
    except AgreedError as exc:  # a full disk, say: every rank stops, rank 0 says why
        return stop_agreed(comm, exc)
    finally:
        if lock is not None:
            lock.release()
    return 0

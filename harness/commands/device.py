"""`python -m harness device [-o mine.toml]`: measure this machine's device (one CUDA GPU, else this CPU) and write
a device description (docs/devices.md, "Calibrating this machine") that `[cluster] device = "mine.toml"` reads.

What is measured and how: harness.profile.device_curves; how the curves are fitted: harness.plan.device_fit.
Under an MPI launcher with 2 or more ranks (`mpirun -n 2 python -m mpi4py -m harness device -o mine.toml`) every
rank calibrates at once, then the collectives a training step runs are timed in context (their rows in --json
and the summary: `collectives_in_context`; on a CPU also FSDP2's unshard and reduce of small units, `unshards`
and `reduces`, a tensor-parallel block's inline collectives over the ranks, `inline_collectives`, and a pipeline
send, `p2p`); rank 0 writes and prints.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.common.errors import UserError
from harness.common.output import format_table, writable
from harness.common.subcommands import non_empty
from harness.plan.device import MIB, REQUIRED_DTYPES, check_output_path

NAME = "device"
HELP = "measure this machine's device (CUDA, else the CPU) and write its description for [cluster] device"
DEFAULT_REPEATS = 10
QUICK_REPEATS = 3
MAX_REPEATS = 10_000
OUTPUTS = {"output": "-o"}
INPUTS = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", metavar="FILE.toml",
                        help="write the description here (default: print it, or with --json only the JSON)")
    parser.add_argument("--dtype", default=None,
                        help=f"the dtype the curves are fitted in: {', '.join(REQUIRED_DTYPES)} (default: float32 on a "
                             "CPU, bfloat16 on a GPU); every dtype the device runs has its peaks measured")
    parser.add_argument("--repeats", default=None,
                        help=f"timed rounds per kernel after 2 warm-up ones (default {DEFAULT_REPEATS}, --quick "
                             f"{QUICK_REPEATS})")
    parser.add_argument("--quick", action="store_true",
                        help="a few kernels of each kind and few repeats: seconds, for tests (a rough description)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda (default auto)")
    parser.add_argument("--name", type=non_empty,
                        help="the description's name (default: the output file's stem, else 'local')")
    parser.add_argument("--json", action="store_true",
                        help="print the description, every measured kernel and the fit's errors as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def options(args: argparse.Namespace) -> tuple[str | None, int, Path | None]:
    """(dtype or None for the device's default, repeats, output path), checked: UserError on a bad one."""
    if args.dtype is not None and args.dtype not in REQUIRED_DTYPES:
        raise UserError(f"--dtype {args.dtype!r}: give one of {', '.join(REQUIRED_DTYPES)}")
    repeats = QUICK_REPEATS if args.quick else DEFAULT_REPEATS
    if args.repeats is not None:
        try:
            repeats = int(args.repeats)
        except ValueError:
            repeats = 0
        if not 1 <= repeats <= MAX_REPEATS:
            raise UserError(f"--repeats {args.repeats!r}: give a whole number from 1 to {MAX_REPEATS}")
    output = check_output_path(args.output) if args.output else None
    return args.dtype, repeats, output


def check(args: argparse.Namespace) -> None:
    """The options, refused before any rank calibrates (harness.common.subcommands)."""
    options(args)


def run(args: argparse.Namespace) -> int:
    dtype, repeats, output = options(args)
    from harness.common.launch_env import promised_world_size
    from harness.profile.device_curves import calibrate, observation_rows, pick_device

    promised = promised_world_size()
    comm, rank = None, 0
    if promised is not None and promised[0] > 1:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
    device = pick_device(args.device)
    if comm is not None and device.type == "cuda":
        import torch

        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dtype = dtype or ("bfloat16" if device.type == "cuda" else "float32")
    name = args.name or (output.stem if output else "local")
    calibration = calibrate(device, dtype, repeats, args.quick, name, show_progress=not args.quiet and rank == 0,
                            comm=comm)
    if rank != 0:
        return 0
    description = calibration.description
    errors = calibration.fit_errors()
    header = (f"written by python -m harness device{' --quick' if args.quick else ''} ({calibration.seconds:.0f} s); "
              "format in docs/devices.md\nfit: " + "; ".join(
                  f"{curve} {e['kernels']} kernels, median |error| {e['median_abs_error_pct']:.1f}%"
                  for curve, e in errors.items()))
    text = description.to_toml(header=header)
    if output is not None:
        def write() -> Path:
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(text)
            return output
        try:
            writable(str(output), write)
        except UserError as exc:  # what was measured is not lost: the description goes to stdout instead
            sys.stdout.write(text)
            raise UserError(f"{exc}; the description is printed above instead: save it as a .toml file") from None
    if args.json:
        print(json.dumps({"description": description.to_dict(), "output": str(output) if output else None,
                          "device": str(device), "dtype": dtype, "repeats": repeats, "quick": args.quick,
                          "seconds": calibration.seconds, "fit_errors": errors,
                          "launch": {"bare_s": calibration.bare_launch_s, "framework_s": calibration.framework_blocks,
                                     "bare_issue_s": calibration.bare_issue_s},
                          "optimizer_counts": calibration.optimizer_counts, "ranks": calibration.ranks,
                          "collectives_in_context": calibration.collectives, "unshards": calibration.unshards,
                          "reduces": calibration.reduces,
                          "inline_collectives": calibration.inline, "p2p": calibration.p2p,
                          "causal": calibration.causal,
                          "kernels": observation_rows(calibration)}, indent=1))
        return 0
    if output is None:
        sys.stdout.write(text)
        return 0
    print(summary(description, errors, output, calibration.collectives, calibration.causal))
    return 0


def summary(description, errors: dict, output: Path, collectives: list | None = None,
            causal: list | None = None) -> str:
    """The answer first: where the description went, its peaks, then each curve and its fit's error."""
    peaks = ", ".join(f"{d} {description.matrix_peak[d] / 1e9:.3g}" for d in REQUIRED_DTYPES)
    lines = [f"wrote {output}: {description.title}",
             f"matrix peak GFLOP/s: {peaks}; memory {description.memory_bandwidth / 1e9:.3g} GB/s; launch "
             f"{description.launch_s * 1e6:.2f} us", ""]
    rows = []
    for curve, e in errors.items():
        if curve not in description.curves:  # the optimizers' steps: their line below
            continue
        c = description.curves[curve]
        rows.append([curve, c.max_fraction, f"{c.half_at:.3g}", c.steepness, c.half_dim or "-", e["kernels"],
                     e["median_abs_error_pct"], e["p90_abs_error_pct"]])
    lines.append(format_table(["curve", "max_fraction", "half_at", "steepness", "half_dim", "kernels",
                               "median |err| %", "p90 |err| %"], rows))
    if description.vector_ops:
        lines.append("\nvector operations an element: " + ", ".join(
            f"{kind} {ops:.3g}" for kind, ops in description.vector_ops.items()))
    for kind, cost in description.optimizer.items():
        lines.append(f"optimizer {kind}: {cost.kernels_per_tensor:.3g} kernels a tensor, {cost.kernels_per_step:.3g} "
                     f"a step, {cost.bytes_per_parameter:.3g} bytes a parameter, {cost.kernel_s * 1e6:.3g} us a "
                     f"kernel beyond its bytes, {cost.bandwidth / 1e9:.3g} GB/s")
    for name, cost in description.wrappers.items():
        halves = (f"{cost.backward_s * 1e6:.3g} us the input's half, {cost.weight_s * 1e6:.3g} us the weights' half"
                  if name == "split_backward" else
                  f"{cost.forward_s * 1e6:.3g} us a forward, {cost.backward_s * 1e6:.3g} us a backward")
        lines.append(f"{name} layers: {halves} beyond the layer's own" + (
            f", {cost.optimizer_kernel_s * 1e6:.3g} us more an optimizer kernel on its shards"
            if cost.optimizer_kernel_s else "") + (
            f"; an all-gather {cost.unshard_s * 1e6:.3g} us + {cost.unshard_tensor_s * 1e6:.3g} us a parameter tensor "
            "beyond the collective and its copies" if cost.unshard_s or cost.unshard_tensor_s else "") + (
            f"; a reduce-scatter {cost.reduce_s * 1e6:.3g} us + {cost.reduce_tensor_s * 1e6:.3g} us a parameter tensor "
            "beyond the collective and its copy-in" if cost.reduce_s or cost.reduce_tensor_s else ""))
    if description.inline_collective_s:
        lines.append(f"inline collectives: {description.inline_collective_s * 1e6:.3g} us a call in a layer's pass "
                     "beyond its bytes (a tensor-parallel block over the ranks against it alone)")
    if description.p2p_post(MIB) or description.p2p_sender_busy(MIB):
        d = description
        lines.append(f"pipeline sends: {d.p2p_post_s * 1e6:.3g} us + {d.p2p_post_s_per_mib * 1e6:.3g} us a MiB to "
                     f"post one; its transfer {d.p2p_sender_busy_s * 1e6:.3g} us + "
                     f"{d.p2p_sender_busy_s_per_mib * 1e6:.3g} us a MiB more where the receiver posts late while "
                     "the sender computes" + (f"; received late, {d.p2p_late_s * 1e6:.3g} us + "
                                              f"{d.p2p_late_s_per_mib * 1e6:.3g} us a MiB of each end's compute"
                                              if d.p2p_late(MIB) else ""))
    if causal:
        ratios = ", ".join(f"{r['seq']} {r['ratio']:.2f}" for r in causal if r["pass"] == "forward")
        lines.append(f"causal attention: key blocks of {description.causal_tile} (a causal forward's time over a full "
                     f"one by keys: {ratios})")
    if "optimizer" in errors:
        e = errors["optimizer"]
        lines.append(f"optimizer steps measured: {e['kernels']}, median |error| {e['median_abs_error_pct']:.1f}%, "
                     f"p90 {e['p90_abs_error_pct']:.1f}%")
    if collectives:
        lines += ["", f"collectives in context on {collectives[0]['ranks']} ranks (after a "
                  f"{collectives[0]['burst_s'] * 1e3:g} ms compute burst; back to back after a barrier beside):"]
        lines.append(format_table(["op", "bytes", "in context ms", "back to back ms"],
                                  [[r["op"], r["bytes"], r["in_context_s"] * 1e3, r["back_to_back_s"] * 1e3]
                                   for r in collectives]))
    lines.append(f"\nuse it: [cluster] device = \"{output}\" (docs/devices.md)")
    return "\n".join(lines)

"""`python -m analysis device PROFILE.h5 [--device NAME|FILE.toml] [-o REFINED.toml]`: a device description refined
on the profile's own compute events (analysis.device_refine; docs/devices.md, "Refined on a profile")."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from analysis.costs.corrections import engine_gaps
from analysis.device_refine import Refinement, check_processor, figure_name, profile_events, refine
from analysis.profile_reader import load_profile
from harness.common.errors import SpecError, UserError
from harness.common.output import format_table, writable
from harness.plan.device import check_output_path, load_device

NAME = "device"
HELP = "refine a device description on a profile's measured compute events, for a spec alone's estimates"
OUTPUTS = {"output": "-o"}
INPUTS = ("profile", "device")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", help="profile.h5 written by `python -m harness profile` (or its OUTDIR)")
    parser.add_argument("--device", metavar="NAME|FILE.toml",
                        help="the description to refine: a shipped name or a file (`harness device -o`); default "
                             "the profile's [cluster] device")
    parser.add_argument("-o", "--output", metavar="FILE.toml", help="write the refined description here")
    parser.add_argument("--name", help="the refined description's name (default: the output file's stem, else "
                                       "NAME-refined)")
    parser.add_argument("--json", action="store_true", help="print the refinement as JSON (docs/devices.md)")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def run(args: argparse.Namespace) -> int:
    if args.output:
        check_output_path(args.output)
    profile = load_profile(args.profile)
    text = args.device or profile.spec.cluster.device
    if not text:
        raise UserError(f"{profile.path}: its spec names no [cluster] device and no --device was given: name the "
                        "description to refine (a shipped one, or a file that `python -m harness device -o` wrote)")
    try:
        base = load_device(text)
    except SpecError as exc:
        if not args.device or exc.field != "cluster.device":
            raise
        # the name came from --device, not from a spec's [cluster] device
        raise UserError(f"--device: {str(exc).split('] ', 1)[-1]}") from None
    check_processor(profile, base)
    name = args.name or (Path(args.output).stem if args.output else "")
    progress = None if args.quiet or args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    refinement = refine(base, profile_events(profile), source=str(profile.path), name=name, progress=progress,
                        engine_gaps=engine_gaps(profile))
    written = None
    if args.output:
        header = (f"{refinement.refined.name}: {base.name} refined on {profile.path} (python -m analysis device); "
                  f"its events' median |error| {refinement.median_abs_pct('before'):.1f}% -> "
                  f"{refinement.median_abs_pct('after'):.1f}%")
        writable(args.output, lambda: Path(args.output).write_text(refinement.refined.to_toml(header)))
        written = args.output
    if args.json:
        print(json.dumps({**refinement.to_dict(str(profile.path)), "written": str(written) if written else None},
                         indent=1))
    else:
        print(report(refinement, str(profile.path)))
        if written:
            print(f"wrote {written}: use it as [cluster] device = \"{written}\"")
    return 0


def report(refinement: Refinement, profile_path: str) -> str:
    """The answer first (the events' median |error| before and after), then the figures and the events."""
    before, after = refinement.median_abs_pct("before"), refinement.median_abs_pct("after")
    lines = [f"{refinement.base.name} refined on {profile_path}'s {len(refinement.events)} compute events: median "
             f"|error| {before:.1f}% -> {after:.1f}%"]
    figures = [[figure_name(key), f"{was:.4g}", f"{now:.4g}"] for key, (was, now) in refinement.figures.items()]
    lines += ["", format_table(["figure", "before", "after"], figures or [["(none moved)", "", ""]])]
    errors_before, errors_after = refinement.errors_pct("before"), refinement.errors_pct("after")
    rows = [[event.name, event.measured_s * 1e3, was * 1e3, e_before, now * 1e3, e_after]
            for event, was, now, e_before, e_after in zip(refinement.events, refinement.before_s, refinement.after_s,
                                                          errors_before, errors_after)]
    lines += ["", format_table(["event", "measured ms", "before ms", "error %", "after ms", "error %"], rows)]
    return "\n".join(lines)

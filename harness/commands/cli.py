"""`python -m harness`: its subcommands (events, profile, show, train, collectives, spec, device), each a thin front
end over the registry of harness.common.subcommands, and the bare command.
"""
from __future__ import annotations

import argparse
import sys
from importlib import resources

from harness.common.subcommands import build_parser, run_cli

SUBCOMMANDS = ("events", "profile", "show", "train", "collectives", "spec", "device")


def default_spec_path() -> str:
    """The built-in demo job, used when no spec is given."""
    return str(resources.files("harness") / "jobs" / "demo.toml")


DEFAULT_PROFILE_DIR = "distsim-profile"


def main(argv: list[str] | None = None) -> int:
    """The bare command (no arguments): under an MPI launcher, profile the built-in demo job into
    DEFAULT_PROFILE_DIR and say what to run next; elsewhere, the short help."""
    parser = build_parser("python -m harness", "harness.commands", SUBCOMMANDS,
                          "Break a hybrid-parallel training iteration into unique events and profile them.")
    args = sys.argv[1:] if argv is None else argv
    if args:
        return run_cli(parser, args)
    from launcher.topology import promised_world_size

    if promised_world_size() is None:
        print(short_help(parser))
        return 0
    status = run_cli(parser, ["profile", "-o", DEFAULT_PROFILE_DIR])
    if status == 0 and _is_rank_zero():
        profile = f"{DEFAULT_PROFILE_DIR}/profile.h5"
        search_spec = resources.files("harness") / "jobs" / "search.toml"
        print(f"next: python -m analysis simulate {profile} --png {DEFAULT_PROFILE_DIR}/timeline.png --trace "
              f"{DEFAULT_PROFILE_DIR}/timeline.json.gz   # every device's timeline, bubbles, memory\n"
              f"      python -m harness show {profile}   # every measurement and its precision\n"
              f"      mpirun -n N python -m mpi4py -m harness profile {search_spec} -o grid/ && "
              "python -m analysis search grid/profile.h5   # a grid of strategies, ranked")
    return status


def short_help(parser: argparse.ArgumentParser) -> str:
    """The commands, one line each, and the two lines most users start with."""
    lines = [parser.format_usage().rstrip(), "", "commands:"]
    for action in parser._subparsers._group_actions:  # argparse keeps its subcommands there
        for choice in action._choices_actions:
            lines.append(f"  {choice.dest:<12} {choice.help}")
    lines += ["", "start with:",
              "  mpirun -n 4 python -m mpi4py -m harness   # profile the built-in demo job into "
              f"{DEFAULT_PROFILE_DIR}/",
              "  python -m harness COMMAND --help"]
    return "\n".join(lines)


def _is_rank_zero() -> bool:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank() == 0

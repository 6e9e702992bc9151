"""`python -m analysis`: a registry of subcommands, each a thin front end over one analysis module.

Same contract as harness.common.subcommands: every module in analysis.commands defines NAME, HELP, add_arguments(parser)
and run(args) -> int; bad input (UserError) becomes one message on stderr and exit status 2.
"""
from __future__ import annotations

from harness.common.subcommands import build_parser, run_cli

SUBCOMMANDS = ("simulate", "search", "validate", "collectives", "network", "device", "breakdown", "scaling")


def main(argv: list[str] | None = None) -> int:
    """Run `python -m analysis COMMAND ...`; returns the exit status."""
    parser = build_parser("python -m analysis", "analysis.commands", SUBCOMMANDS,
                          "Rebuild every device's timeline of one training iteration from profile.h5, and analyse "
                          "real runs (offline).")
    return run_cli(parser, argv)

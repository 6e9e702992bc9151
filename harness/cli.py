"""`python -m harness`: a registry of subcommands (events, profile, show, train, collectives), each a thin front
end.

Every subcommand module defines NAME, HELP, add_arguments(parser) and run(args) -> int. Bad input
(UserError) becomes one message on stderr and exit status 2, never a traceback; output cut short by its
reader (`| head`) ends quietly with status 141, as a tool killed by SIGPIPE.
"""
from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
from importlib import resources

from harness.errors import UserError

SUBCOMMANDS = ("events", "profile", "show", "train", "collectives")


def default_spec_path() -> str:
    """The built-in demo job, used when no spec is given."""
    return str(resources.files("harness") / "jobs" / "demo.toml")


def build_parser(prog: str, package: str, names: tuple[str, ...], description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in names:
        module = importlib.import_module(f"{package}.{name}")
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def run_cli(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    try:
        status = int(args.run(args) or 0)
        sys.stdout.flush()  # here, where a reader gone away is caught, not in the interpreter's exit
        return status
    except UserError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_is_gone():
            raise  # a pipe of the subcommand's own, not its output
        return 128 + 13  # the reader of our output went away (`... | head`): stop as a SIGPIPE'd tool does


def _stdout_is_gone() -> bool:
    """Whether stdout is a pipe whose reader has gone away (poll reports an error on its end); if so, stdout now
    points at /dev/null, so that the interpreter's final flush cannot fail again."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):
            return False
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
        return True
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (captured), or no poll
        return False


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

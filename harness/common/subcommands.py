"""The registry both front ends share (`python -m harness`, `python -m analysis`): subcommands as modules, bad
input as one message.

Every subcommand module defines NAME, HELP, add_arguments(parser) and run(args) -> int, and where it writes files
OUTPUTS (its arguments' names -> their options, e.g. {"csv": "--csv"}) and INPUTS (the names of the arguments it
reads files from): the outputs are checked against them before run (harness.common.output.check_outputs); an
optional check(args) refuses bad options before run too. Under an MPI launcher only rank 0 reports a bad
argument (every rank parses the same); an MPI command checks its outputs inside its ranks' agreement instead of
declaring them (harness collectives). Bad input (UserError)
becomes one message on stderr and exit status 2, never a traceback; output cut short by its reader (`| head`)
ends quietly with status 141, as a tool killed by SIGPIPE. Pure Python: the analysis runs it offline.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import select
import sys

from harness.common.errors import UserError
from harness.common.launch_env import launched_rank
from harness.common.output import DISK_FULL_ERRNOS, check_outputs


def build_parser(prog: str, package: str, names: tuple[str, ...], description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in names:
        module = importlib.import_module(f"{package}.{name}")
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(run=module.run, outputs=getattr(module, "OUTPUTS", {}),
                             inputs=getattr(module, "INPUTS", ()), check=getattr(module, "check", None))
    return parser


def non_empty(text: str) -> str:
    """An argparse type for an option whose empty value would silently mean "not given" (`--network "$UNSET"`), or
    the current folder (`-o "$UNSET"`)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty; give a value (an unset shell variable?)")
    return text


def run_cli(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    # the arguments are the same on every rank of an MPI job: rank 0 alone says what is wrong with them (the checks
    # below look at files, which a node may see differently: every rank says its own; the commands that
    # communicate agree on run's errors and rank 0 reports them)
    first = launched_rank() in (None, 0)
    with contextlib.nullcontext() if first else contextlib.redirect_stderr(io.StringIO()):
        args = parser.parse_args(argv)
    try:
        check_outputs({option: getattr(args, name, None) for name, option in args.outputs.items()},
                      _paths(getattr(args, name, None) for name in args.inputs))
        if args.check is not None:
            args.check(args)
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
    except OSError as exc:
        if exc.errno not in DISK_FULL_ERRNOS or exc.filename is not None:
            raise  # a file's errors are its writer's to say (harness.common.output.write_failure)
        _stdout_to_devnull()  # so that the interpreter's final flush cannot fail again
        print(f"{parser.prog} {args.command}: error: no space left for the output ({exc.strerror}); free some space "
              "where standard output goes, or send it elsewhere", file=sys.stderr)
        return 1


def _paths(values) -> list:
    """The input arguments' values as one list of paths (an argument may hold several: nargs="+")."""
    out = []
    for value in values:
        out.extend(value if isinstance(value, (list, tuple)) else [value])
    return out


def _stdout_to_devnull() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (captured)
        pass


def _stdout_is_gone() -> bool:
    """Whether stdout is a pipe whose reader has gone away (poll reports an error on its end); if so, stdout now
    points at /dev/null, so that the interpreter's final flush cannot fail again."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):
            return False
        _stdout_to_devnull()
        return True
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (captured), or no poll
        return False

"""What the commands print and write: aligned terminal tables, CSV files, seconds in words, writable paths.

Pure Python (the analysis front ends use it too). Rules:
- a table aligns text left and numbers right; a number column has one format: every float in it gets the
  decimals that give its largest value four significant digits (at most 3, none from 1,000 up), integers
  get thousands separators; a gap (None or "-") shows as "-" and keeps the column a number column;
- a CSV file holds the same rows at full precision (gaps empty), for spreadsheets;
- an output path that cannot be written is bad input (one message, exit 2), not a traceback: a full disk names the
  folder, the bytes needed and the bytes free; a file the failed write had begun is removed;
- a command's output files are checked before its work (check_outputs): an empty name, a folder, a path under a
  file, one of the command's inputs (writing it would lose what was measured) or two options at one path are
  refused, so that a long search or a profile's analysis never ends in an error after the work.
"""
from __future__ import annotations

import argparse
import csv
import errno
import math
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from harness.common.errors import UserError, WriteError

T = TypeVar("T")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """Columns aligned: text left, numbers right, one number format per column (module docstring)."""
    columns = list(zip(*rows)) if rows else [() for _ in headers]
    numeric = [any(_is_number(v) for v in column) and all(_is_number(v) or _is_gap(v) for v in column)
               for column in columns]
    decimals = [_decimals(column) for column in columns]
    cells = [[_cell(value, decimals[i] if numeric[i] else None) for i, value in enumerate(row)] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if numeric[i] else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths)))

    out = [title] if title else []
    out.append(line(list(headers)).rstrip())
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row).rstrip() for row in cells)
    return "\n".join(out)


PNG_NAMES = ((".png",), "charts are written as PNG; give a file name ending in .png")
SPEC_NAMES = ((".toml",), "a job spec is written as FILE.toml (what every command reads); give such a name")
HDF5_NAMES = ((".h5",), "the results are written as HDF5; give a name ending in .h5")
TRACE_NAMES = ((".json", ".json.gz"), "a trace is written as FILE.json or FILE.json.gz (what ui.perfetto.dev "
                                      "opens); give such a name")


def check_name(path: str | Path, names: tuple[tuple[str, ...], str]) -> Path:
    """`path`, where its name ends in one of `names`' suffixes (PNG_NAMES, TRACE_NAMES); else a UserError that says
    what to give."""
    suffixes, advice = names
    path = Path(path)
    if not path.name.lower().endswith(suffixes):
        raise UserError(f"{path}: {advice}")
    return path


def named(names: tuple[tuple[str, ...], str]) -> Callable[[str], str]:
    """An argparse type for an output file of `names` (PNG_NAMES, TRACE_NAMES): refused as the options are read,
    before any output is written."""
    def check(text: str) -> str:
        try:
            check_name(text, names)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return check


def write_csv(path: str | Path, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> Path:
    """The rows of a table as CSV (full precision; None and "-" empty); an unwritable path is a UserError."""
    path = Path(path)

    def write() -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(headers)
            writer.writerows([["" if _is_gap(v) else v for v in row] for row in rows])
        return path
    return writable(path, write)


def writable(path: str | Path, write: Callable[[], T]) -> T:
    """Run `write()` (which writes `path`); an OSError becomes a WriteError naming the path, and a file at `path`
    that was not there before is removed (a failed write leaves no part of itself)."""
    path = Path(path)
    existed = path.exists()
    try:
        return write()
    except WriteError:
        raise
    except OSError as exc:
        if not existed and path.is_file():
            path.unlink()
        raise write_failure(path, exc) from None


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def nearest_existing(path: str | Path) -> Path:
    """`path`, or its nearest parent that exists (where a writer makes the missing folders)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_outputs(outputs: Mapping[str, str | Path | None], inputs: Iterable[str | Path | None] = ()) -> None:
    """Refuse, before any work, the output files (option -> path; None: not given) that could not be written or
    would destroy something (module docstring); `inputs` are the paths the command reads (names that are not
    files, such as a shipped device's, are left alone)."""
    read = {}
    for path in inputs:
        if path is None or not str(path):
            continue
        # a folder given as an input stands for the files the commands read in it (a run's, a profile's)
        candidates = [Path(path) / name for name in FOLDER_INPUTS] if _is_folder(path) else [Path(path)]
        for candidate in candidates:
            if _is_file(candidate):
                read[os.path.realpath(candidate)] = str(candidate)
    seen: dict[str, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        if not str(path).strip():
            raise UserError(f"{option}: the file name is empty; give a file to write, or leave {option} out")
        try:
            _check_output(option, Path(path), read, seen)
        except OSError as exc:  # a name too long, a folder this user cannot look into
            raise UserError(f"{option} {path}: cannot write it ({exc.strerror or exc}); give another path") from None


def _check_output(option: str, path: Path, read: dict[str, str], seen: dict[str, str]) -> None:
    """check_outputs' checks of one output (OSError where the system cannot look at the path)."""
    if path.is_dir():
        raise UserError(f"{option} {path}: cannot write it, it is a folder; give a file name in it")
    folder = nearest_existing(path.parent)
    if not folder.is_dir():
        raise UserError(f"{option} {path}: cannot write it, {folder} is a file, not a folder; give a path in a "
                        "folder")
    real = os.path.realpath(path)
    if real in read:
        raise UserError(f"{option} {path}: is {read[real]}, which this command reads; writing it would lose "
                        "it: give another file")
    if real in seen:
        raise UserError(f"{option} {path}: {seen[real]} writes the same file; give each output its own")
    seen[real] = option


FOLDER_INPUTS = ("trace.h5", "profile.h5")  # what a command reads in a folder given as its input


def _is_file(text: str | Path) -> bool:
    """Whether `text` names a file (an argument that is not a path, such as a launch's arguments, is not one)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # a name too long for the system, or with a NUL in it
        return False


def _is_folder(text: str | Path) -> bool:
    try:
        return Path(text).is_dir()
    except (OSError, ValueError):
        return False


def free_bytes(folder: str | Path) -> int | None:
    """Bytes free to this user in `folder` (its nearest existing parent), None where the system cannot tell (a
    pseudo file system such as /proc or /sys states a size of 0)."""
    try:
        usage = shutil.disk_usage(nearest_existing(folder))
    except OSError:
        return None
    return usage.free if usage.total else None


def write_failure(path: str | Path, exc: OSError, needed: int | None = None, free: int | None = None) -> WriteError:
    """The one message for a file that could not be written: a full disk (with the bytes `needed` and free), a
    read-only or unwritable folder, or another system error."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    reason = exc.strerror or str(exc)
    if exc.errno in DISK_FULL_ERRNOS:
        free = free_bytes(folder) if free is None else free
        sizes = ", ".join(part for part in (needed is not None and f"it needs {format_bytes(needed)}",
                                            free is not None and f"{format_bytes(free)} free") if part)
        return WriteError(f"no space left in {folder} for {path.name}{f' ({sizes})' if sizes else ''}; free some "
                          "space there or write elsewhere", str(path), disk_full=True)
    if exc.errno in READ_ONLY_ERRNOS:
        return WriteError(f"cannot write in {folder}: {reason}; give a writable folder", str(path))
    if exc.errno in (errno.EEXIST, errno.ENOTDIR):  # a file stands where a folder of the path should be
        return WriteError(f"cannot write {path}: a part of {folder} is a file, not a folder; give a path in a "
                          "folder", str(path))
    return WriteError(f"cannot write {path}: {reason}; give a path in a writable folder", str(path))


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def format_bytes(nbytes: float) -> str:
    """Decimal units, as memory capacities are quoted (GB = 1e9 bytes): '1.23 GB', '512 kB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def byte_unit(values: Sequence[float | None]) -> tuple[str, float]:
    """One decimal unit for a column of byte counts: the one its largest value reads best in."""
    largest = max((abs(v) for v in values if v is not None), default=0.0)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if largest >= scale:
            return unit, scale
    return "B", 1.0


def format_duration(seconds: float) -> str:
    """A span of time in the unit it reads best in: '42.0 s', '3.5 min', '12.3 h', '4.2 days'."""
    for unit, scale in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * scale:
            return f"{seconds / scale:,.1f} {unit}"
    return format_seconds(seconds)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_gap(value: Any) -> bool:
    """A missing number: None, or the "-" callers put in its place."""
    return value is None or value == "-"


def _decimals(column: Sequence[Any]) -> int:
    """Decimals for a column's floats: four significant digits for its largest finite value, 0 to 3."""
    largest = max((abs(v) for v in column if isinstance(v, float) and math.isfinite(v)), default=0.0)
    if largest == 0:
        return 0 if not any(isinstance(v, float) for v in column) else 3
    return min(3, max(0, 3 - math.floor(math.log10(largest))))


def _cell(value: Any, decimals: int | None) -> str:
    if _is_gap(value):
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.{decimals if decimals is not None else 3}f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)

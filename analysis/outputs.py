"""Writing output files: an unwritable path is bad input (one message, exit 2), not a traceback."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

from harness.errors import UserError

T = TypeVar("T")


def writable(path: str | Path, write: Callable[[], T]) -> T:
    """Run `write()` (which writes `path`); an OSError becomes a UserError naming the path."""
    try:
        return write()
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}; give a path in a writable folder")

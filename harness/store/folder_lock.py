"""One job at a time in an output folder: `FolderLock` holds OUTDIR/.harness.lock for the job's life.

Rules:
- the lock is an exclusive `flock` on the file, held by the job's rank 0 until it releases it or dies (the
  kernel lets go of a dead process's lock, so a crashed job never blocks the next);
- the file names its holder (host, pid, command, start time); a job that finds the lock held refuses at once,
  naming that holder;
- a job that takes the lock and finds a holder's name still in the file took over from a job that ended
  without releasing it (killed, aborted): `taken_over` says which, for a note;
- releasing empties the file (it is never removed: a job waiting on the old file would lock a ghost);
- a folder that cannot hold the file (read-only, not a folder) is a WriteError, before anything is measured.
On a file system without `flock` the holder's pid is checked instead, where it ran on this host.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from harness.common.errors import UserError
from harness.common.output import write_failure

LOCK_NAME = ".harness.lock"
NO_FLOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)
HOLDER_WAIT_TRIES = 20


class FolderBusy(UserError):
    """Another job holds the folder's lock."""


def describe_holder(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return (f"`{holder.get('command', '?')}` on host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"started {when}")


class FolderLock:
    """The lock of one output folder (module docstring); `acquire` raises FolderBusy or WriteError."""

    def __init__(self, folder: str | Path, command: str):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.command = command
        self.taken_over: dict | None = None  # the holder named in the file when this job took the lock
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise write_failure(self.path, exc) from None
        try:
            state = self._lock(fd)
            previous = _read_holder(fd)
            for _ in range(HOLDER_WAIT_TRIES):  # a job that took the lock this instant writes its name next
                if state != "held" or previous:
                    break
                time.sleep(0.05)
                previous = _read_holder(fd)
            if state == "held" or (state == "unsupported" and previous and _alive_here(previous)):
                raise FolderBusy(f"{self.folder} is in use by {describe_holder(previous or {})}; wait for it to end, "
                                 "or give another folder")
            self.taken_over = previous or None
            mine = {"host": socket.gethostname(), "pid": os.getpid(), "command": self.command, "started": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(mine) + "\n").encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise write_failure(self.path, exc) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    @staticmethod
    def _lock(fd: int) -> str:
        """Take the flock: "taken", "held" (by another process) or "unsupported" (this file system has no flock:
        the holder's pid decides)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return "taken"
        except BlockingIOError:
            return "held"
        except OSError as exc:
            if exc.errno in NO_FLOCK_ERRNOS:
                return "unsupported"
            raise

    def note(self) -> str | None:
        """A line for the user when this job took the lock over from one that ended without releasing it."""
        if self.taken_over is None:
            return None
        return (f"took over {self.path}, left by {describe_holder(self.taken_over)}, which ended without releasing "
                "it; what it finished is kept")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass  # a folder gone read-only: the holder's name stays, and the next job takes the lock over
        os.close(self._fd)  # closing lets go of the flock
        self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def clear_for_this_job(lock: FolderLock, program: str) -> None:
    """Holding the lock: remove what writers killed mid-write left, and say so when this job took the lock over."""
    from harness.store.hdf5_io import remove_temporaries

    removed = remove_temporaries(lock.folder)
    note = lock.note()
    if note:
        left = f"; removed {len(removed)} unfinished temporary file(s)" if removed else ""
        print(f"{program}: NOTE: {note}{left}", file=sys.stderr, flush=True)


def _read_holder(fd: int) -> dict | None:
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not text:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        return {"command": "an unknown job"}
    return holder if isinstance(holder, dict) else {"command": "an unknown job"}


def _alive_here(holder: dict) -> bool:
    """Whether the holder ran on this host and its process (not this one) still lives: the check without flock."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def command_line() -> str:
    """How this process was started, as a user would type it (for the lock's holder)."""
    program = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("python")
    name = f"python -m {program.parent.name}" if program.name == "__main__.py" else program.name
    return " ".join([name, *sys.argv[1:]])

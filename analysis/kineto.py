"""Reading PyTorch profiler traces (the Kineto Chrome-trace JSON of `torch.profiler`, `.json` or `.json.gz`).

A trace is streamed: the top-level object is read key by key and `traceEvents` one event at a time, each event
reduced at once to what an analysis needs (start, duration, name, category, thread, CUDA correlation id), so a
trace takes about 40 bytes per complete event in memory however large its JSON is, never the parsed document
(docs/benchmarks.md, "Breakdown"). Only complete events (`"ph": "X"`) of the categories in KEPT_CATEGORIES are
kept (`cuda_sync` ones only where they name a stream); thread names come from the `thread_name` metadata events.

`whole_microseconds=True` reads times as HolisticTraceAnalysis does: where any event's `ts` is fractional (or
missing), every start is rounded up and every end down to a whole microsecond.

    trace = read_kineto("traces/rank-3.json.gz")
    trace.rank, trace.world_size, trace.backend     # from `distributedInfo`, else the rank from the file name
    trace.events.mask(category="kernel")            # columns: start_s, end_s, name, category, thread, ...
"""
from __future__ import annotations

import gzip
import io
import json
import math
import re
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from harness.common.errors import UserError

KEPT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_sync", "gpu_user_annotation", "cpu_op",
                   "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STREAM_CATEGORIES = GPU_CATEGORIES + ("cuda_sync",)  # what runs on a GPU stream
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # the CPU calls that launch GPU work (by correlation id)
NO_CORRELATION = -1
CHUNK_CHARS = 1 << 20
NUMBER_TAIL = re.compile(r"[0-9.eE+\-]*")  # what may follow a number's decoded part inside the same number
PARTIAL_TOKEN = re.compile(r"[0-9.eE+\-a-z\s]*")  # a number or literal (true, false, null) not yet complete
MAX_VALUE_CHARS = 64 << 20  # no event is this long: a value still open after it is a damaged file
RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
TRACE_SUFFIXES = (".json", ".json.gz")


@dataclass
class Events:
    """Complete events as columns: start_s and end_s (seconds, float64), codes into `names`, `categories` and
    `threads` (int32), and the CUDA correlation id that ties a GPU event to its launch (int64, NO_CORRELATION
    where there is none)."""

    start_s: np.ndarray
    end_s: np.ndarray
    name: np.ndarray
    category: np.ndarray
    thread: np.ndarray
    names: list[str]
    categories: list[str]
    threads: list[str]
    correlation: np.ndarray

    def __len__(self) -> int:
        return len(self.start_s)

    def codes(self, table: list[str], keep: Callable[[str], bool]) -> np.ndarray:
        """The codes of the entries of `table` for which keep() holds."""
        return np.array([i for i, value in enumerate(table) if keep(value)], dtype=np.int32)

    def mask(self, *, category: str | tuple[str, ...] | None = None,
             name: Callable[[str], bool] | None = None) -> np.ndarray:
        """Events of the given categories whose name passes `name` (each a filter left out when None)."""
        keep = np.ones(len(self), dtype=bool)
        if category is not None:
            wanted = (category,) if isinstance(category, str) else category
            keep &= np.isin(self.category, self.codes(self.categories, lambda c: c in wanted))
        if name is not None:
            keep &= np.isin(self.name, self.codes(self.names, name))
        return keep


@dataclass
class KinetoTrace:
    path: Path
    rank: int
    rank_source: str  # "distributedInfo" or "file name"
    world_size: int | None
    backend: str | None
    distributed: dict[str, Any]
    metadata: dict[str, Any]  # the other small top-level values (schemaVersion, deviceProperties, ...)
    events: Events
    thread_names: dict[str, str] = field(default_factory=dict)  # "pid/tid" -> name
    fractional_times: bool = False  # some event's ts is fractional or missing (HolisticTraceAnalysis rounds then)

    @property
    def has_gpu(self) -> bool:
        """Whether the trace holds GPU kernels or memory operations (HolisticTraceAnalysis's rules apply)."""
        return bool(self.events.mask(category=GPU_CATEGORIES).any())


class _Columns:
    """Growing columns of compact events, names and threads interned."""

    def __init__(self) -> None:
        self.start = array("d")
        self.dur = array("d")
        self.name = array("i")
        self.category = array("i")
        self.thread = array("i")
        self.correlation = array("q")
        self.tables: tuple[dict[str, int], dict[str, int], dict[str, int]] = ({}, {}, {})

    def code(self, table: dict[str, int], value: str) -> int:
        code = table.get(value)
        if code is None:
            code = table[value] = len(table)
        return code

    def add(self, ts: float, dur: float, name: str, category: str, thread: str, correlation: int) -> None:
        names, categories, threads = self.tables
        self.start.append(ts)
        self.dur.append(dur)
        self.name.append(self.code(names, name))
        self.category.append(self.code(categories, category))
        self.thread.append(self.code(threads, thread))
        self.correlation.append(correlation)

    def events(self, whole_microseconds: bool = False) -> Events:
        """The columns in seconds; `whole_microseconds`: starts rounded up, ends down to a microsecond."""
        start_us = np.frombuffer(self.start, dtype=np.float64)
        end_us = start_us + np.frombuffer(self.dur, dtype=np.float64)
        if whole_microseconds:
            start_us, end_us = np.ceil(start_us), np.floor(end_us)
        codes = [np.frombuffer(column, dtype=np.int32).copy() for column in (self.name, self.category, self.thread)]
        return Events(start_us * 1e-6, end_us * 1e-6, *codes, *[list(table) for table in self.tables],
                      np.frombuffer(self.correlation, dtype=np.int64).copy())


class _Stream:
    """Incremental JSON over a text stream: values decoded one at a time from a window of the file."""

    def __init__(self, handle: IO[str], path: Path):
        self.handle, self.path = handle, path
        self.buffer, self.pos, self.consumed = "", 0, 0
        self.eof = False
        self.decoder = json.JSONDecoder()

    def _more(self) -> bool:
        if self.eof:
            return False
        chunk = self.handle.read(CHUNK_CHARS)
        if not chunk:
            self.eof = True
            return False
        if self.pos > CHUNK_CHARS:  # drop what was read already
            self.consumed += self.pos
            self.buffer, self.pos = self.buffer[self.pos:], 0
        self.buffer += chunk
        return True

    def error(self, what: str, failure: json.JSONDecodeError | None = None) -> UserError:
        """Cut short: the file ends inside the value being read; else not a trace. `what` says what was expected
        (the place is added)."""
        end = len(self.buffer.rstrip())
        at = self.pos if failure is None else failure.pos
        where = f"{what} at character {self.consumed + at}"
        if self.eof and (at >= end or self.pos >= end or (failure is not None and (
                failure.msg.startswith("Unterminated string") or PARTIAL_TOKEN.fullmatch(self.buffer, at)))):
            return UserError(f"{self.path}: the trace is cut short ({where}); export it again, or copy the "
                             "whole file")
        return UserError(f"{self.path}: not a PyTorch profiler trace ({where}); give the Kineto JSON that "
                         "torch.profiler exports (export_chrome_trace or tensorboard_trace_handler)")

    def peek(self) -> str:
        """The next character that is not white space ('' at the end of the file)."""
        while True:
            while self.pos < len(self.buffer) and self.buffer[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buffer):
                return self.buffer[self.pos]
            if not self._more():
                return ""

    def expect(self, char: str, what: str) -> None:
        if self.peek() != char:
            raise self.error(f"expected {char!r} {what}")
        self.pos += 1

    def value(self) -> Any:
        """Decode the next JSON value, reading on until the window holds all of it."""
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.pos)
            except json.JSONDecodeError as failure:
                if len(self.buffer) - self.pos < MAX_VALUE_CHARS and self._more():
                    continue
                raise self.error(failure.msg, failure) from None
            except (RecursionError, ValueError) as failure:  # nesting past Python's recursion; an integer too long
                raise self.error(str(failure)[:200] or type(failure).__name__) from None
            if (isinstance(value, (int, float)) and not self.eof and NUMBER_TAIL.fullmatch(self.buffer, end)
                    and self._more()):
                continue  # the window ends inside a number ("1." or "1e" decode as 1): read on, decode it whole
            self.pos = end
            return value


def _open_text(path: Path) -> IO[str]:
    raw = open(path, "rb")
    magic = raw.read(2)
    raw.seek(0)
    stream = gzip.GzipFile(fileobj=raw) if magic == b"\x1f\x8b" else raw
    return io.TextIOWrapper(stream, encoding="utf-8", errors="replace")


def _events(stream: _Stream) -> Iterator[dict[str, Any]]:
    stream.expect("[", "after \"traceEvents\":")
    if stream.peek() == "]":
        stream.pos += 1
        return
    while True:
        event = stream.value()
        if isinstance(event, dict):
            yield event
        char = stream.peek()
        stream.pos += 1
        if char == "]":
            return
        if char != ",":
            stream.pos -= 1
            raise stream.error("expected ',' or ']' between trace events")


def rank_from_name(path: Path) -> int | None:
    """The N of a `rank-N` (or rank_N, rankN) in a file name, if there is one."""
    match = RANK_IN_NAME.search(path.name)
    return int(match.group(1)) if match else None


def _integer_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


def read_kineto(path: str | Path, *, whole_microseconds: bool = False) -> KinetoTrace:
    """Read one rank's Kineto trace; UserError if it is not one, is cut short, or names no rank.
    `whole_microseconds`: round fractional times as HolisticTraceAnalysis does (module docstring)."""
    path = Path(path)
    columns = _Columns()
    thread_names: dict[str, str] = {}
    metadata: dict[str, Any] = {}
    saw_events = False
    fractional = False
    try:
        with _open_text(path) as handle:
            stream = _Stream(handle, path)
            stream.expect("{", "at the start (a trace is one JSON object)")
            while stream.peek() != "}":
                if stream.peek() == ",":
                    stream.pos += 1
                key = stream.value()
                if not isinstance(key, str):
                    raise stream.error("expected a key of the top-level object")
                stream.expect(":", f"after the key {key!r}")
                if key != "traceEvents":
                    metadata[key] = stream.value()
                    continue
                saw_events = True
                for event in _events(stream):
                    phase = event.get("ph")
                    if not fractional and type(event.get("ts")) is not int:
                        fractional = True
                    if phase == "X":
                        category = event.get("cat", "")
                        if category not in KEPT_CATEGORIES:
                            continue
                        try:
                            ts, dur = float(event["ts"]), float(event.get("dur", 0.0))
                        except (KeyError, TypeError, ValueError):
                            raise stream.error("a complete event without a numeric \"ts\"") from None
                        if not (math.isfinite(ts) and math.isfinite(dur)):
                            raise stream.error(f"a complete event with \"ts\" {ts} and \"dur\" {dur}: times "
                                               "must be finite")
                        args = event.get("args")
                        args = args if isinstance(args, dict) else {}
                        if category == "cuda_sync" and _integer_or_none(args.get("stream")) in (None, -1):
                            continue  # a device-wide synchronisation, on no stream
                        correlation = _integer_or_none(args.get("correlation"))
                        if correlation is not None and not -1 <= correlation < 1 << 63:
                            correlation = None
                        columns.add(ts, dur, str(event.get("name", "")), category,
                                    f"{event.get('pid', '')}/{event.get('tid', '')}",
                                    NO_CORRELATION if correlation is None else correlation)
                    elif phase == "M" and event.get("name") == "thread_name":
                        thread_names[f"{event.get('pid', '')}/{event.get('tid', '')}"] = str(
                            (event.get("args") or {}).get("name", ""))
            stream.pos += 1
    except FileNotFoundError:
        raise UserError(f"{path}: no such trace file") from None
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise UserError(f"{path}: cannot read the trace ({exc}); is the .gz file complete?") from None
    if not saw_events:
        raise UserError(f"{path}: not a PyTorch profiler trace: it has no \"traceEvents\"")
    events = columns.events(whole_microseconds and fractional)
    if not len(events):
        raise UserError(f"{path}: the trace has no events of {', '.join(KEPT_CATEGORIES)}; was the profiler "
                        "active during the steps it was meant to record?")
    distributed = metadata.pop("distributedInfo", None) or {}
    if not isinstance(distributed, dict):
        raise UserError(f"{path}: distributedInfo is {type(distributed).__name__} {str(distributed)[:40]!r}, not an "
                        "object; the trace was written by another tool, or edited: take it again with torch.profiler")
    rank, source = distributed.get("rank"), "distributedInfo"
    if rank is None:
        rank, source = rank_from_name(path), "file name"
    if rank is None:
        raise UserError(f"{path}: the trace names no rank (no \"distributedInfo\" and no rank-N in the file name); "
                        "rename the files rank-0.json, rank-1.json, ... ")
    world = distributed.get("world_size")
    for name, value in (("rank", rank), ("world_size", world)):
        if value is not None and (isinstance(value, bool) or not re.fullmatch(r"[0-9]{1,9}", str(value))):
            raise UserError(f"{path}: distributedInfo.{name} is {value!r}, not a whole number; the trace was written "
                            "by another tool, or edited: take it again with torch.profiler")
    return KinetoTrace(path=path, rank=int(rank), rank_source=source, world_size=int(world) if world else None,
                       backend=distributed.get("backend"), distributed=distributed, metadata=metadata,
                       events=events, thread_names=thread_names, fractional_times=fractional)


def trace_files(path: Path) -> list[Path]:
    """The Kineto traces of a folder (every *.json and *.json.gz in it), in name order."""
    return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))


def is_kineto_path(path: Path) -> bool:
    """Whether a path given as a run names Kineto traces (a .json/.json.gz file, or a folder holding them and
    no trace.h5)."""
    if path.is_dir():
        return not (path / "trace.h5").exists() and bool(trace_files(path))
    return path.name.endswith(TRACE_SUFFIXES)

"""What `harness train` records on one rank: its intervals (rows of trace.h5's `intervals`), its layer intervals
(`--layer-times`), the clock they are read on, and the torch.profiler annotation of each kind of interval.

A row is (start_ns, end_ns, wait_ns, kind, name, phase, event_id, virtual_stage, micro, iteration, peer), on
this rank's perf_counter_ns; harness.train.trace_writer turns rows into columns on the common timebase.
"""
from __future__ import annotations

import contextlib
import time

import torch

# torch.profiler annotation of each kind of recorded interval (harness train --torch-profiler)
ANNOTATIONS = {"F": "distsim:forward", "B": "distsim:backward", "W": "distsim:backward.weight",
               "tp": "distsim:allreduce.tp", "cp": "distsim:cp", "ep": "distsim:ep",
               "ep_grads": "distsim:allreduce.ep",
               "recv.activation": "distsim:recv.activation", "recv.gradient": "distsim:recv.gradient",
               "opt": "distsim:optimizer", "zero": "distsim:zero.bucket", "tie": "distsim:allreduce.tie"}


class Recorder:
    """Intervals of one rank, on its own clock (ns): appended as tuples, so threads may add safely.

    `iteration` and `step` (phase, virtual stage, micro-batch) say where the device is: rows of collectives
    that run inside a compute step (tensor parallel, FSDP) take their stage and micro-batch from `step`."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.layer_rows: list[tuple] = []  # (start_ns, end_ns, phase, event_id, layer, vs, micro, iteration)
        self.iteration = -1
        self.step: tuple[str, int, int] = ("F", -1, -1)

    def add(self, start_ns: int, end_ns: int, wait_ns: int, kind: str, name: str, phase: str, event_id: str = "",
            vs: int = -1, micro: int = -1, peer: int = -1) -> None:
        self.rows.append((start_ns, end_ns, wait_ns, kind, name, phase, event_id or "", vs, micro, self.iteration,
                          peer))

    def add_layer(self, start_ns: int, end_ns: int, phase: str, event_id: str, layer: int, vs: int,
                  micro: int) -> None:
        self.layer_rows.append((start_ns, end_ns, phase, event_id, layer, vs, micro, self.iteration))

    def step_name(self, name: str) -> str:
        """`name` of a collective in the current step, with `.fwd` or `.bwd` by the step's phase."""
        return f"{name}.{'fwd' if self.step[0] == 'F' else 'bwd'}"


class DeviceClock:
    """The clock every interval is read on: perf_counter_ns, after the device's queued work (a GPU's) is done,
    so that an interval holds what ran in it. `annotated(kind)` marks an interval for torch.profiler when
    `annotate` (ANNOTATIONS)."""

    def __init__(self, device: torch.device, annotate: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        self.annotate = annotate

    def now(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter_ns()

    def annotated(self, kind: str):
        """The torch.profiler annotation of a recorded interval of this kind (nothing unless `annotate`)."""
        if not self.annotate:
            return contextlib.nullcontext()
        from torch.profiler import record_function

        return record_function(ANNOTATIONS[kind])

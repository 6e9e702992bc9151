"""The speed probe: one small fixed piece of work that every profiling rank times once per round.

Every rank profiles its own share of the compute events, so an event's samples carry the speed of the rank
that took them, and ranks differ (cores of a shared machine, nodes that throttle differently). Timed by
every rank in the same rounds, the probe tells the ranks' speeds apart; the analysis
refers each compute event to the ranks' mean (analysis.costs). The work has a transformer MLP's shape, on the
rank's device (SHAPES): an untimed run (what ran before it was the round's last event, different on every
rank), then a timed one. A rank without a share of the compute events has no rounds and no probe.
"""
from __future__ import annotations

import statistics

import torch

from harness.profile.timer import time_region

MIN_SAMPLES = 10  # a rank with fewer rounds tops up right after its share, still in the compute phase
# (rows, width, hidden, dtype) per device type: about 1 ms a run on a CPU core; on a GPU large enough to time
# the device's arithmetic rather than a kernel launch (about 0.7 ms on an H200; float16 where a GPU has no
# bfloat16)
SHAPES = {"cpu": (64, 256, 1024, torch.float32), "cuda": (4096, 4096, 8192, torch.bfloat16)}
DESCRIPTION = ("x (rows x width) @ (width x hidden), GELU, @ (hidden x width): float32 64 x 256 x 1024 on a CPU, "
               "bfloat16 4096 x 4096 x 8192 on a GPU; once untimed then timed, after every round of a rank's "
               f"share of the compute phase (at least {MIN_SAMPLES} times); median per rank, none for a rank "
               "without a share")


class SpeedProbe:
    """The fixed work on `device` (weights from a fixed seed: every rank runs the same) and its samples."""

    def __init__(self, device: torch.device):
        rows, width, hidden, dtype = SHAPES["cuda" if device.type == "cuda" else "cpu"]
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            dtype = torch.float16
        generator = torch.Generator().manual_seed(0)
        self.device = device
        self.x = torch.randn(rows, width, generator=generator).to(device, dtype)
        self.w1 = (torch.randn(width, hidden, generator=generator) / width ** 0.5).to(device, dtype)
        self.w2 = (torch.randn(hidden, width, generator=generator) / hidden ** 0.5).to(device, dtype)
        self.samples_s: list[float] = []

    def _run(self) -> torch.Tensor:
        return torch.nn.functional.gelu(self.x @ self.w1) @ self.w2

    def sample(self) -> None:
        """Run the work untimed, then time it once (CUDA events on a GPU, the wall clock on a CPU)."""
        with torch.no_grad():
            self._run()
            self.samples_s.append(time_region(self._run, self.device))

    def top_up(self) -> None:
        """With some rounds but fewer than MIN_SAMPLES samples, take the rest now (call it in the phase)."""
        while self.samples_s and len(self.samples_s) < MIN_SAMPLES:
            self.sample()

    def median_s(self) -> float | None:
        """The median sample; None without any (a rank that had no share of the compute events)."""
        return statistics.median(self.samples_s) if self.samples_s else None

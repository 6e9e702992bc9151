"""The speed probe: one small fixed piece of work that every profiling rank times once per round.

Every rank profiles its own share of the compute events, so an event's samples carry the speed of the rank
that took them. Ranks differ: on a shared machine one core ran 4-19% slower than the other over the same
profiling minute (docs/benchmarks.md, run 19), and on a cluster nodes throttle differently. Timed by all
ranks in the same rounds, the probe tells the ranks' speeds apart; the analysis refers every compute sample
to the ranks' mean speed (analysis.costs). The work has a transformer MLP's shape, on the rank's
device (SHAPES): an untimed run (what ran before it was the round's last event, different on every rank),
then a timed one.
"""
from __future__ import annotations

import torch

from harness.profilers.timer import time_region

MIN_SAMPLES = 10  # a rank with few or no rounds still gets a median worth the name
# (rows, width, hidden, dtype) per device type: about 1 ms a run on a CPU core; on a GPU large enough to time
# the device's arithmetic rather than a kernel launch (about half a millisecond on an H200)
SHAPES = {"cpu": (64, 256, 1024, torch.float32), "cuda": (4096, 4096, 8192, torch.bfloat16)}
DESCRIPTION = ("x (rows x width) @ (width x hidden), GELU, @ (hidden x width): float32 64 x 256 x 1024 on a CPU, "
               "bfloat16 4096 x 4096 x 8192 on a GPU; once untimed then timed, after every round of the compute "
               f"phase (at least {MIN_SAMPLES} times); median per rank")


class SpeedProbe:
    """The fixed work on `device` (weights from a fixed seed: every rank runs the same) and its samples."""

    def __init__(self, device: torch.device):
        rows, width, hidden, dtype = SHAPES["cuda" if device.type == "cuda" else "cpu"]
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

    def median_s(self) -> float:
        """The median sample, after topping up to MIN_SAMPLES."""
        while len(self.samples_s) < MIN_SAMPLES:
            self.sample()
        ordered = sorted(self.samples_s)
        return ordered[len(ordered) // 2]

"""A compute event's duration from its kernels on a device described as data (harness.plan.device): a roofline
made honest by the description's efficiency curves (rules in docs/devices.md, "The device model").

Each kernel takes its launches x the launch time plus the longer of its compute time and its memory time:
- compute: its executed FLOPs over the peak of its unit in its dtype (matrix for GEMMs and attention, vector for
  memory-bound kernels) x the curve's fraction at its size (GEMMs by FLOPs and smallest dimension; fused attention
  by FLOPs, forward and backward apart; materialised attention by FLOPs; memory-bound kernels at the full vector
  peak). A causal fused attention executes the share of its counted FLOPs that
  harness.plan.kernels.causal_fraction gives at the description's `causal_tile` (its key blocks below the
  diagonal; without a tile half: the masked half skipped);
- memory: its bytes over the HBM bandwidth x the memory curve's fraction at those bytes.
Where the description measured them (format 2, docs/devices.md):
- a memory-bound kernel of a kind in its [vector_ops] computes its elements x the kind's vector operations an
  element (in place of the FLOPs the layer counts) at the vector peak: a GELU bound by its erf on a CPU core;
- a memory-bound kernel of a kind in its [launches] launches that many operations (x its listed launches): a
  LLaMA RMSNorm runs 6 in eager PyTorch, each paying the launch;
- an optimizer step whose optimizer is in its [optimizer] is costed as the framework runs it (optimizer_time):
  its kernels (per tensor and per step) x the measured seconds a kernel beyond its bytes, plus its parameters x
  the counted bytes a parameter at the optimizer's measured bandwidth.
- a layer the run wraps (a full-recompute layer under torch.utils.checkpoint, a ZeRO job's FSDP2 unit, a
  zero-bubble schedule's split backward) costs its wrapper's [wrappers.NAME] seconds beyond its kernels
  (wrapper_seconds): the device's time on a CPU, where the framework's code runs on the cores that compute; the
  host's issue time on a GPU. A ZeRO all-gather costed as the bare collective gains FSDP2's unshard
  (unshard_seconds): its copies on the roofline, and [wrappers.fsdp2]'s unshard time; a ZeRO reduce-scatter, FSDP2's
  reduce (reduce_seconds): its copy-in on the roofline, and [wrappers.fsdp2]'s reduce time.
The host issues each kernel in the description's `[host] kernel_issue_us` (per launch): a compute event's issue
time (`issue_seconds`), which analysis.simulate plays against the device's time (Costs.host_issue).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from harness.plan.device import DeviceDescription, load_device
from harness.plan.device_fit import KernelTime, kernel_time, launched, memory_seconds, optimizer_time
from harness.plan.kernels import Kernel, MemoryBound, reduce_kernels, unshard_kernels, unshard_tensors


class DeviceModel:
    """Seconds of kernels (harness.plan.kernels) on one described device."""

    def __init__(self, description: DeviceDescription):
        self.description = description

    @classmethod
    def named(cls, text: str) -> DeviceModel:
        """The model of `[cluster] device = TEXT`: a shipped name or a description's path (harness.plan.device)."""
        return cls(load_device(text))

    @property
    def name(self) -> str:
        return self.description.name

    def kernel_time(self, kernel: Kernel) -> KernelTime:
        """`kernel`'s compute, memory and launch seconds (module docstring; harness.plan.device_fit.kernel_time)."""
        return kernel_time(self.description, kernel)

    def memory_seconds(self, nbytes: float) -> float:
        """`nbytes` read and written by one kernel: over the bandwidth x the memory curve's fraction at them."""
        return memory_seconds(self.description, nbytes)

    def optimizer_time(self, kernel: MemoryBound) -> KernelTime:
        """An optimizer step on a description with its [optimizer.NAME] (harness.plan.device_fit.optimizer_time)."""
        return optimizer_time(self.description, kernel)

    def kernel_seconds(self, kernel: Kernel) -> float:
        return self.kernel_time(kernel).seconds

    def event_seconds(self, kernels: Iterable[Kernel]) -> float:
        """A compute event's seconds: its kernels', one after another."""
        return sum(self.kernel_seconds(kernel) for kernel in kernels)

    def wrapper_seconds(self, content: Mapping[str, Any], kernels: Iterable[Kernel]) -> float:
        """The framework's seconds around a compute event's layer beyond its kernels, where the run wraps it
        (content's RUN_WRAPPERS keys, or a split backward's phase: `split_backward`; the description's
        [wrappers.NAME], 0 where it has none): a wrapper's forward_s on a `fwd`, its backward_s on the call that
        runs the layer's autograd (`bwd`, or a split backward's `bwd_input`), its weight_s on a `bwd_weight`, and
        on an `optimizer` step over FSDP2's shards optimizer_kernel_s a kernel it launches. A full-recompute group
        of several layers runs one checkpoint and is costed one a layer."""
        phase = content.get("phase")
        total = 0.0
        for name in self.wrappers_of(content):
            cost = self.description.wrappers[name]
            if phase == "fwd":
                total += cost.forward_s
            elif phase in ("bwd", "bwd_input"):
                total += cost.backward_s
            elif phase == "bwd_weight":
                total += cost.weight_s
            elif phase == "optimizer" and cost.optimizer_kernel_s:
                total += cost.optimizer_kernel_s * sum(self.launched(kernel) for kernel in kernels)
        return total

    def unshard_seconds(self, content: Mapping[str, Any]) -> tuple[float, float]:
        """FSDP2's time around a ZeRO all-gather beyond the collective (content: the event's): its copies'
        (harness.plan.kernels.unshard_kernels, on the roofline) and the framework's ([wrappers.fsdp2] unshard_s
        plus unshard_tensor_s a parameter tensor; 0 where the description has none)."""
        return self._fsdp2_seconds(unshard_kernels(content), content, "unshard")

    def reduce_seconds(self, content: Mapping[str, Any]) -> tuple[float, float]:
        """FSDP2's time around a ZeRO reduce-scatter beyond the collective (content: the event's): its copy-in's
        (harness.plan.kernels.reduce_kernels, on the roofline) and the framework's ([wrappers.fsdp2] reduce_s plus
        reduce_tensor_s a parameter tensor; 0 where the description has none)."""
        return self._fsdp2_seconds(reduce_kernels(content), content, "reduce")

    def _fsdp2_seconds(self, kernels: list[MemoryBound], content: Mapping[str, Any], side: str) -> tuple[float, float]:
        """(the copies' seconds on the roofline, [wrappers.fsdp2]'s `side`_s plus `side`_tensor_s a parameter
        tensor of the event's unit, 0 where the description has none)."""
        copies = sum(self.kernel_seconds(kernel) for kernel in kernels)
        cost = self.description.wrappers.get("fsdp2")
        if cost is None:
            return copies, 0.0
        return copies, getattr(cost, f"{side}_s") + getattr(cost, f"{side}_tensor_s") * unshard_tensors(content)

    def wrappers_of(self, content: Mapping[str, Any]) -> list[str]:
        """The description's wrappers around a compute event: those its content names, checkpointed on a block
        of selective recompute too (its attention core runs under torch.utils.checkpoint, once a forward and once
        a backward), and split_backward on a split backward's halves."""
        implied = set()
        if content.get("phase") in ("bwd_input", "bwd_weight"):
            implied.add("split_backward")
        signature = content.get("signature")
        if isinstance(signature, Mapping) and signature.get("recompute") == "selective":
            implied.add("checkpointed")
        return [name for name in self.description.wrappers if content.get(name) or name in implied]

    def launched(self, kernel: Kernel) -> float:
        """The kernels the framework launches for `kernel` (harness.plan.device_fit.launched)."""
        return launched(self.description, kernel)

    def issue_seconds(self, kernels: Iterable[Kernel]) -> float:
        """The host's seconds to issue a compute event's kernels: their launches x the description's
        kernel_issue_s (0 where the description gives none: the host keeps ahead)."""
        return sum(self.description.kernel_launches(kernel) for kernel in kernels) * self.description.kernel_issue_s


# a one-tier network fitted to collectives measured on a few ranks (harness device's in context, or harness
# collectives' back to back): a grid over bandwidth and latency
TIER_BANDWIDTHS_GBS = tuple(10 ** (x / 20) for x in range(-40, 21))  # 0.01 to 10 GB/s, 20 a decade
TIER_LATENCIES_US = tuple(10 ** (x / 20) for x in range(0, 101))  # 1 us to 100 ms (a loaded machine's time slices)


def fit_tier(points: Sequence[tuple[str, float, float]], ranks: int, name: str = "gloo",
             bandwidths_gbs: Sequence[float] = TIER_BANDWIDTHS_GBS,
             latencies_us: Sequence[float] = TIER_LATENCIES_US, library: str = "gloo") -> dict:
    """The one-tier network of `ranks` devices (analysis.network's model: NetworkTier(name, ranks, bandwidth,
    latency), its collectives run by `library`, as the points were) whose estimates best fit `points` (operation,
    bytes as harness collectives counts them, seconds): the grid point of least squared log error. Its fields as
    [[cluster.network]] takes them, with the fit's rms log error and its points."""
    from analysis.network import spec_network
    from harness.plan.network import NetworkTier, contiguous_span

    points = [(op, float(size), float(seconds)) for op, size, seconds in points if seconds > 0]
    if not points:
        raise ValueError("no collectives to fit a tier on")
    best = None
    for bandwidth in bandwidths_gbs:
        for latency in latencies_us:
            tiers = (NetworkTier(name, ranks, bandwidth, latency),)
            model, span = spec_network(tiers, library), contiguous_span(ranks, tiers)
            loss = sum(math.log(model.estimate(op, size, span).seconds / seconds) ** 2 for op, size, seconds in points)
            if best is None or loss < best[0]:
                best = (loss, bandwidth, latency)
    loss, bandwidth, latency = best
    return {"name": name, "size": ranks, "bandwidth_gbs": bandwidth, "latency_us": latency,
            "rms_log_error": math.sqrt(loss / len(points)), "points": len(points)}


def in_context_tier(rows: Sequence[dict], name: str = "gloo", column: str = "in_context_s",
                    library: str = "gloo") -> dict:
    """fit_tier on `harness device`'s collectives in context (its --json `collectives_in_context` rows, timed over
    torch.distributed: gloo on a CPU; `column` back_to_back_s: the same collectives back to back after a
    barrier)."""
    return fit_tier([(r["op"], r["bytes"], r[column]) for r in rows], int(rows[0]["ranks"]), name, library=library)

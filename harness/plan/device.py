"""A device described as data: a datasheet's peaks and the efficiency curves that make a roofline honest.

`[cluster] device = "NAME"` names a shipped description (harness/plan/devices/NAME.toml) and `device = "PATH.toml"`
a user's. The format (version DEVICE_FORMAT), its fields and each shipped figure's source are in docs/devices.md.
Pure Python (stdlib tomllib); analysis.device_model costs kernels with it.
"""
from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from harness.common.errors import SpecError, UserError
from harness.common.toml_text import toml_value

DEVICE_FORMAT = 2  # what this harness writes where a description needs it (FORMATS: what it reads)
FORMATS = (1, 2)  # 2 adds the optional [vector_ops], [launches], [optimizer.NAME] and [wrappers.NAME] tables
# and [host] inline_collective_us and a pipeline send's p2p_post_us, p2p_sender_busy_us and p2p_late_us (each
# with its _per_mib)
US, GB_S, TFLOPS = 1e-6, 1e9, 1e12  # the file's units in SI: launch_us and kernel_issue_us, GB/s, TFLOP/s
SHIPPED_DIR = Path(__file__).with_name("devices")
# the datasheet's number formats a peak may be given for; the model's dtypes (harness.plan.spec.DTYPES) are required
PEAK_DTYPES = ("float32", "tfloat32", "bfloat16", "float16", "float8")
REQUIRED_DTYPES = ("float32", "bfloat16", "float16")
# efficiency curves: what each is a fraction of, and what its size is measured in
CURVES = {
    "gemm": "the matrix peak, by the GEMM's FLOPs (2 m n k x batch)",
    "sdpa_forward": "the matrix peak, by a fused (flash / memory-efficient) attention forward's FLOPs",
    "sdpa_backward": "the matrix peak, by a fused attention backward's FLOPs",
    "materialized_attention": "the matrix peak, by a materialised-softmax attention's FLOPs (older Megatron-LM)",
    "memory": "the HBM bandwidth, by a memory-bound kernel's bytes",
}
# the kinds of memory-bound kernel harness.plan.kernels names (MemoryBound.op), each with its backward
# (+ "_backward"), and what its `elements` count: a norm, activation, residual add, dropout or copy its output's
# elements, rotary the rotated q and k elements, an embedding's lookup its rows' elements read (rows x h),
# the loss its logits, a fill the elements it writes
MEMORY_KINDS = ("copy", "add", "fill", "layer_norm", "rms_norm", "gelu", "swiglu", "dropout", "rotary", "embedding",
                "cross_entropy")
VECTOR_KINDS = tuple(k for kind in MEMORY_KINDS for k in (kind, f"{kind}_backward"))
# an optimizer step's op (MemoryBound.op): torch's Adam, SGD without and with momentum
OPTIMIZER_KINDS = ("adam", "sgd", "sgd_momentum")
# what a compute event's content says about how the run wraps its layer (torch.utils.checkpoint, FSDP2): the
# framework's code around the layer costs time of its own ([wrappers.NAME])
RUN_WRAPPERS = ("checkpointed", "fsdp2")
# and the zero-bubble schedules' split backward (torch.distributed.pipelining's stage_backward_input and _weight),
# which the events' phases say (bwd_input, bwd_weight): the [wrappers.NAME] a description may give
WRAPPERS = (*RUN_WRAPPERS, "split_backward")
_TOP = {"format", "name", "title", "processor", "fitted", "fitted_on", "datasheet", "efficiency", "host",
        "vector_ops", "launches", "optimizer", "wrappers"}
PROCESSORS = ("gpu", "cpu")  # what the description describes; a spec-only interval draws on held-out runs of its kind
_FORMAT_2 = ("vector_ops", "launches", "optimizer", "wrappers")  # the tables format 2 adds
_DATASHEET = {"memory_gb", "memory_bandwidth_gb_s", "matrix_tflops", "vector_tflops"}
_EFFICIENCY = {"launch_us", "causal_tile", *CURVES}
MAX_CAUSAL_TILE = 1 << 20  # keys: beyond any sequence a job here runs
_CURVE = {"max_fraction", "half_at", "steepness"}
_GEMM_CURVE = _CURVE | {"half_dim"}
# [host] field -> DeviceDescription attribute (microseconds in the file, seconds in the description)
HOST_FIELDS = {"kernel_issue_us": "kernel_issue_s", "collective_issue_us": "collective_issue_s",
               "step_gap_us": "step_gap_s", "inline_collective_us": "inline_collective_s",
               "p2p_post_us": "p2p_post_s", "p2p_post_us_per_mib": "p2p_post_s_per_mib",
               "p2p_sender_busy_us": "p2p_sender_busy_s", "p2p_sender_busy_us_per_mib": "p2p_sender_busy_s_per_mib",
               "p2p_late_us": "p2p_late_s", "p2p_late_us_per_mib": "p2p_late_s_per_mib"}
HOST_FORMAT_2 = ("inline_collective_us", "p2p_post_us", "p2p_post_us_per_mib", "p2p_sender_busy_us",
                 "p2p_sender_busy_us_per_mib", "p2p_late_us", "p2p_late_us_per_mib")  # the [host] fields format 2 adds
MIB = 1 << 20
_OPTIMIZER = {"kernels_per_tensor", "kernels_per_step", "bytes_per_parameter", "kernel_us", "bandwidth_gb_s"}
_WRAPPER = {"forward_us", "backward_us", "weight_us", "optimizer_kernel_us", "unshard_us", "unshard_tensor_us",
            "reduce_us", "reduce_tensor_us"}
# fsdp2's alone: its all-gathers' and its reduce-scatters' framework time
_FSDP2_ONLY = ("unshard_us", "unshard_tensor_us", "reduce_us", "reduce_tensor_us")


@dataclass(frozen=True)
class OptimizerCost:
    """An optimizer step as the framework runs it on the device ([optimizer.NAME], format 2): the kernels it
    launches for each parameter tensor (torch's one-tensor-at-a-time implementation: every operation once a
    tensor) and once a step (the foreach implementation: each operation once over every tensor), the bytes its
    kernels read and write a parameter (every pass over the parameter, its gradient and its states): counted; a
    kernel's seconds beyond its bytes (its launch and the framework's code around it) and the bytes/s its kernels
    move those bytes at: measured. A step over T tensors of P parameters in all takes
    (kernels_per_step + kernels_per_tensor x T) x kernel_s + P x bytes_per_parameter / bandwidth."""

    kernels_per_tensor: float
    kernels_per_step: float
    bytes_per_parameter: float
    kernel_s: float
    bandwidth: float  # bytes/s

    def to_dict(self) -> dict[str, float]:
        return {"kernels_per_tensor": self.kernels_per_tensor, "kernels_per_step": self.kernels_per_step,
                "bytes_per_parameter": self.bytes_per_parameter, "kernel_us": in_unit(self.kernel_s, US),
                "bandwidth_gb_s": in_unit(self.bandwidth, GB_S)}


@dataclass(frozen=True)
class WrapperCost:
    """The framework's seconds around a layer the run wraps ([wrappers.NAME], NAME in WRAPPERS; format 2), beyond
    the layer's own kernels: once a forward, once a backward (the call that runs its autograd: `bwd`, or a split
    backward's `bwd_input`), once a split backward's `bwd_weight` and, for FSDP2, once a kernel of an optimizer
    step over its sharded parameters (DTensor's dispatch), on each all-gather of a unit (`unshard()`), unshard_s
    plus unshard_tensor_s a parameter tensor beyond the collective and its copies, and on each reduce-scatter of a
    unit's gradients (its post-backward), reduce_s plus reduce_tensor_s a parameter tensor beyond the collective
    and its copy-in. Measured by harness device on tiny blocks, wrapped against plain (the unshard and reduce
    figures on units over its ranks)."""

    forward_s: float
    backward_s: float
    optimizer_kernel_s: float = 0.0
    weight_s: float = 0.0
    unshard_s: float = 0.0
    unshard_tensor_s: float = 0.0
    reduce_s: float = 0.0
    reduce_tensor_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        out = {"forward_us": in_unit(self.forward_s, US), "backward_us": in_unit(self.backward_s, US)}
        for key, value in (("weight_us", self.weight_s), ("optimizer_kernel_us", self.optimizer_kernel_s),
                           ("unshard_us", self.unshard_s), ("unshard_tensor_us", self.unshard_tensor_s),
                           ("reduce_us", self.reduce_s), ("reduce_tensor_us", self.reduce_tensor_s)):
            if value:
                out[key] = in_unit(value, US)
        return out


# a description's figures in their fields' units (TFLOP/s, GB/s, us, FLOPs, bytes): none above the top, no rate (what
# times divide by) below the bottom; beyond them, a typo or a unit
FIGURE_RANGE = (1e-9, 1e15)
MAX_STEEPNESS = 8.0  # a curve steeper than this is a step; the fit keeps its own in harness.plan.device_fit's range
RAMP_EXPONENT_LIMIT = 700.0  # the ramp's least value, e^-700: a kernel far below its half point is slow, not free


@dataclass(frozen=True)
class Curve:
    """Achieved fraction of a peak as a saturating function of a kernel's size x (FLOPs or bytes):
    max_fraction x^p / (x^p + half_at^p), p = steepness; half_at is where half of max_fraction is reached.
    A GEMM's also falls with its smallest dimension d (tiles left empty): x d / (d + half_dim)."""

    max_fraction: float
    half_at: float
    steepness: float = 1.0
    half_dim: float = 0.0

    def fraction(self, size: float, smallest_dim: float | None = None) -> float:
        if size <= 0:
            return 0.0
        ramp = 1.0
        if self.half_at:  # (half_at / size) ** steepness through its logarithm, which cannot overflow
            ramp = 1.0 / (1.0 + math.exp(min(RAMP_EXPONENT_LIMIT,
                                             self.steepness * (math.log(self.half_at) - math.log(size)))))
        if self.half_dim and smallest_dim is not None:
            ramp *= smallest_dim / (smallest_dim + self.half_dim)
        return self.max_fraction * ramp

    def to_dict(self) -> dict[str, float]:
        out = {"max_fraction": self.max_fraction, "half_at": self.half_at, "steepness": self.steepness}
        return {**out, "half_dim": self.half_dim} if self.half_dim else out


@dataclass(frozen=True)
class DeviceDescription:
    """One device: peaks in FLOP/s per dtype for its matrix (tensor core) and vector units, HBM bandwidth in
    bytes/s and capacity in GB (1e9 bytes), a kernel launch's seconds, and the efficiency curves (CURVES).
    `kernel_issue_s`: the host's seconds to issue one kernel (the framework driving the device; 0: the host
    keeps ahead of the device); `collective_issue_s` its seconds to issue one collective inline in a step (the
    framework's collective call and the library's enqueue; 0: none); `step_gap_s` the training engine's host seconds
    between a device's steps that the device waits out (a synchronising data load, the engine's bookkeeping per
    micro-batch; 0: none); `inline_collective_s` (format 2) a CPU's seconds a tensor-parallel collective inline in a
    layer's pass costs beyond its bytes on the network model (the wait for the other ranks' arrival and the
    library's threads on cores the ranks keep busy; 0: none); `p2p_post_s` and `p2p_sender_busy_s` (format 2), each
    with its seconds a MiB (`_per_mib`), a CPU's pipeline send: the sender's seconds to post it as a training step
    does, and what its transfer takes beyond the least when the receiver posts late while the sender computes (its
    library's thread must win the sender's core; 0: none), both as a profile measures its P2P events, and
    `p2p_late_s` what such a send received late takes from the compute of each of its two ranks (their library
    threads on the cores the ranks keep busy; 0: none); p2p_post, p2p_sender_busy and p2p_late give them at a
    send's bytes. `fitted`: whether the figures were fitted on
    measurements (`fitted_on` says which), or are starting values."""

    name: str
    title: str
    memory_gb: float
    memory_bandwidth: float  # bytes/s
    matrix_peak: Mapping[str, float]  # dtype -> FLOP/s
    vector_peak: Mapping[str, float]
    launch_s: float
    curves: Mapping[str, Curve]
    fitted: bool = False
    fitted_on: str = ""
    kernel_issue_s: float = 0.0
    collective_issue_s: float = 0.0
    step_gap_s: float = 0.0
    inline_collective_s: float = 0.0
    p2p_post_s: float = 0.0
    p2p_post_s_per_mib: float = 0.0
    p2p_sender_busy_s: float = 0.0
    p2p_sender_busy_s_per_mib: float = 0.0
    p2p_late_s: float = 0.0
    p2p_late_s_per_mib: float = 0.0
    source: str = field(default="<device>", compare=False)
    # format 2: vector operations an element and operations launched a call per kind of memory-bound kernel
    # (VECTOR_KINDS), and optimizer steps as the framework runs them (OPTIMIZER_KINDS -> OptimizerCost); empty:
    # bytes alone and one launch a kernel, as in format 1
    vector_ops: Mapping[str, float] = field(default_factory=dict)
    launches: Mapping[str, float] = field(default_factory=dict)
    optimizer: Mapping[str, OptimizerCost] = field(default_factory=dict)
    processor: str = "gpu"  # PROCESSORS: a GPU (every shipped description) or a CPU (harness device on one)
    wrappers: Mapping[str, WrapperCost] = field(default_factory=dict)  # WRAPPERS -> its cost; empty: none
    # format 2: the keys a fused causal attention computes as one block (harness.plan.kernels.causal_fraction);
    # 0: none, the masked half skipped
    causal_tile: int = 0

    @property
    def format(self) -> int:
        """The format its file needs: 2 where it has a format-2 table, else 1 (read by every harness)."""
        return 2 if (self.vector_ops or self.launches or self.optimizer or self.wrappers or self.causal_tile
                     or any(getattr(self, HOST_FIELDS[key]) for key in HOST_FORMAT_2)) else 1

    def p2p_post(self, nbytes: float) -> float:
        """A pipeline send's post of `nbytes` (seconds; 0 without the figures)."""
        return self.p2p_post_s + nbytes / MIB * self.p2p_post_s_per_mib

    def p2p_sender_busy(self, nbytes: float) -> float:
        """A pipeline send's extra seconds where its receiver posts late while its sender computes (0: none)."""
        return self.p2p_sender_busy_s + nbytes / MIB * self.p2p_sender_busy_s_per_mib

    def p2p_late(self, nbytes: float) -> float:
        """The compute seconds a pipeline send received late takes from each of its two ranks (0: none)."""
        return self.p2p_late_s + nbytes / MIB * self.p2p_late_s_per_mib

    def kernel_launches(self, kernel: Any) -> float:
        """A kernel's launches here: the listing's (kernel.launches) x, for a memory-bound kind in [launches],
        the operations the framework launches for one (a LLaMA RMSNorm is 6: pow, mean, add, rsqrt, two mul)."""
        per = self.launches.get(getattr(kernel, "op", ""), 1.0)
        return kernel.launches * per

    def to_dict(self) -> dict[str, Any]:
        """The description as plain data in the file's form (parse_device reads it back)."""
        out: dict[str, Any] = {"format": self.format, "name": self.name, "title": self.title}
        if self.processor != "gpu":
            out["processor"] = self.processor
        out["fitted"] = self.fitted
        if self.fitted_on:
            out["fitted_on"] = self.fitted_on
        out["datasheet"] = {"memory_gb": self.memory_gb,
                            "memory_bandwidth_gb_s": in_unit(self.memory_bandwidth, GB_S),
                            "matrix_tflops": {k: in_unit(v, TFLOPS) for k, v in self.matrix_peak.items()},
                            "vector_tflops": {k: in_unit(v, TFLOPS) for k, v in self.vector_peak.items()}}
        out["efficiency"] = {"launch_us": in_unit(self.launch_s, US),
                             **({"causal_tile": self.causal_tile} if self.causal_tile else {}),
                             **{name: curve.to_dict() for name, curve in self.curves.items()}}
        host = {key: in_unit(getattr(self, attribute), US) for key, attribute in HOST_FIELDS.items()
                if getattr(self, attribute)}
        if host:
            out["host"] = host
        if self.vector_ops:
            out["vector_ops"] = dict(self.vector_ops)
        if self.launches:
            out["launches"] = dict(self.launches)
        if self.optimizer:
            out["optimizer"] = {name: cost.to_dict() for name, cost in self.optimizer.items()}
        if self.wrappers:
            out["wrappers"] = {name: cost.to_dict() for name, cost in self.wrappers.items()}
        return out

    def to_toml(self, header: str = "") -> str:
        """The description as a TOML file (what a fit or a calibration writes); `header` becomes comments."""
        data = self.to_dict()
        lines = [f"# {line}" for line in header.splitlines()]
        lines += [f"{key} = {toml_value(data[key])}" for key in ("format", "name", "title", "processor", "fitted",
                                                             "fitted_on") if key in data]
        sheet = data["datasheet"]
        lines += ["", "[datasheet]"] + [f"{key} = {toml_value(value)}" for key, value in sheet.items()]
        efficiency = data["efficiency"]
        lines += ["", "[efficiency]", f"launch_us = {toml_value(efficiency.pop('launch_us'))}"]
        if "causal_tile" in efficiency:
            lines.append(f"causal_tile = {toml_value(efficiency.pop('causal_tile'))}")
        for name, curve in efficiency.items():
            lines += ["", f"[efficiency.{name}]"] + [f"{key} = {toml_value(value)}" for key, value in curve.items()]
        if "host" in data:
            lines += ["", "[host]"] + [f"{key} = {toml_value(value)}" for key, value in data["host"].items()]
        for table in ("vector_ops", "launches"):
            if table in data:
                lines += ["", f"[{table}]"] + [f"{key} = {toml_value(value)}" for key, value in data[table].items()]
        for table in ("optimizer", "wrappers"):
            for name, cost in data.get(table, {}).items():
                lines += ["", f"[{table}.{name}]"] + [f"{key} = {toml_value(value)}" for key, value in cost.items()]
        return "\n".join(lines) + "\n"


def in_unit(value: float, unit: float) -> float:
    """`value` (in SI units) as the file writes it in `unit` (US, GB_S, TFLOPS): the shortest decimal that
    parse_device reads back (figure x unit) as exactly `value`, so that a description round-trips through its
    file bit for bit (6.6607 us stays 6.6607, not 6.660699999999999)."""
    quotient = value / unit
    if not math.isfinite(quotient):
        return quotient
    for digits in range(1, 18):
        figure = float(f"{quotient:.{digits}g}")
        if figure * unit == value:
            return figure
    up = down = quotient
    for _ in range(4):  # rarely: a neighbour of the quotient reads back exactly
        up, down = math.nextafter(up, math.inf), math.nextafter(down, -math.inf)
        for figure in (up, down):
            if figure * unit == value:
                return figure
    return quotient


def shipped_devices() -> list[str]:
    """The names of the shipped descriptions (harness/plan/devices/*.toml)."""
    return sorted(path.stem for path in SHIPPED_DIR.glob("*.toml"))


def check_output_path(text: str, option: str = "-o") -> Path:
    """The path a description is written to: a .toml file (what `[cluster] device` reads as a path) that is not
    already something else (a job spec: both end in .toml); UserError naming `option` otherwise (a folder or an
    unwritable place: harness.common.output.check_outputs)."""
    output = Path(text)
    if output.suffix != ".toml":
        raise UserError(f"{option} {text}: a device description is a .toml file (a spec's [cluster] device reads a "
                        "path ending in .toml)")
    if output.is_file() and output.stat().st_size:  # an empty file (mktemp's) holds nothing to lose
        try:
            existing = tomllib.loads(output.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            existing = None
        if not isinstance(existing, dict) or "format" not in existing:
            what = "a job spec" if isinstance(existing, dict) and "model" in existing else "not a device description"
            raise UserError(f"{option} {text}: exists and is {what}; writing the description there would replace it: "
                            "give another name")
    return output


def is_device_path(text: str) -> bool:
    """Whether `device = TEXT` is a file's path (ends in .toml or has a folder) rather than a shipped name."""
    return text.endswith(".toml") or "/" in text or "\\" in text


def load_device(text: str) -> DeviceDescription:
    """The description `[cluster] device = TEXT` names: a shipped one by name, or a TOML file by path (relative to
    the working directory). An unknown name or a missing file: SpecError on cluster.device; a bad description:
    SpecError naming its file and field."""
    if not isinstance(text, str) or not text:
        raise SpecError(f"must be a device name ({', '.join(shipped_devices())}) or a description's path "
                        f"(*.toml, docs/devices.md), got {text!r}", field="cluster.device")
    if is_device_path(text):
        path = Path(text)
        if path.is_dir():
            raise SpecError(f"device description {text!r} is a folder; give the description's TOML file",
                            field="cluster.device")
        if not path.is_file():
            raise SpecError(f"device description {text!r} not found; give a TOML file's path (format in "
                            f"docs/devices.md) or a shipped name ({', '.join(shipped_devices())})",
                            field="cluster.device")
    else:
        path = SHIPPED_DIR / f"{text}.toml"
        if not path.is_file():
            raise SpecError(f"unknown device {text!r}; shipped: {', '.join(shipped_devices())}, or give a "
                            "description's path (*.toml, format in docs/devices.md)", field="cluster.device")
    stat = path.stat()
    return _read_device(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=64)
def _read_device(path: str, mtime_ns: int, size: int) -> DeviceDescription:
    """The description in the file at `path`, read once while its modification time and size stay (a search
    parses its spec, and so its device, once per candidate)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"malformed TOML: {exc}", source=path) from None
    except (ValueError, RecursionError):  # an integer past Python's 4,300 digits; tables nested past its recursion
        raise SpecError("malformed TOML: a number thousands of digits long, or tables nested thousands deep",
                        source=path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read the device description: {exc}", source=path) from None
    return parse_device(data, source=path, default_name=Path(path).stem)


def parse_device(data: Mapping[str, Any], source: str = "<device>", default_name: str = "device") -> DeviceDescription:
    """Validate plain data (as read from TOML) into a DeviceDescription; every error names `source` and the field."""

    def fail(message: str, where: str) -> SpecError:
        return SpecError(message, field=where, source=source)

    if "format" not in data and ("model" in data or "strategy" in data):
        raise fail("this is a job spec (docs/spec.md), not a device description (docs/devices.md); give a "
                   "description's file or a shipped name", "format")
    _known(data, _TOP, "", fail)
    version = data.get("format")
    if version is None:
        raise fail(f"is missing; a description starts with format = {FORMATS[0]} (or {DEVICE_FORMAT} with its "
                   "optional tables; docs/devices.md)", "format")
    if isinstance(version, bool) or version not in FORMATS:
        raise fail(f"unsupported device format {version!r}; this harness reads format = "
                   f"{' or '.join(map(str, FORMATS))} (docs/devices.md)", "format")
    for key in _FORMAT_2:
        if key in data and version < 2:
            raise fail("is a format 2 table; say format = 2 (docs/devices.md)", key)
    name = data.get("name", default_name)
    title = data.get("title", name)
    fitted_on = data.get("fitted_on", "")
    for key, value in (("name", name), ("title", title), ("fitted_on", fitted_on)):
        if not isinstance(value, str):
            raise fail(f"must be a string, got {value!r}", key)
    processor = data.get("processor", "gpu")
    if processor not in PROCESSORS:
        raise fail(f"must be one of {', '.join(PROCESSORS)}, got {processor!r}", "processor")
    fitted = data.get("fitted", False)
    if not isinstance(fitted, bool):
        raise fail(f"must be true or false, got {fitted!r}", "fitted")
    sheet = _table(data, "datasheet", fail)
    _known(sheet, _DATASHEET, "datasheet", fail)
    peaks = {}
    for unit in ("matrix_tflops", "vector_tflops"):
        where = f"datasheet.{unit}"
        table = _table(sheet, unit, fail, where)
        _known(table, set(PEAK_DTYPES), where, fail)
        for dtype in REQUIRED_DTYPES:
            if dtype not in table:
                raise fail(f"is required: the {dtype} peak in TFLOP/s (dense)", f"{where}.{dtype}")
        peaks[unit] = {dtype: _positive(table, dtype, where, fail, rate=True) * TFLOPS for dtype in table}
    efficiency = _table(data, "efficiency", fail)
    _known(efficiency, _EFFICIENCY, "efficiency", fail)
    causal_tile = efficiency.get("causal_tile", 0)
    if isinstance(causal_tile, bool) or not isinstance(causal_tile, int) or not 0 <= causal_tile <= MAX_CAUSAL_TILE:
        raise fail(f"must be a whole number of keys from 0 (none: the masked half skipped) to {MAX_CAUSAL_TILE:,}, "
                   f"got {causal_tile!r}", "efficiency.causal_tile")
    if causal_tile and version < 2:
        raise fail("is a format 2 field; say format = 2 (docs/devices.md)", "efficiency.causal_tile")
    curves = {}
    for curve in CURVES:
        where = f"efficiency.{curve}"
        table = _table(efficiency, curve, fail, where)
        _known(table, _GEMM_CURVE if curve == "gemm" else _CURVE, where, fail)
        fraction = _positive(table, "max_fraction", where, fail, rate=True)
        if fraction > 1:
            raise fail(f"is a fraction of the peak, at most 1, got {fraction!r}", f"{where}.max_fraction")
        curves[curve] = Curve(max_fraction=fraction, half_at=_positive(table, "half_at", where, fail, zero=True),
                              steepness=_steepness(table, where, fail),
                              half_dim=_positive(table, "half_dim", where, fail, default=0.0, zero=True))
    host = data.get("host", {})
    if not isinstance(host, dict):
        raise fail(f"must be a table, got {host!r}", "host")
    _known(host, set(HOST_FIELDS), "host", fail)
    for key in HOST_FORMAT_2:
        if key in host and version < 2:
            raise fail("is a format 2 field; say format = 2 (docs/devices.md)", f"host.{key}")
    vector_ops = data.get("vector_ops", {})
    if not isinstance(vector_ops, dict):
        raise fail(f"must be a table, got {vector_ops!r}", "vector_ops")
    _known(vector_ops, set(VECTOR_KINDS), "vector_ops", fail)
    vector_ops = {kind: _positive(vector_ops, kind, "vector_ops", fail, zero=True) for kind in vector_ops}
    launches = data.get("launches", {})
    if not isinstance(launches, dict):
        raise fail(f"must be a table, got {launches!r}", "launches")
    _known(launches, set(VECTOR_KINDS), "launches", fail)
    launches = {kind: _positive(launches, kind, "launches", fail) for kind in launches}
    optimizer = {}
    for kind, (where, table) in _named_tables(data, "optimizer", OPTIMIZER_KINDS, _OPTIMIZER, fail).items():
        optimizer[kind] = OptimizerCost(
            kernels_per_tensor=_positive(table, "kernels_per_tensor", where, fail, zero=True),
            kernels_per_step=_positive(table, "kernels_per_step", where, fail, default=0.0, zero=True),
            bytes_per_parameter=_positive(table, "bytes_per_parameter", where, fail),
            kernel_s=_positive(table, "kernel_us", where, fail, zero=True) * US,
            bandwidth=_positive(table, "bandwidth_gb_s", where, fail, rate=True) * GB_S)
        if not optimizer[kind].kernels_per_tensor and not optimizer[kind].kernels_per_step:
            raise fail("an optimizer step launches kernels: give kernels_per_tensor or kernels_per_step above 0",
                       f"{where}.kernels_per_tensor")
    wrappers = {}
    for wrapper, (where, table) in _named_tables(data, "wrappers", WRAPPERS, _WRAPPER, fail).items():
        for key in _FSDP2_ONLY:
            if key in table and wrapper != "fsdp2":
                raise fail("is FSDP2's collectives' time: only [wrappers.fsdp2] has it", f"{where}.{key}")
        wrappers[wrapper] = WrapperCost(*(_positive(table, key, where, fail, zero=True) * US
                                       for key in ("forward_us", "backward_us")),
                                     *(_positive(table, key, where, fail, default=0.0, zero=True) * US
                                       for key in ("optimizer_kernel_us", "weight_us", *_FSDP2_ONLY)))
    return DeviceDescription(name=name, title=title,
                             memory_gb=_positive(sheet, "memory_gb", "datasheet", fail, rate=True),
                             memory_bandwidth=_positive(sheet, "memory_bandwidth_gb_s", "datasheet", fail,
                                                        rate=True) * GB_S,
                             matrix_peak=peaks["matrix_tflops"], vector_peak=peaks["vector_tflops"],
                             launch_s=_positive(efficiency, "launch_us", "efficiency", fail, zero=True) * US,
                             curves=curves, fitted=fitted, fitted_on=fitted_on,
                             **{attribute: _positive(host, key, "host", fail, default=0.0, zero=True) * US
                                for key, attribute in HOST_FIELDS.items()},
                             source=source, vector_ops=vector_ops, launches=launches, optimizer=optimizer,
                             processor=processor, wrappers=wrappers, causal_tile=causal_tile)


def _named_tables(data: Mapping[str, Any], key: str, names: tuple[str, ...], fields: set[str],
                  fail) -> dict[str, tuple[str, Mapping[str, Any]]]:
    """The tables [key.NAME] (optional: none where `key` is absent), NAME one of `names`, each holding only
    `fields`: NAME -> (its field path for messages, the table)."""
    parent = data.get(key, {})
    if not isinstance(parent, dict):
        raise fail(f"must be a table, got {parent!r}", key)
    _known(parent, set(names), key, fail)
    out = {}
    for name in parent:
        where = f"{key}.{name}"
        table = _table(parent, name, fail, where)
        _known(table, fields, where, fail)
        out[name] = (where, table)
    return out


def _known(table: Mapping[str, Any], known: set[str], where: str, fail) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise fail(f"unknown field {unknown[0]!r}; expected one of {', '.join(sorted(known))}",
                   f"{where}.{unknown[0]}" if where else unknown[0])


def _table(parent: Mapping[str, Any], key: str, fail, where: str | None = None) -> Mapping[str, Any]:
    value = parent.get(key)
    if value is None:
        raise fail("is required (docs/devices.md)", where or key)
    if not isinstance(value, dict):
        raise fail(f"must be a table, got {value!r}", where or key)
    return value


def _steepness(table: Mapping[str, Any], where: str, fail) -> float:
    value = _positive(table, "steepness", where, fail, default=1.0)
    if value > MAX_STEEPNESS:
        raise fail(f"must be at most {MAX_STEEPNESS:g} (a steeper curve is a step), got {value!r}",
                   f"{where}.steepness")
    return value


def _positive(table: Mapping[str, Any], key: str, where: str, fail, default: float | None = None,
              zero: bool = False, rate: bool = False) -> float:
    """A finite number above 0 (or at least 0 with `zero`), at most FIGURE_RANGE's top and, for a `rate` (a peak, a
    bandwidth, a capacity: what times divide by), at least its bottom; `default` where the field may be left
    out."""
    value = table.get(key, default)
    if value is None:
        raise fail("is required (docs/devices.md)", f"{where}.{key}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero):
        bound = "0 or more" if zero else "above 0"
        raise fail(f"must be a finite number {bound}, got {value!r}", f"{where}.{key}")
    low, high = FIGURE_RANGE
    if value > high or (rate and value < low):
        span = f"from {low:g} to {high:g}" if rate else f"at most {high:g}"
        raise fail(f"{value!r} is beyond any device's figure in the field's unit (docs/devices.md): give one {span}; "
                   "check the unit", f"{where}.{key}")
    return float(value)

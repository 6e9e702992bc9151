"""The timeline model's own error, as held-out runs measured it: what a prediction's interval draws from beside the
profile's sampling noise and the machine's drift (docs/analysis.md, "How far to trust a prediction").

`analysis/data/model_residuals.json` holds, per device kind, the batch-time errors of bench/generalization.py's pairs
(a profile, then a real run of a job drawn from a seed nobody tuned to), with the seeds and dates they came from. A
pair's error e (percent, (predicted - measured) / measured) is the factor 1 / (1 + e / 100) by which its run took
longer than its prediction. A device kind without held-out runs has no such factor, and the interval says so.

A kind's entry may state the domain its runs cover (`domain`: the model widths, device counts and nodes they had)
and, beside its runs, `beyond_runs`: errors measured where the model was fitted on part of that domain and scored
outside it, and `multi_node_runs`: held-out errors of runs on many nodes. A prediction outside the domain draws on
one of those (analysis.uncertainty.gpu_residuals_for says which), since the runs inside it say nothing of how far the
model carries.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

RESIDUALS_PATH = Path(__file__).resolve().parent / "data" / "model_residuals.json"
RESIDUALS_KIND = "distsim-model-residuals"
# a kind's lists of runs in the file, and what each holds
RESIDUAL_PARTS = {"runs": "held-out", "beyond_runs": "out-of-domain", "multi_node_runs": "multi-node held-out"}


@dataclass(frozen=True)
class ResidualDomain:
    """What held-out runs covered: model widths (hidden) and device counts from-to, and at most `nodes` nodes."""

    hidden: tuple[int, int]
    devices: tuple[int, int]
    nodes: int

    def contains(self, hidden: int, devices: int, nodes: int) -> bool:
        return (self.hidden[0] <= hidden <= self.hidden[1] and self.devices[0] <= devices <= self.devices[1]
                and nodes <= self.nodes)

    def text(self) -> str:
        return (f"hidden {self.hidden[0]}-{self.hidden[1]}, {self.devices[0]}-{self.devices[1]} devices, "
                f"{'one node' if self.nodes == 1 else f'up to {self.nodes} nodes'}")

    def to_dict(self) -> dict[str, Any]:
        return {"hidden": list(self.hidden), "devices": list(self.devices), "nodes": self.nodes}


@dataclass(frozen=True)
class ModelResiduals:
    """Held-out runs of one device kind: each pair's run over its prediction, and where they came from."""

    device: str
    ratios: tuple[float, ...]
    seeds: tuple[int, ...]
    dates: tuple[str, ...]
    bench: str = "bench/generalization.py"  # what measured them (the file's "command", its script)
    domain: ResidualDomain | None = None  # what the runs covered (None: not stated)
    part: str = "runs"  # which of the file's lists (RESIDUAL_PARTS)

    @property
    def beyond(self) -> bool:
        """Errors of predictions outside the domain of the runs fitted on."""
        return self.part == "beyond_runs"

    @property
    def source(self) -> str:
        seeds = ", ".join(str(s) for s in dict.fromkeys(self.seeds))
        what = RESIDUAL_PARTS[self.part]
        where = f"; beyond {self.domain.text()}" if self.beyond and self.domain else ""
        return (f"{len(self.ratios)} {what} {self.device.upper()} runs of {self.bench} (seeds {seeds}; "
                f"{', '.join(sorted(set(self.dates)))}{where})")

    def to_dict(self) -> dict[str, Any]:
        ratios = np.asarray(self.ratios)
        return {"device": self.device, "runs": len(self.ratios), "seeds": list(self.seeds), "dates": list(self.dates),
                "median_ratio": float(np.median(ratios)), "p5_ratio": float(np.percentile(ratios, 5)),
                "p95_ratio": float(np.percentile(ratios, 95)), "source": self.source,
                "domain": self.domain.to_dict() if self.domain else None, "beyond_domain": self.beyond,
                "part": self.part}


def device_kind(environment: Mapping[str, Any]) -> str:
    """'cuda' for a profile taken on a GPU, else 'cpu' (the profile's environment names its device)."""
    return "cuda" if str(environment.get("device", "cpu")).startswith("cuda") else "cpu"


def processor_of(environment: Mapping[str, Any]) -> str:
    """The processor a profile measured on, as a device description names it (harness.plan.device.PROCESSORS)."""
    return "gpu" if device_kind(environment) == "cuda" else "cpu"


def residuals_text(document: Mapping[str, Any]) -> str:
    """A residuals document (RESIDUALS_KIND) as JSON with a job a line (thousands of them), its errors' list on it."""
    text = json.dumps(document, indent=1)
    text = re.sub(r"\[\s*((?:-?[0-9.e+-]+,\s*)*-?[0-9.e+-]+)\s*\]",
                  lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text)
    return re.sub(r'\{\n\s*"job": ("[^"]*"),\n\s*"pair_error_pct": (\[[^\]]*\])\n\s*\}',
                  r'{"job": \1, "pair_error_pct": \2}', text) + "\n"


def ratios_of(errors: Iterable[float]) -> list[float]:
    """Each held-out pair's error e (percent, (predicted - measured) / measured) as the factor run / prediction,
    1 / (1 + e / 100), that an interval multiplies a prediction by; an error of -100% or below says nothing."""
    return [1.0 / (1.0 + e / 100.0) for e in errors if e > -100.0]


@lru_cache(maxsize=8)
def model_residuals(device: str, path: Path = RESIDUALS_PATH, part: str = "runs") -> ModelResiduals | None:
    """The held-out runs of `device` ('cpu', 'cuda'), or another of its lists (`part`, RESIDUAL_PARTS); None where
    there are none (or no file)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("kind") != RESIDUALS_KIND:
        return None
    entry = data.get("devices", {}).get(device, {})
    runs = entry.get(part, [])
    ratios, seeds, dates = [], [], []
    for run in runs:
        seeds.append(int(run["seed"]))
        dates.append(str(run["date"]))
        for job in run["jobs"]:
            ratios += ratios_of(job["pair_error_pct"])
    if not ratios:
        return None
    words = str(data.get("command", "")).split()
    bench = next((word for word in words if word.endswith(".py")), "bench/generalization.py")
    domain = entry.get("domain")
    if domain:
        domain = ResidualDomain(tuple(domain["hidden"]), tuple(domain["devices"]), int(domain["nodes"]))
    return ModelResiduals(device, tuple(ratios), tuple(seeds), tuple(dates), bench, domain or None, part)

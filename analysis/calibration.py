"""The timeline model's own error, as held-out runs measured it: what a prediction's interval draws from beside the
profile's sampling noise and the machine's drift (docs/analysis.md, "How far to trust a prediction").

`analysis/data/model_residuals.json` holds, per device kind, the batch-time errors of bench/generalization.py's pairs
(a profile, then a real run of a job drawn from a seed nobody tuned to), with the seeds and dates they came from. A
pair's error e (percent, (predicted - measured) / measured) is the factor 1 / (1 + e / 100) by which its run took
longer than its prediction. A device kind without held-out runs has no such factor, and the interval says so.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

RESIDUALS_PATH = Path(__file__).resolve().parent / "data" / "model_residuals.json"
RESIDUALS_KIND = "distsim-model-residuals"


@dataclass(frozen=True)
class ModelResiduals:
    """Held-out runs of one device kind: each pair's run over its prediction, and where they came from."""

    device: str
    ratios: tuple[float, ...]
    seeds: tuple[int, ...]
    dates: tuple[str, ...]
    bench: str = "bench/generalization.py"  # what measured them (the file's "command", its script)

    @property
    def source(self) -> str:
        seeds = ", ".join(str(s) for s in self.seeds)
        return (f"{len(self.ratios)} held-out {self.device.upper()} runs of {self.bench} (seeds {seeds}; "
                f"{', '.join(sorted(set(self.dates)))})")

    def to_dict(self) -> dict[str, Any]:
        ratios = np.asarray(self.ratios)
        return {"device": self.device, "runs": len(self.ratios), "seeds": list(self.seeds), "dates": list(self.dates),
                "median_ratio": float(np.median(ratios)), "p5_ratio": float(np.percentile(ratios, 5)),
                "p95_ratio": float(np.percentile(ratios, 95)), "source": self.source}


def device_kind(environment: Mapping[str, Any]) -> str:
    """'cuda' for a profile taken on a GPU, else 'cpu' (the profile's environment names its device)."""
    return "cuda" if str(environment.get("device", "cpu")).startswith("cuda") else "cpu"


@lru_cache(maxsize=8)
def model_residuals(device: str, path: Path = RESIDUALS_PATH) -> ModelResiduals | None:
    """The held-out runs of `device` ('cpu', 'cuda'); None where there are none (or no file)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("kind") != RESIDUALS_KIND:
        return None
    runs = data.get("devices", {}).get(device, {}).get("runs", [])
    ratios, seeds, dates = [], [], []
    for run in runs:
        seeds.append(int(run["seed"]))
        dates.append(str(run["date"]))
        for job in run["jobs"]:
            ratios += [1.0 / (1.0 + e / 100.0) for e in job["pair_error_pct"] if e > -100.0]
    if not ratios:
        return None
    words = str(data.get("command", "")).split()
    bench = next((word for word in words if word.endswith(".py")), "bench/generalization.py")
    return ModelResiduals(device, tuple(ratios), tuple(seeds), tuple(dates), bench)

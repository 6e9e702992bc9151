"""Held against Megatron-LM's own published measurements (Korthikanti et al. 2022; bench/data/README.md: source,
layouts, cluster), each predicted from its spec alone:
- the eight end-to-end iterations of Table 5, 8 to 512 A100s (Calculon validates on the same eight and reports a
  3.7% mean |error|), and Section 6.3's one more: the 530B on 2,240 A100s, eight data-parallel replicas
  (bench/data/megatron-iterations.csv);
- Table 4: one transformer layer of the 22B, its forward and its backward (recompute included), without recompute,
  with sequence parallelism, with full and with selective recompute (bench/data/megatron-layer-times.csv).

Each row becomes Megatron-LM's arguments (megatron_arguments: GPT-2's vocabulary, fp16, dropout 0.1, local
layers, whose attention is materialised as Megatron-LM's was in 2022; no recompute, full recompute of every layer,
or selective recompute, with or without sequence parallelism; the interleaved schedule where the row has virtual
stages), then a spec through the project's own importer (harness.plan.importers.megatron), on Selene as the paper
states it: the device `--device` (default the shipped `a100-80gb`, whose efficiency figures are documented
starting values, fitted on nothing) and DGX A100's network (harness/jobs/dgx-a100.toml: NVLink 3 with NVSwitch, one
200 Gb/s HDR adapter a GPU, rails) with the NVLink tier's memory at the A100 80GB's 2,039 GB/s.
analysis.predict.predict_spec predicts each (no profile; the gradient all-reduce after the backward, not
overlapped, as the paper states). A layer's time is read off the predicted timeline: the median over the 22B's
blocks of one micro-batch's forward items (its compute and tensor-parallel collectives), and of its backward and
recompute items. Nothing is fitted here, and no figure in the project was fitted on these rows.

Printed: each iteration's measured and predicted time, error, where the predicted time went (compute,
tensor-parallel communication, pipeline bubble and transfers), the predicted peak memory a GPU against the A100's
80 GB, and the 90% interval a spec alone states (analysis.uncertainty.spec_only_interval on the GPU residuals); the
mean, median and worst |error| of Table 5's eight beside Calculon's reported figure, and the interval's coverage;
Section 6.3's row and what data parallelism added, measured and predicted; then the layer table. `--json PATH`
writes them.

Run: .venv/bin/python bench/megatron_table.py [--device NAME_OR_PATH] [--json out.json]
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from analysis.predict import predict_spec  # noqa: E402
from analysis.uncertainty import spec_only_interval, spec_only_residuals  # noqa: E402
from bench.published import error_summary, errors_pct, time_spent  # noqa: E402
from harness.common.errors import UserError  # noqa: E402
from harness.common.output import format_table  # noqa: E402
from harness.plan.device import load_device  # noqa: E402
from harness.plan.importers.megatron import from_megatron  # noqa: E402
from harness.plan.network import NetworkTier  # noqa: E402
from harness.plan.spec import JobSpec, load_spec  # noqa: E402

TABLE = ROOT / "bench" / "data" / "megatron-iterations.csv"
LAYER_TABLE = ROOT / "bench" / "data" / "megatron-layer-times.csv"
TABLE5 = "Table 5"  # the source of the eight rows Calculon's figure is for
LAYER_MODEL = "22B"  # Table 4's model
CLUSTER = ROOT / "harness" / "jobs" / "dgx-a100.toml"
DEVICE = "a100-80gb"
HBM_GBS = 2039.0  # A100 SXM4 80GB (NVIDIA's datasheet): Selene's nodes
SEQ = 2048
GIB = 1 << 30
PUBLISHED = {"Calculon (its authors' validation)": 3.7}
JSON_VERSION = 2


@dataclass(frozen=True)
class Row:
    """One published iteration: its model, layout, recompute and measured time (seconds)."""

    model: str
    layers: int
    hidden: int
    heads: int
    tp: int
    pp: int
    layers_per_virtual_stage: int | None
    gpus: int
    global_batch: int
    micro: int
    recompute: str  # none | full | selective
    sp: bool
    measured_s: float
    source: str = TABLE5

    @property
    def label(self) -> str:
        return f"{self.model} {'sp + selective' if self.sp else self.recompute + ' recompute'}"

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


@dataclass(frozen=True)
class LayerRow:
    """One row of Table 4: a layer of the 22B under one recompute and sequence parallelism, measured (ms)."""

    experiment: str
    recompute: str  # none | full | selective
    sp: bool
    forward_ms: float
    backward_ms: float


def read_rows(path: Path = TABLE) -> list[Row]:
    """The table's rows, in file order."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            virtual = row["layers_per_virtual_stage"]
            rows.append(Row(row["model"], int(row["layers"]), int(row["hidden"]), int(row["heads"]),
                            int(row["tensor_parallel"]), int(row["pipeline_parallel"]),
                            int(virtual) if virtual else None, int(row["gpus"]), int(row["global_batch"]),
                            int(row["micro_batch"]), row["recompute"], row["sequence_parallel"] == "true",
                            float(row["iteration_s"]), row["source"]))
    return rows


def read_layer_rows(path: Path = LAYER_TABLE) -> list[LayerRow]:
    """Table 4's rows, in file order."""
    with open(path, newline="") as f:
        return [LayerRow(row["experiment"], row["recompute"], row["sequence_parallel"] == "true",
                         float(row["forward_ms"]), float(row["backward_ms"])) for row in csv.DictReader(f)]


def megatron_arguments(row: Row) -> str:
    """The row as Megatron-LM's arguments (module docstring)."""
    args = (f"--num-layers {row.layers} --hidden-size {row.hidden} --num-attention-heads {row.heads} "
            f"--seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size {row.micro} "
            f"--global-batch-size {row.global_batch} --tensor-model-parallel-size {row.tp} "
            f"--pipeline-model-parallel-size {row.pp} --fp16 --vocab-file gpt2-vocab.json "
            "--merge-file gpt2-merges.txt --transformer-impl local --hidden-dropout 0.1 --attention-dropout 0.1")
    if row.layers_per_virtual_stage:
        args += f" --num-layers-per-virtual-pipeline-stage {row.layers_per_virtual_stage}"
    if row.sp:
        args += " --sequence-parallel"
    if row.recompute == "full":
        return args + " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    return args + (" --recompute-granularity selective" if row.recompute == "selective" else "")


def selene_network() -> tuple[NetworkTier, ...]:
    """DGX A100's tiers (harness/jobs/dgx-a100.toml), the NVLink tier's memory the A100 80GB's (HBM_GBS)."""
    tiers = load_spec(CLUSTER, import_factory=False).cluster.network
    return tuple(dataclasses.replace(tier, memory_gbs=HBM_GBS) if tier.memory_gbs else tier for tier in tiers)


def row_spec(row: Row, device: str = DEVICE, network: tuple[NetworkTier, ...] | None = None) -> JobSpec:
    """The row's spec: its Megatron-LM arguments through the importer, on Selene (module docstring; `network`:
    selene_network's, read once by a caller of many rows)."""
    spec = from_megatron(megatron_arguments(row), gpus=row.gpus).spec
    return dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, device=device,
                                                                 network=network or selene_network()))


def predict_rows(rows: Sequence[Row], device: str = DEVICE) -> list[dict]:
    """Each row predicted from its spec alone: measured and predicted seconds, error, where the time went (ms),
    the peak memory a GPU (GiB) and the 90% interval (seconds; None without GPU residuals)."""
    out, network = [], selene_network()
    for row in rows:
        spec = row_spec(row, device, network)
        prediction = predict_spec(spec, dp_overlap=False, resamples=0)
        seconds = prediction.timeline.batch_time_s
        residuals = spec_only_residuals(spec, "gpu")
        interval = spec_only_interval(seconds, residuals) if residuals is not None else None
        out.append({"model": row.model, "label": row.label, "source": row.source, "gpus": row.gpus,
                    "dp": spec.strategy.dp, "tp": row.tp, "pp": row.pp, "virtual_stages": spec.strategy.chunks,
                    "micro": row.micro, "global_batch": row.global_batch,
                    "recompute": row.recompute, "sp": row.sp, "measured_s": row.measured_s,
                    "predicted_s": seconds, "error_pct": (seconds / row.measured_s - 1) * 100,
                    "spent_ms": time_spent(prediction.timeline),
                    "peak_gib": prediction.memory.peak_bytes / GIB,
                    "interval_s": [interval.p5_s, interval.p95_s] if interval else None})
    return out


def layer_times_ms(prediction) -> tuple[float, float]:
    """A transformer block's forward and backward (its recompute included) on the first pipeline device, in ms:
    the predicted timeline's layer passes (analysis.simulate.Timeline.layer_passes: a micro-batch's pass, its
    compute and collectives, the median over the device's blocks)."""
    row = next(r for r in prediction.timeline.layer_passes() if r["stage"] == 0 and r["layer"] == "block")
    return row["forward_s"] * 1e3, row["backward_s"] * 1e3


def predict_layers(layer_rows: Sequence[LayerRow], model: Row, device: str = DEVICE) -> list[dict]:
    """Each Table 4 row: `model` (the 22B's iteration row) under the row's recompute and sequence parallelism,
    predicted from its spec alone; measured and predicted forward, backward and their sum (ms), and errors."""
    out, network = [], selene_network()
    for layer_row in layer_rows:
        row = dataclasses.replace(model, recompute=layer_row.recompute, sp=layer_row.sp)
        forward, backward = layer_times_ms(predict_spec(row_spec(row, device, network), dp_overlap=False,
                                                        resamples=0))
        measured = {"forward": layer_row.forward_ms, "backward": layer_row.backward_ms,
                    "combined": layer_row.forward_ms + layer_row.backward_ms}
        predicted = {"forward": forward, "backward": backward, "combined": forward + backward}
        out.append({"experiment": layer_row.experiment, "recompute": layer_row.recompute, "sp": layer_row.sp,
                    "measured_ms": measured, "predicted_ms": predicted,
                    "error_pct": {key: (predicted[key] / measured[key] - 1) * 100 for key in measured}})
    return out


def layer_summary(results: Sequence[dict]) -> dict:
    """Mean and worst |error| of the layer rows' forward and backward times (ten figures; the forwards of the
    settings without sequence parallelism are one prediction of one measured 7.7 ms, and the two with it another),
    of the forwards and of the backwards alone, and of their sums."""
    errors = {key: [abs(r["error_pct"][key]) for r in results] for key in ("forward", "backward", "combined")}
    passes = errors["forward"] + errors["backward"]
    return {"figures": len(passes), "mape_pct": float(np.mean(passes)), "worst_abs_pct": float(np.max(passes)),
            "forward_mape_pct": float(np.mean(errors["forward"])),
            "backward_mape_pct": float(np.mean(errors["backward"])),
            "combined_mape_pct": float(np.mean(errors["combined"])),
            "combined_worst_abs_pct": float(np.max(errors["combined"]))}


def data_parallel_added(results: Sequence[dict]) -> list[dict]:
    """For each row with data parallelism, what it added over the same model and layout on one replica (a row of
    the table with dp = 1), measured and predicted (seconds)."""
    out = []
    for r in results:
        if r["dp"] == 1:
            continue
        base = next((b for b in results if b["dp"] == 1 and (b["model"], b["label"], b["tp"], b["pp"])
                     == (r["model"], r["label"], r["tp"], r["pp"])), None)
        if base is not None:
            out.append({"label": r["label"], "gpus": r["gpus"], "dp": r["dp"],
                        "measured_s": r["measured_s"] - base["measured_s"],
                        "predicted_s": r["predicted_s"] - base["predicted_s"],
                        "predicted_dp_allreduce_s": r["spent_ms"].get("dp", 0.0) / 1e3})
    return out


def summary(results: Sequence[dict]) -> dict:
    """The rows' error statistics (bench.published.error_summary) and the interval's coverage."""
    errors = errors_pct([r["predicted_s"] for r in results], [r["measured_s"] for r in results])
    figures = error_summary(errors)
    inside = [r["interval_s"][0] <= r["measured_s"] <= r["interval_s"][1] for r in results if r["interval_s"]]
    figures["interval_coverage_pct"] = float(np.mean(inside) * 100) if inside else None
    return figures


def print_report(results: Sequence[dict], figures: dict, added: Sequence[dict], layers: Sequence[dict],
                 layer_figures: dict, device: str) -> None:
    print(f"Megatron-LM's published iterations (Korthikanti et al. 2022, Table 5; Selene, DGX A100 80GB), each from a "
          f"spec alone on {device}: mean |error| {figures['mape_pct']:.1f}%, worst {figures['worst_abs_pct']:.1f}% "
          f"({figures['rows']} runs)")
    table = []
    for r in results:
        spent = r["spent_ms"]
        comm = spent.get("tp", 0.0) + spent.get("dp", 0.0)
        table.append([r["label"], r["source"], f"{r['gpus']:,}", f"{r['dp']} x {r['tp']} x {r['pp']}"
                      + (f" (x{r['virtual_stages']})" if r["virtual_stages"] > 1 else ""),
                      f"{r['micro']} x {r['global_batch'] // (r['micro'] * r['dp'])}", f"{r['measured_s']:.2f}",
                      f"{r['predicted_s']:.2f}", f"{r['error_pct']:+.1f}",
                      f"{spent.get('compute', 0.0) / 1e3:.2f} / {comm / 1e3:.2f} / {spent.get('idle', 0.0) / 1e3:.2f}",
                      f"{r['peak_gib']:.1f}",
                      f"{r['interval_s'][0]:.2f}-{r['interval_s'][1]:.2f}" if r["interval_s"] else "-"])
    print(format_table(["run", "source", "GPUs", "dp x tp x pp", "micro x n", "measured s", "predicted s", "error %",
                        "compute / comm / idle s", "peak GiB", "90% interval s"], table))
    print()
    print(f"Table 5: mean |error| {figures['mape_pct']:.2f}%, median {figures['median_abs_pct']:.2f}%, worst "
          f"{figures['worst_abs_pct']:.2f}%, signed median {figures['median_signed_pct']:+.2f}%"
          + (f"; the 90% interval held {figures['interval_coverage_pct']:.0f}% of the runs"
             if figures["interval_coverage_pct"] is not None else ""))
    for name, mape in PUBLISHED.items():
        print(f"{name}: {mape}% mean |error| on the same eight runs")
    for a in added:
        print(f"data parallelism {a['dp']} ({a['label']}, {a['gpus']:,} GPUs) added {a['measured_s']:.2f} s measured, "
              f"{a['predicted_s']:.2f} s predicted (the gradient all-reduce after the backward: "
              f"{a['predicted_dp_allreduce_s']:.2f} s)")
    print()
    print(f"One transformer layer of the 22B (Table 4), forward and backward, each from a spec alone on {device}: "
          f"mean |error| {layer_figures['mape_pct']:.1f}% over {layer_figures['figures']} (forwards "
          f"{layer_figures['forward_mape_pct']:.1f}%, backwards {layer_figures['backward_mape_pct']:.1f}%), worst "
          f"{layer_figures['worst_abs_pct']:.1f}%; forward + backward {layer_figures['combined_mape_pct']:.1f}%")
    rows = []
    for r in layers:
        m, p, e = r["measured_ms"], r["predicted_ms"], r["error_pct"]
        rows.append([r["experiment"]] + [f"{m[key]:.1f} / {p[key]:.2f} ({e[key]:+.1f}%)"
                                         for key in ("forward", "backward", "combined")])
    print(format_table(["experiment", "forward ms, measured / predicted", "backward ms (recompute in it)",
                        "combined ms"], rows))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=DEVICE,
                        help=f"a shipped description's name or a description's path (default {DEVICE}, unfitted)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    try:
        description = load_device(args.device)
        rows = read_rows()
        results = predict_rows(rows, args.device)
        layers = predict_layers(read_layer_rows(), next(r for r in rows if r.model == LAYER_MODEL), args.device)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    figures = summary([r for r in results if r["source"] == TABLE5])
    added, layer_figures = data_parallel_added(results), layer_summary(layers)
    print_report(results, figures, added, layers, layer_figures, args.device)
    if args.json:
        document = {"version": JSON_VERSION, "sources": [str(TABLE.relative_to(ROOT)),
                                                         str(LAYER_TABLE.relative_to(ROOT))],
                    "device": args.device, "fitted_on": description.fitted_on if description.fitted
                    else "nothing: the description's starting values", "figures": figures, "rows": results,
                    "data_parallel_added": added, "layer_figures": layer_figures, "layers": layers,
                    "published": PUBLISHED}
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The training engine's host time between steps: from one step's end to the next one's start (the engine's
bookkeeping, the next micro-batch's tokens copied to the device, the clock's synchronize on a GPU), measured
by training a copy of one of the job's stages on this rank alone with harness train's own engine. Every run of
the job pays it; no event holds it (docs/profiling.md, "The engine's gaps").

Rules:
- the copy is one pipeline stage of the job as one rank holds it: the model's family, dtype and micro-batch size
  (the tokens copied each step), a stage's layers (layers / pp, with the embedding and the head), one
  tensor-parallel rank's sizes (hidden, heads, ffn and vocab / tp), a context-parallel rank's sequence, the
  optimizer and the device; dp = tp = pp = 1, dense, no recompute, no ZeRO. The gaps grow with what a step
  leaves to free and count (on a CPU: 25 us between steps of a one-layer copy of hidden 32 against 100 of four
  layers of hidden 128). A factory model stands in as FACTORY_STAND_IN's GPT-2;
- two short runs on COMM_SELF of MICRO_BATCHES micro-batches, 1F1B and GPipe, ITERATIONS each after WARMUP:
  1F1B has the F->B and B->F transitions, GPipe F->F and B->B; both a last backward to the optimizer ("B->opt"),
  the iteration's start to its first step ("start") and its last interval's end to the iteration's end ("end");
- each gap is the median over the measured iterations' transitions of its kind (both runs' for the last three).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from harness.store.hdf5_schema import ENGINE_GAPS as GAPS

FAMILIES = {"gpt2": "gpt2-small", "bert": "bert-base", "llama": "llama-1b"}
FACTORY_STAND_IN = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": 256, "vocab": 512}
MICRO_BATCHES = 2
ITERATIONS = 6
WARMUP = 1


def stage_copy(spec, schedule: str):
    """The one-rank copy of one of `spec`'s pipeline stages whose engine gaps stand for the job's (module
    docstring), under `schedule`."""
    from harness.plan.spec import parse_spec

    data = spec.to_dict()
    model, s = data["model"], spec.strategy
    if model.get("factory") or model.get("family") not in FAMILIES:
        model = {"name": "gpt2-small", "family": "gpt2", "dtype": model.get("dtype", "float32"), **FACTORY_STAND_IN,
                 "seq_len": spec.model.seq_len}
    else:
        tp = s.tp
        model = {"name": FAMILIES[model["family"]], "family": model["family"], "dtype": model["dtype"],
                 "layers": -(-model["layers"] // s.pp), "hidden": model["hidden"] // tp,
                 "heads": max(1, model["heads"] // tp), "kv_heads": max(1, model.get("kv_heads", model["heads"]) // tp),
                 "ffn": model["ffn"] // tp, "vocab": max(8, model["vocab"] // tp),
                 "seq_len": model["seq_len"] // s.cp, "tie_embeddings": False}
    micro = data["batch"]["micro"]
    data["model"] = model
    data["batch"] = {"global": micro * MICRO_BATCHES, "micro": micro}
    data["strategy"] = {"dp": 1, "tp": 1, "pp": 1, "schedule": schedule, "chunks": 1, "recompute": "none",
                        "zero": 0}
    data["cluster"] = {"nodes": 1, "gpus_per_node": 1}
    data.pop("search", None)
    return parse_spec(data, source=f"{spec.source}: the engine's gaps ({schedule})")


def transitions(columns: dict[str, np.ndarray], iterations: dict[str, np.ndarray], warmup: int) -> dict[str, list]:
    """Every measured iteration's gaps by kind (GAPS) from one rank's trace columns and iteration bounds."""
    out: dict[str, list] = {gap: [] for gap in GAPS}
    steps = np.isin(columns["kind"], ["compute", "optimizer"])
    for index, (start, end) in enumerate(zip(iterations["start_s"], iterations["end_s"])):
        if index < warmup:
            continue
        mine = steps & (columns["iteration"] == index)
        rows = sorted(zip(columns["start_s"][mine], columns["end_s"][mine], columns["phase"][mine]))
        if not rows:
            continue
        out["start"].append(rows[0][0] - start)
        out["end"].append(end - max(columns["end_s"][columns["iteration"] == index]))
        for (_, before_end, before), (after_start, _, after) in zip(rows, rows[1:]):
            kind = f"{before}->{after}"
            if kind in out:
                out[kind].append(after_start - before_end)
    return out


def measure_engine_gaps(spec, device: str) -> dict[str, float]:
    """This rank's engine gaps for `spec` (module docstring), in seconds by GAPS' kinds, on `device` ("cpu" or
    "cuda:N"). Collective over nothing: each rank trains its copy alone (MPI's COMM_SELF), with no
    torch.distributed world of the caller's left standing."""
    from mpi4py import MPI

    from harness.train.runner import run_training
    from harness.train.trace_writer import rank_file_name, read_rank_trace

    gathered: dict[str, list] = {gap: [] for gap in GAPS}
    with tempfile.TemporaryDirectory(prefix="engine-gaps-") as folder:
        for schedule in ("1f1b", "gpipe"):
            rundir = Path(folder) / schedule
            run_training(stage_copy(spec, schedule), MPI.COMM_SELF, rundir, iterations=ITERATIONS, warmup=WARMUP,
                         device=device, clock_samples=1)
            _, columns, iterations = read_rank_trace(rundir / rank_file_name(0))
            for gap, values in transitions(columns, iterations, WARMUP).items():
                gathered[gap] += values
    return {gap: float(np.median(values)) for gap, values in gathered.items() if values}

"""Side by side with what users pick instead: the generalization suite's jobs predicted by this project and by
llm-analysis (an analytical estimator), both against the same real runs.

    .venv/bin/python bench/peers.py --peer-python VENV/bin/python [--seed S] [--jobs N] [--keep DIR] [--json]

llm-analysis is not a dependency: install it into a scratch environment and name that environment's python,

    python3 -m venv /tmp/peers && /tmp/peers/bin/pip install llm-analysis==0.2.2

Per job of `bench/generalization.py`'s draw (the same seed gives the same jobs), one pair as the suite measures
it (`harness profile`, then `harness train` and `analysis validate`, 2 ranks bound to cores). Then llm-analysis's
`LLMAnalysis.training` on the job as a user would describe it: its layers, hidden, heads (and kv heads), ffn,
vocabulary, sequence, micro-batch size and count, dp x tp x pp, ZeRO stage, full recompute or none, Adam, no
flash attention, gated MLP for the LLaMA family. It computes in 16 bits only (its FLOP rates assert it): its
memory parts are scaled to the jobs' fp32 (weights and activations x2, Adam's 8 bytes a parameter without its 4
of master weights, gradients at 4 bytes as it counts them). The
"GPU" is the CPU (1 TFLOPS peak, 20 GB/s memory, 1 GB/s between ranks, 100 us latency); its FLOP efficiency is
calibrated once, on the first job, so that its time is that job's measured one, and kept for the rest; beside
it, the peer at its best: the one efficiency that minimises its median error over every job, chosen knowing the
runs (an upper bound no user has). Memory:
its weights + gradients + optimizer state + activations per device against the largest device's peak that the
run's meter measured, beside this project's memory model against the same device's peak (validate's memory row
of that stage: what the meter can see). ZeRO jobs on a CPU have no meter (gloo's buffers) and no memory figure.
Goal (issue 33): ahead of the peer on every job's memory and on the median time error.
Figures: docs/benchmarks.md ("Peers").
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.accuracy import ROOT, median_of  # noqa: E402
from bench.generalization import DEFAULT_SEED, DrawnJob, draw_jobs, measure_pair  # noqa: E402

CPU_AS_GPU = {"name": "cpu-2-cores", "mem_per_GPU_in_GB": 24.0, "hbm_bandwidth_in_GB_per_sec": 20.0,
              "intra_node_bandwidth_in_GB_per_sec": 1.0, "intra_node_min_message_latency": 1e-4,
              "peak_fp16_TFLOPS": 1.0, "inter_node_bandwidth_in_GB_per_sec": 1.0}
# Runs in the scratch environment: reads [{"job": ..., "efficiency": ...}] on stdin, prints one result each.
PEER_SCRIPT = r'''
import json, sys
from llm_analysis.analysis import ActivationRecomputation, DSZeRO, LLMAnalysis
from llm_analysis.config import DtypeConfig, GPUConfig, ModelConfig, ParallelismConfig
tasks = json.load(sys.stdin)
out = []
for task in tasks:
    j = task["job"]
    model = ModelConfig(name=j["name"], num_layers=j["layers"], n_head=j["heads"], hidden_dim=j["hidden"],
                        vocab_size=j["vocab"], max_seq_len=j["seq"], num_key_value_heads=j["kv_heads"],
                        ffn_embed_dim=j["ffn"], expansion_ratio=j["ffn"] / j["hidden"], model_type=j["family"])
    analysis = LLMAnalysis(model, GPUConfig(**task["gpu"]), DtypeConfig(),
                           ParallelismConfig(tp_size=j["tp"], pp_size=j["pp"], dp_size=j["dp"]),
                           flops_efficiency=task["efficiency"], hbm_memory_efficiency=1.0)
    result = analysis.training(batch_size_per_gpu=j["micro"], gradient_accumulation_steps=j["micro_batches"],
                               global_batch_size=j["global"], seq_len=j["seq"],
                               activation_recomputation=ActivationRecomputation(2 if j["recompute"] else 0),
                               ds_zero=DSZeRO(j["zero"]), flash_attn=False, layernorm_dtype_bytes=2,
                               master_weights_dtype_bytes=4, other_op_bytes=8,
                               mlp_gated_linear_units=j["family"] == "llama")
    # it computes in 16 bits only: its own parts scaled to the job's fp32 (weights and activations x2, Adam's 8
    # bytes of state without the 4 of master weights, gradients already 4 bytes)
    memory = (2 * result["weight_memory_per_gpu"] + result["gradient_memory_per_gpu"]
              + result["optimizer_state_memory_per_gpu"] * 8 / 12 + 2 * result["activation_memory_per_gpu"])
    out.append({"latency_per_iter_s": result["latency_per_iter"], "memory_per_gpu_bytes": memory})
print(json.dumps(out))
'''


def describe(job: DrawnJob) -> dict:
    """The job as a user describes it to llm-analysis."""
    m, s = job.spec.model, job.spec.strategy
    return {"name": job.name, "family": "factory" if m.factory else m.family, "layers": m.layers, "heads": m.heads,
            "kv_heads": m.kv_heads or m.heads, "hidden": m.hidden, "ffn": m.ffn, "vocab": m.vocab, "seq": m.seq_len,
            "micro": job.spec.batch.micro, "micro_batches": job.spec.micro_batches, "global": job.spec.batch.global_size,
            "dp": s.dp, "tp": s.tp, "pp": s.pp, "zero": s.zero, "recompute": s.recompute != "none"}


def peer(python: str, jobs: list[dict], efficiency: float) -> list[dict]:
    """llm-analysis's time and memory of each job at one FLOP efficiency (PEER_SCRIPT in the scratch python)."""
    tasks = [{"job": job, "efficiency": efficiency, "gpu": CPU_AS_GPU} for job in jobs]
    done = subprocess.run([python, "-c", PEER_SCRIPT], input=json.dumps(tasks), capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        sys.exit(f"llm-analysis failed in {python}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def largest_device(pair: dict) -> dict | None:
    """Validate's memory row of the stage whose device held the most (its meter's peak), None without a meter."""
    rows = [r for r in pair.get("memory", []) if r.get("measured_bytes") and r.get("error_pct") is not None]
    return max(rows, key=lambda r: r["measured_bytes"]) if rows else None


def compare(args: argparse.Namespace) -> dict:
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    jobs = draw_jobs(args.seed, args.jobs, 2)
    folder = Path(args.keep or tempfile.mkdtemp(prefix="peers-"))
    pairs = []
    measure = argparse.Namespace(ranks=2, seed=args.seed, iterations=args.iterations)
    for job in jobs:
        pair = measure_pair(job, folder / f"job{job.index + 1:02d}", measure, env)
        pairs.append(pair)
        print(f"[job {job.index + 1}/{len(jobs)}] {job.name}: measured {pair['measured_batch_time_s'] * 1e3:.1f} ms, "
              f"predicted {pair['predicted_batch_time_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    described = [describe(job) for job in jobs]
    first = peer(args.peer_python, described[:1], 1.0)[0]
    efficiency = min(1.0, first["latency_per_iter_s"] / pairs[0]["measured_batch_time_s"])
    theirs = peer(args.peer_python, described, efficiency)
    rows = []
    for job, pair, their in zip(jobs, pairs, theirs):
        measured, largest = pair["measured_batch_time_s"], largest_device(pair)
        peak = largest["measured_bytes"] if largest else None
        rows.append({"job": job.name, "measured_ms": measured * 1e3,
                     "ours_error_pct": pair["batch_time_error_pct"],
                     "peer_error_pct": (their["latency_per_iter_s"] - measured) / measured * 100.0,
                     "measured_peak_bytes": peak,
                     "ours_memory_error_pct": largest["error_pct"] if largest else None,
                     "peer_memory_error_pct": ((their["memory_per_gpu_bytes"] - peak) / peak * 100.0
                                               if peak else None),
                     "calibration_job": job.index == 0})
    held = [r for r in rows if not r["calibration_job"]]
    metered = [r for r in rows if r["ours_memory_error_pct"] is not None]
    summary = {"seed": args.seed, "jobs": len(rows), "peer_flops_efficiency": efficiency,
               "ours_median_abs_error_pct": median_of(abs(r["ours_error_pct"]) for r in held),
               "peer_median_abs_error_pct": median_of(abs(r["peer_error_pct"]) for r in held),
               "memory_jobs": len(metered),
               "memory_ahead_jobs": sum(abs(r["ours_memory_error_pct"]) < abs(r["peer_memory_error_pct"])
                                        for r in metered),
               "ours_memory_max_abs_error_pct": max((abs(r["ours_memory_error_pct"]) for r in metered), default=None),
               "peer_memory_median_abs_error_pct": median_of(abs(r["peer_memory_error_pct"]) for r in metered)}
    summary["goal_met"] = (summary["memory_ahead_jobs"] == len(metered)
                           and summary["ours_median_abs_error_pct"] < summary["peer_median_abs_error_pct"])
    # the peer at its best: the one efficiency, chosen knowing every run, that minimises its median |error| (its
    # time is its FLOPs over the efficiency here, so a factor on every prediction): an upper bound on calibration
    ratios = np.array([1 + r["peer_error_pct"] / 100 for r in rows])
    factors = np.exp(np.linspace(-8.0, 8.0, 32001))
    medians = np.median(np.abs(np.outer(factors, ratios) - 1), axis=1)
    summary["peer_best_flops_efficiency"] = efficiency / float(factors[int(np.argmin(medians))])
    summary["peer_best_median_abs_error_pct"] = float(medians.min()) * 100.0
    return {"summary": summary, "rows": rows}


def report(result: dict) -> str:
    from harness.common.output import format_table

    s = result["summary"]
    lines = [f"time: median |error| over the {s['jobs'] - 1} jobs after the calibration one: this project "
             f"{s['ours_median_abs_error_pct']:.1f}%, llm-analysis {s['peer_median_abs_error_pct']:.1f}% (its FLOP "
             f"efficiency {s['peer_flops_efficiency']:.3f}, from job 1); at the one efficiency best for every run, "
             f"chosen knowing them ({s['peer_best_flops_efficiency']:.3f}), llm-analysis "
             f"{s['peer_best_median_abs_error_pct']:.1f}% over all {s['jobs']}",
             f"memory: this project closer on {s['memory_ahead_jobs']} of {s['memory_jobs']} metered jobs (at most "
             f"{s['ours_memory_max_abs_error_pct']:.1f}% off; llm-analysis a median "
             f"{s['peer_memory_median_abs_error_pct']:.1f}%); goal {'met' if s['goal_met'] else 'not met'}", ""]
    rows = [[r["job"] + (" (calibration)" if r["calibration_job"] else ""), r["measured_ms"], r["ours_error_pct"],
             r["peer_error_pct"], r["ours_memory_error_pct"], r["peer_memory_error_pct"]] for r in result["rows"]]
    lines.append(format_table(["job", "measured ms", "ours %", "llm-analysis %", "ours memory %",
                               "llm-analysis memory %"], rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", required=True, help="python of an environment with llm-analysis installed")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--keep", metavar="DIR")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not Path(args.peer_python).exists():
        parser.exit(2, f"--peer-python {args.peer_python}: no such file; install llm-analysis into a scratch "
                       "environment first (the docstring says how)\n")
    result = compare(args)
    print(json.dumps(result, indent=1) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

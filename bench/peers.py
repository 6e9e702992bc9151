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
of master weights, gradients at 4 bytes as it counts them).
Its "GPU" gets the calibration this project gets, from the same profile of the job: its peak FLOP rate is the
rate the job's compute reached there (the FLOPs of its compute events over their measured seconds; FLOP
efficiency 1), its link between ranks the latency and bandwidth fitted to the profile's measured communication
(the all-reduce's where there is one), and its memory bandwidth a one-core copy measured here. Nothing of the
runs it is judged against goes in. Beside it, the peer at its best: those rates times the one factor that
minimises its median error over every job, chosen knowing the runs (an upper bound no user has). Memory:
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
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.accuracy import ROOT, median_of  # noqa: E402
from bench.generalization import DEFAULT_SEED, DrawnJob, draw_jobs, measure_pair  # noqa: E402

# the factors on the profile's FLOP rate tried for the peer at its best (evaluated by llm-analysis itself: its
# memory-bound and communication parts do not scale with the rate)
BEST_FACTORS = np.exp(np.linspace(np.log(1 / 8), np.log(8), 121))
# Runs in the scratch environment: reads [{"job": ..., "gpu": ..., "efficiency": ...}] on stdin, prints one result
# each.
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
            "micro": job.spec.batch.micro, "micro_batches": job.spec.micro_batches,
            "global": job.spec.batch.global_size,
            "dp": s.dp, "tp": s.tp, "pp": s.pp, "zero": s.zero, "recompute": s.recompute != "none"}


def copy_bandwidth(megabytes: int = 128, repeats: int = 5) -> float:
    """Bytes per second one core moves copying an array (read and write counted), the best of `repeats`."""
    source = np.ones(megabytes * 2**20 // 8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return 2 * source.nbytes / best


def profile_figures(profile_path: Path) -> dict:
    """What the job's own profile measured, as the prediction uses it: `flops_per_s`, the FLOPs of its compute
    events over their measured seconds (each counted as often as an iteration runs it); `latency_s` and
    `bytes_per_s`, the link fitted to its measured communication (its all-reduce's where it has one, intra-node
    before inter); None where it has none."""
    from analysis.costs import estimate_costs
    from analysis.profile_reader import layers_for, load_profile
    from harness.plan.events import build_plan

    profile = load_profile(profile_path)
    plan = build_plan(profile.spec, layers_for(profile, profile.spec))
    costs = estimate_costs(plan, profile)
    flops = seconds = 0.0
    for eid, event in plan.events.items():
        if event.kind == "compute" and event.cost > 0 and costs.events[eid].seconds > 0:
            flops += event.cost * plan.multiplicity[eid]
            seconds += costs.events[eid].seconds * plan.multiplicity[eid]
    links = sorted((f for f in costs.fits.values() if f.points and f.beta_s_per_byte > 0),
                   key=lambda f: (f.kind != "allreduce", f.placement != "intra"))
    return {"flops_per_s": flops / seconds if seconds else None,
            "latency_s": links[0].alpha_s if links else None,
            "bytes_per_s": 1 / links[0].beta_s_per_byte if links else None}


def as_gpu(figures: dict, memory_bytes_per_s: float) -> dict:
    """llm-analysis's GPUConfig of the profile's figures (a job without communication gets a link it never uses)."""
    link_gbs = (figures["bytes_per_s"] or memory_bytes_per_s) / 1e9
    return {"name": "cpu-core-as-profiled", "mem_per_GPU_in_GB": 1e3, "hbm_bandwidth_in_GB_per_sec":
            memory_bytes_per_s / 1e9, "intra_node_bandwidth_in_GB_per_sec": link_gbs,
            "inter_node_bandwidth_in_GB_per_sec": link_gbs,
            "intra_node_min_message_latency": figures["latency_s"] or 0.0,
            "peak_fp16_TFLOPS": figures["flops_per_s"] / 1e12}


def peer(python: str, tasks: list[dict]) -> list[dict]:
    """llm-analysis's time and memory of each task (a job, its GPU, a FLOP efficiency; PEER_SCRIPT in the scratch
    python)."""
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
    memory_bytes_per_s = copy_bandwidth()
    figures = [profile_figures(folder / f"job{job.index + 1:02d}" / "prof") for job in jobs]
    gpus = [as_gpu(f, memory_bytes_per_s) for f in figures]
    theirs = peer(args.peer_python, [{"job": j, "gpu": g, "efficiency": 1.0} for j, g in zip(described, gpus)])
    # the peer at its best: every job's rate times one factor, each factor's predictions by llm-analysis itself
    scaled = peer(args.peer_python, [{"job": j, "gpu": {**g, "peak_fp16_TFLOPS": g["peak_fp16_TFLOPS"] * k},
                                      "efficiency": 1.0}
                                     for k in BEST_FACTORS for j, g in zip(described, gpus)])
    measured = np.array([p["measured_batch_time_s"] for p in pairs])
    latencies = np.array([r["latency_per_iter_s"] for r in scaled]).reshape(len(BEST_FACTORS), len(jobs))
    medians = np.median(np.abs(latencies / measured - 1), axis=1)
    rows = []
    for job, pair, their, gpu in zip(jobs, pairs, theirs, gpus):
        measured, largest = pair["measured_batch_time_s"], largest_device(pair)
        peak = largest["measured_bytes"] if largest else None
        rows.append({"job": job.name, "measured_ms": measured * 1e3,
                     "ours_error_pct": pair["batch_time_error_pct"],
                     "peer_error_pct": (their["latency_per_iter_s"] - measured) / measured * 100.0,
                     "measured_peak_bytes": peak,
                     "ours_memory_error_pct": largest["error_pct"] if largest else None,
                     "peer_memory_error_pct": ((their["memory_per_gpu_bytes"] - peak) / peak * 100.0
                                               if peak else None),
                     "profile_tflops": gpu["peak_fp16_TFLOPS"],
                     "profile_link_gbs": gpu["intra_node_bandwidth_in_GB_per_sec"],
                     "profile_link_latency_us": gpu["intra_node_min_message_latency"] * 1e6})
    metered = [r for r in rows if r["ours_memory_error_pct"] is not None]
    summary = {"seed": args.seed, "jobs": len(rows), "peer_calibration": "profile",
               "memory_copy_gbs": memory_bytes_per_s / 1e9,
               "ours_median_abs_error_pct": median_of(abs(r["ours_error_pct"]) for r in rows),
               "peer_median_abs_error_pct": median_of(abs(r["peer_error_pct"]) for r in rows),
               "memory_jobs": len(metered),
               "memory_ahead_jobs": sum(abs(r["ours_memory_error_pct"]) < abs(r["peer_memory_error_pct"])
                                        for r in metered),
               "ours_memory_max_abs_error_pct": max((abs(r["ours_memory_error_pct"]) for r in metered), default=None),
               "peer_memory_median_abs_error_pct": median_of(abs(r["peer_memory_error_pct"]) for r in metered)}
    summary["goal_met"] = (summary["memory_ahead_jobs"] == len(metered)
                           and summary["ours_median_abs_error_pct"] < summary["peer_median_abs_error_pct"])
    # an upper bound on any calibration of the peer: the one factor, chosen knowing every run
    summary["peer_best_rate_factor"] = float(BEST_FACTORS[int(np.argmin(medians))])
    summary["peer_best_median_abs_error_pct"] = float(medians.min()) * 100.0
    return {"summary": summary, "rows": rows}


def report(result: dict) -> str:
    from harness.common.output import format_table

    s = result["summary"]
    lines = [f"time: median |error| over the {s['jobs']} jobs, each calibrated by its own profile: this project "
             f"{s['ours_median_abs_error_pct']:.1f}%, llm-analysis {s['peer_median_abs_error_pct']:.1f}% (the FLOP "
             f"rate and link the profile measured, memory {s['memory_copy_gbs']:.1f} GB/s); at the one factor on "
             f"those rates best for every run, chosen knowing them ({s['peer_best_rate_factor']:.2f}), llm-analysis "
             f"{s['peer_best_median_abs_error_pct']:.1f}%",
             f"memory: this project closer on {s['memory_ahead_jobs']} of {s['memory_jobs']} metered jobs (at most "
             f"{s['ours_memory_max_abs_error_pct']:.1f}% off; llm-analysis a median "
             f"{s['peer_memory_median_abs_error_pct']:.1f}%); goal {'met' if s['goal_met'] else 'not met'}", ""]
    rows = [[r["job"], r["measured_ms"], r["profile_tflops"] * 1e3, r["profile_link_gbs"], r["ours_error_pct"],
             r["peer_error_pct"], r["ours_memory_error_pct"], r["peer_memory_error_pct"]] for r in result["rows"]]
    lines.append(format_table(["job", "measured ms", "profile GFLOP/s", "link GB/s", "ours %", "llm-analysis %",
                               "ours memory %", "llm-analysis memory %"], rows))
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

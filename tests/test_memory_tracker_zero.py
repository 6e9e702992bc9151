"""The ZeRO-3 memory model against PyTorch's own accounting (MemTracker) on a real FSDP2 run: every rank of the
world is a data-parallel replica of a small GPT-2 trained by harness train with zero = 3, under MemTracker; the
model predicts from the profiler's own activation measurements. Run under MPI:
.venv/bin/mpirun -n 2 .venv/bin/python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_memory_tracker_zero.py"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import tiny_spec_text

pytestmark = pytest.mark.mpi(min_size=2)


def _lazy_barrier(comm) -> None:
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


@pytest.mark.parametrize(("name", "zero", "vocab", "micro"),
                         [("gpt2-small", 3, 512, 2), ("bert-base", 2, 512, 2), ("llama-1b", 1, 2048, 1)])
def test_zero_meets_pytorchs_own_peak(tmp_path, name, zero, vocab, micro):
    """FSDP2 as harness train runs it (every layer its own root): at zero 3 the peak holds one layer whole (and its
    all-gather buffer as its backward starts) beside the shards, and the reduce-scatter inputs of the layers whose
    backward has run; at zero 2 every layer stays whole, and a head's whole gradients are let go at its reduce-
    scatter like any layer's (held there, the model read the bert job 2.6% over its peak); at zero 1 the last
    backward's reduce-scatter lets the accumulated whole gradients go into its input with no working copy beside it
    (with both, the model read the llama job, whose head outweighs its activations, 7% over). Which of a few moments
    peaks depends on when gloo's asynchronous collectives complete and let their buffers go: MemTracker's peak took
    2.42, 2.45, 2.49 and 2.55 MB over runs of the ZeRO-3 job on 2 ranks, one layer whole more or less beside
    different buffers; on 4 ranks, whose shards are smaller, 1.88 MB in two runs of three, 8% above the model's 1.73
    MB. So the model is held to that range: never more than 2% above the run's peak, and below it by at most the
    largest layer whole (a buffer gloo had not let go yet) and 2%; MemTracker's gradients at its peak are at most the
    model's (its last backward's) and 2% and a layer's shard."""
    import torch
    from mpi4py import MPI

    from analysis.memory import estimate_memory
    from harness.plan.events import build_plan
    from harness.plan.spec import loads_spec
    from harness.profile.compute import measure_compute_share
    from harness.profile.memory import pytorch_tracker, tracker_peak
    from harness.train.runner import run_training

    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    spec = loads_spec(tiny_spec_text(name=name, layers=2, hidden=64, heads=4, ffn=256, seq=32, vocab=vocab,
                                     micro=micro, global_batch=4 * n, dp=n, zero=zero))
    plan = build_plan(spec)
    forwards = {eid: e.content for eid, e in plan.events.items()
                if e.kind == "compute" and e.content.get("phase") == "fwd"}
    measured = measure_compute_share(spec, forwards, torch.device("cpu"), warmup=0, repeats=1)
    (stage,) = estimate_memory(plan, {eid: m.activation_bytes for eid, m in measured.items()}).stages
    rundir = Path(comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)) / "run"
    with pytorch_tracker() as tracker:
        run_training(spec, comm, rundir, iterations=3, warmup=1, timeout_s=120)
    peak = tracker_peak(tracker)
    _lazy_barrier(comm)
    layer_whole = max(layer.params for layer in plan.layers) * spec.model.dtype_bytes
    assert -0.02 - layer_whole / peak["total"] < (stage.total - peak["total"]) / peak["total"] < 0.02, (
        stage.to_dict(), peak, layer_whole)
    # which moment peaks moves under load, and with it how many layers' gradient shards exist yet: the model's
    # gradients are the last backward's (every shard, and the whole ones it holds), which MemTracker's at its peak
    # never exceed by more than 2% and a layer's shard; below them by up to the shards not made yet (in `make test`
    # on 4 ranks 8 KB were missing at the peak in one run, 2.4% of them, and in another, under load, 85 KB of the
    # ZeRO-3 job's 168 KB: a peak in mid-backward; the job passed three runs alone)
    assert peak["gradient"] <= stage.gradients + 0.02 * peak["gradient"] + layer_whole / n, (stage.gradients, peak)

"""`harness train` from the command line (mpirun subprocesses) and its serial parts: sharding, checks, reader.

Plain pytest runs these; the MPI run of the suite (`-m mpi`) leaves them out.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.common.errors import UserError
from harness.plan.spec import loads_spec
from tests.helpers import tiny_spec_text

ROOT = Path(__file__).resolve().parent.parent


def mpirun() -> str:
    candidate = os.environ.get("DISTSIM_MPIRUN") or str(ROOT / ".venv" / "bin" / "mpirun")
    found = shutil.which(candidate)
    if found is None:
        pytest.skip(f"no mpirun at {candidate} (set DISTSIM_MPIRUN)")
    return found


def train(tmp_path: Path, project_env, spec_text: str, *args: str, ranks: int = 2):
    spec = tmp_path / "job.toml"
    spec.write_text(spec_text)
    cmd = [mpirun(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "harness", "train", str(spec),
           "-o", str(tmp_path / "run"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=project_env, capture_output=True, text=True, timeout=300)


def test_cli_trains_two_ranks_and_writes_the_trace(tmp_path, project_env):
    from analysis.trace_reader import read_trace

    proc = train(tmp_path, project_env, tiny_spec_text(pp=2, layers=2, micro=1, global_batch=2), "--iterations",
                 "2", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    assert (run / "trace.h5").is_file()
    assert sorted(p.name for p in run.glob("rank-*.trace.h5")) == ["rank-00000.trace.h5", "rank-00001.trace.h5"]
    assert not list(run.glob(".*tmp*")), "temporary files left behind"
    assert "loss first" in proc.stdout and proc.stdout.count("loss first") == 1, proc.stdout
    trace = read_trace(run / "trace.h5")
    assert trace.world_size == 2 and list(trace.iterations["warmup"]) == [1, 0]
    assert len(trace.iteration_times()) == 1 and trace.iteration_times()[0] > 0
    for rank in range(2):
        phases = set(trace.device(rank).columns["phase"])
        assert {"F", "B", "send", "recv", "opt"} <= phases
    # the summary asks for binding only where the ranks share cores and each could have had its own
    affinity = trace.environment["cpu_affinity"]
    could_bind = trace.environment["cpu_binding"] == "shared" and len(set(affinity[0]) | set(affinity[1])) >= 2
    assert ("NOTE: the ranks were free to share cores" in proc.stdout) == could_bind, proc.stdout


@pytest.mark.parametrize("args, spec_kwargs, message", [
    ((), dict(dp=4, layers=2, micro=1, global_batch=4),
     "the job needs dp x tp x pp = 4 x 1 x 1 = 4 ranks but runs on 2; start it with mpirun -n 4"),
    (("--iterations", "2", "--warmup", "2"), dict(dp=2, layers=2, micro=1, global_batch=2),
     "--warmup must be between 0 and --iterations - 1 = 1, got 2"),
    ((), dict(dp=2, layers=3, pp=2), "layers (3) must be divisible by pp = 2"),
    (("--torch-profiler", "/proc/no-such/traces"), dict(dp=2, layers=2, micro=1, global_batch=2),
     "cannot create the profiler trace folder /proc/no-such/traces"),
    (("--lr", "-1"), dict(dp=2, layers=2, micro=1, global_batch=2), "--lr must be a positive learning rate, got -1.0"),
    (("--timeout-s", "nan"), dict(dp=2, layers=2, micro=1, global_batch=2),
     "--timeout-s must be from 1 to 604800 seconds (a week), got nan"),
    (("--threads", "100000"), dict(dp=2, layers=2, micro=1, global_batch=2), "--threads must be from 1 to 1024"),
    (("--iterations", "99999999999999999999999"), dict(dp=2, layers=2, micro=1, global_batch=2),
     "--iterations must be from 1 to 100,000"),
])
def test_cli_bad_input_exits_2_with_one_message(tmp_path, project_env, args, spec_kwargs, message):
    proc = train(tmp_path, project_env, tiny_spec_text(**spec_kwargs), *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr  # rank 0 only; no traceback, no MPI_Abort chatter
    assert lines[0].startswith("python -m harness train: error: ")
    assert not (tmp_path / "run").exists()


def test_check_run_names_the_rank_count():
    from harness.train.runner import check_run

    spec = loads_spec(tiny_spec_text(dp=2, tp=2, layers=2, micro=1, global_batch=2))
    check_run(spec, 4, 2, 1)
    with pytest.raises(UserError, match="needs dp x tp x pp = 2 x 2 x 1 = 4 ranks but runs on 3"):
        check_run(spec, 3, 2, 1)
    with pytest.raises(UserError, match="--iterations must be from 1 to 100,000"):
        check_run(spec, 4, 0, 0)
    # what is wrong with the arguments comes before the ranks they need (a user fixing one error at a time would
    # otherwise book ranks for a run that cannot start)
    with pytest.raises(UserError, match="--iterations must be from 1 to 100,000"):
        check_run(spec, 3, 0, 0)
    with pytest.raises(UserError, match="--backend must be one of torch, mpi4py"):
        check_run(spec, 4, 2, 1, "nccl")
    bfloat16 = loads_spec(tiny_spec_text(dp=2, layers=2, micro=1, global_batch=2).replace(
        'dtype = "float32"', 'dtype = "bfloat16"'))
    with pytest.raises(UserError, match="--backend mpi4py cannot all-reduce bfloat16"):
        check_run(bfloat16, 2, 2, 1, "mpi4py")


def _partial_attention(block, x):
    """A block's attention output projection before its bias and all-reduce: what tp shards add up."""
    from torch.nn import functional as F

    h = block.norm1(x) if block.family != "bert" else x
    return F.linear(block.attention_context(h), block.proj.weight)


def _partial_mlp(block, x):
    from torch.nn import functional as F

    if block.family == "llama":
        gate, up = block.gate_up(x).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, block.down.weight)
    return F.linear(F.gelu(block.fc1(x)), block.fc2.weight)


@pytest.mark.parametrize("family, kv_heads", [("gpt2-small", 4), ("bert-base", 4), ("llama-1b", 2)])
def test_tensor_parallel_shards_are_cut_from_the_whole_layer(family, kv_heads):
    """Each shard has the parameters the event plan counts, and the shards' partial sums are the whole layer's."""
    import torch

    from harness.plan.events import build_plan
    from harness.train.model import build_full_layer, build_shard

    text = tiny_spec_text(name=family, tp=2, layers=2, heads=4, hidden=32, ffn=64, micro=1, global_batch=1)
    spec = loads_spec(text.replace("\nheads = ", f"\nkv_heads = {kv_heads}\nheads = ", 1))
    assert spec.model.kv_heads == kv_heads
    plan = build_plan(spec)
    x = torch.randn(2, spec.model.seq_len, spec.model.hidden, generator=torch.Generator().manual_seed(1))
    for position, desc in enumerate(plan.layers):
        shards = [build_shard(spec.model, desc.kind, 0, position, 2, t, None) for t in range(2)]
        assert sum(p.numel() for p in shards[0].parameters()) == desc.params, (family, desc.kind)
        if desc.kind != "block":
            continue
        whole = build_full_layer(spec.model, desc.kind, 0, position)
        with torch.no_grad():
            for part in (_partial_attention, _partial_mlp):
                torch.testing.assert_close(sum(part(s, x) for s in shards), part(whole, x), rtol=1e-4, atol=1e-5)


def test_timebase_converts_with_offset_and_drift():
    from harness.train.clock import ClockSync, Timebase

    methods = ["reference", "cristian"]
    first = ClockSync(1_000_000_000, np.array([0, 500]), np.array([0, 10]), np.array([0, 500]), methods)
    last = ClockSync(3_000_000_000, np.array([0, 700]), np.array([0, 10]), np.array([0, 700]), methods)
    tb = Timebase(1, 1_000_000_000, first, last)
    # Rank 1 reads t + 500 ns at t0 and t + 700 ns two seconds later (100 ns/s drift).
    np.testing.assert_allclose(tb.seconds(np.array([1_000_000_500, 3_000_000_700, 2_000_000_600])),
                               [0.0, 2.0, 1.0], atol=1e-12)
    assert Timebase(0, 1_000_000_000, first, last).seconds(1_500_000_000) == pytest.approx(0.5)


def test_layer_clock_on_a_cpu_is_the_host_clock():
    import time

    import torch

    from harness.train.layer_times import LayerClock

    clock = LayerClock(torch.device("cpu"))
    before = time.perf_counter_ns()
    mark = clock.mark()
    assert before <= mark <= time.perf_counter_ns()
    assert clock.to_ns(0, None, mark) == mark


def test_background_communications_join_the_profiler_trace_on_threads_where_they_nest():
    """Sends and MPI buckets in flight together go on different threads; warm-up rows stay out; torch's buckets
    stay out (gloo's own thread shows them)."""
    from harness.train.profiler_trace import BACKGROUND_THREAD, background_events

    rows = [(100, 500, 0, "p2p", "send.activation", "send", "e1", 0, 0, 1, 1),
            (300, 800, 0, "allreduce", "dp.bucket0", "dp", "b0", 0, 1, 1, -1),
            (600, 900, 0, "p2p", "send.activation", "send", "e1", 0, 1, 1, 1),
            (0, 50, 0, "p2p", "send.activation", "send", "e1", 0, 0, 0, 1)]  # iteration 0: warm-up
    import time

    base_ns = time.time_ns() - 60 * 10**9  # Kineto's ts count from its trace's base, a little before the run
    events = [e for e in background_events(rows, 1, base_ns, 42, mpi_buckets=True) if e["ph"] == "X"]
    assert [(e["name"], e["tid"]) for e in events] == [
        ("distsim:send.activation", f"{BACKGROUND_THREAD} 0"), ("mpi4py:allreduce", f"{BACKGROUND_THREAD} 1"),
        ("distsim:send.activation", f"{BACKGROUND_THREAD} 0")]
    assert [e["dur"] for e in events] == [0.4, 0.5, 0.3]  # microseconds
    assert events[1]["ts"] - events[0]["ts"] == pytest.approx(0.2, abs=1e-3)
    assert [e["name"] for e in background_events(rows, 1, 0, 42, mpi_buckets=False) if e["ph"] == "X"] == [
        "distsim:send.activation"] * 2


def test_the_memory_peak_comes_from_the_last_warm_up_iteration_when_two_warm_up():
    """With two or more warm-up iterations the saved-tensor count runs in the last of them only (the optimizer's
    states exist from the second iteration on), so no timed iteration pays for it; with fewer it runs in the
    measured ones."""
    from harness.train.runner import memory_iteration

    assert [memory_iteration(w) for w in range(5)] == [0, 1, 1, 2, 3]


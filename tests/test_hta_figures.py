"""`analysis breakdown` against HolisticTraceAnalysis (HTA): its rules on hand-made GPU traces with exact answers,
both spans (`--span trace|hta`), and HTA 0.5.0's own figures pinned on tests/data/hta_ddp (HTA is not needed to
run these tests)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from analysis.activity import COMMUNICATION_CLASS, COMPUTE, MEMORY_CLASS, SPANS, kernel_class, load_run
from analysis.breakdown import CATEGORIES, breakdown, to_json
from analysis.cli import main
from analysis.commands.breakdown import SPAN_CHOICES

DATA = Path(__file__).parent / "data"
US = 1e-6


def gpu(name, ts, dur, correlation=None, cat="kernel", stream=7):
    args = {"device": 0, "stream": stream}
    if correlation is not None:
        args["correlation"] = correlation
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur, "args": args}


def cpu(name, ts, dur, cat="cpu_op", correlation=None):
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}


def launch(correlation, ts):
    return cpu("cudaLaunchKernel", ts, 3, cat="cuda_runtime", correlation=correlation)


def write(path: Path, events, steps=((0, 100), (100, 200), (200, 300))) -> Path:
    marks = [cpu(f"ProfilerStep#{i + 1}", a, b - a, cat="user_annotation") for i, (a, b) in enumerate(steps)]
    path.write_text(json.dumps({"distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
                                "traceEvents": marks + list(events)}))
    return path


def three_steps(extra=()):
    """Steps at 0, 100, 200 us. Launched before step 3: a compute kernel, an all-reduce under it by 5 us, a
    copy with fractional times, a kernel still running after step 3 began, a short kernel named nccl_* that
    is no NCCL kernel (HTA: compute), a stream synchronisation; launched in step 3: one kernel; one whose
    correlation id no launch call holds; a device-wide synchronisation on no stream."""
    return [launch(1, 10), gpu("volta_sgemm_128x64_nn", 20, 40, 1),
            launch(2, 50), gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 55, 65, 2, stream=20),
            launch(7, 60), gpu("nccl_helper_kernel", 125, 3, 7),
            gpu("elementwise_kernel", 130, 10, 6),
            launch(3, 150), gpu("Memcpy DtoH (Device -> Pinned)", 150.3, 20.5, 3, cat="gpu_memcpy"),
            cpu("cudaStreamSynchronize", 171, 6, cat="cuda_runtime", correlation=8),
            gpu("Stream Sync", 171, 5, 8, cat="cuda_sync"),
            launch(4, 190), gpu("volta_sgemm_128x64_nn", 195, 35, 4),
            launch(5, 210), gpu("volta_sgemm_128x64_nn", 240, 40, 5),
            {"ph": "X", "cat": "cuda_sync", "name": "Event Sync", "pid": 0, "tid": 7, "ts": 285, "dur": 10,
             "args": {"correlation": 9}},
            *extra]


def rank_row(run):
    (row,) = breakdown(run).ranks
    return row


def test_whole_trace_span_counts_every_gpu_event(tmp_path):
    """span [20, 280); compute 40 + 3 + 10 + 35 + 40; the all-reduce's 60 us past the kernel; the copy and the
    stream synchronisation are memory; the gaps 5 + 2 + 10.3 + 0.2 + 19 + 10 us idle."""
    run = load_run(write(tmp_path / "t.json", three_steps()))
    row = rank_row(run)
    assert run.span == "trace" and len(run.iteration_s) == 3
    assert (row.span_s, row.compute_s, row.communication_s, row.memory_s, row.idle_s) == pytest.approx(
        (260 * US, 128 * US, 60 * US, 25.5 * US, 46.5 * US), abs=1e-9)
    assert row.overlap_pct == pytest.approx(100 * 5 / 65)


def test_hta_span_leaves_out_what_the_last_step_launched(tmp_path):
    """HTA's reading: times rounded (the copy becomes [151, 170)), only what was launched before step 3's start
    (the kernel still running at 230 us stays; the one launched at 210 us and the one no call launched go):
    span [20, 230); compute 40 + 3 + 35; communication 60; memory 19 + 5; idle 5 + 23 + 1 + 19."""
    run = load_run(write(tmp_path / "t.json", three_steps()), span="hta")
    row = rank_row(run)
    assert run.span == "hta" and len(run.iteration_s) == 2
    assert (row.span_s, row.compute_s, row.communication_s, row.memory_s, row.idle_s) == pytest.approx(
        (210 * US, 78 * US, 60 * US, 24 * US, 48 * US), abs=1e-9)
    assert row.overlap_pct == pytest.approx(100 * 5 / 65)


def test_hta_cuts_at_the_latest_step_mark_off_the_gpu_streams(tmp_path):
    """A GPU annotation ProfilerStep#3 at 215 us (no stream, as torch writes it) moves the cut past the launch
    at 210 us: its kernel [240, 280) stays."""
    mark = {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#3", "pid": 0, "tid": 7, "ts": 215,
            "dur": 60, "args": {}}
    row = rank_row(load_run(write(tmp_path / "t.json", three_steps([mark])), span="hta"))
    assert (row.span_s, row.compute_s) == pytest.approx((260 * US, 118 * US), abs=1e-9)


def test_a_trace_of_one_step_is_taken_whole(tmp_path):
    events = [launch(1, 10), gpu("volta_sgemm_128x64_nn", 20, 40, 1), gpu("elementwise_kernel", 70, 10)]
    path = write(tmp_path / "t.json", events, steps=((0, 100),))
    for span in SPANS:
        row = rank_row(load_run(path, span=span))
        assert (row.span_s, row.compute_s) == pytest.approx((60 * US, 50 * US), abs=1e-9), span


def test_hta_kernel_classes_by_name():
    assert kernel_class("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == COMMUNICATION_CLASS
    assert kernel_class("ncclKernel_SendRecv") == COMMUNICATION_CLASS
    assert kernel_class("nccl_helper_kernel") == COMPUTE  # no "Kernel": not NCCL's to HTA
    for name in ("Memcpy DtoH (Device -> Pinned)", "Memset (Device)", "dma_copy", "Stream Sync",
                 "void cub::detail::batch_memcpy::BatchMemcpyKernel"):
        assert kernel_class(name) == MEMORY_CLASS, name
    assert kernel_class("volta_sgemm_128x64_nn") == COMPUTE


def test_hta_span_with_nothing_launched_before_the_last_step_is_refused(tmp_path, capsys):
    events = [launch(1, 210), gpu("volta_sgemm_128x64_nn", 220, 40, 1)]
    path = write(tmp_path / "t.json", events)
    assert main(["breakdown", str(path), "--span", "hta"]) == 2
    err = capsys.readouterr().err
    assert "launched nothing on the GPU before its last profiler step" in err and "Traceback" not in err


def test_hta_span_on_a_trace_h5_is_refused(capsys):
    assert main(["breakdown", str(DATA / "pp2-trace.h5"), "--span", "hta"]) == 2
    err = capsys.readouterr().err
    assert "trace.h5" in err and "leave --span out" in err and "Traceback" not in err


def test_span_choices_are_the_analysis_spans():
    assert SPAN_CHOICES == SPANS


# ---- HTA 0.5.0's figures on tests/data/hta_ddp (tests/data/hta_make_traces.py) ---------------------------------
# Per rank: span, compute, non-compute (communication or memory with no compute running) and idle time (us),
# and the communication-computation overlap (%, as HTA rounds it), from HTA 0.5.0's get_temporal_breakdown()
# and get_comm_comp_overlap():
# - span "hta": TraceAnalysis(trace_dir=..., include_last_profiler_step=False), HTA's defaults;
# - span "trace": include_last_profiler_step=True with HTA_DISABLE_NS_ROUNDING=1 (every step, exact times); every
#   GPU event of the fixture was launched inside a step, so HTA then takes the whole trace.
HTA_0_5_0 = {
    "hta": {0: (1871.0, 1306.0, 393.0, 172.0, 32.24), 1: (2225.0, 1702.0, 350.0, 173.0, 35.27)},
    "trace": {0: (2682.670, 1949.590, 565.339, 167.741, 34.95), 1: (2718.0, 2029.0, 520.0, 169.0, 38.89)},
}


@pytest.mark.parametrize("span", SPANS)
def test_hta_figures_on_the_synthetic_ddp_traces(span):
    result = breakdown(load_run(DATA / "hta_ddp", span=span))
    assert result.run.kind == "kineto-gpu" and [r.rank for r in result.ranks] == [0, 1]
    for row in result.ranks:
        span_us, compute_us, non_compute_us, idle_us, overlap_pct = HTA_0_5_0[span][row.rank]
        assert row.span_s / US == pytest.approx(span_us, abs=1e-3)
        assert row.compute_s / US == pytest.approx(compute_us, abs=1e-3)
        assert (row.communication_s + row.memory_s) / US == pytest.approx(non_compute_us, abs=1e-3)
        assert row.idle_s / US == pytest.approx(idle_us, abs=1e-3)
        assert row.overlap_pct == pytest.approx(overlap_pct, abs=0.005)
        assert sum(getattr(row, f"{c}_s") for c in CATEGORIES) == pytest.approx(row.span_s)
    assert len(result.run.iteration_s) == (2 if span == "hta" else 3)
    assert to_json(result)["span"] == span


def test_hta_span_from_the_command_line(capsys):
    assert main(["breakdown", str(DATA / "hta_ddp"), "--span", "hta", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["span"] == "hta" and data["ranks"][1]["span_s"] == pytest.approx(2225 * US, abs=1e-9)


def test_the_generator_makes_the_committed_fixture():
    spec = importlib.util.spec_from_file_location("hta_make_traces", DATA / "hta_make_traces.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    for rank in (0, 1):
        committed = json.loads((DATA / "hta_ddp" / f"rank-{rank}.json").read_text())
        assert maker.make_rank(rank) == committed, rank

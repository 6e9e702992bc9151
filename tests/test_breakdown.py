"""`analysis breakdown`: hand-made Kineto traces with exact answers, real torch.profiler and trace.h5 fixtures with
pinned numbers, the streaming reader, and bad input."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import analysis.kineto as kineto
from analysis.activity import innermost, load_run, load_runs
from analysis.breakdown import CATEGORIES, breakdown, phase_summary, to_json
from analysis.cli import main
from harness.common.errors import UserError

DATA = Path(__file__).parent / "data"
US = 1e-6


def event(name, ts, dur, cat="kernel", tid=7, pid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def write_trace(path: Path, events, rank: int | None = 0, world: int = 1, gz: bool = False, steps=((0, 1000),),
                first_key: str = "distributedInfo", base_ns: int | None = None) -> Path:
    """A Kineto trace as torch.profiler writes it: metadata, distributedInfo, then traceEvents."""
    marks = [event(f"ProfilerStep#{i + 1}", a, b - a, cat="user_annotation", tid=99) for i, (a, b) in enumerate(steps)]
    body = {"schemaVersion": 1, "deviceProperties": []}
    info = {"backend": "nccl", "rank": rank, "world_size": world} if rank is not None else None
    items = [("traceEvents", marks + list(events) + [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 7,
                                                      "args": {"name": "stream 7"}}])]
    if info is not None:
        items.insert(0 if first_key == "distributedInfo" else 1, ("distributedInfo", info))
    body |= dict(items)
    body["traceName"] = str(path)
    if base_ns is not None:
        body["baseTimeNanoseconds"] = base_ns
    text = json.dumps(body)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def only_rank(run):
    (activity,) = run.ranks.values()
    return breakdown(run).ranks[0], activity


def test_gpu_kernels_follow_holistic_trace_analysis(tmp_path):
    """Two kernels overlapping by 50 us, a gap of 50 us, a memcpy alone: every category known exactly."""
    events = [event("volta_sgemm_128x64_nn", 0, 100), event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 100),
              event("elementwise_kernel", 200, 50), event("Memcpy DtoH (Device -> Pinned)", 300, 20, cat="gpu_memcpy"),
              event("aten::mm", 0, 400, cat="cpu_op", tid=3),  # CPU ops do not count on a GPU trace
              event("DistributedDataParallel.forward", 0, 120, cat="gpu_user_annotation")]
    run = load_run(write_trace(tmp_path / "gpu.json.gz", events, gz=True))
    row, activity = only_rank(run)
    assert run.kind == "kineto-gpu" and run.backend == "nccl"
    assert row.span_s == pytest.approx(320 * US)
    assert row.compute_s == pytest.approx(150 * US)
    assert row.communication_s == pytest.approx(50 * US)
    assert row.memory_s == pytest.approx(20 * US)
    assert row.idle_s == pytest.approx(100 * US)
    assert row.overlap_pct == pytest.approx(50.0)
    assert [a.key for a in activity.arrivals] == [("allreduce", 0)]
    assert set(activity.phases) == {"dp-sync", "forward"}
    forward = next(p for p in breakdown(run).phases if p["phase"] == "forward")
    assert (forward["compute_s"], forward["communication_s"], forward["idle_s"]) == pytest.approx(
        (100 * US, 20 * US, 0.0))


def test_memory_under_a_compute_kernel_is_compute(tmp_path):
    events = [event("gemm", 0, 100), event("Memset (Device)", 80, 40, cat="gpu_memset"),
              event("ncclKernel_SendRecv", 110, 20)]
    row, _ = only_rank(load_run(write_trace(tmp_path / "t.json", events)))
    assert (row.compute_s, row.communication_s, row.memory_s, row.idle_s) == pytest.approx(
        (100 * US, 20 * US, 10 * US, 0.0))


def test_cpu_trace_gives_each_instant_to_the_innermost_event(tmp_path):
    """A forward annotation holding a c10d launch, while gloo's thread runs the all-reduce."""
    events = [event("distsim:forward", 0, 100, cat="user_annotation", tid=1),
              event("aten::addmm", 5, 10, cat="cpu_op", tid=1),
              event("c10d::allreduce_", 20, 10, cat="cpu_op", tid=1),
              event("gloo:all_reduce", 25, 35, cat="user_annotation", tid=2),
              event("aten::relu", 150, 50, cat="cpu_op", tid=1)]
    run = load_run(write_trace(tmp_path / "rank-3.json", events, rank=None))
    row, activity = only_rank(run)
    assert run.kind == "kineto-cpu" and row.rank == 3  # from the file name
    assert row.span_s == pytest.approx(200 * US)
    assert row.compute_s == pytest.approx((100 - 10 + 50) * US)
    assert row.communication_s == pytest.approx(10 * US)
    assert row.idle_s == pytest.approx(50 * US)
    assert row.overlap_pct == pytest.approx(100 * 30 / 40)
    assert activity.phases["forward"].length == pytest.approx(100 * US)
    assert activity.phases["dp-sync"].length == pytest.approx(40 * US)


def test_innermost_cuts_an_event_that_outlasts_its_parent():
    start, end = np.array([0.0, 10.0, 30.0]), np.array([50.0, 80.0, 40.0])
    outer, inner = innermost(start, end, np.array([0, 1, 0]), 2)
    assert inner.pairs() == [(10.0, 30.0), (40.0, 50.0)]
    assert outer.pairs() == [(0.0, 10.0), (30.0, 40.0)]


def test_stragglers_and_windows_are_exact(tmp_path):
    """Rank 1 launches its all-reduce 30 us after rank 0: rank 0 waited 30 us for it."""
    for rank, launch in ((0, 10), (1, 40)):
        events = [event("aten::mm", 0, 100, cat="cpu_op", tid=1), event("c10d::allreduce_", launch, 5, cat="cpu_op",
                                                                        tid=1)]
        write_trace(tmp_path / f"r{rank}.json", events, rank=rank, world=2)
    result = breakdown(load_run(tmp_path), windows=4)
    assert [(c.last_rank, c.waited_s, c.ranks) for c in result.collectives] == [(1, pytest.approx(30 * US), 2)]
    assert [(s.rank, s.last, s.joined) for s in result.stragglers] == [(1, 1, 1), (0, 0, 1)]
    assert result.stragglers[0].cost_s == pytest.approx(30 * US)
    assert result.edges == pytest.approx(np.linspace(0, 100 * US, 5))
    compute_windows = result.windows[:, :, CATEGORIES.index("compute")]
    comm_windows = result.windows[:, :, CATEGORIES.index("communication")]
    assert compute_windows[0] == pytest.approx([20 * US, 25 * US, 25 * US, 25 * US])
    assert comm_windows[1] == pytest.approx([0, 5 * US, 0, 0])


def test_traces_on_their_own_time_bases_are_aligned_and_keep_collective_names(tmp_path):
    """Rank 1's trace counts from 30 us later (baseTimeNanoseconds): its all-reduce, at the same offset,
    arrives 30 us after rank 0's, and the wait still names the collective."""
    for rank in (0, 1):
        events = [event("aten::mm", 0, 100, cat="cpu_op", tid=1), event("c10d::allreduce_", 10, 5, cat="cpu_op", tid=1)]
        write_trace(tmp_path / f"r{rank}.json", events, rank=rank, world=2, base_ns=10**12 + 30_000 * rank)
    result = breakdown(load_run(tmp_path))
    assert [(c.collective, c.last_rank, c.waited_s) for c in result.collectives] == \
        [("c10d::allreduce #0", 1, pytest.approx(30 * US))]


def assert_ranks(result, pinned: dict, span_abs_ms: float = 1e-3) -> None:
    """Each rank's span (ms) and compute, communication and idle shares and overlap (%) as pinned, and its
    categories adding up to its span."""
    for row in result.ranks:
        span, compute, comm, idle, overlap = pinned[row.rank]
        assert row.span_s * 1e3 == pytest.approx(span, abs=span_abs_ms)
        assert (row.share("compute"), row.share("communication"), row.share("idle"), row.overlap_pct) == \
            pytest.approx((compute, comm, idle, overlap), abs=0.01)
        assert sum(getattr(row, f"{c}_s") for c in CATEGORIES) == pytest.approx(row.span_s)


def test_ddp_gloo_profiler_traces_pinned():
    """tests/data/ddp-gloo: torch.profiler traces of a DDP run on gloo (tests/data/make_ddp_trace.py)."""
    run = load_run(DATA / "ddp-gloo")
    result = breakdown(run)
    assert run.kind == "kineto-cpu" and run.backend == "gloo" and run.world_size == 2
    assert run.iteration_s == pytest.approx([0.03447854, 0.03986715, 0.03983702], abs=1e-8)
    pinned = {0: (108.347, 71.05, 27.21, 1.74, 42.71), 1: (108.183, 73.30, 24.56, 2.15, 33.57)}
    assert_ranks(result, pinned)
    assert [(s.rank, s.last, s.joined) for s in result.stragglers] == [(1, 4, 9), (0, 5, 9)]
    assert result.stragglers[0].cost_s == pytest.approx(0.031092, abs=1e-6)
    phases = {p["phase"] for p in result.phases}
    assert phases == {"forward", "backward", "optimizer", "dp-sync"}


def test_fsdp_gloo_profiler_traces_pinned():
    """tests/data/fsdp-gloo: FSDP2 (fully_shard) on gloo: parameters all-gathered in the forward and backward,
    gradients reduce-scattered; the forward communicates most of its time."""
    result = breakdown(load_run(DATA / "fsdp-gloo"))
    assert result.run.iteration_s == pytest.approx([0.06608271, 0.06333404, 0.06229806], abs=1e-8)
    pinned = {0: (190.240, 64.74, 33.13, 2.13, 28.31), 1: (190.166, 65.99, 31.36, 2.65, 27.95)}
    assert_ranks(result, pinned)
    assert {c.collective.split(" #")[0] for c in result.collectives} == {"c10d::_allgather_base",
                                                                         "c10d::_reduce_scatter_base"}
    assert [(s.rank, s.last, s.joined) for s in result.stragglers] == [(0, 15, 27), (1, 12, 27)]
    forward = next(p for p in phase_summary(result) if p["phase"] == "forward")
    assert forward["communication_pct"] == pytest.approx(72.0, abs=0.1)


def test_trace_h5_fixture_pinned():
    """tests/data/pp2-trace.h5 (pp = 2, gloo): receives are communication, the rest of the steps compute."""
    result = breakdown(load_run(DATA / "pp2-trace.h5"))
    assert_ranks(result, {0: (1382.84, 69.75, 29.68, 0.56, 3.15), 1: (1348.29, 83.39, 6.47, 10.14, 0.76)},
                 span_abs_ms=1e-2)
    assert result.stragglers == []  # pp = 2 has no collective
    per_window = result.windows.sum(axis=2)
    assert per_window == pytest.approx(np.broadcast_to(np.diff(result.edges), per_window.shape))


def test_streaming_reader_matches_json_load_across_chunk_edges(tmp_path, monkeypatch):
    """Every chunk size from 1 to 60 characters: numbers, escapes, non-ASCII names and white space straddle the
    read window's edges somewhere."""
    events = [event(f'k{i % 7} "q\\ é', i * 3.5, 2.25e0, tid=i % 3) for i in range(40)]
    path = write_trace(tmp_path / "t.json", events, first_key="traceEvents")
    whole = json.loads(path.read_text())
    whole["x"] = -12.5e-3
    path.write_text(json.dumps(whole, indent=3))
    complete = [e for e in whole["traceEvents"] if e.get("ph") == "X"]
    for chunk in range(1, 61):
        monkeypatch.setattr(kineto, "CHUNK_CHARS", chunk)
        trace = kineto.read_kineto(path)
        assert len(trace.events) == len(complete), chunk
        assert trace.events.start_s == pytest.approx([e["ts"] * US for e in complete])
        assert [trace.events.names[c] for c in trace.events.name] == [e["name"] for e in complete]
        assert trace.rank == 0 and trace.metadata["x"] == -12.5e-3 and trace.metadata["traceName"] == str(path)
        assert trace.thread_names == {"1/7": "stream 7"}


@pytest.mark.parametrize("tail", ['1.', 'tru', '-', '"na'])
def test_a_trace_cut_inside_a_value_is_cut_short(tmp_path, tail):
    path = _bad(tmp_path, "rank-0.json", '{"traceEvents": [{"ph": "X", "ts": ' + tail)
    with pytest.raises(UserError, match="cut short"):
        kineto.read_kineto(path)


def test_json_output_has_the_documented_keys(capsys):
    assert main(["breakdown", str(DATA / "ddp-gloo"), "--json", "--windows", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"ranks", "windows", "phases", "stragglers", "summary", "collectives"} <= set(data)
    assert {"rank", "span_s", "compute_s", "communication_s", "memory_s", "idle_s", "overlap_pct"} <= set(
        data["ranks"][0])
    assert len(data["windows"]) == 2 * 5


def test_png_and_csv(tmp_path, capsys):
    png, csv = tmp_path / "b.png", tmp_path / "b.csv"
    assert main(["breakdown", str(DATA / "pp2-trace.h5"), "--png", str(png), "--csv", str(csv),
                 "--window-ms", "100"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = csv.read_text().splitlines()
    assert lines[0].split(",")[:3] == ["rank", "window", "start_s"]
    assert len(lines) == 1 + 2 + 2 * 14  # ranks, then 1.383 s in windows of 100 ms per rank
    assert "compute" in capsys.readouterr().out


def _bad(tmp_path, name: str, content: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


@pytest.mark.parametrize("name,content,message", [
    ("rank-0.json", "this is not json", "not a PyTorch profiler trace"),
    ("rank-0.json", '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2}, {"ph": "X"',
     "cut short"),
    ("rank-0.json", '{"schemaVersion": 1}', "no \"traceEvents\""),
    ("rank-0.json", '{"traceEvents": []}', "has no events"),
    ("trace.json", '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2}]}',
     "names no rank"),
    ("rank-0.json", '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2}]}',
     "mark no iteration"),
    ("rank-0.json.gz", gzip.compress(b'{"traceEvents": [')[:-6], "cannot read"),
    ("rank-0.json", '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": NaN}]}',
     "times must be finite"),
    ("rank-0.json", '{"distributedInfo": "x", "traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, '
     '"dur": 2}]}', "distributedInfo is str 'x', not an object"),
    ("rank-0.json", '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2, "args": '
     + "[" * 100000 + "]" * 100000 + "}]}", "maximum recursion depth"),
])
def test_bad_traces_get_one_message_and_exit_2(tmp_path, capsys, name, content, message):
    path = _bad(tmp_path, name, content)
    assert main(["breakdown", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_two_traces_of_one_rank_are_refused(tmp_path, capsys):
    for name in ("a.json", "b.json"):
        write_trace(tmp_path / name, [event("gemm", 0, 10)], rank=1, world=2)
    assert main(["breakdown", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 2
    assert "both claim rank 1" in capsys.readouterr().err


def test_missing_run_and_bad_windows(tmp_path, capsys):
    assert main(["breakdown", str(tmp_path / "nothing")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["breakdown", str(DATA / "pp2-trace.h5"), "--windows", "0"]) == 2
    assert "--windows" in capsys.readouterr().err
    for option, value, words in (("--windows", "1000000000", "windows over the run's"),
                                 ("--window-ms", "1e-9", "windows over the run's"),
                                 ("--window-ms", "nan", "--window-ms must be a positive number")):
        assert main(["breakdown", str(DATA / "pp2-trace.h5"), option, value]) == 2  # refused before any array
        assert words in capsys.readouterr().err
    with pytest.raises(UserError, match="neither a trace.h5"):
        load_runs([tmp_path])


def test_several_runs_print_one_after_another(capsys):
    assert main(["breakdown", str(DATA / "pp2-trace.h5"), str(DATA / "ddp-gloo"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "distsim-breakdown" and data["schema_version"] == 1
    assert [r["trace"] for r in data["runs"]] == ["trace.h5", "kineto-cpu"]
    assert to_json(breakdown(load_run(DATA / "ddp-gloo")))["summary"]["overlap_pct"] > 0


def test_a_trace_whose_rank_or_spec_is_not_what_the_writer_writes_is_refused(tmp_path, capsys):
    """A Kineto trace naming rank 'x', and a trace.h5 whose spec_json is not JSON or whose model is no table: one
    message each, exit 2."""
    import shutil

    import h5py

    bad_rank = write_trace(tmp_path / "rank-0.json", [event("volta_sgemm", 0, 100)], rank="x")
    assert main(["breakdown", str(bad_rank)]) == 2
    assert "distributedInfo.rank is 'x', not a whole number" in capsys.readouterr().err
    for name, text in (("not-json.h5", "{bad"), ("model-3.h5", '{"model": 3}')):
        copy = shutil.copy(DATA / "pp2-trace.h5", tmp_path / name)
        with h5py.File(copy, "r+") as f:
            f.attrs["spec_json"] = text
        assert main(["breakdown", str(copy)]) == 2
        assert "spec_json or layers_json is missing or not what docs/hdf5.md describes" in capsys.readouterr().err
    for name, column in (("nan-start.h5", "devices/rank-00000/start_s"), ("nan-iteration.h5", "iterations/end_s")):
        copy = shutil.copy(DATA / "pp2-trace.h5", tmp_path / name)
        with h5py.File(copy, "r+") as f:
            group, _, key = column.rpartition("/")
            f[group][key][0] = float("nan")  # the checksum kept whole: a number edited, not a damaged file
        assert main(["breakdown", str(copy)]) == 2
        assert f"{column} holds 1 time(s) that are not finite" in capsys.readouterr().err

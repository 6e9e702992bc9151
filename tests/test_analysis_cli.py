"""`python -m analysis simulate`: table, JSON, Perfetto trace, PNG and timeline HDF5; offline imports."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from analysis.cli import main
from analysis.profile_reader import parse_spec_offline
from analysis.timeline_file import read_timeline
from harness.plan.layers import LayerDesc
from harness.store.hdf5_schema import SENDER_BUSY_SERIES
from tests.test_analysis_helpers import REPO, by_name, comm_point, make_spec, run_python, write_handmade_profile

JSON_KEYS = {"schema_version", "batch_time_s", "throughput_samples_s", "throughput_tokens_s", "bubble_fraction",
             "devices", "stages", "extrapolated", "interpolated", "comm_held_out", "unmeasured", "fits",
             "p2p_sender_busy_extra", "p2p_send_post", "p2p_late_transfer_cpu",
             "compute_host_issue", "compute_backward_call", "dp_bucket_divide", "dp_bucket_zero", "compute_statistic",
             "replica_skew",
             "warnings"}
DEVICE_KEYS = {"rank", "stage", "dp", "tp", "compute_s", "comm_s", "idle_s", "overlapped_comm_s"}


@pytest.fixture(scope="module")
def hybrid_profile(tmp_path_factory):
    """dp=2 x tp=2 x pp=2 on 2 nodes of 4: P2P between nodes, TP and DP all-reduces within a node."""
    spec = make_spec(dp=2, tp=2, pp=2, micro_batches=4, nodes=2, bucket_mb=1e-6)
    times = {"gpt2.block.fwd": 2e-3, "gpt2.block.bwd": 4e-3, "gpt2.embedding.fwd": 5e-4, "gpt2.head.fwd": 1e-3,
             "p2p": None, "allreduce": 1e-4}
    extra = [comm_point("p2p", n, "inter", 2e-5 + n * 1e-10) for n in (2**10, 2**16, 2**20)]
    extra[0].series[SENDER_BUSY_SERIES] = np.array([1e-4, 3e-4])  # 2e-4 - 2.01e-5 beyond its own time
    return write_handmade_profile(tmp_path_factory.mktemp("hybrid") / "profile.h5", spec, by_name(times, 2e-4),
                                  extra, world_size=4)


def test_simulate_writes_trace_png_timeline_and_json(hybrid_profile, tmp_path, capsys):
    trace, png, out = tmp_path / "trace.json.gz", tmp_path / "gantt.png", tmp_path / "timeline.h5"
    assert main(["simulate", str(hybrid_profile), "--json", "--trace", str(trace), "--png", str(png),
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert JSON_KEYS <= set(report) and report["schema_version"] == 1
    assert report["compute_statistic"] == "mean"
    assert report["replica_skew"] is None  # a hand-made profile has no sample end times
    assert len(report["devices"]) == 8 and all(DEVICE_KEYS <= set(d) for d in report["devices"])
    T = report["batch_time_s"]
    assert T > 0 and report["throughput_samples_s"] == pytest.approx(8 / T)
    assert report["throughput_tokens_s"] == pytest.approx(8 / T * 16)
    for d in report["devices"]:
        assert d["compute_s"] + d["comm_s"] + d["idle_s"] == pytest.approx(T, rel=1e-12)
    assert report["bubble_fraction"] == pytest.approx(sum(d["idle_s"] for d in report["devices"]) / (8 * T))
    assert report["extrapolated"] == []  # the P2P lies between measured sizes of its placement
    (p2p,) = report["interpolated"]
    assert p2p["kind"] == "p2p" and p2p["source"] == "interpolated" and "measured" in p2p["note"]
    assert [f["kind"] for f in report["fits"]] == ["allreduce", "p2p"]

    document = json.loads(gzip.decompress(trace.read_bytes()))
    events = document["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == set(range(8))
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert all(names[pid, 0] == "compute" and names[pid, 1] == "communication" for pid in range(8))
    assert any(e["name"] == "F gpt2.block.fwd L1 s0 mb2" for e in complete)
    by_thread = defaultdict(list)
    for e in complete:
        by_thread[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():  # slices within a thread never overlap partially
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - 1e-6
    flows = defaultdict(dict)
    for e in events:
        if e["ph"] in ("s", "f"):
            flows[e["id"]][e["ph"]] = e
    assert len(flows) == 2 * 4 * 4  # per micro-batch, one activation and one gradient per (dp, tp) pair
    for pair in flows.values():
        assert pair["s"]["pid"] != pair["f"]["pid"] and pair["f"]["bp"] == "e"

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    timeline = read_timeline(out)
    assert timeline["attrs"]["schema_version"] == 2 and timeline["attrs"]["kind"] == "distsim-timeline"
    assert timeline["attrs"]["batch_time_s"] == pytest.approx(T)
    assert sorted(timeline["devices"]) == list(range(8))
    rank5 = timeline["devices"][5]
    assert rank5["attrs"]["stage"] == 1 and len(rank5["start_s"]) == len(rank5["name"]) > 0
    assert (rank5["end_s"] >= rank5["start_s"]).all() and rank5["end_s"].max() <= T * (1 + 1e-12)


def test_table_output_and_device_selection(hybrid_profile, capsys):
    assert main(["simulate", str(hybrid_profile), "--no-overlap"]) == 0
    out = capsys.readouterr().out
    # the answer first, the model's corrections only on request
    for text in ("batch time", "samples/s", "tokens/s", "bubble", "per pipeline stage", "after the backward",
                 "1 interpolated between measured sizes (--details)"):
        assert text in out
    for text in ("per device:", "communication fits", "while the sender computes", "probe / ranks' mean"):
        assert text not in out
    assert out.splitlines()[1].startswith("batch time")
    assert main(["simulate", str(hybrid_profile), "--no-overlap", "--details", "--devices", "0-1"]) == 0
    out = capsys.readouterr().out
    for text in ("per device:", "interpolated: 1 events", "communication fits", "while the sender computes"):
        assert text in out
    assert main(["simulate", str(hybrid_profile), "--json", "--devices", "stages"]) == 0
    report = json.loads(capsys.readouterr().out)
    (busy,) = report["p2p_sender_busy_extra"]  # the one P2P event of the job, unmeasured: the inter extra
    assert busy["name"].startswith("p2p") and busy["extra_s"] == pytest.approx(2e-4 - (2e-5 + 2**10 * 1e-10))
    assert [d["rank"] for d in report["devices"]] == [0, 4] and report["devices_selection"] == "stages"
    assert main(["simulate", str(hybrid_profile), "--json", "--devices", "1,5-6"]) == 0
    assert [d["rank"] for d in json.loads(capsys.readouterr().out)["devices"]] == [1, 5, 6]
    assert main(["simulate", str(hybrid_profile), "--devices", "3-8"]) == 2
    assert "outside the job's ranks 0..7" in capsys.readouterr().err


def test_the_report_shows_how_long_a_replica_averages_and_zeroes_its_gradient_buckets(tmp_path, capsys):
    spec = make_spec(dp=2, micro_batches=2, bucket_mb=1000)
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({}, 1e-3), divide=[2e-3, 2e-3],
                                  zero=[1.5e-3, 1.5e-3])
    assert main(["simulate", str(path), "--details"]) == 0
    out = capsys.readouterr().out
    assert "averages each gradient bucket" in out and "zero ms" in out
    assert main(["simulate", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (divide,), (zero,) = report["dp_bucket_divide"], report["dp_bucket_zero"]
    assert divide["name"].startswith("allreduce") and divide["divide_s"] == pytest.approx(2e-3)
    assert zero["id"] == divide["id"] and zero["zero_s"] == pytest.approx(1.5e-3)


def test_the_report_shows_how_long_a_sending_step_posts_its_send(tmp_path, capsys):
    path = write_handmade_profile(tmp_path / "profile.h5", make_spec(pp=2, micro_batches=2), by_name({}, 1e-3),
                                  send_post=[3e-4, 5e-4])
    assert main(["simulate", str(path), "--details"]) == 0
    assert "post the send for" in capsys.readouterr().out
    assert main(["simulate", str(path), "--json"]) == 0
    (post,) = json.loads(capsys.readouterr().out)["p2p_send_post"]
    assert post["name"].startswith("p2p") and post["post_s"] == pytest.approx(4e-4)


def test_large_worlds_default_to_one_device_per_stage(tmp_path, capsys):
    path = write_handmade_profile(tmp_path / "profile.h5", make_spec(pp=2, micro_batches=2), by_name({}, 1e-3))
    assert main(["simulate", str(path), "--json", "--strategy", "dp=1024,global=2048",
                 "--trace", str(tmp_path / "t.json")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world"] == 2048 and report["devices_selection"] == "stages"
    assert [d["rank"] for d in report["devices"]] == [0, 1024]
    trace = json.loads((tmp_path / "t.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1024}


def test_offline_run_loads_neither_torch_nor_mpi4py(tmp_path):
    """A user model's profile: simulating it imports neither torch, mpi4py, nor the model's module."""
    data = {"model": {"factory": "tests.user_model:build", "layers": 4, "hidden": 32, "seq_len": 16,
                      "vocab": 128},
            "batch": {"global": 4, "micro": 1}, "strategy": {"pp": 2}, "cluster": {"gpus_per_node": 2}}
    spec = parse_spec_offline(data, source="test")

    def layer(name, params, index):
        return LayerDesc(kind="user", signature=(("family", "user"), ("class", name), ("dtype", "float32")),
                         params=params, fwd_flops_per_token=2.0 * params, out_features=(32,), index=index)

    layers = [layer("Embed", 4096, 0), layer("Mixer", 4192, 1), layer("Mixer", 4192, 1), layer("Linear", 4224, 3)]
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({}, 1e-3), layers=layers)
    # `python -m analysis` as runpy runs it, then a look at what got imported
    script = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["analysis", "simulate", {str(path)!r}, "--json", "--trace", {str(tmp_path / 't.json.gz')!r},
                    "--out", {str(tmp_path / 't.h5')!r}, "--png", {str(tmp_path / 't.png')!r}]
        try:
            runpy.run_module("analysis", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            status = exit.code
        loaded = sorted(m for m in ("torch", "mpi4py", "tests.user_model", "harness.models", "harness.profile",
                                  "harness.train", "launcher")
                        if m in sys.modules)
        print("LOADED", loaded, file=sys.stderr)
        sys.exit(status or (3 if loaded else 0))
    """)
    result = run_python(script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stderr
    report = json.loads(result.stdout)
    assert report["model"] == "tests.user_model:build" and len(report["devices"]) == 2


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["simulate", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert all(option in out for option in ("--spec", "--strategy", "--no-overlap", "--devices", "--trace", "--png"))


def test_unwritable_outputs_are_bad_input(tmp_path):
    from tests.test_analysis_helpers import by_name, make_spec, run_python, write_handmade_profile

    profile_path = write_handmade_profile(tmp_path / "profile.h5", make_spec(pp=2), by_name({}, default=1e-3))
    blocker = tmp_path / "file"
    blocker.write_text("")
    for option, name in (("--trace", "x.json"), ("--png", "x.png"), ("--out", "x.h5")):
        result = run_python(f"import sys; from analysis.cli import main; "
                            f"sys.exit(main(['simulate', {str(profile_path)!r}, {option!r}, {str(blocker / name)!r}]))")
        assert result.returncode == 2 and "cannot write" in result.stderr and "Traceback" not in result.stderr


def test_no_output_is_written_over_an_input(tmp_path, capsys):
    """Every subcommand's outputs are checked against its inputs before its work (harness.common.subcommands):
    the profile a prediction reads is never replaced by its CSV or timeline, and a search's long work never ends
    in a folder given as its PNG."""
    from harness.commands.cli import main as harness_main
    from tests.test_analysis_helpers import by_name, make_spec, write_handmade_profile

    profile_path = write_handmade_profile(tmp_path / "profile.h5", make_spec(pp=2), by_name({}, default=1e-3))
    (tmp_path / "folder.png").mkdir()
    before = profile_path.read_bytes()
    for argv in (["simulate", str(profile_path), "--out", str(profile_path)],
                 ["simulate", str(profile_path), "--csv", str(profile_path)],
                 ["search", str(profile_path), "--csv", str(profile_path)],
                 ["search", str(profile_path), "--png", str(tmp_path / "folder.png")],
                 ["simulate", str(profile_path), "--csv", ""]):
        assert main(argv) == 2, argv
    assert harness_main(["show", str(profile_path), "--csv", str(profile_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("which this command reads; writing it would lose it") == 4 and "Traceback" not in err
    assert "it is a folder" in err and "--csv: the file name is empty" in err
    assert profile_path.read_bytes() == before


def test_gpu_host_issue_times_shape_the_prediction_and_are_shown(tmp_path, capsys):
    spec = make_spec(micro_batches=2, layers=2)
    durations = by_name({}, default=1e-3)
    plain = write_handmade_profile(tmp_path / "plain.h5", spec, durations)
    gpu = write_handmade_profile(tmp_path / "gpu.h5", spec, durations, host_issue={"gpt2.head.bwd": [3e-3]})
    both = write_handmade_profile(tmp_path / "both.h5", spec, durations,
                                  host_issue={"gpt2.block.fwd": [0.5e-3], "gpt2.head.bwd": [3e-3]})
    assert main(["simulate", str(plain), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert before["compute_host_issue"] == []
    assert main(["simulate", str(gpu), "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    (row,) = after["compute_host_issue"]
    assert row["name"] == "gpt2.head.bwd" and row["host_issue_s"] == pytest.approx(3e-3)
    assert row["device_s"] == pytest.approx(1e-3)
    # the head's backward opens each of the 2 backward steps: the device waits 2 ms for its issue each time
    assert after["batch_time_s"] == pytest.approx(before["batch_time_s"] + 2 * 2e-3)
    assert main(["simulate", str(gpu), "--details"]) == 0
    assert "host issue ms" in capsys.readouterr().out
    # the table lists the launch-bound layer (the host slower than the device) first
    assert main(["simulate", str(both), "--details"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if "host issue ms" in line) + 2:][:2]
    assert "gpt2.head.bwd" in table[0] and table[0].endswith("host")
    assert "gpt2.block.fwd" in table[1] and table[1].endswith("device")


def test_simulate_takes_the_median_when_asked(hybrid_profile, capsys):
    assert main(["simulate", str(hybrid_profile), "--json", "--compute-stat", "median"]) == 0
    assert json.loads(capsys.readouterr().out)["compute_statistic"] == "median"


def test_output_cut_short_by_its_reader_ends_quietly(hybrid_profile):
    """`python -m analysis simulate ... | head`: the reader goes away, the tool stops with SIGPIPE's status and
    no traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen([sys.executable, "-m", "analysis", "simulate", str(hybrid_profile), "--json"],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # gone before the first line is written
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141, stderr
    assert stderr == ""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_output_to_a_full_device_is_one_message(hybrid_profile):
    """Standard output on a full device (/dev/full): one message, exit 1, no traceback and nothing from the
    interpreter's own final flush."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "analysis", "simulate", str(hybrid_profile), "--json"],
                                cwd=REPO, env=env, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().endswith("free some space where standard output goes, or send it elsewhere")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


@pytest.mark.parametrize("devices, words", [("3-1", "3-1 runs backwards; write the range low-high, e.g. 1-3")])
def test_a_backwards_device_range_is_said(tmp_path, capsys, devices, words):
    from tests.test_analysis_helpers import by_name, make_spec, write_handmade_profile

    path = write_handmade_profile(tmp_path / "profile.h5", make_spec(pp=2), by_name({}, default=1e-3))
    assert main(["simulate", str(path), "--devices", devices]) == 2
    assert words in capsys.readouterr().err

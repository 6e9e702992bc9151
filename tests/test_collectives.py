"""The collective benchmark: nccl-tests' definitions, the check of outputs, the file, and both commands as
users run them (under mpirun, with bad input)."""
from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from harness.common.errors import UserError
from harness.plan.collectives import (
    OPS,
    SizeResult,
    average_busbw,
    bus_factor,
    expected_output,
    input_values,
    parse_size,
    round_size,
    sweep_sizes,
)
from harness.store.collectives_file import CollectivesRun, read_collectives, write_collectives
from harness.store.hdf5_io import plain
from tests.conftest import ROOT
from tests.helpers import mpirun_harness


def test_bus_factors_are_nccl_tests():
    assert bus_factor("allreduce", 8) == pytest.approx(2 * 7 / 8)
    for op in ("allgather", "reducescatter", "alltoall"):
        assert bus_factor(op, 4) == pytest.approx(0.75)
    assert bus_factor("broadcast", 16) == bus_factor("sendrecv", 16) == 1.0


def test_bandwidths_from_the_mean_of_the_slowest_rank():
    r = SizeResult("allreduce", 1_000_000, "float32", 4, np.array([1e-3, 3e-3]), 0)
    assert r.mean_s == pytest.approx(2e-3)
    assert r.algbw_gbs == pytest.approx(0.5)  # 1e6 B / 2 ms = 0.5 GB/s (GB = 1e9)
    assert r.busbw_gbs == pytest.approx(0.5 * 1.5)
    row = r.row()
    assert row["count"] == 250_000 and row["time_us"] == pytest.approx(2000) and row["min_us"] == pytest.approx(1000)
    assert average_busbw([r, SizeResult("allreduce", 2_000_000, "float32", 4, np.array([1e-3]), 0)]) == \
        pytest.approx((0.75 + 3.0) / 2)


def test_sizes_as_nccl_tests_reads_them():
    assert parse_size("8", "-b") == 8 and parse_size("64K", "-b") == 65536 and parse_size("64M", "-e") == 64 << 20
    assert parse_size("1g", "-e") == 1 << 30
    assert sweep_sizes(8, 64, 2) == [8, 16, 32, 64]
    assert sweep_sizes(8, 100, 4) == [8, 32, 100]  # the largest size closes the sweep
    assert sweep_sizes(1024, 1024, 2) == [1024]
    for bad in ("x", "-4", "0", "1.5M"):
        with pytest.raises(UserError, match="size"):
            parse_size(bad, "-b")
    with pytest.raises(UserError, match="above the largest"):
        sweep_sizes(64, 8, 2)
    with pytest.raises(UserError, match="more than 10,000; give a larger factor"):  # not a sweep without end
        sweep_sizes(8, 1 << 30, 1.0000000001)
    assert sweep_sizes(1, 100, 1.0000000001) == list(range(1, 101))  # every whole byte, at once
    with pytest.raises(UserError, match="above 1"):
        sweep_sizes(8, 64, 1)


def test_sizes_rounded_to_whole_elements_per_rank():
    assert round_size("allreduce", 9, "float32", 4) == 8
    assert round_size("allreduce", 10, "float32", 4) == 12  # halves up
    assert round_size("allreduce", 2, "float32", 4) == 4  # at least one element
    assert round_size("allgather", 40, "float32", 4) == 48  # 16-byte units: 40 -> nearest 48
    assert round_size("alltoall", 8, "float64", 3) == 24
    assert round_size("broadcast", 6, "float16", 4) == 6


def _simulate(op: str, ranks: int, elements: int) -> list[np.ndarray]:
    """Every rank's output of `op` computed the obvious way from every rank's input: the reference the
    check's expected outputs must equal."""
    share = elements // ranks
    inputs = [input_values(q, share if op == "allgather" else elements) for q in range(ranks)]
    if op == "allreduce":
        return [np.sum(inputs, axis=0)] * ranks
    if op == "allgather":
        return [np.concatenate(inputs)] * ranks
    if op == "reducescatter":
        total = np.sum(inputs, axis=0)
        return [total[r * share:(r + 1) * share] for r in range(ranks)]
    if op == "broadcast":
        return [inputs[0]] * ranks
    if op == "alltoall":
        return [np.concatenate([inputs[q][r * share:(r + 1) * share] for q in range(ranks)]) for r in range(ranks)]
    return [inputs[(r - 1) % ranks] for r in range(ranks)]  # sendrecv: from the previous rank


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_expected_outputs_match_the_operations(op, ranks):
    for r, output in enumerate(_simulate(op, ranks, 12 * ranks)):
        np.testing.assert_array_equal(expected_output(op, r, ranks, 12 * ranks), output)


def test_check_counts_wrong_elements():
    from harness.profile.collectives import CollectiveBench

    class _Comm:
        def Get_size(self):
            return 2

        def Get_rank(self):
            return 0

    bench = CollectiveBench(_Comm(), (0, 1), "mpi4py", "float32")
    expected = expected_output("allreduce", 0, 2, 8)
    got = expected.copy()
    assert bench._count_wrong(got, expected) == 0
    got[[1, 5]] += 1
    assert bench._count_wrong(got, expected) == 2


def _run(tmp_path) -> CollectivesRun:
    results = {"allreduce": [SizeResult("allreduce", 8, "float32", 2, np.array([2e-5, 3e-5, 4e-5]), 0),
                             SizeResult("allreduce", 1024, "float32", 2, np.array([5e-5, 5e-5, 6e-5]), 1)]}
    return CollectivesRun(tmp_path / "c.h5", "torch-gloo", "all", "intra", [0, 1], "float32", 3, 1, results,
                          {"hosts": ["a"], "world_size": 2})


def test_file_round_trip(tmp_path):
    run = _run(tmp_path)
    write_collectives(run.path, run)
    back = read_collectives(run.path)
    assert back.summary() == run.summary() and back.environment == run.environment
    assert [(r.nbytes, r.wrong) for r in back.results["allreduce"]] == [(8, 0), (1024, 1)]
    np.testing.assert_array_equal(back.results["allreduce"][1].samples_s, [5e-5, 5e-5, 6e-5])
    with h5py.File(run.path) as f:
        assert plain(f.attrs["kind"]) == "distsim-collectives" and f["ops/allreduce/samples_s"].fletcher32


def test_a_file_is_written_into_folders_it_makes(tmp_path):
    """As every writer here does (CSV, charts, traces), an HDF5 file's missing folders are made."""
    run = _run(tmp_path)
    deep = tmp_path / "a" / "b" / "bench.h5"
    write_collectives(deep, run)
    assert read_collectives(deep).results.keys() == run.results.keys()


def test_an_output_that_cannot_be_a_file_is_refused_before_measuring(tmp_path, project_env):
    """A folder, a path under a file, a name not ending in .h5, and a file of another kind (a run's trace: what it
    measured would be replaced) are refused before measuring, by rank 0 alone; the trace is left as it was."""
    import shutil

    (tmp_path / "plain").write_text("a file")
    trace = tmp_path / "trace.h5"
    shutil.copy(ROOT / "tests" / "data" / "pp2-trace.h5", trace)
    before = trace.read_bytes()
    (tmp_path / "folder.h5").mkdir()
    for output, message in ((tmp_path / "folder.h5", "it is a folder; give a file name in it"),
                            (tmp_path / "plain" / "x.h5", "is a file, not a folder"),
                            (tmp_path / "results.toml", "give a name ending in .h5"),
                            (trace, "exists and is a real run's trace")):
        result = mpirun_harness(2, ["collectives", "-o", str(output)], project_env, timeout=120)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and "allreduce" not in result.stdout  # nothing was measured
        assert result.stderr.count("error:") == 1, result.stderr  # the ranks agree (or parse alike): rank 0 says it
    assert trace.read_bytes() == before


def test_analysis_refuses_other_files(tmp_path, project_env):
    profile = ROOT / "tests" / "data" / "pp2-profile.h5"
    result = subprocess.run([sys.executable, "-m", "analysis", "collectives", str(profile)], capture_output=True,
                            text=True, env=project_env)
    assert result.returncode == 2 and "collective benchmark" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["-b", "1M", "-e", "8"], "above the largest"),
    (["-f", "1"], "above 1"),
    (["--ops", "allreduce,gossip"], "unknown operation(s) gossip"),
    (["--backend", "carrier-pigeon"], "unknown backend"),
    (["--backend", "ucc"], "not built into this torch"),
    (["--backend", "mpi4py", "--dtype", "bfloat16"], "cannot go through mpi4py"),
    (["--backend", "mpi4py", "--device", "cuda"], "times numpy buffers in host memory"),
    (["--dtype", "complex32"], "unknown type"),
    (["--iters", "0"], "--iters 0"),
    (["--group", "inter"], "needs ranks on 2 or more nodes"),
    (["--group", "sideways"], "unknown --group"),
])
def test_bad_input_is_one_message(project_env, args, message):
    result = mpirun_harness(2, ["collectives", *args], project_env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("error:") == 1  # rank 0 alone says it


def test_one_rank_is_bad_input(project_env):
    result = subprocess.run([sys.executable, "-m", "harness", "collectives"], capture_output=True, text=True,
                            env=project_env, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and "needs 2 or more ranks" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("backend", ["torch", "mpi4py"])
def test_benchmark_end_to_end(tmp_path, project_env, backend):
    out = tmp_path / f"{backend}.h5"
    result = mpirun_harness(2, ["collectives", "--backend", backend, "-b", "10", "-e", "4K", "-f", "8", "--iters", "3",
                                "--warmup", "1", "-o", str(out), "--json", "--quiet"], project_env, timeout=180)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["backend"] == ("torch-gloo" if backend == "torch" else "mpi4py") and doc["wrong"] == 0
    assert doc["ranks"] == [0, 1] and doc["placement"] == "intra" and list(doc["ops"]) == list(OPS)
    allgather = doc["ops"]["allgather"]["rows"]
    assert [r["bytes"] for r in allgather] == [8, 80, 640, 4096]  # 10 B rounded to 8-byte units (2 ranks)
    assert "allgather: 1 size(s) rounded to whole float32 elements per rank (2 ranks): 10 -> 8 B" in doc["notes"]
    assert [r["bytes"] for r in doc["ops"]["allreduce"]["rows"]][0] == 12
    for op, entry in doc["ops"].items():
        for row in entry["rows"]:
            assert 0 < row["min_us"] <= row["median_us"] <= row["max_us"] and row["count"] * 4 == row["bytes"]
            assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * bus_factor(op, 2))
    run = read_collectives(out)
    assert run.environment["world_size"] == 2 and run.environment["backend"] == doc["backend"]
    assert run.iters == 3 and all(r.samples_s.size == 3 for r in run.results["allreduce"])
    # the analysis prints the same table; two files side by side, and a picture
    table = subprocess.run([sys.executable, "-m", "analysis", "collectives", str(out)], capture_output=True,
                           text=True, env=project_env)
    assert table.returncode == 0 and "avg bus bandwidth (GB/s): allreduce" in table.stdout
    assert "every output checked and right" in table.stdout


def test_analysis_side_by_side(tmp_path, project_env):
    first = _run(tmp_path)
    write_collectives(first.path, first)
    second = CollectivesRun(tmp_path / "d.h5", "mpi4py", "all", "intra", [0, 1], "float32", 3, 1,
                            {"allreduce": [SizeResult("allreduce", 1024, "float32", 2, np.array([1e-5] * 3), 0)]})
    write_collectives(second.path, second)
    png, csv = tmp_path / "bw.png", tmp_path / "bw.csv"
    result = subprocess.run([sys.executable, "-m", "analysis", "collectives", str(first.path), str(second.path),
                             "--png", str(png), "--csv", str(csv)], capture_output=True, text=True, env=project_env)
    assert result.returncode == 0, result.stderr
    assert "torch-gloo x2 intra" in result.stdout and "mpi4py x2 intra" in result.stdout
    assert png.stat().st_size > 1000
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("op,size B,torch-gloo x2 intra us") and len(lines) == 3
    assert lines[1].startswith("allreduce,8,") and lines[1].endswith(",,")  # mpi4py did not measure 8 B
    doc = json.loads(subprocess.run([sys.executable, "-m", "analysis", "collectives", str(first.path),
                                     str(second.path), "--json"], capture_output=True, text=True,
                                    env=project_env).stdout)
    assert [r["backend"] for r in doc["runs"]] == ["torch-gloo", "mpi4py"]
    assert doc["runs"][0]["ops"]["allreduce"]["wrong"] == 1
    twice = subprocess.run([sys.executable, "-m", "analysis", "collectives", str(first.path), str(first.path)],
                           capture_output=True, text=True, env=project_env)
    assert twice.returncode == 2 and "given twice" in twice.stderr


def test_benchmark_groups_from_the_topology():
    from launcher.placement import benchmark_group
    from launcher.topology import Topology

    two_nodes = Topology(0, 4, (0, 0, 1, 1), ("a", "a", "b", "b"))
    assert benchmark_group(two_nodes, "all") == ((0, 1, 2, 3), "inter")
    assert benchmark_group(two_nodes, "intra") == ((0, 1), "intra")
    assert benchmark_group(two_nodes, "inter") == ((0, 2), "inter")  # every link crosses nodes
    one_node = Topology(0, 3, (0, 0, 0), ("a",) * 3)
    assert benchmark_group(one_node, "all") == ((0, 1, 2), "intra")
    with pytest.raises(UserError, match="needs ranks on 2 or more nodes"):
        benchmark_group(one_node, "inter")
    lonely = Topology(0, 3, (0, 1, 1), ("a", "b", "b"))  # rank 0 alone on its node
    assert benchmark_group(lonely, "intra") == ((1, 2), "intra")
    with pytest.raises(UserError, match="a node with 2 or more ranks"):
        benchmark_group(Topology(0, 2, (0, 1), ("a", "b")), "intra")


def test_a_benchmark_joins_a_profile_for_curves_and_fits(tmp_path, capsys):
    """`simulate --collectives`: the benchmark's all-reduce points at its placement and rank count bracket the
    bucket the profile left unmeasured, which is then interpolated on them; another backend is refused."""
    from analysis.cli import main as analysis_main
    from analysis.predict import predict
    from tests.test_analysis_costs import dp_profile

    profile = dp_profile(tmp_path, [])  # its all-reduces left out; environment backend "test", device "cpu"
    (bucket,) = predict(profile).plan.stages[0].buckets
    sizes = (bucket.nbytes // 8, bucket.nbytes * 8)
    results = {"allreduce": [SizeResult("allreduce", n, "float32", 2, np.array([n * 1e-9] * 3), 0) for n in sizes],
               "broadcast": [SizeResult("broadcast", 64, "float32", 2, np.array([1e-5] * 3), 0)]}
    bench = CollectivesRun(tmp_path / "bench.h5", "test", "all", "intra", [0, 1], "float32", 3, 1, results,
                           {"device": "cpu"})
    write_collectives(bench.path, bench)
    costs = predict(profile, collectives=[bench.path]).costs
    cost = costs.events[bucket.event]
    assert cost.source == "interpolated" and cost.seconds == pytest.approx(bucket.nbytes * 1e-9, rel=1e-9)
    assert costs.fits[("allreduce", "intra")].points == 2
    other = CollectivesRun(tmp_path / "other.h5", "mpi4py", "all", "intra", [0, 1], "float32", 3, 1, results,
                           {"device": "cpu"})
    write_collectives(other.path, other)
    assert analysis_main(["simulate", str(profile), "--collectives", str(other.path)]) == 2
    assert "measured with mpi4py on cpu" in capsys.readouterr().err

"""analysis validate: errors computed right on a hand-made trace, and the real pipeline end to end."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.predict import predict
from analysis.profile_reader import load_profile
from analysis.trace_reader import read_trace
from analysis.validate import environment_differences, replay_stage_costs, validate
from harness.train.trace_writer import merge_traces, write_rank_trace
from tests.conftest import ROOT
from tests.helpers import write_spec
from tests.test_analysis_helpers import by_name, make_spec, write_handmade_profile

MPIRUN = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")


def _columns(rows):
    names = ("start_s", "end_s", "wait_s", "kind", "name", "phase", "event_id", "virtual_stage", "micro", "iteration",
             "peer")
    cols = {n: np.array([r[i] for r in rows], dtype=object if n in ("kind", "name", "phase", "event_id") else None)
            for i, n in enumerate(names)}
    for n in ("virtual_stage", "micro", "iteration", "peer"):
        cols[n] = cols[n].astype(np.int64)
    return cols


def write_trace(path: Path, timeline, per_rank: dict, starts: np.ndarray, length: float, loss_rank: int) -> Path:
    """trace.h5 of `timeline`'s spec: `per_rank` maps rank -> (interval rows, (dp, tp, pp), layer columns or
    None); every rank's iterations start at `starts` and last `length`; iteration 0 is warm-up."""
    files = [write_rank_trace(path.parent / f"rank-{rank:05d}.trace.h5", rank=rank, columns=_columns(rows),
                              attrs={"dp": dp, "tp": tp, "pp": pp},
                              iterations={"start_s": starts, "end_s": starts + length, "loss": np.zeros(len(starts))},
                              layers=layers)
             for rank, (rows, (dp, tp, pp), layers) in per_rank.items()]
    layers_json = json.dumps([layer.to_dict() for layer in timeline.plan.layers])
    return merge_traces(path, files, root_attrs={"spec_json": timeline.spec.to_json(), "layers_json": layers_json},
                        environment={"world_size": len(per_rank)}, clock={"rank": np.arange(len(per_rank))},
                        warmup=1, loss_ranks=[loss_rank])


def write_scaled_trace(path: Path, timeline, factor: float, iterations: int = 3) -> Path:
    """A trace whose every iteration is the predicted one stretched by `factor` (iteration 0 is warm-up)."""
    period = timeline.batch_time_s * factor * 1.5
    per_rank = {}
    for stage, device in enumerate(timeline.pipeline):
        rows = []
        for it in range(iterations):
            zero = it * period
            for r in device.steps:
                rows.append((zero + r.start_s * factor, zero + r.end_s * factor, 0.0, "compute",
                             f"{r.phase} s{r.virtual_stage} mb{r.micro}", r.phase, "", r.virtual_stage, r.micro, it,
                             -1))
            rows.append((zero + device.optimizer_start_s * factor, zero + device.optimizer_end_s * factor, 0.0,
                         "optimizer", "optimizer", "opt", "", stage, -1, it, -1))
        per_rank[stage] = (rows, (0, 0, stage), None)
    return write_trace(path, timeline, per_rank, np.arange(iterations) * period, timeline.batch_time_s * factor,
                       loss_rank=len(per_rank) - 1)


@pytest.mark.parametrize("factor", [1.0, 1.25, 0.8])
def test_errors_are_computed_right(tmp_path, factor):
    spec = make_spec(pp=2, micro_batches=4, layers=4)
    profile_path = write_handmade_profile(tmp_path / "profile.h5", spec,
                                          by_name({"compute": 1e-3, "p2p": 2e-4}, default=5e-4))
    timeline = predict(profile_path).timeline
    trace = read_trace(write_scaled_trace(tmp_path / "trace.h5", timeline, factor))
    result = validate(trace, load_profile(profile_path))
    expected = (1 / factor - 1) * 100
    assert result.measured_batch_s == pytest.approx(timeline.batch_time_s * factor)
    assert result.batch_time_error_pct == pytest.approx(expected, abs=1e-6)
    assert result.device_error_pct == pytest.approx(abs(expected), abs=1e-6)
    assert len(result.steps) == 2 * 2 * 4  # (F, B) x 2 stages x 4 micro-batches
    assert all(row["error_pct"] == pytest.approx(expected, abs=1e-6) for row in result.steps)
    report = result.to_dict()
    assert report["measured_iterations"] == 2  # warm-up excluded
    # neither handmade file recorded how its ranks were bound
    assert report["cpu_binding"] == {"profile": "unknown", "run": "unknown"}


@pytest.mark.parametrize("factor", [1.0, 1.25, 0.8])
def test_the_replay_of_a_runs_own_compute_leaves_the_timeline_models_own_error(tmp_path, factor):
    """Without communication between steps, a run that is the prediction stretched is replayed exactly from
    its own compute: the timeline model's error is nil and the whole batch-time error is the compute costs'."""
    spec = make_spec(pp=2, micro_batches=4, layers=4)
    profile_path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({"compute": 1e-3}, default=0.0))
    timeline = predict(profile_path).timeline
    result = validate(read_trace(write_scaled_trace(tmp_path / "trace.h5", timeline, factor)),
                      load_profile(profile_path))
    assert result.replay_batch_s == pytest.approx(timeline.batch_time_s * factor)
    assert result.replay_error_pct == pytest.approx(0.0, abs=1e-6)
    assert result.compute_cost_error_pct == pytest.approx(result.batch_time_error_pct, abs=1e-6)
    report = result.to_dict()
    assert report["replay_batch_time_s"] == result.replay_batch_s
    assert report["replay_error_pct"] + report["compute_cost_error_pct"] == pytest.approx(
        report["batch_time_error_pct"])


def test_the_replay_takes_each_stages_steps_and_optimizer_as_the_run_measured_them(tmp_path):
    spec = make_spec(pp=2, micro_batches=2, layers=4)
    profile_path = write_handmade_profile(tmp_path / "profile.h5", spec,
                                          by_name({"compute": 1e-3, "p2p": 2e-4}, default=5e-4))
    timeline = predict(profile_path).timeline
    slower = {0: 1.0, 1: 2.0}  # stage 1 ran its steps and its optimizer twice as long as predicted
    inline = 1e-4  # a tensor-parallel all-reduce inside each of stage 0's forward steps
    iterations, per_rank = 3, {}
    for stage, device in enumerate(timeline.pipeline):
        rows, f = [], slower[stage]
        for it in range(iterations):
            zero = it * 10 * timeline.batch_time_s
            for r in device.steps:
                start = zero + r.start_s
                rows.append((start, start + (r.end_s - r.start_s) * f, 0.0, "compute", "step", r.phase, "",
                             r.virtual_stage, r.micro, it, -1))
                if stage == 0 and r.phase == "F":
                    rows.append((start + 1e-5, start + 1e-5 + inline, inline, "allreduce", "tp.allreduce.fwd", "tp",
                                 "", r.virtual_stage, r.micro, it, -1))
            opt = zero + device.optimizer_start_s
            rows.append((opt, opt + (device.optimizer_end_s - device.optimizer_start_s) * f, 0.0, "optimizer",
                         "optimizer", "opt", "", stage, -1, it, -1))
        per_rank[stage] = (rows, (0, 0, stage), None)
    trace = read_trace(write_trace(tmp_path / "trace.h5", timeline, per_rank,
                                   np.arange(iterations) * 10 * timeline.batch_time_s, timeline.batch_time_s, 1))
    replayed = replay_stage_costs(trace, timeline, trace.measured())
    for vs, (before, after) in enumerate(zip(timeline.stage_costs, replayed)):
        f = slower[vs]
        assert after.forward_s == pytest.approx(before.forward_s * f)
        assert after.backward_s == pytest.approx(before.backward_s * f)
        assert after.forward_offsets == pytest.approx([o * f for o in before.forward_offsets])
        assert after.backward_offsets == pytest.approx([o * f for o in before.backward_offsets])
        assert after.optimizer_s == pytest.approx(before.optimizer_s * f)
        assert after.forward_comm_s == pytest.approx(inline if vs == 0 else before.forward_comm_s * f)
        # what passes between the steps stays as the profile has it
        assert (after.send_forward_s, after.send_backward_s) == (before.send_forward_s, before.send_backward_s)
    result = validate(trace, load_profile(profile_path))
    assert result.replay_batch_s > timeline.batch_time_s  # stage 1, the pipeline's last, got slower


def test_the_replay_leaves_the_buckets_division_to_the_buckets(tmp_path):
    """With the all-reduce overlapped, the trainer divides the buckets inside the last micro-batch's backward;
    the timeline divides them with the buckets, so the replay takes the division off that step."""
    spec = make_spec(dp=2, micro_batches=2, bucket_mb=1000)
    profile_path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({}, 1e-3), divide=[2e-3, 2e-3])
    timeline = predict(profile_path).timeline
    divide = sum(timeline.costs.bucket_divide.values())
    assert divide == pytest.approx(2e-3) and timeline.dp_overlap
    rows = []
    for it in range(3):
        zero = it * 10.0
        for r in timeline.pipeline[0].steps:
            longer = divide if (r.phase, r.micro) == ("B", 1) else 0.0  # as harness train times it
            rows.append((zero + r.start_s, zero + r.end_s + longer, 0.0, "compute", "step", r.phase, "",
                         r.virtual_stage, r.micro, it, -1))
    trace = read_trace(write_trace(tmp_path / "trace.h5", timeline, {0: (rows, (0, 0, 0), None)},
                                   np.arange(3) * 10.0, 1.0, 0))
    (replayed,) = replay_stage_costs(trace, timeline, trace.measured())
    assert replayed.backward_s == pytest.approx(timeline.stage_costs[0].backward_s)
    assert replayed.forward_s == pytest.approx(timeline.stage_costs[0].forward_s)


@pytest.mark.parametrize("factor", [1.0, 1.5])
def test_layer_errors_are_computed_right_with_collectives_taken_off(tmp_path, factor):
    spec = make_spec(pp=2, micro_batches=2, layers=4)
    cost = 1e-3
    profile_path = write_handmade_profile(tmp_path / "profile.h5", spec,
                                          by_name({"compute": cost, "p2p": 2e-4}, default=5e-4))
    timeline = predict(profile_path).timeline
    plan, iterations, collective = timeline.plan, 3, 4e-4
    per_rank = {}
    for stage, device in enumerate(timeline.pipeline):
        rows, layer_rows = [], []
        for it in range(iterations):
            zero = it * 10 * timeline.batch_time_s
            for step, r in enumerate(device.steps):
                rows.append((zero + r.start_s, zero + r.end_s, 0.0, "compute", "step", r.phase, "", r.virtual_stage,
                             r.micro, it, -1))
                at = 100.0 + it + step * 0.1  # each step's layers (longer than the step here) apart from the others
                for index, layer in enumerate(plan.stages[r.virtual_stage].layers):
                    program = plan.stages[r.virtual_stage]
                    events, order = ((program.forward, program.forward_layers) if r.phase == "F"
                                     else (program.backward, program.backward_layers))
                    length = cost * factor + (collective if index == 0 else 0.0)
                    if index == 0:  # an all-reduce inside the layer, which the layer's time leaves out
                        rows.append((at + 1e-5, at + 1e-5 + collective, collective, "allreduce", "tp", "tp", "",
                                     r.virtual_stage, r.micro, it, -1))
                    layer_rows.append((at, at + length, r.phase, events[order.index(layer)], layer, r.virtual_stage,
                                       r.micro, it))
                    at += length
        layers = {n: np.array([row[i] for row in layer_rows], dtype=object if n in ("phase", "event_id") else None)
                  for i, n in enumerate(("start_s", "end_s", "phase", "event_id", "layer", "virtual_stage", "micro",
                                         "iteration"))}
        per_rank[stage] = (rows, (0, 0, stage), layers)
    path = write_trace(tmp_path / "trace.h5", timeline, per_rank, np.arange(iterations) * 10 * timeline.batch_time_s,
                       timeline.batch_time_s, 1)
    result = validate(read_trace(path), load_profile(profile_path))
    expected = (1 / factor - 1) * 100
    keys = {(row["virtual_stage"], row["phase"], row["event_id"]) for row in result.layers}
    assert keys == {(vs, phase, eid) for vs, program in enumerate(plan.stages)
                    for phase, events in (("F", program.forward), ("B", program.backward)) for eid in events}
    for row in result.layers:
        layers_of_event = sum(1 for eid in (plan.stages[row["virtual_stage"]].forward if row["phase"] == "F"
                                            else plan.stages[row["virtual_stage"]].backward) if eid == row["event_id"])
        assert row["samples"] == layers_of_event * 2 * (iterations - 1)  # micro-batches x measured iterations
        assert row["measured_s"] == pytest.approx(cost * factor)
        assert row["predicted_s"] == pytest.approx(cost)
        assert row["error_pct"] == pytest.approx(expected, abs=1e-6)
    assert result.to_dict()["layers"] == result.layers


def test_replica_lag_is_the_last_replicas_compute_end_behind_their_mean(tmp_path):
    spec = make_spec(dp=2, micro_batches=2, layers=2)
    profile_path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({"compute": 1e-3}, default=0.0))
    timeline = predict(profile_path).timeline
    device, T = timeline.pipeline[0], timeline.batch_time_s
    stretch = {0: 1.0, 1: 1.2}  # replica 1 computes 20% slower in every iteration
    per_rank = {rank: ([(it * 2 * T + r.start_s * factor, it * 2 * T + r.end_s * factor, 0.0, "compute", "step",
                         r.phase, "", 0, r.micro, it, -1) for it in range(3) for r in device.steps], (rank, 0, 0), None)
                for rank, factor in stretch.items()}
    path = write_trace(tmp_path / "trace.h5", timeline, per_rank, np.arange(3) * 2 * T, 1.2 * T, 0)
    result = validate(read_trace(path), load_profile(profile_path))
    compute_end = max(r.end_s for r in device.steps)
    assert result.replica_lag == [{"stage": 0, "measured_s": pytest.approx(0.1 * compute_end),
                                   "predicted_s": 0.0, "error_pct": pytest.approx(-100.0)}]
    assert result.to_dict()["replica_lag"] == result.replica_lag
    single = make_spec(micro_batches=2, layers=2)
    path = write_handmade_profile(tmp_path / "single" / "profile.h5", single, by_name({"compute": 1e-3}, default=0.0))
    one = predict(path).timeline
    assert validate(read_trace(write_scaled_trace(tmp_path / "single" / "trace.h5", one, 1.0)),
                    load_profile(path)).replica_lag == []


def test_real_run_validates_end_to_end(tmp_path, project_env):
    """profile under mpirun, train under mpirun, validate: the whole chain with real MPI, gloo and HDF5."""
    spec = write_spec(tmp_path / "job.toml", layers=2, hidden=32, heads=4, ffn=64, seq=16, vocab=64, pp=2,
                      global_batch=4, micro=1, warmup=1, repeats=3)
    run = lambda *args: subprocess.run([MPIRUN, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "harness", *args],  # noqa: E731
                                       capture_output=True, text=True, env=project_env, timeout=300, cwd=ROOT)
    profiled = run("profile", str(spec), "-o", str(tmp_path / "prof"), "--quiet")
    assert profiled.returncode == 0, profiled.stderr
    trained = run("train", str(spec), "-o", str(tmp_path / "run"), "--iterations", "3", "--warmup", "1",
                  "--layer-times")
    assert trained.returncode == 0, trained.stderr
    png, perfetto = tmp_path / "cmp.png", tmp_path / "cmp.json.gz"
    result = subprocess.run([sys.executable, "-m", "analysis", "validate", str(tmp_path / "run"),
                             str(tmp_path / "prof"), "--json", "--png", str(png), "--trace-out", str(perfetto)],
                            capture_output=True, text=True, env=project_env, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    m, p = report["measured_batch_time_s"], report["predicted_batch_time_s"]
    assert m > 0 and p > 0
    assert report["batch_time_error_pct"] == pytest.approx((p - m) / m * 100)
    assert report["replay_batch_time_s"] > 0
    assert report["replay_batch_time_s"] != report["predicted_batch_time_s"]  # the run's compute, not the profile's
    assert report["replay_error_pct"] == pytest.approx((report["replay_batch_time_s"] - m) / m * 100)
    assert len(report["devices"]) == 2 and report["measured_iterations"] == 2
    # every layer event of both stages, measured and predicted (--layer-times)
    assert {(r["virtual_stage"], r["phase"]) for r in report["layers"]} == {(0, "F"), (0, "B"), (1, "F"), (1, "B")}
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 and r["samples"] >= 2 for r in report["layers"])
    assert not [w for w in report["warnings"] if "differ in" in w]  # profiled and run in the same conditions
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(gzip.decompress(perfetto.read_bytes()))["traceEvents"]
    pids = {e["pid"] for e in events if e.get("ph") == "X"}
    assert {0, 1, 100_000, 100_001} <= pids  # predicted and measured devices


def test_validate_refuses_a_profile_as_trace(tmp_path, project_env):
    spec = make_spec(pp=2)
    profile_path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({}, default=1e-3))
    result = subprocess.run([sys.executable, "-m", "analysis", "validate", str(profile_path), str(profile_path)],
                            capture_output=True, text=True, env=project_env, timeout=60, cwd=ROOT)
    assert result.returncode == 2 and "not a real run's trace" in result.stderr and "Traceback" not in result.stderr


def test_json_report_with_extrapolated_events(tmp_path):
    """A run validated against a profile that lacks some communication: the report still serialises."""
    from tests.test_analysis_helpers import comm_point

    spec = make_spec(pp=2, micro_batches=2, layers=2)
    point = comm_point("allreduce", 4096, "intra", 1e-4)  # no communication event measured, one point to fit
    profile_path = write_handmade_profile(tmp_path / "profile.h5", spec,
                                          lambda e: 1e-3 if e.kind == "compute" else None, extra=[point])
    timeline = predict(profile_path).timeline
    trace = read_trace(write_scaled_trace(tmp_path / "trace.h5", timeline, 1.1))
    report = validate(trace, load_profile(profile_path)).to_dict()
    assert report["extrapolated"] and all("id" in item for item in report["extrapolated"])
    json.loads(json.dumps(report, allow_nan=False))


def test_a_profile_and_a_run_taken_in_different_conditions_are_flagged():
    same = {"device": "cpu:AMD EPYC 7B13", "host_memory": "retained", "torch_version": "2.13.0+cpu",
            "backend": "torch-gloo"}
    assert environment_differences(same, dict(same, device="cpu")) == []  # a run names no processor
    assert environment_differences(same, {"world_size": 2}) == []  # older files lack the keys
    (warning,) = environment_differences(same, dict(same, host_memory="default"))
    assert "host_memory: retained (profile) against default (run)" in warning
    gpu = dict(same, device="cuda:NVIDIA H200", backend="torch-nccl")
    assert len(environment_differences(gpu, same)) == 2  # device and backend


def test_a_profile_and_a_run_bound_differently_to_cores_are_flagged():
    bound, shared = {"cpu_binding": "bound"}, {"cpu_binding": "shared"}
    assert environment_differences(bound, dict(bound)) == []
    assert environment_differences(bound, {"cpu_binding": "unknown"}) == []  # one side could not tell
    assert environment_differences(bound, {}) == []  # files from before the binding was recorded
    assert environment_differences(bound, {"cpu_binding": "single"}) == []  # one rank per host shares nothing
    assert environment_differences(bound, {"cpu_binding": "numa"}) == []  # a value this reader does not know
    (warning,) = environment_differences(bound, shared)
    assert "profile's ranks were bound to cores of their own and the run's free to share cores" in warning
    assert "--bind-to core" in warning
    (warning,) = environment_differences(shared, bound)
    assert "profile's ranks were free to share cores and the run's bound" in warning


def test_a_trace_short_of_its_specs_devices_says_what_to_give(tmp_path):
    """A trace holding one device of a two-device job (an edited file, or not harness train's merge): one message
    that says which file validate reads."""
    import h5py

    from harness.common.errors import UserError

    spec = make_spec(pp=2)
    profile_path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({}, default=1e-3))
    path = write_scaled_trace(tmp_path / "trace.h5", predict(profile_path).timeline, 1.1)
    with h5py.File(path, "r+") as f:
        del f["devices"][sorted(f["devices"])[-1]]
    with pytest.raises(UserError, match="trace has 1 devices but its spec has .* give the trace.h5 that harness "
                                        "train merged from every rank"):
        validate(read_trace(path), load_profile(profile_path))

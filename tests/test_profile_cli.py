"""`harness profile` as users run it: under mpirun, failures end the job, mismatched launches are caught."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from harness.common.errors import UserError
from harness.store.hdf5_io import plain, read_environment
from harness.store.hdf5_schema import COMPUTE_PHASE_ATTR, RANK_SPEED_PROBE_ENV, compute_phase_key
from tests.conftest import ROOT
from tests.helpers import write_spec

MPIRUN = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")


def mpirun(n: int, args: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [MPIRUN, "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "harness", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


@pytest.fixture
def spec_file(tmp_path):
    return write_spec(tmp_path / "job.toml", layers=2, hidden=32, heads=4, ffn=64, seq=16, vocab=64, dp=2,
                      global_batch=4, micro=2, warmup=1, repeats=2)


@pytest.mark.parametrize("backend", ["torch", "mpi4py"])
def test_profile_under_mpirun_and_show(tmp_path, project_env, backend):
    spec_file = write_spec(tmp_path / "job.toml", layers=2, hidden=32, heads=4, ffn=64, seq=16, vocab=64, dp=2,
                           pp=2, global_batch=8, micro=2, warmup=1, repeats=2)
    out = tmp_path / "out"
    result = mpirun(2, ["profile", str(spec_file), "-o", str(out), "--quiet", "--backend", backend], project_env)
    assert result.returncode == 0, result.stderr
    assert "profile:" in result.stdout and (out / "profile.h5").exists()
    show = subprocess.run([sys.executable, "-m", "harness", "show", str(out / "profile.h5"), "--json"],
                          capture_output=True, text=True, env=project_env)
    assert show.returncode == 0 and '"schema_version": 2' in show.stdout
    summary = json.loads(show.stdout)
    expected = "torch-gloo" if backend == "torch" else "mpi4py"
    assert summary["environment"]["backend"] == expected
    assert summary["environment"]["host_memory"] == "retained"  # a CPU run keeps freed memory (glibc)
    assert len(summary["environment"]["cpu_affinity"]) == 2 and all(summary["environment"]["cpu_affinity"])
    # both ranks on this machine: bound when the launcher gave each its own cores
    affinity = summary["environment"]["cpu_affinity"]
    expected_binding = "shared" if set(affinity[0]) & set(affinity[1]) else "bound"
    assert summary["environment"]["cpu_binding"] == expected_binding
    # the summary asks for binding only where the ranks share cores and each could have had its own
    could_bind = expected_binding == "shared" and len(set(affinity[0]) | set(affinity[1])) >= 2
    assert ("NOTE: the ranks were free to share cores" in result.stdout) == could_bind
    assert any(m["kind"] == "allreduce" and m["needed"] for m in summary["measurements"])
    with h5py.File(out / "profile.h5") as f:  # P2P also with the sender computing, on either backend
        p2p = [g for g in f["measurements"].values() if plain(g.attrs["kind"]) == "p2p"]
        assert p2p and all((g["sender_busy_samples_s"][()] > 0).all() for g in p2p)
        # and the sender's post of each send, its receiver waiting: host bookkeeping, never a transfer's wait
        # (0.2-0.5 ms here; through the run's own path on torch, harness.runtime.inflight.post_send)
        assert all((g["send_post_samples_s"][()] > 0).all() and (g["send_post_samples_s"][()] < 0.05).all()
                   for g in p2p)
        if backend == "mpi4py":  # the bare Isend, timed inside the ping-pong: part of its round trip
            assert all((g["send_post_samples_s"][()] < 2 * g["samples_s"][()]).all() for g in p2p)
        # every rank timed the speed probe in the compute phase that took the compute samples
        phases = {compute_phase_key(g.attrs[COMPUTE_PHASE_ATTR]) for g in f["measurements"].values()
                  if plain(g.attrs["kind"]) == "compute"}
    probes = summary["environment"][RANK_SPEED_PROBE_ENV]
    assert set(probes) == phases and len(phases) == 1
    (medians,) = probes.values()
    assert len(medians) == 2 and all(m > 0 for m in medians)


def test_a_failing_rank_ends_the_job_naming_the_rank(tmp_path, spec_file, project_env):
    env = dict(project_env, DISTSIM_FAIL_RANK="1")
    started = time.monotonic()
    result = mpirun(2, ["profile", str(spec_file), "-o", str(tmp_path / "out"), "--quiet"], env, timeout=120)
    assert result.returncode == 1  # the harness's failure, not bad input: its traceback, then its line
    assert "rank 1" in result.stderr and "failed in phase 'compute'" in result.stderr
    assert "Traceback" in result.stderr and "raised in the model's code" not in result.stderr
    assert time.monotonic() - started < 120


def test_a_run_stopped_before_its_merge_keeps_its_speed_probe_for_the_resume(tmp_path, spec_file, project_env):
    from harness.store.profile_store import read_rank_probes

    out = tmp_path / "out"
    stopped = mpirun(2, ["profile", str(spec_file), "-o", str(out), "--quiet"],
                     dict(project_env, DISTSIM_FAIL_RANK="1", DISTSIM_FAIL_PHASE="communication"), timeout=120)
    assert stopped.returncode != 0 and "failed in phase 'communication'" in stopped.stderr
    assert not (out / "profile.h5").exists()
    # each rank file holds its compute samples and, for the phase that took them, the rank's own probe median
    kept = [read_rank_probes(out / f"rank-{r:05d}.h5") for r in range(2)]
    assert all(len(probes) == 1 and min(probes.values()) > 0 for probes in kept) and kept[0].keys() == kept[1].keys()
    resumed = mpirun(2, ["profile", str(spec_file), "-o", str(out), "--quiet"], project_env, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    with h5py.File(out / "profile.h5") as f:

        probes = read_environment(f)[RANK_SPEED_PROBE_ENV]
        phases = {compute_phase_key(g.attrs[COMPUTE_PHASE_ATTR]) for g in f["measurements"].values()
                  if plain(g.attrs["kind"]) == "compute"}
    # the compute samples are the stopped run's, and so are the probes that refer them to the ranks' mean speed
    (stopped_phase,) = kept[0]
    assert phases == {stopped_phase} and set(probes) == phases
    assert probes[stopped_phase] == [kept[0][stopped_phase], kept[1][stopped_phase]]


def test_world_size_mismatch_is_caught(tmp_path, spec_file, project_env):
    env = dict(project_env, SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2")
    for name in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "harness", "profile", str(spec_file), "-o", str(tmp_path / "o")],
                            capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert "world size is 1 but the launcher promised 2" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_spec_exits_2_once(tmp_path, project_env):
    bad = write_spec(tmp_path / "bad.toml", name="gpt5")
    result = mpirun(2, ["profile", str(bad), "-o", str(tmp_path / "o")], project_env)
    assert result.returncode == 2
    assert result.stderr.count("unknown model 'gpt5'") == 1 and "Traceback" not in result.stderr
    assert "MPI_Abort" not in result.stderr + result.stdout


@pytest.mark.parametrize("option, message", [
    (["--precision", "0"], "[profile.precision] must be a fraction above 0 and at most 0.5"),
    (["--precision", "60%"], "[profile.precision] must be a fraction above 0 and at most 0.5"),
    (["--precision", "abc"], "--precision: 'abc' is not a fraction (0.02) or a percentage (2%)"),
    (["--budget-s", "0"], "--budget-s: '0' is not a positive, finite number of seconds"),
    (["--budget-s", "-3"], "--budget-s: '-3' is not a positive, finite number of seconds"),
    (["--budget-s", "inf"], "--budget-s: 'inf' is not a positive, finite number of seconds")])
def test_bad_precision_or_budget_exits_2_once(tmp_path, spec_file, project_env, option, message):
    result = mpirun(2, ["profile", str(spec_file), "-o", str(tmp_path / "o"), *option], project_env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count(message) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists(), "nothing is written for bad input"


def test_a_resume_measures_again_what_misses_a_precision_it_now_asks_more_of():
    import numpy as np

    from harness.profile.run import _complete
    from harness.store.hdf5_schema import PRECISION_BUDGET_ATTR, PRECISION_GOAL_ATTR
    from harness.store.profile_store import Measurement

    wide = np.array([1.0, 2.0, 1.0, 2.0, 1.0, 2.0])  # its mean known within about 22%
    taken = Measurement("id", "compute", {"phase": "fwd"}, wide, [0], "env",
                        {"activation_bytes": 8, PRECISION_GOAL_ATTR: 0.02, PRECISION_BUDGET_ATTR: 10.0})
    assert _complete(taken, (0.02, 10.0)), "the same precision and budget would only miss again"
    assert not _complete(taken, (0.01, 10.0)) and not _complete(taken, (0.02, 20.0))  # asked more of
    assert _complete(taken, (0.5, 60.0)), "it reaches a coarser precision"
    older = Measurement("id", "allreduce", {}, wide, [0, 1], "env", {},
                        {"divide_samples_s": wide, "zero_samples_s": wide})
    assert not _complete(older, (0.02, 10.0)), "taken before precision was recorded: measured again"
    assert _complete(older), "without a precision asked, as before"


def test_output_folder_that_cannot_be_created(tmp_path, spec_file, project_env):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = mpirun(2, ["profile", str(spec_file), "-o", str(blocker / "out")], project_env)
    assert result.returncode == 2 and "cannot create the output folder" in result.stderr
    assert "Traceback" not in result.stderr and "MPI_Abort" not in result.stderr


def test_a_folder_where_the_profile_writes_a_file_is_refused_before_measuring(tmp_path):
    """A folder named profile.h5 or rank-NNNNN.h5 in OUTDIR would fail the merge after every measurement and again
    on every rerun: refused first, saying what to move."""
    from harness.profile.run import check_outdir

    for name in ("profile.h5", "rank-00001.h5"):
        outdir = tmp_path / name.split(".")[0]
        (outdir / name).mkdir(parents=True)
        with pytest.raises(UserError, match=f"{name} is a folder where the profile writes a file; move or remove it"):
            check_outdir(outdir)
    check_outdir(tmp_path / "fresh")


def test_resume_measures_again_what_this_version_measures_more_of():
    """A P2P without sender-busy samples, an all-reduce without its division's or its zeroing's samples, a
    forward without its saved bytes, a backward without its temporaries and a GPU forward or backward without
    host issue times are incomplete; everything else stored is reused."""
    import numpy as np

    from harness.profile.run import _complete
    from harness.store.hdf5_schema import (
        DIVIDE_SERIES,
        HOST_ISSUE_SERIES,
        SEND_POST_SERIES,
        SENDER_BUSY_SERIES,
        ZERO_SERIES,
    )
    from harness.store.profile_store import Measurement

    def measurement(kind, phase=None, device="cpu:x", series=(), **attrs):
        content = {"phase": phase} if phase else {}
        return Measurement("id", kind, content, np.ones(3), [0], "env", {"device": device, **attrs},
                           {name: np.ones(3) for name in series})

    assert _complete(measurement("compute", "fwd", activation_bytes=64))  # a CPU profile has no host issue times
    assert not _complete(measurement("compute", "fwd"))  # measured before its activations were
    assert not _complete(measurement("compute", "bwd"))  # measured before its backward's temporaries were
    assert _complete(measurement("compute", "bwd", temporary_bytes=64))
    assert not _complete(measurement("compute", "bwd", "cuda:NVIDIA H200", temporary_bytes=64))
    assert _complete(measurement("compute", "bwd", "cuda:NVIDIA H200", [HOST_ISSUE_SERIES], temporary_bytes=64))
    assert _complete(measurement("compute", "optimizer", "cuda:NVIDIA H200"))  # timed alone, no issue times
    assert not _complete(measurement("p2p"))
    assert not _complete(measurement("p2p", series=[SENDER_BUSY_SERIES]))  # before its post was timed
    assert _complete(measurement("p2p", series=[SENDER_BUSY_SERIES, SEND_POST_SERIES]))
    assert not _complete(measurement("allreduce"))  # measured before its division was timed
    assert not _complete(measurement("allreduce", series=[DIVIDE_SERIES]))  # before its zeroing was timed
    assert _complete(measurement("allreduce", series=[DIVIDE_SERIES, ZERO_SERIES]))


def test_rank_files_read_their_probes_and_older_files_have_none(tmp_path):
    from harness.profile.run import RankRecorder, _rank_file_speeds
    from harness.store.profile_store import read_rank_probes, write_rank_file

    class Probe:
        def __init__(self, median):
            self.median = median

        def median_s(self):
            return self.median

    older = write_rank_file(tmp_path / "rank-00002.h5", 2, [])  # written before rank files kept their probe
    assert read_rank_probes(older) == {}
    recorder = RankRecorder(tmp_path / "rank-00000.h5", 0, {"env_key": "e"}, {}, {"1.5": 0.002})
    probe = Probe(None)
    recorder.track_probe("2.5", probe)
    probe.median = 0.003  # the median as of each flush, not as of tracking
    recorder.flush()
    assert read_rank_probes(tmp_path / "rank-00000.h5") == {"1.5": 0.002, "2.5": 0.003}
    # per phase, by rank: rank 1 has no file and rank 2's has no probe
    assert _rank_file_speeds(tmp_path) == {"1.5": [0.002, None, None], "2.5": [0.003, None, None]}


def test_the_failure_hook_refuses_a_phase_it_does_not_know(monkeypatch):
    from harness.profile.run import _fail_if_asked

    monkeypatch.setenv("DISTSIM_FAIL_RANK", "1")
    monkeypatch.setenv("DISTSIM_FAIL_PHASE", "tensor-parallel composites")
    _fail_if_asked(0, "tensor-parallel composites")  # another rank's failure
    with pytest.raises(RuntimeError, match="injected"):
        _fail_if_asked(1, "tensor-parallel composites")
    monkeypatch.setenv("DISTSIM_FAIL_PHASE", "comunication")
    with pytest.raises(RuntimeError, match="not one of"):
        _fail_if_asked(0, "compute")


def test_the_slurm_script_refuses_a_misplaced_output_folder_before_launching(tmp_path):
    """slurm/profile.sh: a forgotten OUTDIR (an option in its place), an -o among the options (it would have won in
    argparse and left OUTDIR empty), and an interpreter without the project's packages, each one message, exit 2,
    no folder made, before any srun (run here as in an allocation, with SLURM_JOB_ID set)."""
    root = Path(__file__).resolve().parents[1]
    spec = tmp_path / "job.toml"
    spec.write_text((root / "harness" / "jobs" / "demo.toml").read_text())
    env = {**os.environ, "SLURM_JOB_ID": "1", "DISTSIM_HOME": str(root)}
    cases = [(["job.toml", "--force"], {}, "OUTDIR '--force' looks like an option"),
             (["job.toml", "out", "-o", "x"], {}, "drop '-o' from the options"),
             (["job.toml", "out", "--output=x"], {}, "drop '--output=x' from the options"),
             (["job.toml", "out"], {"DISTSIM_PYTHON": "/usr/bin/python3"}, "cannot import mpi4py, torch, h5py")]
    system = Path("/usr/bin/python3")
    if not system.exists() or subprocess.run([str(system), "-c", "import mpi4py, torch, h5py, numpy"],
                                             capture_output=True).returncode == 0:
        cases.pop()  # no system interpreter, or one with every package: nothing to refuse
    for args, extra, message in cases:
        done = subprocess.run(["bash", str(root / "slurm" / "profile.sh"), *args], cwd=tmp_path, capture_output=True,
                              text=True, env={**env, **extra}, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml"]


@pytest.mark.parametrize("command", ["profile", "train"])
def test_an_empty_output_folder_is_refused_not_read_as_here(tmp_path, spec_file, monkeypatch, capsys, command):
    """`-o "$UNSET"`: the current folder is never taken for an empty OUTDIR (nothing is written there)."""
    from harness.commands.cli import main as harness_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        harness_main([command, str(spec_file), "-o", ""])
    assert stop.value.code == 2
    assert "argument -o/--output: empty; give a value" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["job.toml"]

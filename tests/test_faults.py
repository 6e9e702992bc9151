"""Faults an operator meets on a cluster, each on the real commands under mpirun: a rank killed in each phase, then
resumed; a full disk (a real small tmpfs); a read-only output folder; a second job in the same folder. Each ends
in one message and, where the job itself could tell, exit status 2; nothing already measured is lost."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.common.errors import UserError, WriteError
from harness.common.output import writable
from harness.store.folder_lock import LOCK_NAME, FolderBusy, FolderLock
from harness.store.hdf5_io import create, remove_temporaries, write_dataset
from harness.store.profile_store import read_measurements
from tests.helpers import mpirun_harness, write_spec

EVENTS = 7  # the tiny spec's unique events, all compute on one pipeline device


def _temporaries(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.tmp-*"))


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ": error: " in line]


@pytest.fixture
def spec_file(tmp_path):
    return write_spec(tmp_path / "job.toml")


@pytest.fixture
def mounts(tmp_path):
    """mount(name, options) -> a fresh tmpfs folder with those mount options; skipped where this machine cannot
    mount one (not root, or no mount permission). Every mount is undone at the end."""
    made: list[Path] = []

    def mount(name: str, options: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root here")
        folder = tmp_path / name
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        made.append(folder)
        return folder

    yield mount
    for folder in reversed(made):
        for _ in range(20):  # a process just gone may keep the mount busy for a moment
            if subprocess.run(["umount", str(folder)], capture_output=True).returncode == 0:
                break
            time.sleep(0.25)


def _remount(folder: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(folder)], check=True, capture_output=True)


def _profile(out: Path, spec: Path, env: dict, **fail) -> subprocess.CompletedProcess:
    if fail:
        env = dict(env, DISTSIM_FAIL_RANK=str(fail["rank"]), DISTSIM_FAIL_PHASE=fail["phase"], DISTSIM_FAIL_HOW="kill")
    return mpirun_harness(2, ["profile", str(spec), "-o", str(out), "--quiet"], env, timeout=180)


# --- a rank killed, then the job resumed ------------------------------------------------------------------------

@pytest.mark.parametrize("phase", ["compute", "communication", "merge"])
def test_a_rank_killed_in_a_phase_then_resumed_loses_nothing_it_finished(tmp_path, spec_file, project_env, phase):
    out = tmp_path / "out"
    killed = _profile(out, spec_file, project_env, rank=1, phase=phase)
    assert killed.returncode != 0
    assert not (out / "profile.h5").exists()
    kept = {}
    for path in sorted(out.glob("rank-*.h5")):
        kept.update(read_measurements(path))  # every file left is complete and readable
    if phase != "compute":  # the compute phase's measurements were saved at its end
        assert len(kept) == EVENTS
    resumed = _profile(out, spec_file, project_env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(kept)} already stored" in resumed.stdout
    assert f"{EVENTS - len(kept)} measurements taken" in resumed.stdout
    assert "took over" in resumed.stderr  # the killed job's lock, named in a note
    assert not _temporaries(out)
    assert len(read_measurements(out / "profile.h5")) == EVENTS


# --- a full disk ----------------------------------------------------------------------------------------------

def test_a_full_disk_is_one_message_and_a_resume_keeps_every_complete_file(tmp_path, spec_file, project_env,
                                                                           mounts):
    disk = mounts("disk", "size=4m")
    out = disk / "out"
    assert _profile(out, spec_file, project_env, rank=1, phase="merge").returncode != 0  # rank files hold all
    before = {p.name: p.read_bytes() for p in out.glob("rank-*.h5")}
    assert len(before) == 2
    filler = disk / "filler"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    filler.write_bytes(b"\0" * (free - 2048))  # under 2 KiB left: less than any rank file or the profile

    full = _profile(out, spec_file, project_env)
    assert full.returncode == 2, full.stderr
    errors = _error_lines(full.stderr)
    assert len(errors) == 1, full.stderr
    assert f"no space left in {out}" in errors[0] and "it needs" in errors[0] and "free" in errors[0]
    assert "Traceback" not in full.stderr
    assert not _temporaries(out)
    assert {p.name: p.read_bytes() for p in out.glob("rank-*.h5")} == before  # untouched, complete

    filler.unlink()
    resumed = _profile(out, spec_file, project_env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"0 measurements taken, {EVENTS} already stored" in resumed.stdout


def test_a_file_larger_than_the_free_space_is_refused_before_a_byte_is_written(mounts):
    disk = mounts("small", "size=64k")
    with pytest.raises(WriteError, match=r"no space left in .* for big\.h5 \(it needs [\d.]+ kB, [\d.]+ kB free\)"):
        with create(disk / "big.h5", "test", 1) as f:
            write_dataset(f, "values", list(range(100_000)))
    assert list(disk.iterdir()) == []


def test_an_output_that_fills_the_disk_part_way_leaves_nothing(mounts):
    disk = mounts("small", "size=16k")
    target = disk / "chart.png"

    def write():
        with target.open("wb") as f:
            f.write(b"\0" * 100_000)
    with pytest.raises(WriteError, match="no space left in"):
        writable(target, write)
    assert not target.exists()


# --- a read-only output folder --------------------------------------------------------------------------------

def test_a_read_only_output_folder_is_one_message(tmp_path, spec_file, project_env, mounts):
    folder = mounts("readonly", "size=1m")
    _remount(folder, "ro")
    for out in (folder, folder / "new"):
        result = _profile(out, spec_file, project_env)
        assert result.returncode == 2, result.stderr
        errors = _error_lines(result.stderr)
        assert len(errors) == 1 and "Read-only file system" in errors[0], result.stderr
        assert "Traceback" not in result.stderr


# --- two jobs in one folder -----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["profile", "train"])
def test_a_second_job_in_a_folder_in_use_is_refused_naming_the_first(tmp_path, spec_file, project_env, command):
    out = tmp_path / "out"
    with FolderLock(out, "the first job"):
        args = [command, str(spec_file), "-o", str(out)] + (["--iterations", "2", "--warmup", "1"]
                                                            if command == "train" else ["--quiet"])
        result = mpirun_harness(1, args, project_env, timeout=120)
    assert result.returncode == 2, result.stderr
    errors = _error_lines(result.stderr)
    assert len(errors) == 1, result.stderr
    assert f"{out} is in use by `the first job`" in errors[0] and f"pid {os.getpid()}" in errors[0]
    assert not (out / "profile.h5").exists() and not (out / "trace.h5").exists()


def test_two_profiles_started_together_one_runs_the_other_is_refused(tmp_path, spec_file, project_env):
    out = tmp_path / "out"
    launcher = [os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun"), "-n", "1",
                sys.executable, "-m", "mpi4py", "-m", "harness", "profile", str(spec_file), "-o", str(out), "--quiet"]
    # the first samples long enough to hold the folder while the second starts (its torch import takes seconds)
    first = subprocess.Popen([*launcher, "--repeats", "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=project_env)
    lock = out / LOCK_NAME
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.stat().st_size) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    second = subprocess.run(launcher, capture_output=True, text=True, env=project_env, timeout=120)
    first_out, first_err = first.communicate(timeout=120)
    assert first.returncode == 0, first_err
    assert second.returncode == 2 and "is in use by" in second.stderr, second.stderr
    assert lock.read_text() == ""  # released at the end


def test_a_lock_left_by_a_killed_process_is_taken_over_with_a_note(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; from harness.store.folder_lock import FolderLock; "
                               f"FolderLock({str(tmp_path)!r}, 'a job that dies').acquire(); print('held', flush=True);"
                               " time.sleep(60)"], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(FolderBusy, match="a job that dies"):
        FolderLock(tmp_path, "me").acquire()
    holder.kill()
    holder.wait()
    (tmp_path / f".rank-00000.h5.tmp-{holder.pid}").write_bytes(b"half a file")
    lock = FolderLock(tmp_path, "me").acquire()
    try:
        assert "a job that dies" in lock.note() and "ended without releasing it" in lock.note()
        assert [p.name for p in remove_temporaries(tmp_path)] == [f".rank-00000.h5.tmp-{holder.pid}"]
    finally:
        lock.release()
    assert FolderLock(tmp_path, "me").acquire().note() is None  # a released lock leaves no holder behind


def test_a_lock_in_a_path_that_is_a_file_is_bad_input(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot write"):
        FolderLock(tmp_path / "file", "me").acquire()


def test_a_run_into_a_full_disk_is_one_message(tmp_path, project_env, mounts):
    disk = mounts("disk", "size=8k")
    spec_file = write_spec(tmp_path / "dp2.toml", dp=2)
    result = mpirun_harness(2, ["train", str(spec_file), "-o", str(disk / "run"), "--iterations", "2", "--warmup",
                                "1"], project_env, timeout=180)
    assert result.returncode == 2, result.stderr
    errors = _error_lines(result.stderr)
    assert len(errors) == 1 and "no space left in" in errors[0] and "it needs" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not _temporaries(disk / "run")


def test_the_analysis_outputs_into_a_full_disk_are_one_message(tmp_path, project_env, mounts):
    disk = mounts("disk", "size=4k")
    (disk / "filler").write_bytes(b"\0" * 4096)  # nothing more fits
    profile = Path(__file__).resolve().parent / "data" / "pp2-profile.h5"
    for args in (["simulate", str(profile), "--trace", str(disk / "t.json.gz"), "--png", str(disk / "t.png"),
                  "--out", str(disk / "timeline.h5")],
                 ["search", str(profile), "--write-spec", str(disk / "best.toml"), "--png", str(disk / "s.png")]):
        result = subprocess.run([sys.executable, "-m", "analysis", *args], capture_output=True, text=True,
                                env=project_env)
        assert result.returncode == 2, (args, result.stderr)
        errors = _error_lines(result.stderr)
        assert len(errors) == 1 and f"no space left in {disk}" in errors[0], (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert [p.name for p in disk.iterdir()] == ["filler"], args


def test_a_collectives_benchmark_into_a_full_disk_prints_its_table_then_one_message(project_env, mounts):
    disk = mounts("disk", "size=4k")
    (disk / "filler").write_bytes(b"\0" * 4096)
    result = mpirun_harness(2, ["collectives", "-o", str(disk / "c.h5"), "--ops", "allreduce", "--maxbytes", "64K",
                                "--quiet"], project_env, timeout=180)
    assert result.returncode == 2, result.stderr
    errors = _error_lines(result.stderr)
    assert len(errors) == 1 and f"no space left in {disk} for c.h5" in errors[0], result.stderr
    assert "MPI_Abort" not in result.stderr and "Traceback" not in result.stderr
    assert "avg bus bandwidth" in result.stdout and "results:" not in result.stdout  # measured, not lost
    assert [p.name for p in disk.iterdir()] == ["filler"]


# --- a user's model that fails only on real tensors ---------------------------------------------------------------

@pytest.mark.parametrize("command", ["train", "profile"])
def test_a_model_that_breaks_on_real_tensors_is_one_message_naming_its_line(tmp_path, project_env, command):
    """The factory builds on the meta device, so the spec is valid; the model's forward fails when run. Every rank
    ends at once with one line naming the rank, what it was doing and the line of the user's code, exit status 2
    (bad input: the model); no traceback."""
    spec = tmp_path / "job.toml"
    spec.write_text("""[model]
factory = "tests.user_model:breaks_on_real_tensors"
layers = 4
hidden = 32
seq_len = 16
vocab = 128
[batch]
global = 4
micro = 1
[strategy]
dp = 1
pp = 2
[cluster]
nodes = 1
gpus_per_node = 2
[profile]
repeats = 3
warmup = 1
""")
    extra = ["--iterations", "2", "--warmup", "1"] if command == "train" else ["--quiet"]
    result = mpirun_harness(2, [command, str(spec), "-o", str(tmp_path / "out"), *extra], project_env, timeout=120)
    assert result.returncode == 2, result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith(f"harness {command}: rank ")]
    assert failed, result.stderr
    assert "failed in" in failed[0] and "RuntimeError" in failed[0]
    assert "raised in the model's code at" in failed[0] and "user_model.py:" in failed[0] and "in forward" in failed[0]
    assert "Traceback" not in result.stderr


def test_the_models_line_is_named_only_where_the_model_raised():
    """user_code_frame: the deepest frame of the factory's package, unless the harness's own code lies below it (a
    hook of the profiler's failing under the model's forward is the harness's failure); modules told by name."""
    from harness.runtime.mpi_errors import user_code_frame

    namespace = {"__name__": "mymodel.layers"}
    source = ("def forward(x):\n    return x[5]\n\n"
              "def calls_the_harness(text):\n"
              "    from harness.plan.spec import loads_spec\n    return loads_spec(text)\n")
    exec(compile(source, "/models/mymodel/layers.py", "exec"), namespace)
    caught = []
    for call, argument in ((namespace["forward"], [1]), (namespace["calls_the_harness"], "[model")):
        try:
            call(argument)
        except Exception as exc:  # noqa: BLE001 - any error will do
            caught.append(exc)
    model_raised, harness_raised = caught
    assert user_code_frame(model_raised, ("mymodel",)) == "/models/mymodel/layers.py:2, in forward"
    assert user_code_frame(model_raised, ()) is None  # a built-in model: no user code
    assert user_code_frame(model_raised, ("othermodel",)) is None
    assert user_code_frame(harness_raised, ("mymodel",)) is None

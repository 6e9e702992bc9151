"""`sbatch slurm/profile.sh SPEC OUTDIR` on a real (private, single-node) Slurm."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "slurm" / "profile.sh"
JOB_TIMEOUT_S = 300

TINY_SPEC = """\
[model]
name = "gpt2-small"
layers = 2
hidden = 64
heads = 4
ffn = 256
seq_len = 32
vocab = 512
dtype = "float32"
[batch]
global = 8
micro = 2
[strategy]
dp = 2
tp = 1
pp = 2
schedule = "1f1b"
[cluster]
nodes = 1
gpus_per_node = 4
[profile]
warmup = 1
repeats = 3
budget_s = 0.001
"""


@dataclass
class Job:
    """A finished batch job: its id, exit status and output file's text."""

    job_id: str
    returncode: int
    output: str

    def explain(self) -> str:
        return f"job {self.job_id} exited {self.returncode}; its output:\n{self.output}"


def _job_env(slurm, **extra: str) -> dict:
    """The test's environment without an enclosing job's Slurm variables or DISTSIM_ settings.

    SLURM_CONF and DISTSIM_SRUN_MPI (an existing cluster's MPI plugin) are kept.
    """
    keep = ("SLURM_CONF", "DISTSIM_SRUN_MPI")
    env = {k: v for k, v in slurm.env().items()
           if k in keep or not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "DISTSIM_"))}
    # The environment pytest runs in is the one the job should use.
    if sys.prefix != sys.base_prefix:
        env["DISTSIM_VENV"] = sys.prefix
    else:
        env["DISTSIM_PYTHON"] = sys.executable
    env.update(extra)
    return env


def _sbatch(slurm, cwd: Path, args: list[str], env: dict) -> Job:
    """Run `sbatch --wait` from cwd; scancel the job if it outlives JOB_TIMEOUT_S."""
    cmd = ["sbatch", "--wait", "--parsable", *args]
    try:
        res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        stdout, returncode = res.stdout, res.returncode
        stderr = res.stderr
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        returncode = None
    job_id = stdout.strip().split(";")[0].splitlines()[0] if stdout.strip() else "?"
    out_file = cwd / f"distsim-profile-{job_id}.out"
    output = out_file.read_text(errors="replace") if out_file.exists() else f"(no {out_file})"
    if returncode is None:
        if job_id != "?":
            subprocess.run(["scancel", job_id], env=env, capture_output=True, timeout=30)
        pytest.fail(f"sbatch --wait timed out after {JOB_TIMEOUT_S} s; job {job_id} cancelled.\n"
                    f"sbatch stderr: {stderr}\njob output:\n{output}\n{slurm.log_tail()}")
    if job_id == "?":
        pytest.fail(f"sbatch submitted nothing (exit {returncode}): {stderr}\n{slurm.log_tail()}")
    return Job(job_id, returncode, output + (f"\nsbatch stderr: {stderr}" if stderr.strip() else ""))


@pytest.fixture
def submit_dir(tmp_path: Path) -> Path:
    """A working directory outside the repository, holding the tiny spec."""
    (tmp_path / "tiny.toml").write_text(TINY_SPEC)
    return tmp_path


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_profile_job(slurm, submit_dir: Path, launcher: str):
    """The batch job profiles, predicts, and writes all four outputs."""
    env = _job_env(slurm, DISTSIM_HOME=str(ROOT), DISTSIM_LAUNCHER=launcher)
    job = _sbatch(slurm, submit_dir, ["-n", "2", str(SCRIPT), "tiny.toml", "out"], env)
    assert job.returncode == 0, job.explain()
    out = submit_dir / "out"

    import h5py

    with h5py.File(out / "profile.h5", "r") as f:
        assert "schema_version" in f.attrs, job.explain()

    prediction = json.loads((out / "prediction.json").read_text())
    assert prediction["batch_time_s"] > 0, job.explain()

    with gzip.open(out / "timeline.json.gz", "rt") as f:
        assert "traceEvents" in json.load(f), job.explain()

    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", job.explain()


def test_singleton_launch_is_detected(slurm, submit_dir: Path):
    """srun --mpi=none makes each task a rank 0 of 1: the harness must refuse, not run N jobs."""
    env = _job_env(slurm, DISTSIM_HOME=str(ROOT), DISTSIM_SRUN_MPI="none")
    job = _sbatch(slurm, submit_dir, ["-n", "2", str(SCRIPT), "tiny.toml", "out"], env)
    assert job.returncode != 0, job.explain()
    assert "world size" in job.output.lower(), job.explain()


def test_project_root_is_required(slurm, submit_dir: Path):
    """Submitted from outside the repository without DISTSIM_HOME, the job says what to set."""
    env = _job_env(slurm)
    job = _sbatch(slurm, submit_dir, ["-n", "1", str(SCRIPT), "tiny.toml", "out"], env)
    assert job.returncode != 0, job.explain()
    assert "DISTSIM_HOME" in job.output, job.explain()
    assert not (submit_dir / "out").exists()  # a refusal leaves no empty output folder behind

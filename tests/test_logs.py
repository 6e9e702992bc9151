"""What a person reads: progress in a log (a line per phase at most every 10 s, however the total grows), the
profile's short closing lines, and the bare `python -m harness` (the short help; under mpirun, the demo
profiled into a default folder with what to run next)."""
from __future__ import annotations

import subprocess
import sys
import time

from harness.commands.cli import DEFAULT_PROFILE_DIR
from harness.common.progress import Progress
from tests.conftest import ROOT
from tests.helpers import mpirun_harness


def test_a_log_gets_a_line_per_interval_however_often_the_total_grows(capsys):
    progress = Progress("compute", 10, log_every_s=0.2, unit="sample")
    start = time.monotonic()
    while time.monotonic() - start < 1.0:  # adaptive sampling: every advance grows the total
        progress.advance(3)
        time.sleep(0.001)
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert 3 <= len(lines) <= 6, lines  # about 1.0 / 0.2, never one a sample
    assert all(line.startswith("[compute] ") and " samples, elapsed " in line for line in lines)


def test_a_phase_shorter_than_the_interval_prints_nothing_in_a_log(capsys):
    progress = Progress("communication", 5)
    for _ in range(5):
        progress.advance()
    progress.close()
    assert capsys.readouterr().err == ""


def test_the_bare_command_without_mpi_prints_the_short_help(project_env):
    env = {k: v for k, v in project_env.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_"))}
    result = subprocess.run([sys.executable, "-m", "harness"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("usage: python -m harness")
    for name in ("events", "profile", "show", "train", "collectives"):
        assert any(line.split()[:1] == [name] for line in lines), name
    assert "mpirun -n 4 python -m mpi4py -m harness" in result.stdout
    assert len(lines) < 20


def test_the_bare_command_under_mpirun_profiles_the_demo_and_says_what_next(tmp_path, project_env):
    result = mpirun_harness(2, [], project_env, timeout=400, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    profile = tmp_path / DEFAULT_PROFILE_DIR / "profile.h5"
    assert profile.exists()
    assert result.stdout.count("profiled gpt2-small on 2 ranks") == 1
    assert "next: python -m analysis simulate" in result.stdout and "analysis search" in result.stdout
    # a log, not a terminal: at most a line per phase every 10 s, and no line longer than a screen's few rows
    assert len(result.stderr.splitlines()) < 30, result.stderr
    assert max(len(line) for line in result.stdout.splitlines()) < 400

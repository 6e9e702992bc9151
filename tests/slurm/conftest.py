"""Session fixture: a Slurm to submit to (a private single-node one started for the tests)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import SlurmCluster  # noqa: E402


@pytest.fixture(scope="session")
def slurm():
    """A usable SlurmCluster; skips when none can be had, which is a failure under CI=true."""
    cluster = SlurmCluster().start()
    try:
        if cluster.skip_reason:
            reason = f"no Slurm: {cluster.skip_reason}"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"{reason} (CI=true: the Slurm tests must run)", pytrace=False)
            pytest.skip(reason)
        yield cluster
    finally:
        cluster.stop()

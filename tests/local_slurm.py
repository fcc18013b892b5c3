"""The real SLURM cluster the SLURM tests start on this machine (tests/slurm/local_cluster.sh) and stop afterwards."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT, apt_lock, file_lock

CLUSTER = ROOT / "tests" / "slurm" / "local_cluster.sh"
LOCK = Path("/tmp/arl-slurm.lock")  # one test session at a time owns the machine's cluster


def run_cluster(command: str, nodes: int) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"SLURM_LOCAL_NODES": str(nodes)}
    return subprocess.run(["bash", str(CLUSTER), command], capture_output=True, text=True, timeout=900, env=env)


@contextmanager
def local_cluster(nodes: int = 1) -> Iterator[None]:
    """A cluster of `nodes` nodes (one slurmd each, all on this host) while the block runs; fails the test with the
    reason where SLURM cannot start."""
    if os.geteuid() != 0:
        pytest.fail("starting SLURM's daemons needs root")
    with file_lock(LOCK):
        try:
            with apt_lock():  # the start installs what is missing
                started = run_cluster("start", nodes)
        except subprocess.TimeoutExpired as exc:
            run_cluster("stop", nodes)
            pytest.fail(f"SLURM did not start in {exc.timeout} s")
        try:
            if started.returncode != 0:
                pytest.fail(f"SLURM could not start:\n{started.stderr[-3000:]}")
            yield
        finally:
            run_cluster("stop", nodes)

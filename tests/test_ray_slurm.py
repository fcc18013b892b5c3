"""Ray over a real SLURM cluster of two nodes: tests/slurm/local_cluster.sh with SLURM_LOCAL_NODES=2 starts two slurmd
on this machine (arl-node1, arl-node2; Debian's slurm-wlm supports several per host). A job submitted as a user would
(`hydra/launcher=slurm resources.nodes=2`) starts Ray with `start_ray_cluster()` and the real ray of .venv-verl: the
head on its first node, a worker on the second through `srun --overlap`. Where SLURM cannot start, the tests fail with
the reason."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.sweep import submitted_jobs
from tests.conftest import launch
from tests.local_slurm import local_cluster

# The worker of every SLURM test: the machine has one cluster, which a second worker would wait for, idle, on its lock
# (258 s of one run); one worker also keeps two Ray clusters, which could find each other, from starting at once.
pytestmark = [pytest.mark.slurm, pytest.mark.integration, pytest.mark.xdist_group("slurm")]

# Each job: 2 nodes of 1 CPU, no GPU (this machine's cluster has none).
SLURM_2_NODES = [
    "hydra/launcher=slurm",
    "resources.nodes=2",
    "hydra.launcher.gpus_per_node=0",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=1",
    "hydra.launcher.timeout_min=30",
]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[None]:
    with local_cluster(nodes=2):
        yield


def job_logs(sweep_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(sweep_dir.glob(".submitit/*/*_log.*")))


def sweep(args: list[str], tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """One run through hydra/launcher=slurm on two nodes, waited for; its summary.json and run directory."""
    sweep_dir = tmp_path / "sweep"
    try:
        result = launch(["-m", *args, *SLURM_2_NODES, f"hydra.sweep.dir={sweep_dir}"], tmp_path / "c", tmp_path, 300)
    finally:
        for job in submitted_jobs(sweep_dir).values():  # nothing of this test stays queued or running
            subprocess.run(["scancel", job["job_id"]], capture_output=True)
    run_dir = sweep_dir / "0"
    assert result.returncode == 0, result.stderr[-3000:] + job_logs(sweep_dir)
    return json.loads((run_dir / "summary.json").read_text()), run_dir


def test_a_two_node_job_starts_ray_on_both_nodes_and_stops_it(two_nodes: None, tmp_path: Path) -> None:
    summary, _ = sweep(["job._target_=tests.jobs.ray_nodes", "resources.gpus_per_node=0"], tmp_path)
    assert summary["status"] == "completed" and summary["ray_nodes"] == 2
    assert sorted(task["slurm_node"] for task in summary["tasks"]) == ["arl-node1", "arl-node2"]
    assert [task["parent"] for task in summary["tasks"]] == ["raylet", "raylet"]
    assert summary["alive_after_stop"] == []  # workers and raylets of both nodes, before the job ended


def test_backend_verl_on_two_nodes_starts_ray_over_them(two_nodes: None, tmp_path: Path) -> None:
    """backend=verl up to verl's trainer (backend.fit=false: vLLM and GPUs are what this machine lacks) on two
    nodes: the run writes verl's inputs and config and starts Ray over its allocation."""
    verl = ["backend=verl", "model=tiny", "warmstart=none", "algorithm.pool_samples=null", "backend.fit=false"]
    data = ["data.generate.n_train=24", "data.generate.n_dev=4", "algorithm.micro_batch_size=8"]  # 16 a GPU
    summary, run_dir = sweep([*verl, *data], tmp_path)
    assert summary["status"] == "completed" and summary["fit"].startswith("skipped"), summary
    assert "Ray cluster at 127.0.0.1:6379: 2 nodes" in (run_dir / "launch.log").read_text()

"""A run of two ranks on two SLURM nodes (`resources.nodes=2`): the job runs once, on its first node, and starts the
ranks with srun, one a node (tests/slurm/local_cluster.sh with SLURM_LOCAL_NODES=2: two slurmd on this host)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.sweep import submitted_jobs
from tests.conftest import FAST_RUN, wait_for
from tests.local_slurm import local_cluster
from tests.test_dispatch_slurm import attempts, env_for, start_sweep, steps, summary

# The worker of the other SLURM tests: one cluster on this machine at a time.
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[None]:
    with local_cluster(nodes=2):
        yield


def steps_of(job_id: str) -> list[tuple[str, int, int]]:
    """The job's steps in SLURM's accounting: (id, nodes, tasks)."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,NNodes,NTasks"], capture_output=True, text=True, timeout=60
    )
    rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 2]
    return [(r[0], int(r[1]), int(r[2])) for r in rows if r[0].startswith(f"{job_id}.") and r[2].isdigit()]


@pytest.mark.integration
def test_two_ranks_on_two_nodes_start_with_srun_and_train_one_run(
    two_nodes: None, spider_mini_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    sweep_dir, log = tmp_path / "sweep", tmp_path / "sweep.log"
    # 2 nodes x 1 rank of the CPU cluster: the job asks no GPU and 1 CPU a node
    cpu_job = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1"]
    cpu_job += ["hydra.launcher.mem_gb=4", "hydra.launcher.timeout_min=30"]
    ranks = ["resources.nodes=2", "resources.gpus_per_node=1"]
    args = ["-m", *FAST_RUN, *ranks, *cpu_job, f"hydra.sweep.dir={sweep_dir}"]
    sweep = start_sweep(args, env_for(cache_dir, tmp_path), log)
    try:
        returncode = sweep.wait(timeout=600)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert returncode == 0, log.read_text()[-3000:]
    run = sweep_dir / "0"
    done = summary(run)
    assert done["status"] == "completed" and done["world_size"] == 2 and done["steps"] == 2, done
    assert done["rollouts_per_rank"] == [4, 4]  # both ranks ran their share of the rollouts
    assert done["sharding"] == "fsdp2"  # the model was sharded across the two nodes' ranks
    assert steps(run) == [0, 1, 2]  # rank 0 alone writes metrics
    (job,) = submitted_jobs(sweep_dir).values()
    assert [a["slurm_job_id"] for a in attempts(run)] == [job["job_id"]]  # one attempt: the ranks are not attempts
    (rank_dir,) = (run / "ranks").glob("slurm-*")  # srun's step in this job, each task's output apart
    assert rank_dir.name == f"slurm-{job['job_id']}.0"
    logs = {p.parent.name: p.read_text() for p in rank_dir.glob("*/stderr.log")}
    assert sorted(logs) == ["0", "1"]
    assert "Writing model shards" in logs["0"] and "Writing model shards" not in logs["1"]  # rank 0 saves
    # the job ran once, on one node (submitit's step), and its ranks as one step of 2 tasks over both nodes
    wait_for(lambda: (job["job_id"] + ".1", 2, 2) in steps_of(job["job_id"]), 60, "the ranks' step in sacct")
    assert (job["job_id"] + ".0", 1, 1) in steps_of(job["job_id"])


@pytest.mark.integration
def test_sigint_to_the_run_stops_both_srun_ranks_after_one_step_and_leaves_no_process(
    two_nodes: None, spider_mini_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """SIGINT (Ctrl-C) to the job's process that started the ranks: it stops them through srun (as SIGUSR1: srun
    would kill them on a SIGTERM, and take a single SIGINT for a status request), both end the same step with a
    checkpoint, the run says `interrupted`, and nothing that carries the run's mark is left on the nodes."""
    import psutil

    from foundation.ranks import RANK_OF
    from tests.test_dispatch_slurm import wait_for as wait_for_sweep

    sweep_dir, log = tmp_path / "sweep", tmp_path / "sweep.log"
    cpu_job = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1"]
    cpu_job += ["hydra.launcher.mem_gb=4", "hydra.launcher.timeout_min=30"]
    ranks = ["resources.nodes=2", "resources.gpus_per_node=1", "algorithm.max_steps=50"]
    args = ["-m", *FAST_RUN, *ranks, *cpu_job, f"hydra.sweep.dir={sweep_dir}"]
    sweep = start_sweep(args, env_for(cache_dir, tmp_path), log)
    run = sweep_dir / "0"

    def run_processes() -> list[int]:
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                if proc.environ().get(RANK_OF) == str(run):
                    found.append(proc.pid)
        return found

    try:
        first_step = lambda: (run / "metrics.jsonl").is_file() and len(steps(run)) >= 2  # noqa: E731
        wait_for_sweep("the ranks' first GRPO step", first_step, sweep, log)
        assert len(run_processes()) >= 2  # the two ranks
        # the process that started the ranks: the job's python in its first step (the ranks' step is the second)
        job_id = attempts(run)[-1]["slurm_job_id"]  # jobs/job.py's slurm_job_id: <array job>_<task>

        def is_launcher(env: dict[str, str]) -> bool:
            own = f"{env.get('SLURM_ARRAY_JOB_ID')}_{env.get('SLURM_ARRAY_TASK_ID')}"
            return job_id in (own, env.get("SLURM_JOB_ID")) and env.get("SLURM_STEP_ID") == "0"

        launcher = [
            proc
            for proc in psutil.process_iter(["name", "environ"])
            if "python" in (proc.info["name"] or "") and is_launcher(proc.info["environ"] or {})
        ]
        assert len(launcher) == 1, launcher
        launcher[0].send_signal(signal.SIGINT)
        sweep.wait(timeout=300)
        wait_for_sweep("the run's processes to end", lambda: not run_processes(), timeout=60)
    finally:
        if sweep.poll() is None:
            sweep.kill()
        for job in submitted_jobs(sweep_dir).values():
            subprocess.run(["scancel", job["job_id"]], capture_output=True)
    assert summary(run)["status"] == "interrupted", summary(run)
    logs = [p.read_text() for p in sorted((run / "ranks").glob("slurm-*/*/stderr.log"))]
    stops = {m for text in logs for m in re.findall(r"SIGUSR1 during GRPO: stopped after step (\d+)", text)}
    assert len(logs) == 2 and len(stops) == 1, (stops, [text[-1500:] for text in logs])
    shards = sorted(
        p.name for p in (run / "checkpoints" / f"checkpoint-{stops.pop()}" / "pytorch_model_fsdp_0").glob("*.distcp")
    )
    assert shards == ["__0_0.distcp", "__1_0.distcp"]

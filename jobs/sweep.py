"""A sweep directory: Hydra's numbered run directories, and the SLURM jobs submitted for them.

    <sweep_dir>/multirun.yaml        the sweep's config (Hydra)
    <sweep_dir>/<n>/                 run n's directory (`summary.json`, `metrics.jsonl`, ...)
    <sweep_dir>/jobs.jsonl           one line per submitted job: run number, overrides, SLURM job id, submitit folder
    <sweep_dir>/.submitit/<job id>/  submitit's pickles and the job's stdout/stderr

Re-running a sweep into the same directory (`hydra.sweep.dir=...`) runs again only what did not complete: a run whose
`summary.json` says completed with the same overrides is skipped; a directory that holds a run of other overrides is
an error, never overwritten.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

JOBS_FILE = "jobs.jsonl"

# SLURM job states (squeue/sacct) grouped the way `analysis.status` reports them.
QUEUED_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
RUNNING_STATES = {"RUNNING", "CONFIGURING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING", "SUSPENDED", "STOPPED"}

# Why a pending job can never start as it asks (squeue's reason, with EnforcePartLimits=NO SLURM queues such jobs
# instead of refusing them), and the keys that ask for it.
NEVER_STARTS = {
    "PartitionConfig": "it asks more CPUs, memory or GPUs a node than the partition has: hydra.launcher.cpus_per_task, "
    "hydra.launcher.mem_gb, resources.gpus_per_node, or another hydra.launcher.partition",
    "PartitionNodeLimit": "it asks more nodes than the partition has or allows: resources.nodes, or another "
    "hydra.launcher.partition",
    "PartitionTimeLimit": "its time limit is over the partition's: hydra.launcher.timeout_min, or another "
    "hydra.launcher.partition",
    "BadConstraints": "no node meets its constraints: hydra.launcher.constraint",
    "InvalidAccount": "its account does not exist or is not yours: hydra.launcher.account",
    "InvalidQOS": "its QOS does not exist or is not allowed: hydra.launcher.qos",
    "QOSNotAllowed": "its QOS is not allowed in this partition or account: hydra.launcher.qos",
    "AccountNotAllowed": "its account may not use this partition: hydra.launcher.account, hydra.launcher.partition",
}
START_CHECK_S = 60.0  # how long after submission jobs are watched for a reason of NEVER_STARTS


class RunDirConflict(RuntimeError):
    """A run directory holds a run of other overrides (another sweep wrote into this sweep directory)."""


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None


def recorded_overrides(run_dir: Path) -> list[str] | None:
    """The overrides a run directory was started with: its summary's, else Hydra's `.hydra/overrides.yaml`."""
    summary = read_summary(run_dir)
    if summary is not None and "overrides" in summary:
        return list(summary["overrides"])
    hydra_file = run_dir / ".hydra" / "overrides.yaml"
    if hydra_file.is_file():
        return [str(o) for o in OmegaConf.load(hydra_file)]
    return None


def completed_run(run_dir: Path, overrides: list[str]) -> dict[str, Any] | None:
    """The summary of the run that completed in `run_dir` with these overrides, or None when it has to run (it never
    started, failed or was interrupted). Raises RunDirConflict if `run_dir` holds a run of other overrides."""
    recorded = recorded_overrides(run_dir)
    if recorded is None:
        return None
    if sorted(recorded) != sorted(overrides):
        raise RunDirConflict(
            f"{run_dir} holds a run of other overrides ({' '.join(recorded)}), not {' '.join(overrides)}: "
            "give this sweep its own hydra.sweep.dir"
        )
    summary = read_summary(run_dir)
    return summary if summary is not None and summary.get("status") == "completed" else None


def record_jobs(sweep_dir: Path, jobs: list[dict[str, Any]]) -> None:
    """Append submitted jobs (`num`, `overrides`, `job_id`, `folder`) to `jobs.jsonl`."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with (sweep_dir / JOBS_FILE).open("a", encoding="utf-8") as f:
        for job in jobs:
            f.write(json.dumps({**job, "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")


def submitted_jobs(sweep_dir: Path) -> dict[int, dict[str, Any]]:
    """The latest job submitted for each run number."""
    path = sweep_dir / JOBS_FILE
    if not path.is_file():
        return {}
    jobs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {job["num"]: job for job in jobs}


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """SLURM's state of each job id (`123` or array task `123_4`): squeue for live jobs, sacct for finished ones.
    Empty where SLURM's commands are not installed."""
    if not job_ids or shutil.which("squeue") is None:
        return {}
    states: dict[str, str] = {}
    live = subprocess.run(["squeue", "--me", "-h", "-r", "-o", "%i|%T"], capture_output=True, text=True, timeout=60)
    for line in live.stdout.splitlines():
        job_id, _, state = line.partition("|")
        states[job_id.strip()] = state.strip()
    rest = [j for j in job_ids if j not in states]
    if rest and shutil.which("sacct"):
        done = subprocess.run(
            ["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(rest)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        for line in done.stdout.splitlines():
            job_id, _, state = line.partition("|")
            if job_id in rest:
                states[job_id] = state.split()[0] if state.strip() else "UNKNOWN"  # "CANCELLED by 0"
    return {j: states[j] for j in job_ids if j in states}


def jobs_that_cannot_start(job_ids: list[str], within_s: float = START_CHECK_S, poll_s: float = 2.0) -> dict[str, str]:
    """The jobs among `job_ids` that pend for a reason of NEVER_STARTS, with that reason. Each job is watched until
    it starts, pends for a reason that can pass (Resources, Priority, ...) or for one that cannot; `within_s` at most
    (SLURM's scheduler gives a new job its reason within a scheduling cycle, seconds). A job that first pends behind
    others (Priority) is not watched on: on a busy cluster its limits are only checked when its turn comes. squeue
    failing or not answering ends the watch with what was found (the jobs are waited for as before)."""
    if not job_ids or shutil.which("squeue") is None:
        return {}
    deadline = time.monotonic() + within_s
    unsettled, stuck = set(job_ids), {}
    while unsettled:
        try:
            listed = subprocess.run(
                ["squeue", "-h", "-r", "-j", ",".join(sorted(unsettled)), "-o", "%i|%T|%r"],
                capture_output=True,
                text=True,
                timeout=max(1.0, deadline - time.monotonic()),
            )
        except (subprocess.TimeoutExpired, OSError):
            break
        reasons = {}
        for line in listed.stdout.splitlines():
            job_id, state, reason = (part.strip() for part in line.split("|", 2))
            reasons[job_id] = reason if state == "PENDING" else state
        for job_id in list(unsettled):
            reason = reasons.get(job_id, "gone")
            if reason in NEVER_STARTS:
                stuck[job_id] = reason
            if reason != "None":  # "None": not looked at by the scheduler yet
                unsettled.discard(job_id)
        if not unsettled or time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    return stuck


def listed_state(job_id: str) -> str | None:
    """The state of a job that SLURM still lists (squeue: queued, running, completing, requeued), else None. squeue
    reads the controller, where sacct reads the accounting database, which lags behind it."""
    if shutil.which("squeue") is None:
        return None
    out = subprocess.run(["squeue", "-h", "-r", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or None


def live_jobs(sweep_dir: Path) -> dict[int, dict[str, Any]]:
    """The recorded jobs of this sweep that SLURM still has queued or running, by run number."""
    jobs = submitted_jobs(sweep_dir)
    states = slurm_states([job["job_id"] for job in jobs.values()])
    return {num: job for num, job in jobs.items() if states.get(job["job_id"]) in QUEUED_STATES | RUNNING_STATES}

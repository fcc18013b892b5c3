"""Dispatch on a real SLURM cluster that this module starts and stops (tests/slurm/local_cluster.sh: Debian's
slurmctld, slurmd, slurmdbd, munge, MariaDB; needs root, installs them with apt if missing).

One 4-run sweep of the tiny CPU experiment, 2 jobs at a time: one run fails, one is requeued from outside
(`scontrol requeue`) and one is preempted (USR2, what SLURM sends before a time limit or a preemption) in the middle;
both resume from their checkpoints in the same run directory. Then the same sweep is submitted again without waiting:
only the failed run is resubmitted, and `analysis.status` follows it. Where SLURM cannot start, the tests fail with
the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from submitit.core.utils import JobPaths

from analysis.status import sweep_status
from jobs.sweep import submitted_jobs
from tests.conftest import FAST_RUN, ROOT
from tests.jobs import RELEASE
from tests.local_slurm import local_cluster

# One xdist worker runs the whole file: its cluster and its sweep are module fixtures.
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

CHECKPOINT_1 = Path("checkpoints", "checkpoint-1", "trainer_state.json")  # written last: the checkpoint is complete

# Each job: 1 CPU (2 jobs at once on 2 cores), no GPU; a time limit over 10 min, so that USR2 reads as a preemption.
SLURM = [
    "hydra/launcher=slurm",
    "resources.gpus_per_node=0",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=4",
    "hydra.launcher.timeout_min=30",
    "hydra.launcher.array_parallelism=2",
]
# 3 GRPO steps, a checkpoint after each, validation before and after; run 2 fails its config validation (lr -1).
# Runs 0 and 1 wait after their first checkpoint until they are interrupted (tests.jobs.held_train).
SWEEP = [
    *FAST_RUN,
    "job._target_=tests.jobs.held_train",
    "+job._schema_=tests.jobs.HeldTrain",
    "+job.hold=[0,1]",
    "warmstart.steps=2",
    "algorithm.max_steps=3",
    "algorithm.val_every=3",
    "algorithm.learning_rate=1e-4,2e-4,-1,3e-4",
]


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[None]:
    with local_cluster():
        yield


def env_for(cache: Path, output: Path) -> dict[str, str]:
    return os.environ | {"ARL_CACHE_DIR": str(cache), "ARL_OUTPUT_DIR": str(output), "HF_HUB_OFFLINE": "1"}


def start_sweep(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`python launch.py ARGS` in the background, its output in `log`."""
    with log.open("w") as log_file:
        return subprocess.Popen(
            [sys.executable, "launch.py", *args], cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT
        )


def wait_for(
    what: str,
    check: Callable[[], Any],
    sweep: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    timeout: float = 400,
) -> Any:
    """Poll `check` until it returns something true; fail (not hang) after `timeout` s or if the sweep ends first,
    showing the end of the sweep's `log`."""
    deadline = time.monotonic() + timeout

    def fail(why: str) -> None:
        pytest.fail(why + (f"; the sweep's log ends:\n{log.read_text()[-4000:]}" if log and log.is_file() else ""))

    while not (value := check()):
        if sweep is not None and sweep.poll() is not None:
            fail(f"the sweep ended (exit {sweep.returncode}) before {what}")
        if time.monotonic() > deadline:
            fail(f"gave up waiting for {what} after {timeout} s")
        time.sleep(0.5)
    return value


def statuses(sweep_dir: Path) -> dict[int, str]:
    return {r.num: r.status for r in sweep_status(sweep_dir)}


def requeue(job_id: str) -> None:
    """What an operator does: the job is killed and queued again (its process is not told; SIGTERM is ignored)."""
    subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, timeout=60)


def preempt(job_id: str) -> None:
    """USR2, what SLURM sends a job before its time limit or a preemption (`--signal`). slurm 22.05's scancel delivers
    it to a running task of an array whose other tasks are pending, then answers "Job can not be altered now" and
    retries every ~5 s, delivering it again each time: it is stopped before its first retry."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(["scancel", "--signal=USR2", job_id], capture_output=True, timeout=3)


def summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def attempts(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]


def steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def slurm_sweep(
    slurm_cluster: None, spider_mini_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Runs the sweep (waiting for it, as hydra-submitit-launcher does); requeues run 0 and preempts run 1 after
    their first checkpoint; returns what was seen on the way."""
    out = tmp_path_factory.mktemp("slurm")
    sweep_dir = out / "sweep"
    args = ["-m", *SWEEP, *SLURM, f"hydra.sweep.dir={sweep_dir}"]
    seen: dict[str, Any] = {"sweep_dir": sweep_dir, "args": args, "env": env_for(cache_dir, out)}
    log = out / "sweep.log"
    sweep = start_sweep(args, seen["env"], log)
    try:
        wait_for("the jobs to be submitted", lambda: len(submitted_jobs(sweep_dir)) == 4, sweep, log)
        jobs = submitted_jobs(sweep_dir)
        seen["first_status"] = statuses(sweep_dir)

        interrupted: set[int] = set()

        def interrupt() -> bool:
            for num, how in ((0, requeue), (1, preempt)):
                if num not in interrupted and (sweep_dir / str(num) / CHECKPOINT_1).is_file():
                    how(jobs[num]["job_id"])
                    interrupted.add(num)
            return interrupted == {0, 1}

        wait_for("the first checkpoints of runs 0 and 1", interrupt, sweep, log)

        # "queued" lasts until SLURM starts the job again, which can be before the next poll: its second attempt is
        # the durable sign
        def requeued() -> bool:
            second = (sweep_dir / "0" / "attempts.jsonl").is_file() and len(attempts(sweep_dir / "0")) >= 2
            return second or statuses(sweep_dir)[0] == "queued"

        wait_for("run 0 to be queued again (its status, or its second attempt)", requeued, sweep, log)
        wait_for(
            "run 1's interrupted summary", lambda: summary(sweep_dir / "1").get("status") == "interrupted", sweep, log
        )
        seen["returncode"] = sweep.wait(timeout=600)
        seen["output"] = log.read_text()
        yield seen
    finally:
        if sweep.poll() is None:
            sweep.kill()
        for job in submitted_jobs(sweep_dir).values():  # only this sweep's jobs, if any are left
            subprocess.run(["scancel", job["job_id"]], capture_output=True)


@pytest.mark.integration
def test_a_slurm_sweep_survives_a_failure_a_requeue_and_a_preemption(slurm_sweep: dict[str, Any]) -> None:
    sweep_dir, output = slurm_sweep["sweep_dir"], slurm_sweep["output"]
    first = slurm_sweep["first_status"]
    assert (first[2], first[3]) == ("queued", "queued")  # array parallelism 2: runs 2 and 3 wait

    # The failing run fails alone: the sweep exits 1 once every job is done, the other runs complete.
    assert slurm_sweep["returncode"] == 1, output[-3000:]
    failed = summary(sweep_dir / "2")
    assert failed["status"] == "failed" and "algorithm.learning_rate must be > 0" in failed["error"]
    for num in (0, 1, 3):
        done = summary(sweep_dir / str(num))
        assert done["status"] == "completed" and done["steps"] == 3, done
        assert steps(sweep_dir / str(num)) == [0, 1, 2, 3]  # no step twice, none missing
    # Both interrupted runs went on in their own run directory from a checkpoint, not from the start.
    for num in (0, 1):
        assert summary(sweep_dir / str(num))["resumed_from"].startswith("checkpoint-")
        assert summary(sweep_dir / str(num))["attempts"] == 2  # the kill left no summary for run 0: counted anyway
        assert len({a["slurm_job_id"] for a in attempts(sweep_dir / str(num))}) == 1  # requeued: the same job
    assert "resumed_from" not in summary(sweep_dir / "3") and summary(sweep_dir / "3")["attempts"] == 1
    jobs = submitted_jobs(sweep_dir)
    assert len(jobs) == 4 and len((sweep_dir / "jobs.jsonl").read_text().splitlines()) == 4  # resumed, not resubmitted
    preempted_log = JobPaths(jobs[1]["folder"], job_id=jobs[1]["job_id"], task_id=0).stderr
    assert "Caught signal SIGUSR2" in preempted_log.read_text()
    assert statuses(sweep_dir) == {0: "completed", 1: "completed", 2: "failed", 3: "completed"}


@contextlib.contextmanager
def cluster_full() -> Iterator[str]:
    """A job that holds the whole node (another user's, say) while the block runs: what is submitted meanwhile
    stays queued until the block ends and cancels it. Yields its job id once it runs."""
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--exclusive", "--time=30", "--output=/dev/null", "--wrap", "sleep 900"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()

    def state() -> str:
        return subprocess.run(
            ["squeue", "-h", "-j", blocker, "-o", "%T"], capture_output=True, text=True, timeout=60
        ).stdout.strip()

    try:
        wait_for("the blocking job to run", lambda: state() == "RUNNING", timeout=120)
        yield blocker
    finally:
        subprocess.run(["scancel", blocker], capture_output=True, timeout=60)


@pytest.mark.integration
def test_submit_and_return_resubmits_only_the_failed_run(slurm_sweep: dict[str, Any]) -> None:
    """With the node taken by another job, the launcher (wait=false) submits the failed run alone and returns while
    it is queued; once the node frees, it runs and fails again, its second attempt in the same run directory."""
    sweep_dir = slurm_sweep["sweep_dir"]
    before = submitted_jobs(sweep_dir)
    with cluster_full():
        again = subprocess.run(
            [sys.executable, "launch.py", *slurm_sweep["args"], "hydra.launcher.wait=false"],
            cwd=ROOT,
            env=slurm_sweep["env"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        log = again.stdout + again.stderr
        assert again.returncode == 0, log[-3000:]
        assert log.count("completed before, not submitted") == 3 and "python -m analysis.status" in log
        after = submitted_jobs(sweep_dir)
        assert [n for n in after if after[n] != before[n]] == [2]
        assert statuses(sweep_dir)[2] == "queued"  # the launcher returned while the job waits for the node

    wait_for("the resubmitted run to fail again", lambda: statuses(sweep_dir)[2] == "failed")
    assert summary(sweep_dir / "2")["attempts"] == 2
    assert [a["slurm_job_id"] for a in attempts(sweep_dir / "2")] == [before[2]["job_id"], after[2]["job_id"]]
    shown = subprocess.run(
        [sys.executable, "-m", "analysis.status", str(sweep_dir)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0
    assert f"{sweep_dir}: 4 runs: 3 completed, 1 failed" in shown.stdout
    assert f"job {after[2]['job_id']} (COMPLETED)" in shown.stdout  # Hydra caught the error: SLURM saw it complete
    assert "algorithm.learning_rate must be > 0" in shown.stdout


@pytest.mark.integration
def test_a_rerun_waits_for_a_job_still_running_instead_of_submitting_it_twice(
    slurm_cluster: None, tmp_path: Path
) -> None:
    sweep_dir, log = tmp_path / "sweep", tmp_path / "again.log"
    quick = ["job._target_=tests.jobs.quick", "+job._schema_=tests.jobs.QuickJob", "+job.hold=[0]"]
    args = ["-m", *quick, *SLURM, f"hydra.sweep.dir={sweep_dir}"]
    env = env_for(tmp_path / "cache", tmp_path)

    submit = subprocess.run(
        [sys.executable, "launch.py", *args, "hydra.launcher.wait=false"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submit.returncode == 0, (submit.stdout + submit.stderr)[-3000:]
    wait_for("run 0 to start (it then waits to be released)", lambda: (sweep_dir / "0" / "executions").is_file())
    again = start_sweep(args, env, log)  # while the job is held: finds it and waits for it
    try:
        waiting = "is still queued or running, not submitted"
        wait_for("the second launch to find the job", lambda: waiting in log.read_text(), again, log)
        (sweep_dir / "0" / RELEASE).touch()
        returncode = again.wait(timeout=300)
    finally:
        if again.poll() is None:
            again.kill()
    assert returncode == 0, log.read_text()[-3000:]
    assert len((sweep_dir / "jobs.jsonl").read_text().splitlines()) == 1
    assert (sweep_dir / "0" / "executions").read_text() == "1"
    assert json.loads((sweep_dir / "0" / "summary.json").read_text())["status"] == "completed"


@pytest.mark.integration
def test_a_cancelled_job_fails_its_run_and_the_sweep_still_waits_for_the_others(
    slurm_cluster: None, tmp_path: Path
) -> None:
    sweep_dir, log = tmp_path / "sweep", tmp_path / "sweep.log"
    args = [
        "-m",
        "job._target_=tests.jobs.quick",
        "+job._schema_=tests.jobs.QuickJob",
        "+job.hold=[0]",  # run 0 waits until it is cancelled; run 1 completes at once
        "seed=0,1",
        *SLURM,
        f"hydra.sweep.dir={sweep_dir}",
    ]
    sweep = start_sweep(args, env_for(tmp_path / "cache", tmp_path), log)
    try:
        wait_for(
            "run 0 to start (it then waits until it is cancelled)",
            lambda: (sweep_dir / "0" / "executions").is_file(),
            sweep,
            log,
        )
        subprocess.run(["scancel", submitted_jobs(sweep_dir)[0]["job_id"]], check=True, timeout=60)
        returncode = sweep.wait(timeout=300)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    output = log.read_text()
    assert returncode == 1, output[-3000:]  # the cancelled run fails the sweep...
    assert summary(sweep_dir / "1")["status"] == "completed"  # ...once the other run has completed
    assert "has not produced any output" in output  # submitit's error for the cancelled job, raised last by Hydra
    assert statuses(sweep_dir) == {0: "failed", 1: "completed"}


@pytest.mark.integration
def test_a_job_that_can_never_start_fails_its_run_at_once(slurm_cluster: None, tmp_path: Path) -> None:
    """The job asks 8 CPUs of a 2-CPU partition: SLURM queues it (Reason=PartitionConfig), where it would wait
    forever. The launcher finds it within a minute of submitting it, cancels it and fails its run, naming the reason
    and the keys to change."""
    sweep_dir, log = tmp_path / "sweep", tmp_path / "sweep.log"
    args = [
        "-m",
        "job._target_=tests.jobs.quick",
        "+job._schema_=tests.jobs.QuickJob",
        *SLURM,
        "hydra.launcher.cpus_per_task=8",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    sweep = start_sweep(args, env_for(tmp_path / "cache", tmp_path), log)
    try:
        returncode = sweep.wait(timeout=300)  # a hang guard; the launcher gives up on the job after 60 s at most
    finally:
        if sweep.poll() is None:
            sweep.kill()
    output = log.read_text()
    assert returncode == 1, output[-3000:]
    job_id = submitted_jobs(sweep_dir)[0]["job_id"]
    reason = f"job {job_id} can never start (SLURM: Reason=PartitionConfig)"
    assert reason in output and "hydra.launcher.cpus_per_task" in output, output[-3000:]
    failed = summary(sweep_dir / "0")
    assert failed["status"] == "failed" and failed["error"].startswith(reason) and "cancelled" in failed["error"]
    listed = subprocess.run(["squeue", "-h", "-r", "-j", job_id], capture_output=True, text=True, timeout=60)
    assert listed.stdout.strip() == ""  # cancelled, not left pending
    assert not (sweep_dir / "0" / "executions").is_file()  # it never ran
    assert statuses(sweep_dir) == {0: "failed"}

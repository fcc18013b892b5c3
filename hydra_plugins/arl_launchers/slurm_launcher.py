"""`hydra/launcher=slurm`: hydra-submitit-launcher's SLURM launcher, plus what this project's sweeps need.

- Runs that completed in the sweep directory with the same overrides are not submitted again, nor are runs whose job
  SLURM still has queued or running (`jobs/sweep.py`); the others are submitted as one job array.
- Each submitted job is appended to `<sweep_dir>/jobs.jsonl`, which `python -m analysis.status <sweep_dir>` reads.
- `hydra.launcher.wait=false` submits and returns: no process waits for the sweep.
- A job of several nodes runs its run once, as task 0 on its first node (`srun_args`), and is waited for as such.
- A job that can never start as it asks (squeue's reason PartitionConfig: more CPUs or memory than the partition
  has; PartitionTimeLimit, ...) is found within a minute of its submission, cancelled, and its run fails with the
  reason and the keys to change (`summary.json` says so too); the other runs go on.
- Waiting survives requeues (a job that SLURM still lists is waited for again), and a job that ends without a result
  (cancelled, killed for memory) is a failed run: the others are still waited for, then the sweep exits non-zero.

(Hydra loads launchers only from the `hydra_plugins` package, hence this folder.)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf, open_dict

from foundation.run_dir import RunDir
from jobs.sweep import NEVER_STARTS, completed_run, jobs_that_cannot_start, listed_state, live_jobs, record_jobs

log = logging.getLogger(__name__)


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    def __init__(self, wait: bool = True, **params: Any) -> None:
        super().__init__(**params)
        self.wait = wait

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        import submitit  # lazy, as in hydra-submitit-launcher: plugin discovery stays fast

        assert self.config is not None
        sweeper = self.config.hydra.sweeper._target_
        if not self.wait and not sweeper.endswith("BasicSweeper"):
            raise ValueError(f"hydra.launcher.wait=false needs the basic (grid) sweeper; {sweeper} needs results")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        folder = self.params["submitit_folder"]
        live = live_jobs(sweep_dir)
        returns: dict[int, JobReturn] = {}
        waiting: dict[int, tuple[Any, list[str]]] = {}
        todo: list[tuple[int, list[str]]] = []
        for num, overrides in enumerate(job_overrides, initial_job_idx):
            overrides = list(overrides)
            shown = " ".join(filter_overrides(overrides))
            previous = completed_run(self._run_dir(num, overrides), overrides)
            if previous is not None:
                log.info(f"\t#{num} : {shown} : completed before, not submitted")
                returns[num] = JobReturn(overrides=overrides, status=JobStatus.COMPLETED, _return_value=previous)
            elif num in live:
                job = live[num]
                log.info(f"\t#{num} : {shown} : job {job['job_id']} is still queued or running, not submitted")
                waiting[num] = (submitit.SlurmJob(folder=job["folder"], job_id=job["job_id"], tasks=[0]), overrides)
            else:
                log.info(f"\t#{num} : {shown}")
                todo.append((num, overrides))

        if todo:
            executor = self._executor()
            singleton_state = Singleton.get_state()
            args = [(ov, "hydra.sweep.dir", num, f"job_id_for_{num}", singleton_state) for num, ov in todo]
            jobs = executor.map_array(self, *zip(*args, strict=True))
            record_jobs(
                sweep_dir,
                [
                    {"num": num, "overrides": ov, "job_id": job.job_id, "folder": folder}
                    for (num, ov), job in zip(todo, jobs, strict=True)
                ],
            )
            waiting |= {num: (job, ov) for (num, ov), job in zip(todo, jobs, strict=True)}
            log.info(f"Submitted {len(jobs)} job(s) to SLURM: {', '.join(job.job_id for job in jobs)}")
            stuck = jobs_that_cannot_start([job.job_id for job in jobs])
            for num, job in zip((num for num, _ in todo), jobs, strict=True):
                if job.job_id in stuck:
                    returns[num] = self._never_starts(num, job.job_id, stuck[job.job_id], waiting.pop(num)[1])
        if not self.wait:
            log.info(
                f"Not waiting (hydra.launcher.wait=false); the sweep's state: python -m analysis.status {sweep_dir}"
            )
            return list(returns.values())
        for num, (job, overrides) in waiting.items():
            # Task 0 runs the run (`srun_args`); submitit counts nodes x tasks_per_node tasks and would wait for
            # results that the other nodes' tasks never write.
            returns[num] = self._result(num, job.task(0), overrides)
        return [returns[num] for num in sorted(returns)]

    def _never_starts(self, num: int, job_id: str, reason: str, overrides: list[str]) -> JobReturn:
        """A job that pends for a reason it cannot leave: cancelled; its run fails saying why and what to change."""
        import subprocess

        try:
            cancelled = subprocess.run(["scancel", job_id], capture_output=True, timeout=60).returncode == 0
        except (subprocess.TimeoutExpired, OSError):
            cancelled = False
        outcome = "it was cancelled" if cancelled else f"cancelling it failed: scancel {job_id}"
        message = f"job {job_id} can never start (SLURM: Reason={reason}): {NEVER_STARTS[reason]}; {outcome}"
        log.error(f"\t#{num} : {message}")
        RunDir(self._run_dir(num, overrides)).write_summary(
            {"job": None, "overrides": overrides, "status": "failed", "error": message, "slurm_job_id": job_id}
        )
        return JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=RuntimeError(message))

    @staticmethod
    def _result(num: int, job: Any, overrides: list[str]) -> JobReturn:
        """The run's JobReturn once its job has ended. submitit decides that a job ended from a `sacct` reading taken
        now and then; a job requeued (by an operator, a node failure or its own preemption) passes through states
        that read as the end, so while squeue still lists the job, it is waited for again. A job that ended without
        a result is a failed run (the error names the job and the end of its stderr), not the end of the wait."""
        from submitit.core.utils import FailedJobError, UncompletedJobError

        while True:
            try:
                return job.result()
            except UncompletedJobError as error:
                state = listed_state(job.job_id)
                if state is None:
                    return JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=error)
                log.warning(f"\t#{num} : job {job.job_id} is {state} again (requeued): waiting for it")
                job.watcher.clear()  # submitit cached the job as finished
            except FailedJobError as error:  # the job's own process failed outside the run (Hydra catches the run's)
                return JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=error)

    def _run_dir(self, num: int, overrides: list[str]) -> Path:
        """Where run `num` writes, as Hydra's run_job computes it (sweep dir / subdir)."""
        assert self.hydra_context is not None and self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        if OmegaConf.to_container(self.config.hydra.sweep)["subdir"] == "${hydra.job.num}":  # Hydra's default
            return sweep_dir / str(num)
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = num
        return sweep_dir / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))

    def _executor(self) -> Any:
        """The submitit executor for these parameters (what hydra-submitit-launcher's launch builds)."""
        import submitit

        init_keys = {"submitit_folder", "max_num_timeout"}
        executor = submitit.AutoExecutor(
            cluster=self._EXECUTOR,
            folder=self.params["submitit_folder"],
            slurm_max_num_timeout=self.params["max_num_timeout"],
        )
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in shared else f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k not in init_keys}
        )
        return executor

"""What every job shares: its run directory, config validation, and a `summary.json` whatever happens.

`summary.json` says `completed`, `failed` (an exception, with `error` and `traceback`) or `interrupted` (the process
was told to stop: SIGTERM, Ctrl-C; with `stopped_at` (the phase and last logged step), the latest complete
`checkpoint` and the command that resumes it; a requeued job runs again and resumes). It describes the latest attempt;
`attempts` counts the starts in this directory, one line each in `attempts.jsonl` (time, commit, host, SLURM job).
`wall_s` is the run's wall time over its attempts (`attempt_wall_s` the latest one's): those that wrote a summary,
`wall_s_attempts` of them (an attempt killed before it could write one is not counted).
In a sweep, a run that completed before in its directory with the same overrides is not run again.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shlex
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf

from foundation.errors import ConfigError
from foundation.interrupt import stop_signals
from foundation.ranks import STACKS_SIGNAL, is_main, started_by_launcher
from foundation.run_dir import RunDir, git_commit, last_complete_checkpoint
from jobs.config import build_group, check_job, check_run
from jobs.doctor import PreflightFailed
from jobs.ranks import write_rank_results
from jobs.sweep import completed_run, read_summary

# failures whose message says what to change (a config key, the doctor's table): a run stops with one line, no traceback
STOPS_WITHOUT_TRACEBACK = (ConfigError, PreflightFailed)

Job = Callable[[DictConfig, RunDir], dict[str, Any]]


def slurm_job_id() -> str | None:
    """This job's id as squeue, sacct and `jobs.jsonl` show it (`<array job>_<task>` in an array); None outside
    SLURM."""
    env = os.environ
    if "SLURM_ARRAY_JOB_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def resume_command(hydra: DictConfig, run: RunDir) -> str:
    """What runs an interrupted run again in its directory, where it resumes from its latest checkpoint."""
    if hydra.mode == RunMode.MULTIRUN:
        return f"the sweep's command again with hydra.sweep.dir={hydra.sweep.dir} (completed runs are skipped)"
    overrides = [shlex.quote(o) for o in hydra.overrides.task if not o.startswith("hydra.run.dir=")]
    return " ".join(["python launch.py", *overrides, f"hydra.run.dir={shlex.quote(str(run.path))}"])


def interruption(run: RunDir, hydra: DictConfig) -> dict[str, Any]:
    """Where an interrupted run stopped and how to go on."""
    return {
        "stopped_at": {"phase": run.phase, "step": run.last_step()},
        "checkpoint": last_complete_checkpoint(run.checkpoints),
        "resume": resume_command(hydra, run),
    }


def start_tracker(cfg: DictConfig, run: RunDir, hydra: DictConfig) -> Any:
    """The `logger` group's tracker, started and attached to `run`; None for logger=none or when it fails to start
    (reported once: the run goes on with metrics.jsonl). A bad logger config still fails the run here."""
    tracker = build_group(cfg, "logger")
    if tracker is None:
        return None
    try:
        tracker.start(run, cfg, hydra)
    except Exception as exc:
        run.tracking_errors.append(f"{type(tracker).__name__}.start: {type(exc).__name__}: {exc}")
        print(f"tracking off ({run.tracking_errors[-1]}); metrics.jsonl goes on", file=sys.stderr, flush=True)
        return None
    run.trackers.append(tracker)
    return tracker


def finish_tracker(tracker: Any, summary: dict[str, Any], run: RunDir) -> None:
    """Close `tracker` with the run's summary (already written), if it is still tracking; a failure is added to the
    summary, never raised."""
    if tracker is None or tracker not in run.trackers:
        return
    try:
        tracker.finish(summary)
    except Exception as exc:
        summary["tracking_errors"] = [*summary["tracking_errors"], f"{type(tracker).__name__}.finish: {exc}"]
        print(f"tracking: {summary['tracking_errors'][-1]}", file=sys.stderr, flush=True)
        run.write_summary(summary)


def end_process_group() -> None:
    """A rank's last collective: every rank waits for the others here, then leaves the process group, so that no
    rank exits while a collective of its own is still queued on its device (the others would wait for it forever)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def stop_without_traceback(exc: Exception, hydra: DictConfig) -> None:
    """A single run ends here with `exc`'s one line (exit 1): its message says what to change. A sweep's run returns
    and is raised as any failure (Hydra records it; the other runs go on)."""
    if hydra.mode == RunMode.RUN:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def earlier_wall_s(run: RunDir) -> tuple[float, int]:
    """The wall time of the run's earlier attempts in `run` that wrote a summary with one, and how many they are (a
    summary written before `wall_s_attempts` existed counts its own attempt only; one without `wall_s`, none)."""
    previous = read_summary(run.path)
    if previous is None or previous.get("wall_s") is None:
        return 0.0, 0
    return float(previous["wall_s"]), int(previous.get("wall_s_attempts", 1))


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """Run `cfg.job._target_` in its run directory; write `summary.json` (completed or failed) and print it."""
    hydra = HydraConfig.get()  # one output directory per run, also in a sweep
    run = RunDir(hydra.runtime.output_dir)
    job: Job = get_method(cfg.job._target_)
    if started_by_launcher():  # one rank of a run of several processes: the process that started it writes the rest
        faulthandler.register(STACKS_SIGNAL, all_threads=True)  # where a rank that does not stop is stuck
        with stop_signals():
            results = job(cfg, run)
        if is_main():
            write_rank_results(run, results)
        end_process_group()
        return results
    overrides = list(hydra.overrides.task)
    if hydra.mode == RunMode.MULTIRUN and (previous := completed_run(run.path, overrides)) is not None:
        print(f"run directory: {run.path}\nstatus: completed before with the same overrides, not run again", flush=True)
        return previous
    # the same run only (resumed, requeued): else stop here, before an attempt is counted or anything is written
    try:
        run.check_same_run(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    except ConfigError as exc:  # nothing written: the directory holds the other run
        stop_without_traceback(exc, hydra)
        raise
    commit = git_commit()
    attempt = {
        "started": datetime.now().isoformat(timespec="seconds"),
        "git_commit": commit,
        "host": socket.gethostname(),
        "slurm_job_id": slurm_job_id(),
    }
    base = {
        "job": cfg.job.name,
        "run_dir": str(run.path),
        "git_commit": commit,
        "overrides": overrides,
        "attempts": run.start_attempt(attempt),  # > 1: started here again after a requeue, preemption or failure
    }
    earlier_s, earlier_n = earlier_wall_s(run)
    start = time.monotonic()

    def wall() -> dict[str, Any]:
        attempt_s = time.monotonic() - start
        return {"wall_s": earlier_s + attempt_s, "attempt_wall_s": attempt_s, "wall_s_attempts": earlier_n + 1}

    tracker = None
    try:
        with stop_signals():  # SIGTERM / SIGINT: Interrupted, recorded below
            check_run(cfg)  # seed, resources; the job's own keys next; its components when it builds them
            check_job(cfg)
            tracker = start_tracker(cfg, run, hydra)
            results = job(cfg, run)
    except BaseException as exc:
        # Not an error: a stop signal (Interrupted, KeyboardInterrupt) or submitit's exit after a preemption's requeue
        interrupted = not isinstance(exc, Exception)
        failed = base | {
            "status": "interrupted" if interrupted else "failed",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
            **wall(),
        }
        if interrupted:
            failed |= interruption(run, hydra)
        failed["tracking_errors"] = run.tracking_errors
        run.write_summary(failed)
        finish_tracker(tracker, failed, run)
        print(f"run directory: {run.path}\nstatus: {failed['status']}: {type(exc).__name__}: {exc}", flush=True)
        if interrupted:
            print(f"resume: {failed['resume']}", flush=True)
        if isinstance(exc, STOPS_WITHOUT_TRACEBACK):  # its traceback is in summary.json
            stop_without_traceback(exc, hydra)
        raise
    summary = base | {"status": "completed", "error": None} | wall() | results
    summary["tracking_errors"] = run.tracking_errors
    run.write_summary(summary)
    finish_tracker(tracker, summary, run)
    describe = getattr(sys.modules[job.__module__], "describe", None)  # a job's own words for its results
    if describe is not None:
        print(describe(summary), flush=True)
    else:
        print(f"run directory: {run.path}", flush=True)
        print(json.dumps(summary, indent=2, default=str), flush=True)
    return summary

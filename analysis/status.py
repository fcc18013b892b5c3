"""python -m analysis.status DIR [--json] [--tail N]: each run of a sweep, completed, failed, interrupted, running or
queued. DIR is a sweep directory, a folder of single runs (`outputs/runs`) or one run directory. The same table as a
launch.py job: `python launch.py job=status job.sweep_dir=DIR` (conf/job/status.yaml).

Reads the run directories' `summary.json`, the jobs the SLURM launcher recorded (`jobs.jsonl`) and SLURM's view of
them (squeue, sacct). A failed run shows the end of its error: its traceback, or the job's stderr when the job died
without writing a summary; an interrupted one, where it stopped and the command that resumes it. A local run without
a summary yet is `incomplete` (running, or stopped before it wrote one: no scheduler to ask).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from submitit.core.utils import JobPaths

from foundation.errors import ConfigError
from foundation.run_dir import RunDir
from foundation.schema import number
from jobs.sweep import QUEUED_STATES, RUNNING_STATES, read_summary, slurm_states, submitted_jobs


@dataclass
class StatusJob:
    """conf/job/status.yaml's keys."""

    name: str
    sweep_dir: str  # hydra.sweep.dir of the sweep (or a folder of runs, or one run directory)
    tail: int = number(5, gt=0)  # lines of a failed run's error to show


@dataclass
class RunStatus:
    num: int | str  # the run's number in a sweep, or its directory's name
    status: str  # completed | failed | interrupted | running | queued | incomplete
    run_dir: str
    overrides: list[str] = field(default_factory=list)
    job_id: str | None = None
    slurm_state: str | None = None
    error: str | None = None
    error_tail: list[str] = field(default_factory=list)


def _tail(text: str, lines: int) -> list[str]:
    return [line for line in text.rstrip().splitlines() if line.strip()][-lines:]


def _job_stderr(job: dict[str, Any]) -> str:
    path = JobPaths(job["folder"], job_id=job["job_id"], task_id=0).stderr
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


def run_status(num: int | str, run_dir: Path, job: dict[str, Any] | None, state: str | None, tail: int) -> RunStatus:
    summary = read_summary(run_dir)
    overrides = (summary or {}).get("overrides") or (job or {}).get("overrides") or []
    status = RunStatus(num, "incomplete", str(run_dir), overrides, job and job["job_id"], state)
    if summary is not None and summary.get("status") == "completed":
        status.status = "completed"
    elif state in QUEUED_STATES:  # also a failed or interrupted run submitted again, or a requeued one
        status.status = "queued"
    elif state in RUNNING_STATES:
        status.status = "running"
    elif summary is not None and summary.get("status") == "interrupted":  # with no job left to resume it
        status.status = "interrupted"
        stopped = summary.get("stopped_at") or {}
        status.error = f"{summary.get('error')} (in {stopped.get('phase')}, last step {stopped.get('step')})"
        status.error_tail = [f"resume: {summary['resume']}"] if summary.get("resume") else []
    elif summary is not None:
        status.status = "failed"
        status.error = summary.get("error") or summary.get("status")
        status.error_tail = _tail(summary.get("traceback") or "", tail)
    elif job is not None:  # the job ended (or SLURM forgot it) without a summary: killed, out of memory, ...
        status.status = "failed"
        status.error = f"SLURM job {job['job_id']} ended {state or 'UNKNOWN'} without writing summary.json"
        status.error_tail = _tail(_job_stderr(job), tail)
    return status


def _is_run_dir(path: Path) -> bool:
    return (path / "attempts.jsonl").is_file() or (path / "summary.json").is_file()


def sweep_status(sweep_dir: Path, tail: int = 5) -> list[RunStatus]:
    """The status of every run of the sweep (those with a run directory and those submitted to SLURM) and of every
    named run directory beside them (a folder of single runs, `outputs/runs`); of one run directory; or, in a folder
    that holds neither, of every run of the sweeps under it, each named `<sweep>/<n>`."""
    if _is_run_dir(sweep_dir):
        return [run_status(sweep_dir.name, sweep_dir, None, None, tail)]
    jobs = submitted_jobs(sweep_dir)
    children = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    nums = set(jobs) | {int(p.name) for p in children if p.name.isdigit()}
    states = slurm_states([job["job_id"] for job in jobs.values()]) if jobs else {}
    found = [
        run_status(n, sweep_dir / str(n), jobs.get(n), states.get(jobs[n]["job_id"]) if n in jobs else None, tail)
        for n in sorted(nums)
    ]
    found += [run_status(p.name, p, None, None, tail) for p in children if not p.name.isdigit() and _is_run_dir(p)]
    if found:
        return found
    return [replace(r, num=f"{p.name}/{r.num}") for p in children for r in sweep_status(p, tail)]


def format_status(sweep_dir: Path, runs: list[RunStatus]) -> str:
    counts = Counter(r.status for r in runs)
    lines = [f"{sweep_dir}: {len(runs)} runs: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))]
    for r in runs:
        job = f"job {r.job_id} ({r.slurm_state or 'UNKNOWN'})" if r.job_id else "local"
        lines.append(f"{r.num!s:>4}  {r.status:<11}  {job:<28}  {' '.join(r.overrides)}")
        if r.error:
            lines.append(f"{'':>6}{r.error}")
            lines += [f"{'':>8}| {line}" for line in r.error_tail]
    return "\n".join(lines)


def run(cfg: DictConfig, run_dir: RunDir) -> dict[str, Any]:
    """job=status: print the table of `job.sweep_dir`; the summary counts its runs by status."""
    sweep_dir = Path(cfg.job.sweep_dir)
    if not sweep_dir.is_dir():
        raise ConfigError(f"job.sweep_dir={sweep_dir}: no such sweep directory")
    runs = sweep_status(sweep_dir, cfg.job.tail)
    if not runs:
        raise ConfigError(f"job.sweep_dir={sweep_dir}: no run directory or submitted run under it")
    print(format_status(sweep_dir, runs), flush=True)
    return {"sweep_dir": str(sweep_dir), "runs": dict(Counter(r.status for r in runs))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.status", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    parser.add_argument("--tail", type=int, default=5, help="lines of a failed run's error to show")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"{args.sweep_dir}: no such sweep directory", file=sys.stderr)
        return 2
    runs = sweep_status(args.sweep_dir, args.tail)
    if not runs:
        print(f"{args.sweep_dir}: no run directory or submitted run under it", file=sys.stderr)
        return 1
    if args.json:
        print("\n".join(json.dumps(asdict(r)) for r in runs))
    else:
        print(format_status(args.sweep_dir, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

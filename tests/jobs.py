"""Jobs that take a second instead of a training run, for the dispatch tests: `job._target_=tests.jobs.quick`."""

from __future__ import annotations

import time
from typing import Any

from omegaconf import DictConfig

from experiments.run_dir import RunDir


def quick(cfg: DictConfig, run: RunDir) -> dict[str, Any]:
    """Counts its executions in `<run>/executions`, sleeps `job.sleep_s`, fails if `job.fail`."""
    with (run.path / "executions").open("a") as f:
        f.write("1")
    time.sleep(cfg.job.get("sleep_s", 0))
    if cfg.job.get("fail", False):
        raise RuntimeError(f"asked to fail (seed={cfg.seed})")
    return {"seed": cfg.seed}

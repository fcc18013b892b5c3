"""A run on N processes (`resources.gpus_per_node=N`, one node): `python launch.py ... resources.gpus_per_node=2`
starts them itself, with torchrun, and waits.

The processes run the same command in the same run directory (`hydra.run.dir`), marked by `ARL_RANK_OF`: each is
one rank of PyTorch's process group (NCCL on GPUs, gloo on CPU), and `backend=trl` trains data-parallel across them
(each rank runs its share of the step's rollouts on its own policy server and device). Rank 0 writes the run
directory (metrics.jsonl, samples, checkpoints) and its results to `ranks/results.json`; this process, the one the
user started, writes summary.json from them, as for a run of one process. Each rank's output is kept in
`ranks/<attempt>/attempt_0/<rank>/` (torchrun's log layout); rank 0's is shown on the console too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from foundation.errors import ConfigError
from foundation.ranks import RANK_OF
from foundation.run_dir import RunDir

LAUNCH = Path(__file__).resolve().parent.parent / "launch.py"
RESULTS = "ranks/results.json"


def processes(cfg: DictConfig) -> int:
    """How many processes the run trains on: `resources.nodes` x `resources.gpus_per_node` (at least one a node)."""
    return int(cfg.resources.nodes) * max(1, int(cfg.resources.gpus_per_node))


def launch_ranks(cfg: DictConfig, run: RunDir) -> dict[str, Any]:
    """Start the run's processes with torchrun in this run directory; wait; return rank 0's results."""
    if int(cfg.resources.nodes) > 1:
        raise ConfigError(f"resources.nodes={cfg.resources.nodes}: backend=trl starts its ranks on one node; "
                          "several nodes (SLURM, srun) are not supported yet")  # fmt: skip
    n = processes(cfg)
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("hydra.run.dir=")]
    (run.path / RESULTS).unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
        f"--log-dir={run.path / 'ranks'}", "--redirects=3", "--tee=3", "--local-ranks-filter=0",
        str(LAUNCH), *overrides, f"hydra.run.dir={run.path}",
    ]  # fmt: skip
    env = os.environ | {RANK_OF: str(run.path)}
    finished = subprocess.run(command, env=env)
    results_file = run.path / RESULTS
    if finished.returncode != 0 or not results_file.is_file():
        raise RuntimeError(f"the run's {n} processes failed (exit {finished.returncode}); each rank's output: "
                           f"{run.path / 'ranks'}")  # fmt: skip
    return json.loads(results_file.read_text())


def write_rank_results(run: RunDir, results: dict[str, Any]) -> None:
    """Rank 0's results, for the process that started the ranks."""
    path = run.path / RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, default=str))

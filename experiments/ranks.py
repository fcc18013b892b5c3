"""A run on several processes (`resources.gpus_per_node=N`, `resources.nodes=M`): `python launch.py ...
resources.gpus_per_node=2` starts them itself and waits. On one machine it starts N with torchrun. Inside a SLURM job
(`hydra/launcher=slurm`, which asks for M nodes x N GPUs) it starts M x N with `srun`, N on each node, and each
takes its rank from SLURM's environment (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS); several nodes need SLURM.

The processes run the same command in the same run directory (`hydra.run.dir`), marked by `ARL_RANK_OF`: each is
one rank of PyTorch's process group (NCCL on GPUs, gloo on CPU), and `backend=trl` trains data-parallel across them
(each rank runs its share of the step's rollouts on its own policy server and device). Rank 0 writes the run
directory (metrics.jsonl, samples, checkpoints) and its results to `ranks/results.json`; this process, the one the
user (or the SLURM job) started, writes summary.json from them, as for a run of one process. Each rank's output is
kept under `ranks/`: torchrun's layout (`ranks/<id>/attempt_0/<rank>/`, rank 0's shown on the console too) or
`ranks/slurm-<job>.<restart>/<rank>/` under srun.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
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


def check_devices(cfg: DictConfig, gpus: int) -> None:
    """One GPU a rank: a machine with `gpus` GPUs (0: CPU ranks, any number) runs at most that many a node."""
    per_node = max(1, int(cfg.resources.gpus_per_node))
    if cfg.backend.get("device", "auto") != "cpu" and 0 < gpus < per_node:
        raise ConfigError(f"resources.gpus_per_node={per_node}: this machine has {gpus} GPU(s), one a rank "
                          "(backend.device=cpu runs the ranks as CPU processes)")  # fmt: skip


def launch_ranks(cfg: DictConfig, run: RunDir) -> dict[str, Any]:
    """Start the run's processes in this run directory (torchrun, or srun inside a SLURM job); wait; return rank 0's
    results."""
    nodes, per_node = int(cfg.resources.nodes), max(1, int(cfg.resources.gpus_per_node))
    in_slurm = "SLURM_JOB_ID" in os.environ and shutil.which("srun") is not None
    if nodes > 1 and not in_slurm:
        raise ConfigError(f"resources.nodes={nodes}: a run on several nodes starts its ranks with srun, inside a "
                          "SLURM job (hydra/launcher=slurm)")  # fmt: skip
    if not in_slurm:  # under SLURM each node is checked by the job's allocation
        import torch

        check_devices(cfg, torch.cuda.device_count())
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("hydra.run.dir=")]
    own = [str(LAUNCH), *overrides, f"hydra.run.dir={run.path}"]
    (run.path / RESULTS).unlink(missing_ok=True)
    env = os.environ | {RANK_OF: str(run.path)}
    if cfg.backend.get("device", "auto") == "cpu":  # CPU ranks: FSDP2 would place its shards on a visible GPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    if in_slurm:
        command, env, logs = srun_command(nodes, per_node, own, run, env)
    else:
        logs = run.path / "ranks"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={per_node}",
            f"--log-dir={logs}", "--redirects=3", "--tee=3", "--local-ranks-filter=0", *own,
        ]  # fmt: skip
    finished = subprocess.run(command, env=env)
    results_file = run.path / RESULTS
    if finished.returncode != 0 or not results_file.is_file():
        raise RuntimeError(f"the run's {nodes * per_node} processes failed (exit {finished.returncode}); each "
                           f"rank's output: {logs}")  # fmt: skip
    return json.loads(results_file.read_text())


def srun_command(
    nodes: int, per_node: int, own: list[str], run: RunDir, env: dict[str, str]
) -> tuple[list[str], dict[str, str], Path]:
    """The `srun` that starts `nodes` x `per_node` ranks in this SLURM job, the environment it gets, and where the
    ranks' output goes. The step overlaps the job's own (this process), shares the job's CPUs of each node among its
    ranks and sees the job's GPUs; a rank that fails stops the others. Rank 0 (SLURM task 0, on the job's first
    node, where this process runs) is the rendezvous."""
    logs = run.path / "ranks" / f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    for rank in range(nodes * per_node):
        (logs / str(rank)).mkdir(parents=True, exist_ok=True)
    cpus = max(1, int(os.environ.get("SLURM_CPUS_ON_NODE", per_node)) // per_node)
    rendezvous = {
        "MASTER_ADDR": socket.gethostname(),
        "MASTER_PORT": str(free_port()),
        "LOCAL_WORLD_SIZE": str(per_node),
    }
    # USR2 (a time limit or preemption ahead) goes to every step; this process's submitit handler requeues the job,
    # whose ranks then start again from the latest checkpoint: the ranks ignore it (an ignored signal survives exec)
    as_rank = 'trap "" USR2; export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS; exec "$@"'
    command = [
        "srun", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes * per_node}", f"--ntasks-per-node={per_node}",
        f"--cpus-per-task={cpus}", "--kill-on-bad-exit=1",
        f"--output={logs}/%t/stdout.log", f"--error={logs}/%t/stderr.log",
        "bash", "-c", as_rank, "rank", sys.executable, *own,
    ]  # fmt: skip
    return command, env | rendezvous, logs


def free_port() -> int:
    """A port nothing listens on here, for rank 0's rendezvous (torchrun --standalone chooses its own the same way)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def write_rank_results(run: RunDir, results: dict[str, Any]) -> None:
    """Rank 0's results, for the process that started the ranks."""
    path = run.path / RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, default=str))

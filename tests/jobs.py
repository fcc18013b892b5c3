"""Jobs that take seconds instead of a training run, for the dispatch tests: `job._target_=tests.jobs.quick
+job._schema_=tests.jobs.QuickJob` (the schema lets `+job.fail`, `+job.sleep_s` through the job group's check)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from foundation.run_dir import RunDir


@dataclass
class QuickJob:
    name: str = "train"
    fail: bool = False  # raise instead of returning
    sleep_s: float = 0.0  # sleep this long first


def quick(cfg: DictConfig, run: RunDir) -> dict[str, Any]:
    """Counts its executions in `<run>/executions`, sleeps `job.sleep_s`, fails if `job.fail`."""
    with (run.path / "executions").open("a") as f:
        f.write("1")
    time.sleep(cfg.job.get("sleep_s", 0))
    if cfg.job.get("fail", False):
        raise RuntimeError(f"asked to fail (seed={cfg.seed})")
    return {"seed": cfg.seed}


def ray_nodes(cfg: DictConfig, run: RunDir) -> dict[str, Any]:
    """What a Ray backend does in a job of several SLURM nodes: starts Ray over them (`start_ray_cluster`), then runs
    one task on each Ray node; stops Ray. Returns the nodes and, per task, its SLURM node, its pid and its parent's
    (the node's raylet), and which of those pids still ran 10 s after Ray was stopped."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from backends.ray_cluster import start_ray_cluster, stop_ray_cluster

    def where() -> dict[str, Any]:
        parent = os.getppid()
        return {
            "slurm_node": os.environ.get("SLURMD_NODENAME"),
            "pid": os.getpid(),
            "parent_pid": parent,
            "parent": Path(f"/proc/{parent}/comm").read_text().strip(),
        }

    address = start_ray_cluster(timeout_s=120)
    try:
        ray.init(address=address)
        nodes = [node for node in ray.nodes() if node["Alive"]]
        task = ray.remote(num_cpus=1)(where)
        on_each = [
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote()
            for node in nodes
        ]
        tasks = ray.get(on_each, timeout=120)
        ray.shutdown()
    finally:
        stop_ray_cluster()
    pids = [pid for task in tasks for pid in (task["pid"], task["parent_pid"])]
    deadline = time.monotonic() + 10  # a raylet goes with its `ray start --block`, not in the same instant
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {"ray_address": address, "ray_nodes": len(nodes), "tasks": tasks, "alive_after_stop": left}


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` that run on this machine (a zombie, exited but not yet reaped, does not)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            running.append(pid)
    return running

"""Jobs for the dispatch tests. `job._target_=tests.jobs.quick +job._schema_=tests.jobs.QuickJob` takes seconds
instead of a training run; `tests.jobs.held_train` (schema `tests.jobs.HeldTrain`) is the training job held at its
first checkpoint. The schemas let their keys (`+job.fail`, `+job.hold`) through the job group's check.

A held run waits for the test instead of sleeping for a guessed time: a test that interrupts, cancels or waits for a
job while it runs then finds it running, however slow the machine."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from foundation.run_dir import RunDir

RELEASE = "release"  # a held run goes on once `<run>/release` exists


@dataclass
class QuickJob:
    name: str = "train"
    fail: bool = False  # raise instead of returning
    hold: list[int] = field(default_factory=list)  # the runs (hydra.job.num) that wait for `<run>/release` first
    hold_s: float = 300.0  # at most this long: a hang guard, not a timing


@dataclass
class HeldTrain:
    name: str = "train"
    hold: list[int] = field(default_factory=list)  # the runs (hydra.job.num) that wait after their first checkpoint
    hold_s: float = 600.0  # at most this long: a hang guard, not a timing


def held(cfg: DictConfig) -> bool:
    """Whether this run is one of `job.hold`."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().job.num in cfg.job.get("hold", [])


def hold(run: RunDir, timeout_s: float, why: str) -> None:
    """Wait until `<run>/release` exists, the process is stopped (cancelled, requeued, preempted) or `timeout_s` has
    passed; say so in the job's log."""
    print(f"held {why}", flush=True)
    deadline = time.monotonic() + timeout_s
    while not (run.path / RELEASE).exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def quick(cfg: DictConfig, run: RunDir) -> dict[str, Any]:
    """Counts its executions in `<run>/executions`, waits if held, fails if `job.fail`."""
    with (run.path / "executions").open("a") as f:
        f.write("1")
    if held(cfg):
        hold(run, cfg.job.get("hold_s", 300.0), "until the test releases or stops this run")
    if cfg.job.get("fail", False):
        raise RuntimeError(f"asked to fail (seed={cfg.seed})")
    return {"seed": cfg.seed}


def held_train(cfg: DictConfig, run: RunDir) -> dict[str, Any]:
    """The training job (jobs.train.run), except that the runs in `job.hold` wait after writing checkpoint-1
    until the test interrupts them: a requeue or a preemption then always lands in the middle of the run. A resumed
    run starts from checkpoint-1 and never writes it again, so only the first attempt waits."""
    from transformers.trainer_callback import CallbackHandler

    from jobs.train import run as train

    if held(cfg):
        save = CallbackHandler.on_save
        checkpoints = (run.path / "checkpoints").resolve()

        def on_save(self: CallbackHandler, args: Any, state: Any, control: Any) -> Any:
            control = save(self, args, state, control)
            if state.global_step == 1 and Path(args.output_dir).resolve() == checkpoints:
                hold(run, cfg.job.get("hold_s", 600.0), "after checkpoint-1 until the test interrupts this run")
            return control

        CallbackHandler.on_save = on_save  # type: ignore[method-assign]
    return train(cfg, run)


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

"""backend=verl: verl 0.9's PPO trainer (GRPO, FSDP2 workers, vLLM servers, Ray) with our agents in its agent loop.

    our tasks -> <run>/verl/{train,val}.parquet (one row per task: `loop.task_row`)
    our agent, reward and model groups -> <run>/verl/agent_loop.yaml (`loop.loop_config`)
    our groups -> verl's config (`config.py`, validated) -> <run>/verl_config.yaml
    verl's run_ppo with our TaskRunner (`runner.py`) -> <run>/verl_metrics.jsonl -> <run>/metrics.jsonl

On several nodes (`resources.nodes` > 1) Ray must run across the allocation: unless RAY_ADDRESS names a cluster
already, the job starts one over its SLURM allocation (`backends.ray_cluster.start_ray_cluster`) and verl's entry
point joins it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from omegaconf import DictConfig, OmegaConf

from backends.ray_cluster import start_ray_cluster
from backends.setup import TrainSetup
from backends.sft import RunTasks, SFTWarmstart, WarmStart, run_tasks, warm_start
from backends.verl.config import ModelSource, build_verl_config, check_algorithm, check_shape
from backends.verl.loop import ITEM_ID, ITEM_SCORE, loop_config, task_row
from inference.policy_server import eos_ids_of
from models.hub import HubModel, offline

# verl's metric -> ours (backend=trl's name for the same quantity); the rest stay under their verl names
METRIC_NAMES = {
    "timing_s/step": "timing_s/step",
    "timing_s/gen": "timing_s/rollout",
    "timing_s/update_actor": "timing_s/update",
    "timing_s/update_weights": "timing_s/weight_sync",
    "timing_s/old_log_prob": "timing_s/old_logprobs",
    "timing_s/testing": "timing_s/validation",
    "actor/grad_norm": "train/grad_norm",
    "actor/pg_loss": "train/loss",
}


def absolute(task: dict[str, Any]) -> dict[str, Any]:
    """The task with its database path absolute: verl's agent-loop workers run in other working directories."""
    return task | {"db_path": str(Path(task["db_path"]).resolve())} if "db_path" in task else task


def write_inputs(setup: TrainSetup, splits: dict[str, list[dict[str, Any]]], model_path: str, folder: Path) -> dict:
    """The parquet rows of `splits` (train, val) and the agent-loop YAML verl reads, whose model group loads
    `model_path`; returns their paths (config.py's `files`)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, tasks in splits.items():
        rows = [task_row(absolute(task), setup.data.name, i) for i, task in enumerate(tasks)]
        files[split] = str(folder / f"{split}.parquet")
        pd.DataFrame(rows).to_parquet(files[split])
    algo = setup.algorithm
    entry = loop_config(
        setup.groups["agent"],
        setup.groups["reward"],
        setup.groups["model"] | {"path": model_path},
        max_prompt_tokens=algo.max_prompt_length,
        max_response_tokens=algo.max_response_length,
        max_tokens_per_turn=algo.max_tokens_per_turn,
        reward_timeout_s=algo.reward_timeout_s,
        eos_ids=eos_ids(setup.model, model_path),
    )
    files["loop"] = str(folder / "agent_loop.yaml")
    Path(files["loop"]).write_text(yaml.safe_dump(entry, sort_keys=False))
    return files


def eos_ids(model: HubModel, source: str) -> list[int]:
    """The ids that end a reply (`eos_ids_of`: the generation config's, else the tokenizer's), without the weights."""
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(source, local_files_only=offline())
    except OSError:  # no generation_config.json: the tokenizer's eos
        generation = GenerationConfig()
    return sorted(eos_ids_of(generation, model.load_tokenizer(source)))


def verl_setup(
    backend: Any, setup: TrainSetup, tasks: RunTasks | None = None, begin: WarmStart | None = None
) -> tuple[DictConfig, dict[str, int]]:
    """The run's inputs written and verl's config built and validated (what job=validate checks too); the config
    and the tasks per split. `tasks`: the run's (`run_tasks`, made here if not given); `begin`: the warm start GRPO
    starts from (`train_verl` runs it; job=validate checks the config with the prepared model instead)."""
    check_algorithm(setup.algorithm)  # before anything is written or built
    check_shape(setup.finetune, setup.algorithm, backend)
    tasks = tasks or run_tasks(setup)
    model_path = str(begin.checkpoint) if begin is not None and begin.checkpoint is not None else tasks.source
    if Path(model_path).exists():  # a local directory, as every Ray process sees it (their working directories vary)
        model_path = str(Path(model_path).resolve())
    run_path = setup.run.path.resolve()
    files = write_inputs(setup, {"train": tasks.train, "val": tasks.val}, model_path, run_path / "verl")
    model = ModelSource(model_path, setup.model.attn_implementation)
    config = build_verl_config(model, setup.finetune, setup.algorithm, backend, files, run_path, setup.seed)
    counts = {"train_tasks": len(tasks.train), "val_tasks": len(tasks.val), "warmstart_tasks": len(tasks.warm)}
    return config, counts


def verl_warm_start(setup: TrainSetup, tasks: RunTasks) -> WarmStart:
    """The warm start phase (`backends.sft.warm_start`) before Ray, in a process of its own that sees one GPU (or the
    CPU): this one may see every GPU of the node (TRL's SFT refuses several in one process) and has started CUDA on
    them (verl's import does), and the warm start's GPU memory leaves with its process. A run verl resumes (a
    checkpoint of its own in `checkpoints/`) keeps its warm start."""
    if not isinstance(setup.warmstart, SFTWarmstart):
        return WarmStart(None)
    algo = setup.algorithm
    job = partial(
        _warm_start_alone,
        setup.warmstart,
        setup.model,
        setup.run,
        setup.seed,
        tasks,
        max_length=algo.max_prompt_length + algo.max_response_length,
        resuming=(setup.run.checkpoints / "latest_checkpointed_iteration.txt").is_file(),
    )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = (visible or "0").split(",")[0]  # what the process below inherits
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(job).result()
    finally:  # Ray, started later from this process, counts the GPUs from it
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def _warm_start_alone(
    warmstart: SFTWarmstart, model: HubModel, run: Any, seed: int, tasks: RunTasks, max_length: int, resuming: bool
) -> WarmStart:
    """`warm_start` in the process `verl_warm_start` starts: on its GPU if it has one; the model stays here."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = model.load_tokenizer(warmstart.path or tasks.source)
    begin = warm_start(
        warmstart,
        model,
        run,
        seed,
        tasks,
        tokenizer,
        device,
        max_length=max_length,
        use_bf16=device == "cuda",
        resuming=resuming,
    )
    begin.model = None  # verl's workers load the checkpoint
    return begin


def train_verl(backend: Any, setup: TrainSetup) -> dict[str, Any]:
    run = setup.run
    check_algorithm(setup.algorithm)  # before anything is written or built
    check_shape(setup.finetune, setup.algorithm, backend)
    tasks = run_tasks(setup)
    config, counts = verl_setup(backend, setup, tasks)  # checked whole before the warm start trains
    if backend.nodes > 1 and not os.environ.get("RAY_ADDRESS") and start_ray_cluster() == "local":
        raise RuntimeError(
            f"resources.nodes={backend.nodes}, but this is not a job of several SLURM nodes: run it with "
            "hydra/launcher=slurm, or start Ray across the nodes yourself and export RAY_ADDRESS"
        )
    begin = verl_warm_start(setup, tasks)
    if begin.checkpoint is not None:  # verl's actor, servers and agent loop start from it
        config, counts = verl_setup(backend, setup, tasks, begin)
    OmegaConf.save(config, run.path / "verl_config.yaml")
    results: dict[str, Any] = {
        "verl_config": str(run.path / "verl_config.yaml"),
        **counts,
        "is_correction": setup.algorithm.is_correction,
    }
    if begin.checkpoint is not None:
        results["sft"] = begin.record
    if not backend.fit:
        return results | {"fit": "skipped (backend.fit=false)"}
    import ray
    from verl.trainer.main_ppo import run_ppo

    from backends.verl.runner import TaskRunner

    verl_metrics = Path(config.ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH)
    run.phase = "training"
    start = time.monotonic()
    try:
        run_ppo(config, task_runner_class=TaskRunner)
    finally:
        ray.shutdown()
    copy_metrics(verl_metrics, run)
    copy_item_scores(Path(config.trainer.validation_data_dir), run)
    return results | {"fit": "completed", "train_s": round(time.monotonic() - start, 1)}


def copy_item_scores(dumps: Path, run: Any) -> None:
    """Each validation's question scores, from verl's dumps (`<step>.jsonl`, a line per rollout with our loop's
    `reward_extra_info`), into the run's `scores/val_step<step>.json`, the last one also as `val_final.json`, as
    backend=trl writes them; a question answered more than once (val_kwargs.n > 1) gets its mean score."""
    files = sorted(dumps.glob("*.jsonl"), key=lambda f: int(f.stem)) if dumps.is_dir() else []
    for i, dump in enumerate(files):
        by_item: dict[str, list[float | None]] = {}
        for line in dump.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            by_item.setdefault(str(record[ITEM_ID]), []).append(record[ITEM_SCORE])
        scores: dict[str, float | None] = {}
        for item, values in by_item.items():
            known = [v for v in values if v is not None]
            scores[item] = sum(known) / len(known) if known and len(known) == len(values) else None
        run.write_scores(f"val_step{dump.stem}", scores)
        if i == len(files) - 1:
            run.write_scores("val_final", scores)


def copy_metrics(verl_metrics: Path, run: Any) -> None:
    """verl's per-step log into metrics.jsonl: our names where they mean the same (METRIC_NAMES), verl's otherwise;
    validation (`val-core/<source>/reward/mean@1`) as `val/reward_mean`."""
    for line in verl_metrics.read_text().splitlines() if verl_metrics.exists() else []:
        record = json.loads(line)
        data: dict[str, Any] = record["data"]
        metrics = {METRIC_NAMES.get(key, key): value for key, value in data.items()}
        rewards = [v for k, v in data.items() if k.startswith("val-core/") and k.endswith("/reward/mean@1")]
        if rewards:
            metrics["val/reward_mean"] = sum(rewards) / len(rewards)
        run.log(int(record["step"]), metrics)

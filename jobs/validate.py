"""job=validate: everything a backend=verl run does before Ray starts, on CPU: our groups built and validated, the
inputs verl reads written (`<run>/verl/`: parquet rows, the agent-loop YAML; a model built here is built), verl's
config derived and validated by us and by verl (`<run>/verl_config.yaml`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from foundation.errors import ConfigError
from foundation.run_dir import RunDir
from jobs.config import build_components
from jobs.train import train_setup


def verl_config(cfg: DictConfig, run_path: Path) -> DictConfig:
    """Our groups validated and built, then verl's inputs and its trainer config generated and validated."""
    from backends.verl.train import verl_setup

    if cfg.backend.name != "verl":
        raise ConfigError(f"backend={cfg.backend.name}: job=validate checks backend=verl runs (add backend=verl)")
    parts = build_components(cfg)
    config, _ = verl_setup(parts["backend"], train_setup(cfg, parts, RunDir(run_path)))
    return config


def run(cfg: DictConfig, run_dir: RunDir) -> dict[str, Any]:
    generated = verl_config(cfg, run_dir.path)
    path = run_dir.path / "verl_config.yaml"
    OmegaConf.save(generated, path)
    trainer, rollout = generated.trainer, generated.actor_rollout_ref.rollout
    return {
        "verl_config": str(path),
        "nnodes": trainer.nnodes,
        "n_gpus_per_node": trainer.n_gpus_per_node,
        "rollout_n": rollout.n,
        "lora_rank": generated.actor_rollout_ref.model.lora_rank,
        "train_batch_size": generated.data.train_batch_size,
        "adv_estimator": generated.algorithm.adv_estimator,
        "rollout_is": generated.algorithm.rollout_correction.rollout_is,
    }

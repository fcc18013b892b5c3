"""job=validate: everything a backend=verl run checks before it starts, on CPU; writes `<run>/verl_config.yaml`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.config import build_components
from foundation.errors import ConfigError
from foundation.run_dir import RunDir


def verl_config(cfg: DictConfig, run_path: Path) -> DictConfig:
    """Our groups validated and built, then verl's full trainer config generated from them and validated."""
    from backends.agl.config import build_verl_config
    from backends.agl.settings import VerlSettings

    if cfg.backend.name != "verl":
        raise ConfigError(f"backend={cfg.backend.name}: job=validate checks backend=verl runs (add backend=verl)")
    if cfg.warmstart:
        raise ConfigError(f"warmstart={cfg.warmstart.name}: backend=verl has no warm start (add warmstart=none)")
    parts = build_components(cfg)
    backend: VerlSettings = parts["backend"]
    return build_verl_config(parts["model"], parts["finetune"], parts["algorithm"], backend, run_path, cfg.seed)


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
    }

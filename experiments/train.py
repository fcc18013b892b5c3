"""job=train: build the components from the config and hand them to the selected backend."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from backends.setup import TrainSetup
from experiments.config import build_components
from foundation.run_dir import RunDir


def run(cfg: DictConfig, run_dir: RunDir) -> dict[str, Any]:
    parts = build_components(cfg)
    setup = TrainSetup(
        model=parts["model"],
        finetune=parts["finetune"],
        algorithm=parts["algorithm"],
        agent=parts["agent"],
        reward=parts["reward"],
        data=parts["data"],
        warmstart=parts["warmstart"],
        seed=cfg.seed,
        run=run_dir,
    )
    results = parts["backend"].train(setup)
    steps = [m for m in run_dir.metrics() if "train/reward_mean" in m]
    validations = [m for m in run_dir.metrics() if "val/accuracy" in m]
    return results | {
        "steps": len(steps),
        # None: a step whose rollouts were all excluded (see rollout/excluded_*_rate)
        "reward_per_step": [
            None if m["train/reward_mean"] is None else round(m["train/reward_mean"], 4) for m in steps
        ],
        "val_accuracy_before": validations[0]["val/accuracy"] if validations else None,
        "val_accuracy_after": validations[-1]["val/accuracy"] if len(validations) > 1 else None,
    }

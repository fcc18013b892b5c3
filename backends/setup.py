"""Everything a training backend receives, already built from the config and validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.rollout import Agent, Reward
from backends.algorithm import GRPO
from data.spider import SpiderData
from foundation.run_dir import RunDir
from models.finetune import Full, LoRA
from models.hub import HubModel


@dataclass
class TrainSetup:
    model: HubModel
    finetune: Full | LoRA
    algorithm: GRPO
    agent: Agent
    reward: Reward
    data: SpiderData
    warmstart: Any
    seed: int
    run: RunDir
    # the composed configs of agent, reward and model (resolved): what builds them again in other processes (verl's
    # agent-loop workers)
    groups: dict[str, dict[str, Any]]
    # the disk plan made before the run started (backends/disk.py; backend=trl): what each save is checked against
    disk_plan: dict[str, Any] | None = None

"""The class `conf/backend/verl.yaml` builds: verl 0.9's PPO trainer (GRPO advantages, FSDP2 workers, vLLM servers)
on Ray, with our agents in its agent loop (`loop.py`). Its run code (`train.py`) is imported when a run starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.setup import TrainSetup
from foundation.schema import number


@dataclass
class VerlBackend:
    """backend=verl: the keys of `conf/backend/verl.yaml` (each documented there); verl's config is derived from
    them and the other groups (`config.py`)."""

    name: str
    nodes: int = number(gt=0)  # verl's trainer.nnodes
    gpus_per_node: int = number(gt=0)  # verl's trainer.n_gpus_per_node
    tensor_parallel_size: int = number(gt=0)  # each vLLM server's; divides gpus_per_node
    gpu_memory_utilization: float = number(gt=0, le=1)  # vLLM's share of each GPU while it generates
    gradient_checkpointing: bool
    param_offload: bool
    optimizer_offload: bool
    agent_workers: int = number(gt=0)  # verl's agent-loop worker processes (rollouts run as asyncio tasks in them)
    project_name: str
    overrides: dict[str, Any]
    fit: bool

    def train(self, setup: TrainSetup) -> dict[str, Any]:
        from backends.verl.train import train_verl

        return train_verl(self, setup)

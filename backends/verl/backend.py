"""The class `conf/backend/verl.yaml` builds: verl 0.9's PPO trainer (GRPO advantages, FSDP2 workers, vLLM servers)
on Ray, with our agents in its agent loop (`loop.py`). Its run code (`train.py`) is imported when a run starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from backends.protocol import Needs
from backends.setup import TrainSetup
from backends.verl.config import OLD_LOG_PROBS, check_algorithm, check_shape
from foundation.schema import number, one_of


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
    old_log_probs: str = one_of(dataclasses.MISSING, OLD_LOG_PROBS)  # recompute (verl's pass) or from_update (loss.py)
    param_offload: bool
    optimizer_offload: bool
    agent_workers: int = number(gt=0)  # verl's agent-loop worker processes (rollouts run as asyncio tasks in them)
    project_name: str
    overrides: dict[str, Any]
    fit: bool

    @property
    def needs(self) -> Needs:
        return Needs(cuda=True, pinned_extra="verl", vllm=True, ray_across_nodes=True)

    def processes(self, nodes: int, gpus_per_node: int) -> int:
        """One: verl places its own workers on the nodes and GPUs (Ray; backends/ray_cluster.py across nodes)."""
        return 1

    def check(self, setup: TrainSetup, processes: int) -> None:
        check_algorithm(setup.algorithm)
        check_shape(setup.finetune, setup.algorithm, self)

    def plans(self, setup: TrainSetup, processes: int, gpu_memory_gb: float | None) -> dict[str, dict[str, Any]]:
        """None: verl sizes its workers and keeps its checkpoints itself."""
        return {}

    def prepare(self, setup: TrainSetup) -> dict[str, Any]:
        """verl's inputs written (`<run>/verl/`: parquet rows, the agent-loop YAML; a model built here is built) and
        its trainer config derived, validated by us and by verl, saved as `<run>/verl_config.yaml`."""
        from backends.verl.train import verl_setup

        generated, _ = verl_setup(self, setup)
        path = setup.run.path / "verl_config.yaml"
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

    def train(self, setup: TrainSetup) -> dict[str, Any]:
        from backends.verl.train import train_verl

        return train_verl(self, setup)

"""Everything a training backend receives, already built from the config and validated, and what it reads of a data
set (`Data`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from agent.rollout import Agent, Reward
from backends.algorithm import GRPO
from foundation.run_dir import RunDir
from models.finetune import Full, LoRA
from models.hub import HubModel


class Data(Protocol):
    """A data set as a backend reads it (`conf/data/<name>.yaml`'s class: data/spider.py, med_qa.py, dbbench.py):
    its tasks per phase (dicts its agent and metric read; a backend reads no field of them), the metric that scores
    an answer, and the kind of task it holds (which agents answer it: jobs/config.py checks the pair)."""

    name: str
    task_kind: ClassVar[str]
    split_seed: int  # the seed of every split of the tasks (validation from train, warm start / RL phases)

    def train_tasks(self) -> list[dict[str, Any]]: ...

    def val_tasks(self) -> list[dict[str, Any]]: ...

    def test_tasks(self) -> list[dict[str, Any]]: ...

    def metric(self) -> Callable[..., Any]: ...


@dataclass
class TrainSetup:
    model: HubModel
    finetune: Full | LoRA
    algorithm: GRPO
    agent: Agent
    reward: Reward
    data: Data
    warmstart: Any
    seed: int
    run: RunDir
    # the composed configs of agent, reward and model (resolved): what builds them again in other processes (verl's
    # agent-loop workers)
    groups: dict[str, dict[str, Any]]
    # the disk plan made before the run started (backends/disk.py; backend=trl): what each save is checked against
    disk_plan: dict[str, Any] | None = None

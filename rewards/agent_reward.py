"""The agent's own reward (`conf/reward/agent_reward.yaml`): what an agent=lit rollout returned, passed on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.trajectory import Trajectory


@dataclass
class AgentReward:
    """The trajectory's `agent_reward`. None stays None: a missing reward, whose rollout is excluded from training."""

    name: str = "agent_reward"

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float | None:
        return trajectory.agent_reward

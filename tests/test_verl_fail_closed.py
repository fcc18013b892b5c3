"""backend=verl fails closed as backend=trl does (runs in .venv-verl): a rollout whose agent raised or whose reward
raised or timed out reports no reward, and the daemon gives a rollout without a reward no training samples (agent-
lightning 0.3 alone would fill its reward with 0 and train on it)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from agent.trajectory import Trajectory

pytestmark = pytest.mark.verl


class Agent:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    async def run(self, task: dict[str, Any], llm: Any) -> Trajectory:
        if self.fail:
            raise RuntimeError("the agent broke")
        return Trajectory(final_sql="SELECT 1", answer=task["id"])


def rollout_async(agent: Agent, reward: Any, timeout_s: float = 5.0) -> float | None:
    from backends.agl.agl import LLM_RESOURCE, AgentRollouts, agl

    task = {"id": "t1", "question": "How many?"}
    resources = {LLM_RESOURCE: agl.LLM(endpoint="http://127.0.0.1:9/v1", model="m")}
    rollout = agl.Rollout(rollout_id="ro-1", input=task, start_time=0.0)
    return asyncio.run(AgentRollouts(agent, reward, {}, timeout_s).rollout_async(task, resources, rollout))


def test_a_failed_agent_or_reward_reports_no_reward() -> None:
    release = threading.Event()

    def hangs(task: dict[str, Any], trajectory: Trajectory) -> float:
        release.wait(60)
        return 1.0

    def raises(task: dict[str, Any], trajectory: Trajectory) -> float:
        raise ValueError("gold SQL fails")

    try:
        assert rollout_async(Agent(fail=False), lambda task, trajectory: 0.25) == 0.25
        assert rollout_async(Agent(fail=True), lambda task, trajectory: 0.0) is None
        assert rollout_async(Agent(fail=False), raises) is None
        assert rollout_async(Agent(fail=False), hangs, timeout_s=0.2) is None
    finally:
        release.set()


def test_the_daemon_gives_a_rollout_without_reward_no_samples() -> None:
    from backends.agl.agl import FailClosedDaemon, agl

    class Store:
        async def query_spans(self, rollout_id: str, attempt_id: str) -> list[str]:
            return ["span"]

    class Adapter:
        def __init__(self, reward: float | None) -> None:
            self.reward = reward

        def adapt(self, spans: list[str]) -> list[Any]:
            return [agl.Triplet(prompt={"token_ids": [1, 2]}, response={"token_ids": [3]}, reward=self.reward)]

    daemon = FailClosedDaemon.__new__(FailClosedDaemon)  # only what _validate_data_v1 reads
    daemon.store, daemon.reward_fillna_value, daemon.excluded = Store(), 0.0, 0
    rollout = agl.Rollout(rollout_id="ro-1", input={"id": "t1"}, start_time=0.0)

    daemon.adapter = Adapter(reward=1.0)
    kept = asyncio.run(daemon._validate_data_v1(rollout))
    assert kept.final_reward == 1.0 and len(kept.triplets) == 1 and daemon.excluded == 0

    daemon.adapter = Adapter(reward=None)
    dropped = asyncio.run(daemon._validate_data_v1(rollout))
    assert dropped.final_reward is None and dropped.triplets == [] and daemon.excluded == 1

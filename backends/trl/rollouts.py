"""Agent rollouts as TRL GRPO samples: the agent runs against the policy server; its calls become one token sequence.

TRL's `rollout_func` gets the step's prompts already repeated `group_size` times (one entry per rollout) and returns
one sample per entry. A sample is the first call's prompt, then every model turn (trained, env_mask 1) with the text
the agent added between turns (tool results, check and rewrite requests: env_mask 0) in between. This differs from
agent-lightning's transition-level triplets, where each LLM call is its own sample carrying the rollout's reward;
here the whole multi-turn rollout is one sample, as in TRL's own tool loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.rollout import Agent, EvalSummary, Reward, Rollout, evaluate, run_rollouts
from backends.policy_server import CallRecord, PolicyServer

log = logging.getLogger(__name__)


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]
    continuous: bool


def flatten(calls: list[CallRecord], max_completion_tokens: int, pad_id: int) -> Sample:
    """One sequence from a rollout's calls. Stops at a call that does not continue the previous one."""
    if not calls:  # the agent failed before its first call: an empty, untrained sample
        return Sample([pad_id], [pad_id], [0], True)
    first = calls[0]
    completion, mask = list(first.completion_ids), [1] * len(first.completion_ids)
    continuous = True
    for call in calls[1:]:
        if call.reused_prefix != len(first.prompt_ids) + len(completion):
            continuous = False
            break
        added = call.prompt_ids[call.reused_prefix :]
        completion += added + call.completion_ids
        mask += [0] * len(added) + [1] * len(call.completion_ids)
    return Sample(first.prompt_ids, completion[:max_completion_tokens], mask[:max_completion_tokens], continuous)


def task_prompt(task: dict[str, Any]) -> str:
    """The dataset's `prompt` column: the task itself, which the rollout function hands to the agent."""
    return json.dumps(task, sort_keys=True)


class AgentRollouts:
    """TRL `rollout_func`: runs the agent on each prompt's task through `server` and scores it with `reward`."""

    def __init__(
        self,
        agent: Agent,
        reward: Reward,
        server: PolicyServer,
        sampling: dict[str, Any],
        max_completion_tokens: int,
    ) -> None:
        self.agent = agent
        self.reward = reward
        self.server = server
        self.sampling = sampling
        self.max_completion_tokens = max_completion_tokens
        self.last_stats: dict[str, float] = {}
        self.last_rollouts: list[Rollout] = []
        self._counter = 0

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        self.server.model = trainer.accelerator.unwrap_model(trainer.model)
        tasks = [json.loads(p) for p in prompts]
        rollouts, records = run_on_server(self.agent, tasks, self.server, self.sampling, self.reward, self._next_ids)
        pad_id = self.server.tokenizer.pad_token_id
        samples = [flatten(calls, self.max_completion_tokens, pad_id) for calls in records]
        n = len(rollouts)
        for rollout in rollouts:
            if rollout.error is not None:  # the step goes on; the run's log says what went wrong
                log.warning("rollout on task %s failed: %s", rollout.task.get("id"), rollout.error)
        self.last_rollouts = rollouts
        self.last_stats = {
            "rollout/turns_mean": sum(r.trajectory.turns for r in rollouts) / n,
            "rollout/llm_calls_mean": sum(len(c) for c in records) / n,
            "rollout/execution_error_rate": sum(r.trajectory.execution_errors for r in rollouts)
            / max(1, sum(r.trajectory.executions for r in rollouts)),
            "rollout/agent_error_rate": sum(r.error is not None for r in rollouts) / n,
            "rollout/reward_missing_rate": sum(r.reward is None for r in rollouts) / n,
            "rollout/discontinuous_rate": sum(not s.continuous for s in samples) / n,
            "rollout/model_tokens_mean": sum(sum(s.env_mask) for s in samples) / n,
        }
        return {
            "prompt_ids": [s.prompt_ids for s in samples],
            "completion_ids": [s.completion_ids for s in samples],
            "logprobs": None,
            "env_mask": [s.env_mask for s in samples],
            "rollout_reward": [r.reward for r in rollouts],
        }

    def _next_ids(self, count: int) -> list[str]:
        start, self._counter = self._counter, self._counter + count
        return [f"r{i}" for i in range(start, start + count)]


def run_on_server(
    agent: Agent,
    tasks: list[dict[str, Any]],
    server: PolicyServer,
    sampling: dict[str, Any],
    reward: Reward,
    new_ids: Callable[[int], list[str]],
) -> tuple[list[Rollout], list[list[CallRecord]]]:
    """Run all tasks concurrently against `server`; returns the rollouts and each one's recorded calls."""
    ids = new_ids(len(tasks))
    chats = [server.chat_model(rid, sampling) for rid in ids]

    async def go() -> list[Rollout]:
        with server.active_rollouts(len(tasks)):
            return await run_rollouts(
                agent, tasks, lambda i: chats[i], reward, on_finished=lambda _i: server.rollout_finished()
            )

    rollouts = asyncio.run(go())
    return rollouts, [server.pop_records(rid) for rid in ids]


def validate_policy(
    agent: Agent,
    tasks: list[dict[str, Any]],
    server: PolicyServer,
    metric: Reward,
    sampling: dict[str, Any],
) -> tuple[EvalSummary, list[Rollout]]:
    """Evaluation of the server's current model on `tasks` (greedy when `sampling` says so), all batched together."""
    chats = [server.chat_model(f"val{i}", sampling) for i in range(len(tasks))]

    async def go() -> tuple[EvalSummary, list[Rollout]]:
        with server.active_rollouts(len(tasks)):
            return await evaluate(
                agent, tasks, lambda i: chats[i], metric, on_finished=lambda _i: server.rollout_finished()
            )

    try:
        return asyncio.run(go())
    finally:
        for i in range(len(tasks)):
            server.pop_records(f"val{i}")

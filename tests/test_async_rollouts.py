"""Asynchronous rollouts (`algorithm.async_rollouts`): the next step's batch generates while this step updates, one
step off-policy; each step trains on exactly the prompts TRL gave it, and says which weights sampled them.

On a micro model through AgentGRPOTrainer's own training loop: 6 tasks, 2 a step in 2 micro-batches, 2 epochs (6
steps, 3 an epoch)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

from agent.llm import OpenAIChat
from agent.trajectory import Trajectory
from backends.trl.rollouts import AgentRollouts
from inference.policy_server import PolicyServer
from inference.weights import GenerationWeights
from tests.conftest import FAST_RUN, HalfReward, agent_trainer, launch, micro_tiny

GROUP, TASKS_PER_STEP = 2, 2
BATCH = GROUP * TASKS_PER_STEP
QUESTIONS = ["How many?", "Again.", "Count them.", "Which one?", "Show all.", "List them."]
TASKS = [{"id": f"t{i}", "question": q} for i, q in enumerate(QUESTIONS)]
WAIT_S = 60.0  # the longest a step's end waits for the next batch's generation to start


@dataclass
class RecordingAgent:
    """One call a rollout; records which task each rollout ran, in the order they started."""

    started: list[str] = field(default_factory=list)
    lock: threading.Condition = field(default_factory=threading.Condition)

    async def run(self, task: dict[str, Any], llm: OpenAIChat) -> Trajectory:
        with self.lock:
            self.started.append(task["id"])
            self.lock.notify_all()
        messages = [{"role": "user", "content": task["question"]}]
        messages.append({"role": "assistant", "content": await llm.chat(messages)})
        return Trajectory(messages=messages, answer=task["id"], turns=1)


class StepRecord(TrainerCallback):
    """Each step's rollout stats at its end; before its optimizer step (the update under way), where the next step's
    batch was read ahead, waits (at most WAIT_S) until that batch's first rollout has started, and records whether
    it had: it can only have started during this update."""

    def __init__(self, agent: RecordingAgent, rollouts: AgentRollouts) -> None:
        self.agent, self.rollouts = agent, rollouts
        self.steps: list[dict[str, float]] = []
        self.started_during_update: dict[int, bool] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.rollouts._inflight is None:
            return
        step = state.global_step + 1  # the step under way
        with self.agent.lock:
            began = self.agent.lock.wait_for(lambda: len(self.agent.started) > step * BATCH, WAIT_S)
        self.started_during_update[step] = began

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps.append(dict(self.rollouts.last_stats))


def train(tmp_path: Path, asynchronous: bool) -> tuple[StepRecord, AgentRollouts, list[list[str]], RecordingAgent]:
    spec = micro_tiny(tmp_path / "models")
    source = spec.prepare([t["question"] for t in TASKS] * 10)
    model, tokenizer = spec.load_model(source, "cpu"), spec.load_tokenizer(source)
    agent = RecordingAgent()
    server = PolicyServer(model, tokenizer, max_prompt_tokens=128, max_response_tokens=16)
    weights = GenerationWeights("cpu", model.dtype, snapshot=asynchronous)
    rollouts = AgentRollouts(
        agent, HalfReward(), server, {"temperature": 1.0, "max_tokens": 8}, 16, 10.0, weights, asynchronous=asynchronous
    )
    asked: list[list[str]] = []

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        asked.append([p for p in prompts])
        return rollouts(prompts, trainer)

    record = StepRecord(agent, rollouts)
    trainer = agent_trainer(
        model, tokenizer, TASKS, rollout_func, tmp_path / "out", GROUP, TASKS_PER_STEP, asynchronous, [record]
    )
    trainer.train()
    assert trainer.state.global_step == 6
    return record, rollouts, asked, agent


def tasks_of(prompts: list[str]) -> list[str]:
    return [p.split('"id": "')[1].split('"')[0] for p in prompts]


def test_the_next_batch_generates_during_the_update_one_step_off_policy(tmp_path: Path) -> None:
    record, rollouts, asked, agent = train(tmp_path / "async", asynchronous=True)
    # every step after the first was generated during the previous step's update, by the weights before it, across
    # the epoch's end too (step 4 was read ahead from the second epoch during step 3)
    assert [s["rollout/prefetched"] for s in record.steps] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert [s["rollout/staleness"] for s in record.steps] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert [s["rollout/weights_step"] for s in record.steps] == [0.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    # before the optimizer step of each step but the last, the next batch's rollouts had started
    assert record.started_during_update == {1: True, 2: True, 3: True, 4: True, 5: True}
    # exact bookkeeping: the agents ran each step's prompts as TRL asked for them, in that order, each rollout once
    assert agent.started == [t for prompts in asked for t in tasks_of(prompts)]
    assert rollouts.missed == 0 and rollouts.close() == 0  # nothing read ahead in vain, nothing left in flight
    # the engine generated from a copy of the weights taken when it was loaded, not the ones the update writes
    assert rollouts.weights is not None and rollouts.weights._copy is not None
    assert rollouts.server.model is rollouts.weights._copy

    # reading ahead changed no step's data: the synchronous run (same seed) asks for the same prompts in each step
    on_policy, _, asked_on_policy, _ = train(tmp_path / "sync", asynchronous=False)
    assert asked == asked_on_policy
    assert [s.get("rollout/staleness") for s in on_policy.steps] == [None] * 6
    assert on_policy.started_during_update == {}


@pytest.mark.integration
@pytest.mark.parametrize("partial", [False, True])
def test_an_async_run_on_two_ranks_validates_between_steps_and_says_what_it_read_ahead(
    cache_dir: Path, tmp_path: Path, partial: bool
) -> None:
    """Through launch.py, 2 FSDP2 ranks (gloo): every rank loads the weights at the same points (a collective; with
    partial rollouts, under the batcher's lock while the batch read ahead generates), the validation waits for the
    batch in flight (it loads the engine), the summary says what was read ahead."""
    run = tmp_path / "run"
    args = [*FAST_RUN, "algorithm.async_rollouts=true", "algorithm.max_steps=3", "resources.gpus_per_node=2"]
    args.append(f"algorithm.partial_rollouts={str(partial).lower()}")
    result = launch([*args, f"hydra.run.dir={run}"], cache_dir, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["rollouts_per_rank"] == [6, 6]  # 2 tasks x 2 rollouts, 3 steps
    grpo = summary["grpo"]
    assert (grpo["async_rollouts"], grpo["prefetch_missed"], grpo["discarded_in_flight"]) == (True, 0, 0)
    assert grpo["partial_rollouts"] is partial
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
    assert [m["rollout/staleness"] for m in metrics] == [0.0, 1.0, 1.0]  # the mean over both ranks
    assert [m["rollout/weights_step"] for m in metrics] == [0.0, 0.0, 1.0]
    assert all("val/accuracy" in m for m in metrics)  # experiment=smoke validates every step

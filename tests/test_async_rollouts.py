"""Asynchronous rollouts (`algorithm.async_rollouts`): the next step's batch generates while this step updates, one
step off-policy; each step trains on exactly the prompts TRL gave it, and says which weights sampled them. A run
resumed in a later epoch, read ahead or not, reads that epoch's order (`EpochSampler`).

On a micro model through AgentGRPOTrainer's own training loop: 6 tasks, 2 a step in 2 micro-batches, 2 epochs (6
steps, 3 an epoch)."""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from accelerate.data_loader import prepare_data_loader, skip_first_batches
from torch.utils.data import DataLoader
from transformers import TrainerCallback
from trl.trainer.utils import RepeatSampler

from agent.llm import OpenAIChat
from agent.trajectory import Trajectory
from backends.trl.rollouts import AgentRollouts
from backends.trl.trainer import AgentGRPOTrainer, EpochSampler
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
        self.first_step = 0  # the step this start began at (a resumed run's is its checkpoint's)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.first_step = state.global_step

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.rollouts._inflight is None:
            return
        step = state.global_step + 1  # the step under way
        with self.agent.lock:
            began = self.agent.lock.wait_for(lambda: len(self.agent.started) > (step - self.first_step) * BATCH, WAIT_S)
        self.started_during_update[step] = began

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps.append(dict(self.rollouts.last_stats))


def train(
    tmp_path: Path, asynchronous: bool, save_every: int = 100, resume: str | None = None, epochs: int = 2
) -> tuple[StepRecord, AgentRollouts, list[list[str]], RecordingAgent]:
    """`epochs` of 3 steps (6 tasks, 2 a step); the prompts TRL asked the rollouts for at each step (`asked`)."""
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
        model, tokenizer, TASKS, rollout_func, tmp_path / "out", GROUP, TASKS_PER_STEP, asynchronous, [record],
        save_every=save_every, epochs=epochs,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume and str(tmp_path / "out" / resume))
    assert trainer.state.global_step == 3 * epochs
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


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_run_resumed_in_its_second_epoch_reads_each_later_epochs_order(tmp_path: Path, asynchronous: bool) -> None:
    """3 epochs, a checkpoint after step 4 (the second epoch's first): the resumed run asks for steps 5 to 9's tasks
    as the uninterrupted run did, not for the first epoch's order again (TRL's sampler draws each epoch's order from a
    generator seeded once per process). With `asynchronous`, step 6 reads the third epoch's first batch ahead, from
    the Trainer's data loader, which the resumed epoch did not read (it read a loader skipping step 4's batch)."""
    _, _, asked, _ = train(tmp_path, asynchronous, save_every=4, epochs=3)
    assert asked[1:3] != asked[4:6] and asked[3:6] != asked[6:]  # the epochs' orders differ where the resumed run reads
    _, _, resumed, _ = train(tmp_path, asynchronous, resume="checkpoint-4", epochs=3)
    assert resumed == asked[4:]


def test_each_epochs_order_is_the_one_trls_sampler_draws_in_that_epoch_of_one_process() -> None:
    trl = RepeatSampler(range(10), mini_repeat_count=2, batch_size=4, repeat_count=1, seed=7)
    uninterrupted = [list(trl) for _ in range(4)]  # one process: each pass draws the next order
    assert len({tuple(order) for order in uninterrupted}) == 4
    ours = EpochSampler(range(10), mini_repeat_count=2, batch_size=4, repeat_count=1, seed=7)
    for epoch in (0, 2, 1, 3, 3):  # a fresh process set to an epoch (a resume), in any order, any number of times
        ours.set_epoch(epoch)
        assert list(ours) == uninterrupted[epoch]
    with pytest.raises(ValueError, match="needs a seed"):
        EpochSampler(range(10), mini_repeat_count=2)


def trained_order(tasks: int, lookahead: int, max_steps: int, resume_at: int = 0) -> list[tuple[str, ...]]:
    """The tasks each step trains (one a group), from AgentGRPOTrainer's `get_batch_samples` reading `lookahead` steps
    ahead, driven as HF's Trainer drives it (its epochs through `_run_epoch`'s epoch setting, a resumed epoch from a
    loader skipping its trained steps): groups of 2, 2 tasks a step in 2 micro-batches."""
    group, per_step, micro = 2, 2, 2
    rows = [{"prompt": f"t{i}"} for i in range(tasks)]
    sampler = EpochSampler(rows, group, per_step, micro, True, 42)
    loader = prepare_data_loader(
        DataLoader(rows, batch_size=group * per_step, sampler=sampler, collate_fn=list),  # type: ignore[arg-type]
        num_processes=1, process_index=0, put_on_device=False,
    )  # fmt: skip

    class Reading(AgentGRPOTrainer):
        def __init__(self) -> None:  # only what get_batch_samples reads
            self.lookahead, self._ahead, self._sources = lookahead, deque(), {}
            self._train_dataloader, self._epoch = loader, 0
            self.state = SimpleNamespace(global_step=resume_at, max_steps=max_steps)
            self.model_accepts_loss_kwargs, self.compute_loss_func = False, None

    trainer, steps_per_epoch, trained = Reading(), len(loader) // micro, []
    first_epoch, skipped = divmod(resume_at, steps_per_epoch)
    for epoch in range(first_epoch, -(-max_steps // steps_per_epoch)):
        trainer._epoch = epoch
        trainer._read_epoch(epoch)
        epoch_loader = skip_first_batches(loader, skipped * micro) if epoch == first_epoch and skipped else loader
        epoch_loader.set_epoch(epoch)
        iterator = iter(epoch_loader)
        for _ in range(skipped if epoch == first_epoch else 0, steps_per_epoch):
            if trainer.state.global_step >= max_steps:
                break
            batches, _ = trainer.get_batch_samples(iterator, micro, "cpu")
            assert all(batch == batches[0] for batch in batches)  # one generation a step: its micro-batches repeat it
            trained.append(tuple(row["prompt"] for row in batches[0][::group]))
            trainer.state.global_step += 1
    return trained


@pytest.mark.parametrize("tasks", [2, 4, 6])  # 1, 2 and 3 steps an epoch
def test_reading_steps_ahead_trains_the_batches_a_run_reads_without_it_and_resumes_to_them(tasks: int) -> None:
    """Reading 1 to 3 steps ahead across epochs of 1 to 3 steps, to the run's last step, and resumed at every step
    (mid-epoch from a skipping loader): the steps train the batches, in the order, of a run reading none ahead."""
    for max_steps in (5, 7):
        plain = trained_order(tasks, 0, max_steps)
        assert len(plain) == max_steps and len(set(plain)) > 1  # the epochs' orders differ
        for lookahead in (1, 2, 3):
            assert trained_order(tasks, lookahead, max_steps) == plain
            for resumed in range(1, max_steps):
                assert trained_order(tasks, lookahead, max_steps, resume_at=resumed) == plain[resumed:]


def test_the_trainer_sets_each_epochs_order_where_accelerates_loader_does_not_pass_it_on() -> None:
    """On several ranks, a resumed epoch's loader (accelerate's skip over its rank's shard) does not pass `set_epoch`
    on to the sampler; the trainer sets each epoch it runs on the Trainer's own loader, which does."""
    sampler = EpochSampler(range(8), mini_repeat_count=1, batch_size=4, seed=0)
    shard = prepare_data_loader(
        DataLoader(range(8), sampler=sampler, batch_size=2), num_processes=2, process_index=0, put_on_device=False
    )
    skipping = skip_first_batches(shard, 1)
    skipping.set_epoch(3)  # what the Trainer calls for a resumed epoch
    assert sampler.epoch == 0

    class Epochs(AgentGRPOTrainer):
        def __init__(self) -> None:  # only what _run_epoch reads
            self._train_dataloader = shard
            self.state = SimpleNamespace(global_step=6, max_steps=6)  # trained: the epoch does not begin
            self.control = SimpleNamespace(should_training_stop=False)

    trainer = Epochs()
    trainer._run_epoch(epoch=3)
    assert sampler.epoch == 3 and trainer._epoch == 3 and trainer.control.should_training_stop


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

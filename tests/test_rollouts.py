"""`AgentRollouts` as TRL's rollout function, end to end on a tiny model: samples, masks, log-probs, rewards, metrics,
and fail-closed exclusion (an agent exception and a reward timeout in a group get zero weight and leave the others'
advantages as if they had never run); on 2 ranks, a group split between them is normalized as a whole."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from datasets import Dataset
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from agent.llm import OpenAIChat
from agent.rollout import Rollout, run_rollouts
from agent.trajectory import Trajectory
from backends.algorithm import GRPO, LOSS_TYPES, RFT
from backends.samples import check_stats
from backends.trl.backend import TRLBackend, _passthrough_reward
from backends.trl.rollouts import AgentRollouts, task_prompt
from backends.trl.trainer import (
    AgentGRPOTrainer,
    drop_nonfinite_gradients,
    importance_weights,
    trimmed,
)
from inference.policy_server import PolicyServer
from jobs.ranks import free_port
from tests.conftest import micro_tiny

GROUP = 4
# Rewards by rollout (r<i>: the i-th rollout of the step; task A is r0-r3, task B r4-r7).
REWARDS = {"r0": 1.0, "r1": 0.0, "r3": 1.0, "r4": 0.0, "r6": 1.0, "r7": 1.0}
AGENT_FAILS, REWARD_HANGS = "r2", "r5"


def rollout_id(llm: OpenAIChat) -> str:
    return str(llm.client.base_url).rstrip("/").split("/")[-2]  # .../rollouts/<id>/v1


@dataclass
class TwoTurnAgent:
    """Asks twice in one conversation; raises (after its first call) in rollout AGENT_FAILS."""

    async def run(self, task: dict[str, Any], llm: OpenAIChat) -> Trajectory:
        messages = [{"role": "user", "content": task["question"]}]
        first = await llm.chat(messages)
        if rollout_id(llm) == AGENT_FAILS:
            raise RuntimeError("the agent broke")
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Again."}]
        second = await llm.chat(messages)
        messages.append({"role": "assistant", "content": second})
        return Trajectory(messages=messages, answer=rollout_id(llm), turns=2)


class TableReward:
    """The reward in REWARDS; in rollout REWARD_HANGS it blocks until released (the timeout fires first)."""

    name = "table"

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float:
        if trajectory.answer == REWARD_HANGS:
            self.release.wait(60)
        return REWARDS[str(trajectory.answer)]


CORPUS = ["How many people are there?", "Again.", "SELECT count(*) FROM people"] * 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    spec = micro_tiny(tmp_path_factory.mktemp("models"))
    source = spec.prepare(CORPUS)
    return spec.load_model(source, "cpu"), spec.load_tokenizer(source)


def one_step(tiny: tuple[Any, Any], tmp_path: Path, algo: GRPO) -> tuple[AgentGRPOTrainer, AgentRollouts, Any]:
    """One generation batch of `algo` (2 tasks x GROUP rollouts of TwoTurnAgent, TableReward's rewards) through
    AgentGRPOTrainer: the trainer, its rollout function and the batch it built."""
    model, tokenizer = tiny
    reward = TableReward()
    server = PolicyServer(model, tokenizer, max_prompt_tokens=256, max_response_tokens=96)
    rollouts = AgentRollouts(TwoTurnAgent(), reward, server, {"temperature": 1.0, "max_tokens": 8}, 96, 0.5)
    tasks = [{"id": "A", "question": "How many people are there?"}, {"id": "B", "question": "Again."}]
    trainer = AgentGRPOTrainer(
        model=model,
        reward_funcs=[_passthrough_reward("table")],
        args=TRLBackend().grpo_config(algo, str(tmp_path), seed=0, device="cpu"),
        train_dataset=Dataset.from_list([{"prompt": task_prompt(t)} for t in tasks]),
        processing_class=tokenizer,
        rollout_func=rollouts,
        is_correction="token_truncate",
        is_cap=2.0,
        accept_reward=algo.accept_reward if isinstance(algo, RFT) else None,
    )
    inputs = [{"prompt": task_prompt(t)} for t in tasks for _ in range(GROUP)]
    trainer.model.train()  # as inside trainer.train(): the step's metrics are the training ones
    try:
        return trainer, rollouts, trainer._generate_and_score_completions(inputs)
    finally:
        reward.release.set()


def test_failed_rollouts_get_no_weight_and_do_not_shift_the_group_baseline(tiny: tuple[Any, Any], tmp_path: Path):
    algo = GRPO(group_size=GROUP, tasks_per_step=2, micro_batch_size=8, max_prompt_length=256, max_response_length=96)
    trainer, rollouts, output = one_step(tiny, tmp_path, algo)

    # The rollouts themselves: the failures are marked, with their reasons; the rest are exact two-turn samples.
    failures = [r.failure for r in rollouts.last_rollouts]
    assert failures == [None, None, "agent_error", None, None, "reward_error", None, None]
    assert "the agent broke" in str(rollouts.last_rollouts[2].error)
    assert "timed out" in str(rollouts.last_rollouts[5].error) and rollouts.last_rollouts[5].reward is None
    samples = rollouts.last_samples
    assert [s.excluded for s in samples] == [None, None, "agent_error", None, None, "reward_error", None, None]
    for sample in (s for s in samples if s.excluded is None):
        assert len(sample.completion_ids) == len(sample.env_mask) == len(sample.logprobs) <= 96
        assert sample.env_mask[0] == 1 and 0 in sample.env_mask  # model turn, then the masked "Again." turn
        assert all(lp < 0 for lp, m in zip(sample.logprobs, sample.env_mask, strict=True) if m == 1)
    stats = rollouts.last_stats
    assert stats["rollout/excluded_rate"] == 2 / 8
    assert stats["rollout/excluded_agent_error_rate"] == stats["rollout/excluded_reward_error_rate"] == 1 / 8
    assert stats["rollout/excluded_inexact_rate"] == stats["rollout/excluded_overflow_rate"] == 0
    assert stats["rollout/discontinuous_rate"] == 0

    # Zero weight in the loss: no token of an excluded row is in the loss mask, and its advantage is 0.
    loss_mask = output["completion_mask"] * output["tool_mask"]
    advantages = output["advantages"]
    for row in (2, 5):
        assert loss_mask[row].sum() == 0 and torch.all(advantages[row] == 0)
    assert output["num_items_in_batch"] == sum(sum(s.env_mask) for s in samples if s.excluded is None)

    # The others' advantages: normalized over their own group as if the excluded rollouts had never run.
    def expected(ids: list[str]) -> dict[str, float]:
        r = torch.tensor([REWARDS[i] for i in ids])
        return {i: float((REWARDS[i] - r.mean()) / (r.std() + 1e-4)) for i in ids}

    want = expected(["r0", "r1", "r3"]) | expected(["r4", "r6", "r7"])
    for row, rid in enumerate(f"r{i}" for i in range(8)):
        if rid in want:
            assert advantages[row] == pytest.approx(want[rid], abs=1e-4)

    # The IS weights come from the loss's own forward, folded into the advantages per token before TRL reads them;
    # on CPU float32 the sampler's and the trainer's log-probs agree: every weight is 1.
    micro = trimmed(output)
    trainer.current_gradient_accumulation_steps = 1
    trainer.compute_loss(trainer.model, micro)
    for row, rid in enumerate(f"r{i}" for i in range(8)):
        model_tokens = micro["completion_mask"][row].bool() & micro["tool_mask"][row].bool()
        expected_row = want.get(rid, 0.0)
        assert torch.allclose(micro["advantages"][row][model_tokens], torch.tensor(expected_row), atol=1e-4)
    assert trainer._is_stats is not None
    metrics = trainer._is_stats.metrics()
    assert metrics["sampling/logp_diff/max"] < 1e-4 and metrics["sampling/is_ratio/clipped_frac"] == 0
    assert trainer._is_stats.tokens == output["num_items_in_batch"]  # every model token of the kept rollouts


def test_rejection_sampling_trains_on_the_accepted_rollouts_alone(tiny: tuple[Any, Any], tmp_path: Path) -> None:
    """algorithm=rft: the same rollouts as GRPO; those with reward >= accept_reward (r0, r3, r6, r7) get advantage 1
    on their model tokens, the others (wrong, failed, excluded) no loss token, and the loss is normalized by the kept
    tokens: the gradient of their mean negative log-likelihood."""
    algo = RFT(group_size=GROUP, tasks_per_step=2, micro_batch_size=8, max_prompt_length=256, max_response_length=96)
    trainer, rollouts, output = one_step(tiny, tmp_path, algo)
    kept = [0, 3, 6, 7]
    loss_mask = output["completion_mask"] * output["tool_mask"]
    for row in range(8):
        model_tokens = torch.tensor(rollouts.last_samples[row].env_mask + [0] * 96)[: loss_mask.size(1)].bool()
        if row in kept:
            assert torch.equal(loss_mask[row].bool(), model_tokens) and loss_mask[row].sum() > 0
            assert output["advantages"][row] == 1.0
        else:
            assert loss_mask[row].sum() == 0
    assert output["num_items_in_batch"] == sum(sum(rollouts.last_samples[i].env_mask) for i in kept)
    assert trainer._metrics["train"]["rft/accepted_rate"][-1] == 4 / 8


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_of_like_lengths_train_the_gradient_of_the_plain_split(
    tiny: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loss_type: str
) -> None:
    """The micro-batches AgentGRPOTrainer trains (`micro_batches`: ordered by completion length where the loss type
    allows, else shuffled as TRL does; each cut to its longest row) give the gradient of TRL's split of the same
    order at full width, to float32 rounding, over fewer positions; and no forward runs over the batch before the
    update: the loss's own gives the IS weights."""
    calls: list[bool] = []
    original = AgentGRPOTrainer._get_per_token_logps_and_entropies

    def counted(self: AgentGRPOTrainer, *args: Any, **kwargs: Any) -> Any:
        calls.append(self._loss_inputs is not None)  # True: the loss's forward
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AgentGRPOTrainer, "_get_per_token_logps_and_entropies", counted)
    algo = GRPO(
        group_size=GROUP,
        tasks_per_step=2,
        micro_batch_size=2,
        max_prompt_length=256,
        max_response_length=96,
        loss_type=loss_type,
    )
    trainer, _, output = one_step(tiny, tmp_path, algo)
    assert calls == []  # the rollouts are scored by the update's forward
    accumulation = trainer.args.steps_per_generation
    assert accumulation == 4
    trainer.current_gradient_accumulation_steps = accumulation

    def gradient(micros: list[dict[str, Any]]) -> list[torch.Tensor]:
        trainer.model.zero_grad()
        for micro in micros:
            trainer.compute_loss(trainer.model, micro).backward()
        return [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    torch.manual_seed(0)
    ours = trainer.micro_batches(output)
    torch.manual_seed(0)  # the shuffle bnpo keeps: the same permutation
    plain = split_tensor_dict(output if loss_type != "bnpo" else shuffle_sequence_dict(output), accumulation)
    lengths = [int(n) for micro in ours for n in micro["completion_mask"].sum(dim=1)]
    if loss_type == "bnpo":  # its normalizer is per micro-batch: which rows share one matters
        assert lengths == [int(n) for micro in plain for n in micro["completion_mask"].sum(dim=1)]
    else:
        assert lengths == sorted(output["completion_mask"].sum(dim=1).tolist(), reverse=True)
    assert [m["completion_ids"].size(1) for m in ours] == [int(m["completion_mask"].sum(dim=1).max()) for m in ours]
    assert sum(m["completion_ids"].numel() for m in ours) < sum(m["completion_ids"].numel() for m in plain)
    expected, got = gradient(plain), gradient(ours)
    assert len(expected) == len(got) > 0
    for a, b in zip(expected, got, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert calls == [True] * 2 * accumulation  # one forward a micro-batch, the loss's


def test_importance_weights_truncate_and_mask_at_the_cap() -> None:
    trainer = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    sampler = torch.tensor([[-1.0, -1.0, -0.5, 0.0]])  # ratios e, 1, e^-1.5; the last token is environment
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, stats = importance_weights(trainer, sampler, mask, "token_truncate", cap=2.0)
    metrics = stats.metrics()
    assert torch.allclose(weights, torch.tensor([[2.0, 1.0, float(torch.exp(torch.tensor(-1.5))), 0.0]]))
    assert metrics["sampling/is_ratio/clipped_frac"] == pytest.approx(1 / 3)
    assert metrics["sampling/logp_diff/max"] == pytest.approx(1.5)
    weights, _ = importance_weights(trainer, sampler, mask, "token_mask", cap=2.0)
    assert weights[0, 0] == 0 and weights[0, 1] == 1
    weights, _ = importance_weights(trainer, sampler, mask, "sequence_truncate", cap=2.0)  # e^-0.5 for every token
    assert torch.allclose(weights[0, :3], torch.exp(torch.tensor(-0.5)).expand(3)) and weights[0, 3] == 0


def test_a_reward_that_raises_is_missing_not_zero() -> None:
    import asyncio

    def broken(task: dict[str, Any], trajectory: Trajectory) -> float:
        raise ValueError("gold SQL fails")

    class Quiet:
        async def run(self, task: dict[str, Any], llm: Any) -> Trajectory:
            return Trajectory(final_sql="SELECT 1")

    [rollout] = asyncio.run(run_rollouts(Quiet(), [{"id": 1}], lambda _i: None, broken))  # type: ignore[arg-type]
    assert rollout.reward is None and rollout.failure == "reward_error"
    assert "gold SQL fails" in str(rollout.error)
    assert json.dumps(rollout.record())  # still a record a run writes


def test_rewards_reuse_their_threads_and_a_hung_one_holds_only_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reward threads are kept between steps (no thread started per reward): over 10 steps of 8 rewards, no more
    threads run them than run at once in one step, plus the one a reward hung past its time limit keeps while the
    later steps go on without it."""
    import asyncio

    import agent.rollout

    monkeypatch.setattr(agent.rollout, "_REWARD_WORKERS", agent.rollout._DaemonWorkers())  # none left by other tests
    release = threading.Event()
    ran_on: set[threading.Thread] = set()  # the objects, whose identity is never reused (thread ids are)

    def reward(task: dict[str, Any], trajectory: Trajectory) -> float:
        if task["id"] == "hangs":
            release.wait(timeout=60)  # bounded: released at the end of the test
        ran_on.add(threading.current_thread())
        return 1.0

    class Quiet:
        async def run(self, task: dict[str, Any], llm: Any) -> Trajectory:
            return Trajectory(final_sql="SELECT 1")

    def step(tasks: list[dict[str, Any]]) -> list[Any]:
        return asyncio.run(run_rollouts(Quiet(), tasks, lambda _i: None, reward, reward_timeout_s=2))  # type: ignore[arg-type]

    try:
        first = step([{"id": i} for i in range(7)] + [{"id": "hangs"}])
        assert [r.reward for r in first] == [1.0] * 7 + [None] and "timed out" in str(first[-1].error)
        for _ in range(9):
            assert [r.reward for r in step([{"id": i} for i in range(8)])] == [1.0] * 8
        assert len(ran_on) <= 8 + 1  # a thread per reward would be 79
    finally:
        release.set()


def test_a_reward_worker_whose_hand_back_fails_lives_on_for_the_next_reward() -> None:
    """The worker counts itself free before handing the result back; if that raises, it must still take the job the
    count reserved for it (else that reward would wait forever)."""
    from agent.rollout import _DaemonWorkers

    workers = _DaemonWorkers()
    raised, second = threading.Event(), threading.Event()

    def fail(_result: Any) -> None:
        raised.set()
        raise ValueError("the caller is gone")

    workers.submit(lambda: 1, fail)
    assert raised.wait(timeout=10), "the first job's hand-back never ran"
    workers.submit(lambda: 2, lambda result: second.set() if result == 2 else None)  # reuses that worker
    assert second.wait(timeout=10), "the second job never ran: the worker died with a job reserved for it"


def test_check_stats_say_how_often_the_check_accepts_and_how_often_wrongly() -> None:
    def rollout(verdicts: list[bool], reward: float | None) -> Rollout:
        return Rollout(task={}, trajectory=Trajectory(verdicts=verdicts), reward=reward, error=None)

    rollouts = [
        rollout([True], 1.0),  # accepted, right
        rollout([True], 0.0),  # accepted, wrong
        rollout([False, True], 0.0),  # rewritten, then a wrong query accepted
        rollout([False, False], 1.0),  # rejected to the end (the turn limit)
        rollout([True], None),  # no reward: not counted among the accepted
    ]
    assert check_stats(rollouts) == {
        "rollout/check_said_correct_rate": 4 / 7,
        "rollout/check_accepted_wrong_rate": 2 / 3,
    }
    assert check_stats([rollout([], 1.0)]) == {}  # an agent without a check step logs no check metrics
    # a check that accepted nothing has no accepted-wrong rate (not 0: it was never tested)
    assert check_stats([rollout([False, False], 0.0)]) == {"rollout/check_said_correct_rate": 0.0}


def test_a_step_whose_gradient_is_not_finite_is_not_applied() -> None:
    """One NaN gradient applied turns every weight into NaN: its gradients are dropped, and the optimizer then leaves
    the weights (and its state) as they were; a finite step goes through."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    before = [p.detach().clone() for p in layer.parameters()]
    layer(torch.tensor([[1.0, float("nan"), 0.0]])).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
    assert drop_nonfinite_gradients(layer, norm) is True
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))
    layer(torch.ones(1, 3)).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
    assert drop_nonfinite_gradients(layer, norm) is False and drop_nonfinite_gradients(layer, None) is False
    optimizer.step()
    assert all(
        torch.isfinite(p).all() and not torch.equal(a, p) for a, p in zip(before, layer.parameters(), strict=True)
    )


# A group of 4 split between 2 ranks, 2 rollouts each: rank 0's rewards, then rank 1's.
SPLIT_REWARDS = {0: [1.0, 0.0], 1: [0.0, 0.0]}


class RankReward:
    """This rank's rewards in SPLIT_REWARDS, in the order of its rollouts (r0, r1 on every rank)."""

    name = "rank"

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float:
        return SPLIT_REWARDS[int(os.environ["RANK"])][int(str(trajectory.answer)[1:])]


def _split_group_rank(rank: int, port: int, models: Path, out: Path) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    spec = micro_tiny(models)
    source = spec.prepare(CORPUS)
    model, tokenizer = spec.load_model(source, "cpu"), spec.load_tokenizer(source)
    algo = GRPO(group_size=4, tasks_per_step=1, micro_batch_size=2, max_prompt_length=256, max_response_length=96)
    server = PolicyServer(model, tokenizer, max_prompt_tokens=256, max_response_tokens=96)
    rollouts = AgentRollouts(TwoTurnAgent(), RankReward(), server, {"temperature": 1.0, "max_tokens": 8}, 96)
    task = {"id": "A", "question": "How many people are there?"}
    trainer = AgentGRPOTrainer(
        model=model,
        reward_funcs=[_passthrough_reward("rank")],
        args=TRLBackend().grpo_config(algo, str(out / "trainer"), seed=0, device="cpu"),
        train_dataset=Dataset.from_list([{"prompt": task_prompt(task)}]),
        processing_class=tokenizer,
        rollout_func=rollouts,
    )
    trainer.model.train()
    output = trainer._generate_and_score_completions([{"prompt": task_prompt(task)} for _ in range(2)])  # its half
    torch.save(output["advantages"].tolist(), out / str(rank))  # one per rollout (no IS correction: not per token)


def test_a_group_split_across_ranks_is_normalized_as_a_whole(tmp_path: Path) -> None:
    """TRL gathers the step's rewards from every rank before it normalizes each group: a rank whose share of a group
    is all wrong still gets the group's baseline (normalized on its own it would get advantages of 0)."""
    micro_tiny(tmp_path / "models").prepare(CORPUS)  # built once, before the ranks load it
    mp.spawn(_split_group_rank, args=(free_port(), tmp_path / "models", tmp_path), nprocs=2, join=True)
    group = torch.tensor(SPLIT_REWARDS[0] + SPLIT_REWARDS[1])
    want = ((group - group.mean()) / (group.std() + 1e-4)).tolist()  # [1.5, -0.5, -0.5, -0.5]
    got = torch.load(tmp_path / "0") + torch.load(tmp_path / "1")
    assert got == pytest.approx(want, abs=1e-4)

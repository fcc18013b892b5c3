"""Carry-over (`algorithm.carry_over`, with partial rollouts): a step trains the groups that finished first, older
read-aheads first, and carries the unfinished ones over to later steps, where they generate on under each load. A
group is taken whole, once; every token keeps the log-prob it was sampled with; a rollout carried past
`max_staleness` is excluded (`stale`) and counted, never trained; TRL scores and logs the rows the step took.

The pipeline runs on a micro model through AgentGRPOTrainer's own loop with the HF engine: 6 tasks, 2 a step, groups
of 2, 2 epochs. The first group read ahead straggles: its rollouts send their second call only once a later step's
weights are loaded, so the steps before it go on without it."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import TrainerCallback
from trl import GRPOTrainer

from agent.llm import OpenAIChat
from agent.trajectory import Trajectory
from backends.algorithm import GRPO
from backends.samples import Sample, flatten
from backends.trl.rollouts import AgentRollouts, Generated, Group, InFlight
from backends.trl.trainer import AgentGRPOTrainer, read_carry_state, write_carry_state
from foundation.errors import ConfigError
from inference.hf import HFGenerate
from inference.policy_server import PolicyServer
from inference.weights import GenerationWeights
from tests.conftest import HalfReward, agent_trainer, micro_tiny
from tests.test_partial_rollouts import TASKS, WAIT_S, until

GROUP, TASKS_PER_STEP, STEPS = 2, 2, 6


@dataclass
class StragglingAgent:
    """Two calls a rollout; the rollouts of the task in `straggler` started before step `until` send their second
    call only once that step's weights are loaded (waiting at most WAIT_S; `came` says whether they came)."""

    server: PolicyServer
    until: int
    straggler: list[str] = field(default_factory=list)
    came: list[bool] = field(default_factory=list)

    async def run(self, task: dict[str, Any], llm: OpenAIChat) -> Trajectory:
        messages = [{"role": "user", "content": task["question"]}]
        messages += [{"role": "assistant", "content": await llm.chat(messages)}, {"role": "user", "content": "Why?"}]
        if task["id"] in self.straggler and self.server.ledger.weights_version < self.until:  # the first epoch
            self.came.append(await until(lambda: self.server.ledger.weights_version >= self.until, WAIT_S))
        messages.append({"role": "assistant", "content": await llm.chat(messages)})
        return Trajectory(messages=messages, answer=task["id"], turns=2)


class Watched(AgentRollouts):
    """Marks the first group read ahead as the straggler (its first epoch only) and records each step's take."""

    def __init__(self, *args: Any, agent: StragglingAgent, **kwargs: Any) -> None:
        super().__init__(agent, *args, **kwargs)
        self.takes: list[Take] = []
        self.added: list[tuple[str, int]] = []  # (task, the step it was read ahead for), in the order added
        self.states: list[dict[str, list[Any]]] = []

    def _add(self, rows: list[dict[str, Any]], for_step: int, prefetched: bool) -> None:
        for i in range(0, len(rows), self.group_size):
            task = json.loads(rows[i]["prompt"])["id"]
            if not self.added:
                self.agent.straggler.append(task)
            self.added.append((task, for_step))
        super()._add(rows, for_step, prefetched)

    def _batch(self, generated: Generated, step: int, timings: dict[str, float]) -> dict[str, Any]:
        batch = super()._batch(generated, step, timings)
        tasks = [json.loads(p)["id"] for p in generated.prompts[:: self.group_size]]
        self.takes.append(Take(step, tasks, dict(self.last_stats), generated, self.last_samples, batch))
        self.states.append(self.carry_state(step))  # what a checkpoint after this step would keep
        return batch


class LoggedPrompts(TrainerCallback):
    """The prompts TRL logged (its completions table's) at each step's end."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.steps: list[list[str]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.append(list(self.trainer._logs["prompt"]))


@dataclass
class Take:
    step: int
    tasks: list[str]  # one a group
    stats: dict[str, float]
    generated: Generated
    samples: list[Sample]
    batch: dict[str, Any]  # what TRL got


@pytest.mark.parametrize("straggle_until", [2, 3])
def test_a_step_trains_the_groups_finished_first_and_carries_a_straggler_over(
    tmp_path: Path, straggle_until: int
) -> None:
    """max_staleness 2: straggling until step 2's weights it trains at step 2; until step 3's, it is excluded."""
    max_staleness = 2
    spec = micro_tiny(tmp_path / "models")
    source = spec.prepare([t["question"] for t in TASKS] * 10 + ["Why?"] * 10)
    model, tokenizer = spec.load_model(source, "cpu"), spec.load_tokenizer(source)
    server = PolicyServer(model, tokenizer, max_prompt_tokens=128, max_response_tokens=32, engine=HFGenerate())
    agent = StragglingAgent(server, straggle_until)
    rollouts = Watched(
        HalfReward(),
        server,
        {"temperature": 1.0, "max_tokens": 6},
        32,
        10.0,
        GenerationWeights("cpu", model.dtype, snapshot=True),
        agent=agent,
        asynchronous=True,
        partial=True,
        max_staleness=max_staleness,
        carry_over=True,
        group_size=GROUP,
    )
    logged = LoggedPrompts()
    trainer = agent_trainer(
        model,
        tokenizer,
        TASKS,
        rollouts,
        tmp_path / "out",
        GROUP,
        TASKS_PER_STEP,
        lookahead=True,
        callbacks=[logged],
        take_rows=rollouts.take,
    )
    logged.trainer = trainer
    trainer.train()
    assert trainer.state.global_step == STEPS and agent.came == [True] * GROUP
    (straggler,) = agent.straggler

    # the first step adds its own groups and the next step's; every later step but the last the next step's
    assert [s for _, s in rollouts.added] == [0, 0] + [step + 1 for step in range(STEPS - 1) for _ in range(2)]
    # each group read ahead is taken once, whole, by one step: each epoch's tasks once each; nothing left over
    taken = [task for take in rollouts.takes for task in take.tasks]
    assert sorted(taken) == sorted(t for t, _ in rollouts.added) and len(taken) == STEPS * TASKS_PER_STEP
    assert sorted(taken) == sorted([t["id"] for t in TASKS] * 2)
    for take in rollouts.takes:  # whole groups: each task's group_size rollouts side by side
        ids = [json.loads(p)["id"] for p in take.generated.prompts]
        assert ids == [task for task in ids[::GROUP] for _ in range(GROUP)]
    assert [take.step for take in rollouts.takes] == list(range(STEPS))
    assert rollouts.close() == 0 and rollouts.dropped == 0
    # TRL scored and logged the rows each step took, not the ones the Trainer read for it
    assert logged.steps == [take.generated.prompts for take in rollouts.takes]

    # the steps before straggle_until did not wait for the straggler: it was taken by the step whose weights its
    # second call waited for, carried over from step 0, its calls sampled by step 0's weights and that step's
    take = next(take for take in rollouts.takes if straggler in take.tasks)
    assert take.step == straggle_until and take.stats["rollout/carried_over"] == 1 / TASKS_PER_STEP
    assert take.stats["rollout/staleness"] == straggle_until
    assert sum(t.stats["rollout/taken_early"] for t in rollouts.takes[:straggle_until]) > 0  # later groups filled in
    # a checkpoint after step 0 would keep the straggler's rows (carried) and the groups step 0 took early
    carried, early = rollouts.states[0]["carried"], rollouts.states[0]["early"]
    assert [json.loads(row["prompt"])["id"] for row in carried] == [straggler] * GROUP
    assert len(early) == rollouts.takes[0].stats["rollout/taken_early"] * TASKS_PER_STEP > 0
    assert all(json.loads(prompt)["id"] in rollouts.takes[0].tasks for prompt in early)
    first = take.tasks.index(straggler) * GROUP
    straggled = range(first, first + GROUP)
    for i in straggled:
        assert [c.weights_version for c in take.generated.records[i]] == [0, straggle_until]
    # within the bound the straggler trains as sampled; beyond it, it is excluded (stale) and counted, never trained
    expected = None if max_staleness >= straggle_until else "stale"
    assert [take.samples[i].excluded for i in straggled] == [expected] * GROUP
    assert take.stats["rollout/excluded_stale_rate"] == (0.0 if expected is None else 1 / TASKS_PER_STEP)
    for t in rollouts.takes:  # token-exact: what TRL trains is the sampled calls' tokens, with their log-probs
        for i, (calls, sample) in enumerate(zip(t.generated.records, t.samples, strict=True)):
            assert t.batch["completion_ids"][i] == sample.completion_ids and t.batch["logprobs"][i] == sample.logprobs
            if sample.excluded is None:
                assert sample == flatten(calls, 32)
                model_logprobs = [lp for lp, m in zip(sample.logprobs, sample.env_mask, strict=True) if m]
                assert model_logprobs == [lp for call in calls for lp in call.logprobs or []] and model_logprobs
            else:
                assert sample.env_mask == [0] and t is take


def test_carry_over_needs_partial_rollouts_and_a_bound_that_keeps_a_group_carried_once() -> None:
    with pytest.raises(ValueError, match=r"algorithm\.carry_over"):
        GRPO(async_rollouts=True, carry_over=True)
    with pytest.raises(ValueError, match=r"algorithm\.max_staleness=1 with algorithm\.carry_over"):
        GRPO(async_rollouts=True, partial_rollouts=True, carry_over=True)
    assert GRPO(async_rollouts=True, partial_rollouts=True, carry_over=True, max_staleness=2).carry_over
    assert GRPO(async_rollouts=True, partial_rollouts=True, carry_over=True, max_staleness=None).carry_over
    with pytest.raises(ValueError, match="partial"):
        AgentRollouts(None, None, None, {}, 8, asynchronous=True, carry_over=True)  # type: ignore[arg-type]
    algo = GRPO(async_rollouts=True, partial_rollouts=True, carry_over=True, max_staleness=2, group_size=8,
                tasks_per_step=4, micro_batch_size=4)  # fmt: skip
    with pytest.raises(ConfigError, match=r"not whole groups of algorithm\.group_size=8"):
        algo.per_rank(8)  # 4 sequences a rank: half a group
    assert algo.per_rank(4) == (4, 2)


def test_rows_that_are_not_whole_groups_are_refused_before_anything_generates() -> None:
    rollouts = AgentRollouts(None, None, None, {}, 8, asynchronous=True, partial=True, carry_over=True, group_size=2)  # type: ignore[arg-type]
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=0))
    with pytest.raises(ValueError, match="not whole groups of 2"):
        rollouts.take([{"prompt": "a"}, {"prompt": "a"}, {"prompt": "b"}], trainer)
    with pytest.raises(ValueError, match="not one task's group"):
        rollouts._add([{"prompt": "a"}, {"prompt": "b"}], 0, prefetched=False)
    assert rollouts._loop is None and rollouts._pool == []


def test_a_step_that_saves_a_checkpoint_takes_no_group_read_ahead_for_a_later_step() -> None:
    """So that the pool then holds only the next step's groups, which a resumed run generates anew."""
    rollouts = AgentRollouts(None, None, None, {}, 8, asynchronous=True, partial=True, carry_over=True)  # type: ignore[arg-type]
    carried: Future[Generated] = Future()
    early: Future[Generated] = Future()
    early.set_result(Generated(["b"], [], [], 1.0, True))
    own = Group([{"prompt": "a"}], 1, InFlight(["a"], carried))
    ahead = Group([{"prompt": "b"}], 2, InFlight(["b"], early))
    rollouts._pool = [own, ahead]
    assert rollouts._first_done(1) == [ahead] and rollouts._pool == [own]  # not saving: the first done
    rollouts._pool = [own, ahead]
    finish = threading.Timer(0.05, carried.set_result, (Generated(["a"], [], [], 1.0, True),))
    finish.start()
    try:
        assert rollouts._first_done(1, up_to=1) == [own] and rollouts._pool == [ahead]  # waited for its own
    finally:
        finish.cancel()


def test_a_saving_step_asks_only_for_groups_read_ahead_for_it_or_earlier(monkeypatch: pytest.MonkeyPatch) -> None:
    """`take` passes its own step as the bound exactly at the steps that save a checkpoint (`save_steps`)."""
    rollouts = AgentRollouts(None, None, None, {}, 8, asynchronous=True, partial=True, carry_over=True)  # type: ignore[arg-type]
    bounds: list[int | None] = []
    done: Future[Generated] = Future()
    done.set_result(Generated(["a"], [], [], 1.0, True))
    monkeypatch.setattr(rollouts, "_load", lambda trainer: 0.0)
    monkeypatch.setattr(rollouts, "_upcoming_rows", lambda trainer, step: None)
    monkeypatch.setattr(rollouts, "_add", lambda rows, for_step, prefetched: None)
    monkeypatch.setattr(
        rollouts,
        "_first_done",
        lambda wanted, up_to=None: bounds.append(up_to) or [Group([{"prompt": "a"}], 0, InFlight(["a"], done))],
    )
    for step in range(6):
        trainer = SimpleNamespace(state=SimpleNamespace(global_step=step), args=SimpleNamespace(save_steps=3))
        rollouts.take([{"prompt": "a"}], trainer)
    assert bounds == [None, None, 2, None, None, 5]  # after steps 3 and 6 (global_step 2 and 5) a checkpoint


def test_a_resumed_run_trains_the_groups_carried_at_the_stop_and_not_those_trained_early(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint after step 2 keeps task c's group carried (read ahead for step 2, not trained) and task b's
    trained early, not d's (read ahead for step 3, generating); the resumed run's first step (3) reads a and b: its
    pool is c's group first, then a's, and neither b's nor d's is generated twice."""
    added: list[list[str]] = []

    def carrying(**kwargs: Any) -> AgentRollouts:
        rollouts = AgentRollouts(None, None, None, {}, 8, asynchronous=True, partial=True, carry_over=True, **kwargs)  # type: ignore[arg-type]
        monkeypatch.setattr(rollouts, "_load", lambda trainer: 0.0)
        monkeypatch.setattr(rollouts, "_upcoming_rows", lambda trainer, step: None)
        monkeypatch.setattr(rollouts, "_submit", submit)
        return rollouts

    def submit(prompts: list[Any], prefetched: bool) -> InFlight:
        added.append(prompts)
        done: Future[Generated] = Future()
        done.set_result(Generated(prompts, [], [], 1.0, prefetched))
        return InFlight(prompts, done)

    stopped = carrying(group_size=2)
    stopped._pool = [
        Group([{"prompt": "c"}] * 2, 2, InFlight(["c"] * 2, Future())),
        Group([{"prompt": "d"}] * 2, 3, InFlight(["d"] * 2, Future())),
    ]
    stopped._early = ["b"]
    write_carry_state(tmp_path / "checkpoint-3", stopped.carry_state(2))  # after step 2 (0-based): checkpoint-3
    kept = read_carry_state(str(tmp_path / "checkpoint-3"))
    assert kept == {"carried": [{"prompt": "c"}] * 2, "early": ["b"]}
    assert read_carry_state(str(tmp_path)) is None  # a checkpoint of a run without carry-over

    resumed = carrying(group_size=2)
    resumed.resume(kept)
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=3), args=SimpleNamespace(save_steps=100))
    rows = resumed.take([{"prompt": "a"}, {"prompt": "a"}, {"prompt": "b"}, {"prompt": "b"}], trainer)
    assert added == [["c", "c"], ["a", "a"]]  # b's group is not generated again
    assert rows == [{"prompt": "c"}] * 2 + [{"prompt": "a"}] * 2
    assert resumed._taken is not None and resumed._taken.timings["rollout/carried_over"] == 0.5

    other = carrying(group_size=2)  # the data's order after the resume differs: said, the step goes on
    other.resume({"carried": [], "early": ["z"]})
    assert other.take([{"prompt": "a"}, {"prompt": "a"}], trainer) == [{"prompt": "a"}] * 2
    assert "1 groups trained early before the resume are not among" in caplog.text

    monkeypatch.setattr("backends.trl.trainer.world_size", lambda: 2)  # resumed on another number of ranks
    assert read_carry_state(str(tmp_path / "checkpoint-3")) is None and "another number of ranks" in caplog.text


def test_a_checkpoint_has_its_carry_over_state_before_it_is_complete(tmp_path: Path) -> None:
    """`_save_checkpoint` writes it before the Trainer's files (a checkpoint is complete once those are)."""
    order: list[str] = []
    folder = tmp_path / "checkpoint-4"

    class Saving(AgentGRPOTrainer):
        def __init__(self) -> None:  # only what _save_checkpoint reads
            self.args = SimpleNamespace(output_dir=str(tmp_path), should_save=True)
            self.state = SimpleNamespace(global_step=4)
            self.checkpoint_bytes = None
            self.carry_state = lambda step: order.append(f"state after step {step}") or {"carried": [], "early": []}

    def trainer_files(self: Any, model: Any, trial: Any) -> None:
        order.append(f"trainer files, carry state written: {(folder / 'carry_over.rank0.json').is_file()}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GRPOTrainer, "_save_checkpoint", trainer_files)
        Saving()._save_checkpoint(None, None)
    assert order == ["state after step 3", "trainer files, carry state written: True"]

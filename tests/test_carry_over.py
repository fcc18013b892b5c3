"""Carry-over (`algorithm.carry_over`, with partial rollouts): a step trains the groups that finished first, older
read-aheads first, and carries the unfinished ones over to later steps, where they generate on under each load. A
group is taken whole, once; every token keeps the log-prob it was sampled with; a rollout carried past
`max_staleness` is excluded (`stale`) and counted, never trained; TRL scores and logs the rows the step took.

The pipeline runs on a micro model through AgentGRPOTrainer's own loop with the HF engine: 6 tasks, 2 a step, groups
of 2, 2 epochs, the groups of the next one or two steps read ahead (`algorithm.read_ahead_steps`). The first group
read ahead straggles: its rollouts send their second call only once a later step's weights are loaded, so the steps
before it go on without it."""

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
from tests.conftest import FAST_RUN, HalfReward, agent_trainer, launch, micro_tiny
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
        self.read: list[list[str]] = []  # the tasks the Trainer read for each step, one a group

    def take(self, rows: list[dict[str, Any]], trainer: Any) -> list[dict[str, Any]]:
        self.read.append([json.loads(row["prompt"])["id"] for row in rows[:: self.group_size]])
        return super().take(rows, trainer)

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


def epoch_orders(trainer: Any, epochs: int) -> list[list[str]]:
    """The tasks of each step, one a group, in the order the Trainer's sampler draws them with nothing read ahead."""
    sampler, steps = trainer._get_train_sampler(trainer.train_dataset), []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        drawn = [TASKS[i]["id"] for i in sampler]
        block = len(drawn) * TASKS_PER_STEP // len(TASKS)  # one step's draws: its tasks, repeated per micro-batch
        steps += [list(dict.fromkeys(drawn[i : i + block])) for i in range(0, len(drawn), block)]
    return steps


@pytest.mark.parametrize(("straggle_until", "read_ahead", "max_staleness"), [(2, 1, 2), (3, 1, 2), (3, 2, None)])
def test_a_step_trains_the_groups_finished_first_and_carries_a_straggler_over(
    tmp_path: Path, straggle_until: int, read_ahead: int, max_staleness: int | None
) -> None:
    """Reading one step ahead with max_staleness 2: straggling until step 2's weights it trains at step 2; until step
    3's, it is excluded. Reading two steps ahead, the pool holds more groups done than a step takes, so the straggler
    goes at the first step that finds it done (step 3 or later): unbounded, it trains however late."""
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
        read_ahead=read_ahead,
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
        lookahead=read_ahead,
        callbacks=[logged],
        take_rows=rollouts.take,
    )
    logged.trainer = trainer
    trainer.train()
    assert trainer.state.global_step == STEPS and agent.came == [True] * GROUP
    (straggler,) = agent.straggler

    # the first step adds its own groups and the next read_ahead steps'; every later step those of the step read_ahead
    # on, while there is one; the Trainer read each step's tasks in the order it reads them with nothing read ahead
    first = [step for step in range(read_ahead + 1) for _ in range(TASKS_PER_STEP)]
    later = [step + read_ahead for step in range(1, STEPS - read_ahead) for _ in range(TASKS_PER_STEP)]
    assert [s for _, s in rollouts.added] == first + later
    assert rollouts.read == epoch_orders(trainer, 2)
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

    # the steps before straggle_until did not wait for the straggler: reading one step ahead it was taken by the step
    # whose weights its second call waited for, carried over from step 0, its calls sampled by step 0's weights and
    # that step's; reading two ahead, by that step or a later one
    take = next(take for take in rollouts.takes if straggler in take.tasks)
    assert take.step == straggle_until if read_ahead == 1 else take.step >= straggle_until
    assert take.stats["rollout/carried_over"] >= 1 / TASKS_PER_STEP and take.stats["rollout/staleness"] == take.step
    assert sum(t.stats["rollout/taken_early"] for t in rollouts.takes[:straggle_until]) > 0  # later groups filled in
    # a checkpoint after step 0 would keep the straggler's rows (carried) and the groups step 0 took early
    carried, early = rollouts.states[0]["carried"], rollouts.states[0]["early"]
    assert [json.loads(row["prompt"])["id"] for row in carried] == [straggler] * GROUP
    assert len(early) == rollouts.takes[0].stats["rollout/taken_early"] * TASKS_PER_STEP > 0
    assert all(json.loads(prompt)["id"] in rollouts.takes[0].tasks and 0 < s <= read_ahead for s, prompt in early)
    start = take.tasks.index(straggler) * GROUP
    straggled = range(start, start + GROUP)
    for i in straggled:
        first_call, second_call = (c.weights_version for c in take.generated.records[i])
        assert first_call == 0 and straggle_until <= second_call <= take.step
    # within the bound the straggler trains as sampled; beyond it, it is excluded (stale) and counted, never trained
    expected = None if max_staleness is None or max_staleness >= take.step else "stale"
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
    with pytest.raises(ValueError, match=r"algorithm\.max_staleness=2 with algorithm\.carry_over.*set 3 or more"):
        GRPO(async_rollouts=True, partial_rollouts=True, carry_over=True, max_staleness=2, read_ahead_steps=2)
    assert GRPO(async_rollouts=True, partial_rollouts=True, carry_over=True, max_staleness=3, read_ahead_steps=2)
    with pytest.raises(ValueError, match=r"algorithm\.read_ahead_steps=2: only algorithm\.carry_over"):
        GRPO(async_rollouts=True, partial_rollouts=True, max_staleness=3, read_ahead_steps=2)
    with pytest.raises(ValueError, match="only carry-over"):
        AgentRollouts(None, None, None, {}, 8, asynchronous=True, partial=True, read_ahead=2)  # type: ignore[arg-type]
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
    monkeypatch.setattr(rollouts, "_upcoming_rows", lambda trainer, step, ahead=1: None)
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
    pool is c's group first, then a's, and neither b's nor d's is generated twice. Reading two steps ahead, e's group
    was trained early too (read ahead for step 4): step 4 reads e and f, and only f's is added, by the resumed run's
    first step reading two steps ahead, or its next step reading one; a checkpoint after step 3 still keeps e's."""
    added: list[list[str]] = []
    step_4 = [{"prompt": "e"}, {"prompt": "e"}, {"prompt": "f"}, {"prompt": "f"}]

    def carrying(**kwargs: Any) -> AgentRollouts:
        rollouts = AgentRollouts(None, None, None, {}, 8, asynchronous=True, partial=True, carry_over=True, **kwargs)  # type: ignore[arg-type]
        monkeypatch.setattr(rollouts, "_load", lambda trainer: 0.0)
        monkeypatch.setattr(rollouts, "_upcoming_rows", lambda trainer, step, ahead=1: step_4 if ahead == 1 else None)
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
    stopped._early = [(3, "b"), (4, "e")]
    write_carry_state(tmp_path / "checkpoint-3", stopped.carry_state(2))  # after step 2 (0-based): checkpoint-3
    kept = read_carry_state(str(tmp_path / "checkpoint-3"))
    assert kept == {"carried": [{"prompt": "c"}] * 2, "early": [[3, "b"], [4, "e"]]}
    assert read_carry_state(str(tmp_path)) is None  # a checkpoint of a run without carry-over

    resumed = carrying(group_size=2)
    resumed.resume(kept)
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=3), args=SimpleNamespace(save_steps=100))
    rows = resumed.take([{"prompt": "a"}, {"prompt": "a"}, {"prompt": "b"}, {"prompt": "b"}], trainer)
    assert added == [["c", "c"], ["a", "a"], ["f", "f"]]  # neither b's nor e's group is generated again
    assert rows == [{"prompt": "c"}] * 2 + [{"prompt": "a"}] * 2
    assert resumed._taken is not None and resumed._taken.timings["rollout/carried_over"] == 0.5
    assert [4, "e"] in resumed.carry_state(3)["early"]  # a second resume, from step 3's checkpoint, skips it too

    added.clear()
    two_ahead = carrying(group_size=2, read_ahead=2)
    two_ahead.resume(kept)
    two_ahead.take([{"prompt": "a"}, {"prompt": "a"}, {"prompt": "b"}, {"prompt": "b"}], trainer)
    assert added == [["c", "c"], ["a", "a"], ["f", "f"]]  # neither b's nor e's group generated again
    assert two_ahead._read_ahead == {4: ["e", "e", "f", "f"]}  # step 4's rows are checked against the ones read
    assert [4, "e"] in two_ahead.carry_state(3)["early"]

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


@pytest.mark.integration
def test_a_run_reading_two_steps_ahead_trains_through_launch_and_checkpoints_what_it_took_early(
    cache_dir: Path, tmp_path: Path
) -> None:
    """`python launch.py` with carry-over reading two steps ahead: 4 steps, a checkpoint every second (its take
    bounded to its own step); step 0 trains its own groups, every later step groups read ahead at an earlier one."""
    run = tmp_path / "run"
    args = [*FAST_RUN, "algorithm.async_rollouts=true", "algorithm.partial_rollouts=true", "algorithm.carry_over=true"]
    args += ["algorithm.read_ahead_steps=2", "algorithm.max_staleness=3", "algorithm.max_steps=4"]
    args += ["algorithm.save_every=2", "algorithm.keep_checkpoints=2", f"hydra.run.dir={run}"]
    result = launch(args, cache_dir, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    grpo = json.loads((run / "summary.json").read_text())["grpo"]
    assert (grpo["steps"], grpo["carry_over"], grpo["groups_dropped"]) == (4, True, 0)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
    staleness = [m["rollout/staleness"] for m in metrics]
    assert staleness[0] == 0 and all(1 <= s <= 3 for s in staleness[1:]), staleness
    for step in (2, 4):  # each checkpoint keeps its groups in flight
        assert read_carry_state(str(run / "checkpoints" / f"checkpoint-{step}")) is not None

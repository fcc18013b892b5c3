"""Partial rollouts (`algorithm.partial_rollouts`): each step loads its weights while the batch read ahead still
generates, so its unfinished rollouts finish under them; every call records the weights that sampled it, each token
keeps the log-prob it was sampled with, and a rollout sampled in part by weights older than `algorithm.max_staleness`
allows is excluded (`stale`), never trained.

The pipeline runs on a micro model through AgentGRPOTrainer's own loop with the HF engine (a batch engine: a load
waits for the batch generating, so a rollout spans a load between its turns): 6 tasks, 2 a step, 2 epochs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.llm import OpenAIChat
from agent.rollout import Rollout
from agent.trajectory import Trajectory
from backends.algorithm import GRPO
from backends.samples import flatten
from backends.trl.backend import TRLBackend
from backends.trl.rollouts import AgentRollouts, Generated, GenerationLoop, InFlight
from inference.engine import Completion
from inference.hf import HFGenerate
from inference.ledger import CallRecord, ChatRequest, TokenLedger
from inference.policy_server import PolicyServer
from inference.weights import GenerationWeights
from models.chat import ChatFormat
from tests.conftest import HalfReward, agent_trainer, micro_tiny

GROUP, TASKS_PER_STEP, STEPS = 2, 2, 6
QUESTIONS = ["How many?", "Again.", "Count them.", "Which one?", "Show all.", "List them."]
TASKS = [{"id": f"t{i}", "question": q} for i, q in enumerate(QUESTIONS)]
WAIT_S = 60.0  # the longest a rollout read ahead waits, after its first call, for the next step's weights


async def until(condition: Any, timeout_s: float) -> bool:
    """Whether `condition()` came true within `timeout_s` (polled)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


@dataclass
class SpanningAgent:
    """Two calls a rollout. A rollout of a batch read ahead for step s sends its second call only once step s's
    weights are loaded (`expect[task]`; it waits at most WAIT_S and records whether they came): it is unfinished
    when they load, and finishes under them."""

    server: PolicyServer
    expect: dict[str, int] = field(default_factory=dict)  # task -> the step its batch read ahead is for
    came: list[bool] = field(default_factory=list)

    async def run(self, task: dict[str, Any], llm: OpenAIChat) -> Trajectory:
        messages = [{"role": "user", "content": task["question"]}]
        messages += [{"role": "assistant", "content": await llm.chat(messages)}, {"role": "user", "content": "Why?"}]
        if (step := self.expect.get(task["id"])) is not None:
            self.came.append(await until(lambda: self.server.ledger.weights_version >= step, WAIT_S))
        messages.append({"role": "assistant", "content": await llm.chat(messages)})
        return Trajectory(messages=messages, answer=task["id"], turns=2)


class LockedGenerate(HFGenerate):
    """HF generate that records, for each batch, whether the batcher's lock was held while it generated."""

    def __init__(self) -> None:
        self.lock: threading.Lock | None = None
        self.held: list[bool] = []

    def generate(self, model: Any, *args: Any, **kwargs: Any) -> list[Completion]:
        assert self.lock is not None
        self.held.append(self.lock.locked())
        return super().generate(model, *args, **kwargs)


class Watched(AgentRollouts):
    """Records the order of its loads, starts and takes, and each step's batch as the trainer got it."""

    def __init__(self, *args: Any, agent: SpanningAgent, **kwargs: Any) -> None:
        super().__init__(agent, *args, **kwargs)
        self.events: list[tuple[str, int]] = []
        self.batches: list[tuple[int, Generated, dict[str, float]]] = []
        self._step = 0

    def _asynchronous(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        self._step = trainer.state.global_step
        return super()._asynchronous(prompts, trainer)

    def _load(self, trainer: Any) -> float:
        self.events.append(("load", trainer.state.global_step))
        return super()._load(trainer)

    def _start(self, prompts: list[Any]) -> None:
        for prompt in prompts:
            self.agent.expect[json.loads(prompt)["id"]] = self._step + 1
        super()._start(prompts)

    def _submit(self, prompts: list[Any], prefetched: bool) -> InFlight:
        self.events.append(("submit", self._step + prefetched))  # the step the batch is for
        return super()._submit(prompts, prefetched)

    def _collect(self, inflight: InFlight) -> Generated:
        self.events.append(("take", self._step))
        return super()._collect(inflight)

    def _batch(self, generated: Generated, step: int, timings: dict[str, float]) -> dict[str, Any]:
        batch = super()._batch(generated, step, timings)
        self.batches.append((step, generated, dict(self.last_stats)))
        return batch


def test_a_batch_read_ahead_finishes_under_the_next_weights_each_token_as_it_was_sampled(tmp_path: Path) -> None:
    spec = micro_tiny(tmp_path / "models")
    source = spec.prepare([t["question"] for t in TASKS] * 10 + ["Why?"] * 10)
    model, tokenizer = spec.load_model(source, "cpu"), spec.load_tokenizer(source)
    engine = LockedGenerate()
    server = PolicyServer(model, tokenizer, max_prompt_tokens=128, max_response_tokens=32, engine=engine)
    engine.lock = server.lock
    copy = GenerationWeights("cpu", model.dtype, snapshot=True)
    held_over_copy: list[bool] = []

    def for_generation(trained: Any) -> Any:  # the copy the engine reads, refreshed only under the batcher's lock
        held_over_copy.append(server.lock.locked())
        return copy.for_generation(trained)

    agent = SpanningAgent(server)
    rollouts = Watched(
        HalfReward(),
        server,
        {"temperature": 1.0, "max_tokens": 6},
        32,
        10.0,
        SimpleNamespace(for_generation=for_generation),  # type: ignore[arg-type]
        agent=agent,
        asynchronous=True,
        partial=True,
        max_staleness=1,
    )
    trainer = agent_trainer(model, tokenizer, TASKS, rollouts, tmp_path / "out", GROUP, TASKS_PER_STEP, lookahead=True)
    trainer.train()
    assert trainer.state.global_step == STEPS

    # each step loads its weights and starts the next batch before it waits for its own (the last starts none); the
    # first step's own batch goes first, so the rollouts are numbered in the order of the steps they are for
    expected = [("load", 0), ("submit", 0), ("submit", 1), ("take", 0)]
    for step in range(1, STEPS - 1):
        expected += [("load", step), ("submit", step + 1), ("take", step)]
    assert rollouts.events == [*expected, ("load", STEPS - 1), ("take", STEPS - 1)]
    # every rollout read ahead was unfinished when its step's weights loaded: its second call came after
    assert agent.came == [True] * (STEPS - 1) * TASKS_PER_STEP * GROUP
    # a batch generating and a refresh of the weights it reads never overlap: both hold the batcher's lock
    assert held_over_copy == [True] * STEPS and engine.held and all(engine.held)

    assert [step for step, _, _ in rollouts.batches] == list(range(STEPS))
    for step, generated, stats in rollouts.batches:
        versions = [[call.weights_version for call in calls] for calls in generated.records]
        # the first step's own batch on-policy; each later one began under the previous step's weights and
        # finished under its own: one step stale at most, within the bound, so trained
        assert versions == ([[0, 0]] if step == 0 else [[step - 1, step]]) * TASKS_PER_STEP * GROUP
        assert generated.started_version == max(step - 1, 0)  # the weights loaded when the batch began
        assert stats["rollout/staleness"] == min(step, 1) and stats["rollout/weights_step"] == max(step - 1, 0)
        assert stats["rollout/prefetched"] == float(step > 0) and stats["rollout/excluded_rate"] == 0.0
    # token-exact: the trained sample is the sampled calls' tokens, each with the log-prob it was sampled with
    _, last, _ = rollouts.batches[-1]
    for calls, sample in zip(last.records, rollouts.last_samples, strict=True):
        built = flatten(calls, 32)
        assert not isinstance(built, str) and sample == built
        model_logprobs = [lp for lp, m in zip(sample.logprobs, sample.env_mask, strict=True) if m]
        assert model_logprobs == [lp for call in calls for lp in call.logprobs or []] and len(model_logprobs) > 0
    loop = rollouts._loop
    assert loop is not None and rollouts.missed == 0 and rollouts.close() == 0
    assert not loop.thread.is_alive() and loop.loop.is_closed()  # the rollouts' loop ended with the run


def rollout_of(task: str, reward: float) -> Rollout:
    return Rollout({"id": task}, Trajectory(messages=[], answer=task, turns=2), reward, None)


def call(prompt: list[int], sampled: list[int], version: int, continues: bool = False) -> CallRecord:
    return CallRecord(prompt, sampled, [-0.5] * len(sampled), continues, "stop", True, len(prompt), version)


def test_a_rollout_sampled_in_part_by_weights_older_than_the_bound_is_excluded_and_counted() -> None:
    """At step 5 with max_staleness 1: a rollout whose first call was sampled by step 3's weights is excluded
    (stale: no reward, one masked token), one whose oldest call is step 4's is trained as it was sampled."""
    server = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0))
    rollouts = AgentRollouts(None, None, server, {}, 64, asynchronous=True, partial=True, max_staleness=1)  # type: ignore[arg-type]
    records = [
        [call([1, 2], [3, 4], 3), call([1, 2, 3, 4, 9], [5], 5, continues=True)],
        [call([1, 2], [6, 7], 4), call([1, 2, 6, 7, 9], [8], 5, continues=True)],
    ]
    generated = Generated(["a", "b"], [rollout_of("a", 1.0), rollout_of("b", 1.0)], records, 1.0, True)
    batch = rollouts._batch(generated, 5, {})
    stale, fresh = rollouts.last_samples
    assert stale.excluded == "stale" and stale.env_mask == [0] and batch["rollout_reward"] == [None, 1.0]
    assert fresh.excluded is None and fresh.completion_ids == [6, 7, 9, 8] and fresh.env_mask == [1, 1, 0, 1]
    assert fresh.logprobs == [-0.5, -0.5, 0.0, -0.5]
    assert rollouts.last_stats["rollout/excluded_stale_rate"] == 0.5
    assert rollouts.last_stats["rollout/excluded_rate"] == 0.5
    # the batch's staleness is its oldest call's, not a batch read ahead's one step
    assert rollouts.last_stats["rollout/weights_step"] == 3.0 and rollouts.last_stats["rollout/staleness"] == 2.0

    unbounded = AgentRollouts(None, None, server, {}, 64, asynchronous=True, max_staleness=None)  # type: ignore[arg-type]
    unbounded._batch(generated, 5, {})
    assert [s.excluded for s in unbounded.last_samples] == [None, None]


def test_a_call_records_the_weights_it_was_sent_to_even_when_a_load_comes_while_it_generates(tmp_path: Path) -> None:
    spec = micro_tiny(tmp_path / "models")
    tokenizer = spec.load_tokenizer(spec.prepare(QUESTIONS * 10))
    sent, release = threading.Event(), asyncio.Event()

    async def generate(prompt_ids: list[int], max_new_tokens: int, *, temperature: float, top_p: float) -> Completion:
        sent.set()
        await release.wait()
        return Completion([tokenizer.eos_token_id], "stop", [-0.1])

    ledger = TokenLedger(
        tokenizer, ChatFormat(tokenizer), max_prompt_tokens=256, max_response_tokens=8, generate=generate
    )
    ledger.weights_version = 3

    async def go() -> None:
        answer = asyncio.create_task(ledger.complete("r0", ChatRequest(messages=[{"role": "user", "content": "Hi"}])))
        await until(sent.is_set, WAIT_S)
        ledger.weights_version = 4  # a load while the call generates
        release.set()
        await answer
        await ledger.complete("r0", ChatRequest(messages=[{"role": "user", "content": "Hi"}]))

    asyncio.run(go())
    assert [record.weights_version for record in ledger.pop_records("r0")] == [3, 4]


def test_partial_rollouts_need_asynchronous_ones_and_a_staleness_bound_that_keeps_them() -> None:
    with pytest.raises(ValueError, match=r"algorithm\.partial_rollouts"):
        GRPO(partial_rollouts=True)
    with pytest.raises(ValueError, match=r"algorithm\.max_staleness=0"):
        GRPO(async_rollouts=True, max_staleness=0)
    assert GRPO(async_rollouts=True, partial_rollouts=True).max_staleness == 1
    assert GRPO(async_rollouts=True, max_staleness=None).max_staleness is None


def test_a_signal_while_waiting_for_a_batch_goes_through_as_it_is() -> None:
    """Ctrl-C or a second stop signal while the step waits for a batch is that signal, not the batch failing (a run
    stopped so is `interrupted` and resumable, not `failed`)."""
    never: Future[Generated] = Future()  # a batch that does not end (set after WAIT_S, to bound the test)
    previous = signal.signal(signal.SIGUSR1, signal.default_int_handler)  # raises KeyboardInterrupt
    interrupt = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1))
    bound = threading.Timer(WAIT_S, never.set_result, (None,))
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupt.start(), bound.start()
            InFlight([], never).wait()
    finally:
        interrupt.cancel(), bound.cancel()
        signal.signal(signal.SIGUSR1, previous)

    failed: Future[Generated] = Future()
    failed.set_exception(ValueError("the agent broke"))
    with pytest.raises(RuntimeError, match="in the background failed") as raised:
        InFlight([], failed).wait()
    assert isinstance(raised.value.__cause__, ValueError)


def test_a_batch_with_no_call_sent_is_as_stale_as_the_weights_it_started_under() -> None:
    server = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0))
    rollouts = AgentRollouts(None, None, server, {}, 64, asynchronous=True, max_staleness=1)  # type: ignore[arg-type]
    failed = Rollout({"id": "a"}, Trajectory(error="the agent broke"), None, "the agent broke", "agent_error")
    rollouts._batch(Generated(["a"], [failed], [[]], 1.0, True, started_version=4), 5, {})
    assert rollouts.last_stats["rollout/weights_step"] == 4.0 and rollouts.last_stats["rollout/staleness"] == 1.0
    assert rollouts.last_samples[0].excluded == "agent_error"


def test_a_batch_read_ahead_for_other_prompts_is_waited_for_never_trained_and_its_failure_only_logged() -> None:
    server = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0))
    rollouts = AgentRollouts(None, None, server, {}, 64, asynchronous=True)  # type: ignore[arg-type]
    pending: Future[Generated] = Future()
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (rollouts._matching(InFlight(["b"], pending), ["a"]), returned.set()))
    waiter.start()
    assert not returned.wait(0.2)  # still generating: not left to generate beside this step's batch
    pending.set_exception(ValueError("the agent broke"))
    assert returned.wait(WAIT_S) and rollouts.missed == 1  # its failure is not this step's
    waiter.join(WAIT_S)
    done: Future[Generated] = Future()
    done.set_result(Generated(["a"], [], [], 1.0, True))
    assert rollouts._matching(InFlight(["a"], done), ["a"]) is not None and rollouts.missed == 1


def test_a_failing_run_stops_the_rollouts_loop_without_waiting_for_its_batch() -> None:
    server = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0))
    rollouts = AgentRollouts(None, None, server, {}, 64, asynchronous=True)  # type: ignore[arg-type]
    loop = GenerationLoop()
    rollouts._loop, rollouts._inflight = loop, InFlight(["a"], loop.submit(asyncio.sleep(3600)))  # type: ignore[arg-type]
    assert rollouts.close(wait=False) == 1  # returns at once: the batch is not waited for
    loop.thread.join(WAIT_S)
    assert not loop.thread.is_alive()  # the loop stopped, and its thread ended


def test_partial_rollouts_run_with_vllm_in_its_own_process() -> None:
    """Its engine process is paused for each load (tests/test_vllm_engine.py): nothing refuses the pair."""
    TRLBackend(vllm_own_process=True).check_settings(ranks=1, algo=GRPO(async_rollouts=True, partial_rollouts=True))


class ArrivalLock:
    """A lock that says when someone arrived to take it (before they wait for it)."""

    def __init__(self) -> None:
        self.lock, self.arrived = threading.Lock(), threading.Event()

    def __enter__(self) -> None:
        self.arrived.set()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_the_wait_for_a_batch_generating_is_not_counted_as_the_weight_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """`timing_s/weight_sync` is the load's own time; waiting for the batcher's lock (a batch engine generating) is
    the step waiting for its rollouts. The clock moves only while the lock is held by the batch."""
    clock = [0.0]
    monkeypatch.setattr("backends.trl.rollouts.time.perf_counter", lambda: clock[0])
    loaded: list[int] = []
    lock = ArrivalLock()
    server = SimpleNamespace(lock=lock, load=lambda model, version: loaded.append(version))
    rollouts = AgentRollouts(None, None, server, {}, 8, asynchronous=True)  # type: ignore[arg-type]
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(unwrap_model=lambda m: m), model="weights", state=SimpleNamespace(global_step=3)
    )
    seconds: list[float] = []
    lock.lock.acquire()  # a batch generating
    loader = threading.Thread(target=lambda: seconds.append(rollouts._load(trainer)))
    loader.start()
    assert lock.arrived.wait(WAIT_S)
    clock[0] = 10.0  # the batch generated for 10 s while the load waited
    lock.lock.release()
    loader.join(WAIT_S)
    assert seconds == [0.0] and loaded == [3]

"""Running an agent over tasks: the one loop that training, validation and evaluation share."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent.llm import ChatModel
from agent.trajectory import Trajectory

log = logging.getLogger(__name__)

REWARDS_AT_ONCE = 32  # rewards scored concurrently (each may wait on a judge model)


class Agent(Protocol):
    async def run(self, task: dict[str, Any], llm: ChatModel) -> Trajectory: ...


# A reward may be None: missing (an LLM judge that could not be reached), never a silent 0.
Reward = Callable[[dict[str, Any], Trajectory], float | None]


AGENT_ERROR, REWARD_ERROR = "agent_error", "reward_error"


SUBSET = "subset"  # a task's subset of its split (data/spider.py `val_subset_field`): validation is scored per subset


@dataclass
class Rollout:
    """A task, what the agent did with it, and the score it got. `failure` says why the rollout cannot be trained on:
    the agent failed (`agent_error`: it raised, or its endpoint refused a call) or its reward did (`reward_error`:
    raised, timed out or returned None; the reward is then None)."""

    task: dict[str, Any]
    trajectory: Trajectory
    reward: float | None
    error: str | None
    failure: str | None = None
    reward_s: float | None = None  # how long the reward took, from its start (None: it never started)

    def record(self) -> dict[str, Any]:
        """The line written to `records.jsonl` / `samples/*.jsonl`."""
        return {
            "id": self.task.get("id"),
            "question": self.task.get("question"),
            "db_id": self.task.get("db_id"),
            "gold": self.task.get("query"),
            "final_sql": self.trajectory.final_sql,
            "answer": self.trajectory.answer,
            "reward": self.reward,
            "turns": self.trajectory.turns,
            "verdicts": self.trajectory.verdicts,
            "error": self.error,
            "failure": self.failure,
            "messages": self.trajectory.messages,
        } | ({SUBSET: self.task[SUBSET]} if SUBSET in self.task else {})


async def run_rollouts(
    agent: Agent,
    tasks: Sequence[dict[str, Any]],
    chat_for: Callable[[int], ChatModel],
    reward: Reward,
    *,
    concurrency: int | None = None,
    on_finished: Callable[[int], None] | None = None,
    reward_timeout_s: float | None = None,
) -> list[Rollout]:
    """Run `agent` on every task (at most `concurrency` at once) and score each; one failure never stops the rest.

    A rollout whose agent failed is still scored (evaluation counts it, usually as 0) and marked `agent_error`. A
    reward that raises, returns None (missing: a judge that could not be reached) or runs longer than
    `reward_timeout_s` gives None, never a silent 0, and is marked `reward_error`.
    """
    semaphore = asyncio.Semaphore(concurrency or len(tasks) or 1)
    reward_slots = asyncio.Semaphore(REWARDS_AT_ONCE)

    async def one(index: int, task: dict[str, Any]) -> Rollout:
        async with semaphore:
            try:
                trajectory = await agent.run(task, chat_for(index))
            except Exception as exc:
                trajectory = Trajectory(error=f"{type(exc).__name__}: {exc}")
            finally:
                if on_finished is not None:
                    on_finished(index)
        error = trajectory.error
        failure = None if error is None else AGENT_ERROR
        score: float | None
        reward_s = None
        try:
            async with reward_slots:  # the time limit counts from when the reward starts, not from when it queued
                started = time.monotonic()
                try:
                    score = await asyncio.wait_for(_in_thread(reward, task, trajectory), reward_timeout_s)
                finally:
                    reward_s = time.monotonic() - started
        except TimeoutError:
            score, error = None, error or f"reward timed out after {reward_timeout_s} s"
        except Exception as exc:
            score, error = None, error or f"reward failed: {type(exc).__name__}: {exc}"
        if score is None:  # missing is counted as such (EvalSummary.missing), not as an error
            failure = failure or REWARD_ERROR
        return Rollout(task=task, trajectory=trajectory, reward=score, error=error, failure=failure, reward_s=reward_s)

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))


class _DaemonWorkers:
    """Daemon threads that run rewards, started as needed and reused: a thread started per reward cost the event loop
    about 2 ms each while generation and other rewards held the GIL (`bench/rollout_loop.py`). Not asyncio's default
    executor nor a ThreadPoolExecutor: both are joined at exit, so a reward hung past its time limit would hold the
    whole step (and the process at exit). A hung reward keeps its thread; the next job starts another."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Callable[[Any], None]]] = queue.SimpleQueue()
        self._idle = 0  # threads free for a job: each queued job has one reserved
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], Any], then: Callable[[Any], None]) -> None:
        """Run `job()` on a worker, then `then(its result)` there, once the worker counts as free again."""
        with self._lock:
            reuse = self._idle > 0
            if reuse:
                self._idle -= 1
        if reuse:
            self._jobs.put((job, then))
        else:
            threading.Thread(target=self._work, args=(job, then), name="reward", daemon=True).start()

    def _work(self, job: Callable[[], Any], then: Callable[[Any], None]) -> None:
        while True:
            result = job()
            with self._lock:  # free before `then` tells the caller: its next job finds this thread
                self._idle += 1
            try:
                then(result)
            except Exception:  # counted free already: this thread must live on to take the job reserved for it
                log.exception("a reward's result could not be handed back")
            del job, then, result  # an idle worker holds nothing of the last rollout (its loop, task, trajectory)
            job, then = self._jobs.get()


_REWARD_WORKERS = _DaemonWorkers()


def _in_thread(reward: Reward, task: dict[str, Any], trajectory: Trajectory) -> asyncio.Future[float | None]:
    """`reward(task, trajectory)` on a daemon worker thread (`_DaemonWorkers`)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[float | None] = loop.create_future()

    def settle(set_outcome: Callable[[Any], None], outcome: Any) -> None:
        if not future.done():  # the wait may have given up (time limit) and cancelled it
            set_outcome(outcome)

    def work() -> tuple[Callable[[Any], None], Any]:
        try:
            return future.set_result, reward(task, trajectory)
        except Exception as exc:
            return future.set_exception, exc

    def then(outcome: tuple[Callable[[Any], None], Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for this reward any more
            loop.call_soon_threadsafe(settle, *outcome)

    _REWARD_WORKERS.submit(work, then)
    return future


@dataclass
class EvalSummary:
    """`accuracy` is the mean score over the rollouts that have one; `missing` counts those that do not."""

    accuracy: float
    n: int
    errors: int
    missing: int
    mean_turns: float
    wall_s: float

    @classmethod
    def of(cls, rollouts: Sequence[Rollout], wall_s: float) -> EvalSummary:
        n = len(rollouts)
        scored = [r.reward for r in rollouts if r.reward is not None]
        return cls(
            accuracy=sum(scored) / len(scored) if scored else 0.0,
            n=n,
            errors=sum(r.error is not None for r in rollouts),
            missing=n - len(scored),
            mean_turns=sum(r.trajectory.turns for r in rollouts) / n if n else 0.0,
            wall_s=wall_s,
        )

    @classmethod
    def per_subset(cls, rollouts: Sequence[Rollout]) -> dict[str, dict[str, float]]:
        """The summary's scores (no `wall_s`: the subsets ran together) per value of the tasks' `SUBSET`, sorted by
        value; a task without one is in none. Empty when no task has one."""
        groups: dict[str, list[Rollout]] = {}
        for r in rollouts:
            if SUBSET in r.task:
                groups.setdefault(r.task[SUBSET], []).append(r)
        scores = {name: vars(cls.of(groups[name], 0.0)) for name in sorted(groups)}
        return {name: {k: v for k, v in of.items() if k != "wall_s"} for name, of in scores.items()}


def item_scores(rollouts: Sequence[Rollout]) -> dict[str, float | None]:
    """Each task's score by its id (None where the reward is missing): what `RunDir.write_scores` keeps."""
    scores = {str(r.task["id"]): r.reward for r in rollouts}
    if len(scores) < len(rollouts):
        raise ValueError(f"{len(rollouts) - len(scores)} tasks share an id: item-level scores need unique task ids")
    return scores


async def evaluate(
    agent: Agent,
    tasks: Sequence[dict[str, Any]],
    chat_for: Callable[[int], ChatModel],
    metric: Reward,
    *,
    concurrency: int | None = None,
    on_finished: Callable[[int], None] | None = None,
    reward_timeout_s: float | None = None,
) -> tuple[EvalSummary, list[Rollout]]:
    start = time.monotonic()
    rollouts = await run_rollouts(
        agent,
        tasks,
        chat_for,
        metric,
        concurrency=concurrency,
        on_finished=on_finished,
        reward_timeout_s=reward_timeout_s,
    )
    return EvalSummary.of(rollouts, time.monotonic() - start), rollouts

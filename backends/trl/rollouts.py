"""Agent rollouts as TRL GRPO samples: the agent runs against the policy server; its calls become one token sequence.

TRL's `rollout_func` gets the step's prompts already repeated `group_size` times (one entry per rollout) and returns
one sample per entry (`backends/samples.py`: the rollout's calls as one token sequence, env_mask 0 for the tokens the
conversation added between turns).

Fail closed: a rollout that cannot be trained on exactly is excluded, and counted per reason in
`rollout/excluded_<reason>_rate`. Its sample is one masked token with reward None: TRL leaves it out of its group's
baseline, gives it advantage 0, and its loss mask is all zeros, so it gets no gradient at all (also none from a KL
term).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass
from typing import Any

from agent.rollout import Agent, EvalSummary, Reward, Rollout, evaluate, run_rollouts
from backends.memory import DeviceMemory
from backends.samples import EXCLUSION_REASONS, Sample, check_stats, oldest_weights, sample_of
from backends.trl.fsdp import OptimizerOffload
from foundation.interrupt import stop_requested
from foundation.ranks import world_size
from inference.policy_server import CallRecord, PolicyServer
from inference.weights import GenerationWeights

log = logging.getLogger(__name__)

LOOP_END_S = 60.0  # the longest `GenerationLoop.close` waits for its thread once the loop is told to stop


def task_prompt(task: dict[str, Any]) -> str:
    """The dataset's `prompt` column: the task itself, which the rollout function hands to the agent."""
    return json.dumps(task, sort_keys=True)


@dataclass
class Generated:
    """A rollout phase's result: the prompts' rollouts and each one's calls, its wall time, whether it was generated
    ahead (during the previous update), and the engine's weights when it started (`PolicyServer.load`'s version)."""

    prompts: list[Any]
    rollouts: list[Rollout]
    records: list[list[CallRecord]]
    wall_s: float
    prefetched: bool
    started_version: int = 0


@dataclass
class InFlight:
    """A batch generating on the background loop: its result, or its error, once it is done."""

    prompts: list[Any]
    future: Future[Generated]
    what: str = "the rollouts generating in the background"

    def wait(self) -> Generated:
        """The batch once it is done. Only the batch's own failure is raised as one: a signal that ends the wait
        (an `Interrupted`, Ctrl-C) goes through as it is."""
        wait_for_futures([self.future])
        if (error := self.future.exception()) is not None:
            raise RuntimeError(f"{self.what} failed") from error
        return self.future.result()


@dataclass
class Group:
    """Carry-over: one task's group of rollouts read ahead, its dataset rows (`group_size` copies of the task), the
    optimizer step it was read ahead for, and its generation on the background loop."""

    rows: list[dict[str, Any]]
    for_step: int
    inflight: InFlight


@dataclass
class Taken:
    """Carry-over: what a step took from the groups in flight, kept from `take` until TRL's rollout function asks."""

    generated: Generated
    timings: dict[str, float]


def without_groups(rows: list[dict[str, Any]], prompts: list[Any], group_size: int) -> list[dict[str, Any]]:
    """`rows` (whole groups) less one group for each of `prompts`."""
    left, kept = list(prompts), []
    for i in range(0, len(rows), group_size):
        group = rows[i : i + group_size]
        if group[0]["prompt"] in left:
            left.remove(group[0]["prompt"])
        else:
            kept += group
    if left:  # the data's order after a resume is not the one read ahead before: they may train again
        log.warning("carry-over: %d groups trained early before the resume are not among their step's rows", len(left))
    return kept


def merged(generated: list[Generated]) -> Generated:
    """Groups generated apart as one batch, in their order: its wall time the longest group's, its start the oldest
    group's weights."""
    return Generated(
        [p for g in generated for p in g.prompts],
        [r for g in generated for r in g.rollouts],
        [c for g in generated for c in g.records],
        max(g.wall_s for g in generated),
        all(g.prefetched for g in generated),
        min(g.started_version for g in generated),
    )


class GenerationLoop:
    """One event loop, in a thread of its own, for every batch of a run's asynchronous rollouts: two batches in
    flight at once (partial rollouts) share the batcher's state, which belongs to one loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="async-rollouts", daemon=True)
        self.thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, Generated]) -> Future[Generated]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self, wait: bool = True) -> None:
        """Stop the loop. `wait` (no batch in flight): its thread ends and the loop is closed (a call routed to it
        later is refused, not left hanging); else (the run failed) a batch in flight stops at its next await and the
        thread is left to end with the process."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        if not wait:
            return
        self.thread.join(timeout=LOOP_END_S)
        if self.thread.is_alive():
            log.warning("the rollouts' event loop did not stop within %.0f s; left to end with the process", LOOP_END_S)
            return
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()


class AgentRollouts:
    """TRL `rollout_func`: runs the agent on each prompt's task through `server` and scores it with `reward`."""

    def __init__(
        self,
        agent: Agent,
        reward: Reward,
        server: PolicyServer,
        sampling: dict[str, Any],
        max_completion_tokens: int,
        reward_timeout_s: float | None = None,
        weights: GenerationWeights | None = None,
        offload: OptimizerOffload | None = None,
        memory: DeviceMemory | None = None,
        asynchronous: bool = False,
        partial: bool = False,
        max_staleness: int | None = None,
        carry_over: bool = False,
        group_size: int = 1,
        read_ahead: int = 1,
    ) -> None:
        if partial and not asynchronous:
            raise ValueError("partial rollouts are asynchronous rollouts whose batch in flight spans a weight load")
        if carry_over and not partial:
            raise ValueError("carry-over takes the groups finished first from partial rollouts' batches in flight")
        if read_ahead != 1 and not carry_over:
            raise ValueError(f"read_ahead={read_ahead}: only carry-over reads more than one step ahead")
        self.agent = agent
        self.reward = reward
        self.server = server
        self.sampling = sampling
        self.max_completion_tokens = max_completion_tokens
        self.reward_timeout_s = reward_timeout_s
        self.weights = weights  # a sharded model's full copy for generation (None: the model itself)
        self.offload = offload  # the optimizer's state goes to CPU while the engine generates
        self.memory = memory  # the GPU's memory in use, per phase (rollout: engine awake; update: the rest)
        self.last_stats: dict[str, float] = {}
        self.last_rollouts: list[Rollout] = []
        self.last_samples: list[Sample] = []
        self.last_tokens: dict[str, int] = {}  # this rank's last phase: tokens prefilled, sampled, and trained on
        self._counter = 0  # rollouts started on this rank over the run (they are named r0, r1, ...)
        # algorithm.async_rollouts: the next step's batch generates in the background during this step's update
        self.asynchronous = asynchronous
        # algorithm.partial_rollouts: each step loads its weights while the batch read ahead still generates (its
        # unfinished rollouts go on under them) and starts the next batch before waiting for that one
        self.partial = partial
        # a rollout with a call sent to weights more than this many optimizer steps old is excluded (stale); None: none
        self.max_staleness = max_staleness
        self._loop: GenerationLoop | None = None  # asynchronous: where every batch generates
        self._inflight: InFlight | None = None
        self.missed = 0  # batches read ahead for prompts the step did not ask for (generated again)
        # algorithm.carry_over: a step trains the groups that finished first, older read-aheads first; the others
        # carry over to later steps, generating on (`take`)
        self.carry_over = carry_over
        self.group_size = group_size  # rollouts per task: a group is taken whole or not at all
        self._pool: list[Group] = []  # carry-over: the groups in flight or done and not yet taken, oldest first
        # algorithm.read_ahead_steps (carry-over): each take adds the groups of the step this many steps on
        self.read_ahead = read_ahead
        self._read_ahead: dict[int, list[Any]] = {}  # carry-over: the steps whose groups are in the pool, their prompts
        self._taken: Taken | None = None
        # carry-over: groups trained before the step they were read ahead for, as (that step, its prompt)
        self._early: list[tuple[int, Any]] = []
        self._resumed: dict[str, list[Any]] | None = None  # carry-over: `carry_state` of the checkpoint resumed from
        self.dropped = 0  # carry-over: groups read ahead that no step of this run took (a resumed run makes them anew)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        if self.carry_over:
            return self._carried(prompts, trainer)
        if self.asynchronous:
            return self._asynchronous(prompts, trainer)
        start = time.perf_counter()  # a sharded model's weights are gathered on every rank, then loaded
        step = trainer.state.global_step
        if self.memory is not None:
            self.memory.sample()  # the end of the previous update (without NVML, its only sample)
            self.memory.phase = "rollout"
        offload = self.offload.out_of_gpu(trainer.optimizer) if self.offload is not None else contextlib.nullcontext()
        with offload:
            self._load(trainer)
            weight_sync_s = time.perf_counter() - start
            try:
                generated = self._generate(prompts)
            finally:
                awake_gb = self.memory.sample() if self.memory is not None else 0.0
                self.server.engine.sleep()  # the update gets the memory an engine with its own weights holds
                if self.memory is not None:
                    self.memory.engine_slept(awake_gb)
                    self.memory.phase = "update"
        return self._batch(
            generated, step, {"timing_s/rollout": generated.wall_s, "timing_s/weight_sync": weight_sync_s}
        )

    def take(self, rows: list[dict[str, Any]], trainer: Any) -> list[dict[str, Any]]:
        """Carry-over: the rows this step trains, in place of `rows` (the ones the Trainer read for it), before TRL
        asks the rollout function for them. The step's weights load (rollouts in flight go on under them), the next
        step's groups start, and then the step takes as many whole groups as `rows` holds: the first to finish, and
        of those the ones read ahead for the earliest steps. The others carry over, generating on under every later
        load; `algorithm.max_staleness` excludes a rollout carried too long. Each group read ahead is taken once. The
        pool holds the groups of the next `read_ahead` steps besides this one's and those carried."""
        start = time.perf_counter()
        step = trainer.state.global_step
        if len(rows) % self.group_size:
            raise ValueError(f"a step's {len(rows)} rows are not whole groups of {self.group_size}")
        if self.memory is not None:
            self.memory.sample()  # the end of the previous update (without NVML, its only sample)
            self.memory.phase = "rollout"
        weight_sync_s = self._load(trainer)  # every step, on every rank: a collective when sharded
        if step not in self._read_ahead:  # nothing read ahead for it: the first step, or a resume
            resumed, self._resumed = self._resumed or {"carried": [], "early": []}, None
            # [step, prompt] pairs; a bare prompt (a checkpoint written before read_ahead) is for the first step
            self._early = [(e[0], e[1]) if isinstance(e, list) else (step, e) for e in resumed["early"]]
            self._add(resumed["carried"], step - 1, prefetched=False)  # carried over at the stop: first in the pool
            for ahead in range(self.read_ahead):  # this step's groups, then those of the steps read ahead before it
                later = rows if ahead == 0 else self._upcoming_rows(trainer, step, ahead)
                if later is None:
                    break
                self._read_ahead[step + ahead] = [r["prompt"] for r in later]
                self._add(self._untrained(later, step + ahead), step + ahead, prefetched=ahead > 0)
        if [r["prompt"] for r in rows] != self._read_ahead.pop(step):
            raise RuntimeError(f"carry-over: step {step}'s rows are not the ones read ahead for it")
        upcoming = self._upcoming_rows(trainer, step, self.read_ahead)
        if upcoming is not None:
            self._read_ahead[step + self.read_ahead] = [r["prompt"] for r in upcoming]
            self._add(self._untrained(upcoming, step + self.read_ahead), step + self.read_ahead, prefetched=True)
        # a step that saves a checkpoint trains this step's groups and those carried, none read ahead: the pool then
        # holds the later steps' groups, which a run resumed from the checkpoint generates anew (nothing twice or lost;
        # with read_ahead > 1 also groups of this step or earlier left over, which the checkpoint keeps as carried)
        saves = (step + 1) % trainer.args.save_steps == 0
        groups = self._first_done(len(rows) // self.group_size, None if not saves else step)
        self._early = [(s, p) for s, p in self._early if s > step]
        self._early += [(g.for_step, g.rows[0]["prompt"]) for g in groups if g.for_step > step]
        if self.memory is not None:
            self.memory.phase = "update"
        generated = merged([g.inflight.wait() for g in groups])
        n = len(groups)
        self._taken = Taken(
            generated,
            {
                "timing_s/rollout": time.perf_counter() - start - weight_sync_s,  # waiting for the groups taken
                "timing_s/rollout_generation": generated.wall_s,  # the longest group's own time, overlapped or not
                "timing_s/weight_sync": weight_sync_s,
                "rollout/prefetched": float(generated.prefetched),
                "rollout/carried_over": sum(g.for_step < step for g in groups) / n,  # read ahead for earlier steps
                "rollout/taken_early": sum(g.for_step > step for g in groups) / n,  # read ahead for later steps
                "rollout/groups_in_flight": float(len(self._pool)),  # after the take: what carries over
            },
        )
        return [dict(row) for g in groups for row in g.rows]

    def _untrained(self, rows: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        """Step `step`'s rows less the groups trained early for it: before a resume, or before one it resumed from
        (each kept until that step, so every checkpoint between has it)."""
        trained = [prompt for for_step, prompt in self._early if for_step == step]
        return without_groups(rows, trained, self.group_size) if trained else rows

    def carry_state(self, step: int) -> dict[str, list[Any]]:
        """Carry-over's part of the checkpoint after optimizer step `step` (0-based): the rows of the groups carried
        over (read ahead for it or earlier, not yet trained), and the groups trained early (read ahead for later
        steps) as [step, prompt]. A run resumed from it (`resume`) trains the former and not the latter again."""
        carried = [row for g in self._pool if g.for_step <= step for row in g.rows]
        return {"carried": carried, "early": [[s, p] for s, p in self._early if s > step]}

    def resume(self, state: dict[str, list[Any]]) -> None:
        """Resuming from a checkpoint with `carry_state` `state`: its first step's pool is the groups carried then,
        and its own rows and those of the steps read ahead less those trained early."""
        self._resumed = state

    def _upcoming_rows(self, trainer: Any, step: int, ahead: int = 1) -> list[dict[str, Any]] | None:
        """The rows of the step `ahead` steps after `step` where they are read ahead; None past the last step and once
        a stop signal came (alike on every rank: the step count, the data, and the signal gathered)."""
        last = step + ahead >= trainer.state.max_steps or on_any_rank(stop_requested() is not None)
        return None if last else trainer.upcoming_rows(ahead)

    def _add(self, rows: list[dict[str, Any]], for_step: int, prefetched: bool) -> None:
        """`rows`' groups into the pool, each generating on its own (rollouts numbered in the rows' order)."""
        for i in range(0, len(rows), self.group_size):
            group = rows[i : i + self.group_size]
            if any(row["prompt"] != group[0]["prompt"] for row in group):
                raise ValueError(f"rows {i}-{i + self.group_size - 1} are not one task's group")
            self._pool.append(Group(group, for_step, self._submit([row["prompt"] for row in group], prefetched)))

    def _first_done(self, wanted: int, up_to: int | None = None) -> list[Group]:
        """The `wanted` groups of the pool that finished first, taken out of it in the pool's order (older
        read-aheads first): waits until that many are done (a failed group is done; its error comes on `wait`).
        `up_to`: only groups read ahead for that step or earlier (there are at least `wanted` of them)."""
        pool = [g for g in self._pool if up_to is None or g.for_step <= up_to]
        if len(pool) < wanted:
            raise RuntimeError(f"{len(pool)} groups in flight for a step of {wanted}: each step adds its own")
        while sum(g.inflight.future.done() for g in pool) < wanted:
            wait_for_futures([g.inflight.future for g in pool if not g.inflight.future.done()],
                             return_when=FIRST_COMPLETED)  # fmt: skip
        taken = [g for g in pool if g.inflight.future.done()][:wanted]
        self._pool = [g for g in self._pool if all(g is not t for t in taken)]
        return taken

    def _carried(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """Carry-over: the batch `take` chose for this step (the prompts TRL asks for are its rows')."""
        taken, self._taken = self._taken, None
        if taken is None or taken.generated.prompts != prompts:
            raise RuntimeError("carry-over: the rollout function was asked for other prompts than the step took")
        if not self._pool:
            self.server.engine.sleep()  # nothing to generate during this update
        return self._batch(taken.generated, trainer.state.global_step, taken.timings)

    def _asynchronous(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """This step's rollouts, generated during the previous step's update where they were read ahead (one step
        off-policy: by the weights before that update); then the next step's start with the weights as they are
        now, in the background, while this step scores and updates. The first step, an epoch's first, and a step
        whose prompts were not the ones read ahead generate here, on-policy. Partial rollouts: the weights load and
        the next batch starts first, and the batch read ahead finishes under them (its calls sent from then on are
        sampled by this step's weights; its oldest calls are still one step behind)."""
        start = time.perf_counter()
        step = trainer.state.global_step  # optimizer steps applied to the trainer's weights so far
        if self.memory is not None:
            self.memory.sample()  # the end of the previous update (without NVML, its only sample)
            self.memory.phase = "rollout"
        inflight, self._inflight = self._inflight, None
        if self.partial:
            weight_sync_s = self._load(trainer)  # every step, on every rank: a collective when sharded
            # this step's batch goes first (nothing read ahead for these prompts: it generates beside the next one)
            own = self._matching(inflight, prompts) or self._submit(prompts, prefetched=False)
            upcoming = self._upcoming(trainer, step)
            if upcoming is not None:
                self._start(upcoming)
            generated = self._collect(own)
        else:
            own = self._matching(inflight, prompts)
            generated, weight_sync_s = (None if own is None else self._collect(own)), 0.0
            # a load is a collective when the model is sharded: every rank loads when any rank generates here
            loaded = on_any_rank(generated is None)
            if loaded:
                weight_sync_s = self._load(trainer)
            if generated is None:
                generated = self._generate(prompts)
            upcoming = self._upcoming(trainer, step)
            if upcoming is not None:
                if not loaded:  # else the weights were just loaded, for this step's own rollouts
                    weight_sync_s = self._load(trainer)
                self._start(upcoming)
        if upcoming is None:
            self.server.engine.sleep()  # nothing to generate during this update
        if self.memory is not None:
            self.memory.phase = "update"
        waited = time.perf_counter() - start - weight_sync_s
        return self._batch(
            generated,
            step,
            {
                # what this step spent on its rollouts: waiting (for the batcher's lock too), or generating them
                "timing_s/rollout": waited,
                "timing_s/rollout_generation": generated.wall_s,  # the batch's own time, overlapped or not
                "timing_s/weight_sync": weight_sync_s,
                "rollout/prefetched": float(generated.prefetched),
                "rollout/prefetch_missed": float(self.missed),  # so far: read ahead but not asked for, generated again
            },
        )

    def _upcoming(self, trainer: Any, step: int) -> list[Any] | None:
        """The next step's prompts where they are read ahead (`_upcoming_rows`)."""
        rows = self._upcoming_rows(trainer, step)
        return None if rows is None else [row["prompt"] for row in rows]

    def _load(self, trainer: Any) -> float:
        """The trainer's weights as they are now into the engine (a collective when sharded), stamped with its
        optimizer steps; its seconds. The batcher's lock is held over the copy and the load: a batch read ahead and
        generating meanwhile (partial rollouts) is generated by one set of weights whole."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        with self.server.lock:  # the wait for it is not the load's: a batch generating (timing_s/rollout)
            start = time.perf_counter()
            self.server.load(
                model if self.weights is None else self.weights.for_generation(model), trainer.state.global_step
            )
        return time.perf_counter() - start

    async def _rollouts(self, prompts: list[Any], prefetched: bool) -> Generated:
        start, version = time.perf_counter(), self.server.ledger.weights_version
        tasks = [json.loads(p) for p in prompts]
        rollouts, records = await rollouts_on_server(
            self.agent, tasks, self.server, self.sampling, self.reward, self._next_ids, self.reward_timeout_s
        )
        return Generated(prompts, rollouts, records, time.perf_counter() - start, prefetched, version)

    def _generate(self, prompts: list[Any]) -> Generated:
        """This step's rollouts, generated now (asynchronous: on the background loop, beside any batch there)."""
        if not self.asynchronous:
            return asyncio.run(self._rollouts(prompts, prefetched=False))
        return self._collect(self._submit(prompts, prefetched=False))

    def _start(self, prompts: list[Any]) -> None:
        """Generate `prompts` in the background with the engine's current weights."""
        self._inflight = self._submit(prompts, prefetched=True)

    def _submit(self, prompts: list[Any], prefetched: bool) -> InFlight:
        if self._loop is None:
            self._loop = GenerationLoop()
        what = "the rollouts generating in the background" if prefetched else "this step's rollouts"
        return InFlight(prompts, self._loop.submit(self._rollouts(prompts, prefetched)), what)

    def _collect(self, inflight: InFlight) -> Generated:
        """A batch on the background loop, once it is done."""
        return inflight.wait()

    def settle(self) -> None:
        """Wait until the batch in flight (if any) is generated, keeping it: the engine is then free (validation
        loads other weights into it)."""
        if self._inflight is not None:
            self._inflight.wait()
        for group in self._pool:
            group.inflight.wait()

    def _matching(self, inflight: InFlight | None, prompts: list[Any]) -> InFlight | None:
        """The batch that was in flight, when it was read ahead for `prompts`; else None (one for other prompts is
        counted, waited for so that it is not generating beside this step's, and never trained on: its failure is
        only logged)."""
        if inflight is None or inflight.prompts == prompts:
            return inflight
        self.missed += 1
        log.warning("the rollouts read ahead were for other prompts than this step's: generated again")
        try:
            inflight.wait()
        except RuntimeError as exc:
            log.warning("the rollouts read ahead for other prompts failed (never trained on): %r", exc.__cause__)
        return None

    def close(self, wait: bool = True) -> int:
        """Drop the batch in flight (training stopped before its step) and carry-over's groups not taken (counted in
        `dropped`), once they are done (`wait`; else, a failing run, they stop with the loop at its next await), and
        stop the background loop; 1 when there was a batch or a group."""
        inflight, self._inflight = self._inflight, None
        pool, self._pool = self._pool, []
        self.dropped += len(pool)
        if (inflight is not None or pool) and wait:
            for batch in [inflight, *(g.inflight for g in pool)]:
                if batch is not None:
                    with contextlib.suppress(Exception):
                        batch.wait()
            self.server.engine.sleep()
        if self._loop is not None:
            self._loop.close(wait)
            self._loop = None
        return int(inflight is not None or bool(pool))

    def _batch(self, generated: Generated, step: int, timings: dict[str, float]) -> dict[str, Any]:
        """TRL's batch from the generated rollouts (excluded ones masked) for the trainer's `step` (a rollout sampled
        in part by weights more than `max_staleness` steps older is excluded) and the step's rollout stats."""
        rollouts, records = generated.rollouts, generated.records
        if self.asynchronous:  # the oldest weights any of the batch's calls was sent to (none sent: the batch's start)
            oldest = min((w for calls in records if (w := oldest_weights(calls)) is not None), default=None)
            oldest = generated.started_version if oldest is None else oldest
            timings = {
                **timings,
                "rollout/weights_step": float(oldest),
                "rollout/staleness": float(step - oldest),  # optimizer steps since then
            }
        pad_id = self.server.tokenizer.pad_token_id
        oldest_allowed = None if self.max_staleness is None else step - self.max_staleness
        samples = [
            sample_of(r, calls, self.max_completion_tokens, pad_id, oldest_allowed=oldest_allowed)
            for r, calls in zip(rollouts, records, strict=True)
        ]
        n = len(rollouts)
        for rollout, sample in zip(rollouts, samples, strict=True):
            if sample.excluded is not None:  # the step goes on; the run's log says what went wrong
                log.warning(
                    "rollout on task %s excluded (%s): %s", rollout.task.get("id"), sample.excluded, rollout.error
                )
        self.last_rollouts, self.last_samples = rollouts, samples
        trained = [s for s in samples if s.excluded is None]
        sampled = [c for calls in records for c in calls if c.sampled]
        self.last_tokens = {
            "prefill": sum(c.prefilled for c in sampled),  # what each call's engine computed of its prompt
            "generated": sum(len(c.completion_ids) for c in sampled),
            "trained": sum(len(s.prompt_ids) + len(s.completion_ids) for s in trained),
        }
        self.last_stats = {
            "rollout/turns_mean": sum(r.trajectory.turns for r in rollouts) / n,
            "rollout/llm_calls_mean": sum(len(c) for c in records) / n,
            "rollout/execution_error_rate": sum(r.trajectory.execution_errors for r in rollouts)
            / max(1, sum(r.trajectory.executions for r in rollouts)),
            "rollout/agent_error_rate": sum(r.failure == "agent_error" for r in rollouts) / n,
            "rollout/reward_missing_rate": sum(r.reward is None for r in rollouts) / n,
            "rollout/discontinuous_rate": sum(any(not c.continues for c in calls[1:]) for calls in records) / n,
            "rollout/excluded_rate": (n - len(trained)) / n,
            **{
                f"rollout/excluded_{reason}_rate": sum(s.excluded == reason for s in samples) / n
                for reason in EXCLUSION_REASONS
            },
            "rollout/model_tokens_mean": sum(sum(s.env_mask) for s in trained) / max(1, len(trained)),
            **check_stats(rollouts),
            # rollout: the phase's wall time (agents, their tool calls and rewards, overlapped); weight_sync: the
            # trainer's weights into the engine, before the rollouts; reward_sum: the rewards' own time
            **timings,
            "timing_s/reward_sum": sum(r.reward_s or 0.0 for r in rollouts),
        }
        return {
            "prompt_ids": [s.prompt_ids for s in samples],
            "completion_ids": [s.completion_ids for s in samples],
            "logprobs": [s.logprobs for s in samples],
            "env_mask": [s.env_mask for s in samples],
            # None: TRL leaves the sample out of its group's baseline and gives it advantage 0
            "rollout_reward": [
                r.reward if s.excluded is None else None for r, s in zip(rollouts, samples, strict=True)
            ],
        }

    @property
    def rollouts_run(self) -> int:
        """Rollouts this rank ran over the run."""
        return self._counter

    def _next_ids(self, count: int) -> list[str]:
        start, self._counter = self._counter, self._counter + count
        return [f"r{i}" for i in range(start, start + count)]


def on_any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is on some rank (a collective with several ranks)."""
    if world_size() == 1:
        return flag
    from accelerate.utils import gather_object

    return any(gather_object([flag]))


async def rollouts_on_server(
    agent: Agent,
    tasks: list[dict[str, Any]],
    server: PolicyServer,
    sampling: dict[str, Any],
    reward: Reward,
    new_ids: Callable[[int], list[str]],
    reward_timeout_s: float | None = None,
) -> tuple[list[Rollout], list[list[CallRecord]]]:
    """Run all tasks concurrently against `server`; returns the rollouts and each one's recorded calls."""
    ids = new_ids(len(tasks))
    chats = [server.chat_model(rid, sampling) for rid in ids]
    with server.active_rollouts(len(tasks)) as finished:
        rollouts = await run_rollouts(
            agent,
            tasks,
            lambda i: chats[i],
            reward,
            on_finished=lambda _i: finished(),
            reward_timeout_s=reward_timeout_s,
        )
    return rollouts, [server.pop_records(rid) for rid in ids]


def validate_policy(
    agent: Agent,
    tasks: list[dict[str, Any]],
    server: PolicyServer,
    metric: Reward,
    sampling: dict[str, Any],
    reward_timeout_s: float | None = None,
    route: str = "val",
) -> tuple[EvalSummary, list[Rollout]]:
    """Evaluation of the server's model on `tasks` (greedy when `sampling` says so), all batched together; the
    server's engine has its weights (`server.load`, which the caller makes on every rank when they are sharded).
    `route`: the rollouts' route names' prefix, what an agent that asks sees of why it runs (agent=lit: `val` is a
    validation rollout, anything else one that samples as in training, as the pool's do)."""
    chats = [server.chat_model(f"{route}{i}", sampling) for i in range(len(tasks))]

    async def go() -> tuple[EvalSummary, list[Rollout]]:
        with server.active_rollouts(len(tasks)) as finished:
            return await evaluate(
                agent,
                tasks,
                lambda i: chats[i],
                metric,
                on_finished=lambda _i: finished(),
                reward_timeout_s=reward_timeout_s,
            )

    try:
        return asyncio.run(go())
    finally:
        server.engine.sleep()
        for i in range(len(tasks)):
            server.pop_records(f"{route}{i}")

"""The TRL callbacks of backend=trl's arms: each arm's step log (metrics.jsonl, validation at its clock's cadence, the
stop at its budget's end) and the stop at a step's end on a signal.

Every callback here runs on every rank, and reaches its collectives in the same order on each (a collective reached
by one rank only hangs the run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from accelerate.utils import gather_object
from transformers import PreTrainedModel, TrainerCallback

from backends.memory import gpu_memory_metrics
from backends.trl.clock import Clock
from backends.trl.rollouts import AgentRollouts, on_any_rank
from backends.trl.trainer import AgentGRPOTrainer
from foundation.interrupt import stop_requested
from foundation.ranks import is_main, world_size
from foundation.run_dir import RunDir

# TRL log keys that are not per-step training metrics (end-of-training totals).
_NOT_STEP_METRICS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "epoch"}

Validate = Callable[[PreTrainedModel, str], dict[str, float]]  # (model, name) -> val/* (and test/*) metrics


def per_rank(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a collective with several ranks)."""
    return gather_object([value]) if world_size() > 1 else [value]


class StopAtStepEnd(TrainerCallback):
    """On a stop signal (`foundation.interrupt`) to any rank, checkpoint at the end of the current step and end
    training, on every rank together (a sharded checkpoint is a collective)."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if on_any_rank(stop_requested() is not None):
            control.should_save = True
            control.should_training_stop = True


class StepLog(TrainerCallback):
    """GRPO's (and RFT's) log: writes TRL's per-step logs, the rollouts' stats and the step's phase times
    (`timing_s/*`) to metrics.jsonl; validates at the clock's cadence and at the end: `max_steps`, or a time, FLOPs
    or GPU-seconds budget spent (it stops training there).

    timing_s/step: the whole optimizer step, validation included; weight_sync: the trainer's weights into the
    generation engine (gathered first when sharded; ~0 for an unsharded model and an engine that reads it);
    rollout: the agents, their tools and rewards (overlapped); reward_sum: the rewards' own time, summed; scoring:
    the batch's advantages (and a reference model's log-probs) after the rollouts; update: forward, backward and
    optimizer (the IS weights from the loss's forward);
    validation: when the step validated.
    """

    def __init__(
        self, run: RunDir, clock: Clock, rollouts: AgentRollouts, validate: Validate, trainer: AgentGRPOTrainer
    ) -> None:
        self.run = run
        self.clock = clock  # started at each step's begin: its seconds are the step's, validation left out
        self.rollouts = rollouts
        self.validate = validate
        self.trainer = trainer  # its phase times (`phase_s`, cleared after each step) and dropped steps
        self.forward_passes = int(clock.algo.kl_coef > 0)  # the reference model's (the IS weights: the loss's own)
        self.val_metrics: dict[str, float] = {}
        self.stats: dict[str, float] = {}  # the step's rollout stats (averaged over ranks)
        self.memory: dict[str, float] = {}  # the GPUs' memory in use so far, the most on any rank (`gpu_memory/*`)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.clock.start()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        seconds = self.clock.lap()
        if world_size() > 1:  # every rank's rollout stats, averaged (a collective: every rank is here)
            shares = gather_object([self.rollouts.last_stats])
            keys = dict.fromkeys(k for share in shares for k in share)  # a rank may lack one (no check verdicts)
            self.stats = {k: statistics.mean(s[k] for s in shares if k in s) for k in keys}
        else:
            self.stats = self.rollouts.last_stats
        tokens = per_rank(self.rollouts.last_tokens)  # summed over ranks (a collective)
        trained = sum(t.get("trained", 0) for t in tokens)
        self.clock.compute.add(
            trained=trained,
            generated=sum(t.get("generated", 0) for t in tokens),
            forward_only=self.forward_passes * trained,
            prefill=sum(t.get("prefill", 0) for t in tokens),
            seconds=seconds,
        )
        if self.rollouts.memory is not None:  # every rank has one on GPUs (a collective)
            self.memory = gpu_memory_metrics(per_rank(self.rollouts.memory.summary()))
        step = state.global_step
        end = self.clock.step_end(step, state.max_steps)
        if end.validates:
            start = time.perf_counter()
            self.val_metrics = self.validate(model, "final" if end.last else f"step{step}")
            self.val_metrics["timing_s/validation"] = time.perf_counter() - start
        if end.spent:
            control.should_training_stop = True

    def _timings(self) -> dict[str, float]:
        phase_s = self.trainer.phase_s
        rollout = self.stats.get("timing_s/rollout", 0.0) + self.stats.get("timing_s/weight_sync", 0.0)
        timings = {
            "timing_s/step": time.perf_counter() - self.clock.started,
            "timing_s/scoring": max(0.0, phase_s.get("generation", 0.0) - rollout),
            "timing_s/update": phase_s.get("update", 0.0),
        }
        phase_s.clear()
        return timings

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if not logs or "reward" not in logs or not is_main():
            return
        metrics = {
            ("train/reward_mean" if k == "reward" else f"train/{k}"): v
            for k, v in logs.items()
            if k not in _NOT_STEP_METRICS
        }
        metrics["train/elapsed_s"] = self.clock.train_s
        metrics["train/nonfinite_grad_steps"] = self.trainer.nonfinite_steps
        metrics |= self.clock.compute.metrics()
        metrics |= self.memory
        self.run.log(state.global_step, metrics | self.stats | self._timings() | self.val_metrics)
        self.val_metrics = {}


class ControlLog(TrainerCallback):
    """The control arms' log: at each validation (the clock's cadence, and the end: a time, FLOPs or GPU-seconds
    budget spent, or `max_steps`, where it stops training) one metrics.jsonl line of the training seconds, the last
    SFT loss, the compute and the validation's metrics. Its clock runs from one step's end (after any validation) to
    the next."""

    def __init__(self, run: RunDir, clock: Clock, validate: Validate, tokens_seen: Callable[[], float]) -> None:
        self.run = run
        self.clock = clock
        self.validate = validate
        self.tokens_seen = tokens_seen  # the trainer's tokens so far (every rank's non-padding tokens)
        self.loss: float | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.clock.start()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.loss = float(logs["loss"])

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        seconds = self.clock.lap()
        compute = self.clock.compute
        compute.trained = float(self.tokens_seen())
        compute.add(seconds=seconds)
        step = state.global_step
        end = self.clock.step_end(step, state.max_steps)
        if end.validates:
            metrics = {"train/elapsed_s": self.clock.train_s, "sft/loss": self.loss, **compute.metrics()}
            start = time.perf_counter()
            metrics |= self.validate(model, "final" if end.last else f"step{step}")
            metrics["timing_s/validation"] = time.perf_counter() - start
            if is_main():
                self.run.log(step, metrics)
        if end.last:
            control.should_training_stop = True
        self.clock.start()

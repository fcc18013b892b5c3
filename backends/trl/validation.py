"""The validation phase of a backend=trl run: greedy rollouts of the validation tasks (and, at the end, the test
tasks) by the current weights, on the run's policy server; a phase `TRLBackend.train` calls before training, between
steps and after."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedModel

from agent.rollout import EvalSummary, item_scores
from backends.setup import TrainSetup
from backends.trl.fsdp import OptimizerOffload
from backends.trl.rollouts import validate_policy
from foundation.ranks import is_main
from inference.policy_server import PolicyServer


@dataclass
class Validation:
    """Validates a model: `validation(model, name)` returns `val/*` (and at "final" `test/*`) metrics, and keeps each
    split's summary in `results[f"{split}_{name}"]`, every question's score in the run's scores/ and a few
    trajectories in its samples/.

    generation_copy: the model's weights as the engine generates from them (a sharded model's gathered copy);
    server: a policy server for those weights; offload: `backend.offload=optimizer`'s (the optimizer's state leaves
    the GPU while the engine is awake); trainer: GRPO's, in the copy that validates between its steps (`during`)."""

    setup: TrainSetup
    val_tasks: list[dict[str, Any]]
    test_tasks: list[dict[str, Any]]
    metric: Any
    generation_copy: Callable[[PreTrainedModel], PreTrainedModel]
    server: Callable[[PreTrainedModel], PolicyServer]
    samples_kept: int
    results: dict[str, Any]
    offload: OptimizerOffload | None = None
    trainer: Any = field(default=None)

    def during(self, trainer: Any) -> Validation:
        """This validation between `trainer`'s steps: its batch generating in the background is waited for first
        (validation loads the engine), and with `offload` its optimizer's state leaves the GPU meanwhile."""
        return replace(self, trainer=trainer)

    def __call__(self, model: PreTrainedModel, name: str) -> dict[str, float]:
        if self.trainer is not None:
            self.trainer.rollout_func.settle()
        if self.offload is None:
            return self.validate(model, name)
        with self.offload.out_of_gpu(self.trainer.optimizer if self.trainer is not None else None):
            return self.validate(model, name)

    def validate(self, model: PreTrainedModel, name: str) -> dict[str, float]:
        """Greedy validation. Called on every rank (a sharded model's weights are gathered by all); rank 0 alone
        validates, the other ranks go on to the next step and wait for it there."""
        run, algo = self.setup.run, self.setup.algorithm
        policy = self.generation_copy(model)
        server = self.server(policy)
        server.load(policy)  # every rank: an engine with its own weights gathers sharded ones while it loads
        if not is_main():
            server.engine.sleep()
            return {}
        phase, run.phase = run.phase, f"validation ({name})"
        splits = {"val": self.val_tasks} | ({"test": self.test_tasks} if name == "final" and self.test_tasks else {})
        tasks = [task for split_tasks in splits.values() for task in split_tasks]  # one batch; test: at the end
        start = time.monotonic()
        sampling = algo.sampling(0.0)
        _, rollouts = validate_policy(self.setup.agent, tasks, server, self.metric, sampling, algo.reward_timeout_s)
        server.engine.release()  # the validation batch's KV cache would otherwise stay through training
        wall_s, metrics, done = time.monotonic() - start, {}, 0
        for split, split_tasks in splits.items():
            mine, done = rollouts[done : done + len(split_tasks)], done + len(split_tasks)
            run.write_samples(f"{split}_{name}", [r.record() for r in mine[: self.samples_kept]])
            run.write_scores(f"{split}_{name}", item_scores(mine))
            summary, subsets = EvalSummary.of(mine, wall_s), EvalSummary.per_subset(mine)
            self.results[f"{split}_{name}"] = vars(summary) | ({"subsets": subsets} if subsets else {})
            metrics |= {f"{split}/{k}": v for k, v in vars(summary).items()}
            for subset, scores in subsets.items():
                metrics |= {f"{split}/{subset}/accuracy": scores["accuracy"], f"{split}/{subset}/n": scores["n"]}
        run.phase = phase
        return metrics

"""Compute counted the same way for every arm of an experiment: tokens, and FLOPs from them.

With N the model's parameters (all of them, embeddings included: the tied output layer multiplies every token):

    FLOPs = train_factor * N * trained + 2 * N * forward_only + 2 * N * generated

- trained: tokens through a forward and backward pass (prompt and completion of each trained sequence, or each SFT
  batch's non-padding tokens); train_factor is 6 for full fine-tuning (forward 2N, backward 4N) and 4 for LoRA (the
  frozen weights get no gradient: their 2N weight-gradient matmuls are skipped; the adapter's own are left out);
- forward_only: tokens through a forward pass alone (a reference model's log-probs for the KL penalty; the
  importance correction reads the loss's own forward);
- generated: tokens the engine sampled, every rollout's (excluded ones too: they were paid for). The prompts' prefill
  is not counted (the engine caches shared prefixes, so its cost depends on the engine), nor attention's quadratic
  term (small at these lengths), nor validation.

`algorithm.flops_budget` stops training at the first step end past it, as `time_budget_s` does for seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRAINED, GENERATED, FORWARD_ONLY, FLOPS = (
    "compute/trained_tokens",
    "compute/generated_tokens",
    "compute/forward_only_tokens",
    "compute/flops",
)


@dataclass
class ComputeCount:
    """A run's training compute so far (every rank's together), logged as `compute/*` at each step."""

    parameters: int
    train_factor: int  # 6 (full) or 4 (LoRA): FLOPs per parameter per trained token
    trained: float = 0.0
    generated: float = 0.0
    forward_only: float = 0.0

    def add(self, trained: float = 0.0, generated: float = 0.0, forward_only: float = 0.0) -> None:
        self.trained += trained
        self.generated += generated
        self.forward_only += forward_only

    @property
    def flops(self) -> float:
        return self.parameters * (self.train_factor * self.trained + 2 * self.forward_only + 2 * self.generated)

    def metrics(self) -> dict[str, float]:
        return {
            TRAINED: self.trained,
            GENERATED: self.generated,
            FORWARD_ONLY: self.forward_only,
            FLOPS: self.flops,
        }

    def restore(self, logged: list[dict[str, Any]]) -> None:
        """Continue the counts of a resumed run from its last logged step."""
        last = next((m for m in reversed(logged) if m.get(FLOPS) is not None), None)
        if last is not None:
            self.trained, self.generated = last[TRAINED], last[GENERATED]
            self.forward_only = last.get(FORWARD_ONLY, 0.0)

    def summary(self) -> dict[str, float]:
        return {"parameters": self.parameters, "train_factor": self.train_factor, **self.metrics()}

    def spent(self, budget: float | None) -> bool:
        return budget is not None and self.flops >= budget

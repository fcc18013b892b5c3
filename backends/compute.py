"""Compute counted the same way for every arm of an experiment: tokens, FLOPs from them, and GPU-seconds.

With N the model's parameters (all of them, embeddings included: the tied output layer multiplies every token):

    FLOPs = train_factor * N * trained + 2 * N * (forward_only + prefill + generated) + pool

- trained: tokens through a forward and backward pass (prompt and completion of each trained sequence, or each SFT
  batch's non-padding tokens); train_factor is 6 for full fine-tuning (forward 2N, backward 4N) and 4 for LoRA (the
  frozen weights get no gradient: their 2N weight-gradient matmuls are skipped; the adapter's own are left out);
- forward_only: tokens through a forward pass alone (a reference model's log-probs for the KL penalty; the
  importance correction reads the loss's own forward);
- prefill: prompt tokens the generation engine ran through the model, every call's (excluded rollouts' too): the
  whole prompt of every call for `hf` and `static` (neither keeps a prefix cache), for vLLM the prompt tokens its
  prefix cache did not serve, as it reports them (inference/engine.py's `Completion.prefilled`);
- generated: tokens the engine sampled, every rollout's (excluded ones too: they were paid for);
- pool: what sampling the filtered pool cost (`algorithm.pool_samples`, backends/trl/pool.py: its rollouts' prefill
  and generated tokens at 2N each), charged whole to every arm whose training data comes from the pool (GRPO, RFT,
  gold SFT on the pool), whether the run sampled it or read the file another run wrote; not to the control that
  continues SFT on the warm start's own demonstrations.

GPU-seconds (`compute/gpu_s`): training seconds (validation not counted) x the run's ranks, one GPU each, plus the
pool's sampling seconds x the ranks that held GPUs meanwhile, charged as its FLOPs are.

Not counted: attention's quadratic term (small at these lengths), the padding an engine computes beside the prompts,
vLLM's recomputation of a preempted request, validation, and the warm start (every arm starts from it; its own FLOPs
are in the summary's `sft`).

`algorithm.flops_budget` and `algorithm.gpu_s_budget` stop training at the first step end past them, as
`time_budget_s` does for training seconds; the pool's charge counts toward both from the start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRAINED, GENERATED, FORWARD_ONLY, PREFILL, FLOPS = (
    "compute/trained_tokens",
    "compute/generated_tokens",
    "compute/forward_only_tokens",
    "compute/prefill_tokens",
    "compute/flops",
)
POOL_FLOPS, POOL_GPU_S, GPU_S = "compute/pool_flops", "compute/pool_gpu_s", "compute/gpu_s"


def inference_flops(parameters: int, prefill: float, generated: float) -> float:
    """What generating costs: 2N per prompt token prefilled and per token sampled."""
    return 2 * parameters * (prefill + generated)


@dataclass
class ComputeCount:
    """A run's compute so far (every rank's together, the pool's charge included), logged as `compute/*` at each
    step."""

    parameters: int
    train_factor: int  # 6 (full) or 4 (LoRA): FLOPs per parameter per trained token
    ranks: int = 1  # processes training together, each on a GPU of its own: a training second is `ranks` GPU-seconds
    trained: float = 0.0
    generated: float = 0.0
    forward_only: float = 0.0
    prefill: float = 0.0
    train_gpu_s: float = 0.0  # training seconds x ranks
    pool_flops: float = 0.0  # the pool's sampling, charged to this arm (0: it does not train on a pool)
    pool_gpu_s: float = 0.0

    def add(
        self,
        trained: float = 0.0,
        generated: float = 0.0,
        forward_only: float = 0.0,
        prefill: float = 0.0,
        seconds: float = 0.0,
    ) -> None:
        """A step's tokens, and its training `seconds` (on each rank)."""
        self.trained += trained
        self.generated += generated
        self.forward_only += forward_only
        self.prefill += prefill
        self.train_gpu_s += seconds * self.ranks

    def charge_pool(self, flops: float, gpu_s: float) -> None:
        """The pool's sampling, charged to an arm that trains on the pool (once, at its start)."""
        self.pool_flops, self.pool_gpu_s = flops, gpu_s

    @property
    def flops(self) -> float:
        training = self.parameters * (self.train_factor * self.trained + 2 * self.forward_only)
        return training + inference_flops(self.parameters, self.prefill, self.generated) + self.pool_flops

    @property
    def gpu_s(self) -> float:
        return self.train_gpu_s + self.pool_gpu_s

    def metrics(self) -> dict[str, float]:
        return {
            TRAINED: self.trained,
            GENERATED: self.generated,
            FORWARD_ONLY: self.forward_only,
            PREFILL: self.prefill,
            POOL_FLOPS: self.pool_flops,
            FLOPS: self.flops,
            POOL_GPU_S: self.pool_gpu_s,
            GPU_S: self.gpu_s,
        }

    def restore(self, logged: list[dict[str, Any]]) -> None:
        """Continue the counts of a resumed run from its last logged step (the pool's charge is this start's: the
        same pool file). A line logged before prefill and GPU-seconds were counted restores them as 0."""
        last = next((m for m in reversed(logged) if m.get(FLOPS) is not None), None)
        if last is not None:
            self.trained, self.generated = last[TRAINED], last[GENERATED]
            self.forward_only = last.get(FORWARD_ONLY, 0.0)
            self.prefill = last.get(PREFILL, 0.0)
            self.train_gpu_s = last.get(GPU_S, 0.0) - last.get(POOL_GPU_S, 0.0)

    def summary(self, wall_s: float) -> dict[str, float]:
        """The counts with N, the train factor and the ranks; `wall_s`: the phase's wall seconds (validation and
        loading included, the pool's sampling not)."""
        counts = {"parameters": self.parameters, "train_factor": self.train_factor, "ranks": self.ranks}
        return counts | self.metrics() | {"wall_s": wall_s}

    def spent(self, flops_budget: float | None, gpu_s_budget: float | None) -> bool:
        """Whether the FLOPs or the GPU-seconds budget (None: none) is spent."""
        return (flops_budget is not None and self.flops >= flops_budget) or (
            gpu_s_budget is not None and self.gpu_s >= gpu_s_budget
        )

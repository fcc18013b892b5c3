"""Truncated (or masked) importance sampling for the sampler/trainer mismatch, shared by both backends.

The policy server's engine samples with its own arithmetic (bf16 decode kernels, CUDA graphs, fused weights) and the
trainer scores the same tokens with the model's forward. Each model token's policy-gradient term is weighted by

    w = exp(log p_trainer - log p_sampler)  per model token (token_*), or the product over a sequence (sequence_*)
    truncate: w = min(w, cap);  mask: w = 0 where w > cap

`algorithm.is_correction` names the mode and `algorithm.is_cap` the cap. backend=trl folds the weights into TRL's
advantages (`backends/trl/trainer.py`); backend=verl's `from_update` loss multiplies its policy-gradient terms by
them (`backends/verl/loss.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# |log w| is clamped here before exp (verl's SAFETY_BOUND: its decoupled mode gives the same weights)
LOG_BOUND = 20.0


@dataclass
class ISStats:
    """Sums over model tokens that the step's `sampling/*` metrics come from, added up over micro-batches."""

    tokens: int = 0  # model tokens whose sampler log-prob is known
    diff_sum: float = 0.0  # sum of |log p_trainer - log p_sampler|
    diff_max: float = 0.0
    ratio_sum: float = 0.0  # sum of the weights before truncation
    over: int = 0  # tokens whose weight was over the cap

    def __add__(self, other: ISStats) -> ISStats:
        return ISStats(
            self.tokens + other.tokens,
            self.diff_sum + other.diff_sum,
            max(self.diff_max, other.diff_max),
            self.ratio_sum + other.ratio_sum,
            self.over + other.over,
        )

    def metrics(self) -> dict[str, float]:
        n = max(1, self.tokens)
        return {
            "sampling/logp_diff/mean": self.diff_sum / n,
            "sampling/logp_diff/max": self.diff_max,
            "sampling/is_ratio/mean": self.ratio_sum / n,
            "sampling/is_ratio/clipped_frac": self.over / n,
        }


def importance_weights(
    trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, ISStats]:
    """Per-token weights (B, T) for `mode` (see the module docstring), and their sums for the step's metrics. A token
    whose sampler log-prob is unknown (NaN) counts as no difference (weight 1, as TRL treats them) and is left out of
    the metrics. Each row's weights depend on that row alone."""
    known = mask.bool() & ~torch.isnan(sampler_logps)
    diff = torch.where(known, trainer_logps - sampler_logps, torch.zeros_like(trainer_logps))
    if mode.startswith("sequence"):
        ratio = torch.exp(diff.sum(dim=-1, keepdim=True).clamp(-LOG_BOUND, LOG_BOUND)).expand_as(diff)
    else:
        ratio = torch.exp(diff.clamp(-LOG_BOUND, LOG_BOUND))
    over = ratio > cap
    weights = ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(over, 0.0)
    delta = diff.abs()[known]
    stats = ISStats(
        tokens=int(known.sum()),
        diff_sum=float(delta.sum()),
        diff_max=float(delta.max()) if delta.numel() else 0.0,
        ratio_sum=float(ratio[known].sum()),
        over=int(over[known].sum()),
    )
    return weights * mask, stats

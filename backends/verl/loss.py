"""`backend.old_log_probs=from_update`: the old policy's log-probs taken from the update's own forward, as backend=trl
does, instead of a forward pass over the whole batch before the update (verl's decoupled mode).

Exact here: our verl config makes one optimizer step a batch (`ppo_epochs` 1, the mini-batch the whole batch), so the
weights the update's forward runs with are the old policy's. The old policy's log-probs are then the forward's own,
detached: the PPO ratio is 1 with its gradient, and the truncated IS weight is old / sampler (`backends/importance.py`)
as in decoupled mode, without the pass that recomputes them (that pass took 4.9 of 31.3 s a step, 2 x H200,
`docs/verl.md`). Decoupled mode's ratio is 1 only up to the numerical noise between that pass (no grad, its own
micro-batches) and the update's forward; here it is 1.

verl's side: `algorithm.rollout_correction.bypass_mode=true` makes its trainer skip that pass and its own IS weights,
and put the sampler's log-probs (`rollout_log_probs`) where the old policy's go (`apply_bypass_mode`); the actor's
`policy_loss.loss_mode` is this module's loss, which reads them there. verl's own bypass loss is another objective
(PPO-clip on pi / pi_sampler, or REINFORCE) and raises on a micro-batch with no token, which fail-closed exclusion
can give. Every actor process registers this loss when it imports verl's `core_algos` (`compat.py`).

Its metrics are token sums (verl averages a loss's metrics over micro-batches and ranks, which every micro-batch
reports alike): the driver divides them into backend=trl's `sampling/*` metrics (`sampling_metrics`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, register_policy_loss
from verl.utils.metric import reduce_metrics

from backends.importance import importance_weights
from backends.verl.config import ONE_STEP_LOSS, ROLLOUT_IS

IS_MODES = {verl: ours for ours, verl in ROLLOUT_IS.items()}  # verl's rollout_is -> algorithm.is_correction
SUMS = "is_sums/"  # the loss's metric prefix (verl's driver adds "actor/")


@register_policy_loss(ONE_STEP_LOSS)
def one_step_truncated_is(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's PPO-clip loss (`compute_policy_loss_vanilla`) with the old policy's log-probs = `log_prob` detached and
    the IS weights of `config.policy_loss.rollout_correction` computed from them. `old_log_prob` is the sampler's
    (bypass mode puts `rollout_log_probs` there); verl's `rollout_is_weights` are not computed in bypass mode."""
    correction = config.policy_loss.rollout_correction  # a dict once verl's actor config is built
    mode = IS_MODES.get(correction.get("rollout_is"))
    current = log_prob.detach()
    weights, stats = importance_weights(
        current, old_log_prob, response_mask, mode or "token_truncate", float(correction.get("rollout_is_threshold"))
    )
    loss, metrics = compute_policy_loss_vanilla(
        old_log_prob=current,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=weights if mode else None,
    )
    sums = {"tokens": stats.tokens, "diff": stats.diff_sum, "ratio": stats.ratio_sum, "over": stats.over}
    return loss, metrics | {f"{SUMS}{key}": float(value) for key, value in sums.items()}


def sampling_metrics(actor_metrics: dict[str, Any]) -> dict[str, float]:
    """backend=trl's `sampling/*` metrics from the loss's sums in verl's actor metrics (popped from them). Each sum
    arrives as its mean over ranks and micro-batches (verl's `Metric.aggregate_dp`; every rank has as many
    micro-batches), a value a mini-batch, and is reduced as verl's driver reduces it; every sum has that divisor, so
    their ratios are over tokens. Empty where the loss did not run (decoupled mode, or a step that trained
    nothing)."""
    prefix = f"actor/{SUMS}"
    sums = {key.removeprefix(prefix): actor_metrics.pop(key) for key in list(actor_metrics) if key.startswith(prefix)}
    if not sums:
        return {}
    sums = reduce_metrics(sums)
    tokens = sums["tokens"] or math.nan
    return {
        "sampling/logp_diff/mean": float(sums["diff"] / tokens),
        "sampling/is_ratio/mean": float(sums["ratio"] / tokens),
        "sampling/is_ratio/clipped_frac": float(sums["over"] / tokens),
    }

"""`backend.old_log_probs=from_update` (backends/verl/loss.py): the old policy's log-probs from the update's own forward
give verl's decoupled-mode loss and gradients at one optimizer step a batch, train nothing on a micro-batch of
excluded rollouts without raising, and report backend=trl's `sampling/*` metrics over tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from omegaconf import OmegaConf, open_dict
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, get_policy_loss_fn
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict, rename_dict

from backends.importance import importance_weights
from backends.verl.config import LOSS_AGG_MODES, ONE_STEP_LOSS, default_config
from backends.verl.loss import sampling_metrics

CAP = 1.5


def actor_config(rollout_is: str | None, rows: int, tokens: int, loss_mode: str = ONE_STEP_LOSS) -> Any:
    """verl's actor config as its worker builds it (`omega_conf_to_dataclass`), with the rollout correction where
    `build_verl_config` puts it, and the global batch figures verl's `ppo_loss` sets before each micro-batch."""
    cfg = default_config()
    with open_dict(cfg):
        cfg.algorithm.rollout_correction.rollout_is = rollout_is
        cfg.algorithm.rollout_correction.rollout_is_threshold = CAP
        actor = cfg.actor_rollout_ref.actor
        actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = rows, 2
        actor.policy_loss.loss_mode = loss_mode
        actor.policy_loss.rollout_correction = "${algorithm.rollout_correction}"
    OmegaConf.resolve(cfg)
    config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    config.global_batch_info.update(dp_size=1, batch_num_tokens=tokens, global_batch_size=rows, loss_scale_factor=None)
    return config


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """4 rollouts of 6 response tokens: the first with 2 tool tokens, the third excluded (fail closed: no token);
    the sampler's log-probs off the trainer's by enough that some IS weights pass the cap, and far enough on the second
    that its sequence weight is e^-20."""
    generator = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(4, 6, generator=generator) * 3
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, 2:4] = False
    mask[2] = False
    sampler = log_prob + 0.5 * torch.randn(4, 6, generator=generator)
    sampler[3] -= 0.6  # the last rollout's sequence weight over the cap
    log_prob[1] -= 4.0  # the second's sequence log-ratio under -20, where both clamp it before exp
    return {
        "log_prob": log_prob,
        "sampler": sampler,
        "advantages": torch.tensor([1.0, -0.5, 0.0, 0.7]).unsqueeze(1).expand(4, 6).clone(),
        "mask": mask,
    }


@pytest.mark.parametrize("agg", sorted(set(LOSS_AGG_MODES.values())))
@pytest.mark.parametrize("rollout_is", ["token", "sequence", None])
def test_the_updates_own_log_probs_give_verls_decoupled_loss_and_gradients(rollout_is: str | None, agg: str) -> None:
    """One optimizer step a batch: the recompute pass gives the log-probs the update's forward gives (same weights),
    so verl's decoupled mode is vanilla PPO-clip with old = this forward, detached, and IS weights old / sampler."""
    b = batch()
    config = actor_config(rollout_is, rows=4, tokens=int(b["mask"].sum()))
    ours_in, verls_in = b["log_prob"].clone().requires_grad_(), b["log_prob"].clone().requires_grad_()
    ours, metrics = get_policy_loss_fn(ONE_STEP_LOSS)(
        old_log_prob=b["sampler"],  # bypass mode puts the sampler's log-probs there
        log_prob=ours_in,
        advantages=b["advantages"],
        response_mask=b["mask"],
        loss_agg_mode=agg,
        config=config,
    )
    old = b["log_prob"].clone()  # the recompute pass
    weights = None
    if rollout_is is not None:  # verl's driver, over the whole batch
        weights, _ = compute_rollout_correction_weights(
            log_ratio=old - b["sampler"], response_mask=b["mask"], rollout_is=rollout_is, rollout_is_threshold=CAP
        )
        assert (weights[b["mask"]] == CAP).any() and (weights[b["mask"]] < 1).any()  # truncation is exercised
    verls, _ = compute_policy_loss_vanilla(
        old_log_prob=old,
        log_prob=verls_in,
        advantages=b["advantages"],
        response_mask=b["mask"],
        loss_agg_mode=agg,
        config=actor_config(rollout_is, rows=4, tokens=int(b["mask"].sum()), loss_mode="vanilla"),
        rollout_is_weights=weights,
    )
    ours.backward()
    verls.backward()
    assert torch.equal(ours, verls) and ours != 0
    assert torch.equal(ours_in.grad, verls_in.grad)
    assert not ours_in.grad[2].any()  # the excluded rollout
    assert metrics["is_sums/tokens"] == int(b["mask"].sum())


def test_a_micro_batch_of_excluded_rollouts_trains_nothing_where_verls_bypass_loss_raises() -> None:
    b = batch()
    empty = torch.zeros_like(b["mask"])
    config = actor_config("token", rows=8, tokens=int(b["mask"].sum()))  # the mini-batch's other micro-batch has them
    log_prob = b["log_prob"].clone().requires_grad_()
    loss, metrics = get_policy_loss_fn(ONE_STEP_LOSS)(
        old_log_prob=b["sampler"], log_prob=log_prob, advantages=b["advantages"], response_mask=empty, config=config
    )
    loss.backward()
    assert loss == 0 and not log_prob.grad.any() and metrics["is_sums/tokens"] == 0
    with pytest.raises(ValueError, match="at least one valid token"):
        get_policy_loss_fn("bypass_mode")(
            old_log_prob=b["sampler"], log_prob=log_prob, advantages=b["advantages"], response_mask=empty, config=config
        )


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_sampling_metrics_are_over_tokens_as_verl_aggregates_the_losss_sums(ranks: int) -> None:
    """Micro-batches of unequal token counts on each rank, their metrics gathered as verl gathers them: the step's
    `sampling/*` equal backend=trl's over the whole batch (a mean of per-micro-batch means would not)."""
    micro_batches = [batch(seed) for seed in range(2 * ranks)]
    micro_batches[0]["mask"][1, 1:] = False  # unequal token counts
    per_rank = []
    for rank in range(ranks):
        gathered: dict[str, Any] = {}
        for b in micro_batches[2 * rank : 2 * rank + 2]:
            config = actor_config("token", rows=8, tokens=100)
            _, metrics = get_policy_loss_fn(ONE_STEP_LOSS)(
                old_log_prob=b["sampler"],
                log_prob=b["log_prob"],
                advantages=b["advantages"],
                response_mask=b["mask"],
                config=config,
            )
            append_to_dict(gathered, Metric.from_dict(metrics, aggregation="mean"))  # verl's ppo_loss, then its engine
        per_rank.append(gathered)
    # gathered over the data-parallel group (one rank's too: FSDP's group is the world), each key reduced over ranks
    # and micro-batches to one value a mini-batch (one here), then named by verl's driver
    actor = rename_dict({key: [Metric.aggregate_dp([r[key] for r in per_rank])] for key in per_rank[0]}, "actor/")
    actor["actor/pg_loss"] = [0.0]
    ours = sampling_metrics(actor)
    assert set(actor) == {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    whole = sum(
        (importance_weights(b["log_prob"], b["sampler"], b["mask"], "token_truncate", CAP)[1] for b in micro_batches),
        start=importance_weights(*(torch.zeros(1, 1),) * 3, "token_truncate", CAP)[1],
    ).metrics()
    for key, value in ours.items():
        assert value == pytest.approx(whole[key], rel=1e-9)
    assert sampling_metrics({"actor/pg_loss": [0.0]}) == {}  # decoupled mode: no sums

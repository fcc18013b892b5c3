"""What runs in verl's driver process (a Ray actor): its TaskRunner with our trainer, for `run_ppo`.

`TaskRunner.run` is verl 0.9's legacy TaskRunner (`verl.trainer.main_ppo_v0`) with two changes: this module is
imported in the actor's process, which registers the advantage estimator `grpo_fail_closed` where verl computes
advantages; and the trainer is `FailClosedTrainer`, which logs each step's fail-closed bookkeeping beside verl's
metrics (verl's own reward and length metrics count the excluded rows, with their reward 0 and one token).

A step whose rollouts are all excluded has no token to train: its rollout correction is skipped (verl's raises without a
token; `rollout_correction`) and so is its update (`FailClosedTrainer._update_actor`): the weights, optimizer and
learning-rate schedule stay as they were, and the step logs `train/update_skipped` 1 with its exclusion rates.
"""

from __future__ import annotations

import math
import os
import socket
from collections import Counter
from typing import Any

import numpy as np
import ray
from omegaconf import DictConfig, OmegaConf
from verl.protocol import DataProto
from verl.trainer.main_ppo_v0 import TaskRunner as VerlTaskRunner
from verl.trainer.ppo import rollout_corr_helper
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler, need_critic, need_reference_policy

import backends.verl.loop  # noqa: F401  (registers grpo_fail_closed in this process)
from backends.samples import EXCLUSION_REASONS
from backends.verl.loss import sampling_metrics


def step_metrics(batch: Any) -> dict[str, float]:
    """One step's rollouts as backend=trl logs them: the excluded share (and per reason), and over the rollouts
    that train, the mean reward, model tokens, LLM calls and agent turns (NaN where none trains: metrics.jsonl's
    null, as backend=trl logs such a step)."""
    excluded = np.asarray(batch.non_tensor_batch["excluded"], dtype=object)
    trains = np.array([not reason for reason in excluded])
    n = len(excluded)
    reasons = Counter(str(reason) for reason in excluded if reason)
    metrics = {"rollout/excluded_rate": float(1 - trains.mean())}
    metrics |= {f"rollout/excluded_{reason}_rate": reasons.get(reason, 0) / n for reason in EXCLUSION_REASONS}
    per_rollout = {
        "train/reward_mean": batch.batch["token_level_scores"].sum(dim=-1).numpy(),
        "rollout/model_tokens_mean": batch.batch["response_mask"].sum(dim=-1).numpy(),
        "rollout/llm_calls_mean": np.asarray(batch.non_tensor_batch["llm_calls"], dtype=float),
        "rollout/turns_mean": np.asarray(batch.non_tensor_batch["agent_turns"], dtype=float),
    }
    for name, values in per_rollout.items():
        metrics[name] = float(values[trains].mean()) if trains.any() else math.nan
    return metrics


def nothing_trains(batch: Any) -> bool:
    """Whether no token of the step's batch trains (every rollout excluded)."""
    return not bool(batch.batch["response_mask"].any())


_verl_rollout_correction = rollout_corr_helper.compute_rollout_correction_and_add_to_batch


def rollout_correction(batch: Any, config: Any) -> tuple[Any, dict[str, float]]:
    """verl's rollout correction (IS weights and their metrics), except on a step where nothing trains: there is no
    token to weigh, and verl's raises without one."""
    if nothing_trains(batch):
        return batch, {}
    return _verl_rollout_correction(batch, config)


# verl's fit() imports it from the module at each step: this process's steps use ours
rollout_corr_helper.compute_rollout_correction_and_add_to_batch = rollout_correction


class FailClosedTrainer(RayPPOTrainer):
    """verl's PPO trainer, logging `step_metrics` with each actor update (and, under
    `backend.old_log_probs=from_update`, the loss's `sampling/*` metrics) and skipping the update of a step where
    nothing trains."""

    def _update_actor(self, batch: Any) -> Any:
        skip = nothing_trains(batch)
        ours = step_metrics(batch) | {"train/update_skipped": float(skip)}
        if skip:  # no token, no loss: verl's mean over zero tokens would be 0/0
            return DataProto.from_single_dict(data={}, meta_info={"metrics": ours})
        output = super()._update_actor(batch)
        metrics = output.meta_info["metrics"]
        metrics.update(ours | sampling_metrics(metrics))
        return output


@ray.remote(num_cpus=1)
class TaskRunner(VerlTaskRunner.__ray_actor_class__):  # type: ignore[name-defined,misc]
    """verl's legacy TaskRunner, training with `FailClosedTrainer`."""

    def run(self, config: DictConfig) -> None:
        from verl.utils.config import omega_conf_to_dataclass, validate_config
        from verl.utils.dataset.rl_dataset import collate_fn
        from verl.workers.config import HFModelConfig

        print(f"TaskRunner hostname: {socket.gethostname()}, PID: {os.getpid()}", flush=True)
        OmegaConf.resolve(config)
        _, worker_group_cls = self.add_actor_rollout_worker(config)
        self.add_critic_worker(config)
        self.add_reward_model_resource_pool(config)
        self.add_teacher_model_resource_pool(config)
        validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
        model_config: HFModelConfig = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        tokenizer, processor = model_config.tokenizer, model_config.processor
        datasets = {
            split: create_rl_dataset(files, config.data, tokenizer, processor, is_train=split == "train")
            for split, files in (("train", config.data.train_files), ("val", config.data.val_files))
        }
        trainer = FailClosedTrainer(
            config=config,
            tokenizer=tokenizer,
            processor=processor,
            role_worker_mapping=self.role_worker_mapping,
            resource_pool_manager=self.init_resource_pool_mgr(config),
            ray_worker_group_cls=worker_group_cls,
            train_dataset=datasets["train"],
            val_dataset=datasets["val"],
            collate_fn=collate_fn,
            train_sampler=create_rl_sampler(config.data, datasets["train"]),
        )
        trainer.init_workers()
        trainer.fit()

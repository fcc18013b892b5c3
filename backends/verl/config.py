"""verl 0.9's trainer config, derived from our groups and validated on CPU before any worker starts.

verl's own `ppo_trainer` defaults (composed once per process)
<- ours (`verl_overrides`: every value from one key of our config), merged with struct on: a key verl does not have
   is an error naming it
<- `backend.overrides` (verl keys our groups do not set; one that ours generate is refused)
-> our checks (what vLLM or verl would reject only on the GPUs) -> verl's own `validate_config`.

Only omegaconf at the top: verl is imported when a config is composed.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from backends.algorithm import GRPO, RFT, SFTControl
from foundation.errors import ConfigError
from models.finetune import Full, LoRA

ROOT = Path(__file__).resolve().parents[2]  # the repository: verl's Ray workers import our modules from it
# vLLM's LoRA manager accepts only these adapter ranks (vllm.config.lora.LoRAConfig).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# algorithm.loss_type (TRL's names) -> verl's actor.loss_agg_mode.
LOSS_AGG_MODES = {
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
# algorithm.is_correction -> verl's rollout_correction.rollout_is (truncated IS: weights clipped at algorithm.is_cap).
# The mask modes have no exact verl counterpart (verl's rollout_rs rejections also zero the mask, which
# `grpo_fail_closed` would read as excluded rollouts): refused on backend=verl.
ROLLOUT_IS = {"token_truncate": "token", "sequence_truncate": "sequence"}
# backend.old_log_probs: verl recomputes the old policy's log-probs in a pass of their own (its decoupled mode), or
# the update's forward gives them (bypass mode with our loss, `loss.py`: exact at one optimizer step a batch)
OLD_LOG_PROBS = ("recompute", "from_update")
ONE_STEP_LOSS = "one_step_truncated_is"  # the actor's policy_loss.loss_mode under from_update (`loss.py` registers it)


@dataclass(frozen=True)
class ModelSource:
    """The weights verl loads: a local directory (absolute) or a hub id, and the attention the actor uses (the
    model group's `attn_implementation`: eager, sdpa, flash_attention_2)."""

    path: str
    attn_implementation: str


@contextmanager
def own_hydra() -> Iterator[None]:
    """Compose in a fresh Hydra instance (launch.py's is already initialized) and give the caller's back after."""
    from hydra.core.global_hydra import GlobalHydra

    global_hydra = GlobalHydra.instance()
    saved = global_hydra.hydra if global_hydra.is_initialized() else None
    global_hydra.clear()
    try:
        yield
    finally:
        global_hydra.clear()
        if saved is not None:
            global_hydra.initialize(saved)


@functools.cache
def _default_config() -> DictConfig:
    from hydra import compose, initialize_config_module

    with own_hydra(), initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer")


def default_config() -> DictConfig:
    """verl's `ppo_trainer` config as its `main_ppo` composes it, a fresh copy each call."""
    return copy.deepcopy(_default_config())


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_algorithm(algo: GRPO) -> None:
    """What of algorithm= backend=verl cannot run, named by key."""
    if isinstance(algo, (SFTControl, RFT)):
        raise ConfigError(f"algorithm={algo.name} runs on backend=trl only (backend=verl trains GRPO)")
    if algo.loss_type not in LOSS_AGG_MODES:
        known = ", ".join(LOSS_AGG_MODES)
        raise ConfigError(f"algorithm.loss_type={algo.loss_type} has no verl loss_agg_mode (known: {known})")
    if algo.is_correction not in ("none", *ROLLOUT_IS):
        known = ", ".join(("none", *ROLLOUT_IS))
        raise ConfigError(f"algorithm.is_correction={algo.is_correction}: backend=verl maps {known}")
    if algo.epochs != math.floor(algo.epochs):
        raise ConfigError(f"algorithm.epochs={algo.epochs}: verl counts whole epochs")
    for key in ("time_budget_s", "flops_budget", "gpu_s_budget"):
        if (value := getattr(algo, key)) is not None:
            raise ConfigError(f"algorithm.{key}={value}: backend=trl's; backend=verl counts steps (max_steps)")
    if algo.pool_samples is not None:
        raise ConfigError(
            f"algorithm.pool_samples={algo.pool_samples}: backend=trl's (it filters the tasks with the warm start); "
            "add algorithm.pool_samples=null"
        )
    if algo.async_rollouts:
        raise ConfigError("algorithm.async_rollouts: backend=trl's; verl has its own off-policy recipes")
    if algo.val_points is not None:
        raise ConfigError(
            f"algorithm.val_points={algo.val_points}: backend=trl's; verl validates every val_every steps (test_freq)"
        )


def check_shape(finetune: Full | LoRA, algo: GRPO, backend: Any) -> None:
    """What verl or vLLM would reject only on the GPUs, or not at all."""
    if isinstance(finetune, LoRA) and finetune.rank not in VLLM_LORA_RANKS:
        ranks = ", ".join(map(str, VLLM_LORA_RANKS))
        raise ConfigError(f"finetune.rank={finetune.rank}: vLLM serves LoRA ranks {ranks}")
    if backend.gpus_per_node % backend.tensor_parallel_size:
        raise ConfigError(
            f"backend.tensor_parallel_size={backend.tensor_parallel_size} must divide "
            f"resources.gpus_per_node={backend.gpus_per_node}"
        )
    n_gpus = backend.nodes * backend.gpus_per_node
    if algo.batch_size % n_gpus:
        raise ConfigError(
            f"algorithm.tasks_per_step={algo.tasks_per_step}: tasks_per_step x group_size = {algo.batch_size} "
            f"sequences do not split over {n_gpus} GPUs (resources.nodes x resources.gpus_per_node)"
        )
    per_gpu = algo.batch_size // n_gpus
    if per_gpu % algo.micro_batch_size:
        raise ConfigError(
            f"algorithm.micro_batch_size={algo.micro_batch_size} must divide the {per_gpu} sequences each GPU "
            "gets per step"
        )


def rollout_correction(algo: GRPO, backend: Any) -> dict[str, Any]:
    """Truncated importance sampling with the sampler's log-probs: the IS weight is old/sampler, clipped at is_cap
    (none: metrics only). The old policy's log-probs are recomputed (verl's decoupled mode), or the update's own
    (`backend.old_log_probs=from_update`: verl's bypass mode, the weights computed in our loss)."""
    ours = {
        "rollout_is": ROLLOUT_IS.get(algo.is_correction),
        "rollout_is_threshold": algo.is_cap,
        "rollout_rs": None,
        "bypass_mode": backend.old_log_probs == "from_update",
    }
    if backend.old_log_probs == "from_update":  # what our loss does not read, pinned so that no override asks for it
        ours |= {"rollout_is_batch_normalize": False, "loss_type": "ppo_clip"}
    return ours


def policy_loss(backend: Any) -> dict[str, Any]:
    """The actor's policy loss: verl's default (PPO-clip, the IS weights from its driver), or under
    `backend.old_log_probs=from_update` ours (`loss.py`), which reads the rollout correction from the actor's config
    (`build_verl_config` points it at `algorithm.rollout_correction`)."""
    if backend.old_log_probs == "recompute":
        return {}
    return {"policy_loss": {"loss_mode": ONE_STEP_LOSS}}


def verl_overrides(
    model: ModelSource,
    finetune: Full | LoRA,
    algo: GRPO,
    backend: Any,
    files: dict[str, str],
    run_path: Path,
    seed: int,
) -> dict[str, Any]:
    """Our groups as verl keys. Each value comes from one place in our config; nothing here is a second copy.

    model: the weights verl loads (model.path or hub_id; a built tiny model's directory) and their attention;
    files: the `train`/`val` parquet files and the agent-loop YAML (`loop`) that `backends/verl/train.py` writes."""
    from backends.verl.loop import FAIL_CLOSED_GRPO, LOOP_NAME

    lora = isinstance(finetune, LoRA)
    micro = algo.micro_batch_size
    return {
        "algorithm": {
            "adv_estimator": FAIL_CLOSED_GRPO,
            "use_kl_in_reward": False,
            "rollout_correction": rollout_correction(algo, backend),
        },
        "critic": {"enable": False},
        "data": {
            "train_files": files["train"],
            "val_files": files["val"],
            "train_batch_size": algo.tasks_per_step,
            "max_prompt_length": algo.max_prompt_length,
            "max_response_length": algo.max_response_length,
            "return_raw_chat": True,  # verl's agent loop reads the raw messages (ours: the task in extra_info)
            "truncation": "error",
            "seed": seed,
            "dataloader_num_workers": 0,  # the rows are a few KB each
        },
        "actor_rollout_ref": {
            "model": {
                "path": model.path,
                # flash-attn's varlen kernels pack the micro-batch; sdpa pads it to its longest sequence
                "use_remove_padding": model.attn_implementation == "flash_attention_2",
                "enable_gradient_checkpointing": backend.gradient_checkpointing,
                "lora_rank": finetune.rank if lora else 0,
                "lora_alpha": finetune.alpha if lora else 16,
                "target_modules": list(finetune.target_modules) if lora else "all-linear",
            },
            "actor": {
                "strategy": "fsdp2",
                "optim": {"lr": algo.learning_rate, "lr_warmup_steps": algo.lr_warmup_steps},
                "ppo_mini_batch_size": algo.tasks_per_step,  # one optimizer step per training step, as backend=trl
                "ppo_micro_batch_size_per_gpu": micro,
                "ppo_epochs": 1,
                "use_kl_loss": algo.kl_coef > 0,
                "kl_loss_coef": algo.kl_coef,
                "entropy_coeff": 0,
                "clip_ratio_low": algo.clip_ratio,
                "clip_ratio_high": algo.clip_ratio_high if algo.clip_ratio_high is not None else algo.clip_ratio,
                "grad_clip": algo.max_grad_norm,
                "loss_agg_mode": LOSS_AGG_MODES[algo.loss_type],
                "fsdp_config": {
                    "param_offload": backend.param_offload,
                    "optimizer_offload": backend.optimizer_offload,
                },
            }
            | policy_loss(backend),
            "rollout": {
                "name": "vllm",
                "mode": "async",
                "n": algo.group_size,
                "temperature": algo.temperature,
                "top_p": 1.0,
                "tensor_model_parallel_size": backend.tensor_parallel_size,
                "gpu_memory_utilization": backend.gpu_memory_utilization,
                "log_prob_micro_batch_size_per_gpu": micro,
                "calculate_log_probs": True,  # the sampler's log-probs (rollout correction reads them)
                "logprobs_mode": "processed_logprobs",  # after temperature: what the sampled token's draw used
                "load_format": "auto",
                "agent": {
                    "num_workers": backend.agent_workers,
                    "default_agent_loop": LOOP_NAME,
                    "agent_loop_config_path": files["loop"],
                },
                "val_kwargs": {"temperature": 0.0, "do_sample": False, "n": 1},
            },
            "ref": {
                "log_prob_micro_batch_size_per_gpu": micro,
                "fsdp_config": {"param_offload": backend.param_offload},
            },
        },
        "trainer": {
            "use_v1": False,  # verl's RayPPOTrainer (the V1 trainer needs TransferQueue, the verl-core extra)
            "n_gpus_per_node": backend.gpus_per_node,
            "nnodes": backend.nodes,
            "total_epochs": int(algo.epochs),
            "total_training_steps": algo.max_steps if algo.max_steps > 0 else None,
            "save_freq": algo.save_every,
            "test_freq": algo.val_every,
            "val_before_train": True,
            "critic_warmup": 0,
            "logger": ["console", "file"],  # file: <run>/verl_metrics.jsonl, read back into metrics.jsonl
            "project_name": backend.project_name,
            "experiment_name": run_path.name,
            "default_local_dir": str(run_path / "checkpoints"),
            "validation_data_dir": str(run_path / "verl" / "validation"),  # each validation's rollouts: item scores
        },
    }


def build_verl_config(
    model: ModelSource,
    finetune: Full | LoRA,
    algo: GRPO,
    backend: Any,
    files: dict[str, str],
    run_path: Path,
    seed: int,
) -> DictConfig:
    """The whole verl config for this run, validated by us and by verl; raises ConfigError naming the key."""
    check_algorithm(algo)
    check_shape(finetune, algo, backend)
    ours = verl_overrides(model, finetune, algo, backend, files, run_path, seed)
    generated = flatten(ours)
    for key in flatten(backend.overrides):
        if key in generated:
            raise ConfigError(f"backend.overrides.{key} is generated from our config; set it there, not here")
    cfg = default_config()
    OmegaConf.set_struct(cfg, True)
    for source, values in (("", ours), ("backend.overrides.", backend.overrides)):
        try:
            cfg = OmegaConf.merge(cfg, values)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or str(exc)
            raise ConfigError(f"{source}{key} is not a key of verl's trainer config") from exc
    with open_dict(cfg):  # keys verl's defaults leave empty ({}), which a struct merge cannot fill
        cfg.actor_rollout_ref.model.override_config.attn_implementation = model.attn_implementation
        if backend.old_log_probs == "from_update":  # verl's actor has its own copy, which its yaml leaves out
            cfg.actor_rollout_ref.actor.policy_loss.rollout_correction = "${algorithm.rollout_correction}"
        # every Ray process of the run, also on a cluster started elsewhere (RAY_ADDRESS)
        cfg.ray_kwargs.ray_init.runtime_env.worker_process_setup_hook = "backends.verl.compat.worker_setup"
        cfg.ray_kwargs.ray_init.runtime_env.env_vars = {
            "VERL_FILE_LOGGER_PATH": str(run_path / "verl_metrics.jsonl"),  # verl's `file` logger writes here
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        }
    validate_with_verl(cfg)
    return cfg


def validate_with_verl(cfg: DictConfig) -> None:
    """verl's own `validate_config`, with the roles its TaskRunner would create."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    checked = cfg
    if cfg.actor_rollout_ref.model.lora_rank and importlib.util.find_spec("vllm") is None:
        # verl asks vLLM for its largest LoRA rank; without vLLM (CPU) `check_shape` checked the rank against
        # VLLM_LORA_RANKS, and verl checks the rest
        checked = copy.deepcopy(cfg)
        checked.actor_rollout_ref.model.lora_rank = 0
    try:
        validate_config(checked, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    except (AssertionError, ValueError, TypeError) as exc:
        raise ConfigError(f"verl's validate_config: {exc}") from exc

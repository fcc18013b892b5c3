"""verl's trainer config, generated from our groups and checked on CPU before anything starts.

agent-lightning's defaults (verl's `ppo_trainer` + its `agentlightning` keys, composed once per process)
<- ours (`verl_overrides`), merged with struct on: a key verl does not have is an error naming it
-> our checks (LoRA ranks vLLM serves, batch divisibility, GPUs vs tensor parallel)
-> verl's own `validate_config`
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from backends.agl.settings import NEEDS_VENV, VerlSettings
from backends.algorithm import GRPO, SFTControl
from foundation.errors import ConfigError
from models.finetune import Full, LoRA
from models.hub import HubModel

# vLLM's LoRA manager accepts only these adapter ranks (vllm.config.lora.LoRAConfig).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# algorithm.loss_type (TRL's names) -> verl's actor.loss_agg_mode.
LOSS_AGG_MODES = {
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


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
    spec = importlib.util.find_spec("agentlightning")
    if spec is None or importlib.util.find_spec("verl") is None:
        raise ModuleNotFoundError(NEEDS_VENV)
    from hydra import compose, initialize_config_dir

    config_dir = Path(next(iter(spec.submodule_search_locations or []))) / "verl"
    with own_hydra(), initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="config")


def default_config() -> DictConfig:
    """agent-lightning's base trainer config (what `agl.VERL` merges into), a fresh copy each call."""
    return copy.deepcopy(_default_config())


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def verl_overrides(
    model: HubModel, finetune: Full | LoRA, algo: GRPO, backend: VerlSettings, run_path: Path, seed: int
) -> dict[str, Any]:
    """Our groups as verl keys. Each value comes from one place in our config; nothing here is a second copy."""
    if not (model.path or model.hub_id):
        raise ConfigError(f"model.path: model={model.name} is built by backend=trl; backend=verl needs model.path")
    if algo.loss_type not in LOSS_AGG_MODES:
        known = ", ".join(LOSS_AGG_MODES)
        raise ConfigError(f"algorithm.loss_type={algo.loss_type} has no verl loss_agg_mode (known: {known})")
    if algo.epochs != math.floor(algo.epochs):
        raise ConfigError(f"algorithm.epochs={algo.epochs}: verl counts whole epochs")
    if isinstance(algo, SFTControl):
        raise ConfigError("algorithm=sft_control (the SFT control arm) runs on backend=trl only")
    if algo.time_budget_s is not None:
        raise ConfigError("algorithm.time_budget_s: backend=verl counts steps (set algorithm.max_steps)")
    if algo.async_rollouts:
        raise ConfigError("algorithm.async_rollouts: backend=trl's; verl has its own off-policy recipes")
    lora = isinstance(finetune, LoRA)
    micro = algo.micro_batch_size
    return {
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "critic": {"enable": False},
        "data": {
            "train_batch_size": algo.tasks_per_step,
            "max_prompt_length": algo.max_prompt_length,
            "max_response_length": algo.max_response_length,
            "truncation": "error",
            "seed": seed,
        },
        "actor_rollout_ref": {
            "model": {
                "path": model.source,
                "use_remove_padding": True,
                "enable_gradient_checkpointing": backend.gradient_checkpointing,
                "lora_rank": finetune.rank if lora else 0,
                "lora_alpha": finetune.alpha if lora else 16,
                "target_modules": list(finetune.target_modules) if lora else "all-linear",
            },
            "actor": {
                "optim": {"lr": algo.learning_rate, "lr_warmup_steps": algo.lr_warmup_steps},
                "ppo_mini_batch_size": algo.tasks_per_step,  # one optimizer step per training step, as backend=trl
                "ppo_micro_batch_size_per_gpu": micro,
                "use_kl_loss": algo.kl_coef > 0,
                "kl_loss_coef": algo.kl_coef,
                "entropy_coeff": 0,
                "clip_ratio_low": algo.clip_ratio,
                "clip_ratio_high": algo.clip_ratio_high if algo.clip_ratio_high is not None else algo.clip_ratio,
                "grad_clip": algo.max_grad_norm,
                "loss_agg_mode": LOSS_AGG_MODES[algo.loss_type],
                "fsdp_config": {"param_offload": backend.param_offload, "optimizer_offload": backend.param_offload},
            },
            "rollout": {
                "name": "vllm",
                "n": algo.group_size,
                "temperature": algo.temperature,
                "tensor_model_parallel_size": backend.tensor_parallel_size,
                "gpu_memory_utilization": backend.gpu_memory_utilization,
                "log_prob_micro_batch_size_per_gpu": micro,
                "multi_turn": {"format": model.tool_call_format, "max_assistant_turns": backend.max_turns},
            },
            "ref": {
                "log_prob_micro_batch_size_per_gpu": micro,
                "fsdp_config": {"param_offload": backend.param_offload},
            },
        },
        "agentlightning": {
            "trace_aggregator": {
                "level": backend.trace_aggregation,
                "trajectory_max_prompt_length": algo.max_prompt_length,
                "trajectory_max_response_length": algo.max_response_length,
            }
        },
        "trainer": {
            "n_gpus_per_node": backend.gpus_per_node,
            "nnodes": backend.nodes,
            "total_epochs": int(algo.epochs),
            "total_training_steps": algo.max_steps if algo.max_steps > 0 else None,
            "save_freq": algo.save_every,
            "test_freq": algo.val_every,
            "val_before_train": True,
            "critic_warmup": 0,
            "logger": list(backend.logger),
            "project_name": backend.project_name,
            "experiment_name": run_path.name,
            "default_local_dir": str(run_path / "checkpoints"),
        },
    }


def check_shape(finetune: Full | LoRA, algo: GRPO, backend: VerlSettings) -> None:
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


def build_verl_config(
    model: HubModel, finetune: Full | LoRA, algo: GRPO, backend: VerlSettings, run_path: Path, seed: int
) -> DictConfig:
    """The whole verl config for this run, validated by us and by verl; raises ConfigError naming the key."""
    check_shape(finetune, algo, backend)
    ours = verl_overrides(model, finetune, algo, backend, run_path, seed)
    generated = _flatten(ours)
    for key in _flatten(backend.overrides):
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
    validate_with_verl(cfg)
    return cfg


def validate_with_verl(cfg: DictConfig) -> None:
    """verl's own `validate_config`, with the roles main_ppo would create (a reference policy only with a KL term)."""
    from verl.trainer.ppo.utils import need_critic
    from verl.utils.config import validate_config

    use_reference_policy = bool(cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss)
    try:
        validate_config(cfg, use_reference_policy=use_reference_policy, use_critic=need_critic(cfg))
    except (AssertionError, ValueError) as exc:
        raise ConfigError(f"verl's validate_config: {exc}") from exc

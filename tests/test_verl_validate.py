"""job=validate: verl's trainer config generated from ours and validated on CPU (runs in .venv-verl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.validate import verl_config
from foundation.errors import ConfigError
from tests.conftest import launch
from tests.verl_helpers import AGENTS, FINETUNES, MODELS, compose_config

pytestmark = pytest.mark.verl


def model_args(model: str, tmp_path: Path) -> list[str]:
    # model=tiny is built by backend=trl on first use (after its SFT warm start); backend=verl takes a built one.
    return [f"model={model}", *([f"model.path={tmp_path}", "warmstart=none"] if model == "tiny" else [])]


@pytest.mark.parametrize("agent", AGENTS)
@pytest.mark.parametrize("finetune", FINETUNES)
@pytest.mark.parametrize("model", MODELS)
def test_every_model_finetune_agent_combination_validates(
    model: str, finetune: str, agent: str, tmp_path: Path
) -> None:
    overrides = ["backend=verl", f"agent={agent}", f"finetune={finetune}", *model_args(model, tmp_path)]
    cfg = compose_config(overrides, tmp_path)
    generated = verl_config(cfg, tmp_path / "run")
    rollout, actor = generated.actor_rollout_ref.rollout, generated.actor_rollout_ref.actor
    # Each verl value is ours, generated: the group size, the lengths, the turn limit, LoRA, the cluster shape.
    assert rollout.n == cfg.algorithm.group_size
    assert generated.data.max_response_length == cfg.algorithm.max_response_length
    assert rollout.multi_turn.max_assistant_turns == cfg.agent.max_turns
    assert actor.optim.lr == cfg.algorithm.learning_rate
    assert generated.actor_rollout_ref.model.lora_rank == (cfg.finetune.rank if finetune == "lora" else 0)
    assert generated.trainer.n_gpus_per_node == cfg.resources.gpus_per_node
    assert generated.trainer.nnodes == cfg.resources.nodes


def test_trajectory_aggregation_gets_our_lengths(tmp_path: Path) -> None:
    cfg = compose_config(
        ["backend=verl", "model=qwen2.5-7b-instruct", "backend.trace_aggregation=trajectory"], tmp_path
    )
    aggregator = verl_config(cfg, tmp_path).agentlightning.trace_aggregator
    assert aggregator.level == "trajectory"
    assert aggregator.trajectory_max_response_length == cfg.algorithm.max_response_length


def test_resources_reach_verl(tmp_path: Path) -> None:
    overrides = ["backend=verl", "model=qwen2.5-7b-instruct", "resources.nodes=2", "resources.gpus_per_node=4"]
    generated = verl_config(compose_config([*overrides, "backend.tensor_parallel_size=2"], tmp_path), tmp_path)
    assert (generated.trainer.nnodes, generated.trainer.n_gpus_per_node) == (2, 4)
    assert generated.actor_rollout_ref.rollout.tensor_model_parallel_size == 2


# Each bad config, and the key its error must name.
BAD_CONFIGS = [
    (["finetune=lora", "finetune.rank=12"], "finetune.rank=12"),
    (["backend.tensor_parallel_size=2"], "backend.tensor_parallel_size"),
    (["resources.gpus_per_node=3"], "algorithm.tasks_per_step"),
    (["resources.gpus_per_node=4", "algorithm.micro_batch_size=16"], "algorithm.micro_batch_size"),
    (["algorithm.max_response_length=40000"], "algorithm.max_response_length"),
    (["backend.gpu_memory_utilization=1.5"], "backend.gpu_memory_utilization"),
    (["backend.tracing=otel"], "backend.tracing"),
    (["backend.trace_aggregation=episode"], "backend.trace_aggregation"),
    (["backend.store_address=localhost"], "backend.store_address"),
    (["backend.tracing=llm_proxy"], "backend.agent_match.spider_sql"),  # the proxy's spans name no agent steps
    (["+backend.bogus=1"], "backend.bogus"),
    (["algorithm.epochs=1.5"], "algorithm.epochs"),
    (["warmstart=sft"], "warmstart"),
    (["+backend.overrides.trainer.bogus_key=1"], "backend.overrides.trainer.bogus_key"),
    (["+backend.overrides.actor_rollout_ref.rollout.n=2"], "backend.overrides.actor_rollout_ref.rollout.n"),
    (  # caught by verl's own validate_config
        ["+backend.overrides.actor_rollout_ref.rollout.log_prob_micro_batch_size=4"],
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
    ),
]


@pytest.mark.parametrize(("overrides", "key"), BAD_CONFIGS, ids=[key for _, key in BAD_CONFIGS])
def test_a_bad_config_fails_naming_its_key(overrides: list[str], key: str, tmp_path: Path) -> None:
    cfg = compose_config(["backend=verl", "model=qwen2.5-coder-1.5b-instruct", *overrides], tmp_path)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        verl_config(cfg, tmp_path)


def test_model_tiny_needs_a_built_model_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.path"):
        verl_config(compose_config(["backend=verl", "model=tiny", "warmstart=none"], tmp_path), tmp_path)


def test_launch_validate_writes_the_verl_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "job=validate",
        "backend=verl",
        "model=qwen2.5-coder-1.5b-instruct",
        "finetune=lora",
        f"hydra.run.dir={run_dir}",
    ]
    result = launch(args, tmp_path / "cache", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["lora_rank"] == 32
    written = OmegaConf.load(run_dir / "verl_config.yaml")
    assert written.actor_rollout_ref.rollout.name == "vllm"
    assert written.trainer.default_local_dir == str(run_dir / "checkpoints")


def test_launch_validate_fails_naming_the_key(tmp_path: Path) -> None:
    args = ["job=validate", "backend=verl", "model=qwen2.5-coder-1.5b-instruct", "finetune=lora", "finetune.rank=12"]
    result = launch(args, tmp_path / "cache", tmp_path)
    assert result.returncode != 0
    assert "finetune.rank=12: vLLM serves LoRA ranks" in result.stderr + result.stdout


@pytest.mark.parametrize(("preset", "steps"), [("ci-fast", 1), ("ci", 20)])
def test_the_ci_presets_validate(preset: str, steps: int, tmp_path: Path) -> None:
    generated = verl_config(compose_config([f"experiment={preset}"], tmp_path), tmp_path)
    assert generated.trainer.total_training_steps == steps and generated.trainer.total_epochs == 1

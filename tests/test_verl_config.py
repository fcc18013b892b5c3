"""backend=verl before Ray starts (job=validate, backend.fit=false), on CPU: verl's inputs and config derived from our
groups and validated by us and by verl; bad keys are named before anything is built."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf

from tests.conftest import ROOT, launch

pytestmark = pytest.mark.integration

VERL = ["backend=verl", "model=tiny", "warmstart=none", "algorithm.pool_samples=null"]
DATA = ["data.generate.n_train=24", "data.generate.n_dev=4"]


def test_the_tiny_model_validates_on_verl_without_extra_overrides(tmp_path: Path) -> None:
    """`backend=verl model=tiny`: verl has no pool, so its option drops model=tiny's; asked for, a pool is refused."""
    run_dir = tmp_path / "run"
    result = launch(
        ["backend=verl", "model=tiny", *DATA, "job=validate", f"hydra.run.dir={run_dir}"], tmp_path / "c", tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (run_dir / "verl_config.yaml").is_file()
    asked = launch(
        ["backend=verl", "model=tiny", *DATA, "job=validate", "algorithm.pool_samples=8"], tmp_path / "c", tmp_path
    )
    assert asked.returncode != 0 and "algorithm.pool_samples=8" in asked.stderr


def test_validate_writes_verls_inputs_and_config_from_ours(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*VERL, *DATA, "job=validate", "algorithm.group_size=8", "algorithm.is_correction=sequence_truncate"]
    result = launch([*args, "algorithm.is_cap=3.0", f"hydra.run.dir={run_dir}"], tmp_path / "c", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = OmegaConf.load(run_dir / "verl_config.yaml")
    assert config.algorithm.adv_estimator == "grpo_fail_closed"  # excluded rollouts leave their group
    correction = config.algorithm.rollout_correction
    assert (correction.rollout_is, correction.rollout_is_threshold, correction.rollout_rs) == ("sequence", 3.0, None)
    rollout = config.actor_rollout_ref.rollout
    assert rollout.n == 8 and rollout.logprobs_mode == "processed_logprobs" and rollout.calculate_log_probs
    assert rollout.agent.default_agent_loop == "arl_agent" and config.trainer.use_v1 is False
    # backend.old_log_probs=recompute (the default): verl's decoupled mode, its own loss
    assert correction.bypass_mode is False and config.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"
    # each validation's rollouts dumped where backends/verl/train.py reads each question's score back
    assert Path(config.trainer.validation_data_dir) == run_dir.resolve() / "verl" / "validation"
    model_path = Path(config.actor_rollout_ref.model.path)
    assert model_path.is_absolute() and (model_path / "config.json").is_file()  # the tiny model, built here
    # one row per task, the task whole in extra_info (its database path absolute: the workers run elsewhere)
    rows = pd.read_parquet(config.data.train_files)
    assert len(rows) == 24 and set(rows.agent_name) == {"arl_agent"}
    task = json.loads(rows.extra_info[0]["task"])
    assert Path(task["db_path"]).is_absolute() and Path(task["db_path"]).is_file()
    [entry] = yaml.safe_load(Path(rollout.agent.agent_loop_config_path).read_text())
    assert entry["name"] == "arl_agent" and entry["_recursive_"] is False
    assert entry["agent"]["_target_"] == "agent.spider_sql.SpiderSQLAgent" and entry["model"]["path"] == str(model_path)
    assert entry["max_response_tokens"] == config.data.max_response_length and entry["eos_ids"]


def test_old_log_probs_from_the_update_give_verls_actor_our_loss_and_the_runs_rollout_correction(
    tmp_path: Path,
) -> None:
    from verl.utils.config import omega_conf_to_dataclass

    from backends.verl.config import ONE_STEP_LOSS

    run_dir = tmp_path / "run"
    args = [
        *VERL,
        *DATA,
        "job=validate",
        "backend.old_log_probs=from_update",
        "algorithm.is_correction=sequence_truncate",
    ]
    result = launch([*args, "algorithm.is_cap=3.0", f"hydra.run.dir={run_dir}"], tmp_path / "c", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = OmegaConf.load(run_dir / "verl_config.yaml")
    assert config.algorithm.rollout_correction.bypass_mode is True  # verl's driver skips the recompute pass
    # the actor's own copy of the correction, which verl's bypass mode does not pass to its workers
    OmegaConf.resolve(config)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)  # as verl's worker builds it
    assert actor.policy_loss.loss_mode == ONE_STEP_LOSS
    correction = actor.policy_loss.rollout_correction
    assert (correction["rollout_is"], correction["rollout_is_threshold"]) == ("sequence", 3.0)
    # exact only at one optimizer step a batch: generated, so no override can change it
    assert (actor.ppo_epochs, config.actor_rollout_ref.actor.ppo_mini_batch_size) == (1, config.data.train_batch_size)


OVERRIDES = "+backend.overrides.actor_rollout_ref.rollout"


@pytest.mark.parametrize(
    ("override", "named", "inputs_written"),
    [
        ("finetune=lora finetune.rank=7", "finetune.rank=7: vLLM serves LoRA ranks", False),
        ("algorithm.is_correction=token_mask", "algorithm.is_correction=token_mask", False),
        ("algorithm.time_budget_s=60", "algorithm.time_budget_s=60: backend=trl's", False),
        ("backend.old_log_probs=never", "backend.old_log_probs must be one of recompute, from_update", False),
        # verl's own keys are checked against verl's config, once ours is derived (its paths name the inputs)
        (f"{OVERRIDES}.no_such_key=1", "actor_rollout_ref.rollout.no_such_key is not a key", True),
        (f"{OVERRIDES}.n=3", "backend.overrides.actor_rollout_ref.rollout.n is generated", True),
        (  # from_update's loss does not normalize the IS weights: asking for it is refused, not ignored
            "backend.old_log_probs=from_update +backend.overrides.algorithm.rollout_correction."
            "rollout_is_batch_normalize=true",
            "backend.overrides.algorithm.rollout_correction.rollout_is_batch_normalize is generated",
            True,
        ),
    ],
)
def test_a_bad_key_is_named(override: str, named: str, inputs_written: bool, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*VERL, *DATA, "job=validate", *override.split(), f"hydra.run.dir={run_dir}"]
    result = launch(args, tmp_path / "c", tmp_path)
    assert result.returncode != 0
    assert named in result.stdout + result.stderr
    assert (run_dir / "verl").exists() == inputs_written


def test_a_warm_start_trains_before_ray_and_verl_starts_from_it_and_fit_false_stops_there(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*VERL, *DATA, "warmstart=sft_smoke", "warmstart.task_share=0.5", "backend.fit=false"]
    result = launch([*args, f"hydra.run.dir={run_dir}"], tmp_path / "c", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["fit"].startswith("skipped")
    # the warm start's half of the training tasks (stratified), GRPO's the other half
    assert (summary["warmstart_tasks"], summary["train_tasks"], summary["val_tasks"]) == (12, 12, 4)
    sft = summary["sft"]
    checkpoint = run_dir / "checkpoints" / "sft"
    assert sft["checkpoint"] == str(checkpoint) and sft["trained_tokens"] > 0 and sft["weights_sha256"]
    assert (checkpoint / "config.json").is_file()
    config = OmegaConf.load(run_dir / "verl_config.yaml")
    assert config.actor_rollout_ref.model.path == str(checkpoint.resolve())  # verl's actor and servers load it
    [entry] = yaml.safe_load(Path(config.actor_rollout_ref.rollout.agent.agent_loop_config_path).read_text())
    assert entry["model"]["path"] == str(checkpoint.resolve())  # and the agent loop's tokenizer
    assert len(pd.read_parquet(config.data.train_files)) == 12


def test_the_ray_worker_hook_imports_nothing_that_starts_cuda_and_patches_verl_once_imported() -> None:
    # a fresh interpreter, as a Ray worker process starts: the hook runs before Ray sets the actor's GPUs, so it may
    # not import torch or verl (their import starts CUDA with every GPU visible); verl imported later is patched
    script = (
        "import sys\n"
        "from backends.verl.compat import worker_setup\n"
        "worker_setup(); worker_setup()\n"
        "print(sorted(m for m in ('torch', 'verl') if m in sys.modules))\n"
        "import importlib.util\n"
        "print(importlib.util.find_spec('trl') is not None)\n"
        "from verl.utils.import_utils import is_trl_available\n"
        "print(is_trl_available())\n"
        "import verl.utils.torch_functional as F\n"
        "print(F.logprobs_from_logits_v2.__name__)\n"
        "from verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
        "print(get_policy_loss_fn('one_step_truncated_is').__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["[]", "True", "False", "rowwise_logprobs", "one_step_truncated_is"], done.stderr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_vectorized_log_probs_are_verls_own_values_and_gradients(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rowwise_logprobs` (the worker hook's replacement for verl's one-row-a-time loop, which verl's actor runs over
    every token of a micro-batch without flash-attn) gives verl's log-probs and gradients, in chunks of rows."""
    import importlib.machinery
    import importlib.util

    import torch
    import verl.utils

    from backends.verl import compat

    # verl's own module as it ships, loaded past any patching finder
    spec = importlib.machinery.PathFinder.find_spec("verl.utils.torch_functional", verl.utils.__path__)
    assert spec is not None and spec.loader is not None
    shipped = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shipped)
    vocab = 50
    monkeypatch.setattr(compat, "CHUNK_ELEMENTS", 8 * vocab)  # 8 rows a chunk: 37 rows make five, the last short
    generator = torch.Generator().manual_seed(0)
    for shape in ((37,), (3, 13)):  # verl's actor passes rows (tokens, vocab); other callers (batch, length, vocab)
        logits = (4 * torch.randn(*shape, vocab, generator=generator)).to(getattr(torch, dtype))
        labels = torch.randint(0, vocab, shape, generator=generator)
        ours_in, verls_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        ours, verls = compat.rowwise_logprobs(ours_in, labels), shipped.logprobs_from_logits_v2(verls_in, labels)
        weights = torch.randn(shape, generator=generator).to(ours.dtype)
        (ours * weights).sum().backward()
        (verls * weights).sum().backward()
        assert ours.shape == verls.shape == labels.shape and ours.dtype == verls.dtype
        assert torch.equal(ours, verls) and torch.equal(ours_in.grad, verls_in.grad)  # bit for bit, on CPU

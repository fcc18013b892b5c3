"""backend=verl up to Trainer.fit on CPU: the verl config, agl.VERL and agent-lightning's Trainer are built for real
(backend.fit=false stops there; vLLM and GPUs are what this machine lacks). Runs in .venv-verl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import launch

pytestmark = [pytest.mark.verl, pytest.mark.xdist_group("ray")]  # with test_verl_ray_slurm.py: one Ray at a time

ARGS = ["backend=verl", "model=qwen2.5-coder-1.5b-instruct", "finetune=lora", "backend.fit=false"]
DATA = ["data.generate.n_train=24", "data.generate.n_dev=4"]


def test_verl_builds_everything_up_to_fit(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = launch([*ARGS, *DATA, "algorithm.group_size=8", f"hydra.run.dir={run_dir}"], tmp_path / "c", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["fit"].startswith("skipped")
    assert summary["adapter"] == "TracerTraceToTriplet" and summary["n_runners"] == 8
    assert (summary["train_tasks"], summary["val_tasks"]) == (24, 4)
    config = OmegaConf.load(run_dir / "verl_config.yaml")
    assert config.actor_rollout_ref.rollout.n == 8 and config.actor_rollout_ref.model.lora_rank == 32


def test_llm_proxy_tracing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    tracing = ["backend.tracing=llm_proxy", "backend.agent_match.spider_sql=null"]
    result = launch([*ARGS, *DATA, *tracing, f"hydra.run.dir={run_dir}"], tmp_path / "c", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["adapter"] == "LlmProxyTraceToTriplet"


def test_several_nodes_outside_a_multi_node_slurm_job_fail_clearly(tmp_path: Path) -> None:
    args = [*ARGS, *DATA, "resources.nodes=2"]
    result = launch(args, tmp_path / "c", tmp_path)  # no SLURM allocation here: start_ray_cluster starts nothing
    assert result.returncode != 0
    assert "resources.nodes=2, but this is not a job of several SLURM nodes" in result.stdout + result.stderr

"""A run on 2 processes (`resources.gpus_per_node=2`): launch.py starts both ranks itself (torchrun; gloo on CPU),
each runs its share of the rollouts on its own policy server, FSDP2 shards the model across them (backend.sharding),
rank 0 writes the one run directory; a run started again resumes from the sharded checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import FAST_RUN, launch


@pytest.mark.integration
def test_two_processes_train_one_run(cache_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*FAST_RUN, "resources.gpus_per_node=2", f"hydra.run.dir={run_dir}"]
    result = launch(args, cache_dir, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["steps"] == 2
    assert summary["sharding"] == "fsdp2"  # read off the trained model: its weights were DTensor shards
    # both ranks ran rollouts: 2 tasks x 2 rollouts a step, shared, over 2 steps
    assert summary["rollouts_per_rank"] == [4, 4]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]  # one line per step: rank 0 alone writes
    assert all(m["rollout/llm_calls_mean"] >= 2 for m in metrics[1:])  # the check step ran on both ranks
    assert (run_dir / "checkpoints" / "final" / "config.json").is_file()
    assert len(list(tmp_path.glob("runs/*"))) == 0  # no second run directory
    logs = {p.parent.name: p.read_text() for p in (run_dir / "ranks").rglob("stderr.log")}
    assert sorted(logs) == ["0", "1"]  # each rank's output kept
    # rank 0 alone writes models: the shared cache's tiny model first (rank 1 waits, then reads it), checkpoints later
    assert "Writing model shards" in logs["0"] and "Writing model shards" not in logs["1"]
    assert len((run_dir / "attempts.jsonl").read_text().splitlines()) == 1  # the ranks are not attempts
    # checkpoints are sharded: each rank wrote its part of the model and of the optimizer state
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        shards = sorted(p.name for p in (run_dir / "checkpoints" / "checkpoint-2" / part).glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"]

    # A crash after step 1: running again resumes both ranks from the sharded checkpoint-1.
    shutil.rmtree(run_dir / "checkpoints" / "checkpoint-2")
    shutil.rmtree(run_dir / "checkpoints" / "final")
    result = launch(args, cache_dir, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["resumed_from"] == "checkpoint-1" and resumed["steps"] == 2 and resumed["sharding"] == "fsdp2"
    assert resumed["rollouts_per_rank"] == [2, 2]  # step 2 alone ran again
    again = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in again] == [0, 1, 2] and again[:2] == metrics[:2]
    # the final model is whole: gathered from both ranks' shards, it loads as a plain checkpoint
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "final", output_loading_info=True)
    assert not any(final[1].values())  # no missing, unexpected or mismatched weights


@pytest.mark.integration
def test_ranks_that_cannot_share_the_batch_fail_before_starting(cache_dir: Path, tmp_path: Path) -> None:
    args = [*FAST_RUN, "resources.gpus_per_node=3", f"hydra.run.dir={tmp_path / 'run'}"]
    result = launch(args, cache_dir, tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert result.returncode != 0 and summary["status"] == "failed"
    assert "cannot be shared by 3 processes (resources.gpus_per_node)" in summary["error"]


def test_the_7b_full_preset_asks_for_two_sharded_ranks() -> None:
    """An experiment preset's `resources` override config.yaml's (the preset comes after it)."""
    from tests.test_config import compose_with

    cfg = compose_with("experiment=grpo-qwen2.5-7b-1n2g-full")
    assert cfg.resources.gpus_per_node == 2 and cfg.backend.sharding == "fsdp2" and cfg.finetune.name == "full"
    assert cfg.model.hub_id == "Qwen/Qwen2.5-7B-Instruct"


def test_more_ranks_than_gpus_fail_before_starting() -> None:
    from experiments.ranks import check_devices
    from foundation.errors import ConfigError
    from tests.test_config import compose_with

    cfg = compose_with("resources.gpus_per_node=2")
    with pytest.raises(ConfigError, match=r"resources\.gpus_per_node=2: this machine has 1 GPU"):
        check_devices(cfg, gpus=1)
    check_devices(cfg, gpus=2)
    check_devices(cfg, gpus=0)  # CPU ranks: gloo processes
    check_devices(compose_with("resources.gpus_per_node=2", "backend.device=cpu"), gpus=1)

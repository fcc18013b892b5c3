"""Disk planned like memory (backends/disk.py): a run whose checkpoints cannot fit is refused before any model
loads, naming the bytes; a save that cannot fit is refused before a byte is written; a save that fails midway leaves
no partial checkpoint and the previous one the latest complete, resumable one; `algorithm.keep_checkpoints` keeps N.
Free space is what the tests say it is (`backends.disk.free_bytes` patched): no test fills a disk."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

from backends import disk
from backends.algorithm import GRPO
from backends.disk import DiskFull, DiskSetting, plan_disk
from backends.memory import Shape
from backends.trl.arms import passthrough_reward, save_final
from backends.trl.backend import TRLBackend, saves_ahead
from backends.trl.trainer import AgentGRPOTrainer
from foundation.errors import ConfigError
from foundation.run_dir import RunDir, last_complete_checkpoint
from jobs import train
from tests.conftest import micro_tiny
from tests.test_config import CONF

CORPUS = ["How many people are there?", "SELECT count(*) FROM people"] * 10


def test_the_plan_counts_weights_optimizer_and_the_final_model_per_mode() -> None:
    shape = Shape(parameters=1000, layers=2, hidden=8, intermediate=16, vocab=10, embedding_parameters=80,
                  adapter_parameters=50)  # fmt: skip
    small = disk.SMALL_BYTES
    full = plan_disk(shape, DiskSetting(full=True, ranks=1, sharded=False, weight_bytes=2, keep=1))
    assert (full["checkpoint_bytes"], full["final_bytes"]) == (3 * 2 * 1000 + small, 2 * 1000 + small)
    sharded = plan_disk(shape, DiskSetting(full=True, ranks=2, sharded=True, weight_bytes=2, keep=2))
    assert sharded["checkpoint_bytes"] == 12 * 1000 + 2 * small  # fp32 masters and moments, both ranks' shards
    assert sharded["checkpoint_bytes_per_rank"] == sharded["checkpoint_bytes"] // 2
    assert sharded["peak_bytes"] == int(3 * sharded["checkpoint_bytes"] * disk.MARGIN)  # 2 kept + 1 being written
    lora = plan_disk(shape, DiskSetting(full=False, ranks=1, sharded=False, weight_bytes=2, keep=1))
    assert (lora["checkpoint_bytes"], lora["final_bytes"]) == (12 * 50 + small, 4 * 50 + small)


def test_a_start_that_writes_one_checkpoint_needs_room_for_one() -> None:
    """7B full on two ranks (12 bytes a parameter a checkpoint): two steps saved once fit beside the final model; a
    resumed start that saves again needs the kept checkpoint and the new one side by side."""
    shape = Shape(parameters=7_600_000_000, layers=28, hidden=3584, intermediate=18944, vocab=152064,
                  embedding_parameters=1_090_000_000, adapter_parameters=0)  # fmt: skip
    setting = DiskSetting(full=True, ranks=2, sharded=True, weight_bytes=2, keep=1, saves=1, existing=0)
    first = plan_disk(shape, setting)
    assert first["peak_bytes"] == int((first["checkpoint_bytes"] + first["final_bytes"]) * disk.MARGIN)
    assert 100e9 < first["peak_bytes"] < 126e9  # fits a 126 GB disk
    resumed = plan_disk(shape, DiskSetting(full=True, ranks=2, sharded=True, weight_bytes=2, keep=1, saves=1,
                                           existing=1))  # fmt: skip
    assert resumed["peak_bytes"] == int(2 * resumed["checkpoint_bytes"] * disk.MARGIN) > 180e9


@pytest.mark.parametrize(
    ("algo", "done", "saves"),
    [
        (GRPO(max_steps=3, save_every=1), 0, 3),
        (GRPO(max_steps=2, save_every=64), 0, 1),  # the last step's
        (GRPO(max_steps=3, save_every=2), 2, 1),  # resumed at 2: step 3's
        (GRPO(max_steps=10, flops_budget=1e12), 0, None),  # a budget may end it anywhere
    ],
)
def test_the_saves_a_start_writes_are_counted_from_where_it_resumes(
    tmp_path: Path, algo: GRPO, done: int, saves: int | None
) -> None:
    if done:
        (tmp_path / f"checkpoint-{done}").mkdir()
        (tmp_path / f"checkpoint-{done}" / "trainer_state.json").write_text("{}")
    assert saves_ahead(algo, tmp_path) == saves


def test_a_run_whose_checkpoints_cannot_fit_is_refused_before_any_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["algorithm.keep_checkpoints=3", f"paths.cache_dir={tmp_path / 'cache'}"])
    monkeypatch.setattr(disk, "free_bytes", lambda path: 10 * 2**20)  # 10 MiB free
    monkeypatch.setattr(TRLBackend, "train", lambda *a, **k: pytest.fail("the run started"))
    with pytest.raises(ConfigError) as refused:
        train.run(cfg, RunDir(tmp_path / "run"))
    message = str(refused.value)
    assert "the run needs " in message and " GB and 0.01 GB are free: it would fail at a save" in message
    assert "algorithm.keep_checkpoints (now 3" in message and "finetune=lora" in message
    assert "paths.output_dir (ARL_OUTPUT_DIR)" in message and "backend.disk_check=false" in message
    assert not (tmp_path / "cache" / "models").exists()  # the tiny model was never built, let alone loaded


@pytest.fixture
def trainer(tmp_path: Path) -> AgentGRPOTrainer:
    spec = micro_tiny(tmp_path / "models")
    source = spec.prepare(CORPUS)
    model, tokenizer = spec.load_model(source, "cpu"), spec.load_tokenizer(source)
    algo = GRPO(group_size=2, tasks_per_step=1, micro_batch_size=2, keep_checkpoints=2)
    built = AgentGRPOTrainer(
        model=model,
        reward_funcs=[passthrough_reward("exec_match")],
        args=TRLBackend().grpo_config(algo, str(tmp_path / "checkpoints"), seed=0, device="cpu"),
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "How many?"}]}]),
        processing_class=tokenizer,
        rollout_func=lambda prompts, trainer: pytest.fail("no rollout here"),
        checkpoint_bytes=10 * 2**20,
    )
    built.create_optimizer_and_scheduler(num_training_steps=10)  # what trainer.train() makes first
    return built


def save(trainer: AgentGRPOTrainer, step: int) -> None:
    trainer.state.global_step = step
    trainer._save_checkpoint(trainer.model, None)


def checkpoints(trainer: AgentGRPOTrainer) -> list[str]:
    return sorted(p.name for p in Path(trainer.args.output_dir).glob("checkpoint-*"))


def test_keep_checkpoints_keeps_the_last_n_complete_ones(trainer: AgentGRPOTrainer) -> None:
    for step in (1, 2, 3):
        save(trainer, step)
    assert checkpoints(trainer) == ["checkpoint-2", "checkpoint-3"]


def test_a_save_that_would_not_fit_is_refused_before_a_byte_is_written(
    trainer: AgentGRPOTrainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(trainer, 1)
    monkeypatch.setattr(disk, "free_bytes", lambda path: 2**20)  # 1 MiB left: the plan says 10
    with pytest.raises(DiskFull, match=r"checkpoint-2 needs 0.01 GB and 0.00 GB are free .*checkpoint-1 is intact"):
        save(trainer, 2)
    assert checkpoints(trainer) == ["checkpoint-1"]


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_the_latest_complete_one(
    trainer: AgentGRPOTrainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(trainer, 1)
    first = {p.name: p.stat().st_size for p in (Path(trainer.args.output_dir) / "checkpoint-1").iterdir()}

    def disk_full(output_dir: str) -> Any:  # the weights are written, then the optimizer's state finds no space
        (Path(output_dir) / "optimizer.pt").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "_save_optimizer_and_scheduler", disk_full)
    with pytest.raises(DiskFull, match=r"saving checkpoint-2 failed .*No space left.*checkpoint-1 is the latest"):
        save(trainer, 2)
    assert checkpoints(trainer) == ["checkpoint-1"]  # no partial checkpoint-2 for a restart to take as the latest
    assert last_complete_checkpoint(Path(trainer.args.output_dir)).endswith("checkpoint-1")
    assert {p.name: p.stat().st_size for p in (Path(trainer.args.output_dir) / "checkpoint-1").iterdir()} == first


def test_a_final_model_that_fails_midway_leaves_no_partial_final_and_the_last_checkpoint(
    trainer: AgentGRPOTrainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(trainer, 1)
    trainer.state.global_step = 2  # a step past the last checkpoint: the final model is written, not linked
    final = Path(trainer.args.output_dir) / "final"
    assert save_final(trainer, final, torch.float32, needed=2**20) == "written"
    written = sorted(p.name for p in final.iterdir())
    assert "model.safetensors" in written and not final.with_name("final.partial").exists()

    def disk_full(output_dir: str, **kwargs: Any) -> None:
        (Path(output_dir)).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "save_model", disk_full)
    with pytest.raises(DiskFull, match=r"saving the final model failed .*No space left.*partial files removed"):
        save_final(trainer, final, torch.float32)
    assert not final.with_name("final.partial").exists()
    assert sorted(p.name for p in final.iterdir()) == written  # the earlier final model, as it was
    assert checkpoints(trainer) == ["checkpoint-1"]


def test_a_final_model_at_the_last_checkpoint_s_step_is_hard_links_to_its_weights(trainer: AgentGRPOTrainer) -> None:
    """No second copy on disk: the weights' files are the checkpoint's (one inode, two names), the model loads from
    `final` alone, and it outlives the checkpoint's deletion; the optimizer's state stays out of it."""
    save(trainer, 1)
    folder = Path(trainer.args.output_dir)
    final = folder / "final"
    assert save_final(trainer, final, torch.float32, needed=10**15) == "linked to checkpoint-1"  # no space asked
    weights = final / "model.safetensors"
    assert weights.stat().st_ino == (folder / "checkpoint-1" / "model.safetensors").stat().st_ino
    assert weights.stat().st_nlink == 2
    assert not (final / "optimizer.pt").exists() and not final.with_name("final.partial").exists()
    shutil.rmtree(folder / "checkpoint-1")  # keep_checkpoints rotating it out later
    loaded = AutoModelForCausalLM.from_pretrained(final)
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_file_system_that_cannot_link_gets_the_final_model_written(
    trainer: AgentGRPOTrainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(trainer, 1)

    def cannot(src: Any, dst: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cannot)
    final = Path(trainer.args.output_dir) / "final"
    assert save_final(trainer, final, torch.float32) == "written"
    assert (final / "model.safetensors").stat().st_nlink == 1


def test_the_plan_counts_no_second_copy_where_the_final_model_is_linked() -> None:
    """Unsharded and ending at a save: the final model adds nothing to the peak; sharded or a budget (last step
    unknown): its bytes count."""
    shape = Shape(parameters=1000, layers=2, hidden=8, intermediate=16, vocab=10, embedding_parameters=80,
                  adapter_parameters=50)  # fmt: skip
    linked = plan_disk(shape, DiskSetting(full=True, ranks=1, sharded=False, weight_bytes=2, keep=1, saves=1))
    assert linked["final_linked"]
    assert linked["peak_bytes"] == int((linked["checkpoint_bytes"] + disk.SMALL_BYTES) * disk.MARGIN)
    budgeted = plan_disk(shape, DiskSetting(full=True, ranks=1, sharded=False, weight_bytes=2, keep=1, saves=None))
    assert not budgeted["final_linked"] and budgeted["peak_bytes"] > linked["peak_bytes"]
    sharded = plan_disk(shape, DiskSetting(full=True, ranks=2, sharded=True, weight_bytes=2, keep=1, saves=1))
    assert not sharded["final_linked"]

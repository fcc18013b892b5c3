"""Reward-model jobs: train one with TRL's RewardTrainer, serve it over HTTP, merge a LoRA adapter into its base.

python launch.py job=reward_model_train [model=...] [finetune=lora] [job.pairs=prefs.jsonl]
python launch.py job=reward_model_serve job.model_path=<run>/checkpoints/final job.port=8002
python launch.py job=merge_lora job.adapter_path=<run>/checkpoints/final
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from datasets import Dataset
from omegaconf import DictConfig
from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification, PeftConfig
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import RewardConfig, RewardTrainer

from foundation.run_dir import RunDir
from foundation.schema import number
from jobs.preference import PreferenceJob, device, prepare, save_final, trainer_args
from rewards.reward_model import Scorer, create_app


@dataclass
class RewardModelTrainJob(PreferenceJob):
    """conf/job/reward_model_train.yaml's keys."""


@dataclass
class RewardModelServeJob:
    """conf/job/reward_model_serve.yaml's keys."""

    name: str
    model_path: str  # <run>/checkpoints/final of job=reward_model_train (full or LoRA)
    host: str = "127.0.0.1"
    port: int = number(8002, ge=0, le=65535)
    max_length: int = number(512, gt=0)  # tokens of prompt + response scored (the last ones)
    max_batch_size: int = number(64, gt=0)  # texts per forward pass


@dataclass
class MergeLoraJob:
    """conf/job/merge_lora.yaml's keys."""

    name: str
    adapter_path: str  # a PEFT adapter directory
    output_path: str | None = None  # None: <run dir>/merged


def pairwise_accuracy(scorer: Scorer, pairs: list[dict[str, str]]) -> float:
    prompts = [p["prompt"] for p in pairs]
    chosen = scorer.score(prompts, [p["chosen"] for p in pairs])
    rejected = scorer.score(prompts, [p["rejected"] for p in pairs])
    return sum(c > r for c, r in zip(chosen, rejected, strict=True)) / len(pairs)


def train(cfg: DictConfig, run: RunDir) -> dict[str, Any]:
    """job=reward_model_train: a scalar-head model of the `model` group, full or LoRA, on preference pairs."""
    parts, pairs, source, tokenizer = prepare(cfg)
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    args = trainer_args(RewardConfig, cfg, run)
    trainer = RewardTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(pairs),
        processing_class=tokenizer,
        peft_config=parts["finetune"].peft_config(task_type="SEQ_CLS"),
    )
    result = trainer.train()
    final = save_final(trainer, tokenizer, run)
    scorer = Scorer(trainer.model, tokenizer, cfg.job.max_length)
    held_in = pairs[: cfg.job.eval_pairs]
    accuracy = pairwise_accuracy(scorer, held_in)
    run.log(trainer.state.global_step, {"train/loss": result.training_loss, "train/pairwise_accuracy": accuracy})
    return {
        "pairs": len(pairs),
        "steps": trainer.state.global_step,
        "train_loss": result.training_loss,
        "pairwise_accuracy_held_in": accuracy,
        "model_path": str(final),
    }


def load_reward_model(path: str | Path) -> tuple[Any, Any]:
    """A saved reward model, full or LoRA adapter (merged on load)."""
    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if (path / "adapter_config.json").is_file():
        model = AutoPeftModelForSequenceClassification.from_pretrained(path, num_labels=1).merge_and_unload()
    else:
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def serve(cfg: DictConfig, run: RunDir) -> dict[str, Any]:
    """job=reward_model_serve: the HTTP API of rewards/reward_model.py until stopped."""
    model, tokenizer = load_reward_model(cfg.job.model_path)
    model = model.to(device())
    app = create_app(Scorer(model, tokenizer, cfg.job.max_length), max_batch_size=cfg.job.max_batch_size)
    print(f"reward model {cfg.job.model_path} at http://{cfg.job.host}:{cfg.job.port}", flush=True)
    uvicorn.run(app, host=cfg.job.host, port=cfg.job.port, log_level="warning")
    return {"model_path": cfg.job.model_path}


def merge_lora(cfg: DictConfig, run: RunDir) -> dict[str, Any]:
    """job=merge_lora: an adapter merged into its base, saved as a standalone model (PEFT)."""
    adapter = Path(cfg.job.adapter_path)
    peft_config = PeftConfig.from_pretrained(adapter)
    if peft_config.task_type == "SEQ_CLS":
        model, tokenizer = load_reward_model(adapter)
    else:
        model = AutoPeftModelForCausalLM.from_pretrained(adapter).merge_and_unload()
        tokenizer = AutoTokenizer.from_pretrained(adapter)
    out = Path(cfg.job.output_path) if cfg.job.output_path else run.path / "merged"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"adapter_path": str(adapter), "base": peft_config.base_model_name_or_path, "merged_path": str(out)}

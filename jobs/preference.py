"""What the preference jobs (reward_model_train, dpo) share: the pairs, the model source, TRL's arguments, saving."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase, TrainingArguments

from data.preferences import convert, read_jsonl, sql_pairs
from foundation.run_dir import RunDir
from foundation.schema import number
from jobs.config import build_components

Args = TypeVar("Args", bound=TrainingArguments)


@dataclass
class PreferenceJob:
    """The keys the preference jobs share (conf/job/reward_model_train.yaml, conf/job/dpo.yaml)."""

    name: str
    pairs: str | None = None  # a prompt/chosen/rejected jsonl; None: SQL pairs generated from conf/data
    max_pairs: int | None = number(None, gt=0)  # with generated pairs: at most this many (None: all)
    steps: int = number(200, gt=0)  # optimizer steps
    batch_size: int = number(16, gt=0)  # pairs per step
    learning_rate: float = number(1e-3, gt=0)
    max_length: int = number(512, gt=0)  # tokens of prompt + response
    eval_pairs: int = number(200, gt=0)  # held-in pairs scored before and/or after training


def preference_pairs(cfg: DictConfig, data: Any) -> list[dict[str, str]]:
    """`job.pairs` (a prompt/chosen/rejected jsonl), or SQL pairs generated from the data group's train split."""
    if cfg.job.pairs:
        return convert(read_jsonl(Path(cfg.job.pairs)))
    pairs = sql_pairs(data.prepare(), data.train_split, seed=cfg.seed, limit=cfg.job.max_pairs)
    return [p | {"prompt": p["prompt"] + "\n"} for p in pairs]


def prepare(cfg: DictConfig) -> tuple[dict[str, Any], list[dict[str, str]], str, PreTrainedTokenizerBase]:
    """Built components, the shuffled pairs, where the model loads from (the tiny one trained on the pairs' text)."""
    parts = build_components(cfg)
    pairs = preference_pairs(cfg, parts["data"])
    random.Random(cfg.seed).shuffle(pairs)
    source = parts["model"].prepare([t for p in pairs for t in p.values()])
    return parts, pairs, source, parts["model"].load_tokenizer(source)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def trainer_args(config_cls: type[Args], cfg: DictConfig, run: RunDir, **extra: Any) -> Args:
    """TRL's config for a preference job from `cfg.job` (steps, batch size, learning rate, max length)."""
    return config_cls(
        output_dir=str(run.checkpoints),
        max_steps=cfg.job.steps,
        per_device_train_batch_size=cfg.job.batch_size,
        learning_rate=cfg.job.learning_rate,
        max_length=cfg.job.max_length,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        bf16=device() == "cuda",
        gradient_checkpointing=False,
        seed=cfg.seed,
        disable_tqdm=True,
        **extra,
    )


def save_final(trainer: Any, tokenizer: PreTrainedTokenizerBase, run: RunDir) -> Path:
    final = run.checkpoints / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
    return final

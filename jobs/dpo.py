"""job=dpo: TRL's DPOTrainer on the policy (the `model` group, full or LoRA) with preference pairs.

The pairs are the reward model's (`job.pairs`, or SQL pairs generated from conf/data). The summary reports the mean
log-probability margin of chosen over rejected on held-in pairs before and after, which DPO should widen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset
from omegaconf import DictConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from trl import DPOConfig, DPOTrainer

from foundation.run_dir import RunDir
from foundation.schema import number
from jobs.preference import PreferenceJob, device, prepare, save_final, trainer_args


@dataclass
class DPOJob(PreferenceJob):
    """conf/job/dpo.yaml's keys."""

    steps: int = number(100, gt=0)  # optimizer steps
    batch_size: int = number(8, gt=0)  # pairs per step
    learning_rate: float = number(5e-4, gt=0)  # the tiny model's; about 5e-7 for a pretrained one
    eval_pairs: int = number(64, gt=0)  # held-in pairs whose margin is reported before and after training
    beta: float = number(0.1, gt=0)  # DPO's inverse temperature: how far the policy may move from the reference


@torch.no_grad()
def mean_margin(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: list[dict[str, str]]) -> float:
    """Mean over pairs of log p(chosen | prompt) - log p(rejected | prompt), summed over the response tokens."""
    model.eval()
    device = next(model.parameters()).device

    def logp(prompt: str, response: str) -> float:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = prompt_ids + tokenizer(response + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
        targets = torch.tensor(ids[1:], device=device)
        token_logps = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
        return token_logps[len(prompt_ids) - 1 :].sum().item()

    margins = [logp(p["prompt"], p["chosen"]) - logp(p["prompt"], p["rejected"]) for p in pairs]
    return sum(margins) / len(margins)


def run(cfg: DictConfig, run_dir: RunDir) -> dict[str, Any]:
    parts, pairs, source, tokenizer = prepare(cfg)
    model = parts["model"].load_model(source, device())
    held_in = pairs[: cfg.job.eval_pairs]
    before = mean_margin(model, tokenizer, held_in)
    args = trainer_args(DPOConfig, cfg, run_dir, beta=cfg.job.beta)
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(pairs),
        processing_class=tokenizer,
        peft_config=parts["finetune"].peft_config(),
    )
    result = trainer.train()
    final = save_final(trainer, tokenizer, run_dir)
    after = mean_margin(trainer.model, tokenizer, held_in)
    run_dir.log(trainer.state.global_step, {"train/loss": result.training_loss, "train/margin": after})
    return {
        "pairs": len(pairs),
        "steps": trainer.state.global_step,
        "train_loss": result.training_loss,
        "margin_before": before,
        "margin_after": after,
        "model_path": str(final),
    }

"""job=dpo: TRL's DPOTrainer on the policy (the `model` group, full or LoRA) with preference pairs.

The pairs are the reward model's (`job.pairs`, or SQL pairs generated from conf/data). The summary reports the mean
log-probability margin of chosen over rejected on held-in pairs before and after, which DPO should widen.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from datasets import Dataset
from omegaconf import DictConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from trl import DPOConfig, DPOTrainer

from experiments.config import build_components
from experiments.reward_model import preference_pairs
from experiments.run_dir import RunDir


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
    parts = build_components(cfg)
    model_spec, finetune = parts["model"], parts["finetune"]
    pairs = preference_pairs(cfg, parts["data"])
    random.Random(cfg.seed).shuffle(pairs)
    source = model_spec.prepare([t for p in pairs for t in p.values()])
    tokenizer = model_spec.load_tokenizer(source)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model_spec.load_model(source, device)
    held_in = pairs[: cfg.job.eval_pairs]
    before = mean_margin(model, tokenizer, held_in)
    args = DPOConfig(
        output_dir=str(run_dir.checkpoints),
        max_steps=cfg.job.steps,
        per_device_train_batch_size=cfg.job.batch_size,
        learning_rate=cfg.job.learning_rate,
        beta=cfg.job.beta,
        max_length=cfg.job.max_length,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        bf16=device == "cuda",
        gradient_checkpointing=False,
        seed=cfg.seed,
        disable_tqdm=True,
    )
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(pairs),
        processing_class=tokenizer,
        peft_config=finetune.peft_config(),
    )
    result = trainer.train()
    final = run_dir.checkpoints / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
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

"""Warm start: supervised fine-tuning on demonstrations of the SQL agent, before RL (`conf/warmstart/sft.yaml`).

A random-init model writes no SQL, so GRPO alone would never see a reward. The demonstrations are the agent's own
conversations, produced by running the unchanged agent against a scripted model that answers with the gold SQL and
the right verdicts; some show a wrong first query, an INCORRECT verdict and a rewrite. The model is then trained on
its assistant turns only (TRL's SFTTrainer, `assistant_only_loss`).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback
from trl import SFTConfig, SFTTrainer

from agent.llm import Message, ScriptedChat
from agent.rollout import Agent


@dataclass
class SFTWarmstart:
    name: str = "sft"
    steps: int = 600
    learning_rate: float = 2e-3
    batch_size: int = 32
    warmup_ratio: float = 0.05
    rewrite_demo_fraction: float = 0.2
    write_reply: str = "```sql\n{query}\n```"
    correct_reply: str = "THE QUERY IS CORRECT"
    incorrect_reply: str = "THE QUERY IS INCORRECT"

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.batch_size <= 0 or self.learning_rate <= 0:
            raise ValueError("warmstart.steps, warmstart.batch_size and warmstart.learning_rate must be > 0")
        if not 0.0 <= self.rewrite_demo_fraction <= 1.0:
            raise ValueError(f"warmstart.rewrite_demo_fraction must be in [0, 1], got {self.rewrite_demo_fraction}")

    def _replies(self, task: dict[str, Any], wrong: str | None, check_step: bool) -> list[str]:
        gold = self.write_reply.format(query=task["query"])
        if not check_step:
            return [gold]
        if wrong is None:
            return [gold, self.correct_reply]
        return [self.write_reply.format(query=wrong), self.incorrect_reply, gold, self.correct_reply]

    def demonstrations(self, agent: Agent, tasks: list[dict[str, Any]], seed: int) -> list[list[Message]]:
        """The agent's conversations on `tasks` against a scripted model that knows the answers."""
        rng = random.Random(seed)
        check_step = bool(getattr(agent, "check_step", False))
        can_rewrite = check_step and getattr(agent, "max_turns", 1) >= 2
        by_db: dict[str, list[str]] = {}
        for task in tasks:
            by_db.setdefault(task["db_id"], []).append(task["query"])

        def wrong_query(task: dict[str, Any]) -> str | None:
            if not can_rewrite or rng.random() >= self.rewrite_demo_fraction:
                return None
            others = [q for q in by_db[task["db_id"]] if q != task["query"]]
            return rng.choice(others) if others else None

        scripts = [ScriptedChat(self._replies(task, wrong_query(task), check_step)) for task in tasks]

        async def run_all() -> list[Any]:
            return await asyncio.gather(*(agent.run(t, s) for t, s in zip(tasks, scripts, strict=True)))

        return [t.messages for t in asyncio.run(run_all()) if t.error is None and t.final_sql is not None]

    def train(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        demos: list[list[Message]],
        output_dir: Path,
        log_file: Path,
        seed: int,
        use_bf16: bool,
        max_length: int,
    ) -> PreTrainedModel:
        """Fine-tune `model` on the assistant turns of `demos` (cut at `max_length` tokens); save it to `output_dir`."""
        args = SFTConfig(
            output_dir=str(output_dir),
            max_steps=self.steps,
            per_device_train_batch_size=self.batch_size,
            learning_rate=self.learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, int(self.warmup_ratio * self.steps)),
            assistant_only_loss=True,
            gradient_checkpointing=False,  # TRL turns it on by default; on CPU it only costs time
            max_length=max_length,
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            bf16=use_bf16,
            seed=seed,
            data_seed=seed,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list([{"messages": m} for m in demos]),
            processing_class=tokenizer,
            callbacks=[_JsonlLog(log_file)],
        )
        trainer.train()
        trainer.save_model(str(output_dir))
        tokenizer.save_pretrained(str(output_dir))
        return trainer.model


class _JsonlLog(TrainerCallback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"step": state.global_step, **{f"sft/{k}": v for k, v in logs.items()}}) + "\n")

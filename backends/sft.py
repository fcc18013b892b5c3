"""Warm start: supervised fine-tuning on demonstrations of the agent, before RL (`conf/warmstart/sft.yaml`), a phase
every backend runs the same way (`run_tasks`, then `warm_start`); and the supervised trainer the control arms use.

A random-init model calls no tools and writes no SQL, so GRPO alone would never see a reward. The demonstrations are
the agent's own conversations: the unchanged agent runs against an in-process scripted endpoint that replays the
agent's `oracle(task, wrong)` replies (gold SQL, right verdicts, a final answer; some with a wrong first query and a
correction). A demonstration is the agent's last request (messages, and tools if it has any) plus the reply, exactly
what the policy will be asked during rollouts. The model is then trained on its assistant turns only (TRL's
SFTTrainer, `assistant_only_loss`). TRL encodes a demonstration's rendering whole, so special-token text in its
content (a database row holding `<|im_end|>`) would become the control token; such a demonstration is left out and
counted (`trainable_demos`), as the policy server encodes that text as ordinary ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback

from agent.rollout import Agent
from agent.scripted import ReplayChat
from backends.progress import show_progress
from backends.setup import TrainSetup
from data.splits import stratified_split, training_corpus
from foundation.errors import ConfigError
from foundation.ranks import is_main, world_size
from foundation.schema import number
from models.chat import ChatFormat, for_template

logger = logging.getLogger(__name__)

Demonstration = dict[str, Any]  # {"messages": [...], "tools": JSON string or None}


def demonstration_texts(demo: Demonstration) -> list[str]:
    """The strings a demonstration holds (for training a tokenizer on them)."""
    texts = [str(m.get("content") or "") for m in demo["messages"]]
    texts += [
        json.dumps(c["function"], ensure_ascii=False) for m in demo["messages"] for c in m.get("tool_calls") or []
    ]
    return [*texts, demo["tools"]] if demo["tools"] else texts


@dataclass
class SFTWarmstart:
    name: str = "sft"
    steps: int = number(200, gt=0)  # optimizer steps (cosine schedule)
    learning_rate: float = number(3e-3, gt=0)  # peak, after the warmup
    batch_size: int = number(32, gt=0)
    warmup_ratio: float = number(0.05, ge=0, le=1)  # of the steps, warming the learning rate up
    rewrite_demo_fraction: float = number(0.2, ge=0, le=1)  # demonstrations with a wrong first query and its fix
    concurrency: int = number(64, gt=0)  # agent runs at once while demonstrations are collected
    seed: int | None = number(None, ge=0)  # the demonstrations' and the training's seed (None: the run's)
    task_share: float = number(1.0, gt=0, le=1)  # of the training tasks, this share (stratified); the rest: GRPO's
    rl_tasks: int | None = number(None, gt=0)  # with task_share 1: GRPO's are about this many, the warm start the rest
    shared: bool = False  # one checkpoint in cache_dir for every run asking for the same warm start (arms, seeds)
    cache_dir: str = ".cache/warmstarts"  # where shared warm starts are kept
    path: str | None = None  # a warm start built before (its checkpoint directory): loaded, never trained here
    weights_sha256: str | None = None  # the digest `path`'s weights must have (a run's summary: sft.weights_sha256)

    def __post_init__(self) -> None:
        if self.path is None:
            if self.weights_sha256 is not None:
                raise ConfigError("warmstart.weights_sha256 checks warmstart.path, which is not set")
            return
        if not (Path(self.path) / "config.json").is_file():
            raise ConfigError(f"warmstart.path={self.path} is not a model checkpoint (no config.json)")
        if self.weights_sha256 is not None and (found := weights_digest(Path(self.path))) != self.weights_sha256:
            raise ConfigError(
                f"warmstart.weights_sha256={self.weights_sha256}, but warmstart.path={self.path} holds weights "
                f"{found}: another warm start than the one asked for"
            )

    def seed_of(self, run_seed: int) -> int:
        """The demonstrations' and the training's seed: `seed`, else the run's."""
        return self.seed if self.seed is not None else run_seed

    def split(self, tasks: list[dict[str, Any]], seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(the warm start's tasks, the tasks GRPO and the control train on): all of them for both when `task_share`
        is 1 and `rl_tasks` unset; else `task_share` of them (a share below 1 decides; at 1, all but about
        `rl_tasks`), drawn with `seed` (`data.split_seed`) in the proportions of every kind of task (`data.splits`),
        and the others, which the warm start never sees."""
        by_count = self.task_share == 1 and self.rl_tasks is not None
        share = 1 - self.rl_tasks / max(len(tasks), 1) if by_count else self.task_share
        if share == 1:
            return tasks, tasks
        asked = f"warmstart.rl_tasks={self.rl_tasks}" if by_count else f"warmstart.task_share={self.task_share}"
        if share <= 0:
            raise ConfigError(f"{asked} of {len(tasks)} training tasks leaves the warm start none")
        warm, rest = stratified_split(tasks, share, seed, "warmstart")
        if not warm or not rest:
            raise ConfigError(f"{asked} of {len(tasks)} training tasks leaves one side empty")
        return warm, rest

    def demonstrations(self, agent: Agent, tasks: list[dict[str, Any]], seed: int) -> list[Demonstration]:
        """The agent's conversations on `tasks` against a scripted model that knows the answers. A rewrite
        demonstration's wrong first query is another task's gold query on the same database: only tasks that carry
        both (`db_id`, `query`: SQL data sets) get one; the others are plain."""
        rng = random.Random(seed)
        by_db: dict[str, list[str]] = {}
        for task in tasks:
            if "db_id" in task and "query" in task:
                by_db.setdefault(task["db_id"], []).append(task["query"])

        def wrong_query(task: dict[str, Any]) -> str | None:
            if rng.random() >= self.rewrite_demo_fraction:
                return None
            others = [q for q in by_db.get(task.get("db_id"), []) if q != task.get("query")]
            return rng.choice(others) if others else None

        replays = [ReplayChat(agent.oracle(task, wrong_query(task))) for task in tasks]
        semaphore = asyncio.Semaphore(self.concurrency)

        async def one(task: dict[str, Any], index: int) -> Any:
            async with semaphore:
                return await agent.run(task, replays[index])

        async def run_all() -> list[Any]:
            return await asyncio.gather(*(one(t, i) for i, t in enumerate(tasks)))

        demos = []
        for trajectory, chat in zip(asyncio.run(run_all()), replays, strict=True):
            if trajectory.error is not None or len(chat.replies) != len(chat.script):
                continue  # the agent did not play the whole script (it ended early or failed)
            last = chat.requests[-1]
            demos.append(
                {
                    "messages": [for_template(m) for m in [*last["messages"], chat.replies[-1]]],
                    "tools": json.dumps(last["tools"], ensure_ascii=False) if last.get("tools") else None,
                }
            )
        return demos

    @property
    def writes_into_run(self) -> bool:
        """Whether its checkpoint goes into the run's own `checkpoints/sft` (neither loaded from `path` nor shared)."""
        return self.path is None and not self.shared

    def checkpoint_dir(
        self,
        run_checkpoints: Path,
        source: str,
        demos: list[Demonstration],
        max_length: int,
        use_bf16: bool,
        seed: int,
    ) -> Path:
        """Where the warm start's model is: `path` when given; the run's own `checkpoints/sft`; or with `shared` one
        directory in `cache_dir` for every run that asks for the same warm start (model, demonstrations, settings,
        precision)."""
        if self.path is not None:
            return Path(self.path)
        if not self.shared:
            return run_checkpoints / "sft"
        unkeyed = ("name", "concurrency", "shared", "cache_dir", "path", "weights_sha256")
        settings = {k: v for k, v in asdict(self).items() if k not in unkeyed}
        key = [settings, source, max_length, use_bf16, seed, world_size(), demos]  # ranks: the batch is N times
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
        return Path(self.cache_dir) / f"sft-{digest[:16]}"

    @contextlib.contextmanager
    def exclusive(self, checkpoint: Path) -> Iterator[None]:
        """Held while this run builds a shared warm start: runs that want the same one wait for it (one process;
        the ranks of one run train it together and are not locked)."""
        if not self.shared or world_size() > 1:
            yield
            return
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        with open(checkpoint.with_name(checkpoint.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
            yield

    def train(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        demos: list[Demonstration],
        output_dir: Path,
        log_file: Path,
        seed: int,
        use_bf16: bool,
        max_length: int,
    ) -> tuple[PreTrainedModel, int]:
        """Fine-tune `model` on the assistant turns of `demos` (cut at `max_length` tokens); save it to `output_dir`,
        published whole (written next to it, then renamed). Returns the model and the tokens it trained on (every
        rank's, padding left out)."""
        trainer = supervised(
            model,
            tokenizer,
            demos,
            output_dir=output_dir,
            steps=self.steps,
            learning_rate=self.learning_rate,
            batch_size=self.batch_size,
            schedule="cosine",
            warmup_steps=max(1, int(self.warmup_ratio * self.steps)),
            seed=seed,
            use_bf16=use_bf16,
            max_length=max_length,
            callbacks=[_JsonlLog(log_file)],
        )
        show_progress(trainer, "warm start (SFT)")
        trainer.train()
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        if not is_main() and not trainer.is_fsdp_enabled:  # replicated weights (DDP): rank 0 alone writes them
            return trainer.model, trainer._total_train_tokens
        # Each rank saves into a directory of its own. Rank 0 writes the model there; under FSDP (an accelerate
        # setting in the environment) the others only help gather the weights, but transformers lists the directory
        # they name, and output_dir may be gone then (rank 0 replacing what a dead attempt left).
        staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
        trainer.save_model(str(staging))
        if not is_main():
            shutil.rmtree(staging, ignore_errors=True)
            return trainer.model, trainer._total_train_tokens
        tokenizer.save_pretrained(str(staging))
        if (output_dir / "config.json").is_file():  # published meanwhile (ranks of another run): keep that one
            shutil.rmtree(staging, ignore_errors=True)
        else:
            shutil.rmtree(output_dir, ignore_errors=True)  # what an attempt that died left, never a model
            staging.rename(output_dir)
        return trainer.model, trainer._total_train_tokens


@dataclass
class RunTasks:
    """A run's tasks by phase, the warm start's demonstrations, and the model they prepared (`model.prepare`: a
    built model's tokenizer is trained on the demonstrations and training tasks only)."""

    warm: list[dict[str, Any]]  # the warm start's (all the training tasks unless warmstart.task_share/rl_tasks)
    train: list[dict[str, Any]]  # what RL (and the control arms) train on
    val: list[dict[str, Any]]
    test: list[dict[str, Any]]
    demos: list[Demonstration] = field(default_factory=list)
    source: str = ""  # the model's weights and tokenizer before any training (a hub id or a directory)


def run_tasks(setup: TrainSetup) -> RunTasks:
    """The run's tasks between its phases (`SFTWarmstart.split`), the warm start's demonstrations, and the model
    prepared for them (built here for model=tiny)."""
    warmstart = setup.warmstart if isinstance(setup.warmstart, SFTWarmstart) else None
    train, val, test = setup.data.train_tasks(), setup.data.val_tasks(), setup.data.test_tasks()
    warm, rl = warmstart.split(train, setup.data.split_seed) if warmstart else ([], train)
    seed = warmstart.seed_of(setup.seed) if warmstart else setup.seed
    demos = warmstart.demonstrations(setup.agent, warm, seed) if warmstart else []
    texts = [text for demo in demos for text in demonstration_texts(demo)]
    source = setup.model.prepare(training_corpus(texts, rl, val + test, train))
    return RunTasks(warm, rl, val, test, demos, source)


@dataclass
class WarmStart:
    """Where GRPO starts: the warm start's checkpoint (None: the prepared model itself), the model if this run trained
    it (still in memory), and what the summary records of it (`sft`)."""

    checkpoint: Path | None
    model: PreTrainedModel | None = None
    record: dict[str, Any] = field(default_factory=dict)


def warm_start(
    warmstart: Any,
    model_spec: Any,
    run: Any,
    seed: int,
    tasks: RunTasks,
    tokenizer: PreTrainedTokenizerBase,
    device: str,
    *,
    max_length: int,
    use_bf16: bool,
    resuming: bool,
) -> WarmStart:
    """The warm start phase: with warmstart=sft (`warmstart`), the SFT checkpoint (`SFTWarmstart.checkpoint_dir`),
    trained here from `model_spec` on `tasks.demos` unless it exists (`warmstart.path`, shared, this run's own) or the
    run resumes from a later one; with warmstart=none nothing. `run`: the run directory; `seed`: the run's (the warm
    start's own if it has one). Every rank of a run calls it (they train together)."""
    if not isinstance(warmstart, SFTWarmstart):
        return WarmStart(None)
    seed = warmstart.seed_of(seed)
    checkpoint = warmstart.checkpoint_dir(run.checkpoints, tasks.source, tasks.demos, max_length, use_bf16, seed)
    model, record = None, {}
    with warmstart.exclusive(checkpoint):
        if not resuming and not agreed(is_model(checkpoint)):  # a model that needs a warm start
            run.phase = "warm start (SFT)"  # scores 0 before it: not worth validating
            start = time.monotonic()
            base = model_spec.load_model(tasks.source, device)
            parameters = base.num_parameters()  # before any rank shards it
            model, tokens = warmstart.train(
                base,
                tokenizer,
                tasks.demos,
                checkpoint,
                run.path / "sft_metrics.jsonl",
                seed,
                use_bf16=use_bf16,
                max_length=max_length,
            )
            record = {
                "wall_s": time.monotonic() - start,
                "trained_tokens": tokens,
                "flops": 6 * parameters * tokens,  # backends/compute.py's count: every weight trains
            }
    if model is None and not is_model(checkpoint):  # resumed: a LoRA checkpoint holds no base model
        raise RuntimeError(f"resuming {run.path}: its warm start {checkpoint} is gone (build it again first)")
    record = (record or {"reused": True}) | {
        "demonstrations": len(tasks.demos),
        "checkpoint": str(checkpoint),
        "weights_sha256": weights_digest(checkpoint) if is_main() and is_model(checkpoint) else None,
    }
    return WarmStart(checkpoint, model, record)


def is_model(path: Path) -> bool:
    """Whether `path` holds a model checkpoint."""
    return (path / "config.json").is_file()


def agreed(flag: bool) -> bool:
    """Rank 0's value on every rank (one process: the value)."""
    if world_size() == 1:
        return flag
    box = [flag]
    broadcast_object_list(box, from_process=0)
    return bool(box[0])


def trainable_demos(demos: list[Demonstration], tokenizer: PreTrainedTokenizerBase) -> list[Demonstration]:
    """The demonstrations TRL can encode as their text: those without a special token's text in any message or in
    their tools (TRL would encode it as the control token). The others are left out, with a warning that counts them."""
    chat = ChatFormat(tokenizer)
    kept = [d for d in demos if not chat.carries_special_text([d["messages"], d["tools"]])]
    if len(kept) < len(demos):
        logger.warning(
            "%d of %d demonstrations hold a special token's text (e.g. a tool result with <|im_end|>): left out of "
            "SFT, which would encode it as the control token",
            len(demos) - len(kept),
            len(demos),
        )
    if demos and not kept:
        raise ValueError("every demonstration holds a special token's text: nothing to fine-tune on")
    return kept


def supervised(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    demos: list[Demonstration],
    *,
    output_dir: Path,
    steps: int,
    learning_rate: float,
    batch_size: int,
    schedule: str,
    warmup_steps: int,
    seed: int,
    use_bf16: bool,
    max_length: int,
    callbacks: list[TrainerCallback],
) -> Any:
    """TRL's SFTTrainer on the assistant turns of `demos` (the warm start's, and the control arm's)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type=schedule,
        warmup_steps=warmup_steps,
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
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(trainable_demos(demos, tokenizer)),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


class _JsonlLog(TrainerCallback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs and state.is_world_process_zero:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"step": state.global_step, **{f"sft/{k}": v for k, v in logs.items()}}) + "\n")


def weights_digest(checkpoint: Path) -> str:
    """A short SHA-256 of a checkpoint's weight files: runs that report the same one started from the same weights."""
    digest = hashlib.sha256()
    for path in sorted(checkpoint.glob("*.safetensors")) or sorted(checkpoint.glob("*.bin")):
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:16]

"""What every phase of a backend=trl run reads: one `RunContext`, built once by `build_context`.

Building it is the run's first two phases: prepare (the process group, the seeds, the tasks by phase, the tokenizer,
the validation) and the warm start (the model the arm starts from, and the compute count it trains under). The
phases after it (`TRLBackend.train`) read it and add to it: the first validation, the filtered pool (its tasks
become `tasks.train`), then the arm (backends/trl/arms.py). `results` is the summary's, filled by every phase.
"""

from __future__ import annotations

import contextlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import PartialState
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from trl import GRPOConfig

from backends.algorithm import GRPO
from backends.compute import ComputeCount
from backends.memory import DeviceMemory
from backends.setup import TrainSetup
from backends.sft import RunTasks, SFTWarmstart, WarmStart, run_tasks, warm_start
from backends.trl.fsdp import OptimizerOffload
from backends.trl.validation import Validation
from data.splits import KIND, kind_distance
from foundation.ranks import is_main, world_size
from foundation.run_dir import RunDir, last_complete_checkpoint
from inference.policy_server import PolicyServer
from inference.weights import GenerationWeights


class Parts(Protocol):
    """What the phases take from the backend (`TRLBackend`): its settings, the run's one engine and generation
    weights, and TRL's config."""

    offload: str
    samples_per_validation: int

    def resolved_device(self) -> str: ...

    def weights(self, device: str, dtype: torch.dtype, snapshot: bool = False) -> GenerationWeights: ...

    def policy_server(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, setup: TrainSetup
    ) -> PolicyServer: ...

    def grpo_config(self, algo: GRPO, output_dir: str, seed: int, device: str) -> GRPOConfig: ...


@dataclass
class RunContext:
    """A run's state between its phases (see the module's docstring)."""

    setup: TrainSetup
    backend: Parts
    device: str  # this rank's torch device
    tasks: RunTasks  # by phase, and the warm start's demonstrations; `train`: the pool once filtered
    test_tasks: list[dict[str, Any]]  # scored at the end (none without algorithm.test_at_end)
    metric: Any
    compute_dtype: torch.dtype  # the model's as loaded (FSDP2 keeps fp32 masters beside)
    resume_from: str | None  # the checkpoint this start resumes from (None: a fresh start)
    tokenizer: PreTrainedTokenizerBase
    results: dict[str, Any]
    memory: DeviceMemory | None  # what each GPU has in use from the start on, per phase (on GPUs)
    offload: OptimizerOffload | None  # backend.offload=optimizer's
    validation: Validation
    begin: WarmStart  # where the arm starts: the warm start's checkpoint, or the prepared model
    model: PreTrainedModel
    compute: ComputeCount  # every rank's compute so far, the pool's charge included

    @property
    def run(self) -> RunDir:
        return self.setup.run

    @property
    def algo(self) -> GRPO:
        return self.setup.algorithm

    @property
    def warm(self) -> bool:
        """Whether the run has a warm start (warmstart=sft)."""
        return isinstance(self.setup.warmstart, SFTWarmstart)

    @property
    def resumed_at(self) -> int:
        """The step this start resumes at (0: a fresh start)."""
        return int(Path(self.resume_from).name.split("-")[-1]) if self.resume_from is not None else 0

    @property
    def use_bf16(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def max_length(self) -> int:
        """A sequence's tokens at most: prompt and response."""
        return self.algo.max_prompt_length + self.algo.max_response_length


def build_context(backend: Parts, setup: TrainSetup) -> RunContext:
    """Prepare and warm start (see the module's docstring), on every rank: the run's context."""
    run, algo, warm = setup.run, setup.algorithm, isinstance(setup.warmstart, SFTWarmstart)
    device = backend.resolved_device()
    tasks = _tasks(setup, device)
    test_tasks = tasks.test if algo.test_at_end else []
    metric = setup.data.metric()
    compute_dtype = setup.model.compute_dtype(device)
    resume_from = last_complete_checkpoint(run.checkpoints)
    tokenizer = setup.model.load_tokenizer(setup.warmstart.path if warm and setup.warmstart.path else tasks.source)
    results: dict[str, Any] = {
        "device": device,
        "world_size": world_size(),
        "train_tasks": len(tasks.train),
        "warmstart_tasks": len(tasks.warm),
        "val_tasks": len(tasks.val),
        "test_tasks": len(test_tasks),
    }
    memory = DeviceMemory(device).start() if device.startswith("cuda") else None  # start: loading, first validation
    # backend.offload=optimizer: the optimizer's state leaves the GPU whenever the engine is awake (rollouts, and
    # validations during GRPO: `Validation.during`)
    offload = OptimizerOffload() if backend.offload == "optimizer" and device.startswith("cuda") else None
    validation = Validation(
        setup,
        tasks.val,
        test_tasks,
        metric,
        # algorithm.async_rollouts: the engine generates while the trainer updates, from a copy of the weights
        generation_copy=backend.weights(device, compute_dtype, algo.overlapped).for_generation,
        server=lambda policy: backend.policy_server(policy, tokenizer, setup),
        samples_kept=backend.samples_per_validation,
        results=results,
        offload=offload,
    )
    begin, model, compute = _start(setup, tasks, tokenizer, device, resuming=resume_from is not None)
    if warm:
        results["sft"] = begin.record
    return RunContext(
        setup=setup,
        backend=backend,
        device=device,
        tasks=tasks,
        test_tasks=test_tasks,
        metric=metric,
        compute_dtype=compute_dtype,
        resume_from=resume_from,
        tokenizer=tokenizer,
        results=results,
        memory=memory,
        offload=offload,
        validation=validation,
        begin=begin,
        model=model,
        compute=compute,
    )


def _start(
    setup: TrainSetup, tasks: RunTasks, tokenizer: PreTrainedTokenizerBase, device: str, resuming: bool
) -> tuple[WarmStart, PreTrainedModel, ComputeCount]:
    """The warm start phase (`backends.sft.warm_start`: trained here unless it exists, or the run resumes), the model
    the arm starts from, and the compute count of its parameters (LoRA: 4 FLOPs a parameter a trained token, else 6)
    and ranks."""
    algo = setup.algorithm
    max_length, use_bf16 = algo.max_prompt_length + algo.max_response_length, device.startswith("cuda")
    begin = warm_start(
        setup.warmstart,
        setup.model,
        setup.run,
        setup.seed,
        tasks,
        tokenizer,
        device,
        max_length=max_length,
        use_bf16=use_bf16,
        resuming=resuming,
    )
    checkpoint = str(begin.checkpoint or tasks.source)
    model = begin.model if begin.model is not None else setup.model.load_model(checkpoint, device)
    compute = ComputeCount(
        model.num_parameters(), 4 if setup.finetune.peft_config() is not None else 6, ranks=world_size()
    )
    return begin, model, compute


def _tasks(setup: TrainSetup, device: str) -> RunTasks:
    """The run's tasks by phase, after the seeds. Several ranks (jobs/ranks.py): PyTorch's process group first; rank
    0 writes the shared cache (data, the built model) before the others read it; it alone writes the run directory
    and validates."""
    ranks = PartialState(cpu=not device.startswith("cuda")) if world_size() > 1 else None  # gloo on CPU
    random.seed(setup.seed)
    torch.manual_seed(setup.seed)
    with ranks.main_process_first() if ranks is not None else contextlib.nullcontext():
        return run_tasks(setup)


def validate_start(ctx: RunContext) -> None:
    """The first validation ("after_sft", or "initial" without a warm start): step 0 of a new metrics.jsonl. A
    resumed run validated its start before: its metrics.jsonl loses the steps after its checkpoint's instead."""
    if ctx.resume_from is None:
        initial = ctx.validation(ctx.model, "after_sft" if ctx.warm else "initial")
        if is_main():
            ctx.run.metrics_file.unlink(missing_ok=True)
            ctx.run.log(0, initial)
    else:
        if is_main():
            ctx.run.drop_metrics_after(ctx.resumed_at)
        ctx.results["resumed_from"] = Path(ctx.resume_from).name


def write_splits(
    path: Path,
    seed: int,
    warm: list[dict[str, Any]],
    rl: list[dict[str, Any]],
    val: list[dict[str, Any]],
    test: list[dict[str, Any]],
    pool: dict[str, Any] | None = None,
) -> None:
    """`splits.json`: which task ids each phase trained or was scored on, and how alike the training phases' mixes of
    task kinds are (total-variation distance; 0: the same mix), so that a reviewer can check the split; with a
    filtered pool (`algorithm.pool_samples`), `rl` is the pool and `pool` says how it was filtered."""
    phases = {"warmstart": warm, "rl": rl, "val": val, "test": test}
    record: dict[str, Any] = {
        "split_seed": seed,
        "phases": {name: [str(t["id"]) for t in tasks] for name, tasks in phases.items()},
        "kinds": {name: len({t.get(KIND) for t in tasks}) for name, tasks in phases.items()},
        "kind_distance_warmstart_rl": kind_distance(warm, rl, lambda t: str(t.get(KIND))) if warm else None,
    } | ({"pool": pool} if pool else {})
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")

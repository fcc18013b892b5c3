"""The embedded backend: TRL's GRPOTrainer (+ PEFT), on CPU, one GPU or N ranks (`conf/backend/trl.yaml`).

    data -> [warm-start SFT] -> validate -> GRPOTrainer(rollout_func = agent on the policy server) -> validate

On several ranks (`resources.gpus_per_node`, `resources.nodes`: jobs/ranks.py starts them) GRPO trains
data-parallel: each rank runs its share of the step's rollouts on its own policy server and device, and the weights,
gradients and optimizer state are sharded across ranks with FSDP2 (`sharding=fsdp2`, backends/trl/fsdp.py; the
engines generate from a full copy gathered before each rollout phase, inference/weights.py) or replicated (`ddp`).

Checkpoints go to `<run>/checkpoints/checkpoint-<step>` (TRL's own, resumable); a run started again in the same
directory resumes from the latest one, and `metrics.jsonl` keeps each step once. A stop signal during GRPO ends the
current step, writes a checkpoint there and stops (`foundation.interrupt`).

`train` runs the phases over one context (backends/trl/context.py); the arm that trains is a strategy
(backends/trl/arms.py: GRPO and RFT, or the SFT control), each with its trainer and its callback
(backends/trl/callbacks.py) and one clock for its budget and its validations (backends/trl/clock.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from trl import GRPOConfig

from backends.algorithm import GRPO, SFTControl
from backends.disk import DiskSetting, check_plan, plan_disk
from backends.memory import Setting, Shape, explain, plan_memory
from backends.protocol import Needs
from backends.setup import TrainSetup
from backends.sft import run_tasks
from backends.trl.arms import arm_for
from backends.trl.context import build_context, validate_start, write_splits
from backends.trl.fsdp import OFFLOADS, SHARDINGS, fsdp_arguments
from backends.trl.pool import train_on_pool, trains_on_pool
from foundation.errors import ConfigError
from foundation.ranks import is_main, local_rank, started_by_launcher, world_size
from foundation.run_dir import complete_checkpoints
from foundation.schema import number, one_of
from inference import ENGINES, Engine, VLLMSettings, make_engine, require_vllm, resolve_engine
from inference.policy_server import PolicyServer
from inference.weights import GenerationWeights


@dataclass
class TRLBackend:
    name: str = "trl"
    device: str = "auto"  # a torch device (cpu, cuda, cuda:1); auto: cuda when available, else cpu
    samples_per_validation: int = number(4, ge=0)  # trajectories kept in samples/ per validation
    gradient_checkpointing: bool = False
    sharding: str = one_of("fsdp2", SHARDINGS)  # several ranks: fsdp2 shards weights, grads, optimizer; ddp copies
    batch_wait_s: float = number(0.02, ge=0)  # policy server: generate once no new request came for this long
    generation_engine: str = one_of("auto", ("auto", *ENGINES))
    cuda_graphs: bool = True
    compile_decode: bool = True
    vllm_gpu_memory_utilization: float = number(0.5, gt=0, le=1)  # share of the GPU vLLM takes (weights, KV cache)
    vllm_max_num_seqs: int = number(256, ge=1)  # requests vLLM decodes together at most
    vllm_prefix_caching: bool = True
    vllm_sleep: bool = True
    vllm_enforce_eager: bool = False
    vllm_own_process: bool = False  # vLLM's engine core in a process of its own on the rank's GPU (weights: CUDA IPC)
    offload: str = one_of("none", OFFLOADS)  # trainer state on CPU: none, optimizer (while generating), all (FSDP2)
    memory_check: bool = True  # stop before the run starts when the memory plan does not fit the GPUs (false: warn)
    disk_check: bool = True  # stop before the run starts when the disk plan does not fit under the run (false: warn)

    def __post_init__(self) -> None:
        self._engine: Engine | None = None
        self._weights: GenerationWeights | None = None
        if self.generation_engine == "vllm":  # before any model loads: the extra and a GPU must be there
            try:
                require_vllm(self.resolved_device())
            except RuntimeError as exc:
                raise ConfigError(f"backend.generation_engine=vllm: {exc}") from exc

    def engine(self, max_model_len: int, dtype: torch.dtype | None = None, live_loads: bool = False) -> Engine:
        """One engine for the run (its cache, graphs or vLLM serve training and validation alike); `dtype`: the
        weights' in vLLM (None: the model's); `live_loads`: loads come with requests in flight (partial rollouts)."""
        if self._engine is None:
            self._engine = make_engine(
                self.generation_engine,
                self.resolved_device(),
                cuda_graphs=self.cuda_graphs,
                compile=self.compile_decode,
                vllm=VLLMSettings(
                    max_model_len=max_model_len,
                    gpu_memory_utilization=self.vllm_gpu_memory_utilization,
                    max_num_seqs=self.vllm_max_num_seqs,
                    prefix_caching=self.vllm_prefix_caching,
                    sleep=self.vllm_sleep,
                    enforce_eager=self.vllm_enforce_eager,
                    own_process=self.vllm_own_process,
                    dtype=dtype,
                    live_loads=live_loads,
                    device=self.resolved_device(),
                ),
            )
        return self._engine

    def memory_plan(self, model: Any, finetune: Any, algo: GRPO, ranks: int, capacity_gb: float) -> dict[str, Any]:
        """The memory plan of this run on GPUs of `capacity_gb` (backends/memory.py), with its words in `text`;
        raises ConfigError naming the keys to change when it does not fit (unless `memory_check=false`)."""
        full = finetune.peft_config() is None
        shape = Shape.of(
            model.architecture(), None if full else finetune.rank, None if full else finetune.target_modules
        )
        setting = Setting(
            full=full,
            ranks=ranks,
            sharded=ranks > 1 and self.sharding == "fsdp2",
            offload=self.offload,
            gradient_checkpointing=self.gradient_checkpointing,
            micro_batch_tokens=algo.per_rank(ranks)[0] * (algo.max_prompt_length + algo.max_response_length),
            engine=resolve_engine(self.generation_engine, "cuda"),
            engine_share=self.vllm_gpu_memory_utilization,
            engine_sleeps=self.vllm_sleep and not algo.overlapped,  # async: awake during the update
            snapshot=algo.overlapped,
            weight_bytes=model.compute_dtype("cuda").itemsize,
        )
        plan = plan_memory(shape, setting, capacity_gb)
        plan["text"] = explain(plan, setting)
        if not plan["fits"] and self.memory_check:
            raise ConfigError(f"{plan['text']}\n(backend.memory_check=false runs it anyway)")
        return plan

    def disk_plan(
        self, model: Any, finetune: Any, algo: GRPO, ranks: int, checkpoints: Path, warm_start: bool
    ) -> dict[str, Any]:
        """The disk plan of this run under `checkpoints` (backends/disk.py; `warm_start`: one is trained into the
        run), with its words in `text`; raises
        ConfigError naming the keys that shrink it when its peak does not fit the free space (unless
        `disk_check=false`)."""
        full = finetune.peft_config() is None
        shape = Shape.of(
            model.architecture(), None if full else finetune.rank, None if full else finetune.target_modules
        )
        device = "cuda" if self.resolved_device().startswith("cuda") else "cpu"
        setting = DiskSetting(
            full=full,
            ranks=ranks,
            sharded=ranks > 1 and self.sharding == "fsdp2",
            weight_bytes=model.compute_dtype(device).itemsize,
            keep=algo.keep_checkpoints,
            warm_start=warm_start,
            saves=saves_ahead(algo, checkpoints),
            existing=len(complete_checkpoints(checkpoints)),
        )
        plan = plan_disk(shape, setting)
        plan["text"] = check_plan(plan, checkpoints, setting, self.disk_check)
        return plan

    @property
    def needs(self) -> Needs:
        return Needs(packages=("trl",))

    def processes(self, nodes: int, gpus_per_node: int) -> int:
        """One rank a GPU on every node (one process a node on CPU): GRPO trains data-parallel across them."""
        return nodes * max(1, gpus_per_node)

    def check(self, setup: TrainSetup, processes: int) -> None:
        self.check_settings(processes, setup.algorithm)

    def plans(self, setup: TrainSetup, processes: int, gpu_memory_gb: float | None) -> dict[str, dict[str, Any]]:
        """The memory plan on GPUs of `gpu_memory_gb` (none on CPU, or where it is not known) and the disk plan
        under the run's checkpoints, which every rank checks each save against."""
        model, finetune, algo = setup.model, setup.finetune, setup.algorithm
        plans = {}
        if gpu_memory_gb is not None and self.device != "cpu":
            plans["memory_plan"] = self.memory_plan(model, finetune, algo, processes, gpu_memory_gb)
        here = setup.warmstart is not None and setup.warmstart.writes_into_run
        plans["disk_plan"] = self.disk_plan(model, finetune, algo, processes, setup.run.checkpoints, here)
        return plans

    def prepare(self, setup: TrainSetup) -> dict[str, Any]:
        """The run's tasks split (data, warm start, pool candidates) and TRL's GRPOConfig built from ours (TRL's
        own checks: batch and group sizes), as training does first."""
        tasks = run_tasks(setup)
        config = self.grpo_config(setup.algorithm, str(setup.run.path), setup.seed, "cpu")
        return {
            "train_tasks": len(tasks.train),
            "val_tasks": len(tasks.val),
            "test_tasks": len(tasks.test),
            "warmstart_tasks": len(tasks.warm),
            "generation_batch_size": config.generation_batch_size,
            "per_device_train_batch_size": config.per_device_train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
        }

    def check_settings(self, ranks: int, algo: GRPO) -> None:
        """What needs a GPU or several ranks, or rules out another setting, before anything starts (offload is never
        silently ignored)."""
        if algo.overlapped and self.offload != "none":
            raise ConfigError(f"algorithm.async_rollouts: the engine generates during the update, so the trainer's "
                              f"state stays on the GPU (backend.offload={self.offload}: set none)")  # fmt: skip
        if algo.overlapped and algo.is_correction == "none":
            raise ConfigError("algorithm.async_rollouts trains one step off-policy: it needs the importance-sampling "
                              "correction (algorithm.is_correction, e.g. token_truncate)")  # fmt: skip
        if self.offload == "all" and not (ranks > 1 and self.sharding == "fsdp2"):
            raise ConfigError(f"backend.offload=all: FSDP2 offloads, so it needs several ranks "
                              f"(resources.gpus_per_node > 1) and backend.sharding=fsdp2 (now {ranks} rank(s), "
                              f"{self.sharding})")  # fmt: skip
        if self.offload != "none" and not self.resolved_device().startswith("cuda"):
            raise ConfigError(f"backend.offload={self.offload}: on {self.resolved_device()} the trainer's state is in "
                              "CPU memory already (backend.offload=none)")  # fmt: skip

    def resolved_device(self) -> str:
        device = ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device
        if device == "cuda" and world_size() > 1:  # one GPU per rank
            device = f"cuda:{local_rank()}"
        return device

    def train(self, setup: TrainSetup) -> dict[str, Any]:
        """The run's phases over one context: prepare and warm start (`build_context`), the first validation (a
        resumed run: its resume point), the filtered pool (an arm that trains on one), the splits, then the arm
        (`arm_for`): it trains, validates and saves the final model."""
        ctx = build_context(self, setup)
        validate_start(ctx)
        ctx.results["arm"] = setup.algorithm.name
        if trains_on_pool(setup.algorithm):  # and is charged the pool's sampling, whichever run sampled it
            train_on_pool(ctx)
        if is_main():  # once the tasks the arm trains on are known
            phases = (ctx.tasks.warm, ctx.tasks.train, ctx.tasks.val, ctx.test_tasks)
            write_splits(setup.run.path / "splits.json", setup.data.split_seed, *phases, pool=ctx.results.get("pool"))
        return arm_for(setup.algorithm).run(ctx)

    def weights(self, device: str, dtype: torch.dtype, snapshot: bool = False) -> GenerationWeights:
        """What the engines generate from (the model, or its gathered copy in `dtype` when sharded or `snapshot`):
        one a run."""
        if self._weights is None:
            gathers = resolve_engine(self.generation_engine, device) == "vllm"  # into its own weights, as it loads
            self._weights = GenerationWeights(device, dtype, engine_gathers=gathers, snapshot=snapshot)
        self._weights.snapshot |= snapshot  # asked for by any caller (the pool pass may come first)
        return self._weights

    def policy_server(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, setup: TrainSetup
    ) -> PolicyServer:
        """A policy server for `model` on the run's one engine."""
        algo = setup.algorithm
        return PolicyServer(
            model,
            tokenizer,
            max_prompt_tokens=algo.max_prompt_length,
            max_response_tokens=algo.max_response_length,
            batch_wait_s=self.batch_wait_s,
            engine=self.engine(
                algo.max_prompt_length + algo.max_response_length,
                setup.model.compute_dtype(self.resolved_device()),
                live_loads=algo.partial_rollouts,
            ),
            chat_format=setup.model.chat_format(tokenizer),
        )

    def grpo_config(self, algo: GRPO, output_dir: str, seed: int, device: str) -> GRPOConfig:
        """TRL's settings for `algo` (also what bench/rollout_speed.py runs). With several ranks the step's batch is
        shared: each rank trains micro-batches of at most `algo.micro_batch_size` of its share, and FSDP2 shards
        the model across them (`sharding`)."""
        micro, accumulation = algo.per_rank(world_size())
        settings: dict[str, Any] = dict(
            output_dir=output_dir,
            seed=seed,
            learning_rate=algo.learning_rate,
            num_generations=algo.group_size,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
            generation_batch_size=algo.batch_size,
            max_completion_length=algo.max_response_length,
            temperature=algo.temperature,
            beta=algo.kl_coef,
            epsilon=algo.clip_ratio,
            epsilon_high=algo.clip_ratio_high,
            loss_type=algo.loss_type,
            num_train_epochs=algo.epochs,
            max_steps=algo.max_steps,
            max_grad_norm=algo.max_grad_norm,
            save_strategy="steps",
            save_steps=algo.save_every,
            save_total_limit=algo.keep_checkpoints,
            logging_steps=1,
            report_to=[],
            bf16=device.startswith("cuda"),
            lr_scheduler_type=algo.lr_schedule,
            warmup_steps=algo.lr_warmup_steps,
            gradient_checkpointing=self.gradient_checkpointing,
            use_cpu=device == "cpu",
            dataloader_num_workers=0,
            disable_tqdm=True,
            log_completions=False,
        )
        if started_by_launcher() and self.sharding == "fsdp2":  # a rank of a run of several processes
            settings |= fsdp_arguments(self.gradient_checkpointing, offload_all=self.offload == "all")
        return GRPOConfig(**settings)


def saves_ahead(algo: GRPO, checkpoints: Path) -> int | None:
    """Checkpoints this start writes: one every `save_every` steps and one at its last step (the Trainer's), from
    the step it resumes at; None where its last step is not known ahead (a budget, or epochs)."""
    if isinstance(algo, SFTControl):
        return 0  # the SFT arms write their final model only
    if algo.budgeted or algo.max_steps <= 0:
        return None
    done = max(complete_checkpoints(checkpoints), default=0)
    steps = range(done + 1, algo.max_steps + 1)
    return sum(1 for s in steps if s % algo.save_every == 0 or s == algo.max_steps)

"""The embedded backend: TRL's GRPOTrainer (+ PEFT), on CPU, one GPU or N ranks (`conf/backend/trl.yaml`).

    data -> [warm-start SFT] -> validate -> GRPOTrainer(rollout_func = agent on the policy server) -> validate

On several ranks (`resources.gpus_per_node`, `resources.nodes`: jobs/ranks.py starts them) GRPO trains
data-parallel: each rank runs its share of the step's rollouts on its own policy server and device, and the weights,
gradients and optimizer state are sharded across ranks with FSDP2 (`sharding=fsdp2`, backends/trl/fsdp.py; the
engines generate from a full copy gathered before each rollout phase, inference/weights.py) or replicated (`ddp`).

Checkpoints go to `<run>/checkpoints/checkpoint-<step>` (TRL's own, resumable); a run started again in the same
directory resumes from the latest one, and `metrics.jsonl` keeps each step once. A stop signal during GRPO ends the
current step, writes a checkpoint there and stops (`foundation.interrupt`).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from signal import Signals
from typing import Any

import torch
from accelerate import PartialState
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from trl import GRPOConfig

from backends.algorithm import GRPO, RFT, SFTControl
from backends.compute import ComputeCount
from backends.disk import DiskFull, DiskSetting, check_before_save, check_plan, plan_disk
from backends.memory import DeviceMemory, Setting, Shape, explain, plan_memory
from backends.progress import show_progress
from backends.protocol import Needs
from backends.setup import TrainSetup
from backends.sft import SFTWarmstart, agreed, run_tasks, supervised, warm_start, weights_digest
from backends.trl.callbacks import ControlLog, StepLog, StopAtStepEnd, per_rank
from backends.trl.clock import Clock
from backends.trl.fsdp import OFFLOADS, SHARDINGS, OptimizerOffload, fsdp_arguments
from backends.trl.pool import filtered_pool, pool_key, sample_pool
from backends.trl.rollouts import AgentRollouts, task_prompt
from backends.trl.trainer import AgentGRPOTrainer
from backends.trl.validation import Validation
from data.splits import KIND, kind_distance
from foundation.errors import ConfigError
from foundation.interrupt import Interrupted, checkpoint_at_step_end, stop_requested
from foundation.ranks import is_main, local_rank, started_by_launcher, world_size
from foundation.run_dir import complete_checkpoints, last_complete_checkpoint
from foundation.schema import number, one_of
from inference import ENGINES, Engine, VLLMSettings, make_engine, require_vllm, resolve_engine
from inference.policy_server import PolicyServer
from inference.weights import GenerationWeights, is_sharded


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
    vllm_own_process: bool = False  # vLLM's engine core in a process of its own (weights over CUDA IPC); one rank
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

    def engine(self, max_model_len: int, dtype: torch.dtype | None = None) -> Engine:
        """One engine for the run (its cache, graphs or vLLM serve training and validation alike); `dtype`: the
        weights' in vLLM (None: the model's)."""
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
        if self.vllm_own_process and ranks > 1:
            raise ConfigError(f"backend.vllm_own_process: one rank only for now (vLLM's engine process would take "
                              f"the first GPU on every rank; now {ranks} ranks): set it false")  # fmt: skip
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
        run, algo = setup.run, setup.algorithm
        device = self.resolved_device()
        # Several ranks (jobs/ranks.py): PyTorch's process group first; rank 0 writes the shared cache (data,
        # the built model) before the others read it; it alone writes the run directory and validates.
        ranks = PartialState(cpu=not device.startswith("cuda")) if world_size() > 1 else None  # gloo on CPU
        first = ranks.main_process_first() if ranks is not None else contextlib.nullcontext()
        random.seed(setup.seed)
        torch.manual_seed(setup.seed)
        warm = isinstance(setup.warmstart, SFTWarmstart)
        with first:
            tasks = run_tasks(setup)
        warm_tasks, train_tasks, val_tasks, demos = tasks.warm, tasks.train, tasks.val, tasks.demos
        source = tasks.source
        test_tasks = tasks.test if algo.test_at_end else []
        metric = setup.data.metric()
        compute_dtype = setup.model.compute_dtype(device)  # the model's as loaded (FSDP2 keeps fp32 masters beside)
        resume_from = last_complete_checkpoint(run.checkpoints)
        tokenizer = setup.model.load_tokenizer(setup.warmstart.path if warm and setup.warmstart.path else source)
        results: dict[str, Any] = {
            "device": device,
            "world_size": world_size(),
            "train_tasks": len(train_tasks),
            "warmstart_tasks": len(warm_tasks),
            "val_tasks": len(val_tasks),
            "test_tasks": len(test_tasks),
        }

        # what each GPU has in use from here on, per phase (start: loading, the first validation; rollout; update)
        memory = DeviceMemory(device).start() if device.startswith("cuda") else None
        # backend.offload=optimizer: the optimizer's state leaves the GPU whenever the engine is awake (rollouts, and
        # validations during GRPO: `Validation.during`)
        offload = OptimizerOffload() if self.offload == "optimizer" and device.startswith("cuda") else None
        # algorithm.async_rollouts: the engine generates while the trainer updates, from a copy of the weights
        overlap = algo.overlapped
        validation = Validation(
            setup,
            val_tasks,
            test_tasks,
            metric,
            generation_copy=self.weights(device, compute_dtype, overlap).for_generation,
            server=lambda policy: self._server(policy, tokenizer, setup),
            samples_kept=self.samples_per_validation,
            results=results,
            offload=offload,
        )

        max_length = algo.max_prompt_length + algo.max_response_length
        use_bf16 = device.startswith("cuda")
        begin = warm_start(
            setup.warmstart,
            setup.model,
            run,
            setup.seed,
            tasks,
            tokenizer,
            device,
            max_length=max_length,
            use_bf16=use_bf16,
            resuming=resume_from is not None,
        )
        if warm:
            results["sft"] = begin.record
        model = (
            begin.model if begin.model is not None else setup.model.load_model(str(begin.checkpoint or source), device)
        )
        compute = ComputeCount(
            model.num_parameters(), 4 if setup.finetune.peft_config() is not None else 6, ranks=world_size()
        )
        resumed_at = int(Path(resume_from).name.split("-")[-1]) if resume_from is not None else 0  # its step
        if resume_from is None:
            initial = validation(model, "after_sft" if warm else "initial")
            if is_main():
                run.metrics_file.unlink(missing_ok=True)
                run.log(0, initial)
        else:
            if is_main():
                run.drop_metrics_after(resumed_at)
            results["resumed_from"] = Path(resume_from).name
        results["arm"] = algo.name
        if trains_on_pool(algo):  # and is charged the pool's sampling (`_pool`), whichever run sampled it
            start = weights_digest(begin.checkpoint) if begin.checkpoint else f"untrained {source}"
            train_tasks, results["pool"] = self._pool(
                model, tokenizer, setup, train_tasks, start, metric, device, compute
            )
            results["train_tasks"] = len(train_tasks)
        if is_main():  # once the tasks RL trains on are known
            phases = (warm_tasks, train_tasks, val_tasks, test_tasks)
            write_splits(run.path / "splits.json", setup.data.split_seed, *phases, pool=results.get("pool"))
        if isinstance(algo, SFTControl):  # the warm start's demonstrations, or those of the tasks GRPO trains on
            if algo.sft_demos == "rl" and warm_tasks is not train_tasks:
                demos = setup.warmstart.demonstrations(setup.agent, train_tasks, setup.seed)
            results["sft_control_demos"] = {"tasks": algo.sft_demos, "demonstrations": len(demos)}
            if memory is not None:
                memory.stop()
            return results | self._control(model, tokenizer, demos, setup, validation, use_bf16, max_length, compute)

        trainer, rollout_func, results["grpo"] = self._grpo(
            model,
            tokenizer,
            setup,
            train_tasks,
            validation,
            compute,
            memory=memory,
            offload=offload,
            resume_from=resume_from,
            resumed_at=resumed_at,
            device=device,
            compute_dtype=compute_dtype,
        )
        if started_by_launcher():  # how the ranks held the model, read off it (not the setting)
            results["sharding"] = "fsdp2" if is_sharded(trainer.model) else "ddp"
        # every rank ran its share of the rollouts (collectives)
        results["rollouts_per_rank"] = per_rank(rollout_func.rollouts_run)
        if memory is not None:  # what each GPU had in use (every process on it), not torch's counter
            memory.stop()
            measured = per_rank(memory.summary())
            results["peak_gpu_memory_gb_per_rank"] = [m["peak_gb"] for m in measured]
            results["gpu_memory_per_rank"] = measured
        run.phase = "saving the final model"
        final_bytes = None if setup.disk_plan is None else setup.disk_plan["final_bytes"]
        save_final(trainer, run.checkpoints / "final", compute_dtype, final_bytes)
        if is_main():
            tokenizer.save_pretrained(str(run.checkpoints / "final"))
        return results

    def _grpo(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        setup: TrainSetup,
        train_tasks: list[dict[str, Any]],
        validation: Validation,
        compute: ComputeCount,
        *,
        memory: DeviceMemory | None,
        offload: OptimizerOffload | None,
        resume_from: str | None,
        resumed_at: int,
        device: str,
        compute_dtype: torch.dtype,
    ) -> tuple[AgentGRPOTrainer, AgentRollouts, dict[str, Any]]:
        """The GRPO phase (or RFT's): the agent's rollouts on the run's policy server train the model with TRL's GRPO
        trainer (`AgentGRPOTrainer`), from `resume_from` (its step `resumed_at`) if the run resumes; a stop signal
        ends it at a step's end with a checkpoint (`Interrupted`). Returns the trainer, its rollout function and the
        summary's `grpo`."""
        run, algo = setup.run, setup.algorithm
        overlap = algo.overlapped
        server = self._server(model, tokenizer, setup)
        rollout_func = AgentRollouts(
            setup.agent,
            setup.reward,
            server,
            algo.sampling(algo.temperature),
            algo.max_response_length,
            algo.reward_timeout_s,
            self.weights(device, compute_dtype, overlap),
            offload=offload,
            memory=memory,
            asynchronous=overlap,
        )
        train_s = 0.0
        if resume_from is not None:  # the budgets count the training before the restart
            train_s = max((m.get("train/elapsed_s") or 0.0 for m in run.metrics()), default=0.0)
            compute.restore(run.metrics())
        clock = Clock(algo, algo.val_every, compute, train_s)
        trainer = AgentGRPOTrainer(
            model=model,
            reward_funcs=[_passthrough_reward(setup.reward.name)],
            args=self.grpo_config(algo, str(run.checkpoints), setup.seed, device),
            train_dataset=Dataset.from_list([{"prompt": task_prompt(t)} for t in train_tasks]),
            processing_class=tokenizer,
            peft_config=setup.finetune.peft_config(),
            rollout_func=rollout_func,
            is_correction=algo.is_correction,
            is_cap=algo.is_cap,
            accept_reward=algo.accept_reward if isinstance(algo, RFT) else None,
            lookahead=overlap,  # the next step's prompts, for the rollouts generated during this step's update
            checkpoint_bytes=None if setup.disk_plan is None else setup.disk_plan["checkpoint_bytes_per_rank"],
            budget_spent=clock.spent,  # a resumed run spent before its restart trains no step
        )
        # the callbacks join once the trainer exists (in the order they run): the step log reads the trainer's phase
        # times, and validates between its steps (`Validation.during`)
        step_log = StepLog(run, clock, rollout_func, validation.during(trainer), trainer)
        trainer.add_callback(step_log)
        trainer.add_callback(StopAtStepEnd())
        show_progress(trainer, "GRPO")
        start = time.monotonic()
        run.phase = "GRPO"
        with checkpoint_at_step_end():
            try:
                trainer.train(resume_from_checkpoint=resume_from)
            except BaseException:
                rollout_func.close(wait=False)  # a background batch ends with the process (its thread is a daemon)
                raise
        discarded = rollout_func.close()  # a batch read ahead for a step that never came (a time or FLOPs budget)
        if (signal_name := stop_requested()) is not None:
            step = trainer.state.global_step
            raise Interrupted(
                f"{signal_name} during GRPO: stopped after step {step} with checkpoint-{step}", Signals[signal_name]
            )
        if resume_from is not None and trainer.state.global_step == resumed_at:  # resumed after its last step
            step_log.validate(trainer.model, "final")  # for the summary; metrics.jsonl has it on that step's line
        wall_s = time.monotonic() - start
        record = {
            "steps": trainer.state.global_step,
            "async_rollouts": overlap,
            "prefetch_missed": rollout_func.missed,  # async: batches read ahead that no step asked for
            "discarded_in_flight": discarded,
            "wall_s": wall_s,
            "train_s": step_log.clock.train_s,
            "compute": compute.summary(wall_s),
        }
        return trainer, rollout_func, record

    def _control(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        demos: list[Any],
        setup: TrainSetup,
        validation: Any,
        use_bf16: bool,
        max_length: int,
        compute: ComputeCount,
    ) -> dict[str, Any]:
        """The control arm: the warm start's SFT goes on, on the same demonstrations, for the time budget (or
        `max_steps`), validated every `sft_val_every` SFT steps and at the end like GRPO. Not resumable: a run started
        again begins at the warm start."""
        run, algo = setup.run, setup.algorithm
        assert isinstance(algo, SFTControl)
        clock = Clock(algo, algo.sft_val_every, compute)
        trainer = supervised(
            model,
            tokenizer,
            demos,
            output_dir=run.checkpoints,
            steps=algo.max_steps if algo.max_steps > 0 else _UNBOUNDED_STEPS,
            learning_rate=algo.sft_learning_rate,
            batch_size=algo.sft_batch_size,
            schedule="constant",
            warmup_steps=0,
            seed=setup.seed,
            use_bf16=use_bf16,
            max_length=max_length,
            callbacks=[],
        )
        # its log joins once the trainer exists: TRL's count of tokens, every rank's non-padding ones
        trainer.add_callback(ControlLog(run, clock, validation, lambda: trainer._total_train_tokens))
        show_progress(trainer, "SFT control")
        run.phase = "SFT control"
        start = time.monotonic()
        trainer.train()
        trainer.save_model(str(run.checkpoints / "final"))
        if is_main():
            tokenizer.save_pretrained(str(run.checkpoints / "final"))
        steps, wall_s = trainer.state.global_step, time.monotonic() - start
        return {
            "sft_control": {
                "steps": steps,
                "wall_s": wall_s,
                "train_s": clock.train_s,
                "compute": compute.summary(wall_s),
            }
        }

    def _pool(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        setup: TrainSetup,
        tasks: list[dict[str, Any]],
        start: str,
        metric: Any,
        device: str,
        compute: ComputeCount,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The RL tasks the starting policy solves some but not all of `algorithm.pool_samples` times (backends/trl/
        pool.py): worked out once per starting weights and settings, kept beside the shared warm starts (or in the
        run's checkpoints without one), read by every later run; and the summary's `pool`. What sampling the pool
        cost (at `compute`'s parameters and ranks, when this run samples it) is charged to `compute`, whichever run
        sampled it: this arm trains on the pool."""
        algo = setup.algorithm
        sampling = algo.sampling(algo.temperature)
        settings = {
            "samples": algo.pool_samples,
            "sampling": sampling,
            "lengths": [algo.max_prompt_length, algo.max_response_length],
            "agent": repr(setup.agent),
            "metric": repr(metric),
        }
        pools = Path(setup.warmstart.cache_dir) / "pools" if setup.warmstart is not None else setup.run.checkpoints
        path = pools / f"pool-{pool_key(start, tasks, settings)}.json"
        server = None
        if agreed(not path.is_file()):  # every rank loads (a sharded model's weights are gathered by all)
            policy = self.weights(device, setup.model.compute_dtype(device)).for_generation(model)
            server = self._server(policy, tokenizer, setup)
            server.load(policy)
            if not is_main():
                server.engine.sleep()

        def sample() -> dict[str, Any]:
            assert server is not None
            setup.run.phase = f"sampling the pool ({algo.pool_samples} a task)"
            load = lambda: server.load(server.model)  # noqa: E731  (the engine sleeps after each chunk)
            args = (setup.agent, tasks, server, load, metric, sampling, algo.pool_samples, algo.reward_timeout_s)
            return sample_pool(*args, parameters=compute.parameters, ranks=compute.ranks)

        if is_main():
            pool, record = filtered_pool(tasks, path, sample, exclusive=world_size() == 1)
        agreed(True)  # the other ranks wait here for rank 0's file
        if not is_main():
            pool, record = filtered_pool(tasks, path, sample, exclusive=False)
        compute.charge_pool(record["flops"], record["gpu_s"])
        return pool, record | {"charged_flops": compute.pool_flops, "charged_gpu_s": compute.pool_gpu_s}

    def weights(self, device: str, dtype: torch.dtype, snapshot: bool = False) -> GenerationWeights:
        """What the engines generate from (the model, or its gathered copy in `dtype` when sharded or `snapshot`):
        one a run."""
        if self._weights is None:
            gathers = resolve_engine(self.generation_engine, device) == "vllm"  # into its own weights, as it loads
            self._weights = GenerationWeights(device, dtype, engine_gathers=gathers, snapshot=snapshot)
        self._weights.snapshot |= snapshot  # asked for by any caller (the pool pass may come first)
        return self._weights

    def _server(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, setup: TrainSetup) -> PolicyServer:
        algo = setup.algorithm
        return PolicyServer(
            model,
            tokenizer,
            max_prompt_tokens=algo.max_prompt_length,
            max_response_tokens=algo.max_response_length,
            batch_wait_s=self.batch_wait_s,
            engine=self.engine(
                algo.max_prompt_length + algo.max_response_length, setup.model.compute_dtype(self.resolved_device())
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


_UNBOUNDED_STEPS = 10**9  # the control's steps when its time budget ends it


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


def trains_on_pool(algo: GRPO) -> bool:
    """Whether the arm's training data comes from the filtered pool (`algorithm.pool_samples`): GRPO's and RFT's tasks,
    gold SFT's demonstrations of them (`sft_demos=rl`); not SFT continued on the warm start's own demonstrations."""
    return algo.pool_samples is not None and not (isinstance(algo, SFTControl) and algo.sft_demos == "warmstart")


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


def save_final(trainer: AgentGRPOTrainer, path: Path, dtype: torch.dtype, needed: int | None = None) -> None:
    """The trained model as a Hugging Face checkpoint (safetensors shards; a LoRA run: its adapter), written by rank 0
    into `<path>.partial` and renamed to `path` once complete (a run's earlier final model, if any, is replaced only
    then): refused before a byte is written when the disk cannot hold `needed` bytes, and on a failure midway its
    partial files removed, the last checkpoint untouched. Sharded (FSDP2): every rank takes part in gathering the
    full weights to rank 0's CPU first; the fp32 master weights are written in `dtype`, the model's as loaded, as an
    unsharded run writes them. Every rank returns only once rank 0 has written it: a rank whose part of the gather
    was still queued on its GPU when it went on to exit left rank 0 waiting in the gather forever (seen on 2 H100s,
    3 runs in 5)."""
    staging = path.with_name(path.name + ".partial")
    if is_main():
        shutil.rmtree(staging, ignore_errors=True)  # a crash's leftover
        if needed is not None:
            previous = last_complete_checkpoint(path.parent)
            check_before_save(path, needed, previous and Path(previous).name)
    sharded = is_sharded(trainer.model)
    try:
        if not sharded:
            trainer.save_model(str(staging))  # rank 0 writes
        else:
            state_dict = trainer.accelerator.get_state_dict(trainer.model)  # a collective
            if is_main():
                state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
                trainer.accelerator.unwrap_model(trainer.model).save_pretrained(str(staging), state_dict=state_dict)
    except (OSError, RuntimeError) as exc:
        if is_main():
            shutil.rmtree(staging, ignore_errors=True)
        raise DiskFull(
            f"saving the final model failed ({exc}): its partial files removed; the last checkpoint is intact, and "
            "running the same command again writes the final model from it"
        ) from exc
    if is_main():
        shutil.rmtree(path, ignore_errors=True)
        staging.rename(path)
    if sharded:
        trainer.accelerator.wait_for_everyone()  # after the gather and the rename: done on every rank when it returns


def _passthrough_reward(name: str) -> Any:
    """TRL reward function returning the reward the rollout already computed (named after the reward, for logs)."""

    def reward(
        prompts: list[Any], completions: list[Any], rollout_reward: list[float | None], **_: Any
    ) -> list[float | None]:
        return list(rollout_reward)  # None: missing, which TRL leaves out of the group's baseline

    reward.__name__ = name
    return reward

"""The arms of backend=trl: what trains the model from the run's context (backends/trl/context.py), each owning its
trainer and its callback, and writing the final model.

- `GRPOArm`: GRPO, and RFT (`algorithm=rft`: the same trainer keeping the rollouts at `accept_reward` or above):
  the agent's rollouts on the run's policy server (`AgentRollouts`) train the model with TRL's GRPO trainer
  (`AgentGRPOTrainer`), resumable from the run's checkpoints;
- `SFTArm`: the control arms (`algorithm=sft_control`): the warm start's SFT goes on instead of GRPO.

`arm_for` is the one place an algorithm picks its arm.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from signal import Signals
from typing import Any, Protocol

import torch
from datasets import Dataset

from backends.algorithm import GRPO, RFT, SFTControl
from backends.disk import DiskFull, check_before_save
from backends.progress import show_progress
from backends.sft import supervised
from backends.trl.callbacks import ControlLog, StepLog, StopAtStepEnd, per_rank
from backends.trl.clock import Clock
from backends.trl.context import RunContext
from backends.trl.rollouts import AgentRollouts, task_prompt
from backends.trl.trainer import AgentGRPOTrainer, read_carry_state
from foundation.interrupt import Interrupted, checkpoint_at_step_end, stop_requested
from foundation.ranks import is_main, started_by_launcher
from foundation.run_dir import last_complete_checkpoint
from inference.weights import is_sharded

_UNBOUNDED_STEPS = 10**9  # the control's steps when its budget ends it


class Arm(Protocol):
    """A strategy that trains a run's model."""

    def run(self, ctx: RunContext) -> dict[str, Any]:
        """Train from `ctx`, validate along the way and at the end, save the final model: the run's results."""
        ...


def arm_for(algo: GRPO) -> Arm:
    """The arm that trains `algo`."""
    if isinstance(algo, SFTControl):
        return SFTArm()
    return GRPOArm(accept_reward=algo.accept_reward if isinstance(algo, RFT) else None)


def fills_a_step(ctx: RunContext) -> None:
    """Raises unless the training tasks fill one step: with fewer than `tasks_per_step` the trainer's data loader has no
    batch, and the run would end "completed" without a step."""
    algo, tasks = ctx.algo, len(ctx.tasks.train)
    if tasks >= algo.tasks_per_step:
        return
    pool = ctx.results.get("pool")
    whose = f"the pool kept {tasks} of {pool['tasks']} tasks" if pool else f"{tasks} training tasks"
    most, batch = max(tasks, 1), max(tasks, 1) * algo.group_size
    fits = f"algorithm.tasks_per_step={most}"
    if batch % algo.micro_batch_size:  # what the config check would refuse next
        fits += f" algorithm.micro_batch_size={batch}"
    raise RuntimeError(
        f"{whose}, fewer than a step's algorithm.tasks_per_step={algo.tasks_per_step}: no step can be filled, so "
        f"nothing would train. Set {fits} (or fewer tasks a step), or give it more tasks"
        + (" (algorithm.pool_samples=null: every task)" if pool else "")
    )


class GRPOArm:
    """GRPO's phase (or RFT's, with `accept_reward`): from the checkpoint the run resumes from, if any; a stop signal
    ends it at a step's end with a checkpoint (`Interrupted`). Then what each rank did, and the final model."""

    def __init__(self, accept_reward: float | None = None) -> None:
        self.accept_reward = accept_reward  # RFT: a rollout with at least this reward is a demonstration

    def run(self, ctx: RunContext) -> dict[str, Any]:
        fills_a_step(ctx)
        trainer, step_log = self._trainer(ctx)
        ctx.results["grpo"] = self._train(ctx, trainer, step_log)
        if started_by_launcher():  # how the ranks held the model, read off it (not the setting)
            ctx.results["sharding"] = "fsdp2" if is_sharded(trainer.model) else "ddp"
        # every rank ran its share of the rollouts (collectives)
        ctx.results["rollouts_per_rank"] = per_rank(trainer.rollout_func.rollouts_run)
        if ctx.memory is not None:  # what each GPU had in use (every process on it), not torch's counter
            ctx.memory.stop()
            measured = per_rank(ctx.memory.summary())
            ctx.results["peak_gpu_memory_gb_per_rank"] = [m["peak_gb"] for m in measured]
            ctx.results["gpu_memory_per_rank"] = measured
        ctx.run.phase = "saving the final model"
        final_bytes = None if ctx.setup.disk_plan is None else ctx.setup.disk_plan["final_bytes"]
        ctx.results["final_model"] = save_final(trainer, ctx.run.checkpoints / "final", ctx.compute_dtype, final_bytes)
        if is_main():
            ctx.tokenizer.save_pretrained(str(ctx.run.checkpoints / "final"))
        return ctx.results

    def _trainer(self, ctx: RunContext) -> tuple[AgentGRPOTrainer, StepLog]:
        """The trainer with its rollout function, and its step log, whose clock goes on from a resumed run's counts.
        The callbacks join once the trainer exists (in the order they run): the step log reads the trainer's phase
        times, and validates between its steps (`Validation.during`)."""
        setup, run, algo = ctx.setup, ctx.run, ctx.algo
        overlap = algo.overlapped
        rollouts = AgentRollouts(
            setup.agent,
            setup.reward,
            ctx.backend.policy_server(ctx.model, ctx.tokenizer, setup),
            algo.sampling(algo.temperature),
            algo.max_response_length,
            algo.reward_timeout_s,
            ctx.backend.weights(ctx.device, ctx.compute_dtype, overlap),
            offload=ctx.offload,
            memory=ctx.memory,
            asynchronous=overlap,
            partial=algo.partial_rollouts,
            max_staleness=algo.max_staleness,
            carry_over=algo.carry_over,
            group_size=algo.group_size,
            read_ahead=algo.read_ahead_steps,
        )
        train_s = 0.0
        if ctx.resume_from is not None:  # the budgets count the training before the restart
            train_s = max((m.get("train/elapsed_s") or 0.0 for m in run.metrics()), default=0.0)
            ctx.compute.restore(run.metrics())
        clock = Clock(algo, algo.val_every, ctx.compute, train_s)
        trainer = AgentGRPOTrainer(
            model=ctx.model,
            reward_funcs=[passthrough_reward(setup.reward.name)],
            args=ctx.backend.grpo_config(algo, str(run.checkpoints), setup.seed, ctx.device),
            train_dataset=Dataset.from_list([{"prompt": task_prompt(t)} for t in ctx.tasks.train]),
            processing_class=ctx.tokenizer,
            peft_config=setup.finetune.peft_config(),
            rollout_func=rollouts,
            is_correction=algo.is_correction,
            is_cap=algo.is_cap,
            accept_reward=self.accept_reward,
            lookahead=algo.steps_read_ahead,  # the prompts of the steps generating ahead
            checkpoint_bytes=None if setup.disk_plan is None else setup.disk_plan["checkpoint_bytes_per_rank"],
            budget_spent=clock.spent,  # a resumed run spent before its restart trains no step
            take_rows=rollouts.take if algo.carry_over else None,
            carry_state=rollouts.carry_state if algo.carry_over else None,
        )
        if algo.carry_over and ctx.resume_from is not None and (state := read_carry_state(ctx.resume_from)):
            rollouts.resume(state)  # the groups in flight at the checkpoint
        step_log = StepLog(run, clock, rollouts, ctx.validation.during(trainer), trainer)
        trainer.add_callback(step_log)
        trainer.add_callback(StopAtStepEnd())
        show_progress(trainer, "GRPO")
        return trainer, step_log

    def _train(self, ctx: RunContext, trainer: AgentGRPOTrainer, step_log: StepLog) -> dict[str, Any]:
        """Training, to its end or a stop signal's; the summary's `grpo`."""
        run, rollouts = ctx.run, step_log.rollouts
        start = time.monotonic()
        run.phase = "GRPO"
        with checkpoint_at_step_end():
            try:
                trainer.train(resume_from_checkpoint=ctx.resume_from)
            except BaseException:
                rollouts.close(wait=False)  # a batch in flight stops at its next await; a generate call ends with it
                raise
        discarded = rollouts.close()  # a batch read ahead for a step that never came (a time or FLOPs budget)
        if (signal_name := stop_requested()) is not None:
            step = trainer.state.global_step
            raise Interrupted(
                f"{signal_name} during GRPO: stopped after step {step} with checkpoint-{step}", Signals[signal_name]
            )
        if ctx.resume_from is not None and trainer.state.global_step == ctx.resumed_at:  # resumed after its last step
            step_log.validate(trainer.model, "final")  # for the summary; metrics.jsonl has it on that step's line
        wall_s = time.monotonic() - start
        return {
            "steps": trainer.state.global_step,
            "async_rollouts": ctx.algo.overlapped,
            "partial_rollouts": ctx.algo.partial_rollouts,
            "prefetch_missed": rollouts.missed,  # async: batches read ahead that no step asked for
            "carry_over": ctx.algo.carry_over,
            "groups_dropped": rollouts.dropped,  # carry-over: groups read ahead that no step of this start took
            "discarded_in_flight": discarded,
            "wall_s": wall_s,
            "train_s": step_log.clock.train_s,
            "compute": ctx.compute.summary(wall_s),
        }


class SFTArm:
    """The control arm: the warm start's SFT goes on, on its demonstrations or on those of the tasks GRPO trains on
    (`sft_demos`), for the time, FLOPs or GPU-seconds budget (or `max_steps`), validated at its clock's cadence
    (`sft_val_every` SFT steps, or `val_points`) and at the end like GRPO. Not resumable: a run started again begins
    at the warm start."""

    def run(self, ctx: RunContext) -> dict[str, Any]:
        setup, run, algo = ctx.setup, ctx.run, ctx.algo
        assert isinstance(algo, SFTControl)
        demos = ctx.tasks.demos
        if algo.sft_demos == "rl" and ctx.tasks.warm is not ctx.tasks.train:  # of the tasks GRPO trains on
            demos = setup.warmstart.demonstrations(setup.agent, ctx.tasks.train, setup.seed)
        ctx.results["sft_control_demos"] = {"tasks": algo.sft_demos, "demonstrations": len(demos)}
        if ctx.memory is not None:
            ctx.memory.stop()
        clock = Clock(algo, algo.sft_val_every, ctx.compute)
        trainer = supervised(
            ctx.model,
            ctx.tokenizer,
            demos,
            output_dir=run.checkpoints,
            steps=algo.max_steps if algo.max_steps > 0 else _UNBOUNDED_STEPS,
            learning_rate=algo.sft_learning_rate,
            batch_size=algo.sft_batch_size,
            schedule="constant",
            warmup_steps=0,
            seed=setup.seed,
            use_bf16=ctx.use_bf16,
            max_length=ctx.max_length,
            callbacks=[],
        )
        # its log joins once the trainer exists: TRL's count of tokens, every rank's non-padding ones
        trainer.add_callback(ControlLog(run, clock, ctx.validation, lambda: trainer._total_train_tokens))
        show_progress(trainer, "SFT control")
        run.phase = "SFT control"
        start = time.monotonic()
        trainer.train()
        trainer.save_model(str(run.checkpoints / "final"))
        if is_main():
            ctx.tokenizer.save_pretrained(str(run.checkpoints / "final"))
        steps, wall_s = trainer.state.global_step, time.monotonic() - start
        return ctx.results | {
            "sft_control": {
                "steps": steps,
                "wall_s": wall_s,
                "train_s": clock.train_s,
                "compute": ctx.compute.summary(wall_s),
            }
        }


def passthrough_reward(name: str) -> Any:
    """TRL reward function returning the reward the rollout already computed (named after the reward, for logs)."""

    def reward(
        prompts: list[Any], completions: list[Any], rollout_reward: list[float | None], **_: Any
    ) -> list[float | None]:
        return list(rollout_reward)  # None: missing, which TRL leaves out of the group's baseline

    reward.__name__ = name
    return reward


def save_final(trainer: AgentGRPOTrainer, path: Path, dtype: torch.dtype, needed: int | None = None) -> str:
    """The trained model as a Hugging Face checkpoint (safetensors shards; a LoRA run: its adapter), written by rank 0
    into `<path>.partial` and renamed to `path` once complete (a run's earlier final model, if any, is replaced only
    then): refused before a byte is written when the disk cannot hold `needed` bytes, and on a failure midway its
    partial files removed, the last checkpoint untouched. Unsharded, where the last step's checkpoint already holds
    the weights, the final model is hard links to its files (`linked_final`): no second copy on disk. Sharded
    (FSDP2): every rank takes part in gathering the
    full weights to rank 0's CPU first; the fp32 master weights are written in `dtype`, the model's as loaded, as an
    unsharded run writes them. Every rank returns only once rank 0 has written it: a rank whose part of the gather
    was still queued on its GPU when it went on to exit left rank 0 waiting in the gather forever (seen on 2 H100s,
    3 runs in 5). Returns how it was made: `linked to checkpoint-<step>` or `written`."""
    staging = path.with_name(path.name + ".partial")
    sharded = is_sharded(trainer.model)
    if is_main():
        shutil.rmtree(staging, ignore_errors=True)  # a crash's leftover
        last = None if sharded else path.parent / f"checkpoint-{trainer.state.global_step}"
        if last is not None and linked_final(last, staging):
            shutil.rmtree(path, ignore_errors=True)
            staging.rename(path)
            return f"linked to {last.name}"
        if needed is not None:
            previous = last_complete_checkpoint(path.parent)
            check_before_save(path, needed, previous and Path(previous).name)
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
    return "written"


# what `save_model` writes beside the weights (`*.safetensors`, a sharded set's index): the final model's files
_MODEL_FILES = {"config.json", "generation_config.json", "adapter_config.json", "training_args.bin"}


def linked_final(checkpoint: Path, staging: Path) -> bool:
    """`staging` as hard links to the weights and model files of `checkpoint`, the Trainer's save at the final step
    (the same bytes `save_model` would write: nothing trains after it): True when made. False, with nothing left
    behind, where there is no complete checkpoint at that step, it holds no safetensors weights (FSDP2's sharded
    state), or the file system cannot link."""
    if not (checkpoint / "trainer_state.json").is_file():
        return False
    files = [
        f
        for f in checkpoint.iterdir()
        if f.is_file() and (f.name in _MODEL_FILES or f.name.endswith((".safetensors", ".safetensors.index.json")))
    ]
    if not any(f.name.endswith(".safetensors") for f in files):
        return False
    try:
        staging.mkdir(parents=True)
        for f in files:
            os.link(f, staging / f.name)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return False
    return True

"""TRL's GRPOTrainer with the sampler's log-probs used: truncated importance sampling for the engine/trainer mismatch.

TRL corrects the engine/trainer gap only when it runs vLLM itself (`vllm_importance_sampling_*`); here the rollout
function brings the sampler's log-probs, so this subclass applies the same correction (`backends/importance.py`).

The weight multiplies each token's policy-gradient term. It is folded into the advantages, which TRL accepts per
token (shape (B, T)); since w >= 0, -min(r A w, clip(r) A w) = w * -min(r A, clip(r) A): the same as TRL's own
`per_token_loss * importance_sampling_ratio`. Logged per step: `sampling/logp_diff/{mean,max}` (|delta log p| over
model tokens), `sampling/is_ratio/mean` (before truncation) and `sampling/is_ratio/clipped_frac`.

The trainer's log-probs are the loss's own forward, detached (each batch trains once: TRL's `num_iterations` 1, one
generation per optimizer step, so the weights that score a micro-batch are those its loss sees): the weights are
computed there, before TRL reads the advantages, and no separate scoring pass runs over the batch.

Micro-batches of like lengths: each micro-batch is cut to its longest row, so its forward and backward run over its
own rows' length, not the batch's longest (the columns cut are padding, which every loss type masks; dr_grpo divides
by the configured length, not the tensor's). For the loss types whose gradient does not depend on which rows share a
micro-batch (dapo: over the batch's tokens; grpo and dr_grpo: per row, micro-batches of equal size) the step's batch
is also ordered by completion length (longest first) instead of shuffled before it is split: TRL shuffles so that a
batch spread over several optimizer steps gives each a fair sample, and here one batch is one optimizer step. bnpo
divides each micro-batch by its own token count, so its batch is shuffled as TRL does. TRL's per-micro-batch means
(`entropy`, `kl`), averaged over micro-batches, then weigh short rows more than a shuffled split would.

LoRA under bf16 autocast: PEFT casts each adapter's input to the adapter's dtype (fp32: PEFT keeps adapters in fp32
beside a bf16 model) and autocast casts it back to bf16 for the adapter's product, two copies of every adapted
layer's input in each forward, and of their gradients in the backward. Where the loss's forward autocasts to bf16
and no adapter has dropout (`adapter_casts_undone`), those casts are skipped (PEFT's `disable_input_dtype_casting`):
the product's inputs are the same bits, and so are the loss and the gradients (`tests/test_adapter_casts.py`). With
gradient checkpointing the backward's recomputation still casts (the flags are back by then; same bits). The
update's profile on an H100 counted 69,497 copies in one step of 32 micro-batches (`bench/README.md`).

A step whose gradient norm is not finite (NaN or inf) is not applied: its gradients are dropped before the optimizer
runs, as verl's actor does, and `nonfinite_steps` counts it (logged as `train/nonfinite_grad_steps`). Applied, one
such step turns every weight into NaN, and every later rollout into garbage.

A resumed run reads each epoch's tasks in the order an uninterrupted run does (`EpochSampler`): TRL's sampler draws
each epoch's order from a generator seeded once per process, which the Trainer does not replay on a resume.

It also keeps each optimizer step's phase times in `phase_s` (read and cleared by GRPO's step log,
backends/trl/callbacks.py): `generation` (the whole `_generate_and_score_completions`: rollouts, then the batch and
its advantages) and `update` (forward, backward and optimizer over the step's micro-batches, generation left out).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peft.helpers import disable_input_dtype_casting
from peft.tuners.tuners_utils import BaseTunerLayer
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler, shuffle_sequence_dict, split_tensor_dict

from backends.disk import DiskFull, check_before_save
from backends.importance import ISStats, importance_weights
from backends.trl.fsdp import shard_on_cpu
from foundation.ranks import rank, world_size
from foundation.run_dir import last_complete_checkpoint

log = logging.getLogger(__name__)

CARRY_STATE = "carry_over.rank{rank}.json"  # a checkpoint's carry-over state, per rank (`write_carry_state`)


def by_length(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's rows ordered by completion length, longest first (stable), every per-row value alike."""
    lengths = batch["completion_mask"].sum(dim=1)
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    index = torch.tensor(order, dtype=torch.long)

    def permute(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value if value.ndim == 0 else value[index.to(value.device)]
        return value if value is None else [value[i] for i in order]

    return {key: permute(value) for key, value in batch.items()}


BY_LENGTH_LOSSES = ("dapo", "grpo", "dr_grpo")  # their gradient is the same whichever rows share a micro-batch
COMPLETION_ALIGNED = ("completion_ids", "completion_mask", "tool_mask", "sampling_per_token_logps",
                      "old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio")  # fmt: skip


def trimmed(micro: dict[str, Any]) -> dict[str, Any]:
    """The micro-batch cut to its longest row's completion: the columns after every row's last completion token go
    (padding: masked in every loss). Advantages given per token (B, T) are cut alike."""
    mask = micro["completion_mask"]
    width = mask.size(1)
    used = mask.any(dim=0).nonzero()
    keep = int(used.max()) + 1 if used.numel() else 1
    if keep == width:
        return micro
    out = dict(micro)
    for key in (*COMPLETION_ALIGNED, "advantages"):
        value = out.get(key)
        if isinstance(value, torch.Tensor) and value.ndim == 2 and value.size(1) == width:
            out[key] = value[:, :keep]
    return out


def drop_nonfinite_gradients(model: torch.nn.Module, grad_norm: float | torch.Tensor | None) -> bool:
    """Drop every gradient of `model` when `grad_norm` is not finite (the optimizer then leaves each weight and its
    state alone); True when it did."""
    if grad_norm is None or bool(torch.isfinite(torch.as_tensor(grad_norm))):
        return False
    model.zero_grad(set_to_none=True)
    return True


def write_carry_state(folder: Path, state: dict[str, list[Any]]) -> None:
    """This rank's carry-over state (`AgentRollouts.carry_state`) into the checkpoint `folder`, with the ranks."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CARRY_STATE.format(rank=rank())).write_text(json.dumps({"ranks": world_size(), **state}))


def read_carry_state(checkpoint: str) -> dict[str, list[Any]] | None:
    """This rank's carry-over state in `checkpoint`; None for a checkpoint of a run without carry-over, or of one
    with another number of ranks (said: its groups in flight are then generated anew or lost)."""
    path = Path(checkpoint) / CARRY_STATE.format(rank=rank())
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    if state.pop("ranks") != world_size():
        log.warning("carry-over: %s was saved by another number of ranks; its groups in flight are not resumed", path)
        return None
    return state


class EpochSampler(RepeatSampler):
    """TRL's RepeatSampler with each epoch's order a function of the epoch: the (epoch + 1)-th permutation of the
    seed's generator, the order an uninterrupted TRL run reads in that epoch. TRL's draws the next permutation at each
    pass from a generator seeded once per process; a run resumed in a later epoch would read the first epoch's order
    again, skipped to the step (some tasks twice in that epoch, others not at all), and HF's Trainer does not replay
    it. The epoch comes from accelerate's data loader, which passes its own on (`set_epoch`) at each pass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.shuffle and self.seed is None:
            raise ValueError("a shuffled EpochSampler needs a seed: its epochs' orders are drawn from it")
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        if self.shuffle:  # the generator as it stands after the epochs before this one drew their orders
            self.generator.manual_seed(self.seed)
            for _ in range(self.epoch):
                torch.randperm(self.num_samples, generator=self.generator)
        return super().__iter__()


def autocasts_to_bf16(accelerator: Any) -> bool:
    """Whether the Trainer's forward passes run under bf16 autocast (accelerate's `autocast()`, which TRL's loss
    forward enters): with `bf16` on GPUs (one, DDP, FSDP2, whose adapters are bf16 in the forward anyway); not on CPU
    runs (fp32)."""
    device = accelerator.device.type
    with accelerator.autocast():
        return torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16


def adapter_casts_undone(model: Any, accelerator: Any) -> bool:
    """Whether PEFT's cast of each adapter's input is undone before it counts: the forward autocasts to bf16, and no
    adapter has dropout (dropout runs on the cast input, so in fp32 it would differ in the last bits)."""
    dropout = any(
        not isinstance(d, torch.nn.Identity)
        for m in model.modules()
        if isinstance(m, BaseTunerLayer)
        for d in getattr(m, "lora_dropout", {}).values()
    )
    return not dropout and autocasts_to_bf16(accelerator)


class AgentGRPOTrainer(GRPOTrainer):
    """GRPOTrainer + importance-sampling correction with the rollout function's log-probs (`is_correction` /
    `is_cap`: `algorithm.is_correction`, `algorithm.is_cap`; "none" leaves TRL's computation as it is)."""

    def __init__(
        self,
        *args: Any,
        is_correction: str = "none",
        is_cap: float = 2.0,
        accept_reward: float | None = None,
        lookahead: int = 0,
        checkpoint_bytes: int | None = None,
        budget_spent: Callable[[], bool] = lambda: False,
        take_rows: Callable[[list[dict[str, Any]], Any], list[dict[str, Any]]] | None = None,
        carry_state: Callable[[int], dict[str, list[Any]]] | None = None,
        skip_adapter_casts: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # under bf16 autocast the loss's forward skips PEFT's casts of each adapter's input (module docstring);
        # False keeps them (the reference bench/agent_rollouts.py --peft-casts measures against)
        self.skip_adapter_casts = skip_adapter_casts
        self.checkpoint_bytes = checkpoint_bytes  # what one rank writes a checkpoint (backends/disk.py's plan)
        self.lookahead = lookahead  # read the batches of the next this many optimizer steps early (`upcoming_rows`)
        self.budget_spent = budget_spent  # the run's time, FLOPs or GPU-seconds budget (a collective)
        # algorithm.carry_over: the rows a training step trains, chosen before TRL generates for them
        # (`AgentRollouts.take`); None: the rows the Trainer read for it
        self.take_rows = take_rows
        # algorithm.carry_over: this rank's groups in flight that each checkpoint keeps (`AgentRollouts.carry_state`)
        self.carry_state = carry_state
        one_generation_a_step = self.args.steps_per_generation == self.args.gradient_accumulation_steps
        if self.num_iterations != 1 or not one_generation_a_step:  # the loss's forward scores, batches by length
            raise ValueError("one generation per optimizer step, trained once (num_iterations 1, "
                             "steps_per_generation = gradient_accumulation_steps)")  # fmt: skip
        self._ahead: deque[tuple[int, list[Any]]] = deque()  # the next steps' batches read ahead, with their epoch
        self._sources: dict[int, Any] = {}  # each epoch's iterator read from: the Trainer's, or ours made ahead of it
        self._train_dataloader: Any = None  # the Trainer's, whose next epoch's iterator is read ahead
        self._epoch = 0  # the epoch the Trainer runs
        self.is_correction = is_correction
        self.is_cap = is_cap
        self.accept_reward = accept_reward  # set: rejection-sampling fine-tuning (`rejection_sampled`)
        self.phase_s: defaultdict[str, float] = defaultdict(float)
        self._is_stats: ISStats | None = None  # this step's `sampling/*` sums, while its micro-batches train
        self._loss_inputs: dict[str, Any] | None = None  # the micro-batch whose loss forward comes next
        self.nonfinite_steps = 0  # optimizer steps dropped for a gradient norm that is not finite

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, refused before a byte is written when the disk cannot hold it (`checkpoint_bytes`),
        and on a failure midway (a full disk, an I/O error) its partial files removed: the previous checkpoint stays
        the latest complete one, resumable. The oldest is deleted (`save_total_limit`) only once the new one is
        complete."""
        folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        previous = last_complete_checkpoint(Path(self.args.output_dir))
        if self.checkpoint_bytes is not None:
            check_before_save(folder, self.checkpoint_bytes, previous and Path(previous).name)
        try:
            if self.carry_state is not None:  # before the Trainer's files: a checkpoint complete has it
                write_carry_state(folder, self.carry_state(self.state.global_step - 1))
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as exc:
            if self.args.should_save:  # the process that writes the Trainer's files removes the partial ones
                shutil.rmtree(folder, ignore_errors=True)
            kept = (
                f"{Path(previous).name} is the latest complete checkpoint, resumable" if previous else "no earlier one"
            )
            raise DiskFull(f"saving {folder.name} failed ({exc}): its partial files removed; {kept}") from exc

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if shard_on_cpu(self.accelerator, self.args.fsdp_plugin_args):  # FSDP2 on gloo too (backends/trl/fsdp.py)
            self.is_fsdp_enabled = True

    def _get_train_sampler(self, dataset: Any = None) -> EpochSampler:
        """TRL's sampler, as an EpochSampler: a resumed run reads each epoch's order, not the first epoch's again."""
        trl = super()._get_train_sampler(dataset)
        return EpochSampler(
            trl.data_source, trl.mini_repeat_count, trl.batch_size, trl.repeat_count, trl.shuffle, trl.seed
        )

    def get_train_dataloader(self) -> Any:
        self._train_dataloader = super().get_train_dataloader()
        return self._train_dataloader

    def _run_epoch(self, *args: Any, epoch: int, **kwargs: Any) -> None:
        """The Trainer's epoch, its order set (`EpochSampler`: the Trainer's own `set_epoch` does not reach a sampler
        under a resumed epoch's skipping loader on several ranks); not begun once `max_steps` are trained or the
        budget is spent: both are checked only after a step, so a run resumed from its last step's checkpoint
        (stopped before its final model) would train one step more."""
        self._epoch = epoch
        self._read_epoch(epoch)
        if self.state.global_step >= self.state.max_steps or self.budget_spent():
            self.control.should_training_stop = True
            return
        super()._run_epoch(*args, epoch=epoch, **kwargs)

    def _read_epoch(self, epoch: int) -> None:
        """The epoch whose order the Trainer's data loader reads on its next pass: accelerate's loader passes it on to
        its sampler (a resumed epoch's skipping loader on several ranks does not: the sampler keeps this one's)."""
        if self._train_dataloader is not None:
            self._train_dataloader.set_epoch(epoch)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """The Trainer's batches of this optimizer step; with `lookahead` N, the next N steps' are read now as well (as
        many as the run has left) and kept for them, in the order the Trainer reads them: nothing is sampled twice or
        skipped. At an epoch's end the next epoch's batches come from an iterator of the Trainer's dataloader made
        now, which then stands in for the one the Trainer makes for that epoch (that one is never read: its sampler
        draws the same order)."""
        if not self.lookahead:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        self._sources = {e: it for e, it in self._sources.items() if e >= self._epoch}
        self._sources.setdefault(self._epoch, epoch_iterator)  # an epoch nothing read ahead: the Trainer's iterator
        if self._ahead:
            epoch, batches = self._ahead.popleft()
            if epoch != self._epoch or len(batches) != num_batches:  # GRPO's epochs are whole steps (RepeatSampler)
                raise RuntimeError(f"read {len(batches)} batches of epoch {epoch} ahead for a step of {num_batches} "
                                   f"in epoch {self._epoch}")  # fmt: skip
        else:  # the first step (of a run, or a resumed one)
            batches, _ = super().get_batch_samples(self._sources[self._epoch], num_batches, device)
        steps_after = self.state.max_steps - self.state.global_step - 1  # the steps that come after this one
        while len(self._ahead) < min(self.lookahead, steps_after):
            epoch = self._ahead[-1][0] if self._ahead else self._epoch
            upcoming, _ = super().get_batch_samples(self._sources[epoch], num_batches, device)
            if not upcoming and self._train_dataloader is not None:  # that epoch's end: the next epoch's first
                epoch += 1
                self._read_epoch(epoch)  # its order, as the Trainer sets it for that epoch
                self._sources[epoch] = iter(self._train_dataloader)
                upcoming, _ = super().get_batch_samples(self._sources[epoch], num_batches, device)
            if not upcoming:
                break
            self._ahead.append((epoch, upcoming))
        return batches, self._get_num_items_in_batch(batches, device)

    def upcoming_rows(self, ahead: int = 1) -> list[dict[str, Any]] | None:
        """The dataset rows the optimizer step `ahead` steps after this one generates for (this rank's share), None
        where not read ahead (past the last step; beyond `lookahead`). One generation a step: its first micro-batch
        holds them all."""
        return list(self._ahead[ahead - 1][1][0]) if 0 < ahead <= len(self._ahead) else None

    def _clip_grad_norm(self, model: Any) -> Any:
        grad_norm = super()._clip_grad_norm(model)
        self.nonfinite_steps += drop_nonfinite_gradients(model, grad_norm)
        return grad_norm

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        start, generation_before = time.perf_counter(), self.phase_s["generation"]
        loss = super().training_step(model, inputs, num_items_in_batch)
        generated = self.phase_s["generation"] - generation_before  # this micro-batch's share, when it generated
        self.phase_s["update"] += time.perf_counter() - start - generated
        return loss

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's, with the step's batch split by `micro_batches` (module docstring) instead of TRL's shuffle."""
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        accumulation = self.args.steps_per_generation  # one generation a step: its micro-batches
        if self._step % accumulation == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self.micro_batches(self._generate_and_score_completions(generation_batch))
        return self._buffered_inputs[self._step % accumulation]

    def micro_batches(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """The step's batch as its micro-batches: ordered by length where the loss type allows (else shuffled, as
        TRL does), split, each cut to its longest row."""
        if "pixel_values" in batch:
            raise ValueError("images are not supported: the batch is split and cut per text row")
        ordered = by_length(batch) if self.loss_type in BY_LENGTH_LOSSES else shuffle_sequence_dict(batch)
        return [trimmed(micro) for micro in split_tensor_dict(ordered, self.args.steps_per_generation)]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            if self.model.training and self.take_rows is not None:
                inputs = self.take_rows(inputs, self)  # the groups finished first: TRL scores and logs them
            output = super()._generate_and_score_completions(inputs)
            if self.accept_reward is not None:
                self.rejection_sampled(output)
            return output
        finally:
            self.phase_s["generation"] += time.perf_counter() - start

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's, with the importance weights taken from its forward (`_get_per_token_logps_and_entropies`) and, where
        that forward autocasts to bf16, without PEFT's casts of each adapter's input (module docstring)."""
        corrects = self.is_correction != "none" and inputs.get("sampling_per_token_logps") is not None
        self._loss_inputs = inputs if corrects and model.training else None
        try:
            skip = self.skip_adapter_casts and adapter_casts_undone(model, self.accelerator)
            with disable_input_dtype_casting(model, active=skip):
                return super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's; in the loss's forward (the first call of `_compute_loss`), the micro-batch's importance weights
        from these log-probs, folded into its advantages before TRL reads them."""
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._loss_inputs is not None:
            inputs, self._loss_inputs = self._loss_inputs, None
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            weights, stats = importance_weights(
                out[0].detach(), inputs["sampling_per_token_logps"], mask, self.is_correction, self.is_cap
            )
            advantages = inputs["advantages"]
            if advantages.shape != weights.shape:  # per sequence (B,): every token of a row alike
                advantages = advantages.unsqueeze(1)
            inputs["advantages"] = advantages * weights
            self._is_stats = stats if self._is_stats is None else self._is_stats + stats
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The step's `sampling/*` metrics, from the sums over its micro-batches, join TRL's before it logs them."""
        if self._is_stats is not None:
            for key, value in self._is_stats.metrics().items():
                self._metrics["train"][key].append(value)
            self._is_stats = None
        super().log(logs, start_time)

    def rejection_sampled(self, output: dict[str, Any]) -> None:
        """RFT in place of GRPO's advantages: a kept rollout (reward >= `accept_reward`, not excluded) gets advantage
        1 on its model tokens, every other one no loss tokens at all, and the loss is normalized by the kept tokens
        (over every rank): at ratio 1 the gradient is that of the kept tokens' mean negative log-likelihood."""
        rollouts = self.rollout_func  # AgentRollouts: this rank's last rollouts, in the batch's order
        kept = [
            sample.excluded is None and rollout.reward is not None and rollout.reward >= self.accept_reward
            for rollout, sample in zip(rollouts.last_rollouts, rollouts.last_samples, strict=True)
        ]
        accepted = torch.tensor(kept, dtype=output["completion_mask"].dtype, device=output["completion_mask"].device)
        loss_mask = output.get("tool_mask", torch.ones_like(output["completion_mask"])) * accepted.unsqueeze(1)
        output["tool_mask"] = loss_mask
        output["advantages"] = accepted.float()
        output["num_items_in_batch"] = self.accelerator.gather((loss_mask * output["completion_mask"]).sum()).sum()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["rft/accepted_rate"].append(float(accepted.float().mean()))

"""Disk of backend=trl's runs, planned like memory: before the first step, and checked again before every save.

What a GRPO checkpoint (`<run>/checkpoints/checkpoint-<step>`, the Trainer's own) holds, from the model's shape:

- full fine-tuning on one process: the weights in the model's dtype (b bytes a parameter) and AdamW's two moments in
  the same dtype (2b), about 3b x N;
- full fine-tuning sharded by FSDP2 (`SHARDED_STATE_DICT`): each rank writes its shard of the fp32 master weights
  (4) and of the two fp32 moments (8): 12 x N over all ranks, 12 x N / ranks each;
- LoRA: the fp32 adapters (4) and their two moments (8): 12 x the adapters' parameters;
- plus the scheduler, the RNG states and the trainer state (under a megabyte).

The final model (`checkpoints/final`): b x N (the full model, safetensors shards, in the model's dtype) or 4 x the
adapters (LoRA), or nothing more where it is hard links to the last checkpoint's weights (unsharded, a run that
ends at a save: its last step's checkpoint holds the same bytes); a warm start trained into the run
(`checkpoints/sft`), b x N. The estimate errs high (the tiny
model's vocabulary is planned at its largest: 16.0 MB planned for a 13.6 MB checkpoint). `algorithm.keep_checkpoints`
complete checkpoints are kept; a new one is written beside them and the oldest deleted only once it is complete, so
the peak is keep + 1 checkpoints, or keep and the final model (and the warm start, where the run holds one); a start
that writes fewer (one save in all: `max_steps` <= `save_every`) or holds fewer needs room for what it writes.

`check_plan` refuses a run whose peak does not fit the free space under its run directory (what it already holds
counts as used), naming the bytes needed and free and the keys that shrink it; `check_before_save` refuses a save
that would not fit, before a byte is written, leaving the previous checkpoint as it is.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.memory import Shape
from foundation.errors import ConfigError

GB = 1e9
SMALL_BYTES = 2**20  # scheduler, RNG states, trainer state, config files
MARGIN = 1.05  # file-system overhead and the estimate's slack


@dataclass(frozen=True)
class DiskSetting:
    """How a run saves: the keys the plan reads (their names are in its message)."""

    full: bool  # finetune=full (else LoRA)
    ranks: int  # processes writing shards (resources.nodes x resources.gpus_per_node), on one disk
    sharded: bool  # backend.sharding=fsdp2 on several ranks
    weight_bytes: int  # bytes a weight in the model's dtype (2 for bf16, 4 for fp32)
    keep: int  # algorithm.keep_checkpoints
    warm_start: bool = False  # a warm start trained into the run (checkpoints/sft: not shared, not warmstart.path)
    saves: int | None = None  # checkpoints this start writes (every save_every steps and at its end); None: unknown
    existing: int = 0  # complete checkpoints the run already holds (a resumed run's)

    @property
    def final_linked(self) -> bool:
        """The final model is hard links to the last checkpoint's weights (`backends/trl/arms.py linked_final`):
        unsharded, and the run ends at a save (its last step is known, and the Trainer saves there)."""
        return not self.sharded and bool(self.saves)


def plan_disk(shape: Shape, setting: DiskSetting) -> dict[str, Any]:
    """Bytes per checkpoint (and per rank), of the final model, and the peak the run's directory reaches."""
    p, b = shape.parameters, setting.weight_bytes
    if not setting.full:
        checkpoint = 12 * shape.adapter_parameters
        final = 4 * shape.adapter_parameters
    elif setting.sharded:
        checkpoint, final = 12 * p, b * p
    else:
        checkpoint, final = 3 * b * p, b * p
    checkpoint += SMALL_BYTES * setting.ranks
    final += SMALL_BYTES
    warm = (b * p + SMALL_BYTES) if setting.warm_start else 0
    # at a save: the kept ones and the new one beside them; at the end: the kept ones and the final model
    at_once = setting.keep + 1 if setting.saves is None else min(setting.keep + 1, setting.existing + setting.saves)
    kept = min(setting.keep, at_once)
    final_more = SMALL_BYTES if setting.final_linked else final  # linked: the last checkpoint's weights, no copy
    peak = (max(at_once * checkpoint, kept * checkpoint + final_more) + warm) * MARGIN
    return {
        "checkpoint_bytes": int(checkpoint),
        "checkpoint_bytes_per_rank": int(checkpoint / setting.ranks) if setting.sharded else int(checkpoint),
        "final_bytes": int(final),
        "final_linked": setting.final_linked,
        "warm_start_bytes": int(warm),
        "keep_checkpoints": setting.keep,
        "peak_bytes": int(peak),
    }


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of `path` (or of its nearest existing parent)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    return shutil.disk_usage(existing).free


def used_bytes(folder: Path) -> int:
    """What the run's checkpoints already take (a resumed run's count toward its kept ones)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0


def explain(plan: dict[str, Any], free: int, where: Path) -> str:
    lines = [
        f"disk plan under {where}: a checkpoint {plan['checkpoint_bytes'] / GB:.2f} GB"
        + (
            f" ({plan['checkpoint_bytes_per_rank'] / GB:.2f} GB a rank)"
            if plan["checkpoint_bytes_per_rank"] != plan["checkpoint_bytes"]
            else ""
        )
        + f", the final model {plan['final_bytes'] / GB:.2f} GB"
        + (" (hard links to the last checkpoint's weights: no copy)" if plan.get("final_linked") else "")
        + (f", the warm start {plan['warm_start_bytes'] / GB:.2f} GB" if plan["warm_start_bytes"] else "")
        + f", {plan['keep_checkpoints']} kept: peak "
        f"{plan['peak_bytes'] / GB:.2f} GB; {free / GB:.2f} GB free (with what the run already holds)"
    ]
    return "\n".join(lines)


def check_plan(plan: dict[str, Any], checkpoints: Path, setting: DiskSetting, enforce: bool) -> str:
    """The plan in words; a ConfigError naming the keys that shrink it when its peak does not fit (`enforce`)."""
    free = free_bytes(checkpoints) + used_bytes(checkpoints)
    text = explain(plan, free, checkpoints)
    plan["free_bytes"] = free
    plan["fits"] = plan["peak_bytes"] <= free
    if plan["fits"] or not enforce:
        return text
    keys = []
    if setting.keep > 1:
        keys.append(f"algorithm.keep_checkpoints (now {setting.keep}; 1 keeps the last complete one)")
    if setting.full:
        keys.append("finetune=lora (a checkpoint holds the adapters only)")
    if setting.warm_start:
        keys.append("warmstart.shared=true (the warm start in paths.cache_dir instead of the run)")
    keys.append("paths.output_dir (ARL_OUTPUT_DIR) on a disk with more free space")
    raise ConfigError(
        "\n".join(
            [
                text,
                f"the run needs {plan['peak_bytes'] / GB:.2f} GB and {free / GB:.2f} GB are free: it would fail at "
                "a save; change one of:",
                *(f"  - {k}" for k in keys),
                "(backend.disk_check=false runs it anyway)",
            ]
        )
    )


class DiskFull(RuntimeError):
    """A save refused (or failed) for want of space; the previous checkpoint is as it was."""


def check_before_save(target: Path, needed: int, previous: str | None) -> None:
    """Refuse a save of `needed` bytes into `target` that the free space cannot hold, before a byte is written."""
    free = free_bytes(target)
    if needed * MARGIN > free:
        raise DiskFull(
            f"{target.name} needs {needed / GB:.2f} GB and {free / GB:.2f} GB are free under {target.parent}: not "
            f"written; {previous or 'no earlier checkpoint'} is intact"
            + (" and resumable (run the same command again once space is freed)" if previous else "")
        )

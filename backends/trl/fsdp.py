"""FSDP2 for backend=trl on several ranks (`backend.sharding=fsdp2`): PyTorch's `fully_shard`, through accelerate.

Why FSDP2 through accelerate: TRL's GRPOTrainer is a transformers Trainer, which hands sharding to accelerate
(`fsdp_config={"version": 2}` in its arguments): accelerate wraps each decoder layer (`TRANSFORMER_BASED_WRAP`), the
embeddings and the head in `fully_shard`, keeps fp32 master weights under bf16 compute (its mixed-precision policy),
and writes sharded checkpoints (torch.distributed.checkpoint) that the Trainer resumes from. Each rank then holds 1/N
of the weights, gradients and Adam state: full fine-tuning of a 7B model needs ~120 GB of those in fp32, which one GPU
does not have. DeepSpeed ZeRO-3 would do the same through another dependency; it is not used.

What this project adds around it (`inference/weights.py` gathers the full weights for generation):
- `fsdp_arguments`: the Trainer's FSDP2 settings, one place.
- `shard_on_cpu`: accelerate sets FSDP only for accelerators; on CPU (gloo) it silently falls back to DDP. The CPU
  runs in CI must run the same path as the GPUs, so the trainer promotes its accelerator to FSDP there: torch's
  `fully_shard` works on CPU meshes, and its gradients on gloo are the averaged ones (torch 2.13; checked against
  one process by tests/test_fsdp.py).
"""

from __future__ import annotations

from typing import Any

SHARDINGS = ("fsdp2", "ddp")


def fsdp_arguments(gradient_checkpointing: bool) -> dict[str, Any]:
    """The Trainer's arguments for FSDP2: each decoder layer its own unit, resharded after its forward (the full
    weights of one layer at a time), sharded checkpoints (each rank writes its shard; resumable), activation
    checkpointing by FSDP when asked for (the Trainer's own must then be off)."""
    return {
        "fsdp": "full_shard",
        "fsdp_config": {
            "version": 2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "reshard_after_forward": True,
            "state_dict_type": "SHARDED_STATE_DICT",
            "activation_checkpointing": gradient_checkpointing,
            "cpu_ram_efficient_loading": False,
        },
        "gradient_checkpointing": False,
    }


def shard_on_cpu(accelerator: Any, plugin_args: dict[str, Any] | None) -> bool:
    """Give a CPU accelerator the FSDP2 plugin (`plugin_args`: the Trainer's `fsdp_plugin_args`) that accelerate only
    sets on accelerators; True when it did (nothing changes on GPUs, or without FSDP arguments)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if plugin_args is None or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
    # where accelerate keeps it too: every later AcceleratorState() copies the process's state from there
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True

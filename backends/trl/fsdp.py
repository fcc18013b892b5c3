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

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

SHARDINGS = ("fsdp2", "ddp")
# What lives in CPU memory instead of the GPU's (backend.offload): nothing; the optimizer's state while the engine
# generates (`OptimizerOffload`: the update keeps GPU AdamW); or all of the trainer's state, always (FSDP2's
# CPUOffloadPolicy: each layer's weights are copied in for its forward and backward, AdamW steps on the CPU).
OFFLOADS = ("none", "optimizer", "all")


def fsdp_arguments(gradient_checkpointing: bool, offload_all: bool = False) -> dict[str, Any]:
    """The Trainer's arguments for FSDP2: each decoder layer its own unit, resharded after its forward (the full
    weights of one layer at a time), sharded checkpoints (each rank writes its shard; resumable), activation
    checkpointing by FSDP when asked for (the Trainer's own must then be off), the trainer's state on CPU when
    `offload_all`."""
    return {
        "fsdp": "full_shard",
        "fsdp_config": {
            "version": 2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "reshard_after_forward": True,
            "state_dict_type": "SHARDED_STATE_DICT",
            "activation_checkpointing": gradient_checkpointing,
            "cpu_ram_efficient_loading": False,
            "cpu_offload": offload_all,
        },
        "gradient_checkpointing": False,
    }


class OptimizerOffload:
    """The optimizer's state (AdamW's moments) in pinned CPU buffers while the engine generates, back on the GPU for
    the update (verl's `optimizer_offload`): a 7B model's fp32 moments are 61 GB, 30 GB a rank on two. The buffers
    are allocated once and reused; `to_cpu` frees the GPU copies (the engine's wake-up empties torch's cache)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._device: dict[tuple[int, str], torch.device] = {}

    @contextlib.contextmanager
    def out_of_gpu(self, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
        """The optimizer's state in CPU memory while the block runs, back on the GPU after it, also if it raised."""
        if optimizer is None:
            yield
            return
        try:
            self.to_cpu(optimizer)
            yield
        finally:
            self.to_gpu(optimizer)

    def to_cpu(self, optimizer: torch.optim.Optimizer) -> None:
        for param, state in optimizer.state.items():
            for key, value in state.items():
                slot = (id(param), key)
                if not isinstance(value, torch.Tensor) or value.device.type == "cpu" or slot in self._device:
                    continue  # on the CPU already (AdamW's step count), or moved out before
                local = value._local_tensor if hasattr(value, "_local_tensor") else value  # a DTensor's shard
                buffer = self._buffers.get(slot)
                if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                    buffer = self._buffers[slot] = torch.empty_like(local, device="cpu", pin_memory=True)
                buffer.copy_(local, non_blocking=True)
                self._device[slot] = local.device
                local.data = torch.empty(0, dtype=local.dtype, device=local.device)  # the GPU copy is freed
        torch.cuda.synchronize()

    def to_gpu(self, optimizer: torch.optim.Optimizer) -> None:
        for param, state in optimizer.state.items():
            for key, value in state.items():
                slot = (id(param), key)
                if slot not in self._device:
                    continue
                local = value._local_tensor if hasattr(value, "_local_tensor") else value
                local.data = self._buffers[slot].to(self._device.pop(slot), non_blocking=True)
        torch.cuda.synchronize()


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

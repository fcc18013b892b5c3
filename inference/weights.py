"""The weights generation reads: the trainer's model as it is, or, when FSDP2 shards it across ranks, a full copy.

Under FSDP2 (`backend.sharding=fsdp2`, several ranks) each rank holds 1/N of every weight as a DTensor shard, and no
engine can generate from that: the HF engine would run FSDP's per-layer all-gathers inside every decode step (and the
ranks, whose rollouts make different numbers of calls, would hang in them), the static engine and vLLM read plain
tensors. So before each rollout phase every rank gathers the full weights in the same order (`full_weights`: one
all-gather per parameter, a collective) into a plain model of the same architecture (`GenerationWeights`), built once
per run on the rank's device in the compute dtype, and generates from that. LoRA is merged into the copy (W + B·A·
scaling, computed in float32 and rounded once); the trainer's weights are never touched.

The copy stays between rollout phases: the static engine keeps its CUDA graphs bound to its tensors, and rebuilding
them each step costs more than the memory (full weights in bf16: 15 GB per rank for a 7B model). An engine that keeps
its own weights (vLLM) needs no copy: it is handed the sharded model and gathers while it loads (`full_weights`, in
the same order on every rank). An unsharded model (one process, or DDP) is generated from directly, as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PreTrainedModel


def is_sharded(model: torch.nn.Module) -> bool:
    """True when some of the model's weights are DTensor shards (FSDP2)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_weights(model: PreTrainedModel) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under its checkpoint's names (what vLLM's `load_weights` maps, what a plain model of the
    same architecture names its parameters); a LoRA layer's weight is a merged copy, W + the active adapters' deltas,
    and the adapters themselves are left out. A DTensor shard is gathered whole first: with FSDP2 every rank must
    iterate this to the end, in step (the order is `named_parameters`', the same on every rank)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lora = {_plain(n): m for n, m in base.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}
    with torch.no_grad():
        for name, param in base.named_parameters():
            if ".lora_" in name or ".original_module." in name:
                continue
            name = _plain(name).replace(".modules_to_save.default.", ".")
            owner, _, leaf = name.rpartition(".")
            if owner.endswith(".base_layer") and owner.removesuffix(".base_layer") in lora:
                owner = owner.removesuffix(".base_layer")
                name = f"{owner}.{leaf}"
                if leaf == "weight":
                    yield name, _merged(lora[owner], _full(param))
                    continue
            yield name, _full(param)


def _plain(name: str) -> str:
    """A parameter's name without the wrapper that activation checkpointing puts around each layer."""
    return name.replace(f"{_CHECKPOINT_WRAPPED_MODULE}.", "")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a DTensor gathered whole (a collective), anything else as it is. A shard that FSDP2 keeps in
    CPU memory (`backend.offload=all`) is copied to this rank's GPU first: NCCL gathers GPU tensors."""
    if not isinstance(tensor, DTensor):
        return tensor.detach()
    if tensor.device.type == "cpu" and tensor.device_mesh.device_type == "cuda":
        local = tensor.to_local().to(torch.device("cuda", torch.cuda.current_device()))
        tensor = DTensor.from_local(
            local, tensor.device_mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
        )
    return tensor.full_tensor()


def _merged(layer: Any, weight: torch.Tensor) -> torch.Tensor:
    adapters = [a for a in getattr(layer, "active_adapters", []) if a in layer.lora_A]
    if layer.merged or layer.disable_adapters or not adapters:
        return weight
    if any(layer.use_dora.get(a, False) for a in adapters):
        raise ValueError("DoRA adapters cannot be merged into generation weights (use LoRA, or generation_engine=hf)")
    out = weight.to(torch.float32, copy=True)  # a copy even when the weight is float32
    for adapter in adapters:
        out += _delta(layer, adapter)
    return out.to(weight.dtype)  # rounded once


def _delta(layer: Any, adapter: str) -> torch.Tensor:
    """B·A·scaling in float32 (PEFT's `get_delta_weight` for a Linear layer), from gathered A and B when sharded."""
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    if not (isinstance(a, DTensor) or isinstance(b, DTensor)):
        return layer.get_delta_weight(adapter).float()
    if not hasattr(layer, "fan_in_fan_out"):
        raise ValueError(f"{type(layer).__name__}: only LoRA on Linear layers is merged from FSDP2 shards")
    delta = _full(b).float() @ _full(a).float()
    return (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[adapter]


class GenerationWeights:
    """What the policy server generates from: `for_generation(model)` is called on every rank before each rollout
    phase and each validation (a collective when `model` is sharded)."""

    def __init__(self, device: str, dtype: torch.dtype, engine_gathers: bool = False, snapshot: bool = False) -> None:
        self.device = device
        self.dtype = dtype  # the copy's: the model's as loaded (bf16 on CUDA), not FSDP2's fp32 master weights
        self.engine_gathers = engine_gathers  # the engine loads its own weights with `full_weights` (vLLM)
        # a copy of a whole model too: the engine generates while the trainer updates it (async rollouts), so it must
        # read the weights as they were when loaded, not the ones the optimizer is writing
        self.snapshot = snapshot
        self._copy: PreTrainedModel | None = None

    def for_generation(self, model: PreTrainedModel) -> PreTrainedModel:
        """`model` itself when it is whole (and no snapshot is asked for) or the engine gathers it itself; else the
        full copy, refreshed from the model (gathered from its shards)."""
        if self.engine_gathers or not (is_sharded(model) or self.snapshot):
            return model
        if self._copy is None:
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            with torch.device(self.device):
                self._copy = AutoModelForCausalLM.from_config(base.config, dtype=self.dtype)
            self._copy.generation_config = base.generation_config
            self._copy.eval().requires_grad_(False)
        params = dict(self._copy.named_parameters())
        filled = set()
        with torch.no_grad():
            for name, tensor in full_weights(model):
                params[name].copy_(tensor)
                filled.add(name)
        if filled != params.keys():
            raise RuntimeError(f"the generation copy's weights {sorted(params.keys() - filled)} were not filled")
        return self._copy

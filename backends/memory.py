"""GPU memory of backend=trl's runs: a plan made before any rank starts, and what each rank really used.

The plan (`plan_memory`, called by job=train before it loads a model or starts ranks): from the model's shape (its
config, on the meta device: no weights), the fine-tuning mode, the ranks and their sharding, the optimizer offload,
the micro-batch and the engine's share, the peak of each GPU in its two phases:

- rollout: the trainer's resident state (fp32 master shards under FSDP2; bf16 weights unsharded, the optimizer's
  state unless `backend.offload` moved it to CPU; gradients are freed after each step) + the engine
  (vLLM: `backend.vllm_gpu_memory_utilization` of the GPU for its weights and KV cache; an engine that generates from
  a gathered bf16 copy of sharded weights: that copy);
- update: the whole trainer state (weights, gradients, optimizer) + FSDP2's gathered layers + activations (with or
  without checkpointing) + the logits of a micro-batch + what a sleeping vLLM keeps.

Both plus a fixed overhead (CUDA context, NCCL buffers) and a margin for fragmentation must fit the card; when one
does not, the run stops before it starts (ConfigError), naming the keys that change it. The plan is an estimate
(what an optimizer keeps, how an attention kernel stores its activations): it says what it assumed, and the
measured peaks beside it (`bench/results/sharded_steps_*`) say how close it was.

The measurement (`DeviceMemory`): what the GPU has in use (NVML, every process on it: one rank per GPU), sampled by
a thread, peak per phase, plus what the engine frees when it sleeps. torch's own counter
(`max_memory_allocated`) is not used: vLLM's sleep mode unmaps memory that torch still counts as allocated, so it
read 101.5 GB on an 80 GB card.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GB = 1e9
OVERHEAD_GB = 3.0  # CUDA context, cuBLAS workspaces, NCCL buffers
SLEEPING_ENGINE_GB = 2.0  # what vLLM keeps while asleep (its CUDA graphs' pool, compiled kernels)
MARGIN = 1.08  # the allocator's fragmentation: blocks cached but not reusable for the next request's size
LOGIT_BYTES = 6  # bytes per logit of a micro-batch in the update: bf16 logits, their scaled copy, their gradient


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model's architecture."""

    parameters: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    embedding_parameters: int  # input embeddings and, when untied, the output layer
    adapter_parameters: int  # LoRA's A and B on the target modules (0 for full fine-tuning)

    @classmethod
    def of(cls, config: Any, lora_rank: int | None = None, lora_targets: list[str] | None = None) -> Shape:
        """From a transformers config: the model is built on the meta device (no memory), its parameters counted."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        embeddings = {
            id(p): p.numel()
            for m in (model.get_input_embeddings(), model.get_output_embeddings())
            for p in m.parameters()
        }
        adapters = 0
        if lora_rank is not None:
            for name, module in model.named_modules():
                if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in (lora_targets or []):
                    adapters += lora_rank * (module.in_features + module.out_features)
        return cls(
            parameters=sum(p.numel() for p in model.parameters()),
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            embedding_parameters=sum(embeddings.values()),
            adapter_parameters=adapters,
        )


@dataclass(frozen=True)
class Setting:
    """How a run holds the model: the keys the plan reads (their names are in its message)."""

    full: bool  # finetune=full (else LoRA)
    ranks: int  # processes sharing the model (resources.nodes x resources.gpus_per_node)
    sharded: bool  # backend.sharding=fsdp2 on several ranks
    offload: str  # backend.offload: none, optimizer (on CPU while the engine generates), all (FSDP2's CPU offload)
    gradient_checkpointing: bool  # backend.gradient_checkpointing
    micro_batch_tokens: int  # algorithm.micro_batch_size x (max_prompt_length + max_response_length)
    engine: str  # vllm, static or hf
    engine_share: float  # backend.vllm_gpu_memory_utilization
    engine_sleeps: bool  # backend.vllm_sleep (and not algorithm.async_rollouts: the engine generates during the update)
    snapshot: bool = False  # algorithm.async_rollouts: a static or HF engine generates from a copy of the weights
    weight_bytes: int = 2  # bytes a weight in the model's dtype on GPUs (model.dtype: 2 for bf16 and auto, 4 for fp32)


def plan_memory(shape: Shape, setting: Setting, capacity_gb: float) -> dict[str, Any]:
    """Each phase's estimated peak per GPU (GB), what it is made of, and whether it fits `capacity_gb`."""
    n = setting.ranks if setting.sharded else 1
    p, b = shape.parameters, setting.weight_bytes
    if setting.full:
        # FSDP2 keeps fp32 master weights and AdamW's two fp32 moments, sharded; one process trains the model's own
        # dtype (weights, gradients, two moments); DDP adds its gradient buckets
        weights, grads, optimizer = (4 * p / n, 4 * p / n, 8 * p / n) if setting.sharded else (b * p, b * p, 2 * b * p)
        grads += b * p if setting.ranks > 1 and not setting.sharded else 0
    else:  # the frozen base in the model's dtype (sharded under FSDP2); PEFT keeps the adapters in fp32
        a = shape.adapter_parameters
        weights, grads, optimizer = b * p / n + 4 * a, 4 * a, 8 * a
    layer = (p - shape.embedding_parameters) / shape.layers
    gathered = (2 * layer * (2 + 4) + 6 * shape.vocab * shape.hidden) if setting.sharded else 0.0
    tokens = setting.micro_batch_tokens
    per_layer = tokens * 2 * (6 * shape.hidden + 4 * shape.intermediate)  # bf16 inputs of each matmul and norm
    activations = (
        (tokens * 2 * shape.hidden * shape.layers + per_layer)
        if setting.gradient_checkpointing
        else (per_layer * shape.layers)
    )
    logits = LOGIT_BYTES * tokens * shape.vocab
    awake = setting.engine_share * capacity_gb * GB if setting.engine == "vllm" else 0.0
    # inference/weights.py's copy for generation: gathered from the shards, or a snapshot the update does not write
    copy = b * p if setting.engine != "vllm" and (setting.sharded or setting.snapshot) else 0.0
    asleep = (SLEEPING_ENGINE_GB * GB if setting.engine_sleeps else awake) if setting.engine == "vllm" else copy
    on_gpu = 0.0 if setting.offload == "all" else 1.0  # all: the trainer's state lives in CPU memory
    rollout = {
        "trainer weights": on_gpu * (weights + (0 if setting.offload == "optimizer" else optimizer)),
        "engine": awake + copy,
    }
    update = {
        "trainer weights, gradients, optimizer": on_gpu * (weights + grads + optimizer),
        "gathered layers": gathered,
        "activations": activations,
        "logits": logits,
        "engine asleep": asleep,
    }
    phases = {}
    for name, parts in (("rollout", rollout), ("update", update)):
        total = (sum(parts.values()) + OVERHEAD_GB * GB) * MARGIN
        phases[name] = {"peak_gb": round(total / GB, 1), "parts_gb": {k: round(v / GB, 1) for k, v in parts.items()}}
    peak = max(phase["peak_gb"] for phase in phases.values())
    return {"capacity_gb": round(capacity_gb, 1), "peak_gb": peak, "fits": peak <= capacity_gb, "phases": phases}


def explain(plan: dict[str, Any], setting: Setting) -> str:
    """The plan in words, and for a plan that does not fit, the keys that change it."""
    lines = [f"memory plan per GPU ({plan['capacity_gb']} GB): peak {plan['peak_gb']} GB"]
    for name, phase in plan["phases"].items():
        parts = ", ".join(f"{k} {v}" for k, v in phase["parts_gb"].items() if v)
        lines.append(f"  {name}: {phase['peak_gb']} GB = ({parts}) + {OVERHEAD_GB} overhead, x{MARGIN} margin")
    if plan["fits"]:
        return "\n".join(lines)
    keys = []
    if setting.full and setting.offload == "none":
        keys.append("backend.offload=optimizer (the optimizer's state on CPU while the engine generates)")
    if setting.full and setting.offload != "all" and setting.sharded:
        keys.append("backend.offload=all (all of the trainer's state in CPU memory; AdamW steps there, slower)")
    if setting.engine == "vllm":
        keys.append(f"backend.vllm_gpu_memory_utilization (now {setting.engine_share})")
    if not setting.gradient_checkpointing:
        keys.append("backend.gradient_checkpointing=true")
    keys.append("algorithm.micro_batch_size (tokens a micro-batch: algorithm.max_prompt_length + max_response_length)")
    if setting.full:
        keys.append(
            "more GPUs (resources.gpus_per_node with backend.sharding=fsdp2: the trainer state is split across them)"
        )
        keys.append("finetune=lora")
    return "\n".join([*lines, "it does not fit; change one of:", *(f"  - {k}" for k in keys)])


class DeviceMemory:
    """The GPU's memory in use (every process on it), sampled every `every_s` by a thread while `start()`ed: the peak
    of each phase (`phase` names the current one) and the engine's share (what it freed when it last slept).

    The thread reads NVML (the driver's management library), which shares no lock or context with CUDA: a CUDA call
    from a second thread could meet vLLM capturing its CUDA graphs. Without NVML, only the samples the training loop
    takes itself (`sample()` at each phase's end, through CUDA) are kept."""

    def __init__(self, device: str, every_s: float = 0.05) -> None:
        self.device = device
        self.every_s = every_s
        self.phase = "start"
        self.peaks: dict[str, float] = {}
        self.engine_gb: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = _nvml_reader(device)

    def used_gb(self) -> float:
        if self._nvml is not None:
            return self._nvml() / GB
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return (total - free) / GB

    def sample(self) -> float:
        used = self.used_gb()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), used)
        return used

    def start(self) -> DeviceMemory:
        if self._nvml is None:
            return self

        def watch() -> None:
            while not self._stop.wait(self.every_s):
                self.sample()

        self._thread = threading.Thread(target=watch, name="device-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def engine_slept(self, before_gb: float) -> None:
        """The engine has just slept: it freed `before_gb` minus what is in use now."""
        self.engine_gb = max(0.0, before_gb - self.sample())

    def summary(self) -> dict[str, Any]:
        return {
            "peak_gb": round(max(self.peaks.values(), default=0.0), 2),
            "phase_peak_gb": {k: round(v, 2) for k, v in self.peaks.items()},
            "engine_gb": None if self.engine_gb is None else round(self.engine_gb, 2),
            "sampled_by": "nvml thread" if self._nvml is not None else "phase ends",
        }


def gpu_memory_metrics(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Each step's `gpu_memory/*` from every rank's DeviceMemory summary: the peak so far over all ranks, overall and
    per phase (rollout: the engine awake; update: the trainer's), in GB. A run stopped before its summary is written
    keeps them in metrics.jsonl."""
    metrics = {"gpu_memory/peak_gb": max(r["peak_gb"] for r in ranks)}
    for phase in dict.fromkeys(p for r in ranks for p in r["phase_peak_gb"]):
        metrics[f"gpu_memory/{phase}_peak_gb"] = max(r["phase_peak_gb"].get(phase, 0.0) for r in ranks)
    return metrics


class _NVMLMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml_reader(device: str) -> Callable[[], int] | None:
    """A function that returns the bytes in use on `device` (a torch CUDA device) through NVML, found by the GPU's
    UUID; None where NVML cannot be loaded."""
    try:
        import torch

        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        index = torch.device(device).index
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)
        handle = ctypes.c_void_p()
        key = (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}").encode()
        if lib.nvmlDeviceGetHandleByUUID(key, ctypes.byref(handle)) != 0:
            return None
    except (OSError, AttributeError, RuntimeError):
        return None

    def used() -> int:
        memory = _NVMLMemory()
        lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory))
        return int(memory.used)

    return used

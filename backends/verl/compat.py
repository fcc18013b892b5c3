"""What verl 0.9.1 needs to run beside this project's pins and the GPU image, applied in every Ray worker process of a
run (`worker_process_setup_hook` of the run's runtime env, `config.py`).

The hook runs when a worker process starts, before Ray gives it an actor and that actor's GPUs (CUDA_VISIBLE_DEVICES):
it must not import torch or verl, whose import initialises CUDA with every GPU of the node visible, after which each
actor of the node would take the first one (NCCL: "Duplicate GPU detected", seen on 2 GPUs). So each patch waits for
its verl module to be imported, as the actor's own code does."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

# the logits a chunk of `rowwise_logprobs` holds at most (2**27: 0.5 GB of fp32 temporaries, ~880 rows of Qwen's 152k)
CHUNK_ELEMENTS = 2**27


def hide_trl(module: ModuleType) -> None:
    """verl's actor patches `state_dict` of trl's value-head model whenever trl is importable, importing it from
    `trl.experimental.ppo` or `trl`; trl 1.16 has it in neither, so building the actor fails. The patch is for PPO
    critics, which GRPO has none of: verl is told trl is not there."""
    module.is_trl_available = lambda: False


def rowwise_logprobs(logits: Any, labels: Any) -> Any:
    """verl's `logprobs_from_logits_v2` (the log-probs of `labels` under `logits` without flash-attn: the GPU image
    has none) computed as it computes them, log_softmax in the logits' dtype (logsumexp for fp32 and fp64), but over
    chunks of rows instead of one Python iteration a row: verl's actor gives it every token of a micro-batch as one
    row (prompts included), so its loop launched a few kernels and autograd nodes per token: about 140 us a token
    through forward and backward on an H200 (a micro-benchmark of that function), most of backend=verl's update by
    that estimate (not profiled end to end)."""
    import torch
    import torch.nn.functional as F

    rows = logits.reshape(-1, logits.shape[-1])
    flat = labels.reshape(-1, 1)
    step = max(1, CHUNK_ELEMENTS // rows.shape[-1])
    parts = []
    for start in range(0, rows.shape[0], step):
        chunk, index = rows[start : start + step], flat[start : start + step]
        if rows.dtype in (torch.float32, torch.float64):
            parts.append(chunk.gather(-1, index).squeeze(-1) - torch.logsumexp(chunk, dim=-1))
        else:  # verl's own choice for bf16: logsumexp's difference loses precision there
            parts.append(F.log_softmax(chunk, dim=-1).gather(-1, index).squeeze(-1))
    return torch.cat(parts).reshape(labels.shape)


def vectorized_logprobs(module: ModuleType) -> None:
    """`logprobs_from_logits` (which looks `logprobs_from_logits_v2` up when called) reaches `rowwise_logprobs`."""
    module.logprobs_from_logits_v2 = rowwise_logprobs


def register_loss(module: ModuleType) -> None:
    """`backend.old_log_probs=from_update`'s policy loss registered with verl's, in the actor's process
    (`loss.py`)."""
    import backends.verl.loss  # noqa: F401  (registers it)


# each patched module: what is applied to it once it has run
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "verl.utils.import_utils": hide_trl,
    "verl.utils.torch_functional": vectorized_logprobs,
    "verl.trainer.ppo.core_algos": register_loss,
}
# verl's modules that bind `is_trl_available` by name (`from verl.utils.import_utils import is_trl_available`)
BINDERS = ("verl.utils.model", "verl.models.transformers.monkey_patch")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds a module of `PATCHES` as Python would, and applies its patch once the module has run."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def run_and_patch(module: ModuleType) -> None:
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = run_and_patch  # type: ignore[method-assign]
        return spec


def worker_setup() -> None:
    """Applies `PATCHES` to verl in this process: to each module imported already, to the others when they are."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if "verl.utils.import_utils" in sys.modules:
        for name in BINDERS:
            if name in sys.modules:
                hide_trl(sys.modules[name])
    if not all(name in sys.modules for name in PATCHES) and not any(
        isinstance(finder, _PatchOnImport) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _PatchOnImport())

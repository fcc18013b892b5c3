"""What `backend.vllm_own_process` adds to vLLM's GPU worker in the engine process (vLLM's `worker_extension_cls`):
loading the trainer's weights from CUDA IPC handles, so the copy stays on the GPU and nothing is serialized but the
handles. Imported by vLLM's engine process, so it imports nothing of the project's; imported there, it makes that
process end with the trainer's (`die_with_parent`)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

PR_SET_PDEATHSIG = 1  # linux/prctl.h
ENGINE_PROCESS = "EngineCore"  # the name vLLM gives its engine process (vllm/v1/engine/utils.py)


def die_with_parent() -> None:
    """In vLLM's engine process: SIGKILL when the process that started it dies, even by SIGKILL (else an orphaned
    engine would hold its share of the GPU, and the next run's engine would not start); if it died already, exit.
    The parent is the thread that started it (VLLMEngine's engine thread, which ends with `close()`). Elsewhere (the
    trainer, tests) nothing. Linux only (prctl)."""
    parent = multiprocessing.parent_process()
    if parent is None or not multiprocessing.current_process().name.startswith(ENGINE_PROCESS):
        return
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent.pid:
        os._exit(1)


die_with_parent()


def gpu_uuid(device: torch.device | int) -> str:
    """The GPU's UUID: the same GPU whatever number a process gives it (the trainer's side uses it too)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def on_device(rebuild: Any, args: tuple[Any, ...], device: int) -> tuple[Any, ...]:
    """A CUDA tensor's reduction (torch's `rebuild_cuda_tensor`, its 7th argument the device index) made to open on
    `device`; any other as it is."""
    if rebuild is not rebuild_cuda_tensor:
        return args
    return (*args[:6], device, *args[7:])


class SharedWeights:
    """Mixed into vLLM's worker: `collective_rpc("load_shared_weights", args=(payload,))`."""

    model_runner: Any  # the worker's

    def load_shared_weights(self, payload: bytes) -> int:
        """Load one bucket of weights: `payload` pickles (the UUID of the trainer's GPU, [(name, torch.multiprocessing's
        reduction of the tensor)]), the tensors living in the trainer's process on that GPU, which must be this
        process's. Returns how many; the copy is finished when it returns, so the trainer may free or overwrite its
        tensors then. The trainer may number that GPU otherwise (it sees every GPU, this process only its own): a
        handle is opened on this process's device (as vLLM's own IPC weight transfer does)."""
        trainer_gpu, shared = pickle.loads(payload)
        device = torch.cuda.current_device()
        if (engine_gpu := gpu_uuid(device)) != trainer_gpu:
            raise RuntimeError(
                f"vLLM's engine process runs on GPU {engine_gpu}, the trainer's weights are on {trainer_gpu}: "
                "the engine process must start on the trainer's GPU (inference.vllm.engine_process_environment)"
            )
        weights = [(name, rebuild(*on_device(rebuild, args, device))) for name, (rebuild, args) in shared]
        self.model_runner.model.load_weights(weights=weights)
        torch.cuda.current_stream().synchronize()
        return len(weights)

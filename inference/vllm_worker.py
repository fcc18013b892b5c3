"""What `backend.vllm_own_process` adds to vLLM's GPU worker in the engine process (vLLM's `worker_extension_cls`):
loading the trainer's weights from CUDA IPC handles, so the copy stays on the GPU and nothing is serialized but the
handles. Imported by vLLM's engine process, so it imports nothing of the project's."""

from __future__ import annotations

import pickle
from typing import Any

import torch


class SharedWeights:
    """Mixed into vLLM's worker: `collective_rpc("load_shared_weights", args=(payload,))`."""

    model_runner: Any  # the worker's

    def load_shared_weights(self, payload: bytes) -> int:
        """Load one bucket of weights: `payload` pickles [(name, torch.multiprocessing's reduction of the tensor)],
        the tensors living in the trainer's process. Returns how many; the copy is finished when it returns, so the
        trainer may free or overwrite its tensors then."""
        weights = [(name, rebuild(*args)) for name, (rebuild, args) in pickle.loads(payload)]
        self.model_runner.model.load_weights(weights=weights)
        torch.cuda.current_stream().synchronize()
        return len(weights)

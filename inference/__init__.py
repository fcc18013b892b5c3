"""Generation for the policy being trained: engines (token ids in, sampled ids and log-probs out) and the policy
server that puts an OpenAI-compatible endpoint in front of them.

    engine.py         the interface every engine honours (`Completion`, `Engine`, `ContinuousEngine`)
    hf.py             `HFGenerate`: transformers' `model.generate` (any model, any device; what TRL does)
    static.py         `StaticGenerate`: static KV cache + CUDA graphs for Qwen2/Qwen3/Llama (fixed batches)
    vllm.py           `VLLMEngine`: vLLM in this process, continuous batching, prefix caching, sleep/wake
                      (`VLLMProcessEngine`: its engine core in a process of its own)
    ledger.py         `TokenLedger`: each rollout's calls token in, token out, and the records the trainer reads back
    batcher.py        `Batcher`: the concurrent rollouts' requests generated together
    policy_server.py  the endpoint agents call during training and validation: ledger and batcher behind HTTP

`make_engine` picks one by name (`backend.generation_engine`).
"""

from __future__ import annotations

from inference.engine import Engine
from inference.hf import HFGenerate
from inference.static import StaticGenerate
from inference.vllm import VLLMSettings, require_vllm, vllm_available, vllm_engine

ENGINES = ("hf", "static", "vllm")


def resolve_engine(name: str, device: str) -> str:
    """`auto`: vLLM on CUDA where it is installed (fastest on agent workloads: `bench/agent_rollouts.py`), else the
    static engine on CUDA, else HF generate (CPU)."""
    if name != "auto":
        return name
    if device.startswith("cuda"):
        return "vllm" if vllm_available() else "static"
    return "hf"


def make_engine(
    name: str,
    device: str,
    *,
    cuda_graphs: bool = True,
    compile: bool = False,
    vllm: VLLMSettings | None = None,
) -> Engine:
    """The engine `name` (or `auto`, see `resolve_engine`) for `device`; vLLM needs its settings."""
    name = resolve_engine(name, device)
    if name == "static":
        return StaticGenerate(cuda_graphs=cuda_graphs, compile=compile)
    if name == "hf":
        return HFGenerate()
    if name == "vllm":
        require_vllm(device)
        if vllm is None:
            raise ValueError("the vLLM engine needs its settings (VLLMSettings)")
        return vllm_engine(vllm)
    raise ValueError(f"unknown generation engine {name!r} (known: auto, {', '.join(ENGINES)})")

"""Where a decode step of the static engine goes: its time, the floor of its matrix products alone, its kernels.

For one model shape at a time (random weights, bf16, CUDA only):

- `engine_ms`: one decode step of `StaticGenerate` (CUDA graphs, compiled layers), timed over whole generate calls
  of `--batch` rows x `--tokens` new tokens (prefill included, so slightly above the step itself);
- `matmul_floor_ms`: the same step's matrix products alone (every projection and the LM head at `--batch` rows),
  replayed as one CUDA graph: what the step would cost with nothing else in it;
- `bound_ms`: one read of those weights at the copy bandwidth;
- `kernels`: the step's kernels, from the profiler over the engine without graphs (the same kernels, launched one by
  one), by total GPU time.

    python bench/decode_profile.py --cases qwen25_7b-lora --out bench/results/decode_profile_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.rollout_speed import CASES, SHAPES, copy_bandwidth, random_model  # noqa: E402


def build(case: str) -> Any:
    from peft import get_peft_model

    from models.finetune import LoRA

    shape, finetune = CASES[case]
    model = random_model(SHAPES["real"][shape], "cuda")
    return (get_peft_model(model, LoRA().peft_config()) if finetune == "lora" else model).eval()


def graph_ms(step: Callable[[], None], replays: int = 50) -> float:
    """Milliseconds per replay of `step` captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays * 1e3


def matmul_floor(model: Any, batch: int) -> tuple[float, int]:
    """The decode step's projections and LM head at `batch` rows, alone: milliseconds and bytes of weights read."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weights = []
    for layer in base.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            weights.append(getattr(module, "base_layer", module).weight)
    weights.append(base.get_output_embeddings().weight)
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], device="cuda", dtype=w.dtype) for w in weights}

    def step() -> None:
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    return graph_ms(step), sum(w.numel() * w.element_size() for w in weights)


def engine_ms(model: Any, prompts: list[list[int]], tokens: int, repeats: int = 3) -> float:
    from inference.static import StaticGenerate

    engine = StaticGenerate(cuda_graphs=True, compile=True)
    kwargs = {"temperature": 1.0, "top_p": 1.0, "eos_ids": {-1}, "pad_id": 0}
    engine.generate(model, prompts, [tokens] * len(prompts), **kwargs)  # compile and capture
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(model, prompts, [tokens] * len(prompts), **kwargs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    engine.release()
    return statistics.median(times) / tokens * 1e3


def kernels(model: Any, prompts: list[list[int]], tokens: int = 65, top: int = 20) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from inference.static import StaticGenerate

    engine = StaticGenerate(cuda_graphs=False, compile=True)
    kwargs = {"temperature": 1.0, "top_p": 1.0, "eos_ids": {-1}, "pad_id": 0}
    engine.generate(model, prompts, [tokens] * len(prompts), **kwargs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(model, prompts, [tokens] * len(prompts), **kwargs)
        torch.cuda.synchronize()
    engine.release()
    events = sorted(
        (e for e in prof.key_averages() if e.device_type.name == "CUDA"), key=lambda e: -e.self_device_time_total
    )
    steps = tokens - 1
    return {
        "per_step": sum(e.count for e in events) / steps,
        "gpu_ms_per_step": sum(e.self_device_time_total for e in events) / 1e3 / steps,
        "top": [
            {"kernel": e.key[:100], "per_step": e.count / steps, "ms_per_step": e.self_device_time_total / 1e3 / steps}
            for e in events[:top]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="qwen3_0_6b-full,qwen25_7b-lora")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=162)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    report: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "cases": {},
    }
    for case in args.cases.split(","):
        model = build(case)
        generator = torch.Generator().manual_seed(0)
        shape = (args.batch, args.prompt_tokens)
        prompts = torch.randint(3, model.config.vocab_size, shape, generator=generator).tolist()
        floor, weight_bytes = matmul_floor(model, args.batch)
        result = {
            "engine_ms": engine_ms(model, prompts, args.tokens),
            "matmul_floor_ms": floor,
            "bound_ms": weight_bytes / bandwidth * 1e3,
            "weights_gb": weight_bytes / 1e9,
            "kernels": kernels(model, prompts),
        }
        report["cases"][case] = result
        print(
            f"{case}: engine {result['engine_ms']:.2f} ms/step, matrix products alone {floor:.2f} ms, "
            f"bound {result['bound_ms']:.2f} ms; {result['kernels']['per_step']:.0f} kernels a step",
            flush=True,
        )
        for k in result["kernels"]["top"][:10]:
            print(f"    {k['ms_per_step']:.3f} ms  x{k['per_step']:.0f}  {k['kernel']}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

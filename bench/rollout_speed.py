"""GRPO step time: plain TRL (HF generate) against backend=trl (agent rollouts on the policy server), side by side.

Random-init models of the real shapes, the same batch for every variant (prompts x group rollouts, each forced to
`--tokens` generated tokens: plain TRL through `min_new_tokens`, ours through an eos id no token has), the same
Spider-style prompts (the SQL agent's first call rendered with Qwen's chat template), bf16 on CUDA. Each side runs
its own defaults otherwise: plain TRL with gradient checkpointing on (TRL's default), ours as `conf/backend/trl.yaml`
sets it (off). The generation time is timed apart, so both ratios are reported. Variants:

- `plain`: TRL 1.16's GRPOTrainer at its defaults: HF `generate`, dynamic cache.
- `ours`: backend=trl as `conf/backend/trl.yaml` configures it (generation_engine=auto: the static engine on CUDA).
- `ours_graphs`, `ours_compiled`: the static engine (static KV cache, CUDA graphs) without / with its decode layers
  compiled (torch.compile) before capture; `ours_eager`: neither graphs nor compile.
- `ours_hf`: `generation_engine=hf` (policy server and agent, HF generate): what the engine adds.

    for c in qwen3_0_6b-full qwen3_0_6b-lora qwen25_7b-lora; do   # one process per shape (in one process,
        python bench/rollout_speed.py --cases $c --out bench/results/rollout_speed_$c.json   # torch.compile
    done                                                           # reaches its recompile limit across models)
    python bench/rollout_speed.py --shapes tiny --device cpu --steps 2     # the same code on a 2-layer model

Prints a table (median step time, generated tokens/s, ratio to plain, percent of the bandwidth bound, peak memory)
and writes JSON after every variant.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config, TrainerCallback

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "real": {
        "qwen3_0_6b": {
            "cls": "qwen3",
            "vocab_size": 151936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "tie_word_embeddings": True,
        },
        "qwen25_7b": {
            "cls": "qwen2",
            "vocab_size": 152064,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "tie_word_embeddings": False,
        },
    },
    "tiny": {
        "qwen3_0_6b": {
            "cls": "qwen3",
            "vocab_size": 2048,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "tie_word_embeddings": True,
        },
        "qwen25_7b": {
            "cls": "qwen2",
            "vocab_size": 2048,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
        },
    },
}
CASES = {
    "qwen3_0_6b-full": ("qwen3_0_6b", "full"),
    "qwen3_0_6b-lora": ("qwen3_0_6b", "lora"),
    "qwen25_7b-lora": ("qwen25_7b", "lora"),
}
NO_TOKEN = -1  # an eos id no token has: generation runs to its length limit (transformers warns and goes on)


def random_model(shape: dict[str, Any], device: str, dtype: torch.dtype | None = None, init: float = 0.02) -> Any:
    fields = {k: v for k, v in shape.items() if k != "cls"}
    config_cls = Qwen3Config if shape["cls"] == "qwen3" else Qwen2Config
    config = config_cls(
        **fields,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
        initializer_range=init,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype or (torch.bfloat16 if device == "cuda" else torch.float32), attn_implementation="sdpa"
        )
    return model


def check_engines(device: str, compile_check: bool) -> list[dict[str, Any]]:
    """The static engine (CUDA graphs on CUDA) against HF generate and the model's forward, float32 tiny shapes.

    Weights are drawn wide (std 0.5) so that next-token distributions are peaked and a wrong hidden state shows.
    """
    from peft import LoraConfig, get_peft_model

    from inference import HFGenerate, StaticGenerate

    checks = []
    for name, shape in SHAPES["tiny"].items():
        for finetune in ("full", "lora"):
            model = random_model(shape, device, torch.float32, init=0.5).eval()
            if finetune == "lora":
                model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
                for key, p in model.named_parameters():
                    if "lora_B" in key:
                        torch.nn.init.normal_(p, std=0.5)
            gen = torch.Generator().manual_seed(1)
            prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (5, 17, 33, 300)]
            kw = {"top_p": 1.0, "eos_ids": {2}, "pad_id": 0}
            engine = StaticGenerate(block=64, compile=compile_check and finetune == "lora")
            plain = HFGenerate().generate(model, prompts, [40, 300, 7, 120], temperature=0.0, **kw)
            fast = engine.generate(model, prompts, [40, 300, 7, 120], temperature=0.0, **kw)
            sampled = engine.generate(model, prompts * 4, [200] * 16, temperature=0.8, **kw)
            worst = 0.0
            for prompt, c in zip(prompts * 4, sampled, strict=True):
                ids = torch.tensor([prompt + c.token_ids], device=device)
                with torch.no_grad():
                    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / 0.8
                expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
                worst = max(worst, float((expected.cpu() - torch.tensor(c.logprobs)).abs().max()))
            checks.append(
                {
                    "shape": name,
                    "finetune": finetune,
                    "greedy_equal_to_hf_generate": [
                        a.token_ids == b.token_ids for a, b in zip(plain, fast, strict=True)
                    ],
                    "greedy_lengths": [len(c.token_ids) for c in fast],
                    "sampled_max_abs_logprob_diff": worst,
                    "graph_captures": engine.graph_captures,
                    "compiled": engine.compile,
                }
            )
            print("check", checks[-1], flush=True)
    return checks


def compose(case: str, args: argparse.Namespace, cache: Path, engine: str) -> dict[str, Any]:
    """The project's own config for this case (agent, reward, data, algorithm, backend), built as launch.py does."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from jobs.config import build_components

    model_name, finetune = CASES[case]
    overrides = [
        f"model={'qwen2.5-7b-instruct' if model_name == 'qwen25_7b' else 'qwen3-0.6b'}",
        f"finetune={finetune}",
        f"paths.cache_dir={cache}",
        "data.generate.n_train=64",
        "data.generate.n_dev=4",
        "agent.check_step=false",
        f"algorithm.group_size={args.group}",
        f"algorithm.tasks_per_step={args.prompts}",
        f"algorithm.micro_batch_size={args.group}",
        f"algorithm.max_response_length={args.tokens}",
        f"algorithm.max_steps={args.warmup + args.steps}",
        f"backend.device={args.device}",
        f"backend.generation_engine={engine}",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    return build_components(cfg)


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (device synchronized) and the generated tokens TRL logged for it."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.tokens: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        _sync()
        self._start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        _sync()
        self.steps.append(time.perf_counter() - self._start)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if logs and "completions/mean_length" in logs:
            self.tokens.append(logs["completions/mean_length"])


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generation(trainer: Any) -> list[float]:
    """Wrap the trainer's generation (rollout_func for ours, HF generate for plain); returns the list it fills."""
    times: list[float] = []
    inner = trainer._generate

    def wrapper(prompts: list[Any]) -> Any:
        _sync()
        start = time.perf_counter()
        out = inner(prompts)
        _sync()
        times.append(time.perf_counter() - start)
        return out

    trainer._generate = wrapper
    return times


def run_variant(case: str, variant: str, args: argparse.Namespace, cache: Path, out_dir: Path) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from backends.trl.arms import passthrough_reward
    from backends.trl.rollouts import AgentRollouts, task_prompt
    from backends.trl.trainer import AgentGRPOTrainer
    from inference.policy_server import PolicyServer
    from models.tiny import train_tokenizer

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0  # what earlier variants left
    engine = {"ours_hf": "hf"}.get(variant, "static")
    parts = compose(case, args, cache, engine)
    algo, agent, backend, finetune = parts["algorithm"], parts["agent"], parts["backend"], parts["finetune"]
    if variant in ("ours_graphs", "ours_compiled", "ours_eager"):
        backend.cuda_graphs = variant != "ours_eager"
        backend.compile_decode = variant == "ours_compiled"
    tasks = parts["data"].train_tasks()[: 8 * args.prompts]
    first = [agent.first_messages(t) for t in tasks]
    tokenizer = train_tokenizer([m["content"] for conv in first for m in conv], vocab_size=2048)
    rendered = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in first]
    prompt_tokens = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in rendered]
    model = random_model(SHAPES[args.shapes][CASES[case][0]], args.device)
    timer = StepTimer()
    if variant == "plain":
        config = GRPOConfig(  # TRL's defaults, but for the batch shape and the forced length
            output_dir=str(out_dir / f"{case}-{variant}"),
            num_generations=args.group,
            per_device_train_batch_size=args.group,
            gradient_accumulation_steps=args.prompts,
            max_completion_length=args.tokens,
            generation_kwargs={"min_new_tokens": args.tokens},
            max_steps=args.warmup + args.steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=args.device == "cpu",
            bf16=args.device == "cuda",
            gradient_checkpointing=args.device == "cuda",
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
            args=config,
            train_dataset=Dataset.from_list([{"prompt": p} for p in rendered]),
            processing_class=tokenizer,
            peft_config=finetune.peft_config(),
            callbacks=[timer],
        )
        server = None
    else:
        server = PolicyServer(
            model,
            tokenizer,
            max_prompt_tokens=algo.max_prompt_length,
            max_response_tokens=algo.max_response_length,
            batch_wait_s=backend.batch_wait_s,
            engine=backend.engine(algo.max_prompt_length + algo.max_response_length),
        )
        rollouts = AgentRollouts(agent, parts["reward"], server, algo.sampling(algo.temperature), args.tokens)
        trainer = AgentGRPOTrainer(  # as backend=trl builds it: with the importance-sampling correction
            model=model,
            reward_funcs=[passthrough_reward("exec_match")],
            args=backend.grpo_config(algo, str(out_dir / f"{case}-{variant}"), 0, args.device),
            train_dataset=Dataset.from_list([{"prompt": task_prompt(t)} for t in tasks]),
            processing_class=tokenizer,
            peft_config=finetune.peft_config(),
            rollout_func=rollouts,
            callbacks=[timer],
            is_correction=algo.is_correction,
            is_cap=algo.is_cap,
        )
    model.generation_config.eos_token_id = NO_TOKEN  # after GRPOTrainer, which sets the tokenizer's eos there
    generation = timed_generation(trainer)
    wall = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - wall
    batch = args.prompts * args.group
    measured = timer.steps[args.warmup :]
    gen = generation[args.warmup :]
    tokens = statistics.median(timer.tokens[args.warmup :]) * batch if timer.tokens else float("nan")
    result = {
        "case": case,
        "variant": variant,
        "engine": type(server.engine).__name__ if server else "trl:hf_generate",
        "steps": timer.steps,
        "generation_s": generation,
        "median_step_s": statistics.median(measured),
        "median_generation_s": statistics.median(gen),
        "generated_tokens_per_step": tokens,
        "tokens_per_s": tokens / statistics.median(measured),
        "generation_tokens_per_s": tokens / statistics.median(gen),
        "prompt_tokens_mean": statistics.mean(prompt_tokens),
        "peak_memory_gib": (torch.cuda.max_memory_allocated() - before) / 2**30 if torch.cuda.is_available() else None,
        "memory_left_by_earlier_variants_gib": before / 2**30,
        "wall_s": wall,
        "graph_captures": getattr(server.engine, "graph_captures", None) if server else None,
    }
    result |= bandwidth_bound(trainer, model, batch, statistics.mean(prompt_tokens) + args.tokens / 2, args)
    del trainer, model, server, parts, backend
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def bandwidth_bound(trainer: Any, model: Any, batch: int, mean_context: float, args: argparse.Namespace) -> dict:
    """Tokens/s if each decode step only read the weights once and the KV cache of the batch, at copy bandwidth."""
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    config = model.config
    if not config.tie_word_embeddings:  # the input embedding is only gathered (batch rows), not read whole
        weights -= config.vocab_size * config.hidden_size * next(model.parameters()).element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * mean_context * batch
    step_bytes = weights + kv
    return {"decode_step_bytes": step_bytes, "bound_tokens_per_s": batch * args.bandwidth / step_bytes}


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of 20 copies of 1 GiB."""
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 4 / statistics.median(times[5:])


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| case | variant | median step s | generation s | gen tok/s | step tok/s | x plain (step) | x plain (gen) "
        "| % bound (gen) | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    plain = {r["case"]: r for r in results if r["variant"] == "plain"}
    for r in results:
        p = plain.get(r["case"])
        ratio = f"{p['median_step_s'] / r['median_step_s']:.1f}" if p else "-"
        gen_ratio = f"{p['median_generation_s'] / r['median_generation_s']:.1f}" if p else "-"
        peak = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        lines.append(
            f"| {r['case']} | {r['variant']} | {r['median_step_s']:.2f} | {r['median_generation_s']:.2f} "
            f"| {r['generation_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | {ratio} | {gen_ratio} "
            f"| {100 * r['generation_tokens_per_s'] / r['bound_tokens_per_s']:.1f} | {peak} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="real")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--variants", default="plain,ours")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--check", action="store_true", help="first check the static engine against HF generate")
    parser.add_argument("--check-compile", action="store_true", help="check the compiled engine too (LoRA cases)")
    args = parser.parse_args()

    import peft
    import transformers
    import trl

    args.bandwidth = copy_bandwidth() if args.device == "cuda" else float("nan")
    info = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "copy_bandwidth_bytes_per_s": args.bandwidth,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "peft": peft.__version__,
        },
        "batch": {"prompts": args.prompts, "group": args.group, "generated_tokens": args.tokens},
        "timed_steps": args.steps,
        "warmup_steps": args.warmup,
    }
    if args.check:
        info["checks"] = check_engines(args.device, args.check_compile)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            for variant in args.variants.split(","):
                print(f"== {case} {variant}", flush=True)
                try:
                    results.append(run_variant(case, variant, args, Path(tmp) / "cache", Path(tmp)))
                except Exception as exc:  # one failing variant must not lose the others' numbers
                    print(f"!! {case} {variant} failed: {exc!r}", flush=True)
                    results.append({"case": case, "variant": variant, "error": repr(exc)})
                if args.out:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(info | {"results": results}, indent=1))
    print(table([r for r in results if "error" not in r]))


if __name__ == "__main__":
    main()

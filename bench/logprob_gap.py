"""How far the sampler's log-probs are from the trainer's: the engine/trainer mismatch that `algorithm.is_correction`
corrects, measured through the training code itself.

For each engine (the static engine with CUDA graphs and compiled decode layers; vLLM colocated, as backend=trl runs
them on CUDA; and HF `generate`), one process, one model:
1. the engine samples completions for a batch of prompts of real agent lengths (bf16 weights, temperature 1) and
   reports each token's log-prob;
2. `AgentGRPOTrainer` (TRL's GRPOTrainer with the correction, bf16 as backend=trl configures it on CUDA) scores the
   same tokens with the model's forward through TRL's own code, through a rollout function that hands it the engine's
   ids and log-probs, and logs `sampling/logp_diff/{mean,max}` and `sampling/is_ratio/{mean,clipped_frac}`.

The weights are random (no hub weights on these machines). A random model's logits are small and its next-token
distribution nearly uniform, which hides bf16 rounding; so the final norm's weight is scaled until the mean entropy of
the sampled distribution is that of a trained model sampling at temperature 1 (`--entropy`, nats), and the report
gives the entropy reached. Both the raw random model and the scaled one are measured.

    python bench/logprob_gap.py --shape qwen3_0_6b --out bench/results/logprob_gap_h100.json
    python bench/logprob_gap.py --shape qwen3_0_6b --engines static,vllm --out bench/results/logprob_gap_vllm_h100.json
    python bench/logprob_gap.py --shape tiny --device cpu        # the same code on a 2-layer model (gap ~0)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen3Config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.rollout_speed import SHAPES as ROLLOUT_SHAPES  # noqa: E402  (after the path)

# The Qwen3-0.6B shapes of bench/rollout_speed.py: the real one, and its tiny stand-in for CPU.
SHAPES: dict[str, dict[str, Any]] = {
    name: {k: v for k, v in ROLLOUT_SHAPES[size]["qwen3_0_6b"].items() if k != "cls"}
    for name, size in (("qwen3_0_6b", "real"), ("tiny", "tiny"))
}
NO_TOKEN = 2**31 - 1  # an eos id no token has: every row generates its whole budget


def build(shape: str, folder: Path, device: str) -> tuple[PreTrainedModel, Any]:
    """A random model of `shape` saved with a minimal tokenizer (TRL needs one to pad), loaded as backend=trl loads."""
    from models.tiny import train_tokenizer

    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=8192, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    train_tokenizer(["SELECT name FROM people WHERE age > 30"] * 10, 300).save_pretrained(folder)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    return model, AutoTokenizer.from_pretrained(folder)


@torch.no_grad()
def entropy_at(model: PreTrainedModel, prompts: list[list[int]]) -> float:
    """Mean next-token entropy (nats, temperature 1) over the last 64 positions of a few prompts."""
    device = next(model.parameters()).device
    values = []
    for ids in prompts[:4]:
        logits = model(torch.tensor([ids], device=device)).logits[0, -64:].float()
        logp = torch.log_softmax(logits, dim=-1)
        values.append(float(-(logp.exp() * logp).sum(-1).mean()))
    return statistics.mean(values)


def scale_to_entropy(model: PreTrainedModel, prompts: list[list[int]], target: float) -> tuple[float, float]:
    """Scale the final norm's weight (bisection on a log scale) until the entropy is about `target`."""
    norm = model.model.norm.weight
    base = norm.detach().clone()
    low, high = 1.0, 1000.0
    for _ in range(14):
        mid = (low * high) ** 0.5
        norm.data.copy_(base * mid)
        if entropy_at(model, prompts) > target:
            low = mid
        else:
            high = mid
    scale = (low * high) ** 0.5
    norm.data.copy_(base * scale)
    return scale, entropy_at(model, prompts)


def make(engine_name: str, device: str, args: argparse.Namespace) -> Any:
    """The engine as backend=trl builds it on CUDA (static: graphs + compiled layers; vllm: colocated)."""
    from inference import VLLMSettings, make_engine

    settings = VLLMSettings(max_model_len=args.max_prompt + args.tokens, gpu_memory_utilization=0.5)
    return make_engine(engine_name, device, cuda_graphs=True, compile=True, vllm=settings)


def measure(args: argparse.Namespace, model: PreTrainedModel, tokenizer: Any, engine: Any, out: Path) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig

    from backends.trl.trainer import AgentGRPOTrainer

    device = next(model.parameters()).device.type
    engine.load(model)  # vLLM copies the weights (the scaled variant changed the final norm); the others read them
    rng = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.batch,), generator=rng).tolist()
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=rng).tolist() for n in lengths]
    timings: list[float] = []

    def rollout_func(batch_prompts: list[Any], trainer: Any) -> dict[str, Any]:
        start = time.monotonic()
        completions = engine.generate(
            model,
            prompts[: len(batch_prompts)],
            [args.tokens] * len(batch_prompts),
            temperature=1.0,
            top_p=1.0,
            eos_ids={NO_TOKEN} if engine.name != "vllm" else set(),  # nothing stops a row: vLLM ignores eos
            pad_id=0,
        )
        timings.append(time.monotonic() - start)
        return {
            "prompt_ids": prompts[: len(batch_prompts)],
            "completion_ids": [c.token_ids for c in completions],
            "logprobs": [c.logprobs for c in completions],
            "env_mask": [[1] * len(c.token_ids) for c in completions],
            "rollout_reward": [float(i % 2) for i in range(len(batch_prompts))],
        }

    def reward(prompts: list[Any], completions: list[Any], rollout_reward: list[float], **_: Any) -> list[float]:
        return rollout_reward

    group = 4
    trainer = AgentGRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=GRPOConfig(
            output_dir=str(out),
            num_generations=group,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.batch // args.micro_batch,
            generation_batch_size=args.batch,
            max_completion_length=args.tokens,
            temperature=1.0,
            beta=0.0,
            loss_type="dapo",
            bf16=device == "cuda",
            gradient_checkpointing=False,
            use_cpu=device == "cpu",
            report_to=[],
            logging_steps=1,
            disable_tqdm=True,
        ),
        train_dataset=Dataset.from_list([{"prompt": f"p{i}"} for i in range(args.batch // group)]),
        processing_class=tokenizer,
        rollout_func=rollout_func,
        is_correction="token_truncate",
        is_cap=2.0,
    )
    model.generation_config.eos_token_id = NO_TOKEN  # after the trainer, which sets the tokenizer's eos there
    trainer.model.train()
    inputs = [{"prompt": f"p{i // group}"} for i in range(args.batch)]
    rounds = []
    for _ in range(args.rounds):
        trainer._generate_and_score_completions(inputs)
        rounds.append({k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("sampling/")})
    engine.release()
    return {
        "engine": engine.name,
        "rounds": rounds,
        "median": {k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
        "generation_s": timings,
        "prompt_tokens_mean": statistics.mean(lengths),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3_0_6b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--engines", default="static,hf")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="generated tokens per row")
    parser.add_argument("--min-prompt", type=int, default=300)
    parser.add_argument("--max-prompt", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--entropy", type=float, default=1.0, help="target entropy (nats) of the scaled model")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import transformers
    import trl

    report: dict[str, Any] = {
        "command": " ".join(["bench/logprob_gap.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
        },
        "shape": args.shape,
        "batch": {
            "rows": args.batch,
            "generated_tokens": args.tokens,
            "prompt_tokens": [args.min_prompt, args.max_prompt],
        },
        "results": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = build(args.shape, Path(tmp) / "model", args.device)
        engines = {name: make(name, args.device, args) for name in args.engines.split(",")}
        probe = [torch.randint(1, model.config.vocab_size, (256,)).tolist() for _ in range(4)]
        for variant in ("random", "scaled"):
            if variant == "scaled":
                scale, reached = scale_to_entropy(model, probe, args.entropy)
            else:
                scale, reached = 1.0, entropy_at(model, probe)
            for engine, built in engines.items():
                result = measure(args, model, tokenizer, built, Path(tmp) / "trainer")
                result |= {"variant": variant, "norm_scale": scale, "entropy_nats": reached}
                report["results"].append(result)
                m = result["median"]
                print(
                    f"{variant:7s} H={reached:5.2f} {engine:6s} |dlogp| mean {m['sampling/logp_diff/mean']:.4f} "
                    f"max {m['sampling/logp_diff/max']:.3f}  IS ratio mean {m['sampling/is_ratio/mean']:.4f}  "
                    f"clipped {m['sampling/is_ratio/clipped_frac']:.5f}",
                    flush=True,
                )
                if args.out:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

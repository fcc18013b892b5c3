"""Agent rollouts as a GRPO step really produces them, per generation engine: HF generate (plain TRL), static, vLLM.

The workload is the realistic recipe, not a fixed-length batch: the Spider SQL agent with the check step and 3 SQL
turns (write, check, rewrite, check, ...: up to 6 model calls a rollout), 32 tasks x 4 rollouts per step, prompt
budget 4096 and response budget 2048 tokens per rollout, the real chat template of the model family, all through the
real policy server (token in, token out) and `AgentGRPOTrainer` (backend=trl's trainer, LoRA as the recipe
`grpo-qwen2.5-coder-1.5b-1n1g-lora`), on random-init models of the real shapes, bf16.

Random weights never stop on their own and never write a verdict, so both are drawn, the same for every engine, from
generators seeded by (seed, rollout n, call k):
- call k of rollout n gets max_tokens = a lognormal draw (mean 450, sigma 0.8: median 327, a long tail; capped at
  2048, and by the server at what is left of the rollout's budget), and no eos id stops it;
- the agent's calls alternate write, check, rewrite, check, ...; a check call says the query is correct with
  probability 1/2 (the bench appends "THE QUERY IS CORRECT" to the reply the agent reads; nothing follows that call,
  so the recorded conversation stays exactly what was sampled), else the agent rewrites, up to 3 SQL turns. So a
  rollout makes 2, 4 or 6 calls (3.5 on average, about 1,600 sampled tokens), and the longest ones overflow the
  2,048-token response budget and are excluded from the update, the same for every engine.
The tokenizer is the project's byte-level BPE trained on the task text with the family's special tokens and chat
template (no hub tokenizer here): prompt lengths are close to, not equal to, Qwen's.

One engine per process (vLLM and torch.compile each own the GPU's state), one JSON each; `--table` joins them:

    for e in hf static vllm; do python bench/agent_rollouts.py --shape qwen25_1_5b --engine $e --out r_$e.json; done
    python bench/agent_rollouts.py --table r_hf.json r_static.json r_vllm.json
    python bench/agent_rollouts.py --shape tiny --device cpu --engine hf --steps 1 --warmup 0 --tasks 2   # CPU check

`--async` runs the same steps with `algorithm.async_rollouts` (the next step's batch generates during this step's
update; `rollout s` is then what a step waited for its rollouts, tokens/s the batch's own), and one more step that is
not timed: the last step of a run has nothing generating behind it. Side by side:

    for a in "" --async; do python bench/agent_rollouts.py --engine vllm --steps 4 $a --out r_vllm$a.json; done

`--async --partial` adds `algorithm.partial_rollouts` (each step loads its weights while the batch read ahead still
generates and starts the next batch before waiting for it); `--carry-over` adds `algorithm.carry_over` (a step
trains the groups finished first and carries the others over; with `--override algorithm.max_staleness=2`).
`--profile-step K` adds step K's operators and kernels by their own device time, and the kernels' time against the
step's and the update's, to the result's `profile` (torch.profiler, this process only: with
`backend.vllm_own_process=true` and without `--async`, the update, the weight sync and the agents, no generation).

Reported per engine: rollout phase wall time (median over timed steps), generated tokens (model tokens sampled, all
rollouts) and tokens/s, the share of a bandwidth bound (every decode step reading the weights once and the running
batch's KV cache, at the measured copy bandwidth, with all rollouts of the step in flight), the GRPO step time and its
phases (metrics.jsonl's `timing_s/*`), peak memory (torch's allocator, and the device's used memory, which includes
vLLM's own pool).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.rollout_speed import SHAPES as SPEED_SHAPES  # noqa: E402
from bench.rollout_speed import StepTimer, bandwidth_bound, copy_bandwidth, random_model  # noqa: E402

QWEN25_1_5B = {
    "cls": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
QWEN3_1_7B = {
    "cls": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}
# shape: (model config, chat template, the project's model preset it stands for)
SHAPES: dict[str, tuple[dict[str, Any], str, str]] = {
    "qwen25_1_5b": (QWEN25_1_5B, "qwen25", "qwen2.5-coder-1.5b-instruct"),
    "qwen3_1_7b": (QWEN3_1_7B, "qwen3", "qwen3-0.6b"),
    "qwen25_7b": (SPEED_SHAPES["real"]["qwen25_7b"], "qwen25", "qwen2.5-7b-instruct"),
    "tiny": (SPEED_SHAPES["tiny"]["qwen25_7b"], "qwen25", "qwen2.5-7b-instruct"),
}
NO_TOKEN = -1  # the eos id: no token has it, so nothing stops before its drawn length
ENGINE_STATS = ("steps", "max_running", "weight_loads", "graph_captures")
MEAN_LENGTH, SIGMA, MAX_CALL, P_CORRECT = 450.0, 0.8, 2048, 0.5


def drawn_length(seed: int, rollout: int, call: int) -> int:
    """Call `call` of rollout `rollout`: lognormal with mean MEAN_LENGTH, capped at MAX_CALL (at least 1)."""
    rng = np.random.default_rng([seed, rollout, call])
    mu = math.log(MEAN_LENGTH) - SIGMA**2 / 2
    return int(min(MAX_CALL, max(1, round(rng.lognormal(mu, SIGMA)))))


def check_passes(seed: int, rollout: int, call: int) -> bool:
    """Whether check call `call` of rollout `rollout` says the query is correct (probability P_CORRECT)."""
    return bool(np.random.default_rng([seed, rollout, call, 1]).random() < P_CORRECT)


def bench_server_class() -> type:
    """The policy server, with each rollout's calls asking for their drawn lengths and its sampled tokens counted."""
    from agent.llm import OpenAIChat
    from agent.spider_sql import CORRECT
    from inference.policy_server import PolicyServer, ServerChat

    class DrawnLengthChat(ServerChat):
        rollout: int = 0
        calls: int = 0
        seed: int = 0

        async def chat(self, messages: list[dict[str, str]]) -> str:
            call = self.calls
            self.calls += 1
            self.sampling["max_tokens"] = drawn_length(self.seed, self.rollout, call)
            text = await super().chat(messages)
            if call % 2 == 1 and check_passes(self.seed, self.rollout, call):  # a check call: the rollout ends here
                text += f"\n{CORRECT}"
            return text

    class BenchServer(PolicyServer):
        seed = 0
        generated = 0  # model tokens sampled, all rollouts (excluded ones too)
        calls = 0

        def chat_model(self, rollout_id: str, sampling: dict[str, Any]) -> OpenAIChat:
            chat = super().chat_model(rollout_id, sampling)
            assert isinstance(chat, ServerChat)  # the in-process client training uses
            drawn = DrawnLengthChat(chat.client, chat.model, dict(chat.sampling), chat.complete)
            drawn.rollout, drawn.seed = int(rollout_id.lstrip("r")), self.seed
            return drawn

        device_used_gib = 0.0  # the most seen at the end of a rollout phase (vLLM still awake)

        def pop_records(self, rollout_id: str) -> list[Any]:
            self.device_used_gib = max(self.device_used_gib, device_used_gib())
            records = super().pop_records(rollout_id)
            self.generated += sum(len(r.completion_ids) for r in records)
            self.calls += len(records)
            return records

    return BenchServer


def run_steps(args: argparse.Namespace) -> int:
    """Steps the run trains: the warm-up and timed ones, and with --async one more, untimed: a run's last step has
    no batch generating behind it, so timing it would time a synchronous step."""
    return args.warmup + args.steps + int(args.asynchronous)


def compose(args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from jobs.config import build_components

    _, _, preset = SHAPES[args.shape]
    overrides = [
        f"model={preset}",
        f"finetune={args.finetune}",
        f"paths.cache_dir={cache}",
        f"data.generate.n_train={max(64, args.tasks * run_steps(args))}",
        "data.generate.n_dev=4",
        "agent=spider_sql",
        "agent.check_step=true",
        f"agent.max_turns={args.turns}",
        f"algorithm.group_size={args.group}",
        f"algorithm.tasks_per_step={args.tasks}",
        f"algorithm.micro_batch_size={args.micro_batch}",
        f"algorithm.max_prompt_length={args.prompt_budget}",
        f"algorithm.max_response_length={args.response_budget}",
        f"algorithm.max_steps={run_steps(args)}",
        f"algorithm.async_rollouts={str(args.asynchronous).lower()}",  # checked with the rest as a run's config
        f"algorithm.partial_rollouts={str(args.partial).lower()}",
        f"algorithm.carry_over={str(args.carry_over).lower()}",
        "algorithm.learning_rate=1e-5",
        f"backend.device={args.device}",
        f"backend.generation_engine={args.engine}",
        *args.override,
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    return build_components(cfg)


def device_used_gib() -> float:
    if not torch.cuda.is_available():
        return float("nan")
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


class StepProfile(TrainerCallback):
    """torch.profiler over one step (`--profile-step`, 0 = the first): the work of this process in it. With vLLM in
    its own process (`backend.vllm_own_process=true`) and no `--async`, that is the update, the weight sync and the
    agents' CPU work, without generation (vLLM's process is not profiled)."""

    TOP = 25  # operators and kernels kept, each by its own time on the device (on a CPU run: on the CPU)

    def __init__(self, step: int | None) -> None:
        self.step, self.profiler = step, None

    def on_step_begin(self, _args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            cuda = [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, *cuda])
            self.profiler.start()

    def on_step_end(self, _args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.profiler is not None and state.global_step == self.step + 1:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.stop()

    def summary(self, step_s: float, update_s: float) -> dict[str, Any]:
        """The step's operators (an operator's device time is its kernels') and kernels, each by own time (ms, every
        call summed), and the kernels' time against the step's and the update's."""
        from torch.autograd import DeviceType

        assert self.profiler is not None, f"step {self.step} never began"
        events = [e for e in self.profiler.key_averages() if not getattr(e, "is_user_annotation", False)]
        operators = [e for e in events if e.device_type == DeviceType.CPU]
        kernels = [e for e in events if e.device_type != DeviceType.CPU]
        busy_s = sum(e.self_device_time_total for e in kernels) / 1e6  # kernels on overlapping streams count twice
        own = (lambda e: e.self_device_time_total) if kernels else (lambda e: e.self_cpu_time_total)

        def top(some: list[Any]) -> list[dict[str, Any]]:
            return [
                {
                    "name": e.key,
                    "calls": e.count,
                    "self_device_ms": e.self_device_time_total / 1e3,
                    "self_cpu_ms": e.self_cpu_time_total / 1e3,
                }
                for e in sorted(some, key=own, reverse=True)[: self.TOP]
            ]

        return {
            "step": self.step,
            "step_s": step_s,
            "update_s": update_s,  # the step's update (PhaseLog's update_s): what the kernels' time compares with
            "device_busy_s": busy_s,
            "device_busy_share_of_step": busy_s / step_s,
            "device_busy_share_of_update": busy_s / update_s,
            "operators": top(operators),
            "kernels": top(kernels),
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset

    from backends.memory import DeviceMemory
    from backends.samples import EXCLUSION_REASONS
    from backends.trl.arms import passthrough_reward
    from backends.trl.rollouts import AgentRollouts, task_prompt
    from backends.trl.trainer import AgentGRPOTrainer
    from inference.weights import GenerationWeights
    from models.tiny import train_tokenizer

    shape, template, _ = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        parts = compose(args, Path(tmp) / "cache")
        algo, agent, backend, finetune = parts["algorithm"], parts["agent"], parts["backend"], parts["finetune"]
        tasks = parts["data"].train_tasks()[: args.tasks * run_steps(args)]
        first = [agent.first_messages(t) for t in tasks]
        tokenizer = train_tokenizer([m["content"] for conv in first for m in conv], 2048, template=template)
        prompt_tokens = [len(tokenizer.apply_chat_template(m, add_generation_prompt=True)["input_ids"]) for m in first]
        model = random_model(shape, args.device)
        engine = backend.engine(algo.max_prompt_length + algo.max_response_length, live_loads=args.partial)
        server = bench_server_class()(
            model,
            tokenizer,
            max_prompt_tokens=algo.max_prompt_length,
            max_response_tokens=algo.max_response_length,
            batch_wait_s=backend.batch_wait_s,
            engine=engine,
        )
        server.seed = args.seed
        # what the GPU has in use, per phase (the same figures as a training run's summary: backends/memory.py)
        memory = DeviceMemory(args.device).start() if torch.cuda.is_available() else None
        # --async: the next step's batch generates during this step's update, from weights copied at each load
        # (vLLM keeps its own); algorithm.async_rollouts in a training run
        weights = GenerationWeights(args.device, model.dtype, args.engine == "vllm", snapshot=True)
        rollouts = AgentRollouts(
            agent,
            parts["reward"],
            server,
            algo.sampling(algo.temperature),
            algo.max_response_length,
            weights=weights if args.asynchronous else None,
            memory=memory,
            asynchronous=args.asynchronous,
            partial=args.partial,
            max_staleness=algo.max_staleness,  # as a training run: a rollout staler than that is excluded
            carry_over=args.carry_over,
            group_size=algo.group_size,
            read_ahead=algo.read_ahead_steps,
        )

        def announced(prompts: list[Any], trainer: Any) -> dict[str, Any]:
            """Print each rollout phase as it ends (a slow engine's first phase is known before its step ends)."""
            out = rollouts(prompts, trainer)
            stats = {k: v for k, v in rollouts.last_stats.items() if k.startswith("timing_s")}
            print("rollout phase", json.dumps(stats | {"generated_tokens_so_far": server.generated}), flush=True)
            return out

        per_step: list[dict[str, float]] = []

        class PhaseLog(TrainerCallback):
            """Per step: the rollouts' stats and timings, tokens generated, memory after the step."""

            def on_step_end(self, _args: Any, state: Any, control: Any, **kw: Any) -> None:
                stats = rollouts.last_stats
                per_step.append(
                    {
                        "rollout_s": stats["timing_s/rollout"],  # async: what the step waited for its rollouts
                        "rollout_generation_s": stats.get("timing_s/rollout_generation", stats["timing_s/rollout"]),
                        "staleness": stats.get("rollout/staleness", 0.0),
                        "carried_over": stats.get("rollout/carried_over", 0.0),  # carry-over: groups from earlier steps
                        "weight_sync_s": stats["timing_s/weight_sync"],
                        "generated_tokens": rollouts.last_tokens["generated"],  # the step's batch's
                        "excluded_rate": stats["rollout/excluded_rate"],
                        "excluded_rates": {  # by reason: stale is partial rollouts' bound (algorithm.max_staleness)
                            reason: stats[f"rollout/excluded_{reason}_rate"] for reason in EXCLUSION_REASONS
                        },
                        "llm_calls_mean": stats["rollout/llm_calls_mean"],
                        "update_s": trainer.phase_s.get("update", 0.0),
                        "scoring_s": trainer.phase_s.get("generation", 0.0)
                        - stats["timing_s/rollout"]
                        - stats["timing_s/weight_sync"],
                        "device_used_gib": device_used_gib(),
                    }
                )
                trainer.phase_s.clear()

        timer = StepTimer()
        profile = StepProfile(args.profile_step)
        trainer = AgentGRPOTrainer(
            model=model,
            reward_funcs=[passthrough_reward("exec_match")],
            args=backend.grpo_config(algo, str(Path(tmp) / "out"), 0, args.device),
            train_dataset=Dataset.from_list([{"prompt": task_prompt(t)} for t in tasks]),
            processing_class=tokenizer,
            peft_config=finetune.peft_config(),
            rollout_func=announced,
            callbacks=[timer, PhaseLog(), profile],
            is_correction=algo.is_correction,
            is_cap=algo.is_cap,
            lookahead=algo.steps_read_ahead,  # the config's algorithm.async_rollouts is --async
            take_rows=rollouts.take if args.carry_over else None,
            skip_adapter_casts=not args.peft_casts,
        )
        # after GRPOTrainer, which sets the tokenizer's eos there; the policy server reads generation_config's
        model.generation_config.eos_token_id = NO_TOKEN
        model.config.eos_token_id = NO_TOKEN
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        wall = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - wall
        if memory is not None:
            memory.stop()
        timed = per_step[args.warmup : args.warmup + args.steps]
        steps = timer.steps[args.warmup : args.warmup + args.steps]
        rollout_s = statistics.median(s["rollout_s"] for s in timed)
        generation_s = statistics.median(s["rollout_generation_s"] for s in timed)
        tokens = statistics.median(s["generated_tokens"] for s in timed)
        result = {
            "shape": args.shape,
            "template": template,
            "finetune": args.finetune,
            "engine": type(engine).__name__,
            "asynchronous": args.asynchronous,
            "partial": args.partial,
            "carry_over": args.carry_over,
            "per_step": per_step,
            "step_s": timer.steps,
            "median_step_s": statistics.median(steps),
            "median_rollout_s": rollout_s,
            "median_rollout_generation_s": generation_s,  # the batch's own time (= rollout_s when synchronous)
            "median_generated_tokens": tokens,
            "rollout_tokens_per_s": tokens / generation_s,
            "median_update_s": statistics.median(s["update_s"] for s in timed),
            "median_scoring_s": statistics.median(s["scoring_s"] for s in timed),
            "median_weight_sync_s": statistics.median(s["weight_sync_s"] for s in timed),
            "prompt_tokens_mean": statistics.mean(prompt_tokens),
            # GPU memory in use (every process on the device, vLLM's own pool included), per phase; torch's peak
            # counter is not used: vLLM's sleep mode unmaps memory it still counts
            "gpu_memory": None if memory is None else memory.summary(),
            "peak_device_used_gib": max([server.device_used_gib] + [s["device_used_gib"] for s in per_step]),
            "wall_s": wall,
            "engine_stats": {k: getattr(engine, k) for k in ENGINE_STATS if hasattr(engine, k)},
        }
        if args.profile_step is not None:
            result["profile"] = profile.summary(timer.steps[args.profile_step], per_step[args.profile_step]["update_s"])
        # the bound with all rollouts in flight at the mean context: the prompt plus about half a 3-turn response
        result |= bandwidth_bound(trainer, model, args.tasks * args.group, statistics.mean(prompt_tokens) + 900, args)
        result["bound_share"] = result["rollout_tokens_per_s"] / result["bound_tokens_per_s"]
        return result


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| shape | engine | rollout s | x HF (rollout) | generated tok | tok/s | % bound | step s | x HF (step) "
        "| update s | scoring s | weight sync s | peak GiB in use |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    hf = {r["shape"]: r for r in results if r["engine"] == "HFGenerate"}
    for r in results:
        base = hf.get(r["shape"])
        x_roll = f"{base['median_rollout_s'] / r['median_rollout_s']:.1f}" if base else "-"
        x_step = f"{base['median_step_s'] / r['median_step_s']:.1f}" if base else "-"
        peak = f"{r['peak_device_used_gib']:.1f}"
        mode = "carry-over" if r.get("carry_over") else "partial" if r.get("partial") else "async"
        engine = r["engine"] + (f" ({mode})" if r.get("asynchronous") else "")
        lines.append(
            f"| {r['shape']} | {engine} | {r['median_rollout_s']:.1f} | {x_roll} "
            f"| {r['median_generated_tokens']:.0f} | {r['rollout_tokens_per_s']:.0f} | {100 * r['bound_share']:.1f} "
            f"| {r['median_step_s']:.1f} | {x_step} | {r['median_update_s']:.1f} | {r['median_scoring_s']:.1f} "
            f"| {r['median_weight_sync_s']:.2f} | {peak} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen25_1_5b")
    parser.add_argument("--engine", choices=["hf", "static", "vllm"], default="vllm")
    parser.add_argument("--finetune", choices=["full", "lora"], default="lora")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--prompt-budget", type=int, default=4096)
    parser.add_argument("--response-budget", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async", dest="asynchronous", action="store_true", help="algorithm.async_rollouts")
    parser.add_argument("--partial", action="store_true", help="algorithm.partial_rollouts (with --async)")
    parser.add_argument("--carry-over", action="store_true", help="algorithm.carry_over (with --partial)")
    parser.add_argument("--profile-step", type=int, default=None, help="profile this step (0: the first) by operator")
    parser.add_argument("--peft-casts", action="store_true", help="the reference: PEFT's adapter input casts kept")
    parser.add_argument("--override", nargs="*", default=[], help="more config overrides, after the bench's own")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table", nargs="+", type=Path, help="print the table of these result files and exit")
    args = parser.parse_args()
    if args.table:
        results = [json.loads(p.read_text()) for p in args.table]
        print(table([r["result"] for r in results if "result" in r]))
        return
    if args.partial and not args.asynchronous:
        parser.error("--partial: with --async (partial rollouts are asynchronous ones)")
    if args.carry_over and not args.partial:
        parser.error("--carry-over: with --partial (it takes the groups finished first from partial rollouts)")
    if args.profile_step is not None and not 0 <= args.profile_step < run_steps(args):
        parser.error(f"--profile-step {args.profile_step}: the run trains steps 0 to {run_steps(args) - 1}")

    import peft
    import transformers
    import trl

    args.bandwidth = copy_bandwidth() if args.device == "cuda" else float("nan")
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "trl": trl.__version__, "peft": peft.__version__}  # fmt: skip
    if args.engine == "vllm":
        import vllm

        versions["vllm"] = vllm.__version__
    info = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "copy_bandwidth_bytes_per_s": args.bandwidth,
        "versions": versions,
        "workload": {
            "tasks": args.tasks,
            "group": args.group,
            "turns": args.turns,
            "check_step": True,
            "prompt_budget": args.prompt_budget,
            "response_budget": args.response_budget,
            "micro_batch": args.micro_batch,
            "peft_casts": args.peft_casts,  # the reference: PEFT's casts of each adapter's input kept
            "overrides": args.override,
            "call_length": f"lognormal mean {MEAN_LENGTH}, sigma {SIGMA}, cap {MAX_CALL}, seed {args.seed}",
        },
        "timed_steps": args.steps,
        "warmup_steps": args.warmup,
    }
    try:
        info["result"] = run(args)
        print(table([info["result"]]))
    except Exception as exc:  # the JSON still says what failed
        info["error"] = repr(exc)
        raise
    finally:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()

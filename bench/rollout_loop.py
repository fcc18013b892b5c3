"""What a GRPO step's rollout loop costs besides generation: `experiment=learn-gpu`'s step (8 tasks x 16 rollouts of
the Spider SQL agent with the check step, up to 3 SQL turns, its SQLite tool and the exec-match reward) through the
policy server, against an engine that answers at once with scripted replies. With generation free, this is the floor
under a step's rollout time on any GPU: the event loop that runs the agents and the server, and the reward threads.

Two variants, side by side in one process, on the same tasks, getting the same replies, taking turns to go first in
a step (the first to meet a step's tasks pays for what is cold: the tokenizer's word cache, the gold results):
- `wire`: every call through the OpenAI SDK, httpx and FastAPI (the server's HTTP route, in process through ASGI),
  and a thread started per reward: the loop as it was before `ServerChat` and the reward workers;
- `direct`: `ServerChat.chat` calls the server in process, rewards run on reused worker threads: the loop now.

    python bench/rollout_loop.py                          # 1 warm-up + 6 timed steps per variant, taking turns first
    python bench/rollout_loop.py --out bench/results/rollout_loop_cpu.json

The scripted model, per task and call (the same for every variant: drawn from the question and the call's index):
a write or rewrite call answers the gold SQL with probability 1/2, else another task's gold query on the same
database; a check call says CORRECT with probability 0.6. About 2.6 calls a rollout, as learn-gpu's runs (2.4-2.9).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import agent.rollout  # noqa: E402
from agent.spider_sql import CORRECT, INCORRECT  # noqa: E402
from backends.sft import demonstration_texts  # noqa: E402
from backends.trl.rollouts import rollouts_on_server  # noqa: E402
from inference.engine import Completion  # noqa: E402
from inference.policy_server import PolicyServer  # noqa: E402
from rewards.exec_match import clear_gold_cache  # noqa: E402

QUESTION = "Question: "


class ScriptedEngine:
    """Answers every prompt at once with the scripted model's reply (see the module docstring)."""

    name = "scripted"

    def __init__(self, tokenizer: Any, tasks: list[dict[str, Any]]) -> None:
        self.tokenizer = tokenizer
        self.gold = {t["question"]: t["query"] for t in tasks}
        by_db: dict[str, list[str]] = {}
        for task in tasks:
            by_db.setdefault(task["db_id"], []).append(task["query"])
        self.others = {t["question"]: [q for q in by_db[t["db_id"]] if q != t["query"]] or [t["query"]] for t in tasks}

    def load(self, model: Any) -> None: ...

    def sleep(self) -> None: ...

    def release(self) -> None: ...

    def reply(self, prompt: list[int]) -> str:
        text = self.tokenizer.decode(prompt)
        question = text[text.index(QUESTION) + len(QUESTION) :].split("\n", 1)[0]
        call = text.count("<|im_start|>assistant") - 1  # the open assistant turn is this call's
        draw = random.Random(f"{question}|{call}").random()
        if call % 2:
            return CORRECT if draw < 0.6 else f"Wrong rows. {INCORRECT}"
        return f"```sql\n{self.gold[question] if draw < 0.5 else self.others[question][0]}\n```"

    def generate(self, model: Any, prompts: list[list[int]], max_new_tokens: list[int], **kw: Any) -> list[Completion]:
        eos = min(kw["eos_ids"])
        out = []
        for prompt, cap in zip(prompts, max_new_tokens, strict=True):
            ids = [*self.tokenizer.encode(self.reply(prompt), add_special_tokens=False)[: cap - 1], eos]
            out.append(Completion(ids, "stop", [-0.1] * len(ids)))
        return out


class ThreadPerReward:
    """The reward threads as they were: one started per reward."""

    def submit(self, job: Callable[[], Any], then: Callable[[Any], None]) -> None:
        threading.Thread(target=lambda: then(job()), name="reward", daemon=True).start()


def build(args: argparse.Namespace) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir

    from jobs.config import build_components

    overrides = ["experiment=learn-gpu", "algorithm=grpo", f"paths.cache_dir={args.cache}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    return build_components(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=8, help="tasks per step")
    parser.add_argument("--group", type=int, default=16, help="rollouts per task")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant (after one warm-up each)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.mkdtemp()) / "cache")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    built = build(args)
    data, agent_, algo, spec = built["data"], built["agent"], built["algorithm"], built["model"]
    data.prepare()
    tasks = data.train_tasks()
    reward = data.metric()
    demos = [{"messages": agent_.first_messages(t), "tools": None} for t in tasks]
    source = spec.prepare([text for d in demos for text in demonstration_texts(d)] + [t["query"] for t in tasks])
    model, tokenizer = spec.load_model(source, "cpu"), spec.load_tokenizer(source)
    engine = ScriptedEngine(tokenizer, tasks)
    server = PolicyServer(
        model,
        tokenizer,
        max_prompt_tokens=algo.max_prompt_length,
        max_response_tokens=algo.max_response_length,
        engine=engine,
    )
    sampling = {"temperature": algo.temperature, "max_tokens": algo.max_tokens_per_turn}
    direct_chat, direct_workers = server.chat_model, agent.rollout._REWARD_WORKERS
    variants = {
        "wire": (partial(direct_chat, wire=True), ThreadPerReward()),
        "direct": (direct_chat, direct_workers),
    }
    counter = iter(range(10**9))
    times: dict[str, list[float]] = {name: [] for name in variants}
    calls: dict[str, list[float]] = {name: [] for name in variants}
    rewards: dict[str, list[float]] = {name: [] for name in variants}
    rng = random.Random(0)
    for step in range(args.steps + 1):
        step_tasks = [t for t in rng.sample(tasks, args.tasks) for _ in range(args.group)]
        order = list(variants.items())
        for name, (chat_model, workers) in order if step % 2 else order[::-1]:  # each goes first every other step
            server.chat_model, agent.rollout._REWARD_WORKERS = chat_model, workers  # type: ignore[method-assign]
            clear_gold_cache()  # each variant scores the step's tasks from cold, as a run meeting new tasks does
            start = time.perf_counter()
            rollouts, records = asyncio.run(
                rollouts_on_server(
                    agent_, step_tasks, server, sampling, reward, lambda n: [f"r{next(counter)}" for _ in range(n)]
                )
            )
            seconds = time.perf_counter() - start
            n_calls = sum(len(r) for r in records)
            print(f"step {step} {name:6s}: {seconds:.2f} s, {n_calls} calls, {1000 * seconds / n_calls:.2f} ms a call")
            if step:  # the first is a warm-up
                times[name].append(seconds)
                calls[name].append(n_calls / len(rollouts))
                rewards[name].append(sum(r.reward or 0 for r in rollouts) / len(rollouts))
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "bench": "rollout_loop",
        "command": "python " + " ".join(sys.argv),
        "workload": f"experiment=learn-gpu: {args.tasks} tasks x {args.group} rollouts a step, scripted replies",
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "step_s_median": median,
        "step_s": times,
        "calls_per_rollout": {k: statistics.mean(v) for k, v in calls.items()},
        "reward_mean": {k: statistics.mean(v) for k, v in rewards.items()},
        "wire_over_direct": median["wire"] / median["direct"],
    }
    print(
        f"median step: wire {median['wire']:.2f} s, direct {median['direct']:.2f} s: "
        f"{result['wire_over_direct']:.2f}x (calls a rollout {result['calls_per_rollout']['direct']:.2f}, "
        f"reward {result['reward_mean']['direct']:.2f} direct / {result['reward_mean']['wire']:.2f} wire)"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

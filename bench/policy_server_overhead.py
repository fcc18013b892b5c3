"""What one LLM call costs the rollout loop besides generation: agents' calls through the in-process OpenAI client
and the policy server (chat template, token ids, batching, recording), against an engine that answers instantly.

    python bench/policy_server_overhead.py                 # 128 rollouts x 3 calls, as a learn_gpu step's calls
    python bench/policy_server_overhead.py --rollouts 256 --calls 6

Every call runs on the one event loop that also drives generation, so this time is not overlapped with anything:
per step it is at least rollouts x calls x the per-call figure. Printed per round (the first round warms up).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.engine import Completion  # noqa: E402
from inference.policy_server import PolicyServer  # noqa: E402
from models.tiny import TinyModel  # noqa: E402

CORPUS = ["You are a helpful assistant.", "What is in the table?", "SELECT name FROM people"] * 10
REPLY_TOKENS = 20


class InstantEngine:
    """Replies REPLY_TOKENS tokens and an eos at once, whatever the prompt."""

    name = "instant"

    def load(self, model: Any) -> None: ...

    def sleep(self) -> None: ...

    def release(self) -> None: ...

    def generate(self, model: Any, prompts: list[list[int]], max_new_tokens: list[int], **kw: Any) -> list[Completion]:
        eos = next(iter(kw["eos_ids"]))
        return [Completion([5] * REPLY_TOKENS + [eos], "stop", [-0.1] * (REPLY_TOKENS + 1)) for _ in prompts]


async def rollout(server: PolicyServer, rollout_id: str, calls: int) -> None:
    chat = server.chat_model(rollout_id, {"temperature": 1.0, "max_tokens": 32})
    question = {"role": "user", "content": "What is in the table? " * 5}
    messages = [{"role": "system", "content": "You are a helpful assistant."}, question]
    for _ in range(calls):
        reply = await chat.chat(messages)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "What is in the table?"}]
    server.rollout_finished()


async def one_round(server: PolicyServer, rollouts: int, calls: int, round_: int) -> None:
    with server.active_rollouts(rollouts):
        await asyncio.gather(*(rollout(server, f"{round_}-{i}", calls) for i in range(rollouts)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=128)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spec = TinyModel(name="tiny", hub_id=None, path=None, cache_dir=tempfile.mkdtemp(), context_length=512,
                     tool_call_format="hermes", vocab_size=300,
                     hidden_size=32, intermediate_size=64, num_hidden_layers=2)  # fmt: skip
    source = spec.prepare(CORPUS)
    model, tokenizer = spec.load_model(source, "cpu"), spec.load_tokenizer(source)
    server = PolicyServer(model, tokenizer, max_prompt_tokens=512, max_response_tokens=400, engine=InstantEngine())
    for round_ in range(args.rounds):
        start = time.perf_counter()
        asyncio.run(one_round(server, args.rollouts, args.calls, round_))
        seconds = time.perf_counter() - start
        per_call = 1000 * seconds / (args.rollouts * args.calls)
        shape = f"{args.rollouts} rollouts x {args.calls} calls"
        print(f"round {round_}: {shape} in {seconds:.2f} s: {per_call:.2f} ms a call")


if __name__ == "__main__":
    main()

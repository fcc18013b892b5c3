"""The generation engine interface: token id prompts in, sampled token ids and their log-probabilities out.

Every engine honours the same contract, so the policy server and the trainer never know which one sampled:
- a completion's `token_ids` are exactly what was sampled, its first eos id included when it stopped there;
- `logprobs[i]` is log p(token_ids[i]) under the logits divided by the temperature (the raw logits when greedy),
  which is what the trainer computes over the same tokens;
- a completion never has more than its request's `max_new_tokens`;
- `prefilled` is how many of the prompt's tokens the engine ran through the model for it: all of them for `hf` and
  `static` (neither keeps a prefix cache), those vLLM did not find in its prefix cache (counted: backends/compute.py).

An engine's life in a training run: `load(model)` before each rollout phase (the optimizer moved the weights), then
`generate` (a batch) or `submit` (one request, for engines that batch continuously), then `sleep()` before the update
(an engine that holds its own copy of the weights and a KV cache gives that memory back), `release()` at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from transformers import PreTrainedModel


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str  # "stop" (ended with an eos id) or "length"
    # log p of each token under logits / temperature (logits as they are when greedy), what the trainer computes
    logprobs: list[float] | None = None
    prefilled: int | None = None  # prompt tokens computed for it (None: the whole prompt)


class Engine(Protocol):
    name: str

    def load(self, model: PreTrainedModel) -> None:
        """Generate with `model`'s current weights from now on (called before every rollout phase)."""
        ...

    def generate(
        self,
        model: PreTrainedModel,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        *,
        temperature: float,
        top_p: float,
        eos_ids: set[int],
        pad_id: int,
    ) -> list[Completion]:
        """One completion per prompt, generated together."""
        ...

    def sleep(self) -> None:
        """Give back the memory generation holds that the update needs (called after every rollout phase)."""
        ...

    def release(self) -> None:
        """Free what the engine keeps between calls (a cache, graphs, an engine)."""
        ...


@runtime_checkable
class ContinuousEngine(Protocol):
    """An engine that batches continuously: each request is submitted on its own the moment it is ready and joins
    the running batch at the next step; no request waits for another to finish. Its life is an `Engine`'s (`load`,
    `sleep`, `release`); `submit` stands for `generate`."""

    name: str

    def load(self, model: PreTrainedModel) -> None: ...

    def sleep(self) -> None: ...

    def release(self) -> None: ...

    async def submit(
        self, prompt_ids: list[int], max_new_tokens: int, *, temperature: float, top_p: float, eos_ids: set[int]
    ) -> Completion: ...


def finish(
    ids: list[int], max_new: int, eos_ids: set[int], logprobs: list[float] | None = None, prefilled: int | None = None
) -> Completion:
    """Cut a row at its own budget and at its first eos id (kept, as the model produced it); `prefilled`: the
    prompt tokens the engine computed for it."""
    ids = ids[:max_new]
    stop = next((k for k, t in enumerate(ids) if t in eos_ids), None)
    end = len(ids) if stop is None else stop + 1
    lps = None if logprobs is None else logprobs[:end]
    return Completion(ids[:end], "length" if stop is None else "stop", lps, prefilled)

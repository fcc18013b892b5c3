"""The per-rollout token ledger: what each rollout's model calls were, as the exact token ids in and out.

The policy server (`inference/policy_server.py`) and verl's agent loop (`backends/verl/loop.py`) answer every model
call through a `TokenLedger`, and the trainer reads back exactly the tokens the model saw and produced (`pop_records`).

- Token in, token out (`models/chat.py`): a rollout's first prompt is its messages rendered by the chat template;
  when a later call's messages are the previous call's, the reply this ledger gave, and new messages, and its `tools`
  are the previous call's, its prompt is the previous prompt + the ids sampled for it + the template's delta for the
  new messages only. A call that does not extend the conversation that way (the agent rewrote or dropped a message,
  `same_message`, or changed `tools`) is answered from a fresh rendering, and its rollout is marked `inexact`: its
  sample cannot be built exactly. Special-token text in what a request carries (a tool result holding `<|im_end|>`)
  is encoded as ordinary ids: only the template writes control tokens.
- Lengths are per rollout, as the trainer sees them: the first prompt is at most `max_prompt_tokens` (else
  `PromptTooLong`), and everything after it (all replies, and the tokens added between turns) at most
  `max_response_tokens`. A call made after that budget is spent gets an empty reply with `finish_reason="length"`
  that the model never sampled, and its rollout is marked `overflow`.
- Replies: a leading `<think>` block comes back as `reasoning_content`; with `tools` in the request, tool calls in the
  model's format come back as OpenAI `tool_calls`. Parsing reads the sampled text; nothing is rendered back.
- The tokens, and each one's log-probability, come from `generate` (the policy server's batcher, `inference/
  batcher.py`, or verl's LLM server client): the ledger builds the prompts and records what was sampled for them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from inference.engine import Completion
from models.chat import ChatFormat, content_problem, same_message


class ChatRequest(BaseModel):
    """What a call may ask for. Honoured: messages (content a string or a list of text parts, read as their text),
    tools, temperature, top_p, max_tokens / max_completion_tokens (>= 1). Refused with a 400 naming the field
    (`refusal`), never ignored: a content part that is not text (image_url, input_audio, file, ...), a stop sequence,
    more than one choice, penalties, logit biases, streaming. Other fields an SDK adds (tool_choice, metadata, ...) do
    not change sampling and are ignored."""

    model: str = "policy"
    messages: list[dict[str, Any]]
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None

    def refusal(self) -> str | None:
        """Why the policy server cannot honour this request, naming the field; None when it can."""
        for key in ("max_tokens", "max_completion_tokens"):
            if (value := getattr(self, key)) is not None and value < 1:
                return f"{key}={value}: at least 1 token (or leave it out for the rollout's whole budget)"
        if self.stop:
            return f"stop={self.stop!r}: not supported; a reply ends at the model's end token or its token budget"
        if self.n not in (None, 1):
            return f"n={self.n}: one choice per call (each rollout's calls make one sequence)"
        for key in ("presence_penalty", "frequency_penalty"):
            if getattr(self, key):
                return f"{key}={getattr(self, key)}: not supported (sampling is temperature and top_p)"
        if self.logit_bias:
            return "logit_bias: not supported (sampling is temperature and top_p)"
        if self.stream:
            return "stream=true: not supported; the reply comes whole"
        for i, message in enumerate(self.messages):
            if (problem := content_problem(message.get("content"))) is not None:
                return f"messages[{i}].{problem}"
        return None


class PromptTooLong(ValueError):
    """A rollout's first prompt is longer than `max_prompt_tokens` (HTTP 400 on the wire)."""


class UnsupportedRequest(ValueError):
    """A call asks for something the policy server does not do (`ChatRequest.refusal`; HTTP 400 on the wire)."""


class Generate(Protocol):
    """Samples up to `max_new_tokens` after `prompt_ids`: the ids, and each one's log-probability."""

    async def __call__(
        self, prompt_ids: list[int], max_new_tokens: int, *, temperature: float, top_p: float
    ) -> Completion: ...


@dataclass
class CallRecord:
    """One LLM call: the exact token ids in and out, each sampled token's log-probability, whether the prompt is
    the previous call's prompt and completion followed by new tokens (`continues`), and how many prompt tokens the
    engine computed for it (`prefilled`: the whole prompt, less what a prefix cache held; backends/compute.py)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None
    continues: bool
    finish_reason: str
    sampled: bool = True  # False: the reply was empty because the rollout's budget was spent; nothing was sampled
    prefilled: int = 0  # prompt tokens the engine computed (0 when nothing was sampled)
    # the engine's weights when the call was sent (`TokenLedger.weights_version`: the trainer's optimizer steps); a
    # load while it generates does not change it, so a rollout's oldest call bounds how stale any of its tokens is
    weights_version: int = 0


@dataclass
class _RolloutState:
    records: list[CallRecord] = field(default_factory=list)
    # The conversation as the last call left it: its request's messages and the reply this ledger gave, its tools.
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class TokenLedger:
    """Answers each rollout's calls token in, token out (see the module docstring) and keeps their records."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        chat_format: ChatFormat,
        *,
        max_prompt_tokens: int,
        max_response_tokens: int,
        generate: Generate,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.max_prompt_tokens = max_prompt_tokens
        self.max_response_tokens = max_response_tokens
        self.generate = generate
        self.rollouts: dict[str, _RolloutState] = {}
        # every sampled call's tokens so far: prompt tokens the engine computed, and tokens it generated
        self.prefilled_tokens = 0
        self.generated_tokens = 0
        self.weights_version = 0  # the engine's weights as of the last load (the trainer's optimizer steps then)

    def open(self, rollout_id: str) -> None:
        """Start `rollout_id` afresh: its next call is a first call."""
        self.rollouts[rollout_id] = _RolloutState()

    def pop_records(self, rollout_id: str) -> list[CallRecord]:
        """The rollout's calls, in order; the rollout is forgotten."""
        return self.rollouts.pop(rollout_id, _RolloutState()).records

    async def complete(self, rollout_id: str, request: ChatRequest) -> dict[str, Any]:
        """Answer `request` as a call of `rollout_id`: an OpenAI chat.completion, its call recorded."""
        if (refusal := request.refusal()) is not None:
            raise UnsupportedRequest(refusal)
        state = self.rollouts.setdefault(rollout_id, _RolloutState())
        prompt_ids, continues = self._prompt_ids(state, request.messages, request.tools)
        if not state.records and len(prompt_ids) > self.max_prompt_tokens:
            raise PromptTooLong(
                f"prompt of {len(prompt_ids)} tokens is longer than the limit of {self.max_prompt_tokens}"
            )
        # A rollout's response budget covers all its turns: what it generated and what was added between turns. A
        # call that starts a new sequence is held to the same limits as a first call.
        if continues:
            budget = self.max_response_tokens - (len(prompt_ids) - len(state.records[0].prompt_ids))
        else:
            budget = self.max_response_tokens if len(prompt_ids) <= self.max_prompt_tokens else 0
        wanted = request.max_completion_tokens or request.max_tokens or self.max_response_tokens
        version = self.weights_version  # as the call is sent: a load while it generates leaves it the older one
        if budget <= 0:  # the rollout has used its budget: answer at once, as a generation cut by length
            completion, sampled = Completion([], "length", []), False
        else:
            completion = await self.generate(
                prompt_ids, min(wanted, budget), temperature=request.temperature, top_p=request.top_p
            )
            sampled = True
        prefilled = 0
        if sampled:
            prefilled = len(prompt_ids) if completion.prefilled is None else completion.prefilled
            self.prefilled_tokens += prefilled
            self.generated_tokens += len(completion.token_ids)
        state.records.append(
            CallRecord(
                prompt_ids,
                completion.token_ids,
                completion.logprobs,
                continues,
                completion.finish_reason,
                sampled,
                prefilled,
                version,
            )
        )
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        message = self.chat_format.reply(text, tools=bool(request.tools))
        state.messages = [*request.messages, message]
        state.tools = request.tools or None
        finish_reason = completion.finish_reason
        if message.get("tool_calls") and finish_reason == "stop":
            finish_reason = "tool_calls"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(completion.token_ids),
                "total_tokens": len(prompt_ids) + len(completion.token_ids),
            },
        }

    def _prompt_ids(
        self, state: _RolloutState, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], bool]:
        """Token in, token out: the previous prompt, its sampled ids and the delta of the new messages, when
        `messages` extend the rollout's conversation and `tools` are its tools; otherwise a fresh rendering (and
        False). Tools are rendered once, in the first prompt: a changed list cannot be added as a delta."""
        kept = state.messages
        extends = (
            bool(state.records)
            and (tools or None) == state.tools
            and len(messages) >= len(kept)
            and all(same_message(sent, held) for sent, held in zip(messages, kept, strict=False))
            and not self.chat_format.drops_thinking(kept, messages[len(kept) :])
        )
        if not extends:
            return self.chat_format.prompt_ids(messages, tools), False
        last = state.records[-1]
        stopped = last.finish_reason == "stop"  # ended with an eos id it sampled (not cut by length)
        delta = self.chat_format.continuation_ids(messages[len(kept) :], tools, last.completion_ids, stopped)
        return last.prompt_ids + last.completion_ids + delta, True

"""An OpenAI-compatible chat endpoint in front of the policy being trained, recording the token ids of every call.

This plays, for the embedded backend, the part agent-lightning's LLM proxy plays in front of vLLM: agents talk to it
like to any endpoint, and the trainer reads back exactly the tokens the model saw and produced.

- Each rollout gets its own base URL, `/rollouts/<id>/v1`, so calls are attributed without the agent knowing.
- Requests from concurrent rollouts are generated together: a batch starts when every active rollout is waiting on
  the model (or once no new request has come for `batch_wait_s`), so the agents of one training step share one
  `generate` call per turn.
- Lengths are per rollout, as the trainer sees them: the first prompt is at most `max_prompt_tokens` (else HTTP 400),
  and everything after it (all replies, and the text added between turns) at most `max_response_tokens`. A call made
  after the budget is spent gets an empty reply with `finish_reason="length"`, and so does a later call that does not
  continue the rollout's sequence (the model emitted text its chat template cannot reproduce) and is too long to
  start a new one.
- Tools: a request's `tools` go into the chat template, and a reply in the model's tool-call format (hermes:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) comes back as OpenAI `tool_calls`; the assistant's
  tool calls in later requests are rendered back by the same template, so the token sequence stays continuous.
- When a call's messages extend the previous call of the same rollout (previous prompt, the reply, new messages),
  its prompt ids are the previous prompt and reply ids followed by the tokens of the new text only. The model thus
  continues from exactly the tokens it sampled (no re-tokenization drift), and a rollout forms one token sequence.
- The tokens themselves come from a generation engine (`backends/generation.py`): `model.generate`, or a static KV
  cache decode loop replayed as CUDA graphs.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agent.llm import OpenAIChat
from backends.generation import Engine, HFGenerate

DEFAULT_ROLLOUT = "default"


class ChatRequest(BaseModel):
    model: str = "policy"
    messages: list[dict[str, Any]]
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None


@dataclass
class CallRecord:
    """One LLM call: the exact token ids in and out, and how many leading prompt ids continue the previous call."""

    prompt_ids: list[int]
    completion_ids: list[int]
    reused_prefix: int
    finish_reason: str


@dataclass
class _Pending:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    future: asyncio.Future[tuple[list[int], str]]


@dataclass
class _RolloutState:
    records: list[CallRecord] = field(default_factory=list)
    # Text of the last call's prompt followed by its reply, as the chat template would render them.
    last_text: str = ""


class PolicyServer:
    """Serves `model` at `/v1/chat/completions` and `/rollouts/<id>/v1/chat/completions`."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_prompt_tokens: int,
        max_response_tokens: int,
        max_batch_size: int = 256,
        batch_wait_s: float = 0.02,
        engine: Engine | None = None,
    ) -> None:
        self.model = model
        self.engine = engine or HFGenerate()
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.max_response_tokens = max_response_tokens
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.rollouts: dict[str, _RolloutState] = {}
        self.generate_calls = 0
        self._pending: list[_Pending] = []
        self._active: int | None = None
        self._busy = False
        self._timer: asyncio.TimerHandle | None = None
        self._batch_task: asyncio.Task[None] | None = None  # referenced so it is not collected mid-batch
        self.app = self._build_app()

    # ---- what the trainer uses ---------------------------------------------------------------------------------
    def chat_model(self, rollout_id: str, sampling: dict[str, Any]) -> OpenAIChat:
        """An in-process client (no sockets) whose calls are recorded under `rollout_id`."""
        self.rollouts[rollout_id] = _RolloutState()
        return OpenAIChat.connect(
            f"http://policy/rollouts/{rollout_id}/v1",
            "policy",
            sampling=sampling,
            transport=httpx.ASGITransport(app=self.app),
        )

    @contextmanager
    def active_rollouts(self, count: int) -> Iterator[None]:
        """Tell the batcher how many rollouts are running, so it generates as soon as all of them are waiting."""
        self._active = count
        try:
            yield
        finally:
            self._active = None

    def rollout_finished(self) -> None:
        if self._active is not None:
            self._active -= 1
            self._maybe_flush()

    def pop_records(self, rollout_id: str) -> list[CallRecord]:
        return self.rollouts.pop(rollout_id, _RolloutState()).records

    # ---- HTTP ----------------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="policy server")

        @app.post("/v1/chat/completions")
        async def completions(request: ChatRequest) -> dict[str, Any]:
            return await self._complete(DEFAULT_ROLLOUT, request)

        @app.post("/rollouts/{rollout_id}/v1/chat/completions")
        async def rollout_completions(rollout_id: str, request: ChatRequest) -> dict[str, Any]:
            return await self._complete(rollout_id, request)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "local"}]}

        return app

    async def _complete(self, rollout_id: str, request: ChatRequest) -> dict[str, Any]:
        state = self.rollouts.setdefault(rollout_id, _RolloutState())
        prompt_ids, reused = self._prompt_ids(state, request.messages, request.tools)
        too_long = reused == 0 and len(prompt_ids) > self.max_prompt_tokens
        if too_long and not state.records:
            raise HTTPException(
                status_code=400,
                detail=f"prompt of {len(prompt_ids)} tokens is longer than the limit of {self.max_prompt_tokens}",
            )
        # A rollout's response budget covers all its turns: what it generated and what was added between turns.
        first_prompt = state.records[0].prompt_ids if reused else prompt_ids
        budget = self.max_response_tokens - (len(prompt_ids) - len(first_prompt))
        if too_long:  # a later call that does not continue the rollout's sequence (its sample ends before this
            budget = 0  # call) and is too long to start one: it ends the rollout like a spent budget
        wanted = request.max_completion_tokens or request.max_tokens or self.max_response_tokens
        if budget <= 0:  # the rollout has used its budget: answer at once, as a generation cut by length
            completion_ids, finish_reason = [], "length"
        else:
            loop = asyncio.get_running_loop()
            pending = _Pending(
                prompt_ids, min(wanted, budget), request.temperature, request.top_p, loop.create_future()
            )
            self._pending.append(pending)
            self._maybe_flush()
            completion_ids, finish_reason = await pending.future
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
        state.records.append(CallRecord(prompt_ids, completion_ids, reused, finish_reason))
        rendered_prompt = self._render(request.messages, request.tools)
        state.last_text = rendered_prompt + self.tokenizer.decode(completion_ids, skip_special_tokens=False)
        message = parse_tool_calls(text) if request.tools else {"role": "assistant", "content": text}
        if "tool_calls" in message and finish_reason == "stop":
            finish_reason = "tool_calls"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(completion_ids),
                "total_tokens": len(prompt_ids) + len(completion_ids),
            },
        }

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return self.tokenizer.apply_chat_template(
            [for_template(m) for m in messages], tools=tools, tokenize=False, add_generation_prompt=True
        )

    def _prompt_ids(
        self, state: _RolloutState, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], int]:
        text = self._render(messages, tools)
        if state.records and state.last_text and text.startswith(state.last_text):
            last = state.records[-1]
            prefix = last.prompt_ids + last.completion_ids
            new_ids = self.tokenizer(text[len(state.last_text) :], add_special_tokens=False)["input_ids"]
            return prefix + new_ids, len(prefix)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], 0

    # ---- batching --------------------------------------------------------------------------------------------------
    def _maybe_flush(self) -> None:
        if self._busy or not self._pending:
            return
        if self._active is not None and len(self._pending) >= self._active:
            self._start_batch()
            return
        if self._timer is not None:  # a new arrival restarts the wait: rollouts still starting up join this batch
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.batch_wait_s, self._start_batch)

    def _start_batch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._busy or not self._pending:
            return
        batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size :]
        self._busy = True
        self._batch_task = asyncio.get_running_loop().create_task(self._run_batch(batch))

    async def _run_batch(self, batch: list[_Pending]) -> None:
        try:
            results = await asyncio.to_thread(self._generate, batch)
            for item, result in zip(batch, results, strict=True):
                item.future.set_result(result)
        except Exception as exc:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
        finally:
            self._busy = False
            self._maybe_flush()

    @torch.no_grad()
    def _generate(self, batch: list[_Pending]) -> list[tuple[list[int], str]]:
        """Generate for a batch, one `generate` call per distinct sampling setting."""
        results: list[tuple[list[int], str] | None] = [None] * len(batch)
        groups: dict[tuple[float, float], list[int]] = {}
        for i, item in enumerate(batch):
            groups.setdefault((item.temperature, item.top_p), []).append(i)
        was_training = self.model.training
        self.model.eval()
        try:
            for (temperature, top_p), indices in groups.items():
                outputs = self._generate_group([batch[i] for i in indices], temperature, top_p)
                for i, output in zip(indices, outputs, strict=True):
                    results[i] = output
        finally:
            self.model.train(was_training)
        self.generate_calls += len(groups)
        return [r for r in results if r is not None]

    def _generate_group(self, items: list[_Pending], temperature: float, top_p: float) -> list[tuple[list[int], str]]:
        eos_ids = set(_as_list(self.model.generation_config.eos_token_id) or [self.tokenizer.eos_token_id])
        completions = self.engine.generate(
            self.model,
            [item.prompt_ids for item in items],
            [item.max_new_tokens for item in items],
            temperature=temperature,
            top_p=top_p,
            eos_ids=eos_ids,
            pad_id=self.tokenizer.pad_token_id,
        )
        return [(c.token_ids, c.finish_reason) for c in completions]


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> dict[str, Any]:
    """An assistant message from generated text: hermes-style `<tool_call>` blocks become OpenAI `tool_calls`.

    A block that is not a JSON object with a `name` and object `arguments` stays in the text, where the agent sees it.
    """
    calls, kept, last = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("not a tool call")
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
        )
    if not calls:
        return {"role": "assistant", "content": text}
    content = ("".join(kept) + text[last:]).strip()
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI message -> what chat templates expect: tool-call arguments as objects, no None content."""
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
            for c in out["tool_calls"]
        ]
    return out


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments

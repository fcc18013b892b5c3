"""An OpenAI-compatible chat endpoint in front of the policy being trained, recording the token ids of every call.

This plays, for the embedded backend, the part agent-lightning's LLM proxy plays in front of vLLM: agents talk to it
like to any endpoint, and the trainer reads back exactly the tokens the model saw and produced.

- Each rollout gets its own base URL, `/rollouts/<id>/v1`, so calls are attributed without the agent knowing. Its
  client (`chat_model`) calls the server in process for `chat`; its `client` speaks HTTP to the same route.
- Token in, token out (`models/chat.py`): a rollout's first prompt is its messages rendered by the chat template;
  when a later call's messages are the previous call's, the reply this server gave, and new messages, and its `tools`
  are the previous call's, its prompt is the previous prompt + the ids sampled for it + the template's delta for the
  new messages only. A call that does not extend the conversation that way (the agent rewrote or dropped a message,
  `same_message`, or changed `tools`) is answered from a fresh rendering, and its rollout is marked `inexact`: its
  sample cannot be built exactly. Special-token text in what a request carries (a tool result holding `<|im_end|>`)
  is encoded as ordinary ids: only the template writes control tokens.
- Requests from concurrent rollouts are generated together. A continuous engine (vLLM) gets each request the moment
  it arrives and adds it to its running batch. Any other engine gets batches: a batch starts when every active
  rollout is waiting on the model (or once no new request has come for `batch_wait_s`), so the agents of one
  training step share one `generate` call per turn.
- Lengths are per rollout, as the trainer sees them: the first prompt is at most `max_prompt_tokens` (else HTTP 400),
  and everything after it (all replies, and the tokens added between turns) at most `max_response_tokens`. A call made
  after that budget is spent gets an empty reply with `finish_reason="length"` that the model never sampled, and its
  rollout is marked `overflow`.
- Replies: a leading `<think>` block comes back as `reasoning_content`; with `tools` in the request, tool calls in the
  model's format come back as OpenAI `tool_calls`. Parsing reads the sampled text; nothing is rendered back.
- The tokens, and each one's log-probability, come from a generation engine (`inference/`). `load(model)` before a
  rollout phase gives the engine the model's current weights.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agent.llm import OpenAIChat
from inference.engine import Completion, ContinuousEngine, Engine
from inference.hf import HFGenerate
from models.chat import ChatFormat, content_problem, same_message

DEFAULT_ROLLOUT = "default"


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


@dataclass
class ServerChat(OpenAIChat):
    """A rollout's client of the policy server. `chat` calls the server in this process: the same request, the same
    recorded tokens, without the OpenAI SDK's request transform, httpx and FastAPI, which were about half of what a
    call cost the event loop that also drives generation (`bench/rollout_loop.py`). `client` still speaks HTTP to the
    same server (through ASGI, no sockets), for agents that bring their own OpenAI client (openai-agents)."""

    complete: Callable[[ChatRequest], Awaitable[dict[str, Any]]] | None = None

    async def chat(self, messages: list[dict[str, Any]]) -> str:
        assert self.complete is not None
        # As on the wire: the server gets its own copy of the messages, JSON's types and all.
        request = ChatRequest(model=self.model, messages=json.loads(json.dumps(messages)), **self.sampling)
        response = await self.complete(request)
        return response["choices"][0]["message"].get("content") or ""


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


@dataclass
class _Pending:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    future: asyncio.Future[Completion]


@dataclass
class _RolloutState:
    records: list[CallRecord] = field(default_factory=list)
    # The conversation as the last call left it: its request's messages and the reply this server gave, its tools.
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class PolicyServer:
    """Serves `model` at `/v1/chat/completions` and `/rollouts/<id>/v1/chat/completions`."""

    def __init__(
        self,
        model: PreTrainedModel | None,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_prompt_tokens: int,
        max_response_tokens: int,
        max_batch_size: int = 256,
        batch_wait_s: float = 0.02,
        engine: Engine | ContinuousEngine | None = None,
        chat_format: ChatFormat | None = None,
        eos_ids: set[int] | None = None,
    ) -> None:
        if model is None and (eos_ids is None or not isinstance(engine, ContinuousEngine)):
            raise ValueError("without a model the server needs an engine that holds the weights, and the eos ids")
        self.model = model  # None: the engine holds the weights (it is never handed the model)
        self.engine = engine or HFGenerate()
        self.eos_ids = eos_ids if eos_ids is not None else eos_ids_of(model.generation_config, tokenizer)
        self.tokenizer = tokenizer
        self.chat_format = chat_format or ChatFormat(tokenizer)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_response_tokens = max_response_tokens
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.rollouts: dict[str, _RolloutState] = {}
        self.generate_calls = 0
        # every sampled call's tokens so far: prompt tokens the engine computed, and tokens it generated
        self.prefilled_tokens = 0
        self.generated_tokens = 0
        self._pending: list[_Pending] = []
        self._active: int | None = None
        self._busy = False
        self._timer: asyncio.TimerHandle | None = None
        self._batch_task: asyncio.Task[None] | None = None  # referenced so it is not collected mid-batch
        self.app = self._build_app()

    # ---- what the trainer uses ---------------------------------------------------------------------------------
    def load(self, model: PreTrainedModel) -> None:
        """Serve `model` with its current weights (an engine that keeps its own copy gets them now; the caller times
        it with the gather before it, `timing_s/weight_sync`)."""
        self.model = model
        self.engine.load(model)

    def chat_model(self, rollout_id: str, sampling: dict[str, Any], *, wire: bool = False) -> OpenAIChat:
        """An in-process client whose calls are recorded under `rollout_id`: a `ServerChat`, or with `wire` a plain
        OpenAIChat whose every call goes through the SDK and HTTP (through ASGI, no sockets)."""
        self.rollouts[rollout_id] = _RolloutState()
        http = OpenAIChat.connect(
            f"http://policy/rollouts/{rollout_id}/v1",
            "policy",
            sampling=sampling,
            transport=httpx.ASGITransport(app=self.app),
        )
        if wire:
            return http

        async def complete(request: ChatRequest) -> dict[str, Any]:
            return await self._complete(rollout_id, request)

        return ServerChat(http.client, http.model, http.sampling, complete)

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
            return await self._complete_http(DEFAULT_ROLLOUT, request)

        @app.post("/rollouts/{rollout_id}/v1/chat/completions")
        async def rollout_completions(rollout_id: str, request: ChatRequest) -> dict[str, Any]:
            return await self._complete_http(rollout_id, request)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "local"}]}

        return app

    async def _complete_http(self, rollout_id: str, request: ChatRequest) -> dict[str, Any]:
        try:
            return await self._complete(rollout_id, request)
        except (PromptTooLong, UnsupportedRequest) as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc

    async def _complete(self, rollout_id: str, request: ChatRequest) -> dict[str, Any]:
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
        if budget <= 0:  # the rollout has used its budget: answer at once, as a generation cut by length
            completion, sampled = Completion([], "length", []), False
        elif isinstance(self.engine, ContinuousEngine):
            completion = await self.engine.submit(
                prompt_ids,
                min(wanted, budget),
                temperature=request.temperature,
                top_p=request.top_p,
                eos_ids=self.eos_ids,
            )
            sampled = True
        else:
            loop = asyncio.get_running_loop()
            pending = _Pending(
                prompt_ids, min(wanted, budget), request.temperature, request.top_p, loop.create_future()
            )
            self._pending.append(pending)
            self._maybe_flush()
            completion, sampled = await pending.future, True
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
        # a request whose caller is gone (cancelled: a stop signal ends the rollouts) is not generated for; without
        # this, every cancelled batch's end started the next, and a stopped run generated its whole queue first
        self._pending = [item for item in self._pending if not item.future.done()]
        if self._busy or not self._pending:
            return
        batch, self._pending = self._pending[: self.max_batch_size], self._pending[self.max_batch_size :]
        self._busy = True
        self._batch_task = asyncio.get_running_loop().create_task(self._run_batch(batch))

    async def _run_batch(self, batch: list[_Pending]) -> None:
        try:
            results = await asyncio.to_thread(self._generate, batch)
            for item, result in zip(batch, results, strict=True):
                if not item.future.done():  # its caller may have been cancelled meanwhile
                    item.future.set_result(result)
        except Exception as exc:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
        finally:
            self._busy = False
            self._maybe_flush()

    @torch.no_grad()
    def _generate(self, batch: list[_Pending]) -> list[Completion]:
        """Generate for a batch, one `generate` call per distinct sampling setting."""
        results: list[Completion | None] = [None] * len(batch)
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

    def _generate_group(self, items: list[_Pending], temperature: float, top_p: float) -> list[Completion]:
        return self.engine.generate(
            self.model,
            [item.prompt_ids for item in items],
            [item.max_new_tokens for item in items],
            temperature=temperature,
            top_p=top_p,
            eos_ids=self.eos_ids,
            pad_id=self.tokenizer.pad_token_id,
        )


def eos_ids_of(generation_config: Any, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids that end a reply: the model's generation config's (what vLLM stops at too), else the tokenizer's."""
    return set(_as_list(generation_config.eos_token_id) or [tokenizer.eos_token_id])


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)

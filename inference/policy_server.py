"""An OpenAI-compatible chat endpoint in front of the policy being trained, recording the token ids of every call.

This plays, for the embedded backend, the part agent-lightning's LLM proxy plays in front of vLLM: agents talk to it
like to any endpoint, and the trainer reads back exactly the tokens the model saw and produced.

- `PolicyServer` composes three parts: the per-rollout token ledger (`inference/ledger.py`: token in, token out, the
  length budgets, the replies), the batcher that generates the concurrent rollouts' requests together
  (`inference/batcher.py`), and the HTTP surface here (`chat_app`).
- Each rollout gets its own base URL, `/rollouts/<id>/v1`, so calls are attributed without the agent knowing. Its
  client (`rollout_chat`) calls the ledger in process for `chat`; its `client` speaks HTTP to the same route.
- A request the ledger refuses (`PromptTooLong`, `UnsupportedRequest`) is an HTTP 400 on the wire.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agent.llm import OpenAIChat
from inference.batcher import Batcher
from inference.engine import ContinuousEngine, Engine
from inference.hf import HFGenerate
from inference.ledger import CallRecord, ChatRequest, PromptTooLong, TokenLedger, UnsupportedRequest
from models.chat import ChatFormat

DEFAULT_ROLLOUT = "default"

Complete = Callable[[str, ChatRequest], Awaitable[dict[str, Any]]]  # a call of a rollout -> its chat.completion


@dataclass
class ServerChat(OpenAIChat):
    """A rollout's client of the policy server. `chat` calls the ledger in this process: the same request, the same
    recorded tokens, without the OpenAI SDK's request transform, httpx and FastAPI, which were about half of what a
    call cost the event loop that also drives generation (`bench/rollout_loop.py`). `client` still speaks HTTP to the
    same route (through ASGI, no sockets), for agents that bring their own OpenAI client (openai-agents)."""

    complete: Callable[[ChatRequest], Awaitable[dict[str, Any]]] | None = None

    async def chat(self, messages: list[dict[str, Any]]) -> str:
        assert self.complete is not None
        # As on the wire: the ledger gets its own copy of the messages, JSON's types and all.
        request = ChatRequest(model=self.model, messages=json.loads(json.dumps(messages)), **self.sampling)
        response = await self.complete(request)
        return response["choices"][0]["message"].get("content") or ""


def chat_app(complete: Complete) -> FastAPI:
    """The HTTP surface: `/v1/chat/completions` (rollout `default`), `/rollouts/<id>/v1/chat/completions` and
    `/v1/models`, each call answered by `complete`."""
    app = FastAPI(title="policy server")

    async def answer(rollout_id: str, request: ChatRequest) -> dict[str, Any]:
        try:
            return await complete(rollout_id, request)
        except (PromptTooLong, UnsupportedRequest) as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc

    @app.post("/v1/chat/completions")
    async def completions(request: ChatRequest) -> dict[str, Any]:
        return await answer(DEFAULT_ROLLOUT, request)

    @app.post("/rollouts/{rollout_id}/v1/chat/completions")
    async def rollout_completions(rollout_id: str, request: ChatRequest) -> dict[str, Any]:
        return await answer(rollout_id, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "local"}]}

    return app


class AppOnFirstRequest:
    """An ASGI app built when its first request comes (a rollout's HTTP surface that only an agent bringing its own
    OpenAI client ever calls)."""

    def __init__(self, build: Callable[[], ASGIApp]) -> None:
        self._build = build
        self._app: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._app is None:
            self._app = self._build()
        await self._app(scope, receive, send)


def rollout_chat(
    ledger: TokenLedger,
    rollout_id: str,
    sampling: dict[str, Any],
    app: ASGIApp | None = None,
    *,
    wire: bool = False,
) -> OpenAIChat:
    """A client whose calls are recorded in `ledger` under `rollout_id`, a fresh rollout: a `ServerChat`, or with
    `wire` a plain OpenAIChat whose every call goes through the SDK and HTTP to `app` (through ASGI, no sockets).
    Without `app`, the ledger's own HTTP surface (`chat_app`) is built at the client's first HTTP request."""
    ledger.open(rollout_id)
    http = OpenAIChat.connect(
        f"http://policy/rollouts/{rollout_id}/v1",
        "policy",
        sampling=sampling,
        transport=httpx.ASGITransport(app=app or AppOnFirstRequest(lambda: chat_app(ledger.complete))),
    )
    if wire:
        return http
    complete = functools.partial(ledger.complete, rollout_id)
    return ServerChat(http.client, http.model, http.sampling, complete, app=http.app)


class PolicyServer:
    """Serves `model` at `/v1/chat/completions` and `/rollouts/<id>/v1/chat/completions`: a `TokenLedger` whose
    calls a `Batcher` generates, behind `chat_app`."""

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
        self.tokenizer = tokenizer
        self.chat_format = chat_format or ChatFormat(tokenizer)
        self.batcher = Batcher(
            engine or HFGenerate(),
            model,  # None: the engine holds the weights (it is never handed the model)
            eos_ids=eos_ids if eos_ids is not None else eos_ids_of(model.generation_config, tokenizer),
            pad_id=tokenizer.pad_token_id,
            max_batch_size=max_batch_size,
            batch_wait_s=batch_wait_s,
        )
        self.ledger = TokenLedger(
            tokenizer,
            self.chat_format,
            max_prompt_tokens=max_prompt_tokens,
            max_response_tokens=max_response_tokens,
            generate=self.batcher.generate,
        )
        self.app = chat_app(self.ledger.complete)

    @property
    def engine(self) -> Engine | ContinuousEngine:
        return self.batcher.engine

    @property
    def model(self) -> PreTrainedModel | None:
        return self.batcher.model

    @property
    def generate_calls(self) -> int:
        """`generate` calls of a batch engine so far (one per batch and sampling setting)."""
        return self.batcher.generate_calls

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens the engine computed, every sampled call so far."""
        return self.ledger.prefilled_tokens

    @property
    def generated_tokens(self) -> int:
        """Tokens the engine generated, every sampled call so far."""
        return self.ledger.generated_tokens

    # ---- what the trainer uses ---------------------------------------------------------------------------------
    def load(self, model: PreTrainedModel, version: int = 0) -> None:
        """Serve `model` with its current weights (an engine that keeps its own copy gets them now; the caller times
        it with the gather before it, `timing_s/weight_sync`). `version`: the trainer's optimizer steps behind them,
        what each call sent from now on records (`CallRecord.weights_version`). Where a batch may be generating, the
        caller holds `lock` over this and over any refresh of the weights it serves."""
        self.batcher.load(model)
        self.ledger.weights_version = version

    @property
    def lock(self) -> threading.Lock:
        """Held by a batch engine's batch while it generates (`Batcher.lock`)."""
        return self.batcher.lock

    def chat_model(self, rollout_id: str, sampling: dict[str, Any], *, wire: bool = False) -> OpenAIChat:
        """An in-process client whose calls are recorded under `rollout_id` (`rollout_chat`, through this server's
        app)."""
        return rollout_chat(self.ledger, rollout_id, sampling, self.app, wire=wire)

    def active_rollouts(self, count: int) -> AbstractContextManager[Callable[[], None]]:
        """Tell the batcher that `count` more rollouts are running, so it generates as soon as all of them are
        waiting; yields what each calls once it ends (`Batcher.active_rollouts`)."""
        return self.batcher.active_rollouts(count)

    def pop_records(self, rollout_id: str) -> list[CallRecord]:
        return self.ledger.pop_records(rollout_id)


def eos_ids_of(generation_config: Any, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids that end a reply: the model's generation config's (what vLLM stops at too), else the tokenizer's."""
    return set(_as_list(generation_config.eos_token_id) or [tokenizer.eos_token_id])


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)

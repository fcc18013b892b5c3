"""What an agent talks to: a chat model behind an OpenAI-compatible endpoint.

Agents only see the `ChatModel` protocol. The trainer's in-process policy server, vLLM, an OpenAI-style API and
`transformers serve` all reach an agent as an `OpenAIChat`; tests and SFT demonstrations use `ScriptedChat`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from openai import AsyncOpenAI

from foundation.schema import number

Message = dict[str, str]


class ChatModel(Protocol):
    async def chat(self, messages: list[Message]) -> str: ...


@dataclass
class OpenAIChat:
    """One rollout's view of an endpoint: a client, a model name and the sampling parameters sent with each call."""

    client: AsyncOpenAI
    model: str
    sampling: dict[str, Any] = field(default_factory=dict)
    # The ASGI app behind `client` when it reaches its server in process (no socket), else None: agent=lit serves it
    # on a loopback port for agents that bring their own client (agent/loopback.py).
    app: Any = field(default=None, kw_only=True, repr=False)

    @classmethod
    def connect(
        cls,
        base_url: str,
        model: str,
        *,
        api_key: str = "EMPTY",
        sampling: dict[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout_s: float = 600.0,
    ) -> OpenAIChat:
        http_client = httpx.AsyncClient(transport=transport, timeout=timeout_s) if transport else None
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
        app = transport.app if isinstance(transport, httpx.ASGITransport) else None
        return cls(client=client, model=model, sampling=dict(sampling or {}), app=app)

    async def chat(self, messages: list[Message]) -> str:
        response = await self.client.chat.completions.create(model=self.model, messages=messages, **self.sampling)
        return response.choices[0].message.content or ""


@dataclass
class Endpoint:
    """An OpenAI-compatible server to evaluate against (`conf/endpoint/*.yaml`). The API key is read from the
    environment variable named by `api_key_env`, never from the config."""

    base_url: str
    model: str | None
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = number(8, gt=0)  # rollouts in flight at once
    limit: int | None = number(None, gt=0)  # evaluate only the first N tasks (None: all)
    temperature: float = number(0.0, ge=0)  # 0: greedy
    max_tokens: int = number(512, gt=0)  # per call
    timeout_s: float = number(120.0, gt=0)  # per call

    @property
    def api_key(self) -> str:
        return os.environ.get(self.api_key_env, "EMPTY")

    def check_reachable(self) -> str:
        """Fail with a clear message unless the server answers; returns the model to use.

        `GET /models` must answer. Its list names the model when `endpoint.model` is null; some servers
        (`transformers serve` with no hub cache) cannot list, which is fine when `endpoint.model` is set.
        """
        url = self.base_url.rstrip("/") + "/models"
        try:
            response = httpx.get(url, headers={"Authorization": f"Bearer {self.api_key}"}, timeout=10.0)
        except httpx.HTTPError as exc:
            raise ConnectionError(f"endpoint.base_url={self.base_url} is not reachable ({url}: {exc})") from exc
        if response.status_code in (401, 403):
            raise PermissionError(f"endpoint.base_url={self.base_url} refused the key in ${self.api_key_env}")
        if self.model is not None:
            return self.model
        served = [m.get("id") for m in response.json().get("data", [])] if response.is_success else []
        if len(served) != 1:
            raise ValueError(f"endpoint.model is not set and {url} lists {served or 'nothing'}: set endpoint.model")
        return str(served[0])

    def chat(self, model: str) -> OpenAIChat:
        sampling = {"temperature": self.temperature, "max_tokens": self.max_tokens}
        return OpenAIChat.connect(
            self.base_url, model, api_key=self.api_key, sampling=sampling, timeout_s=self.timeout_s
        )


@dataclass
class ScriptedChat:
    """Answers with a fixed list of replies, in order; records the messages it was sent."""

    replies: list[str]
    seen: list[list[Message]] = field(default_factory=list)
    _next: Iterator[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._next = iter(self.replies)

    async def chat(self, messages: list[Message]) -> str:
        self.seen.append([dict(m) for m in messages])
        try:
            return next(self._next)
        except StopIteration:
            raise RuntimeError(f"scripted chat ran out of replies after {len(self.replies)} calls") from None

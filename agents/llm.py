"""What an agent talks to: a chat model behind an OpenAI-compatible endpoint.

Agents only see the `ChatModel` protocol. The trainer's in-process policy server, vLLM, an OpenAI-style API and
`transformers serve` all reach an agent as an `OpenAIChat`; tests and SFT demonstrations use `ScriptedChat`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from openai import AsyncOpenAI

Message = dict[str, str]


class ChatModel(Protocol):
    async def chat(self, messages: list[Message]) -> str: ...


@dataclass
class OpenAIChat:
    """One rollout's view of an endpoint: a client, a model name and the sampling parameters sent with each call."""

    client: AsyncOpenAI
    model: str
    sampling: dict[str, Any] = field(default_factory=dict)

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
        return cls(client=client, model=model, sampling=dict(sampling or {}))

    async def chat(self, messages: list[Message]) -> str:
        response = await self.client.chat.completions.create(model=self.model, messages=messages, **self.sampling)
        return response.choices[0].message.content or ""


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

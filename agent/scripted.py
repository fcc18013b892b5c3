"""A scripted OpenAI-compatible chat server: the caller decides every reply, tool calls included.

Tests drive agents through their branches with it (served on loopback); the SFT warm start replays an agent's
`oracle` replies through it in-process, so demonstrations are the exact requests the agent makes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI
from openai import AsyncOpenAI

from agent.llm import Message, OpenAIChat


@dataclass(frozen=True)
class Reply:
    """Text, or a call of `tool` with `arguments` (a JSON string, sent as is: the test may send broken JSON)."""

    content: str | None = None
    tool: str | None = None
    arguments: str = "{}"


def say(content: str) -> Reply:
    return Reply(content=content)


def call(tool: str, **arguments: Any) -> Reply:
    return Reply(tool=tool, arguments=json.dumps(arguments, ensure_ascii=False))


# Chooses the reply from the request's messages (the turn is the number of assistant messages so far).
Script = Callable[[list[dict[str, Any]]], Reply]


def turn(messages: list[dict[str, Any]]) -> int:
    return sum(m.get("role") == "assistant" for m in messages)


def message_of(reply: Reply) -> dict[str, Any]:
    """The assistant message (OpenAI format) that `reply` stands for."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool is not None:
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        message["tool_calls"] = [
            {"id": call_id, "type": "function", "function": {"name": reply.tool, "arguments": reply.arguments}}
        ]
    return message


def chat_app(answer: Callable[[dict[str, Any]], dict[str, Any]], model: str = "scripted") -> FastAPI:
    """An OpenAI-compatible app whose `/v1/chat/completions` replies with `answer(request body)`."""
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    @app.post("/v1/chat/completions")
    def complete(body: dict[str, Any]) -> dict[str, Any]:
        message = answer(body)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {"index": 0, "message": message, "finish_reason": "tool_calls" if "tool_calls" in message else "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    return app


def scripted_app(script: Script, model: str = "scripted") -> FastAPI:
    """A server (for tests) whose reply to each request is `script(messages)`; requests are kept in `app.state`."""
    requests: list[dict[str, Any]] = []

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        requests.append(body)
        return message_of(script(body["messages"]))

    app = chat_app(answer, model)
    app.state.requests = requests
    return app


class ReplayChat:
    """Answers with `script` in turn and records every request and reply.

    Text agents call `chat()`, answered directly; agents that call tools through an SDK use `client`, an OpenAI
    client wired in-process (no sockets) to the same script.
    """

    model = "scripted"

    def __init__(self, script: list[Reply]) -> None:
        self.script = script
        self.sampling: dict[str, Any] = {}
        self.requests: list[dict[str, Any]] = []
        self.replies: list[dict[str, Any]] = []
        self._client: AsyncOpenAI | None = None

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        index = turn(body["messages"])
        if index >= len(self.script):
            raise RuntimeError(f"the script has {len(self.script)} replies; turn {index + 1} was asked for")
        message = message_of(self.script[index])
        self.requests.append(body)
        self.replies.append(message)
        return message

    async def chat(self, messages: list[Message]) -> str:
        return self.answer({"messages": messages})["content"] or ""

    @property
    def client(self) -> AsyncOpenAI:
        if self._client is None:
            transport = httpx.ASGITransport(app=chat_app(self.answer, self.model))
            self._client = OpenAIChat.connect("http://scripted/v1", self.model, transport=transport).client
        return self._client


def last_tool_output(messages: list[dict[str, Any]]) -> str:
    return next(m["content"] for m in reversed(messages) if m.get("role") == "tool")


def first_user_text(messages: list[dict[str, Any]]) -> str:
    content = next(m["content"] for m in messages if m.get("role") == "user")
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)

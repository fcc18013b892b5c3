"""A scripted OpenAI-compatible chat server: the test decides every reply, tool calls included."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI


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


def scripted_app(script: Script, model: str = "scripted") -> FastAPI:
    app = FastAPI()
    app.state.requests = []

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    @app.post("/v1/chat/completions")
    def complete(body: dict[str, Any]) -> dict[str, Any]:
        app.state.requests.append(body)
        reply = script(body["messages"])
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        finish = "stop"
        if reply.tool is not None:
            call_id = f"call_{uuid.uuid4().hex[:12]}"
            message["tool_calls"] = [
                {"id": call_id, "type": "function", "function": {"name": reply.tool, "arguments": reply.arguments}}
            ]
            finish = "tool_calls"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    return app


def last_tool_output(messages: list[dict[str, Any]]) -> str:
    return next(m["content"] for m in reversed(messages) if m.get("role") == "tool")


def first_user_text(messages: list[dict[str, Any]]) -> str:
    content = next(m["content"] for m in messages if m.get("role") == "user")
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)

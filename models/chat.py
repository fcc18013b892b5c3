"""A model's chat format: its template, token in / token out across turns, and how its replies read as messages.

Token in, token out. The prompt of a rollout's first call is the chat template's rendering of its messages. The prompt
of every later call is the previous prompt, the ids sampled for it (as sampled, end token included), and the tokens of
only the messages added since, rendered as the template's *delta* (`continuation_ids`), as TRL's tool loop, verl's
agent loop and SkyRL do. The model never sees a re-tokenized copy of its own output, whatever the template does to
earlier turns on a re-render (Qwen3 drops old `<think>` blocks; templates re-serialize tool-call JSON with spaces).

The delta of new messages is read off one rendering of `[user, assistant(MARK)] + new`: everything after the marker's
end of turn. Only the part of that end of turn the model did not sample (Qwen's newline after `<|im_end|>`; all of
it when a reply was cut by length) is added before the new messages.

Templates shipped here (`models/chat_templates/`, `model.chat_template=<name>` for the tiny model) are TRL's files,
unchanged, so TRL's SFT recognises them for assistant-only loss: `qwen25` (Qwen2.5, hermes tool calls), `qwen3`
(Qwen3: thinking, hermes tool calls; `model.enable_thinking=false` turns thinking off), `llama3` (Llama 3.x turns, no
tool section).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from typing import Any

from transformers import PreTrainedTokenizerBase

CHAT_TEMPLATES = ("qwen25", "qwen3", "llama3")
TOOL_CALL_FORMATS = ("hermes", "llama3_json")
# How each shipped template writes the tool calls it shows the model: the parser must read replies the same way.
TEMPLATE_TOOL_CALLS = {"qwen25": "hermes", "qwen3": "hermes", "llama3": "llama3_json"}
# A reply text that no real conversation holds: where the delta of new messages starts in a rendering.
_MARK = "<<arl:assistant-turn-end>>"
# The conversation a delta is rendered after: the marker's turn ends just before the new messages.
_BASE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": _MARK}]
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


def check_tool_call_format(name: str) -> None:
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(f"model.tool_call_format must be one of {', '.join(TOOL_CALL_FORMATS)}; got {name!r}")


def check_template_pair(template: str, tool_call_format: str) -> None:
    """A shipped template and the tool-call parser must agree (what the model is shown is what its replies are read
    as); a mismatch parses none of the model's tool calls."""
    wanted = TEMPLATE_TOOL_CALLS.get(template)
    if wanted is not None and tool_call_format != wanted:
        raise ValueError(
            f"model.chat_template={template} writes tool calls as {wanted}, but model.tool_call_format="
            f"{tool_call_format} would read none of them: set model.tool_call_format={wanted}"
        )


def chat_template(name: str) -> str:
    """The text of a shipped template (`models/chat_templates/<name>.jinja`)."""
    if name not in CHAT_TEMPLATES:
        raise ValueError(f"model.chat_template must be one of {', '.join(CHAT_TEMPLATES)}; got {name!r}")
    return resources.files("models").joinpath(f"chat_templates/{name}.jinja").read_text(encoding="utf-8")


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


def same_message(sent: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Whether a message an agent sends back is the one the conversation holds: role, content (None = ""), and
    tool calls by name and parsed arguments. Ids and fields an SDK adds (refusal, annotations) do not count."""

    def calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
        return [
            (c["function"]["name"], _arguments(c["function"].get("arguments"))) for c in message.get("tool_calls") or []
        ]

    return (
        sent.get("role") == kept.get("role")
        and (sent.get("content") or "") == (kept.get("content") or "")
        and calls(sent) == calls(kept)
    )


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


@dataclass
class ChatFormat:
    """Renders prompts and deltas with `tokenizer`'s chat template and reads replies in `tool_call_format`."""

    tokenizer: PreTrainedTokenizerBase
    tool_call_format: str = "hermes"
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking for Qwen3

    def __post_init__(self) -> None:
        check_tool_call_format(self.tool_call_format)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            [for_template(m) for m in messages],
            tools=tools,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """A conversation's first prompt: the template's rendering, with the generation prompt."""
        return self.encode(self.render(messages, tools))

    @cached_property
    def turn_end(self) -> str:
        """What the template writes after an assistant turn's content (`<|im_end|>\\n` for Qwen)."""
        text = self.render(_BASE, None, generation_prompt=False)
        return text[text.index(_MARK) + len(_MARK) :]

    def continuation_ids(
        self,
        new_messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        sampled_ids: list[int],
        stopped: bool,
    ) -> list[int]:
        """The ids that follow a sampled reply when `new_messages` are added: the part of the template's end of turn
        that was not sampled, the new messages, and the generation prompt. `stopped`: the reply ended with an end
        token the model sampled (its text, e.g. `<|im_end|>`, then starts the end of turn); otherwise (cut by length)
        the whole end of turn is added."""
        text = self.render([*_BASE, *new_messages], tools)
        start = text.index(_MARK) + len(_MARK)
        if not text.startswith(self.turn_end, start):
            raise ValueError("the chat template ends an assistant turn differently when messages follow it")
        delta = text[start + len(self.turn_end) :]
        rest = self.turn_end
        if stopped and sampled_ids:
            end_token = self.tokenizer.decode(sampled_ids[-1:], skip_special_tokens=False)
            if rest.startswith(end_token):
                rest = rest[len(end_token) :]
        return self.encode(rest + delta)

    def reply(self, text: str, tools: bool) -> dict[str, Any]:
        """The assistant message of a sampled reply (special tokens dropped): a leading `<think>` block becomes
        `reasoning_content`; with `tools`, tool calls in the model's format become OpenAI `tool_calls`."""
        message: dict[str, Any] = {"role": "assistant"}
        think = _THINK.match(text)
        if think:
            message["reasoning_content"] = think.group(1).strip("\n")
            text = text[think.end() :]
        if not tools:
            return message | {"content": text}
        parse = parse_hermes if self.tool_call_format == "hermes" else parse_llama3_json
        return message | parse(text)


def _tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def parse_hermes(text: str) -> dict[str, Any]:
    """Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks -> OpenAI `tool_calls`.

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
        calls.append(_tool_call(name, arguments))
    if not calls:
        return {"content": text}
    content = ("".join(kept) + text[last:]).strip()
    return {"content": content or None, "tool_calls": calls}


def parse_llama3_json(text: str) -> dict[str, Any]:
    """Llama 3.x JSON tool calls: the whole reply (after an optional `<|python_tag|>`) is
    `{"name": ..., "parameters": {...}}`; anything else is plain content."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    try:
        call = json.loads(body)
        name, arguments = call["name"], call.get("parameters", call.get("arguments", {}))
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise TypeError("not a tool call")
    except (ValueError, KeyError, TypeError):
        return {"content": text}
    return {"content": None, "tool_calls": [_tool_call(name, arguments)]}

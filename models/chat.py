"""A model's chat format: its template, token in / token out across turns, and how its replies read as messages.

Token in, token out. The prompt of a rollout's first call is the chat template's rendering of its messages. The prompt
of every later call is the previous prompt, the ids sampled for it (as sampled, end token included), and the tokens of
only the messages added since, rendered as the template's *delta* (`continuation_ids`), as TRL's tool loop, verl's
agent loop and SkyRL do. The model never sees a re-tokenized copy of its own output, whatever the template does to
earlier turns on a re-render (Qwen3 drops old `<think>` blocks; templates re-serialize tool-call JSON with spaces).

The delta of new messages is read off one rendering of `[user, assistant(MARK)] + new`: everything after the marker's
end of turn. Only the part of that end of turn the model did not sample (Qwen's newline after `<|im_end|>`; all of
it when a reply was cut by length) is added before the new messages.

Only the template writes control tokens. The text of a special token inside what the request carries (a tool result
or a database row holding `<|im_end|>`, a user's `<|eot_id|>`) is encoded as ordinary ids, never as the control token
(`ChatFormat.prompt_ids`). Content given as a list of OpenAI parts is read as its text parts' text (`content_text`).

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


def content_problem(content: Any) -> str | None:
    """Why a message's `content` is not text (a string, None, or a list of OpenAI text parts), naming the part; None
    when it is. The policy reads text only: an image, audio, file or refusal part cannot be rendered."""
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"content: a string or a list of text parts, not a {type(content).__name__}"
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            return f"content[{j}]: a {kind!r} part is not supported; only text parts (the policy reads text only)"
    return None


def content_text(content: Any) -> str:
    """A message's content as the text a template renders: a string as is, None as "", a list of OpenAI content parts
    as its text parts' texts concatenated (as OpenAI reads them). Any other part is an error (`content_problem`)."""
    if isinstance(content, str):
        return content
    if (problem := content_problem(content)) is not None:
        raise ValueError(problem)
    return "".join(part["text"] for part in content or [])


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI message -> what chat templates expect: tool-call arguments as objects, content as a string (None: "";
    text parts: their text)."""
    out = dict(message)
    out["content"] = content_text(out.get("content"))
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
            for c in out["tool_calls"]
        ]
    return out


def same_message(sent: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Whether a message an agent sends back is the one the conversation holds, in what a shipped template renders:
    role; content as text (`content_text`: None = "", text parts = their text, so a string resent as parts is the same
    message); tool calls by name and parsed arguments; and `reasoning_content` when the agent sends one: Qwen3's
    template renders it, so one that differs from the held one (for the server's reply, the `<think>` block it
    returned) is a rewrite, while leaving it out, as most SDKs do, is not. Not compared, because no shipped template
    renders them: ids (`tool_call_id`, tool calls' `id`) and fields an SDK adds (refusal, annotations)."""

    def calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
        return [
            (c["function"]["name"], _arguments(c["function"].get("arguments"))) for c in message.get("tool_calls") or []
        ]

    reasoning = sent.get("reasoning_content")
    return (
        sent.get("role") == kept.get("role")
        and content_text(sent.get("content")) == content_text(kept.get("content"))
        and calls(sent) == calls(kept)
        and (reasoning is None or reasoning == (kept.get("reasoning_content") or ""))
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
    keep_thinking: bool = True  # earlier replies' thinking across a new user message: as sampled (`drops_thinking`)
    _plain_ids: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        check_tool_call_format(self.tool_call_format)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation_prompt: bool = True
    ) -> str:
        return self._apply([for_template(m) for m in messages], tools, generation_prompt)

    def _apply(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation_prompt: bool
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """A conversation's first prompt: the template's rendering, with the generation prompt.

        Only the template's own text holds control tokens. Special-token text in any string value of a message (the
        content of every role, the assistant's too, since a fresh rendering is not what was sampled; reasoning_content;
        tool-call arguments; not `role`) or of `tools` is encoded as ordinary ids: each occurrence is wrapped in two
        marker characters the rendering does not hold, the marked request is rendered again, and without its markers
        that text must be the plain rendering (else ValueError: the template treats the marked text differently). The
        plain rendering is encoded as before, and each control id read at a marked occurrence is replaced by that
        text's ordinary ids (`_plain`). A request without special-token text is rendered once and encoded as is."""
        return self._encode(*self._rendered(messages, tools, generation_prompt=True))

    def drops_thinking(self, kept: list[dict[str, Any]], new_messages: list[dict[str, Any]]) -> bool:
        """Whether continuing the sampled tokens with `new_messages` is refused for thinking: with `keep_thinking`
        off, when a new user message follows a reply that thought (`reasoning_content`). Qwen3's template drops that
        thinking from every turn before the last user message, so a deployed model never sees it there; token in,
        token out keeps it as sampled. Off, such a call is answered from the template's rendering, and its rollout,
        which cannot be one sample then, is excluded (`inexact`) instead of trained on a prompt no deployment makes."""
        return (
            not self.keep_thinking
            and any(m.get("role") == "user" for m in new_messages)
            and any(m.get("role") == "assistant" and m.get("reasoning_content") for m in kept)
        )

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
        the whole end of turn is added. Special-token text in the new messages is ordinary ids, as in `prompt_ids`."""
        text, spans = self._rendered([*_BASE, *new_messages], tools, generation_prompt=True)
        start = text.index(_MARK) + len(_MARK)
        if not text.startswith(self.turn_end, start):
            raise ValueError("the chat template ends an assistant turn differently when messages follow it")
        cut = start + len(self.turn_end)
        rest = self.turn_end
        if stopped and sampled_ids:
            end_token = self.tokenizer.decode(sampled_ids[-1:], skip_special_tokens=False)
            if rest.startswith(end_token):
                rest = rest[len(end_token) :]
        shift = len(rest) - cut  # positions in `text` -> positions in `rest + delta`
        return self._encode(rest + text[cut:], [(s + shift, e + shift) for s, e in spans if s >= cut])

    # ---- special-token text in what the request carries: ordinary ids ---------------------------------------------
    @cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The text of the tokenizer's special (control) tokens, longest first. Read off its added tokens:
        `all_special_tokens` names only those with a role (eos, pad, ...), not e.g. `<|im_start|>`."""
        added = {t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special}
        return tuple(sorted(added | set(self.tokenizer.all_special_tokens), key=len, reverse=True))

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.convert_tokens_to_ids(list(self.special_tokens)))

    @cached_property
    def _special_text(self) -> re.Pattern[str]:
        return re.compile("|".join(map(re.escape, self.special_tokens)) or "(?!)")  # leftmost-longest, as tokenizers

    def _rendered(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation_prompt: bool
    ) -> tuple[str, list[tuple[int, int]]]:
        """The template's rendering of `messages`, and the spans of it, in order, that hold special-token text the
        request carried (not the template's own): what `_encode` turns into ordinary ids."""
        prepared = [for_template(m) for m in messages]
        text = self._apply(prepared, tools, generation_prompt)
        free = (chr(c) for c in range(0xF0000, 0xFFFFE) if chr(c) not in text)  # private use, not in the rendering
        left, right = next(free), next(free)
        marked = [{k: v if k == "role" else self._mark(v, left, right) for k, v in m.items()} for m in prepared]
        marked_tools = self._mark(tools, left, right)
        if marked == prepared and marked_tools == tools:
            return text, []
        marked_text = self._apply(marked, marked_tools, generation_prompt)
        pieces = re.split(f"{left}({self._special_text.pattern}){right}|[{left}{right}]", marked_text)
        spans, at = [], 0
        for i, piece in enumerate(pieces):
            if i % 2 and piece is None:
                raise ValueError("the chat template cut special-token text in a message; it cannot be told apart")
            if i % 2:
                spans.append((at, at + len(piece)))
            at += len(piece)
        if "".join(pieces) != text:
            raise ValueError("the chat template renders a message differently once its special-token text is marked")
        return text, spans

    def carries_special_text(self, value: Any) -> bool:
        """Whether any string in `value` (nested lists and dicts; not dict keys) holds a special token's text."""
        return self._mark(value, "\0", "\0") != value

    def _mark(self, value: Any, left: str, right: str) -> Any:
        """`value` with each special-token text in its strings (not in dict keys) wrapped in `left` and `right`."""
        if isinstance(value, str):
            return self._special_text.sub(lambda match: f"{left}{match.group(0)}{right}", value)
        if isinstance(value, dict):
            return {k: self._mark(v, left, right) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._mark(v, left, right) for v in value]
        return value

    def _encode(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """`text`'s ids, where each control token the tokenizer reads inside one of `spans` is ordinary ids instead."""
        if not spans:
            return self.encode(text)
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = []
        pending = iter(spans)
        span = next(pending, None)
        for token, (s, e) in zip(encoding["input_ids"], encoding["offset_mapping"], strict=True):
            while span is not None and span[1] <= s:  # passed without a control token read there
                span = next(pending, None)
            if span is not None and token in self._special_ids and s <= span[0] and span[1] <= e:
                ids += self._plain(text[s:e])
                span = next(pending, None)
            else:
                ids.append(token)
        return ids

    def _plain(self, piece: str) -> list[int]:
        """A special token's text as ordinary ids (the tokenizer's `split_special_tokens`), encoded after a newline
        that is then dropped, so a SentencePiece tokenizer adds no word-start space (alone if the newline merges)."""
        if piece not in self._plain_ids:

            def as_text(text: str) -> list[int]:
                return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

            newline, ids = self.encode("\n"), as_text("\n" + piece)
            ids = ids[len(newline) :] if ids[: len(newline)] == newline else as_text(piece)
            self.encode("")  # a fast tokenizer keeps `split_special_tokens` on until its next call: set it back
            if self._special_ids.intersection(ids) or self.tokenizer.decode(ids) != piece:
                raise ValueError(f"the tokenizer cannot encode {piece!r} as ordinary text")
            self._plain_ids[piece] = ids
        return self._plain_ids[piece]

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

"""The policy server: OpenAI-compatible, batches concurrent rollouts, records token ids that chain across turns."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import openai
import pytest

from agent.llm import OpenAIChat
from backends.samples import flatten
from inference.policy_server import PolicyServer, PromptTooLong, UnsupportedRequest
from tests.conftest import micro_tiny

CORPUS = ["You are a helpful assistant.", "What is in the table?", "SELECT name FROM people"] * 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    spec = micro_tiny(tmp_path_factory.mktemp("models"))
    source = spec.prepare(CORPUS)
    return spec.load_model(source, "cpu"), spec.load_tokenizer(source)


def server_for(tiny, **kwargs) -> PolicyServer:
    model, tokenizer = tiny
    settings = {"max_prompt_tokens": 128, "max_response_tokens": 96} | kwargs
    return PolicyServer(model, tokenizer, **settings)


async def two_turns(chat: OpenAIChat) -> list[str]:
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"}]
    first = await chat.chat(messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "What is in the table?"}]
    return [first, await chat.chat(messages)]


def test_turns_chain_into_one_sequence_with_added_text_masked(tiny) -> None:
    server = server_for(tiny)
    chat = server.chat_model("r0", {"temperature": 0.0, "max_tokens": 8})
    asyncio.run(two_turns(chat))
    first, second = server.pop_records("r0")
    assert second.continues
    assert (
        second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)]
        == first.prompt_ids + first.completion_ids
    )

    sample = flatten([first, second], max_completion_tokens=1000)
    assert not isinstance(sample, str) and sample.prompt_ids == first.prompt_ids
    assert len(sample.completion_ids) == len(sample.env_mask)
    added = [t for t, m in zip(sample.completion_ids, sample.env_mask, strict=True) if m == 0]
    added_text = server.tokenizer.decode(added)
    assert "What is in the table?" in added_text and "<|im_start|>user" in added_text
    model_tokens = [t for t, m in zip(sample.completion_ids, sample.env_mask, strict=True) if m == 1]
    assert model_tokens == first.completion_ids + second.completion_ids
    model_logprobs = [lp for lp, m in zip(sample.logprobs, sample.env_mask, strict=True) if m == 1]
    assert model_logprobs == (first.logprobs or []) + (second.logprobs or []) and all(lp <= 0 for lp in model_logprobs)


def test_concurrent_rollouts_share_one_generate_call_per_turn(tiny) -> None:
    server = server_for(tiny, batch_wait_s=30.0)  # only "every active rollout is waiting" starts a batch: no timing
    chats = [server.chat_model(f"r{i}", {"temperature": 1.0, "max_tokens": 6}) for i in range(8)]

    async def run_all() -> None:
        with server.active_rollouts(len(chats)) as finished:

            async def one(chat: OpenAIChat) -> None:
                try:
                    await two_turns(chat)
                finally:
                    finished()

            await asyncio.gather(*(one(c) for c in chats))

    asyncio.run(run_all())
    assert server.generate_calls == 2
    assert all(len(server.pop_records(f"r{i}")) == 2 for i in range(8))


def test_rollouts_that_start_one_by_one_still_share_one_generate_call(tiny) -> None:
    """No count of active rollouts: a batch starts once no request has come for batch_wait_s, and each arrival restarts
    that wait. Checked on the events (the wait's timer, the batch's members), not on a clock: the wait is long enough
    that it never runs out in the test; the test ends it itself once every request is in."""
    server = server_for(tiny, batch_wait_s=3600.0)
    chats = [server.chat_model(f"r{i}", {"temperature": 1.0, "max_tokens": 4}) for i in range(4)]
    timers: list[Any] = []

    async def run_all() -> None:
        calls = []
        for chat in chats:  # one by one: each request is pending before the next is sent
            calls.append(asyncio.create_task(chat.chat([{"role": "user", "content": "Hi"}])))
            for _ in range(100_000):  # a bound on event-loop turns, not on time
                if len(server.batcher._pending) == len(calls):
                    break
                await asyncio.sleep(0)
            assert len(server.batcher._pending) == len(calls), "a request never reached the batcher"
            timers.append(server.batcher._timer)
            if len(timers) > 1:  # this arrival cancelled the wait the previous one started, and started a new one
                assert timers[-1] is not timers[-2] and timers[-2].cancelled() and not timers[-1].cancelled()
        assert server.generate_calls == 0  # nobody started a batch: the wait restarted with every arrival
        server.batcher._start_batch()  # what the last timer would do once the wait ran out
        await asyncio.gather(*calls)

    asyncio.run(run_all())
    assert len(timers) == 4
    assert server.generate_calls == 1 and all(len(server.pop_records(f"r{i}")) == 1 for i in range(4))


def test_a_spent_response_budget_ends_the_rollout_with_length_and_its_sample_is_refused(tiny) -> None:
    server = server_for(tiny, max_response_tokens=8)
    chat = server.chat_model("r0", {"temperature": 0.0, "max_tokens": 8})
    asyncio.run(two_turns(chat))
    first, second = server.pop_records("r0")
    assert len(first.completion_ids) <= 8
    assert second.completion_ids == [] and second.finish_reason == "length" and not second.sampled
    # compute: the sampled call prefilled its whole prompt (HF generate), the unsampled one nothing
    assert (first.prefilled, second.prefilled) == (len(first.prompt_ids), 0)
    assert (server.prefilled_tokens, server.generated_tokens) == (first.prefilled, len(first.completion_ids))
    assert flatten([first, second], max_completion_tokens=1000) == "overflow"  # never cut with the full reward


def test_too_long_a_prompt_is_a_clear_error_in_process_and_a_400_on_the_wire(tiny) -> None:
    server = server_for(tiny, max_prompt_tokens=4)
    messages = [{"role": "user", "content": "What is in the table?"}]
    with pytest.raises(PromptTooLong, match="longer than the limit of 4"):
        asyncio.run(server.chat_model("r0", {"temperature": 0.0}).chat(messages))
    with pytest.raises(openai.BadRequestError, match="longer than the limit of 4"):
        asyncio.run(server.chat_model("r1", {"temperature": 0.0}, wire=True).chat(messages))


@pytest.mark.parametrize(
    ("asked", "refusal"),
    [
        ({"stop": ["END"]}, "stop=['END']: not supported"),
        ({"n": 2}, "n=2: one choice per call"),
        ({"max_tokens": 0}, "max_tokens=0: at least 1 token"),
        ({"presence_penalty": 0.5}, "presence_penalty=0.5: not supported"),
    ],
)
def test_what_the_server_cannot_honour_is_refused_naming_the_field_never_ignored(
    tiny, asked: dict[str, Any], refusal: str
) -> None:
    server = server_for(tiny)
    messages = [{"role": "user", "content": "What is in the table?"}]
    with pytest.raises(UnsupportedRequest, match=re.escape(refusal)):
        asyncio.run(server.chat_model("r0", {"temperature": 0.0} | asked).chat(messages))
    with pytest.raises(openai.BadRequestError, match=re.escape(refusal)):
        asyncio.run(server.chat_model("r1", {"temperature": 0.0} | asked, wire=True).chat(messages))
    assert not server.pop_records("r0") and not server.pop_records("r1")  # nothing was sampled
    ok = server.chat_model("r2", {"temperature": 0.0, "max_tokens": 3, "n": 1, "stop": None})
    asyncio.run(ok.chat(messages))
    assert len(server.pop_records("r2")[0].completion_ids) <= 3


def test_in_process_and_http_calls_record_the_same_tokens(tiny) -> None:
    """`chat` skips the SDK and HTTP; what the server sees, samples and records is the same as on the wire, and the
    rollout's `client` (for agents that bring an OpenAI client) reaches the same rollout's records."""
    server = server_for(tiny)
    replies = {}
    for rollout_id, wire in (("direct", False), ("wire", True)):
        replies[rollout_id] = asyncio.run(two_turns(server.chat_model(rollout_id, {"temperature": 0.0}, wire=wire)))
    direct, wire = server.pop_records("direct"), server.pop_records("wire")
    assert replies["direct"] == replies["wire"]
    assert [(c.prompt_ids, c.completion_ids, c.continues) for c in direct] == [
        (c.prompt_ids, c.completion_ids, c.continues) for c in wire
    ]
    assert len(direct) == 2 and direct[1].continues

    chat = server.chat_model("sdk", {"temperature": 0.0})

    async def through_client() -> str:
        response = await chat.client.chat.completions.create(
            model=chat.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        return response.choices[0].message.content or ""

    asyncio.run(through_client())
    assert len(server.pop_records("sdk")) == 1


def test_a_call_that_does_not_continue_makes_the_sample_inexact(tiny, tmp_path: Path) -> None:
    server = server_for(tiny)
    chat = server.chat_model("r0", {"temperature": 0.0, "max_tokens": 4})

    async def restart() -> None:
        await chat.chat([{"role": "user", "content": "Hi"}])
        await chat.chat([{"role": "user", "content": "Something else entirely"}])

    asyncio.run(restart())
    calls = server.pop_records("r0")
    assert not calls[1].continues
    assert flatten(calls, max_completion_tokens=1000) == "inexact"


def test_a_later_call_that_breaks_the_sequence_ends_the_rollout_instead_of_failing(tiny) -> None:
    server = server_for(tiny, max_prompt_tokens=80)
    chat = server.chat_model("r0", {"temperature": 0.0, "max_tokens": 4})
    long_text = " ".join(["What is in the table?"] * 30)

    async def restart() -> list[str]:
        first = await chat.chat([{"role": "user", "content": "Hi"}])
        return [first, await chat.chat([{"role": "user", "content": long_text}])]  # not a continuation, too long

    _, second = asyncio.run(restart())
    calls = server.pop_records("r0")
    assert second == "" and calls[1].finish_reason == "length" and calls[1].completion_ids == []


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-abc"}},
    ],
)
def test_a_content_part_that_is_not_text_is_refused_naming_it(tiny, part: dict[str, Any]) -> None:
    server = server_for(tiny)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "What is in the table?"}, part]},
    ]
    refusal = f"messages[1].content[1]: a {part['type']!r} part is not supported"
    with pytest.raises(UnsupportedRequest, match=re.escape(refusal)):
        asyncio.run(server.chat_model("r0", {"temperature": 0.0}).chat(messages))
    with pytest.raises(openai.BadRequestError, match=re.escape(refusal)):
        asyncio.run(server.chat_model("r1", {"temperature": 0.0}, wire=True).chat(messages))
    assert not server.pop_records("r0") and not server.pop_records("r1")  # refused before rendering: nothing sampled


def tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def test_a_later_call_with_other_tools_is_a_fresh_rendering_and_the_rollout_inexact(tiny) -> None:
    """Tools are rendered in the first prompt: a later call whose `tools` differ cannot continue it. It is answered
    from a fresh rendering that shows the new tools, and the rollout is excluded as `inexact`; the same tools again
    continue."""
    server = server_for(tiny, max_prompt_tokens=512)
    first_tools = [tool("people")]

    async def rollout(rollout_id: str, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        chat = server.chat_model(rollout_id, {})
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
        first = await chat.client.chat.completions.create(
            model=chat.model, messages=messages, tools=first_tools, max_tokens=4, temperature=0.0
        )
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
        await chat.client.chat.completions.create(
            model=chat.model, messages=messages, tools=tools, max_tokens=4, temperature=0.0
        )
        return messages

    asyncio.run(rollout("same", [tool("people")]))
    messages = asyncio.run(rollout("other", [tool("table")]))
    same, other = server.pop_records("same"), server.pop_records("other")
    assert same[1].continues and not isinstance(flatten(same, max_completion_tokens=1000), str)
    assert not other[1].continues and flatten(other, max_completion_tokens=1000) == "inexact"
    assert other[1].prompt_ids == server.chat_format.prompt_ids(messages, [tool("table")])
    assert '"name": "table"' in server.tokenizer.decode(other[1].prompt_ids)
    assert '"name": "people"' not in server.tokenizer.decode(other[1].prompt_ids)


def test_requests_whose_callers_were_cancelled_are_never_generated_for(tiny) -> None:
    """A stop signal cancels the rollouts while their requests wait (here 4, in batches of 2): the batch already
    generating finishes, and no further batch starts for requests nobody waits for any more."""
    server = server_for(tiny, batch_wait_s=3600.0, max_batch_size=2)
    chats = [server.chat_model(f"r{i}", {"temperature": 1.0, "max_tokens": 4}) for i in range(4)]

    async def run_all() -> None:
        calls = [asyncio.create_task(chat.chat([{"role": "user", "content": "Hi"}])) for chat in chats]
        for _ in range(100_000):  # a bound on event-loop turns, not on time
            if len(server.batcher._pending) == len(calls):
                break
            await asyncio.sleep(0)
        server.batcher._start_batch()  # the first 2 generate; 2 wait
        batch = server.batcher._batch_task
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await asyncio.gather(batch, return_exceptions=True)  # its end would start the next batch
        for _ in range(1000):
            await asyncio.sleep(0)
        server.batcher._start_batch()  # what a wait running out would do

    asyncio.run(run_all())
    assert server.generate_calls == 1 and server.batcher._pending == []


async def as_group(server: PolicyServer, rollouts: list[Awaitable[Any]], announced: int | None = None) -> None:
    """`rollouts` as one group of active rollouts (`announced` of them: all by default), each saying when it ends; as
    tasks, so that a group started beside this one enters before any call is made, as in the trainer."""
    with server.active_rollouts(len(rollouts) if announced is None else announced) as finished:

        async def one(rollout: Awaitable[Any]) -> None:
            try:
                await rollout
            finally:
                finished()

        await asyncio.gather(*(one(r) for r in rollouts))


def test_two_groups_of_rollouts_on_one_loop_share_one_generate_call_per_turn(tiny) -> None:
    """A batch read ahead beside the step's own (partial rollouts): a batch starts once every rollout of both groups
    waits, not once one group's count of them does."""
    server = server_for(tiny, batch_wait_s=30.0)  # only "every active rollout is waiting" starts a batch: no timing
    chats = [server.chat_model(f"r{i}", {"temperature": 1.0, "max_tokens": 6}) for i in range(6)]

    async def run_all() -> None:
        await asyncio.gather(
            as_group(server, [two_turns(c) for c in chats[:2]]), as_group(server, [two_turns(c) for c in chats[2:]])
        )

    asyncio.run(run_all())
    assert server.generate_calls == 2
    assert server.batcher._active is None  # both groups done: no rollout is waited for


def test_a_group_that_ends_leaves_the_others_rollouts_waited_for(tiny) -> None:
    """One group's rollouts end (its block exits) while another's still run: the batcher waits for those alone."""
    server = server_for(tiny, batch_wait_s=30.0)
    chats = [server.chat_model(f"r{i}", {"temperature": 1.0, "max_tokens": 6}) for i in range(3)]
    active_after_first_group: list[int | None] = []
    first_group_done = asyncio.Event()

    async def one_turn() -> None:
        await as_group(server, [chats[0].chat([{"role": "user", "content": "Hi"}])])
        active_after_first_group.append(server.batcher._active)
        first_group_done.set()

    async def two_turns_after_it(chat: OpenAIChat) -> None:
        messages = [{"role": "user", "content": "Hi"}]
        messages += [{"role": "assistant", "content": await chat.chat(messages)}]
        await first_group_done.wait()
        await chat.chat([*messages, {"role": "user", "content": "What is in the table?"}])

    async def run_all() -> None:
        await asyncio.gather(one_turn(), as_group(server, [two_turns_after_it(c) for c in chats[1:]]))

    asyncio.run(run_all())
    assert active_after_first_group == [2]  # the other group's two rollouts, still running
    assert server.generate_calls == 2 and server.batcher._active is None


def test_a_group_that_ends_with_rollouts_unreported_stops_counting_them(tiny) -> None:
    """A group whose block ends before all its rollouts said they ended (two announced, one ran): the batcher no
    longer waits for the missing one, only for the other group's."""
    server = server_for(tiny)
    chats = [server.chat_model(f"r{i}", {"temperature": 1.0, "max_tokens": 6}) for i in range(2)]
    active_after_first_group: list[int | None] = []
    first_group_done = asyncio.Event()

    async def announced_two_ran_one() -> None:
        await as_group(server, [chats[0].chat([{"role": "user", "content": "Hi"}])], announced=2)
        active_after_first_group.append(server.batcher._active)
        first_group_done.set()

    async def after_it() -> None:
        await first_group_done.wait()
        await chats[1].chat([{"role": "user", "content": "Hi"}])

    async def run_all() -> None:
        await asyncio.gather(announced_two_ran_one(), as_group(server, [after_it()]))

    asyncio.run(run_all())
    assert active_after_first_group == [1]  # the other group's rollout alone

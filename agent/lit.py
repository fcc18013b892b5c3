"""agent=lit: an agent-lightning `LitAgent` subclass trains unchanged (`agent.cls=my_pkg.sql_agent:LitSQLAgent`).

Two parts.

- A stand-in for the API of agent-lightning 0.3.0 that a `LitAgent` is written against: `LitAgent`, `LLM`,
  `NamedResources`, `Rollout` / `Attempt` (`rollout.rollout_id`, `rollout.attempt.attempt_id`, `rollout.mode`),
  `emit_reward` and `self.tracer.get_langchain_handler()`. An agent written for agent-lightning changes only its
  import (`import agentlightning as agl` -> `import agent.lit as agl`). The package itself is not installed: 0.3.0
  resolves beside this project's pins on Python 3.11, but pulls litellm's proxy, agentops and OpenTelemetry (about 60
  packages, agentops instrumenting the OpenAI client), and its runner and tracer would be needed for its `tracer`
  and `emit_reward` to work; 1.x needs Python >= 3.12.
- `LitAgentRunner`, this project's agent (`run(task, llm) -> Trajectory`) around such a class. Each rollout gets
  `resources["main_llm"]`, an `LLM` whose `endpoint` is the rollout's own route of the policy server on a loopback
  port (`agent/loopback.py`): every call is recorded under that rollout, token in, token out. Against a real endpoint
  (job=eval) the route relays each call to it. The calls seen there give the trajectory (the last call's
  conversation, the last ```sql block the model wrote: what the data set's metric scores in validation).
  The reward is what `rollout` returned (a number), else the last `emit_reward` value: one reward either way, never
  the two added. None (and no emitted reward), a value that is no
  finite number, an exception or a time-out is a missing reward: the rollout is excluded from training, never
  scored 0 (`reward=agent_reward` passes it on, `rewards/agent_reward.py`).

The trainer trains on a rollout's calls as one sequence: each call must extend the conversation so far (append the
reply, then the next user message). An agent that builds a fresh prompt per call (agent-lightning's Spider example
does) is excluded as `inexact`. `examples/lit_sql_agent.py` is the Spider loop written so.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import inspect
import itertools
import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Generic, TypeVar
from urllib.parse import urlparse

import openai

from agent.llm import ChatModel, OpenAIChat
from agent.loopback import LOOPBACK
from agent.scripted import ReplayChat, Reply, chat_app, say
from agent.spider_sql import CORRECT, INCORRECT, extract_sql
from agent.trajectory import Trajectory
from foundation.schema import number, one_of

log = logging.getLogger(__name__)

T = TypeVar("T")

# ---- the stand-in: agent-lightning 0.3.0's names and signatures ---------------------------------------------------

NamedResources = dict[str, Any]  # resource name -> resource (`main_llm`: an `LLM`)


@dataclass
class LLM:
    """An OpenAI-compatible endpoint, its model name and the sampling parameters to send (agentlightning.LLM)."""

    endpoint: str
    model: str
    sampling_parameters: dict[str, Any] = field(default_factory=dict)

    def get_base_url(self, *args: Any, **kwargs: Any) -> str:
        """The endpoint: already this rollout's route (agentlightning.ProxyLLM's `get_base_url(rollout_id,
        attempt_id)`)."""
        return self.endpoint


ProxyLLM = LLM


@dataclass
class Attempt:
    rollout_id: str
    attempt_id: str
    sequence_id: int = 1


@dataclass
class Rollout:
    """What a rollout is told about itself (agentlightning.AttemptedRollout): its id, task, mode and attempt."""

    rollout_id: str
    input: Any
    mode: str | None  # train, val or test
    attempt: Attempt


class Tracer:
    """No tracing here: the policy server records every call. `get_langchain_handler()` is None, which LangChain
    takes as no callback (`callbacks=[None]` is not: pass `[h] if h else []`, as agent-lightning's own base tracer
    returns None too)."""

    def get_langchain_handler(self, *args: Any, **kwargs: Any) -> None:
        return None

    get_langchain_callback_handler = get_langchain_handler  # agent-lightning 0.1's name


_EMITTED: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("lit_emitted", default=None)


def emit_reward(
    reward: float | dict[str, Any],
    *,
    primary_key: str | None = None,
    attributes: dict[str, Any] | None = None,
    propagate: bool = True,
) -> None:
    """Record the rollout's reward (agentlightning.emit_reward). The last one emitted counts, unless `rollout`
    returns a number, which counts instead."""
    emitted = _EMITTED.get()
    if emitted is None:
        log.warning("emit_reward outside a rollout: ignored")
        return
    value = reward[primary_key or next(iter(reward))] if isinstance(reward, dict) else reward
    emitted.append(float(value))


class LitAgent(Generic[T]):
    """agentlightning.LitAgent: override `rollout` (or `rollout_async`), or the `training_` / `validation_` pair."""

    def __init__(self, *, trained_agents: str | None = None) -> None:
        self.trained_agents = trained_agents

    @property
    def tracer(self) -> Tracer:
        return Tracer()

    def get_tracer(self) -> Tracer:
        return self.tracer

    def is_async(self) -> bool:
        names = ("rollout_async", "training_rollout_async", "validation_rollout_async")
        return any(getattr(type(self), n) is not getattr(LitAgent, n) for n in names)

    def rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> float | None:
        raise NotImplementedError("Agents must implement the `rollout` method.")

    async def rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> float | None:
        raise NotImplementedError("Agents must implement the `rollout_async` method for async operations.")

    def training_rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> float | None:
        return self.rollout(task, resources, rollout)

    def validation_rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> float | None:
        return self.rollout(task, resources, rollout)

    async def training_rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> float | None:
        return await self.rollout_async(task, resources, rollout)

    async def validation_rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> float | None:
        return await self.rollout_async(task, resources, rollout)


# ---- the adapter ----------------------------------------------------------------------------------------------------


def reward_of(returned: Any, emitted: list[float]) -> float | None:
    """The rollout's one reward: a returned number, else the last emitted one; None (missing) otherwise."""
    if isinstance(returned, bool | int | float):
        value: float | None = float(returned)
    elif returned is None:
        value = emitted[-1] if emitted else None
    else:
        raise TypeError(f"rollout returned a {type(returned).__name__}: agent=lit takes a float reward or None")
    return value if value is not None and math.isfinite(value) else None


def load_class(path: str) -> type:
    """`pkg.module:Class` (or `pkg.module.Class`) -> the class."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not name:
        raise ValueError(f"agent.cls={path}: write it as package.module:Class")
    return getattr(importlib.import_module(module), name)


_IDS = itertools.count()  # route ids of rollouts that bring none
TASK_KINDS = ("text_to_sql", "med_qa", "dbbench")  # the data sets' kinds (data/*.py `task_kind`)


@dataclass
class LitAgentRunner:
    """Runs a `LitAgent` subclass's rollouts as this project's agent. Configured by `conf/agent/lit.yaml`."""

    cls: str  # the LitAgent subclass, package.module:Class
    init: dict[str, Any] = field(default_factory=dict)  # its constructor's keyword arguments
    name: str = "lit"
    task_kind: str = one_of("text_to_sql", TASK_KINDS)  # the kind of task its rollout reads (checked: the data's)
    rollout_timeout_s: float = number(600.0, gt=0)  # one rollout's time limit; past it the rollout is excluded

    def __post_init__(self) -> None:
        try:
            load_class(self.cls)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"agent.cls={self.cls} cannot be loaded: {type(exc).__name__}: {exc}") from exc

    @cached_property
    def agent(self) -> Any:
        """The class's instance, built at the first rollout of this process."""
        return load_class(self.cls)(**self.init)

    def oracle(self, task: dict[str, Any], wrong: str | None = None) -> list[Reply]:
        """The replies of a model that knows the answer (the SFT warm start replays them to the class's rollout):
        the class's own `oracle` where it has one, else the Spider loop's: the gold SQL in a ```sql block and THE
        QUERY IS CORRECT; with `wrong`, first a wrong query and THE QUERY IS INCORRECT."""
        if hasattr(self.agent, "oracle"):
            return list(self.agent.oracle(task, wrong))
        gold = say(f"```sql\n{task['query']}\n```")
        if wrong is None:
            return [gold, say(CORRECT)]
        return [say(f"```sql\n{wrong}\n```"), say(INCORRECT), gold, say(CORRECT)]

    async def run(self, task: dict[str, Any], llm: ChatModel) -> Trajectory:
        """One rollout of the class: `main_llm` is this rollout's route (policy server or scripted chat, on the
        loopback port) or, for a real endpoint, its URL."""
        loop = asyncio.get_running_loop()
        if isinstance(llm, ReplayChat):  # the SFT warm start's scripted chat
            rollout_id, app, strip, mode = f"sft{next(_IDS)}", chat_app(llm.answer, llm.model), True, "train"
        elif isinstance(llm, OpenAIChat) and llm.app is not None:  # the policy server: the rollout's own route
            path = urlparse(str(llm.client.base_url)).path  # /rollouts/<id>/v1
            rollout_id = path.split("/")[2] if path.startswith("/rollouts/") else f"own{next(_IDS)}"
            app, strip, mode = llm.app, False, ("val" if rollout_id.startswith("val") else "train")
        elif isinstance(llm, OpenAIChat):  # a real endpoint (job=eval): relayed, so the calls are seen
            rollout_id, app, strip, mode = f"eval{next(_IDS)}", _relay(llm), True, "test"
        else:
            raise TypeError(f"agent=lit needs an OpenAI-compatible endpoint, not a {type(llm).__name__}")
        rollout = Rollout(rollout_id, task, mode, Attempt(rollout_id, f"{rollout_id}-a1"))
        main_llm = LLM(LOOPBACK.base_url(rollout_id), llm.model, dict(llm.sampling))
        emitted: list[float] = []
        calls: list[tuple[list[dict[str, Any]], str]] = []
        error = None
        reward = None
        try:
            with LOOPBACK.route(rollout_id, app, loop, strip=strip) as route:
                calls = route.calls
                returned = await self._rollout(task, main_llm, rollout, emitted)
            reward = reward_of(returned, emitted)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        replies = [reply for _, reply in calls]
        sqls = [sql for sql in map(extract_sql, replies) if sql is not None]
        last = [*calls[-1][0], {"role": "assistant", "content": calls[-1][1]}] if calls else []
        return Trajectory(
            messages=last, final_sql=sqls[-1] if sqls else None, turns=len(calls), error=error, agent_reward=reward
        )

    async def _rollout(self, task: dict[str, Any], llm: LLM, rollout: Rollout, emitted: list[float]) -> Any:
        """The class's rollout for the mode, awaited (async) or on a daemon thread (sync), at most
        `rollout_timeout_s`."""
        agent = self.agent
        kind = "training" if rollout.mode == "train" else "validation"
        is_async = agent.is_async() if hasattr(agent, "is_async") else False
        method = getattr(agent, f"{kind}_rollout_async" if is_async else f"{kind}_rollout", None)
        method = method or getattr(agent, "rollout_async" if is_async else "rollout")
        resources = {"main_llm": llm}
        if "rollout_id" in inspect.signature(method).parameters:  # agent-lightning 0.1's (task, rollout_id, resources)
            call = lambda: method(task, rollout_id=rollout.rollout_id, resources=resources)  # noqa: E731
        else:
            call = lambda: method(task, resources, rollout)  # noqa: E731
        token = _EMITTED.set(emitted)
        try:
            if is_async:
                return await asyncio.wait_for(call(), self.rollout_timeout_s)
            return await asyncio.wait_for(_on_thread(call), self.rollout_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the rollout ran past agent.rollout_timeout_s={self.rollout_timeout_s}") from None
        finally:
            _EMITTED.reset(token)


def _relay(llm: OpenAIChat) -> Any:
    """An ASGI app that answers a chat completion by sending it on to `llm`'s endpoint (and its error back)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        try:
            response = await llm.client.chat.completions.create(**json.loads(body))
            status, payload = 200, response.model_dump_json().encode()
        except openai.APIStatusError as exc:
            status, payload = exc.status_code, exc.response.content
        except Exception as exc:
            status, payload = 502, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    return app


def _on_thread(call: Callable[[], Any]) -> asyncio.Future[Any]:
    """`call()` on a daemon thread of its own (in this context: `emit_reward` finds its rollout), as a future: a
    rollout past its time limit keeps its thread, not the step."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def work() -> None:
        try:
            outcome = (True, context.run(call))
        except Exception as exc:
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=work, name="lit-rollout", daemon=True).start()
    return future

"""The medical question-answering agent (`agent=med_sql`), on the OpenAI Agents SDK.

One tool, `query_database_by_sql(sql)`, runs a read-only query on the task's medical database (tables `drugs_info`
and `disease`) through the shared SQL tool; the model may call it as often as its turn limit allows, then answers
in prose. Tool calls travel as OpenAI tool calls, so any endpoint that speaks them works: vLLM with a tool parser,
an OpenAI-style API, or this project's policy server.

The SDK's import name is `agents`, hence this project's `agent` package. Its tracing (which would export to
OpenAI) is off; a backend that traces (agent-lightning) instruments the OpenAI client underneath instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from agents import (
    Agent,
    AgentsException,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
)
from agents.models.chatcmpl_converter import Converter

from agent.llm import ChatModel, OpenAIChat
from agent.scripted import ReplayChat, Reply, call, say
from agent.sql_tool import run_query
from agent.trajectory import Trajectory
from foundation.schema import number

TOOL_NAME = "query_database_by_sql"
_SAMPLING_KEYS = ("temperature", "top_p", "max_tokens")


@dataclass
class MedSQLAgent:
    task_kind: ClassVar[str] = "med_qa"

    instructions: str  # the agent's system instructions (conf/agent/med_sql.yaml)
    tool_description: str  # what the model is told the SQL tool does
    name: str = "med_sql"
    max_turns: int = number(4, ge=1)  # model calls per rollout (the SDK's); the one turn limit every backend reads
    sql_timeout_s: float = number(2.0, gt=0)  # one query's time limit
    result_max_rows: int = number(20, gt=0)  # rows of a result the model is shown
    result_max_chars: int = number(1500, gt=0)  # characters of a result the model is shown

    def __post_init__(self) -> None:
        if not self.instructions or not self.tool_description:
            raise ValueError("agent.instructions and agent.tool_description must be set")

    def _tool(self, db_path: str, executions: list[bool]) -> Any:
        def query_database_by_sql(sql: str) -> str:
            result = run_query(db_path, sql, timeout_s=self.sql_timeout_s, max_rows=self.result_max_rows)
            executions.append(result.ok)
            return result.to_text(self.result_max_chars)

        return function_tool(query_database_by_sql, name_override=TOOL_NAME, description_override=self.tool_description)

    def oracle(self, task: dict[str, Any], wrong: str | None = None) -> list[Reply]:
        """The replies of a model that knows the answer (SFT demonstrations): query with the gold SQL, answer with
        what it returns; with `wrong` (and a turn to spare), a wrong query first."""
        replies = [call(TOOL_NAME, sql=task["query"]), say(task["answer"])]
        if wrong is not None and self.max_turns >= 3:
            replies.insert(0, call(TOOL_NAME, sql=wrong))
        return replies

    async def run(self, task: dict[str, Any], llm: ChatModel) -> Trajectory:
        if not isinstance(llm, OpenAIChat | ReplayChat):
            raise TypeError("agent=med_sql calls tools through an OpenAI-compatible endpoint; it needs an OpenAIChat")
        executions: list[bool] = []
        sampling = {k: v for k, v in llm.sampling.items() if k in _SAMPLING_KEYS}
        extra = {k: v for k, v in llm.sampling.items() if k not in _SAMPLING_KEYS}
        sdk_agent = Agent(
            name=self.name,
            instructions=self.instructions,
            tools=[self._tool(task["db_path"], executions)],
            model=OpenAIChatCompletionsModel(model=llm.model, openai_client=llm.client),
            model_settings=ModelSettings(**sampling, extra_args=extra or None),
        )
        error = None
        try:
            result = await Runner.run(
                sdk_agent, task["question"], max_turns=self.max_turns, run_config=RunConfig(tracing_disabled=True)
            )
            items, responses, answer = result.to_input_list(), result.raw_responses, str(result.final_output or "")
        except AgentsException as exc:  # turn limit reached, a call to an unknown tool, ...
            error = f"{type(exc).__name__}: {exc}"
            run_data = exc.run_data
            items = [task["question"]] if run_data is None else _input_list(run_data.input, run_data.new_items)
            responses, answer = ([] if run_data is None else run_data.raw_responses), None
        return Trajectory(
            messages=[{"role": "system", "content": self.instructions}, *Converter.items_to_messages(items)],
            final_sql=_last_sql(items),
            answer=answer,
            turns=len(responses),
            executions=len(executions),
            execution_errors=executions.count(False),
            last_execution_ok=bool(executions) and executions[-1],
            error=error,
        )


def _input_list(start: Any, new_items: list[Any]) -> list[Any]:
    first = [{"role": "user", "content": start}] if isinstance(start, str) else list(start)
    return first + [item.to_input_item() for item in new_items]


def _last_sql(items: list[Any]) -> str | None:
    """The `sql` argument of the last tool call, if it parses."""
    calls = [item for item in items if isinstance(item, dict) and item.get("type") == "function_call"]
    if not calls:
        return None
    try:
        return str(json.loads(calls[-1]["arguments"])["sql"])
    except (ValueError, KeyError, TypeError):
        return None

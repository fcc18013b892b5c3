"""The Spider-style SQL agent: write a query, execute it, check it, rewrite it (LangGraph).

    write_query -> execute_query -> check_query -> END
                        ^                |
                        +- rewrite_query <+  (while the check says INCORRECT and turns < max_turns)

With `check_step=False` the graph is write_query -> execute_query -> END (one turn, no check).

The agent keeps one growing conversation (system, question, SQL, result + check request, verdict, rewrite request,
SQL, ...). Every LLM call therefore extends the previous one, so a backend can train on the whole rollout as one
sequence with tool output masked. agent-lightning's Spider example instead builds a fresh prompt for each call;
its transition-level triplets do not need the conversation to grow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from agent.llm import ChatModel, Message
from agent.scripted import Reply, say
from agent.sql_tool import SCHEMA_STYLES, run_query, schema_text
from agent.trajectory import Trajectory
from foundation.schema import number, one_of

_FENCED_BLOCK = re.compile(r"```(?:[A-Za-z]*)?\s*\n?(.*?)```", re.DOTALL)
CORRECT, INCORRECT = "THE QUERY IS CORRECT", "THE QUERY IS INCORRECT"
_VERDICT = re.compile(r"THE QUERY IS (CORRECT|INCORRECT)")


def extract_sql(text: str) -> str | None:
    """The SQL in the last fenced code block of `text`, or None when there is none."""
    blocks = [b.strip() for b in _FENCED_BLOCK.findall(text)]
    blocks = [b for b in blocks if b]
    return blocks[-1] if blocks else None


def check_says_correct(text: str) -> bool:
    """True when the last verdict in `text` is THE QUERY IS CORRECT."""
    verdicts = _VERDICT.findall(text)
    return bool(verdicts) and verdicts[-1] == "CORRECT"


class _State(TypedDict):
    messages: list[Message]
    query: str | None
    result: str
    correct: bool
    verdicts: list[bool]
    turns: int
    executions: int
    execution_errors: int
    last_execution_ok: bool


@dataclass
class SpiderSQLAgent:
    """Answers a Spider task (`question`, `db_path`) with SQL. Configured by `conf/agent/spider_sql.yaml`."""

    task_kind: ClassVar[str] = "text_to_sql"

    max_turns: int = number(ge=1)  # SQL-writing turns (write + rewrites)
    check_step: bool
    system_prompt: str
    write_prompt: str
    check_prompt: str
    rewrite_prompt: str
    no_query_text: str
    schema_style: str = one_of("sql", SCHEMA_STYLES)
    schema_max_chars: int = number(2000, gt=0)  # characters of the schema in the first prompt
    result_max_chars: int = number(600, gt=0)  # characters of a result the model is shown
    result_max_rows: int = number(20, gt=0)  # rows of a result the model is shown
    sql_timeout_s: float = number(2.0, gt=0)  # one query's time limit
    dialect: str = "SQLite"  # only named in the prompts: queries run on SQLite
    name: str = "spider_sql"

    @cached_property
    def graph(self) -> Any:
        graph = StateGraph(_State)
        graph.add_node("write_query", self._write_query)
        graph.add_node("execute_query", self._execute_query)
        graph.add_node("check_query", self._check_query)
        graph.add_node("rewrite_query", self._rewrite_query)
        graph.add_edge(START, "write_query")
        graph.add_edge("write_query", "execute_query")
        graph.add_conditional_edges("execute_query", self._after_execute, ["check_query", END])
        graph.add_conditional_edges("check_query", self._after_check, ["rewrite_query", END])
        graph.add_edge("rewrite_query", "execute_query")
        return graph.compile()

    def oracle(self, task: dict[str, Any], wrong: str | None = None) -> list[Reply]:
        """The replies of a model that knows the answer (SFT demonstrations): the gold SQL and the right verdict;
        with `wrong` (and a check step and a turn to spare), first a wrong query, INCORRECT and a rewrite."""
        gold = say(f"```sql\n{task['query']}\n```")
        if not self.check_step:
            return [gold]
        if wrong is None or self.max_turns < 2:
            return [gold, say(CORRECT)]
        return [say(f"```sql\n{wrong}\n```"), say(INCORRECT), gold, say(CORRECT)]

    def first_messages(self, task: dict[str, Any]) -> list[Message]:
        """The conversation the agent opens with: system prompt and the question with the schema."""
        schema = schema_text(task["db_path"], self.schema_style)[: self.schema_max_chars]
        user = self.write_prompt.format(dialect=self.dialect, schema=schema, question=task["question"])
        system = self.system_prompt.format(dialect=self.dialect)
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    async def run(self, task: dict[str, Any], llm: ChatModel) -> Trajectory:
        """Run one rollout. Tool errors are shown to the model; an LLM or graph failure is kept in `error`."""
        state: _State = {
            "messages": self.first_messages(task),
            "query": None,
            "result": "",
            "correct": False,
            "verdicts": [],
            "turns": 0,
            "executions": 0,
            "execution_errors": 0,
            "last_execution_ok": False,
        }
        config = {"recursion_limit": 4 * self.max_turns + 4, "configurable": {"llm": llm, "db_path": task["db_path"]}}
        error = None
        try:
            state = await self.graph.ainvoke(state, config=config)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        return Trajectory(
            messages=state["messages"],
            final_sql=state["query"],
            turns=state["turns"],
            executions=state["executions"],
            execution_errors=state["execution_errors"],
            last_execution_ok=state["last_execution_ok"],
            verdicts=state["verdicts"],
            error=error,
        )

    # Nodes. LangGraph passes the run's config; the LLM and the database travel there, not in the state.
    async def _ask(self, state: _State, config: RunnableConfig, user: str | None) -> tuple[list[Message], str]:
        messages = list(state["messages"])
        if user is not None:
            messages.append({"role": "user", "content": user})
        reply = await config["configurable"]["llm"].chat(messages)
        messages.append({"role": "assistant", "content": reply})
        return messages, reply

    async def _write_query(self, state: _State, config: RunnableConfig) -> dict[str, Any]:
        messages, reply = await self._ask(state, config, None)
        return {"messages": messages, "query": extract_sql(reply), "turns": state["turns"] + 1}

    async def _execute_query(self, state: _State, config: RunnableConfig) -> dict[str, Any]:
        if state["query"] is None:
            return {"result": self.no_query_text, "last_execution_ok": False}
        result = run_query(
            Path(config["configurable"]["db_path"]),
            state["query"],
            timeout_s=self.sql_timeout_s,
            max_rows=self.result_max_rows,
        )
        return {
            "result": result.to_text(self.result_max_chars),
            "executions": state["executions"] + 1,
            "execution_errors": state["execution_errors"] + (not result.ok),
            "last_execution_ok": result.ok,
        }

    def _after_execute(self, state: _State) -> str:
        return "check_query" if self.check_step else END

    async def _check_query(self, state: _State, config: RunnableConfig) -> dict[str, Any]:
        user = self.check_prompt.format(query=state["query"] or "", result=state["result"])
        messages, reply = await self._ask(state, config, user)
        correct = check_says_correct(reply)
        return {"messages": messages, "correct": correct, "verdicts": [*state["verdicts"], correct]}

    def _after_check(self, state: _State) -> str:
        return END if state["correct"] or state["turns"] >= self.max_turns else "rewrite_query"

    async def _rewrite_query(self, state: _State, config: RunnableConfig) -> dict[str, Any]:
        messages, reply = await self._ask(state, config, self.rewrite_prompt)
        query = extract_sql(reply)
        return {"messages": messages, "query": query or state["query"], "turns": state["turns"] + 1}

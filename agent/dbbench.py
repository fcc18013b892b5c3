"""The DB-bench agent (`agent=dbbench`): LifelongAgentBench's single-table tasks, in its protocol, on SQLite or MySQL.

Each reply either runs SQL (`Action: Operation` and a ```sql block) or ends (`Action: Answer` and a line
`Final Answer: ...`). The agent may write: every rollout gets its own copy of the task's table, built from the
task's rows, so rollouts never see each other's writes. `engine` (data.engine) says where the copy lives: `sqlite`,
in memory (nothing touches the disk); `mysql`, in a database of the rollout's own on a MariaDB/MySQL server
(`agent.mysql_tool`, data.mysql), dropped when the rollout ends, also after a failure; its statements run in a
worker thread, so rollouts on one event loop wait on the server side by side. The table's rows when the rollout ends
go into the trajectory (`db_state`) for the reward. Where LifelongAgentBench ends a sample on a reply in neither
form, this agent answers with `invalid_action_text` and goes on, within `max_turns`.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from agent.llm import ChatModel, Message
from agent.mysql_tool import DIALECTS, ENGINES, MySQLScratch, MySQLServer, TableUnreadable, driver
from agent.scripted import Reply, say
from agent.sql_tool import ScratchDatabase
from agent.trajectory import Trajectory
from foundation.errors import ConfigError
from foundation.schema import number, one_of

_ACTION = re.compile(r"Action:\s*(Operation|Answer)")
_SQL = re.compile(r"```sql\s*\n?([\s\S]*?)\n?```")
_FINAL = re.compile(r"Final Answer:(.*)", re.DOTALL)


_T = TypeVar("_T")


def scratch_for(
    task: dict[str, Any], engine: str = "sqlite", server: MySQLServer | None = None
) -> ScratchDatabase | MySQLScratch:
    """The task's table (`table_info`: name, column_info_list, row_list) in a fresh database of its own: in memory
    (`sqlite`), or on `server` (`mysql`: the caller must `close` it, which drops it)."""
    info = task["table_info"]
    columns = [(c["name"], c["type"]) for c in info["column_info_list"]]
    if engine == "mysql":
        return MySQLScratch.from_table(server or MySQLServer(), info["name"], columns, info["row_list"])
    return ScratchDatabase.from_table(info["name"], columns, info["row_list"])


def engine_settings(engine: str, mysql: MySQLServer | dict[str, Any] | None, key: str) -> MySQLServer | None:
    """`mysql` as a MySQLServer (Hydra hands a mapping; None stays None); with engine `mysql`, the driver must
    be installed (a ConfigError naming the extra otherwise) and the server's settings given (`key` names them)."""
    if isinstance(mysql, dict):
        mysql = MySQLServer(**mysql)
    if engine != "mysql":
        return mysql
    driver()
    if mysql is None:
        raise ConfigError(f"{key}: data.engine=mysql needs the server's settings (data.mysql)")
    return mysql


def operation(sql: str) -> str:
    """A reply that runs `sql`, in the protocol's form."""
    return f"Action: Operation\n```sql\n{sql}\n```"


def parse_action(reply: str) -> tuple[str, str] | None:
    """("sql", statement) or ("answer", text); None when the reply is in neither form."""
    action = _ACTION.search(reply)
    if action is None:
        return None
    if action.group(1) == "Operation":
        sql = _SQL.search(reply, action.end())
        return ("sql", sql.group(1).strip()) if sql else None
    final = _FINAL.search(reply, action.end())
    return ("answer", final.group(1).strip()) if final else None


@dataclass
class DBBenchAgent:
    task_kind: ClassVar[str] = "dbbench"

    system_prompt: str
    task_prompt: str
    invalid_action_text: str
    mysql: MySQLServer | None  # the server for engine=mysql (data.mysql; data=dbbench writes it, so no default)
    name: str = "dbbench"
    max_turns: int = number(5, ge=1)  # model calls per rollout; the one turn limit every backend reads
    sql_timeout_s: float = number(2.0, gt=0)  # one statement's time limit
    result_max_rows: int = number(50, gt=0)  # rows of a result the model is shown
    result_max_chars: int = number(1500, gt=0)  # characters of a result the model is shown
    engine: str = one_of("sqlite", ENGINES)  # where each rollout's copy of the table lives (data.engine)

    def __post_init__(self) -> None:
        self.mysql = engine_settings(self.engine, self.mysql, "agent.mysql")

    def oracle(self, task: dict[str, Any], wrong: str | None = None) -> list[Reply]:
        """The replies of a model that knows the answer (SFT demonstrations): run the gold SQL, then answer; with a
        wrong SELECT (on a question, with a turn to spare), that one first."""
        direct = task["answer_info"]["direct"]
        final = repr([tuple(row) for row in direct]) if direct is not None else "done"
        replies = [say(operation(task["query"])), say(f"Action: Answer\nFinal Answer: {final}")]
        if wrong is not None and direct is not None and wrong.upper().startswith("SELECT") and self.max_turns >= 3:
            replies.insert(0, say(operation(wrong)))
        return replies

    def first_messages(self, task: dict[str, Any]) -> list[Message]:
        table = json.dumps(task["table_info"], ensure_ascii=False)
        return [
            {"role": "system", "content": self.system_prompt.replace("{dialect}", DIALECTS[self.engine])},
            {"role": "user", "content": self.task_prompt.format(instruction=task["question"], table_info=table)},
        ]

    @staticmethod
    def _state(db: ScratchDatabase | MySQLScratch, table: str) -> list[list[Any]] | None:
        """The table's rows; None when the agent dropped or renamed it (a write task then scores 0)."""
        try:
            return [list(row) for row in db.table_rows(table)]
        except (sqlite3.Error, TableUnreadable):
            return None

    async def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """`fn(*args, **kwargs)`: in a worker thread on a server (engine=mysql), here for the in-memory copy."""
        if self.engine == "mysql":
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    async def _open(self, task: dict[str, Any]) -> ScratchDatabase | MySQLScratch:
        """The rollout's copy of the task's table. On a server it is made in a worker thread; a rollout cancelled
        meanwhile drops it as soon as it exists (whichever of the two comes second does it)."""
        if self.engine != "mysql":
            return scratch_for(task)
        lock = threading.Lock()
        state: dict[str, Any] = {"abandoned": False, "made": None}

        def make() -> MySQLScratch | None:
            db = scratch_for(task, "mysql", self.mysql)
            with lock:
                if not state["abandoned"]:
                    state["made"] = db
                    return db
            db.close()
            return None

        try:
            db = await asyncio.to_thread(make)
        except asyncio.CancelledError:
            with lock:
                state["abandoned"], made = True, state["made"]
            if made is not None:
                await asyncio.shield(asyncio.to_thread(made.close))
            raise
        assert db is not None  # not abandoned: this coroutine is the one that got it
        return db

    async def run(self, task: dict[str, Any], llm: ChatModel) -> Trajectory:
        messages = self.first_messages(task)
        trajectory = Trajectory(messages=messages)
        db = await self._open(task)
        try:
            while trajectory.turns < self.max_turns:
                reply = await llm.chat(messages)
                trajectory.turns += 1
                messages.append({"role": "assistant", "content": reply})
                action = parse_action(reply)
                if action is None:
                    messages.append({"role": "user", "content": self.invalid_action_text})
                    continue
                kind, content = action
                if kind == "answer":
                    trajectory.answer = content
                    break
                result = await self._call(db.run, content, timeout_s=self.sql_timeout_s, max_rows=self.result_max_rows)
                trajectory.final_sql = content
                trajectory.executions += 1
                trajectory.execution_errors += not result.ok
                trajectory.last_execution_ok = result.ok
                messages.append({"role": "user", "content": result.to_text(self.result_max_chars)})
            trajectory.db_state = await self._call(self._state, db, task["table_info"]["name"])
        finally:
            if self.engine == "mysql":  # dropped even when this rollout is cancelled meanwhile
                await asyncio.shield(asyncio.to_thread(db.close))
            else:
                db.close()
        return trajectory

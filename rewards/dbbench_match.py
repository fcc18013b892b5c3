"""DB-bench's check (`data=dbbench`): the answer rows for a SELECT task, the table's contents for a write task.

A SELECT task is right when the final answer, read as rows (`[('Ann', 3), ...]`, a bare value, or comma-separated
values), equals the gold rows: numbers within 1e-6, strings exactly, in order only when the gold SQL has ORDER BY.
A write task (INSERT, UPDATE, DELETE) is right when the table the agent left equals the table the gold SQL makes
from the same start, replayed here on a fresh copy: in memory (`engine=sqlite`), or in a database of its own on the
MySQL server (`engine=mysql`, dropped after). On MySQL the file's `md5` answer is checked too, as LifelongAgentBench
computes it (`agent.mysql_tool.lab_md5_query`, on the server): the replayed table's md5 must be the file's, or the
reward raises naming the task (the server does not reproduce the benchmark's answer: the rollout's reward is then
missing, never a silent 0). The agent's table is compared with it row for row, values as read back (DECIMAL as
numbers, dates as text), so a table whose column types the agent changed but whose values it kept is not told apart.
"""

from __future__ import annotations

import ast
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from agent.dbbench import engine_settings, scratch_for
from agent.mysql_tool import ENGINES, MySQLScratch, MySQLServer
from agent.trajectory import Trajectory
from foundation.schema import one_of


def parse_rows(answer: str) -> list[tuple[Any, ...]]:
    """The rows a final answer states."""
    text = answer.strip()
    try:
        value = ast.literal_eval(text)
    except Exception:  # anything a model writes: SyntaxError, unhashable set members (TypeError), deep nesting, ...
        return [tuple(part.strip().strip("'\"") for part in text.split(","))] if text else []
    if isinstance(value, list | tuple) and value and all(isinstance(v, list | tuple) for v in value):
        return [tuple(v) for v in value]
    if isinstance(value, list):
        return [(v,) for v in value]
    return [tuple(value)] if isinstance(value, tuple) else [(value,)]


def _same_value(agent: Any, gold: Any) -> bool:
    if isinstance(gold, int | float) and not isinstance(gold, bool):
        try:
            return math.isclose(float(agent), float(gold), rel_tol=1e-6, abs_tol=1e-6)
        except (TypeError, ValueError, OverflowError):
            return False
    return str(agent) == str(gold)


def _same_row(agent: tuple[Any, ...], gold: tuple[Any, ...]) -> bool:
    return len(agent) == len(gold) and all(_same_value(a, g) for a, g in zip(agent, gold, strict=True))


def _canonical_value(value: Any) -> str:
    try:
        return f"{float(value):.6g}"
    except (TypeError, ValueError, OverflowError):
        return str(value)


def _canonical(row: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(map(_canonical_value, row))


@dataclass
class DBBenchMatch:
    name: str = "dbbench_match"
    engine: str = one_of("sqlite", ENGINES)  # where the gold SQL is replayed (data.engine)
    mysql: MySQLServer | None = None  # the server for engine=mysql (data.mysql)

    def __post_init__(self) -> None:
        self.mysql = engine_settings(self.engine, self.mysql, "reward.mysql")

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float:
        info = task["answer_info"]
        if info.get("direct") is not None:
            if trajectory.answer is None:
                return 0.0
            agent_rows, gold_rows = parse_rows(trajectory.answer), [tuple(r) for r in info["direct"]]
            if re.search(r"\border\s+by\b", info["sql"], re.IGNORECASE):
                same = len(agent_rows) == len(gold_rows) and all(map(_same_row, agent_rows, gold_rows))
            else:
                same = Counter(map(_canonical, agent_rows)) == Counter(map(_canonical, gold_rows))
            return float(same)
        if trajectory.db_state is None:
            return 0.0
        table = task["table_info"]["name"]
        expected = scratch_for(task, self.engine, self.mysql)
        try:
            result = expected.run(info["sql"])
            if not result.ok:
                raise ValueError(f"task {task.get('id')}: the gold SQL fails: {result.error}")
            gold_state = expected.table_rows(table)
            if isinstance(expected, MySQLScratch) and info.get("md5"):
                columns = [c["name"] for c in task["table_info"]["column_info_list"]]
                md5 = expected.table_md5(table, columns)
                if md5 != info["md5"]:
                    raise ValueError(
                        f"task {task.get('id')}: the gold SQL replayed on {expected.server.where()} leaves a table "
                        f"whose md5 (LifelongAgentBench's) is {md5}, the file's answer is {info['md5']}: this server "
                        f"does not reproduce the benchmark's answer"
                    )
        finally:
            expected.close()
        return float([list(r) for r in gold_state] == [list(r) for r in trajectory.db_state])

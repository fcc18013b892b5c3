"""DB-bench's check (`data=dbbench`): the answer rows for a SELECT task, the table's contents for a write task.

A SELECT task is right when the final answer, read as rows (`[('Ann', 3), ...]`, a bare value, or comma-separated
values), equals the gold rows: numbers within 1e-6, strings exactly, in order only when the gold SQL has ORDER BY.
A write task (INSERT, UPDATE, DELETE) is right when the table the agent left equals the table the gold SQL makes
from the same start, replayed here on a fresh in-memory copy.
"""

from __future__ import annotations

import ast
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from agent.dbbench import scratch_for
from agent.trajectory import Trajectory


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
        expected = scratch_for(task)
        try:
            result = expected.run(info["sql"])
            if not result.ok:
                raise ValueError(f"task {task.get('id')}: the gold SQL fails: {result.error}")
            gold_state = expected.table_rows(task["table_info"]["name"])
        finally:
            expected.close()
        return float([list(r) for r in gold_state] == [list(r) for r in trajectory.db_state])

"""Execution match: 1.0 when the predicted SQL returns the same result as the gold SQL on the task's database.

Results are compared as multisets of rows, in order only when the gold query has ORDER BY (Spider's `exec_eval`
convention). Both queries run through the read-only, time-limited SQL tool.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.sql_tool import run_query
from agents.trajectory import Trajectory

_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)


def execution_match(predicted_sql: str, gold_sql: str, db_path: str | Path, *, timeout_s: float = 2.0) -> float:
    """1.0 if both queries run and return the same rows (ordered only when gold has ORDER BY), else 0.0."""
    if not predicted_sql or not predicted_sql.strip():
        return 0.0
    gold = run_query(db_path, gold_sql, timeout_s=timeout_s, max_rows=100_000)
    if not gold.ok:
        raise ValueError(f"gold SQL fails on {db_path}: {gold.error}\n{gold_sql}")
    pred = run_query(db_path, predicted_sql, timeout_s=timeout_s, max_rows=100_000)
    if not pred.ok or pred.truncated or gold.truncated:
        return 0.0
    if _ORDER_BY.search(gold_sql):
        return float(pred.rows == gold.rows)
    return float(Counter(pred.rows) == Counter(gold.rows))


@dataclass
class ExecMatch:
    """Reward: execution match of the trajectory's final SQL against the task's gold `query`."""

    name: str = "exec_match"
    timeout_s: float = 2.0

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float:
        if trajectory.final_sql is None:
            return 0.0
        return execution_match(trajectory.final_sql, task["query"], task["db_path"], timeout_s=self.timeout_s)

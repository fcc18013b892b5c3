"""Execution match with the semantics of Spider's official evaluator (taoyds/test-suite-sql-eval, `exec_eval`).

As there, with its defaults (`keep_distinct=False`, `plug_value=False`): `> =`-style spacing is repaired, DISTINCT
is removed from both queries, results are compared as bags of rows, in order only when the gold query has ORDER BY,
and columns match up to a permutation. Unlike there, both queries run through the read-only SQL tool, so a query is
stopped inside SQLite at its limits and can never change the database; a predicted query that cannot be parsed,
normalised or compared within bounds (longer than the tool's SQL limit, past sqlparse's token or depth limits, more
column permutations than `MAX_PERMUTATION_WORK` allows) scores 0 instead of raising; and the gold result is cached
per (database, gold query), since GRPO scores a whole group of rollouts against the same gold.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlparse
from sqlparse.exceptions import SQLParseError

from agent.sql_tool import MAX_SQL_CHARS, SQLResult, run_query
from agent.trajectory import Trajectory
from foundation.schema import number

_MAX_ROWS = 100_000
MAX_PERMUTATION_WORK = 2_000_000  # search steps + rows compared over the column permutations tried; past it: no match


def normalize(sql: str) -> str:
    """The official post-processing: `> =` -> `>=` (and `<`, `!`), then DISTINCT removed (sqlparse tokens)."""
    sql = sql.replace("> =", ">=").replace("< =", "<=").replace("! =", "!=")
    tokens = [t.value for t in sqlparse.parse(sql)[0].flatten()] if sql.strip() else []
    return "".join(t for t in tokens if t.lower() != "distinct")


def _unorder_row(row: tuple) -> tuple:
    return tuple(sorted(row, key=lambda x: str(x) + str(type(x))))


def _column_permutations(result1: list[tuple], result2: list[tuple], budget: list[int]) -> Iterator[tuple[int, ...]]:
    """Candidate orders of result2's columns; above 3 columns, pruned by values seen in sampled rows (as upstream).

    Upstream walks `product(*allowed)` and skips the tuples that repeat a column. This yields the same permutations
    (identity first) by extending only with allowed, unused columns, and stops when `budget[0]` (decremented per
    step taken, shared with the caller) runs out."""
    num_cols = len(result2[0])
    allowed = [set(range(num_cols)) for _ in range(num_cols)]
    if num_cols > 3:
        column_values = [{row[i] for row in result1} for i in range(num_cols)]
        for _ in range(20):
            row = random.choice(result2)
            for col in range(num_cols):
                allowed[col] = {c for c in allowed[col] if row[c] in column_values[col]}
    order = [sorted(a) for a in allowed]
    prefix: list[int] = []

    def extend(i: int) -> Iterator[tuple[int, ...]]:
        if i == num_cols:
            yield tuple(prefix)
            return
        for c in order[i]:
            budget[0] -= 1
            if budget[0] < 0:
                return
            if c not in prefix:
                prefix.append(c)
                yield from extend(i + 1)
                prefix.pop()

    return extend(0)


def results_match(result1: list[tuple], result2: list[tuple], order_matters: bool) -> bool:
    """Whether two results denote the same table: same rows (as a bag, or a list) up to a column permutation."""
    if not result1 and not result2:
        return True
    if len(result1) != len(result2) or len(result1[0]) != len(result2[0]):
        return False
    unordered1 = [_unorder_row(r) for r in result1]
    unordered2 = [_unorder_row(r) for r in result2]
    if order_matters and unordered1 != unordered2:
        return False
    if not order_matters and set(unordered1) != set(unordered2):
        return False
    budget = [MAX_PERMUTATION_WORK]  # spent by the search and by every comparison; exhausted: no match
    for perm in _column_permutations(result1, result2, budget):
        budget[0] -= len(result2)
        if budget[0] < 0:
            return False
        permuted = result2 if len(perm) == 1 else [tuple(row[i] for i in perm) for row in result2]
        if order_matters:
            if result1 == permuted:
                return True
        elif Counter(result1) == Counter(permuted):
            return True
    return False


_GOLD_CACHE_SIZE = 4096
_gold_cache: dict[tuple[str, str, int, float], SQLResult] = {}
_gold_lock = threading.Lock()  # rewards are scored in threads, concurrently


def clear_gold_cache() -> None:
    with _gold_lock:
        _gold_cache.clear()


def _gold_result(db_path: str, gold_sql: str, mtime_ns: int, timeout_s: float) -> SQLResult:
    """The gold query's result, cached per (database, its mtime, query, time limit) only when it ran: a timeout or
    error (a loaded machine, a locked file) is tried again next time rather than zeroing the task for the run."""
    key = (db_path, gold_sql, mtime_ns, timeout_s)
    with _gold_lock:
        cached = _gold_cache.get(key)
    if cached is not None:
        return cached
    result = run_query(db_path, gold_sql, timeout_s=timeout_s, max_rows=_MAX_ROWS)
    if result.ok:
        with _gold_lock:
            if len(_gold_cache) >= _GOLD_CACHE_SIZE:
                _gold_cache.pop(next(iter(_gold_cache)))  # the oldest entry
            _gold_cache[key] = result
    return result


def execution_match(predicted_sql: str, gold_sql: str, db_path: str | Path, *, timeout_s: float = 2.0) -> float:
    """1.0 if the predicted query denotes the gold query's result on `db_path`, else 0.0.

    Raises ValueError when the gold query itself fails (the official evaluator asserts).
    """
    if not predicted_sql or not predicted_sql.strip() or len(predicted_sql) > MAX_SQL_CHARS:
        return 0.0
    gold_sql = normalize(gold_sql)
    try:
        predicted_sql = normalize(predicted_sql)
    except (SQLParseError, RecursionError):  # past sqlparse's token or grouping-depth limits: not a query it scores
        return 0.0
    path = Path(db_path)
    mtime = path.stat().st_mtime_ns if path.is_file() else 0
    gold = _gold_result(str(path), gold_sql, mtime, timeout_s)
    if not gold.ok:
        raise ValueError(f"gold SQL fails on {db_path}: {gold.error}\n{gold_sql}")
    pred = run_query(path, predicted_sql, timeout_s=timeout_s, max_rows=_MAX_ROWS)
    if not pred.ok or pred.truncated or gold.truncated:
        return 0.0
    return float(results_match(gold.rows, pred.rows, order_matters="order by" in gold_sql.lower()))


@dataclass
class ExecMatch:
    """Reward: execution match of the trajectory's final SQL against the task's gold `query`."""

    name: str = "exec_match"
    timeout_s: float = number(2.0, gt=0)  # each query's time limit (the gold's and the agent's)

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float:
        if trajectory.final_sql is None:
            return 0.0
        return execution_match(trajectory.final_sql, task["query"], task["db_path"], timeout_s=self.timeout_s)

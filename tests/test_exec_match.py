"""Execution match gives the official Spider evaluator's verdicts (bench/exec_match_suite.py lists them; the
benchmark re-derives each one with the official code)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.trajectory import Trajectory
from bench.exec_match_suite import CASES, build_database
from rewards.exec_match import ExecMatch, execution_match, normalize, results_match


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_database(tmp_path_factory.mktemp("db"))


@pytest.mark.parametrize(("predicted", "gold", "verdict"), CASES)
def test_official_verdicts(db: Path, predicted: str, gold: str, verdict: int) -> None:
    assert execution_match(predicted, gold, db) == float(verdict)


def test_normalize_repairs_spacing_and_drops_distinct() -> None:
    assert normalize("SELECT DISTINCT a FROM t WHERE b > = 1") == "SELECT  a FROM t WHERE b >= 1"


def test_results_match_permutes_columns_but_keeps_bags() -> None:
    assert results_match([(1, "a"), (2, "b")], [("b", 2), ("a", 1)], order_matters=False)
    assert not results_match([(1, "a"), (2, "b")], [("b", 2), ("a", 1)], order_matters=True)
    assert not results_match([(1,), (1,)], [(1,)], order_matters=False)


def test_a_writing_prediction_scores_zero_and_changes_nothing(db: Path) -> None:
    before = db.read_bytes()
    assert execution_match("DELETE FROM products", "SELECT name FROM products", db) == 0.0
    assert db.read_bytes() == before


def test_a_runaway_prediction_is_stopped(db: Path) -> None:
    slow = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    assert execution_match(slow, "SELECT 1", db, timeout_s=0.3) == 0.0


def test_reward_scores_the_final_sql(db: Path) -> None:
    reward = ExecMatch()
    task = {"query": "SELECT name FROM products WHERE category = 'office'", "db_path": str(db)}
    assert reward(task, Trajectory(final_sql="SELECT name FROM products WHERE price < 3")) == 1.0
    assert reward(task, Trajectory(final_sql=None)) == 0.0


def test_failing_gold_is_an_error_not_a_zero(db: Path) -> None:
    with pytest.raises(ValueError, match="gold SQL fails"):
        execution_match("SELECT 1", "SELECT nope FROM products", db)

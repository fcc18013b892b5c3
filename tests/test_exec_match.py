"""Execution match on known pairs."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from agents.trajectory import Trajectory
from rewards.exec_match import ExecMatch, execution_match


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("db") / "shop.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL);"
        "INSERT INTO products (name, category, price) VALUES"
        " ('pen', 'office', 2.5), ('desk', 'furniture', 120.0), ('lamp', 'furniture', 35.0), ('ink', 'office', 2.5);"
    )
    conn.commit()
    conn.close()
    return path


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        ("SELECT name FROM products", "SELECT name FROM products", 1.0),
        ("select NAME from PRODUCTS", "SELECT name FROM products", 1.0),
        ("SELECT name FROM products ORDER BY price", "SELECT name FROM products", 1.0),  # order ignored
        ("SELECT name FROM products ORDER BY price DESC", "SELECT name FROM products ORDER BY price", 0.0),
        (
            "SELECT count(*) FROM products WHERE category = 'office'",
            "SELECT count(*) FROM products WHERE price < 3",
            1.0,
        ),
        ("SELECT DISTINCT price FROM products WHERE price < 3", "SELECT price FROM products WHERE price < 3", 0.0),
        ("SELECT max(price) FROM products", "SELECT price FROM products ORDER BY price DESC LIMIT 1", 1.0),
        ("SELECT name FROM products WHERE price > 100", "SELECT name FROM products WHERE price > 30", 0.0),
        ("SELEC name FROM products", "SELECT name FROM products", 0.0),
        ("SELECT name FROM nowhere", "SELECT name FROM products", 0.0),
        ("", "SELECT name FROM products", 0.0),
        ("DELETE FROM products", "SELECT name FROM products", 0.0),
    ],
)
def test_execution_match(db: Path, predicted: str, gold: str, expected: float) -> None:
    assert execution_match(predicted, gold, db) == expected


def test_reward_scores_the_final_sql(db: Path) -> None:
    reward = ExecMatch()
    task = {"query": "SELECT name FROM products WHERE category = 'office'", "db_path": str(db)}
    assert reward(task, Trajectory(final_sql="SELECT name FROM products WHERE price < 3")) == 1.0
    assert reward(task, Trajectory(final_sql=None)) == 0.0


def test_failing_gold_is_an_error_not_a_zero(db: Path) -> None:
    with pytest.raises(ValueError, match="gold SQL fails"):
        execution_match("SELECT 1", "SELECT nope FROM products", db)

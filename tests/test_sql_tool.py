"""The SQL tool: read-only, one statement, time-limited; errors come back as text."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from agent.sql_tool import ScratchDatabase, run_query, schema_text


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "t.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE people (id INTEGER PRIMARY KEY, name TEXT, age INTEGER);"
        "INSERT INTO people (name, age) VALUES ('Ann', 31), ('Bob', 45), ('Cid', 27);"
        'CREATE TABLE "学生" ("名字" TEXT, "年龄" INTEGER);'
        "INSERT INTO \"学生\" VALUES ('李雷', 20), ('韩梅梅', 19);"
    )
    conn.commit()
    conn.close()
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_select_returns_rows(db: Path) -> None:
    result = run_query(db, "SELECT name FROM people WHERE age > 30 ORDER BY name")
    assert result.ok and result.rows == [("Ann",), ("Bob",)] and result.columns == ["name"]


@pytest.mark.parametrize(
    "sql",
    [
        "DROP TABLE people",
        "DELETE FROM people",
        "UPDATE people SET age = 0",
        "INSERT INTO people (name, age) VALUES ('Eve', 1)",
        "ATTACH DATABASE ':memory:' AS other",
        "PRAGMA writable_schema = ON",
        "SELECT 1; DROP TABLE people",
        "SELEC name FROM people",
        "SELECT load_extension('/tmp/evil.so')",
        'DROP TABLE "学生"',
        "VACUUM",
    ],
)
def test_bad_statements_are_errors_and_change_nothing(db: Path, sql: str) -> None:
    before = digest(db)
    result = run_query(db, sql)
    assert not result.ok and result.to_text().startswith("Error: ")
    assert digest(db) == before


def test_runaway_query_is_stopped_within_its_limit(db: Path) -> None:
    sql = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    result = run_query(db, sql, timeout_s=0.5)  # never ends by itself: only the limit can return it
    assert not result.ok and "time limit" in (result.error or "")


def test_a_huge_cross_join_is_stopped_within_its_limit(db: Path) -> None:
    sql = "SELECT count(*) FROM people a, people b, people c, people d, people e, people f, people g, people h, "
    sql += "people i, people j, people k, people l, people m, people n, people o, people p, people q, people r"
    result = run_query(db, sql, timeout_s=0.5)  # 3^18 rows: only the limit can return it in a test's lifetime
    assert not result.ok and "time limit" in (result.error or "")


def test_unicode_identifiers(db: Path) -> None:
    result = run_query(db, 'SELECT "名字" FROM "学生" WHERE "年龄" > 19')
    assert result.ok and result.rows == [("李雷",)] and result.columns == ["名字"]


def test_rows_and_characters_are_capped(db: Path) -> None:
    result = run_query(db, "SELECT * FROM people, people AS b, people AS c", max_rows=5)
    assert len(result.rows) == 5 and result.truncated
    assert len(result.to_text(max_chars=40)) < 80


def test_missing_database_is_an_error(tmp_path: Path) -> None:
    assert not run_query(tmp_path / "nope.sqlite", "SELECT 1").ok


def test_schema_text_lists_create_statements(db: Path) -> None:
    assert schema_text(db).startswith("CREATE TABLE people")


# ---- the writable copy in memory (DB-bench) ---------------------------------------------------------------------
def test_writes_go_to_the_copy_in_memory_only(db: Path) -> None:
    before = digest(db)
    scratch = ScratchDatabase.from_file(db)
    assert scratch.run("DELETE FROM people WHERE age > 30").ok
    assert scratch.run('DROP TABLE "学生"').ok
    assert scratch.table_rows("people") == [(3, "Cid", 27)]
    other = ScratchDatabase.from_file(db)  # another rollout's copy starts from the file again
    assert len(other.table_rows("people")) == 3
    scratch.close()
    other.close()
    assert digest(db) == before


@pytest.mark.parametrize(
    "sql",
    [
        "ATTACH DATABASE '/tmp/elsewhere.sqlite' AS other",
        "PRAGMA writable_schema = ON",
        "SELECT load_extension('/tmp/evil.so')",
        "DELETE FROM people; DROP TABLE people",
    ],
)
def test_the_copy_refuses_what_could_reach_outside(db: Path, sql: str) -> None:
    scratch = ScratchDatabase.from_file(db)
    result = scratch.run(sql)
    assert not result.ok and result.to_text().startswith("Error: ")
    assert len(scratch.table_rows("people")) == 3
    assert not Path("/tmp/elsewhere.sqlite").exists()


def test_the_copy_stops_a_runaway_query(db: Path) -> None:
    scratch = ScratchDatabase.from_file(db)
    sql = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) INSERT INTO people (age) SELECT x FROM c"
    result = scratch.run(sql, timeout_s=0.5)  # never ends by itself
    assert not result.ok and "time limit" in (result.error or "")
    assert len(scratch.table_rows("people")) == 3  # the statement was rolled back whole

"""Hostile SQL through the three paths agents and rewards use: the read-only tool (`run_query`), the exec-match reward
and DB-bench's scratch copy. Every input comes back (as tool text, or a reward of 0 or 1) within its limits: no
exception escapes, the process does not crash, the database file is unchanged and nothing is written beside it."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.sql_tool import MAX_SQL_CHARS, ScratchDatabase, SQLResult, run_query, schema_text
from agent.trajectory import Trajectory
from rewards.exec_match import ExecMatch, clear_gold_cache, results_match

TIMEOUT_S = 0.5  # the tools' time limit in these tests
HANG_GUARD_S = 120.0  # only turns a hang into a failure; every input below returns long before it


def _deep(n: int) -> str:
    return "SELECT " + "(" * n + "1" + ")" * n


def _doubling(steps: int) -> str:
    return (
        f"WITH RECURSIVE d(s, n) AS (SELECT 'x', 0 UNION ALL SELECT s || s, n + 1 FROM d WHERE n < {steps}) "
        "SELECT length(s) FROM d ORDER BY n DESC LIMIT 1"
    )


# (id, SQL, refused): `refused` inputs must come back as an error (reward 0); the others must only come back bounded.
HOSTILE: list[tuple[str, str, bool]] = [
    # work inside one function call
    ("printf_1e9", "SELECT length(printf('%.*c', 1e9, 'x'))", False),
    ("string_doubling", _doubling(40), True),
    ("randomblob_1e9", "SELECT length(randomblob(1e9))", True),
    ("zeroblob_1e9", "SELECT length(zeroblob(1e9))", True),
    ("hex_of_big_blob", "SELECT length(hex(zeroblob(9e6)))", True),
    ("replace_blowup", "SELECT length(replace(hex(zeroblob(4e6)), '0', 'xxxxxxxx'))", True),
    ("group_concat_blowup", "SELECT length(group_concat(hex(zeroblob(1e5)))) FROM people a, people b, people c", False),
    ("like_backtracking", "SELECT printf('%.*c', 100000, 'a') LIKE '%a%a%a%a%a%a%a%a%a%a%a%a%b'", False),
    ("like_long_pattern", "SELECT 'a' LIKE '" + "%a" * 5000 + "'", True),
    # reaching outside the database
    ("fts3_tokenizer_1arg", "SELECT fts3_tokenizer('simple')", True),
    ("fts3_tokenizer_2arg", "SELECT fts3_tokenizer('simple', X'4141414141414141')", True),
    ("load_extension", "SELECT load_extension('/tmp/evil.so')", True),
    ("attach", "ATTACH DATABASE '/tmp/elsewhere.sqlite' AS other", True),
    ("pragma_writable_schema", "PRAGMA writable_schema = ON", True),
    ("pragma_journal_mode", "PRAGMA journal_mode = DELETE", True),
    ("pragma_heap_limit", "PRAGMA hard_heap_limit = 0", True),
    ("virtual_table", "CREATE VIRTUAL TABLE v USING fts4(a)", True),
    ("readfile", "SELECT readfile('/etc/passwd')", True),
    ("writefile", "SELECT writefile('/tmp/x', 'y')", True),
    ("dbpage", "SELECT * FROM sqlite_dbpage", True),
    # time
    ("runaway_cte", "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c", True),
    ("cross_join", "SELECT count(*) FROM " + ", ".join(f"people p{i}" for i in range(18)), True),
    ("sort_of_cross_join", "SELECT a.name FROM people a, people b, people c, people d ORDER BY random()", False),
    (
        "distinct_blob_queue",
        "WITH RECURSIVE c(x, n) AS (SELECT zeroblob(5e6), 0 UNION SELECT zeroblob(5e6), n + 1 FROM c) "
        "SELECT count(*) FROM c",
        True,
    ),
    # size of the query
    ("sql_12mb", "SELECT '" + "x" * 12_000_000 + "'", True),
    ("sql_over_limit", "SELECT " + "+".join(["1"] * (MAX_SQL_CHARS // 2 + 10)), True),
    ("deep_parens", _deep(5000), True),
    ("deep_subqueries", "SELECT " + "(SELECT " * 300 + "1" + ")" * 300, True),
    ("many_unions", " UNION ".join(f"SELECT {i}" for i in range(1000)), True),
    ("many_args", "SELECT coalesce(" + ", ".join(["1"] * 500) + ")", True),
    ("many_columns", "SELECT " + ", ".join(["1"] * 5000), True),
    ("long_in_list", "SELECT 1 WHERE 1 IN (" + ", ".join(map(str, range(20000))) + ")", True),
    # size of the result
    ("wide_result", "SELECT zeroblob(9e6) FROM people a, people b, people c", True),
    ("many_rows", "SELECT * FROM people a, people b, people c, people d, people e, people f", False),
    # writes and statements a read-only tool refuses
    ("drop", "DROP TABLE people", True),
    ("delete", "DELETE FROM people", True),
    ("update", "UPDATE people SET age = 0", True),
    ("insert_returning", "INSERT INTO people (name, age) VALUES ('Eve', 1) RETURNING id", True),
    ("create_temp", "CREATE TEMP TABLE t AS SELECT 1", True),
    ("create_trigger", "CREATE TRIGGER t AFTER INSERT ON people BEGIN DELETE FROM people; END", True),
    ("alter", "ALTER TABLE people RENAME TO folks", True),
    ("vacuum", "VACUUM", True),
    ("vacuum_into", "VACUUM INTO '/tmp/copy.sqlite'", True),
    ("reindex", "REINDEX", False),  # no index to rebuild: nothing written (the digest shows)
    ("two_statements", "SELECT 1; DROP TABLE people", True),
    # malformed text
    ("nul_char", "SELECT 'a\x00b'", True),
    ("lone_surrogate", "SELECT '\ud800'", True),
    ("unbound_parameter", "SELECT name FROM people WHERE id = ?", True),
    ("empty", "", True),
    ("comment_only", "-- nothing", False),  # no statement: "(no rows)"
    ("typo", "SELEC name FROM people", True),
    ("integer_overflow", "SELECT abs(-9223372036854775808)", True),
    ("invalid_utf8_value", "SELECT CAST(X'80FF' AS TEXT)", False),
]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A small WAL-mode database, closed: the mode in which a careless read-only open leaves -wal/-shm files."""
    path = tmp_path / "t.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.executescript(
        "CREATE TABLE people (id INTEGER PRIMARY KEY, name TEXT, age INTEGER);"
        "INSERT INTO people (name, age) VALUES ('Ann', 31), ('Bob', 45), ('Cid', 27);"
    )
    conn.commit()
    conn.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.sqlite"]
    return path


def bounded(call: Callable[[], Any], what: str) -> Any:
    """`call()` in a thread; its value, or its exception raised here; fails if it has not returned by the guard."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # reported to the test below, whatever it is
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    if thread.is_alive():
        pytest.fail(f"{what} had not returned after {HANG_GUARD_S:g} s (hang guard)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _through_tool(db: Path, sql: str) -> bool:
    result = run_query(db, sql, timeout_s=TIMEOUT_S)
    assert isinstance(result, SQLResult)
    assert result.ok or result.to_text().startswith("Error: ")
    return result.ok


def _through_exec_match(db: Path, sql: str) -> bool:
    reward = ExecMatch(timeout_s=TIMEOUT_S)
    score = reward({"query": "SELECT name FROM people", "db_path": str(db)}, Trajectory(final_sql=sql))
    assert score in (0.0, 1.0)
    return score == 1.0


def _through_scratch(db: Path, sql: str) -> bool:
    scratch = ScratchDatabase.from_file(db)
    try:
        result = scratch.run(sql, timeout_s=TIMEOUT_S)
        assert isinstance(result, SQLResult)
        return result.ok
    finally:
        scratch.close()


PATHS = {"tool": _through_tool, "exec_match": _through_exec_match, "scratch": _through_scratch}
# Statements that a scratch copy exists to allow: writes to the agent's own copy in memory.
SCRATCH_MAY_RUN = {"drop", "delete", "update", "insert_returning", "create_temp", "create_trigger", "alter"}
SCRATCH_MAY_RUN |= {"vacuum", "reindex"}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize(("kind", "sql", "refused"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_is_refused_or_bounded(db: Path, path: str, kind: str, sql: str, refused: bool) -> None:
    clear_gold_cache()
    before = _digest(db)
    ran = bounded(lambda: PATHS[path](db, sql), f"{kind} through {path}")
    if refused and not (path == "scratch" and kind in SCRATCH_MAY_RUN):
        assert not ran, f"{kind} through {path} was not refused"
    assert _digest(db) == before
    assert sorted(p.name for p in db.parent.iterdir()) == ["t.sqlite"], "files were written beside the database"


def test_a_hijacked_fts3_tokenizer_cannot_be_installed_or_used(db: Path) -> None:
    """The two-argument `fts3_tokenizer` stores a C pointer; a table using it then calls through that pointer (on an
    unprotected connection, this sequence ends the process with SIGSEGV)."""
    scratch = ScratchDatabase.from_file(db)
    try:
        assert not scratch.run("SELECT fts3_tokenizer('simple', X'4141414141414141')").ok
        assert not scratch.run("CREATE VIRTUAL TABLE v USING fts3(a, tokenize=simple)").ok
        assert not scratch.run("INSERT INTO v VALUES ('boom')").ok
        assert scratch.run("SELECT count(*) FROM people").rows == [(3,)]
    finally:
        scratch.close()


def test_the_tools_still_answer_ordinary_queries_on_a_wal_database(db: Path) -> None:
    assert run_query(db, "SELECT name FROM people WHERE age > 30 ORDER BY name").rows == [("Ann",), ("Bob",)]
    assert schema_text(db).startswith("CREATE TABLE people")
    assert _through_exec_match(db, "SELECT name FROM people ORDER BY age")
    assert sorted(p.name for p in db.parent.iterdir()) == ["t.sqlite"]


def test_a_live_wal_log_is_read(tmp_path: Path) -> None:
    """With a -wal file present (a writer is open), the tool reads the committed rows in it, not a stale file."""
    path = tmp_path / "live.sqlite"
    writer = sqlite3.connect(path)
    writer.execute("PRAGMA journal_mode = WAL")
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    writer.execute("CREATE TABLE t (x)")
    writer.execute("INSERT INTO t VALUES (1)")
    writer.commit()
    try:
        assert path.with_name("live.sqlite-wal").exists()
        assert run_query(path, "SELECT x FROM t").rows == [(1,)]
    finally:
        writer.close()


def test_column_permutation_bomb_is_a_bounded_non_match() -> None:
    """Twelve columns of equal values: every one of the 12! column orders is a candidate. The identity is tried first
    (a match is found at once); a near miss exhausts the search budget and scores as no match."""
    same = [tuple([1] * 12)] * 50
    assert bounded(lambda: results_match(same, list(same), order_matters=False), "an identical 12-column result")
    near = [tuple([1] * 11 + [2])] * 50
    other = [tuple([2] + [1] * 11)] * 49 + [tuple([1] * 12)]
    assert not bounded(lambda: results_match(near, other, order_matters=False), "a 12-column near miss")


def test_column_order_still_matches_up_to_permutation() -> None:
    gold = [(1, "a", 2.0, None), (3, "b", 4.0, None)]
    pred = [(None, 2.0, "a", 1), (None, 4.0, "b", 3)]
    assert results_match(gold, pred, order_matters=True)
    assert not results_match(gold, [(None, 2.0, "a", 1), (None, 4.0, "c", 3)], order_matters=True)

"""The SQL tool every agent and reward uses: read-only, one statement, bounded in time, rows and characters.

A bad query never raises and never changes the database: it comes back as a `SQLResult` with `error` set, which the
agent sees as tool text. Agents that must write (DB-bench) write into a `ScratchDatabase`, their own copy in memory.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

# Authorizer actions that a read-only query tool must never perform, even on a read-only connection.
_DENIED_ACTIONS = {sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH, sqlite3.SQLITE_PRAGMA}
_PROGRESS_EVERY_N_OPS = 1000


@dataclass(frozen=True)
class SQLResult:
    """Outcome of one statement: rows on success, an error message otherwise."""

    columns: list[str] = field(default_factory=list)
    rows: list[tuple] = field(default_factory=list)
    error: str | None = None
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_text(self, max_chars: int = 2000) -> str:
        """Render for the agent: an error line, or the rows as Python tuples, cut at `max_chars`."""
        if self.error is not None:
            return f"Error: {self.error}"
        text = "\n".join(str(row) for row in self.rows) if self.rows else "(no rows)"
        if self.truncated:
            text += "\n... (more rows not shown)"
        if len(text) > max_chars:
            text = text[:max_chars] + "\n... (output truncated)"
        return text


def _authorizer(action: int, *_args: object) -> int:
    return sqlite3.SQLITE_DENY if action in _DENIED_ACTIONS else sqlite3.SQLITE_OK


def connect_read_only(db_path: str | Path) -> sqlite3.Connection:
    """Open `db_path` so that nothing done through the connection can modify the file."""
    path = Path(db_path)
    if not path.is_file():
        raise FileNotFoundError(f"database not found: {path}")
    conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, check_same_thread=False)
    conn.execute("PRAGMA query_only = ON")
    conn.set_authorizer(_authorizer)
    conn.text_factory = lambda b: b.decode(errors="ignore")  # some Spider databases hold invalid UTF-8
    return conn


def execute(conn: sqlite3.Connection, sql: str, *, timeout_s: float, max_rows: int) -> SQLResult:
    """Run one statement on `conn` with a time limit enforced inside SQLite; every failure is a `SQLResult` error."""
    deadline = time.monotonic() + timeout_s
    # Returning non-zero from the progress handler makes SQLite abort the running statement ("interrupted").
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_EVERY_N_OPS)
    try:
        cursor = conn.execute(sql)
        rows = cursor.fetchmany(max_rows + 1)
        columns = [d[0] for d in cursor.description or []]
    except sqlite3.OperationalError as exc:
        message = f"query exceeded the time limit of {timeout_s:g} s" if time.monotonic() > deadline else str(exc)
        return SQLResult(error=message)
    except (sqlite3.Error, ValueError, OverflowError) as exc:
        return SQLResult(error=str(exc))
    finally:
        conn.set_progress_handler(None, _PROGRESS_EVERY_N_OPS)
    return SQLResult(columns=columns, rows=rows[:max_rows], truncated=len(rows) > max_rows)


def run_query(
    db_path: str | Path,
    sql: str,
    *,
    timeout_s: float = 2.0,
    max_rows: int = 1000,
) -> SQLResult:
    """Execute one read-only statement on `db_path` with a time limit enforced inside SQLite."""
    try:
        conn = connect_read_only(db_path)
    except (FileNotFoundError, sqlite3.Error) as exc:
        return SQLResult(error=str(exc))
    try:
        return execute(conn, sql, timeout_s=timeout_s, max_rows=max_rows)
    finally:
        conn.close()


class ScratchDatabase:
    """A writable database that lives in memory for one rollout: an agent that may write (DB-bench) writes here.

    Built from table rows or copied from a database file with SQLite's backup API; the source is never opened for
    writing and nothing touches the disk. Statements run one per call, in autocommit mode, under the same time
    limit and authorizer (no ATTACH, DETACH or PRAGMA) as the read-only tool.
    """

    def __init__(self) -> None:
        self.conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)

    @classmethod
    def from_file(cls, db_path: str | Path) -> ScratchDatabase:
        scratch = cls()
        source = connect_read_only(db_path)
        try:
            source.backup(scratch.conn)
        finally:
            source.close()
        scratch.conn.set_authorizer(_authorizer)
        return scratch

    @classmethod
    def from_table(
        cls, name: str, columns: list[tuple[str, str]], rows: list[list[object]] | list[tuple[object, ...]]
    ) -> ScratchDatabase:
        """One table `name` with `columns` as (name, SQL type) pairs, filled with `rows`."""
        scratch = cls()
        column_defs = ", ".join(f"{_quote_identifier(c)} {t}" for c, t in columns)
        scratch.conn.execute(f"CREATE TABLE {_quote_identifier(name)} ({column_defs})")
        marks = ", ".join("?" for _ in columns)
        scratch.conn.executemany(f"INSERT INTO {_quote_identifier(name)} VALUES ({marks})", [tuple(r) for r in rows])
        scratch.conn.set_authorizer(_authorizer)
        return scratch

    def run(self, sql: str, *, timeout_s: float = 2.0, max_rows: int = 1000) -> SQLResult:
        return execute(self.conn, sql, timeout_s=timeout_s, max_rows=max_rows)

    def table_rows(self, name: str) -> list[tuple]:
        """Every row of table `name`, sorted: the state a write task is judged on."""
        rows = self.conn.execute(f"SELECT * FROM {_quote_identifier(name)}").fetchall()
        return sorted(rows, key=lambda row: [(v is None, str(type(v)), v if v is not None else 0) for v in row])

    def close(self) -> None:
        self.conn.close()


def _quote_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def schema_text(db_path: str | Path, style: str = "sql") -> str:
    """The database schema as the agent sees it.

    `sql`: the CREATE TABLE statements. `compact`: one line per table, `table(column type, ...)`, then the foreign
    keys as `table.column -> table.column` (about a third of the tokens).
    """
    if style not in ("sql", "compact"):
        raise ValueError(f"unknown schema style {style!r}: use 'sql' or 'compact'")
    path = Path(db_path)
    if not path.is_file():
        raise FileNotFoundError(f"database not found: {path}")
    conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
    try:
        tables = conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL "
            "AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
        ).fetchall()
        if style == "sql":
            return "\n\n".join(sql for _, sql in tables)
        lines, keys = [], []
        for name, _ in tables:
            columns = conn.execute("SELECT name, type FROM pragma_table_info(?)", (name,)).fetchall()
            lines.append(f"{name}({', '.join(f'{c} {t}'.strip() for c, t in columns)})")
            for _, _, ref_table, column, ref_column, *_ in conn.execute(
                "SELECT * FROM pragma_foreign_key_list(?)", (name,)
            ).fetchall():
                keys.append(f"{name}.{column} -> {ref_table}.{ref_column}")
        return "\n".join(lines + keys)
    finally:
        conn.close()

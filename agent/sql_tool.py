"""The SQL tool every agent and reward uses: read-only, one statement, bounded in time, size, memory and rows.

A bad query never raises and never changes the database: it comes back as a `SQLResult` with `error` set, which the
agent sees as tool text. Agents that must write (DB-bench) write into a `ScratchDatabase`, their own copy in memory.

Every connection opened here carries the same hard limits (`harden`):
- SQLite's length limits (`LIMITS`), sized for text-to-SQL: a query or a value that needs more is an error, so no
  single function call (`zeroblob(1e9)`, string doubling) can run long or allocate much; `printf`/`format`, whose
  `*` width or precision SQLite 3.40 walks one character at a time even past the limit (`printf('%.*c', 1e9, 'x')`
  runs for seconds inside one call), give NULL for a `*` argument past it, as for any result past it;
- an authorizer that refuses ATTACH, DETACH, PRAGMA, virtual tables and the functions that reach outside the
  database (`fts3_tokenizer`, whose two-argument form installs a C pointer, and `load_extension`);
- a time limit enforced twice: a progress handler and a watchdog thread that interrupts the connection;
- memory: temporary tables live in SQLite's heap, whose size for the process is capped (`HEAP_LIMIT_BYTES`), and a
  result is read only up to `MAX_RESULT_BYTES`.
Read-only opens of a WAL-mode database whose log is empty (no `-wal` file) are `immutable`, so nothing is written
beside it.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

# (limit, value): SQLite's run-time limits on every connection; the defaults allow 1 GB values and 1 MB queries.
LIMITS = (
    (sqlite3.SQLITE_LIMIT_LENGTH, 10_000_000),  # bytes in one string, blob or row
    (sqlite3.SQLITE_LIMIT_SQL_LENGTH, 100_000),  # bytes of SQL text in one statement
    (sqlite3.SQLITE_LIMIT_COLUMN, 500),  # columns in a table, result, index, GROUP BY or ORDER BY
    (sqlite3.SQLITE_LIMIT_EXPR_DEPTH, 200),  # depth of an expression tree
    (sqlite3.SQLITE_LIMIT_COMPOUND_SELECT, 50),  # terms of a UNION / INTERSECT / EXCEPT chain
    (sqlite3.SQLITE_LIMIT_FUNCTION_ARG, 32),  # arguments of one function call
    (sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, 1_000),  # bytes of a LIKE or GLOB pattern
    (sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999),  # host parameters (?NNN): one per column in a scratch insert
    (sqlite3.SQLITE_LIMIT_TRIGGER_DEPTH, 10),  # nested triggers (DB-bench's scratch copies may create some)
    (sqlite3.SQLITE_LIMIT_ATTACHED, 0),  # attached databases (ATTACH is refused anyway)
    (sqlite3.SQLITE_LIMIT_WORKER_THREADS, 0),  # sorter threads: the query runs in the caller's thread only
)
MAX_SQL_CHARS = dict(LIMITS)[sqlite3.SQLITE_LIMIT_SQL_LENGTH]
MAX_VALUE_BYTES = dict(LIMITS)[sqlite3.SQLITE_LIMIT_LENGTH]
HEAP_LIMIT_BYTES = 2 << 30  # SQLite's heap in this process (all connections): past it, a statement is "out of memory"
MAX_RESULT_BYTES = 64 << 20  # what one result may hold in Python (approximate: text and blob bytes, 16 per number)
SCHEMA_STYLES = ("sql", "compact")  # how `schema_text` shows a database: CREATE TABLE statements, or one line per table

# Authorizer actions that a query tool must never perform, even on a read-only or scratch connection.
_DENIED_ACTIONS = {
    sqlite3.SQLITE_ATTACH,
    sqlite3.SQLITE_DETACH,
    sqlite3.SQLITE_PRAGMA,
    sqlite3.SQLITE_CREATE_VTABLE,
    sqlite3.SQLITE_DROP_VTABLE,
}
_DENIED_FUNCTIONS = {"fts3_tokenizer", "load_extension"}
_PROGRESS_EVERY_N_OPS = 1000
_heap_limit_lock = threading.Lock()
# One conversion of SQLite's printf: flags, width, precision (each a number or `*`, an argument), then its type.
_PRINTF_CONVERSION = re.compile(r"%[-+ #0!,]*(\*|\d*)(?:\.(\*|\d*))?([a-zA-Z%])")
_printf_helper = threading.local()  # a plain in-memory connection per thread that runs SQLite's own printf


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


def _authorizer(action: int, arg1: str | None, arg2: str | None, *_args: object) -> int:
    if action in _DENIED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def _cap_heap(conn: sqlite3.Connection) -> None:
    """Cap SQLite's heap for the process at HEAP_LIMIT_BYTES, unless something set a lower cap already."""
    with _heap_limit_lock:
        (current,) = conn.execute("PRAGMA hard_heap_limit").fetchone()
        if current == 0 or current > HEAP_LIMIT_BYTES:
            conn.execute(f"PRAGMA hard_heap_limit = {HEAP_LIMIT_BYTES}")


def _star_arguments(fmt: str) -> list[int]:
    """Positions (among printf's arguments after the format) of the `*` widths and precisions in `fmt`."""
    positions, index = [], 0
    for match in _PRINTF_CONVERSION.finditer(fmt):
        width, precision, kind = match.groups()
        if kind == "%":
            continue
        for part in (width, precision):
            if part == "*":
                positions.append(index)
                index += 1
        index += 1
    return positions


def _bounded_printf(fmt: object, *args: object) -> object:
    """SQLite's printf, except that a `*` width or precision past the length limit gives NULL at once."""
    if isinstance(fmt, str):
        for i in _star_arguments(fmt):
            value = args[i] if i < len(args) else None
            if isinstance(value, int | float) and not abs(value) <= MAX_VALUE_BYTES:
                return None
    helper = getattr(_printf_helper, "conn", None)
    if helper is None:
        helper = _printf_helper.conn = sqlite3.connect(":memory:")
        for limit_id, value in LIMITS:
            helper.setlimit(limit_id, value)
    marks = ", ".join("?" for _ in range(1 + len(args)))
    return helper.execute(f"SELECT printf({marks})", (fmt, *args)).fetchone()[0]


def harden(conn: sqlite3.Connection) -> sqlite3.Connection:
    """Put the module's limits and authorizer on `conn` (any statement the caller runs itself goes before this)."""
    for limit, value in LIMITS:
        conn.setlimit(limit, value)
    for name in ("printf", "format"):
        conn.create_function(name, -1, _bounded_printf, deterministic=True)
    _cap_heap(conn)
    conn.execute("PRAGMA temp_store = MEMORY")  # sorts and temporary tables count against the heap cap, not the disk
    conn.set_authorizer(_authorizer)
    return conn


def _is_wal_without_log(path: Path) -> bool:
    """A WAL-mode database (header bytes 18-19 are 2) with no `-wal` file: nothing to read but the file itself."""
    with path.open("rb") as f:
        header = f.read(20)
    return len(header) == 20 and header[18] == 2 and not path.with_name(path.name + "-wal").exists()


def _open_read_only(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        raise FileNotFoundError(f"database not found: {path}")
    # A read-only open of a WAL database creates -wal and -shm files unless the file is declared immutable.
    mode = "ro&immutable=1" if _is_wal_without_log(path) else "ro"
    conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode={mode}", uri=True, check_same_thread=False)
    conn.execute("PRAGMA query_only = ON")
    conn.text_factory = lambda b: b.decode(errors="ignore")  # some Spider databases hold invalid UTF-8
    return conn


def connect_read_only(db_path: str | Path) -> sqlite3.Connection:
    """Open `db_path` so that nothing done through the connection can modify the file, under the module's limits."""
    return harden(_open_read_only(Path(db_path)))


class Watchdog:
    """Calls `action` (an interrupt of the running statement) once `timeout_s` have passed, from a timer thread,
    unless `stop` came first; once `stop` returns it can no longer act on a later statement. SQLite's progress
    handler runs only between virtual machine steps, so the SQL tool's watchdog also stops work the handler does not
    see; DB-bench on a server kills the query from a second connection (agent/mysql_tool.py)."""

    def __init__(self, timeout_s: float, action: Callable[[], None]) -> None:
        self._action = action
        self._lock = threading.Lock()
        self._done = False
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if not self._done:
                self._action()

    def stop(self) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()


def _value_bytes(value: object) -> int:
    return len(value) if isinstance(value, str | bytes) else 16


def execute(
    conn: sqlite3.Connection, sql: str, *, timeout_s: float, max_rows: int, max_bytes: int = MAX_RESULT_BYTES
) -> SQLResult:
    """Run one statement on `conn` within `timeout_s`, keeping at most `max_rows` rows; every failure (SQL error,
    limit, time, memory) is a `SQLResult` error."""
    if not sql.strip():
        return SQLResult(error="empty query: write one SQL statement")
    deadline = time.monotonic() + timeout_s
    # Returning non-zero from the progress handler makes SQLite abort the running statement ("interrupted").
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_EVERY_N_OPS)
    watchdog = Watchdog(timeout_s, conn.interrupt)
    try:
        cursor = conn.execute(sql)
        columns = [d[0] for d in cursor.description or []]
        rows: list[tuple] = []
        size = 0
        while len(rows) <= max_rows:
            chunk = cursor.fetchmany(min(1000, max_rows + 1 - len(rows)))
            if not chunk:
                break
            rows.extend(chunk)
            size += sum(_value_bytes(v) for row in chunk for v in row)
            if size > max_bytes:
                return SQLResult(error=f"the result is larger than {max_bytes >> 20} MB: select fewer rows or columns")
    except sqlite3.OperationalError as exc:
        timed_out = time.monotonic() > deadline or str(exc) == "interrupted"
        return SQLResult(error=f"query exceeded the time limit of {timeout_s:g} s" if timed_out else str(exc))
    except MemoryError:
        return SQLResult(error="out of memory")
    except (sqlite3.Error, ValueError, OverflowError, RecursionError) as exc:
        return SQLResult(error=str(exc))
    finally:
        watchdog.stop()
        conn.set_progress_handler(None, _PROGRESS_EVERY_N_OPS)
    return SQLResult(columns=columns, rows=rows[:max_rows], truncated=len(rows) > max_rows)


def run_query(
    db_path: str | Path,
    sql: str,
    *,
    timeout_s: float = 2.0,
    max_rows: int = 1000,
) -> SQLResult:
    """Execute one read-only statement on `db_path` under the module's limits."""
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
    writing and nothing touches the disk. Statements run one per call, in autocommit mode, under the same limits,
    time limit and authorizer as the read-only tool.
    """

    def __init__(self) -> None:
        self.conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)

    @classmethod
    def from_file(cls, db_path: str | Path) -> ScratchDatabase:
        scratch = cls()
        source = _open_read_only(Path(db_path))
        try:
            source.backup(scratch.conn)
        finally:
            source.close()
        harden(scratch.conn)
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
        harden(scratch.conn)
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
    if style not in SCHEMA_STYLES:
        raise ValueError(f"unknown schema style {style!r}: use 'sql' or 'compact'")
    conn = _open_read_only(Path(db_path))
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

"""DB-bench on a MySQL-compatible server (`data.engine=mysql`): a database per rollout, under the SQL tool's limits.

`MySQLScratch` is `agent.sql_tool.ScratchDatabase`'s counterpart on a MariaDB or MySQL server (`MySQLServer`: where
it is, who connects, the password from an environment variable):

- a database of its own (`<database_prefix><16 hex digits>`, utf8mb4) holds the task's table, created from its
  `table_info`, and a user of its own, granted the table-level privileges on that database only (`PRIVILEGES`); both
  are dropped by `close` (agents call it in a `finally`, so also after a failure). A statement that names another
  database, creates or drops one, reads the server's own tables or files, or sets a global variable is refused by
  the server: its error is tool text, and nothing outside the rollout's database changes;
- statements run one per call (the driver sends no multi-statements), in autocommit mode, with the SQL tool's limits:
  its length cap (`MAX_SQL_CHARS`), a time limit enforced twice (MariaDB: `SET STATEMENT max_statement_time=... FOR`
  the statement; MySQL: `max_execution_time`, which bounds SELECT only; on both a watchdog that kills the query from
  a second connection of the rollout's user at the deadline), at most `max_rows` rows and `MAX_RESULT_BYTES` read
  (unbuffered: the server's rows past them are never held in Python);
- values come back as Python's plain types (DECIMAL as int or float, dates and times as MySQL writes them), so tool
  text and table states read as the SQLite engine's do;
- `table_md5` is LifelongAgentBench's answer for a write task, computed by the server with LifelongAgentBench's own
  query (src/tasks/instance/db_bench/task.py, `DBBench._get_task_output`) under MySQL's default
  `group_concat_max_len` (1024; MariaDB's is 1 MiB).

The account must be able to create and drop databases and users and grant privileges (root on a server of its own:
a container, or `mariadbd` started as tests/test_dbbench_mysql.py does). The server's memory is its own to bound
(`max_heap_table_size`, `tmp_table_size`): a user's temporary tables count against it, not against this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import decimal
import functools
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from agent.sql_tool import MAX_RESULT_BYTES, MAX_SQL_CHARS, SQLResult, Watchdog
from foundation.errors import ConfigError
from foundation.schema import check_values, number

ENGINES = ("sqlite", "mysql")  # data.engine: where each rollout's copy of the task's table lives
DIALECTS = {"sqlite": "SQLite", "mysql": "MySQL"}  # what the agent's system prompt calls it ({dialect})
EXTRA = "pip install -e '.[mysql]' (the mysql extra: PyMySQL)"
# MySQL 8's default sql_mode, the one LifelongAgentBench's `mysql` container ran under (MariaDB 10.11's lacks
# ONLY_FULL_GROUP_BY, NO_ZERO_IN_DATE and NO_ZERO_DATE).
MYSQL8_SQL_MODE = (
    "ONLY_FULL_GROUP_BY,STRICT_TRANS_TABLES,NO_ZERO_IN_DATE,NO_ZERO_DATE,"
    "ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION"
)
# What a rollout's user may do on its own database (nothing elsewhere): no TRIGGER, routines, events, LOCK TABLES,
# REFERENCES or FILE.
PRIVILEGES = (
    "SELECT, INSERT, UPDATE, DELETE, CREATE, DROP, ALTER, INDEX, CREATE TEMPORARY TABLES, CREATE VIEW, SHOW VIEW"
)
LAB_GROUP_CONCAT_MAX_LEN = 1024  # MySQL's default, under which LifelongAgentBench's md5 answers were computed
READ_TIMEOUT_S = 120.0  # a hang guard on every socket read (the statement's own limits end it long before)
_TIMED_OUT = {1969, 1317, 3024}  # max_statement_time exceeded, query interrupted (KILL QUERY), max_execution_time
_CONNECTION_LOST = {0, 2003, 2006, 2013, 2055}  # the server is unreachable or went away: not the agent's doing
_PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,39}")


def driver() -> ModuleType:
    """PyMySQL, or a ConfigError naming the extra that installs it."""
    try:
        import pymysql
    except ImportError as exc:
        raise ConfigError(f"data.engine=mysql needs the PyMySQL driver, which is not installed: {EXTRA}") from exc
    return pymysql


@dataclass
class MySQLServer:
    """A MariaDB/MySQL server and an account on it (`data.mysql`). The password is never a config value: it is read
    from the environment variable `password_env` when connecting."""

    host: str = "127.0.0.1"  # the server's address (unix_socket, when set, instead)
    port: int = number(3306, gt=0, lt=65536)  # its TCP port
    user: str = "root"  # an account that may create and drop databases and users, and grant privileges
    password_env: str = "DBBENCH_MYSQL_PASSWORD"  # the environment variable holding its password (unset: none)
    unix_socket: str | None = None  # a unix socket path to connect through instead of host:port
    database_prefix: str = "dbbench_"  # each rollout's database and user: <prefix><16 hex digits>
    connect_timeout_s: float = number(5.0, gt=0)  # connecting, and the preflight's check
    sql_mode: str | None = MYSQL8_SQL_MODE  # every session's sql_mode (None: the server's)

    def __post_init__(self) -> None:
        if isinstance(self.port, str) and self.port.strip().isdigit():  # ${oc.env:...} gives strings
            self.port = int(self.port)
        check_values("data.mysql", type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if not _PREFIX.fullmatch(self.database_prefix):
            raise ConfigError(
                f"data.mysql.database_prefix={self.database_prefix!r}: a letter, then up to 39 letters, digits or _"
            )

    def where(self) -> str:
        """The server and account, as messages name them (no password)."""
        return f"{self.user}@{self.unix_socket or f'{self.host}:{self.port}'}"

    def connect(
        self,
        *,
        user: str | None = None,
        password: str | None = None,
        database: str | None = None,
        unbuffered: bool = False,
        connect_timeout_s: float | None = None,
    ) -> Any:
        """A new autocommit utf8mb4 connection (the configured account unless `user` is given), its sql_mode set."""
        pymysql = driver()
        conn = pymysql.connect(
            host=self.host,
            port=self.port,
            unix_socket=self.unix_socket or None,
            user=user or self.user,
            password=os.environ.get(self.password_env, "") if password is None else password,
            database=database,
            charset="utf8mb4",
            autocommit=True,
            connect_timeout=connect_timeout_s or self.connect_timeout_s,
            read_timeout=READ_TIMEOUT_S,
            write_timeout=READ_TIMEOUT_S,
            cursorclass=pymysql.cursors.SSCursor if unbuffered else pymysql.cursors.Cursor,
        )
        if self.sql_mode is not None:
            with conn.cursor() as cursor:
                cursor.execute("SET SESSION sql_mode = %s", (self.sql_mode,))
        return conn

    def check(self, timeout_s: float) -> str:
        """The server's version, asked within `timeout_s` (the preflight); raises what connecting raises."""
        conn = self.connect(connect_timeout_s=timeout_s)
        try:
            with conn.cursor() as cursor:
                cursor.execute("SELECT VERSION()")
                return str(cursor.fetchone()[0])
        finally:
            conn.close()


def quote(name: str) -> str:
    """A MySQL identifier in backquotes."""
    return "`" + name.replace("`", "``") + "`"


def plain(value: Any) -> Any:
    """A value as the SQLite engine would hold it: DECIMAL as int (integral) or float, dates and times as text."""
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, datetime.date | datetime.time | datetime.timedelta):
        return str(value)
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode(errors="replace")
    if isinstance(value, set):
        return ",".join(sorted(value))
    return value


def _row_key(row: Sequence[Any]) -> list[tuple[bool, str, Any]]:
    return [(v is None, str(type(v)), v if v is not None else 0) for v in row]


def lab_md5_query(table: str, columns: Sequence[str]) -> str:
    """LifelongAgentBench's md5 of a table (DBBench._get_task_output): the md5 of the sorted, comma-joined first 5
    hex digits of each row's md5 over its values joined by commas (CONCAT_WS: NULLs skipped)."""
    names = ",".join(quote(c) for c in columns)
    return (
        "select md5(group_concat(rowhash order by rowhash)) as hash "
        f"from( SELECT substring(MD5(CONCAT_WS(',', {names})), 1, 5) AS rowhash FROM {quote(table)}) as sub"
    )


class ServerLost(RuntimeError):
    """The server cannot be reached or went away mid-rollout: an infrastructure failure, never tool text."""


class TableUnreadable(LookupError):
    """The rollout's table cannot be read (the agent dropped or renamed it)."""


def _kill_query(scratch: MySQLScratch, thread_id: int) -> None:
    """Kills connection `thread_id`'s running query from a second connection of the same user (a user may always
    kill its own queries): the watchdog's action."""
    try:
        conn = scratch.server.connect(user=scratch.user, password=scratch.password)
        try:
            with conn.cursor() as cursor:
                cursor.execute(f"KILL QUERY {int(thread_id)}")
        finally:
            conn.close()
    except Exception:  # the statement ended meanwhile, or the server is gone: the read fails on its own
        pass


class MySQLScratch:
    """One rollout's database and user on a MySQL-compatible server, with ScratchDatabase's methods."""

    def __init__(self, server: MySQLServer, name: str, password: str) -> None:
        self.server = server
        self.database = self.user = name
        self.password = password
        self.mariadb = True
        self._conn: Any = None
        self._closed = False

    @classmethod
    def from_table(
        cls,
        server: MySQLServer,
        name: str,
        columns: Sequence[tuple[str, str]],
        rows: Sequence[Sequence[Any]],
    ) -> MySQLScratch:
        """A new database holding one table `name` with `columns` as (name, SQL type) pairs, filled with `rows`, and
        a user that may use that database only; whatever was made is dropped again when a step fails."""
        scratch = cls(server, f"{server.database_prefix}{secrets.token_hex(8)}", secrets.token_hex(16))
        try:
            admin = server.connect()
        except Exception as exc:
            raise ServerLost(f"the MySQL server {server.where()} (data.mysql) cannot be reached: {exc}") from exc
        try:
            with admin.cursor() as cursor:
                cursor.execute("SELECT VERSION()")
                scratch.mariadb = "mariadb" in str(cursor.fetchone()[0]).lower()
                db = quote(scratch.database)
                cursor.execute(f"CREATE DATABASE {db} CHARACTER SET utf8mb4")
                cursor.execute(
                    "CREATE USER %s@'%%' IDENTIFIED BY %s WITH MAX_USER_CONNECTIONS 3", (scratch.user, scratch.password)
                )
                cursor.execute(f"GRANT {PRIVILEGES} ON {db}.* TO %s@'%%'", (scratch.user,))
                column_defs = ", ".join(f"{quote(c)} {t}" for c, t in columns)
                cursor.execute(f"CREATE TABLE {db}.{quote(name)} ({column_defs})")
                if rows:
                    marks = ", ".join("%s" for _ in columns)
                    cursor.executemany(f"INSERT INTO {db}.{quote(name)} VALUES ({marks})", [tuple(r) for r in rows])
            scratch._connection()
        except BaseException:
            with contextlib.suppress(Exception):  # the first failure is the one to report
                scratch._drop(admin)
            admin.close()
            raise
        admin.close()
        return scratch

    def _connection(self) -> Any:
        """The rollout user's connection, opened on first use (and again after the server closed it)."""
        if self._closed:
            raise ServerLost(f"the rollout's database {self.database} is closed")
        if self._conn is None or not self._conn.open:
            try:
                self._conn = self.server.connect(
                    user=self.user, password=self.password, database=self.database, unbuffered=True
                )
            except Exception as exc:
                where = self.server.where()
                raise ServerLost(f"the MySQL server {where} (data.mysql) cannot be reached: {exc}") from exc
        return self._conn

    def run(self, sql: str, *, timeout_s: float = 2.0, max_rows: int = 1000) -> SQLResult:
        """Run one statement within `timeout_s`, keeping at most `max_rows` rows; a refused, failed or timed-out
        statement is a `SQLResult` error. A lost server raises `ServerLost`."""
        pymysql = driver()
        if not sql.strip():
            return SQLResult(error="empty query: write one SQL statement")
        if len(sql) > MAX_SQL_CHARS:
            return SQLResult(error=f"the statement is longer than {MAX_SQL_CHARS} characters")
        conn = self._connection()
        killer = Watchdog(timeout_s, functools.partial(_kill_query, self, conn.thread_id()))
        cursor = conn.cursor()
        try:
            if self.mariadb:
                cursor.execute(f"SET STATEMENT max_statement_time={timeout_s:.3f} FOR {sql}")
            else:  # MySQL's limit bounds SELECT only: the watchdog bounds the rest
                cursor.execute(f"SET SESSION max_execution_time = {max(1, round(timeout_s * 1000))}")
                cursor.execute(sql)
            columns = [d[0] for d in cursor.description or []]
            rows: list[tuple] = []
            size = 0
            while cursor.description and len(rows) <= max_rows:
                chunk = cursor.fetchmany(min(1000, max_rows + 1 - len(rows)))
                if not chunk:
                    break
                rows.extend(tuple(plain(v) for v in row) for row in chunk)
                size += sum(len(v) if isinstance(v, str) else 16 for row in chunk for v in row)
                if size > MAX_RESULT_BYTES:
                    return SQLResult(error=f"the result is larger than {MAX_RESULT_BYTES >> 20} MB: select fewer rows")
        except pymysql.MySQLError as exc:
            code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 0
            if code in _TIMED_OUT:
                return SQLResult(error=f"query exceeded the time limit of {timeout_s:g} s")
            if code in _CONNECTION_LOST or isinstance(exc, pymysql.err.InterfaceError):
                self._conn = None  # reconnected on the next call, if the server comes back
                raise ServerLost(f"the MySQL server {self.server.where()} went away: {exc}") from exc
            message = exc.args[1] if len(exc.args) > 1 else str(exc)
            return SQLResult(error=f"{code}: {message}")
        except (ValueError, OverflowError, UnicodeError) as exc:
            return SQLResult(error=str(exc))
        finally:
            with contextlib.suppress(Exception):
                cursor.close()  # reads what is left of an unbuffered result: bounded by the time limit
            killer.stop()
        return SQLResult(columns=columns, rows=rows[:max_rows], truncated=len(rows) > max_rows)

    def table_rows(self, name: str) -> list[tuple]:
        """Every row of table `name`, sorted as ScratchDatabase sorts them; TableUnreadable when it is gone."""
        pymysql = driver()
        try:
            with self._connection().cursor() as cursor:
                cursor.execute(f"SELECT * FROM {quote(name)}")
                rows = [tuple(plain(v) for v in row) for row in cursor.fetchall()]
        except pymysql.MySQLError as exc:
            raise TableUnreadable(f"table {name}: {exc}") from exc
        return sorted(rows, key=_row_key)

    def table_md5(self, name: str, columns: Sequence[str]) -> str | None:
        """LifelongAgentBench's md5 answer for table `name` (`lab_md5_query`, group_concat_max_len as MySQL's
        default), computed by the server; None for an empty table."""
        with self._connection().cursor() as cursor:
            cursor.execute(f"SET SESSION group_concat_max_len = {LAB_GROUP_CONCAT_MAX_LEN}")
            cursor.execute(lab_md5_query(name, columns))
            (value,) = cursor.fetchone()
        return None if value is None else str(value)

    def _drop(self, admin: Any) -> None:
        """Drop the database and the user on `admin` (a connection of the configured account), ending the rollout
        user's sessions first so that no lock held by them can stall the drop."""
        with admin.cursor() as cursor:
            cursor.execute("SET SESSION lock_wait_timeout = 30")
            cursor.execute(
                "SELECT ID FROM information_schema.PROCESSLIST WHERE USER = %s AND ID <> CONNECTION_ID()", (self.user,)
            )
            for (thread_id,) in cursor.fetchall():
                with contextlib.suppress(Exception):  # it ended meanwhile
                    cursor.execute(f"KILL CONNECTION {int(thread_id)}")
            cursor.execute(f"DROP DATABASE IF EXISTS {quote(self.database)}")
            cursor.execute("DROP USER IF EXISTS %s@'%%'", (self.user,))

    def close(self) -> None:
        """Drop the rollout's database and user (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        if self._conn is not None:
            with contextlib.suppress(Exception):  # already closed by the server, or broken
                self._conn.close()
        admin = self.server.connect()
        try:
            self._drop(admin)
        finally:
            admin.close()


def leftovers(server: MySQLServer) -> tuple[list[str], list[str]]:
    """The databases and users named with `server.database_prefix` on the server: what rollouts that never reached
    `close` (a killed process) left behind; empty when every rollout cleaned up."""
    pattern = server.database_prefix.replace("_", "\\_") + "%"
    conn = server.connect()
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT SCHEMA_NAME FROM information_schema.SCHEMATA WHERE SCHEMA_NAME LIKE %s", (pattern,))
            databases = sorted(r[0] for r in cursor.fetchall())
            cursor.execute("SELECT DISTINCT User FROM mysql.user WHERE User LIKE %s", (pattern,))
            users = sorted(r[0] for r in cursor.fetchall())
    finally:
        conn.close()
    return databases, users

"""DB-bench on a real MariaDB server (`data.engine=mysql`): a server of the tests' own, started here.

The session fixture installs Debian's mariadb-server where it is missing (skipping only when it cannot be installed),
starts a private `mariadbd` (its own data and temporary directories, unix socket and loopback port), and stops it at
the end. Every wait is bounded and says what it waited for. Rollouts run the DB-bench agent with scripted replies.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from agent.dbbench import DBBenchAgent, scratch_for
from agent.llm import Message, ScriptedChat
from agent.mysql_tool import MySQLScratch, MySQLServer, lab_md5_query, leftovers
from agent.scripted import say, scripted_app, turn
from agent.trajectory import Trajectory
from data import dbbench
from foundation.errors import ConfigError
from jobs.preflight import mysql_findings
from rewards.dbbench_match import DBBenchMatch
from tests.conftest import ROOT, apt_lock, closed_port, run_eval, wait_for

pytestmark = pytest.mark.xdist_group("mariadb")  # one xdist worker starts the server and runs every test on it

PASSWORD_ENV = "DBBENCH_TEST_MYSQL_PASSWORD"  # the tests' admin account's password, only ever in the environment
ADMIN = "bench_admin"
APT_TIMEOUT_S = 900  # apt-get update / install, each (a hang guard)


def _install_mariadb() -> str | None:
    """Install Debian's mariadb-server where mariadbd is missing, as tests/slurm/local_cluster.sh installs packages
    (holding the same lock: another worker may be starting SLURM); None when it is there, else why it cannot be."""
    with apt_lock():
        return _install_mariadb_locked()


def _install_mariadb_locked() -> str | None:
    if shutil.which("mariadbd", path=os.environ.get("PATH", "") + ":/usr/sbin") and shutil.which("mariadb-install-db"):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "MariaDB is not installed, and this machine cannot install it (not root, or no apt-get)"
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    options = ["-o", "DPkg::Lock::Timeout=600", "-o", "Dpkg::Options::=--force-confdef"]
    options += ["-o", "Dpkg::Options::=--force-confold"]
    for command in (
        ["apt-get", *options, "update", "-qq"],
        ["apt-get", *options, "install", "-y", "-qq", "--no-install-recommends", "mariadb-server"],
    ):
        try:
            done = subprocess.run(
                command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=APT_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return f"{' '.join(command[:1] + command[-2:])} ran past {APT_TIMEOUT_S} s"
        if done.returncode != 0:
            return f"{' '.join(command)} failed: {(done.stderr or done.stdout)[-1500:]}"
    return None


@pytest.fixture(scope="session")
def mariadb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MySQLServer]:
    """A private MariaDB server on a free loopback port, and an admin account whose password is in PASSWORD_ENV."""
    import pymysql  # the mysql extra (make test installs it)

    if reason := _install_mariadb():
        pytest.skip(reason)
    mariadbd = shutil.which("mariadbd", path=os.environ.get("PATH", "") + ":/usr/sbin")
    root = tmp_path_factory.mktemp("mariadb")
    data, sock, log, tmp = root / "data", root / "mysqld.sock", root / "mariadb.err", root / "tmp"
    tmp.mkdir()  # its own temporary tables, not in the /tmp every other process on the machine shares
    user = getpass.getuser()
    install_db = ["mariadb-install-db", "--no-defaults", f"--datadir={data}", f"--tmpdir={tmp}", f"--user={user}"]
    install_db += ["--skip-test-db"]
    install = subprocess.run(
        [*install_db, "--auth-root-authentication-method=normal"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    port = closed_port()
    options = [f"--datadir={data}", f"--tmpdir={tmp}", f"--socket={sock}", f"--port={port}", f"--user={user}"]
    options += ["--bind-address=127.0.0.1"]
    options += [f"--pid-file={root / 'mariadbd.pid'}", f"--log-error={log}", "--skip-log-bin", "--skip-name-resolve"]
    options += ["--innodb-buffer-pool-size=32M", "--max-connections=300"]
    server = subprocess.Popen(
        [mariadbd, "--no-defaults", *options],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def accepts() -> bool:
        try:
            pymysql.connect(unix_socket=str(sock), user="root", password="", connect_timeout=2).close()
            return True
        except pymysql.MySQLError:
            return False

    password = secrets.token_hex(12)
    before = os.environ.get(PASSWORD_ENV)
    try:
        wait_for(lambda: server.poll() is not None or accepts(), 120, f"mariadbd to accept connections on {sock}")
        assert server.poll() is None, f"mariadbd exited ({server.returncode}): {log.read_text()[-2000:]}"
        conn = pymysql.connect(unix_socket=str(sock), user="root", password="", autocommit=True)
        with conn.cursor() as cursor:
            cursor.execute(f"CREATE USER '{ADMIN}'@'%%' IDENTIFIED BY %s", (password,))
            cursor.execute(f"GRANT ALL PRIVILEGES ON *.* TO '{ADMIN}'@'%' WITH GRANT OPTION")
        conn.close()
        os.environ[PASSWORD_ENV] = password
        yield MySQLServer(host="127.0.0.1", port=port, user=ADMIN, password_env=PASSWORD_ENV)
    finally:
        if before is None:
            os.environ.pop(PASSWORD_ENV, None)
        else:
            os.environ[PASSWORD_ENV] = before
        server.terminate()  # a clean shutdown
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


@pytest.fixture(scope="module")
def mysql_tasks(cache_dir: Path) -> list[dict[str, Any]]:
    """A generated set whose last 8 tasks are in MySQL's dialect (two of each MySQL skill)."""
    return dbbench.load_entries(dbbench.generate(cache_dir / "dbbench_mysql", seed=0, n=12, mysql_n=8))


@pytest.fixture
def tasks(dbbench_dir: Path) -> list[dict[str, Any]]:
    return dbbench.load_entries(dbbench_dir)


def dbbench_agent(*overrides: str, mysql: MySQLServer | None = None) -> DBBenchAgent:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["agent=dbbench", *overrides])
    agent = instantiate(cfg.agent, _convert_="all")
    if mysql is not None:
        agent.engine, agent.mysql = "mysql", mysql
    return agent


def operation(sql: str) -> str:
    return f"Action: Operation\n```sql\n{sql}\n```"


def gold_answer(task: dict[str, Any]) -> str:
    direct = task["answer_info"]["direct"]
    return "Action: Answer\nFinal Answer: " + (repr([tuple(r) for r in direct]) if direct is not None else "done")


def is_write(task: dict[str, Any]) -> bool:
    return task["answer_info"]["md5"] is not None


class ReadsTheResult:
    """A model that runs the gold SQL, then answers with the rows the tool showed it (or "done" for a write): right
    exactly when the engine runs the gold SQL as the task's answer says."""

    def __init__(self, task: dict[str, Any]) -> None:
        self.task = task

    async def chat(self, messages: list[Message]) -> str:
        if turn(messages) == 0:
            return operation(self.task["query"])
        shown = str(messages[-1]["content"]).splitlines()
        return "Action: Answer\nFinal Answer: " + ("done" if is_write(self.task) else f"[{', '.join(shown)}]")


def rollout(agent: DBBenchAgent, task: dict[str, Any], chat: Any, reward: DBBenchMatch) -> tuple[Trajectory, float]:
    trajectory = asyncio.run(agent.run(task, chat))
    return trajectory, reward(task, trajectory)


# ---- MySQL's dialect -----------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_mysql_only_gold_sql_fails_on_sqlite_and_is_right_on_mysql(
    mariadb: MySQLServer, mysql_tasks: list[dict[str, Any]]
) -> None:
    dialect = [t for t in mysql_tasks if "mysql_dialect" in t["skill_list"]]
    assert len(dialect) == 8 and {t["query"].split("(")[0].split()[-1] for t in dialect} >= {"LPAD", "IF"}
    on_sqlite, on_mysql = dbbench_agent(), dbbench_agent(mysql=mariadb)
    sqlite_reward, mysql_reward = DBBenchMatch(), DBBenchMatch(engine="mysql", mysql=mariadb)
    for task in dialect:
        trajectory, reward = rollout(on_mysql, task, ReadsTheResult(task), mysql_reward)
        assert reward == 1.0, (task["query"], trajectory.messages[-2]["content"])
        assert trajectory.execution_errors == 0
        if "LPAD" in task["query"] or "DATE_FORMAT" in task["query"]:  # no SQLite has them (IF, CONCAT: 3.48, 3.44)
            sqlite_copy = scratch_for(task)
            result = sqlite_copy.run(task["query"])
            sqlite_copy.close()
            assert not result.ok and "no such function" in str(result.error)
            trajectory = asyncio.run(on_sqlite.run(task, ReadsTheResult(task)))
            assert trajectory.messages[3]["content"].startswith("Error: no such function")
            if is_write(task):  # the gold SQL cannot be replayed: said, never a silent 0
                with pytest.raises(ValueError, match=rf"task {task['id']}: the gold SQL fails: no such function"):
                    sqlite_reward(task, trajectory)
            else:
                assert sqlite_reward(task, trajectory) == 0.0
    assert "MySQL table" in on_mysql.first_messages(dialect[0])[0]["content"]
    assert "SQLite table" in on_sqlite.first_messages(dialect[0])[0]["content"]


@pytest.mark.integration
def test_the_generated_answers_are_what_the_server_computes(
    mariadb: MySQLServer, mysql_tasks: list[dict[str, Any]], tasks: list[dict[str, Any]]
) -> None:
    """Every write task's md5 (computed in Python by the generator) is LifelongAgentBench's md5 query on the server,
    after the gold SQL; every MySQL-dialect question's answer rows are the server's."""
    writes = [t for t in tasks + mysql_tasks if is_write(t)]
    assert len(writes) >= 10 and any("mysql_dialect" in t["skill_list"] for t in writes)
    for task in writes:
        db = scratch_for(task, "mysql", mariadb)
        try:
            assert db.run(task["query"]).ok
            columns = [c["name"] for c in task["table_info"]["column_info_list"]]
            assert db.table_md5(task["db_id"], columns) == task["answer_info"]["md5"], task["query"]
        finally:
            db.close()
    for task in (t for t in mysql_tasks if not is_write(t)):
        db = scratch_for(task, "mysql", mariadb)
        try:
            assert [list(r) for r in db.run(task["query"]).rows] == task["answer_info"]["direct"]
        finally:
            db.close()
    assert "group_concat(rowhash order by rowhash)" in lab_md5_query("t", ["a"])


# ---- writes and the reward -----------------------------------------------------------------------------------------
@pytest.mark.integration
def test_write_tasks_are_rewarded_on_mysql(
    mariadb: MySQLServer, tasks: list[dict[str, Any]], mysql_tasks: list[dict[str, Any]]
) -> None:
    agent, reward = dbbench_agent(mysql=mariadb), DBBenchMatch(engine="mysql", mysql=mariadb)
    concat_update = next(t for t in mysql_tasks if is_write(t))
    for task in [*[t for t in tasks if is_write(t)][:6], concat_update]:
        trajectory, score = rollout(agent, task, ScriptedChat([operation(task["query"]), gold_answer(task)]), reward)
        assert score == 1.0 and trajectory.db_state is not None, task["query"]
        wrong = ScriptedChat([operation(f"UPDATE {task['db_id']} SET id = id + 100"), gold_answer(task)])
        assert rollout(agent, task, wrong, reward)[1] == 0.0
    dropped = ScriptedChat([operation(f"DROP TABLE {concat_update['db_id']}"), gold_answer(concat_update)])
    trajectory, score = rollout(agent, concat_update, dropped, reward)
    assert trajectory.error is None and trajectory.db_state is None and score == 0.0


@pytest.mark.integration
def test_a_file_md5_the_server_does_not_reproduce_is_named(mariadb: MySQLServer, tasks: list[dict[str, Any]]) -> None:
    task = next(t for t in tasks if is_write(t))
    broken = json.loads(json.dumps(task))
    broken["answer_info"]["md5"] = "0" * 32
    agent, reward = dbbench_agent(mysql=mariadb), DBBenchMatch(engine="mysql", mysql=mariadb)
    trajectory = asyncio.run(agent.run(broken, ScriptedChat([operation(task["query"]), gold_answer(task)])))
    with pytest.raises(ValueError, match=rf"task {task['id']}: .* md5 .* the file's answer is 0{{32}}"):
        reward(broken, trajectory)


@pytest.mark.integration
def test_select_answers_read_as_on_sqlite(mariadb: MySQLServer, tasks: list[dict[str, Any]]) -> None:
    """SUM gives DECIMAL on MySQL: shown and compared as a plain number, so the gold answer is right on both."""
    agent, reward = dbbench_agent(mysql=mariadb), DBBenchMatch(engine="mysql", mysql=mariadb)
    questions = [t for t in tasks if not is_write(t)]
    assert any("SUM(" in t["query"] for t in questions)
    for task in questions:
        assert rollout(agent, task, ReadsTheResult(task), reward)[1] == 1.0, task["query"]


# ---- isolation -----------------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_concurrent_rollouts_on_threads_never_see_each_others_writes(
    mariadb: MySQLServer, tasks: list[dict[str, Any]]
) -> None:
    task = next(t for t in tasks if not is_write(t))
    table, n_rows, n = task["db_id"], len(task["table_info"]["row_list"]), 4
    written = threading.Barrier(n, timeout=120)  # every rollout has written before any reads

    class WriteWaitRead:
        def __init__(self, i: int) -> None:
            self.i = i

        async def chat(self, messages: list[Message]) -> str:
            step = turn(messages)
            if step == 0:
                return operation(f"DELETE FROM {table} WHERE id <= {self.i}")
            if step == 1:
                written.wait()
                return operation(f"SELECT COUNT(*) FROM {table}")
            return "Action: Answer\nFinal Answer: " + str(messages[-1]["content"])

    agent = dbbench_agent(mysql=mariadb)
    with ThreadPoolExecutor(n) as pool:
        trajectories = list(pool.map(lambda i: asyncio.run(agent.run(task, WriteWaitRead(i))), range(n)))
    for i, trajectory in enumerate(trajectories):
        assert trajectory.error is None and trajectory.answer == f"({n_rows - i},)"
        assert len(trajectory.db_state or []) == n_rows - i
    assert leftovers(mariadb) == ([], [])


@pytest.mark.integration
def test_another_database_and_the_server_are_out_of_reach(mariadb: MySQLServer, tasks: list[dict[str, Any]]) -> None:
    task = next(t for t in tasks if not is_write(t))
    table = task["db_id"]
    other = scratch_for(task, "mysql", mariadb)  # another rollout's copy
    assert isinstance(other, MySQLScratch)
    try:
        hostile = [
            f"SELECT * FROM {other.database}.{table}",
            f"DELETE FROM {other.database}.{table}",
            f"DROP TABLE {other.database}.{table}",
            f"DROP DATABASE {other.database}",
            f"USE {other.database}",
            "CREATE DATABASE elsewhere",
            "SELECT * FROM mysql.user",
            "SET GLOBAL max_connections = 1",
            "SELECT 1 INTO OUTFILE '/tmp/dbbench-escape'",
            f"CREATE TRIGGER t BEFORE INSERT ON {table} FOR EACH ROW SET NEW.id = 1",
            f"GRANT ALL ON *.* TO '{ADMIN}'@'%'",
        ]
        chat = ScriptedChat([*map(operation, hostile), "Action: Answer\nFinal Answer: x"])
        agent = dbbench_agent("agent.max_turns=20", mysql=mariadb)
        trajectory = asyncio.run(agent.run(task, chat))
        shown = [seen[-1]["content"] for seen in chat.seen[1:]]
        assert len(shown) == len(hostile) and trajectory.execution_errors == len(hostile)
        for sql, text in zip(hostile, shown, strict=True):
            assert text.startswith("Error: ") and ("denied" in text or "Access" in text), (sql, text)
        assert len(other.table_rows(table)) == len(task["table_info"]["row_list"])  # untouched
        assert not Path("/tmp/dbbench-escape").exists()
    finally:
        other.close()


@pytest.mark.integration
def test_bad_sql_and_the_limits_are_tool_text(mariadb: MySQLServer, tasks: list[dict[str, Any]]) -> None:
    task = next(t for t in tasks if not is_write(t))
    table = task["db_id"]
    statements = {
        f"SELEC * FROM {table}": "Error: 1064: You have an error in your SQL syntax",
        "SELECT * FROM nowhere": "Error: 1146: Table",
        f"SELECT 1; DROP TABLE {table}": "Error: 1064",  # one statement a call
        "SELECT SLEEP(30)": "Error: query exceeded the time limit of 0.5 s",
        "SET STATEMENT max_statement_time=0 FOR SELECT SLEEP(30)": "Error: query exceeded the time limit of 0.5 s",
        f"SELECT COUNT(*) FROM {', '.join(f'{table} t{i}' for i in range(9))}": "Error: query exceeded the time limit",
        f"SELECT * FROM {table}": "... (more rows not shown)",  # 6-12 rows, 2 shown
        "SELECT 'x' " + "+ 1 " * 60_000: "Error: the statement is longer than 100000 characters",
    }
    chat = ScriptedChat([*map(operation, statements), "Action: Answer\nFinal Answer: x"])
    agent = dbbench_agent("agent.max_turns=20", "agent.sql_timeout_s=0.5", "agent.result_max_rows=2", mysql=mariadb)
    trajectory = asyncio.run(agent.run(task, chat))
    shown = [seen[-1]["content"] for seen in chat.seen[1:]]
    for (sql, expected), text in zip(statements.items(), shown, strict=True):
        assert expected in text, (sql[:80], text)
    assert trajectory.error is None and len(trajectory.db_state or []) == len(task["table_info"]["row_list"])


@pytest.mark.integration
def test_no_database_or_user_is_left_even_after_a_failure(mariadb: MySQLServer, tasks: list[dict[str, Any]]) -> None:
    task = next(t for t in tasks if is_write(t))
    agent = dbbench_agent(mysql=mariadb)
    never = asyncio.Event()

    class Fails:
        async def chat(self, messages: list[Message]) -> str:
            if turn(messages) == 0:
                return operation(task["query"])
            raise RuntimeError("the model's server went away")

    class Hangs:
        async def chat(self, messages: list[Message]) -> str:
            await never.wait()
            return ""

    with pytest.raises(RuntimeError, match="went away"):
        asyncio.run(agent.run(task, Fails()))

    async def cancelled() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(agent.run(task, Hangs()), 2.0)  # a hang guard cancels it

    asyncio.run(cancelled())
    reward = DBBenchMatch(engine="mysql", mysql=mariadb)
    trajectory = asyncio.run(agent.run(task, ScriptedChat([operation(task["query"]), gold_answer(task)])))
    assert reward(task, trajectory) == 1.0
    assert leftovers(mariadb) == ([], [])


# ---- configuration and preflight -----------------------------------------------------------------------------------
def test_engine_and_server_come_from_the_config_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBBENCH_MYSQL_HOST", "db.internal")
    monkeypatch.setenv("DBBENCH_MYSQL_PORT", "13306")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["agent=dbbench", "data.engine=mysql"])
    from jobs.config import build_group

    agent, reward = build_group(cfg, "agent"), build_group(cfg, "reward")
    for built in (agent, reward):
        assert built.engine == "mysql" and built.mysql == MySQLServer(host="db.internal", port=13306)
    assert "password" not in cfg.data.mysql and cfg.data.mysql.password_env == "DBBENCH_MYSQL_PASSWORD"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        default = compose("config", overrides=["agent=dbbench"])
    assert build_group(default, "agent").engine == "sqlite" == build_group(default, "reward").engine


def test_mysql_tasks_need_the_mysql_engine(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.generate.mysql_n=4: .* need data.engine=mysql"):
        dbbench.DBBenchData(name="dbbench", data_dir=str(tmp_path), generate={"seed": 0, "n": 20, "mysql_n": 4})


def test_the_default_set_is_unchanged_by_the_mysql_tasks(tmp_path: Path, dbbench_dir: Path) -> None:
    with_mysql = dbbench.load_entries(dbbench.generate(tmp_path / "m", seed=0, n=28, mysql_n=4))
    without = dbbench.load_entries(dbbench_dir)
    assert with_mysql[:24] == without[:24] and with_mysql[24:] != without[24:]
    assert all("mysql_dialect" not in t["skill_list"] for t in without)


def test_a_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pymysql", None)  # import pymysql raises ImportError
    with pytest.raises(ConfigError, match=r"data.engine=mysql needs the PyMySQL driver.*\.\[mysql\]"):
        DBBenchMatch(engine="mysql", mysql=MySQLServer())
    [finding] = mysql_findings(compose_data_mysql(), 1.0)
    assert not finding.ok and "[mysql]" in finding.fix


def compose_data_mysql() -> Any:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["agent=dbbench", "data.engine=mysql"]).data.mysql


def test_preflight_names_the_variable_when_the_server_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBBENCH_MYSQL_PORT", str(closed_port()))
    [finding] = mysql_findings(compose_data_mysql(), 2.0)
    assert not finding.ok and finding.fix.startswith("DBBENCH_MYSQL_HOST: the MySQL server root@127.0.0.1:")
    assert "does not answer" in finding.fix and "\n" not in finding.fix


@pytest.mark.integration
def test_preflight_passes_and_refuses_a_wrong_password(mariadb: MySQLServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBBENCH_MYSQL_PORT", str(mariadb.port))
    monkeypatch.setenv("DBBENCH_MYSQL_USER", ADMIN)
    monkeypatch.setenv("DBBENCH_MYSQL_PASSWORD", os.environ[PASSWORD_ENV])
    [finding] = mysql_findings(compose_data_mysql(), 5.0)
    assert finding.ok and "MariaDB" in finding.value
    monkeypatch.setenv("DBBENCH_MYSQL_PASSWORD", "wrong-password")
    [finding] = mysql_findings(compose_data_mysql(), 5.0)
    assert not finding.ok and finding.fix.startswith("DBBENCH_MYSQL_PASSWORD: ") and "wrong-password" not in finding.fix


# ---- job=eval end to end -------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_eval_on_mysql_from_the_command_line(
    mariadb: MySQLServer,
    mysql_tasks: list[dict[str, Any]],
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`job=eval agent=dbbench data.engine=mysql` with the server's settings in the environment only: the gold
    replies score 1.0 on a set with MySQL-dialect tasks, and no database is left."""

    def script(messages: list[dict[str, Any]]) -> Any:
        prompt = messages[1]["content"]
        task = next(
            t
            for t in mysql_tasks
            if prompt.startswith(t["question"]) and json.dumps(t["table_info"], ensure_ascii=False) in prompt
        )
        assert "MySQL table" in messages[0]["content"]
        return say(operation(task["query"]) if turn(messages) == 0 else gold_answer(task))

    password = os.environ[PASSWORD_ENV]
    for key, value in [("HOST", "127.0.0.1"), ("PORT", str(mariadb.port)), ("USER", ADMIN), ("PASSWORD", password)]:
        monkeypatch.setenv(f"DBBENCH_MYSQL_{key}", value)  # conftest.launch hands os.environ to the run
    args = ["agent=dbbench", "data.engine=mysql", "data.generate.n=12", "data.generate.mysql_n=8"]
    args += ["data.val_size=6", "data.test_size=2", f"data.data_dir={cache_dir / 'dbbench_mysql'}"]
    summary, run_dir = run_eval(scripted_app(script), args, cache_dir, tmp_path)
    assert summary["n"] == 6 and summary["errors"] == 0 and summary["accuracy"] == 1.0
    written = [p.read_bytes() for p in run_dir.rglob("*") if p.is_file()]
    assert written and not any(password.encode() in content for content in written)  # no secret in the run
    assert leftovers(mariadb) == ([], [])

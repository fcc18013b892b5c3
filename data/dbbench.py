"""DB-bench single-skill tasks in LifelongAgentBench's `entry_dict.json` format, on SQLite or MySQL (`data=dbbench`).

    <data_dir>/entry_dict.json   {"<index>": {"instruction", "table_info": {"name", "row_list", "column_info_list":
                                 [{"name", "type"}]}, "answer_info": {"md5", "direct", "sql"}, "skill_list"}, ...}

The real file (HF csyq/LifelongAgentBench, db_bench) loads as it is. `generate` writes a set of the same shape:
one table per task (employees, products, students, orders) with 6-12 rows, and one skill per task: select with a
condition, order by + limit, aggregation, group by, insert, update, delete. SELECT tasks carry their answer rows in
`direct`; write tasks carry `md5`, a hash of the table after the gold SQL (computed here in SQLite, whereas
LifelongAgentBench computed it in MySQL; the reward therefore replays the gold SQL on a fresh copy and compares
table contents, which works for both; for int and text values the two hashes are the same).

`engine` (`data.engine`) says where rollouts and the reward run the SQL: `sqlite` (in memory) or `mysql` (a
MariaDB/MySQL server, `data.mysql`: agent/mysql_tool.py), where LifelongAgentBench's real file belongs, since its gold
SQL is MySQL's dialect. Asked for (`mysql_n`), the generator also writes tasks in MySQL's dialect that SQLite cannot
run (LPAD, IF, CONCAT, DATE_FORMAT): their answers are computed here in Python, so a server that runs them right
reproduces them; they need `engine=mysql`. Without them (the default) the set is what it always was.

Usage: ``python -m data.dbbench OUT_DIR [--seed S --n N --mysql-n K]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any, ClassVar

from agent.dbbench import engine_settings, scratch_for
from agent.mysql_tool import ENGINES, MySQLServer
from data.splits import KIND, stratified_split
from foundation.errors import ConfigError
from foundation.schema import number, one_of
from rewards.dbbench_match import DBBenchMatch

GENERATOR_VERSION = 1
ENTRY_FILE = "entry_dict.json"

Row = list[Any]

FIRST = ["Alice", "Bob", "Chen", "Dana", "Eve", "Farid", "Grace", "Hiro", "Ivan", "Jia", "Kofi", "Lena", "Mo", "Nia"]
DEPARTMENTS = ["Sales", "Engineering", "Support", "Finance", "Marketing"]
CATEGORIES = ["Books", "Garden", "Toys", "Kitchen", "Sports"]
PRODUCTS = ["Lamp", "Kettle", "Rake", "Puzzle", "Racket", "Atlas", "Shovel", "Blender", "Kite", "Novel", "Ball", "Pan"]
MAJORS = ["Physics", "History", "Biology", "Economics", "Music"]
CITIES = ["Lyon", "Osaka", "Lima", "Accra", "Perth", "Oslo"]


@dataclass(frozen=True)
class _Table:
    name: str
    columns: list[tuple[str, str]]  # (name, type): the first is the key, the second a name, then category, numbers
    make_row: Callable[[random.Random, int], Row]
    noun: str


TABLES = [
    _Table(
        "employees",
        [("id", "INT"), ("name", "TEXT"), ("department", "TEXT"), ("salary", "INT"), ("age", "INT")],
        lambda r, i: [
            i,
            f"{r.choice(FIRST)} {chr(65 + i)}.",
            r.choice(DEPARTMENTS),
            r.randrange(3000, 9000, 100),
            r.randint(22, 60),
        ],
        "employee",
    ),
    _Table(
        "products",
        [("id", "INT"), ("name", "TEXT"), ("category", "TEXT"), ("price", "INT"), ("stock", "INT")],
        lambda r, i: [i, f"{r.choice(PRODUCTS)} {i}", r.choice(CATEGORIES), r.randint(5, 200), r.randint(0, 80)],
        "product",
    ),
    _Table(
        "students",
        [("id", "INT"), ("name", "TEXT"), ("major", "TEXT"), ("score", "INT"), ("year", "INT")],
        lambda r, i: [i, f"{r.choice(FIRST)} {chr(65 + i)}.", r.choice(MAJORS), r.randint(40, 100), r.randint(1, 4)],
        "student",
    ),
    _Table(
        "orders",
        [("id", "INT"), ("customer", "TEXT"), ("city", "TEXT"), ("amount", "INT"), ("quantity", "INT")],
        lambda r, i: [i, f"{r.choice(FIRST)} {chr(65 + i)}.", r.choice(CITIES), r.randint(10, 500), r.randint(1, 9)],
        "order",
    ),
]


def _q(value: Any) -> str:
    return "'" + str(value).replace("'", "''") + "'" if isinstance(value, str) else str(value)


def _task(table: _Table, rows: list[Row], skill: str, rng: random.Random) -> tuple[str, str, list[str]]:
    """(instruction, gold SQL, skills) for one skill on one table."""
    t = table.name
    key, name, cat, num, num2 = (c for c, _ in table.columns)
    row = rng.choice(rows)
    if skill == "select":
        return (
            f"What is the {name} of every row in the {t} table whose {cat} is '{row[2]}'?",
            f"SELECT {name} FROM {t} WHERE {cat} = {_q(row[2])}",
            ["select", "where_single_condition"],
        )
    if skill == "order_limit":
        k = rng.randint(1, 3)
        return (
            f"List the {name} of the {k} {table.noun}(s) with the highest {num} in the {t} table, highest first.",
            f"SELECT {name} FROM {t} ORDER BY {num} DESC, {key} LIMIT {k}",
            ["select", "order_by_single_column", "limit_only"],
        )
    if skill == "aggregate":
        return (
            f"What is the total {num} of all {table.noun}s whose {cat} is '{row[2]}' in the {t} table?",
            f"SELECT SUM({num}) FROM {t} WHERE {cat} = {_q(row[2])}",
            ["select", "where_single_condition"],
        )
    if skill == "group_by":
        return (
            f"For each {cat} in the {t} table, how many {table.noun}s are there? Give ({cat}, count) pairs by {cat}.",
            f"SELECT {cat}, COUNT(*) FROM {t} GROUP BY {cat} ORDER BY {cat}",
            ["select", "group_by_single_column"],
        )
    if skill == "insert":
        new = table.make_row(rng, len(rows) + 1)
        values = ", ".join(f"{c} {_q(v)}" for (c, _), v in zip(table.columns, new, strict=True))
        return (
            f"Add a new {table.noun} to the {t} table with {values}.",
            f"INSERT INTO {t} ({', '.join(c for c, _ in table.columns)}) VALUES ({', '.join(_q(v) for v in new)})",
            ["insert"],
        )
    if skill == "update":
        value = row[3] + rng.choice([-5, 5, 10, 50])
        return (
            f"In the {t} table, set {num} to {value} where {name} is '{row[1]}'.",
            f"UPDATE {t} SET {num} = {value} WHERE {name} = {_q(row[1])}",
            ["update", "where_single_condition"],
        )
    if skill == "delete":
        return (
            f"Remove every {table.noun} with {num2} below {row[4]} from the {t} table.",
            f"DELETE FROM {t} WHERE {num2} < {row[4]}",
            ["delete", "where_single_condition"],
        )
    raise ValueError(f"unknown skill {skill!r}")


SKILLS = ["select", "order_limit", "aggregate", "group_by", "insert", "update", "delete"]


# MySQL-dialect tasks (`generate(mysql_n=...)`): gold SQL that SQLite cannot run, answers computed here in Python.
MYSQL_SKILLS = ["lpad", "if", "date_format", "concat_update"]
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]  # DATE_FORMAT's %b
BOOKINGS = _Table(
    "bookings",
    [("id", "INT"), ("guest", "TEXT"), ("city", "TEXT"), ("nights", "INT"), ("day", "DATE")],
    lambda r, i: [
        i,
        f"{r.choice(FIRST)} {chr(65 + i)}.",
        r.choice(CITIES),
        r.randint(1, 9),
        (date(2024, 1, 1) + timedelta(days=r.randrange(366))).isoformat(),
    ],
    "booking",
)


def _mysql_task(
    table: _Table, rows: list[Row], skill: str, rng: random.Random
) -> tuple[str, str, list[str], list[Row] | None, list[Row]]:
    """(instruction, gold SQL in MySQL's dialect, skills, answer rows (None for a write), the table afterwards)."""
    t = table.name
    key, name, cat, num, _ = (c for c, _ in table.columns)
    row = rng.choice(rows)
    if skill == "lpad":
        chosen = [r for r in rows if r[2] == row[2]]
        return (
            f"For every row of the {t} table whose {cat} is '{row[2]}', give its {key} left-padded with zeros to 4 "
            f"digits and its {name}, by {key}.",
            f"SELECT LPAD({key}, 4, '0'), {name} FROM {t} WHERE {cat} = {_q(row[2])} ORDER BY {key}",
            ["select", "where_single_condition", "order_by_single_column", "mysql_dialect"],
            [[str(r[0]).rjust(4, "0")[:4], r[1]] for r in sorted(chosen, key=lambda r: r[0])],
            rows,
        )
    if skill == "if":
        return (
            f"For every row of the {t} table, by {key}, give its {name} and 'high' if its {num} is at least {row[3]}, "
            f"else 'low'.",
            f"SELECT {name}, IF({num} >= {row[3]}, 'high', 'low') FROM {t} ORDER BY {key}",
            ["select", "order_by_single_column", "mysql_dialect"],
            [[r[1], "high" if r[3] >= row[3] else "low"] for r in sorted(rows, key=lambda r: r[0])],
            rows,
        )
    if skill == "date_format":  # the bookings table
        chosen = sorted((r for r in rows if r[2] == row[2]), key=lambda r: r[0])
        day = [date.fromisoformat(r[4]) for r in chosen]
        return (
            f"For every booking in {row[2]} in the {t} table, by {key}, give its guest and its day written like "
            f"'05 Mar 2024'.",
            f"SELECT guest, DATE_FORMAT(day, '%d %b %Y') FROM {t} WHERE city = {_q(row[2])} ORDER BY {key}",
            ["select", "where_single_condition", "order_by_single_column", "mysql_dialect"],
            [[r[1], f"{d.day:02d} {MONTHS[d.month - 1]} {d.year}"] for r, d in zip(chosen, day, strict=True)],
            rows,
        )
    if skill == "concat_update":
        after = [[r[0], f"{r[1]} #{str(r[0]).rjust(3, '0')[:3]}", *r[2:]] if r[2] == row[2] else list(r) for r in rows]
        return (
            f"In the {t} table, append ' #' and the {key} left-padded with zeros to 3 digits to the {name} of every "
            f"row whose {cat} is '{row[2]}'.",
            f"UPDATE {t} SET {name} = CONCAT({name}, ' #', LPAD({key}, 3, '0')) WHERE {cat} = {_q(row[2])}",
            ["update", "where_single_condition", "mysql_dialect"],
            None,
            after,
        )
    raise ValueError(f"unknown MySQL skill {skill!r}")


def _mysql_entry(skill: str, rng: random.Random) -> dict[str, Any]:
    table = BOOKINGS if skill == "date_format" else rng.choice(TABLES)
    rows = [table.make_row(rng, i) for i in range(1, rng.randint(6, 12) + 1)]
    instruction, sql, skills, direct, after = _mysql_task(table, rows, skill, rng)
    return {
        "instruction": instruction,
        "table_info": {
            "name": table.name,
            "row_list": rows,
            "column_info_list": [{"name": c, "type": t} for c, t in table.columns],
        },
        "answer_info": {"md5": None if direct is not None else table_md5(after), "direct": direct, "sql": sql},
        "skill_list": skills,
    }


def table_md5(rows: list[tuple] | list[Row]) -> str:
    """A hash of a table's contents in LifelongAgentBench's shape: md5 over the sorted 5-character row hashes. For int
    and text values (no NULL) it is the md5 LifelongAgentBench's query computes on MySQL (`lab_md5_query` in
    agent/mysql_tool.py), up to 170 rows (MySQL's group_concat_max_len cuts longer ones)."""
    row_hashes = sorted(hashlib.md5(",".join(map(str, r)).encode()).hexdigest()[:5] for r in rows)
    return hashlib.md5(",".join(row_hashes).encode()).hexdigest()


def _entry(table: _Table, skill: str, rng: random.Random) -> dict[str, Any]:
    rows = [table.make_row(rng, i) for i in range(1, rng.randint(6, 12) + 1)]
    instruction, sql, skills = _task(table, rows, skill, rng)
    entry = {
        "instruction": instruction,
        "table_info": {
            "name": table.name,
            "row_list": rows,
            "column_info_list": [{"name": c, "type": t} for c, t in table.columns],
        },
        "answer_info": {"md5": None, "direct": None, "sql": sql},
        "skill_list": skills,
    }
    scratch = scratch_for(entry)
    try:
        result = scratch.run(sql)
        if not result.ok:
            raise RuntimeError(f"generated SQL failed: {sql}: {result.error}")
        if sql.startswith("SELECT"):
            entry["answer_info"]["direct"] = [list(r) for r in result.rows]
        else:
            entry["answer_info"]["md5"] = table_md5(scratch.table_rows(table.name))
    finally:
        scratch.close()
    return entry


def generate(out_dir: str | Path, *, seed: int = 0, n: int = 300, mysql_n: int = 0) -> Path:
    """Write `n` tasks (skills in turn, tables drawn) to `out_dir/entry_dict.json` unless the same set is there; the
    last `mysql_n` of them in MySQL's dialect (MYSQL_SKILLS in turn; the others are the set without them)."""
    if not 0 <= mysql_n <= n:
        raise ValueError(f"data.generate.mysql_n={mysql_n}: between 0 and data.generate.n={n}")
    out = Path(out_dir)
    meta = {"version": GENERATOR_VERSION, "seed": seed, "n": n} | ({"mysql_n": mysql_n} if mysql_n else {})
    meta_file = out / "_meta.json"
    if meta_file.is_file() and json.loads(meta_file.read_text(encoding="utf-8")) == meta:
        return out
    rng = random.Random(seed)
    entries = {str(i): _entry(rng.choice(TABLES), SKILLS[i % len(SKILLS)], rng) for i in range(n - mysql_n)}
    for j in range(mysql_n):
        entries[str(n - mysql_n + j)] = _mysql_entry(MYSQL_SKILLS[j % len(MYSQL_SKILLS)], rng)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{ENTRY_FILE}.tmp"
    tmp.write_text(json.dumps(entries, ensure_ascii=False, indent=1), encoding="utf-8")
    tmp.replace(out / ENTRY_FILE)
    meta_file.write_text(json.dumps(meta), encoding="utf-8")
    return out


def load_entries(data_dir: str | Path, entry_file: str = ENTRY_FILE) -> list[dict[str, Any]]:
    """Tasks from an `entry_dict.json`: the entry's fields plus `id`, `question`, `db_id` and `query` (gold SQL)."""
    path = Path(data_dir) / entry_file
    if not path.is_file():
        raise FileNotFoundError(f"no DB-bench tasks: {path} does not exist")
    entries = json.loads(path.read_text(encoding="utf-8"))
    tasks = []
    for key in sorted(entries, key=lambda k: (len(k), k)):
        entry = entries[key]
        tasks.append(
            {
                "id": key,
                "question": entry["instruction"],
                "db_id": entry["table_info"]["name"],
                "query": entry["answer_info"]["sql"].strip(),
                **entry,
                KIND: f"{'+'.join(sorted(entry['skill_list']))}|{entry['table_info']['name']}",
            }
        )
    return tasks


@dataclass
class DBBenchData:
    """DB-bench tasks from `data_dir/entry_file`: `val_size` of them validate and `test_size` judge, drawn with
    `split_seed` in the proportions of the skills (`data.splits`); the others train. `engine` and `mysql` are read by
    the agent and the reward too (conf/agent/dbbench.yaml, conf/reward/dbbench_match.yaml)."""

    task_kind: ClassVar[str] = "dbbench"

    name: str
    data_dir: str
    generate: dict[str, int] | None  # data/dbbench.py's generate() arguments; None: a real entry_file in data_dir
    entry_file: str = ENTRY_FILE
    val_size: int = number(50, gt=0)  # entries held out for validation
    test_size: int = number(50, ge=0)  # entries held out for the test (0: no test split)
    split_seed: int = number(0, ge=0)  # the seed of every split of the tasks (validation, test, phases)
    val_limit: int | None = number(None, gt=0)  # validate on the first N of them (None: all)
    engine: str = one_of("sqlite", ENGINES)  # where rollouts and the reward run SQL: in memory, or a MySQL server
    mysql: MySQLServer = field(default_factory=MySQLServer)  # the server for engine=mysql

    def __post_init__(self) -> None:
        self.mysql = engine_settings(self.engine, self.mysql, "data.mysql") or MySQLServer()
        if self.generate is not None and self.generate.get("mysql_n") and self.engine != "mysql":
            raise ConfigError(
                f"data.generate.mysql_n={self.generate['mysql_n']}: tasks in MySQL's dialect need data.engine=mysql "
                f"(SQLite cannot run their gold SQL)"
            )
        if self.generate is None and not (Path(self.data_dir) / self.entry_file).is_file():
            raise FileNotFoundError(f"data.data_dir={self.data_dir} holds no {self.entry_file}")

    def _splits(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        """(train, val, test), each in the entries' order."""
        if self.generate is not None:
            generate(self.data_dir, **self.generate)
        tasks = load_entries(self.data_dir, self.entry_file)
        held = self.val_size + self.test_size
        if len(tasks) <= held:
            raise ValueError(
                f"data.val_size={self.val_size} and data.test_size={self.test_size} leave no training tasks out of "
                f"{len(tasks)}"
            )
        held_out, train = _exactly(tasks, held, self.split_seed, "held-out")
        if not self.test_size:
            return train, held_out, []
        val, test = _exactly(held_out, self.val_size, self.split_seed, "val")
        return train, val, test

    def metric(self) -> DBBenchMatch:
        return DBBenchMatch(engine=self.engine, mysql=self.mysql)

    def train_tasks(self) -> list[dict[str, Any]]:
        return self._splits()[0]

    def val_tasks(self) -> list[dict[str, Any]]:
        tasks = self._splits()[1]
        return tasks[: self.val_limit] if self.val_limit else tasks

    def test_tasks(self) -> list[dict[str, Any]]:
        return self._splits()[2]


def _exactly(
    tasks: list[dict[str, Any]], n: int, seed: int, salt: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(n of `tasks`, the rest), stratified by kind: the systematic split gives n or n + 1; a surplus task goes
    back to the rest (the last drawn)."""
    chosen, rest = stratified_split(tasks, n / len(tasks), seed, salt)
    while len(chosen) > n:
        rest.append(chosen.pop())
    while len(chosen) < n:
        chosen.append(rest.pop())
    return chosen, rest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--mysql-n", type=int, default=0, help="of the n tasks, how many in MySQL's dialect")
    args = parser.parse_args(argv)
    print(generate(args.out_dir, seed=args.seed, n=args.n, mysql_n=args.mysql_n))


if __name__ == "__main__":
    main()

"""Deterministic generator of a small text-to-SQL dataset in Spider's on-disk layout.

Layout written into ``out_dir``::

    train_spider.json, dev.json, test.json   # [{"db_id", "question", "query"}, ...]; dev's and test's also
                                             # "held_out" (below)
    tables.json                        # Spider-style schema descriptions
    database/<db_id>/<db_id>.sqlite
    database/<db_id>/schema.sql        # the CREATE TABLE statements used to build the db
    _meta.json                         # generation parameters (used to skip regeneration)

Three databases (school, shop, zoo), each a 30-row main table and a 45-row child table with a foreign key to it,
and 21 question templates in Spider's SQL style. The dev split holds out ~20% of each database's entity names,
~1/4 of the (database, template, column) combinations and ~1/4 of the numeric thresholds, so dev questions are
about things the train split never mentions where possible. Each dev question says what it holds out
(``held_out``): ``combination`` (a template asked of a column no train question asks it of), ``entity`` (a trained
combination, about an entity no train question names) or ``value`` (a trained combination, with a threshold or count
no train question uses).

Dev (for tuning) and test (for the verdict) are drawn together from the held-out pool and split between them
stratified by what a question holds out and its SQL skeleton (`data.splits`), so the two ask the same mix.

Usage: ``python -m data.spider_mini OUT_DIR [--seed S --n-train N --n-dev M --n-test K]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.splits import sql_skeleton, stratified_split

GENERATOR_VERSION = 3  # 2: dev questions say what they hold out; 3: a test split beside dev

N_MAIN_ROWS = 30
N_CHILD_ROWS = 45
DEV_NAME_FRACTION = 0.2
DEV_COMBO_FRACTION = 0.25
DEV_THRESHOLD_FRACTION = 0.25
MAX_THRESHOLDS = 60
MAX_PAIRS_PER_COMBO = 100  # caps the BETWEEN template, which would otherwise dominate the pool
# what a dev question holds out (its "held_out" field), from the hardest for a model to the easiest
HELD_OUT_COMBINATION, HELD_OUT_ENTITY, HELD_OUT_VALUE = "combination", "entity", "value"

_META_FILE = "_meta.json"
_JSON_FILES = ("train_spider.json", "dev.json", "test.json", "tables.json")


# --------------------------------------------------------------------------------------------------------------------
# Schema descriptions
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Num:
    """A numeric column: name, SQL type, phrase used in questions, value range, decimals (0 = INTEGER)."""

    col: str
    sql_type: str
    lo: float
    hi: float
    decimals: int = 0


@dataclass(frozen=True)
class _DbSpec:
    db_id: str
    main: str  # main table
    main_sing: str
    main_plur: str
    cat: str  # categorical text column of the main table
    cat_noun: str
    cat_plural: str
    cat_pred: str  # verb phrase for "<main_plur> {cat_pred}", with {v} for the value
    cat_values: tuple[str, ...]
    names: tuple[str, ...]  # N_MAIN_ROWS unique entity names
    nums: tuple[_Num, _Num]
    child: str
    child_sing: str
    child_plur: str
    fk: str  # child column referencing main.id
    child_cat: str
    child_cat_plural: str
    child_cat_values: tuple[str, ...]
    child_num: _Num

    def main_columns(self) -> list[tuple[str, str]]:
        return [("id", "INTEGER"), ("name", "TEXT"), (self.cat, "TEXT")] + [(n.col, n.sql_type) for n in self.nums]

    def child_columns(self) -> list[tuple[str, str]]:
        return [
            ("id", "INTEGER"),
            (self.fk, "INTEGER"),
            (self.child_cat, "TEXT"),
            (self.child_num.col, self.child_num.sql_type),
        ]


_STUDENT_NAMES = (
    "Alice Garcia",
    "Bruno Novak",
    "Carmen Smith",
    "Dmitri Tanaka",
    "Elena Weber",
    "Farid Rossi",
    "Greta Dubois",
    "Hiro Silva",
    "Ingrid Kowalski",
    "Jonas Jensen",
    "Keiko Garcia",
    "Lars Novak",
    "Mira Smith",
    "Nikolai Tanaka",
    "Olga Weber",
    "Pablo Rossi",
    "Quentin Dubois",
    "Rosa Silva",
    "Sven Kowalski",
    "Tamara Jensen",
    "Umar Garcia",
    "Vera Novak",
    "Wendell Smith",
    "Ximena Tanaka",
    "Yusuf Weber",
    "Zara Rossi",
    "Amelie Dubois",
    "Boris Silva",
    "Chiara Kowalski",
    "Diego Jensen",
)
_PRODUCT_NAMES = (
    "Copper Kettle",
    "Chef Knife",
    "Pepper Mill",
    "Salad Bowl",
    "Cutting Board",
    "Tea Strainer",
    "Garden Hose",
    "Rose Pruner",
    "Leaf Rake",
    "Watering Can",
    "Flower Pot",
    "Seed Tray",
    "Rubber Duck",
    "Wooden Train",
    "Kite Flyer",
    "Puzzle Cube",
    "Toy Robot",
    "Jump Rope",
    "Desk Lamp",
    "Phone Charger",
    "Wireless Mouse",
    "Smart Speaker",
    "USB Hub",
    "Alarm Clock",
    "Poetry Collection",
    "Cookbook Classics",
    "Star Atlas",
    "Travel Guide",
    "Mystery Novel",
    "Science Primer",
)
_ANIMAL_NAMES = (
    "Biscuit",
    "Shadow",
    "Marble",
    "Thunder",
    "Willow",
    "Pickles",
    "Noodle",
    "Clover",
    "Juniper",
    "Maple",
    "Pebble",
    "Sunny",
    "Ziggy",
    "Tango",
    "Bramble",
    "Comet",
    "Dusty",
    "Fennel",
    "Gizmo",
    "Hazel",
    "Indigo",
    "Jasper",
    "Kiwi",
    "Lulu",
    "Mango",
    "Nimbus",
    "Oreo",
    "Pumpkin",
    "Quincy",
    "Rascal",
)

_SPECS: tuple[_DbSpec, ...] = (
    _DbSpec(
        db_id="school",
        main="students",
        main_sing="student",
        main_plur="students",
        cat="city",
        cat_noun="city",
        cat_plural="cities",
        cat_pred="live in {v}",
        cat_values=("Paris", "London", "Berlin", "Madrid", "Rome"),
        names=_STUDENT_NAMES,
        nums=(_Num("age", "INTEGER", 17, 30), _Num("score", "REAL", 40, 100, 1)),
        child="enrollments",
        child_sing="enrollment",
        child_plur="enrollments",
        fk="student_id",
        child_cat="course",
        child_cat_plural="courses",
        child_cat_values=("Math", "Physics", "History", "Art", "Biology"),
        child_num=_Num("credits", "INTEGER", 1, 8),
    ),
    _DbSpec(
        db_id="shop",
        main="products",
        main_sing="product",
        main_plur="products",
        cat="category",
        cat_noun="category",
        cat_plural="categories",
        cat_pred="are in the {v} category",
        cat_values=("kitchen", "garden", "toys", "electronics", "books"),
        names=_PRODUCT_NAMES,
        nums=(_Num("price", "REAL", 2, 200, 2), _Num("stock", "INTEGER", 0, 120)),
        child="orders",
        child_sing="order",
        child_plur="orders",
        fk="product_id",
        child_cat="customer",
        child_cat_plural="customers",
        child_cat_values=("Acme", "Globex", "Initech", "Umbrella", "Hooli"),
        child_num=_Num("quantity", "INTEGER", 1, 20),
    ),
    _DbSpec(
        db_id="zoo",
        main="animals",
        main_sing="animal",
        main_plur="animals",
        cat="species",
        cat_noun="species",
        cat_plural="species",
        cat_pred="are {v}s",
        cat_values=("lion", "zebra", "penguin", "giraffe", "monkey"),
        names=_ANIMAL_NAMES,
        nums=(_Num("age", "INTEGER", 1, 25), _Num("weight", "REAL", 2, 500, 1)),
        child="feedings",
        child_sing="feeding",
        child_plur="feedings",
        fk="animal_id",
        child_cat="food",
        child_cat_plural="foods",
        child_cat_values=("fish", "meat", "fruit", "hay", "insects"),
        child_num=_Num("amount", "INTEGER", 1, 30),
    ),
)


# --------------------------------------------------------------------------------------------------------------------
# Database contents
# --------------------------------------------------------------------------------------------------------------------


def _draw(rng: random.Random, num: _Num) -> float | int:
    if num.decimals == 0:
        return rng.randint(int(num.lo), int(num.hi))
    return round(rng.uniform(num.lo, num.hi), num.decimals)


def _make_extremes_unique(rows: list[list[Any]], idx: int, num: _Num) -> None:
    """Make the max and min of column ``idx`` unique (so ORDER BY ... LIMIT 1 has one answer)."""
    step = 1 if num.decimals == 0 else 10**-num.decimals
    for sign in (1, -1):
        extreme = max(r[idx] * sign for r in rows) * sign
        tied = [r for r in rows if r[idx] == extreme]
        if len(tied) > 1:
            new = tied[0][idx] + sign * step
            tied[0][idx] = new if num.decimals == 0 else round(new, num.decimals)


def _make_rows(spec: _DbSpec, rng: random.Random) -> tuple[list[list[Any]], list[list[Any]]]:
    names = list(spec.names)
    rng.shuffle(names)
    cats = [spec.cat_values[i % len(spec.cat_values)] for i in range(N_MAIN_ROWS)]
    rng.shuffle(cats)
    main_rows = [[i + 1, names[i], cats[i]] + [_draw(rng, n) for n in spec.nums] for i in range(N_MAIN_ROWS)]
    for j, num in enumerate(spec.nums):
        _make_extremes_unique(main_rows, 3 + j, num)
    child_cats = [spec.child_cat_values[i % len(spec.child_cat_values)] for i in range(N_CHILD_ROWS)]
    rng.shuffle(child_cats)
    child_rows = [
        [i + 1, rng.randint(1, N_MAIN_ROWS), child_cats[i], _draw(rng, spec.child_num)] for i in range(N_CHILD_ROWS)
    ]
    return main_rows, child_rows


def _schema_sql(spec: _DbSpec) -> str:
    main_cols = ",\n".join(f"  {c} {t}" + (" NOT NULL" if c != "id" else "") for c, t in spec.main_columns())
    child_cols = ",\n".join(f"  {c} {t}" + (" NOT NULL" if c != "id" else "") for c, t in spec.child_columns())
    return (
        f"CREATE TABLE {spec.main} (\n{main_cols},\n  PRIMARY KEY (id)\n);\n\n"
        f"CREATE TABLE {spec.child} (\n{child_cols},\n  PRIMARY KEY (id),\n"
        f"  FOREIGN KEY ({spec.fk}) REFERENCES {spec.main}(id)\n);\n"
    )


def _build_db(spec: _DbSpec, db_dir: Path, rng: random.Random) -> None:
    db_dir.mkdir(parents=True)
    schema = _schema_sql(spec)
    (db_dir / "schema.sql").write_text(schema, encoding="utf-8")
    main_rows, child_rows = _make_rows(spec, rng)
    conn = sqlite3.connect(db_dir / f"{spec.db_id}.sqlite")
    try:
        conn.executescript(schema)
        conn.executemany(f"INSERT INTO {spec.main} VALUES ({', '.join('?' * 5)})", main_rows)
        conn.executemany(f"INSERT INTO {spec.child} VALUES ({', '.join('?' * 4)})", child_rows)
        conn.commit()
    finally:
        conn.close()


def _tables_entry(spec: _DbSpec) -> dict[str, Any]:
    tables = [spec.main, spec.child]
    cols: list[list[Any]] = [[-1, "*"]]
    types = ["text"]
    for t_idx, columns in enumerate((spec.main_columns(), spec.child_columns())):
        for c, t in columns:
            cols.append([t_idx, c])
            types.append("text" if t == "TEXT" else "number")
    main_id = cols.index([0, "id"])
    child_id = cols.index([1, "id"])
    fk_col = cols.index([1, spec.fk])
    return {
        "db_id": spec.db_id,
        "table_names_original": tables,
        "table_names": [t.replace("_", " ") for t in tables],
        "column_names_original": cols,
        "column_names": [[t, c.replace("_", " ")] for t, c in cols],
        "column_types": types,
        "primary_keys": [main_id, child_id],
        "foreign_keys": [[fk_col, main_id]],
    }


# --------------------------------------------------------------------------------------------------------------------
# Question templates
# --------------------------------------------------------------------------------------------------------------------


def _q(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _join(spec: _DbSpec) -> str:
    return f"FROM {spec.main} AS T1 JOIN {spec.child} AS T2 ON T1.id = T2.{spec.fk}"


def _plur(spec: _DbSpec, table: str) -> str:
    return spec.main_plur if table == spec.main else spec.child_plur


# Each template: (param kind, function(spec, col, param) -> (question, query)).
# Param kinds: none, name (entity name), thr (threshold), pair (two thresholds), k (child-count threshold),
# value (categorical value / sort direction; not held out by value).


def _t_count_all(s: _DbSpec, col: str, p: Any) -> tuple[str, str]:
    return f"How many {_plur(s, col)} are there?", f"SELECT COUNT(*) FROM {col}"


def _t_count_cat(s: _DbSpec, col: str, v: str) -> tuple[str, str]:
    return (
        f"How many {s.main_plur} {s.cat_pred.format(v=v)}?",
        f"SELECT COUNT(*) FROM {s.main} WHERE {s.cat} = {_q(v)}",
    )


def _t_value_of_named(s: _DbSpec, col: str, name: str) -> tuple[str, str]:
    c = col.split(".")[1]
    return (f"What is the {c} of the {s.main_sing} named {name}?", f"SELECT {c} FROM {s.main} WHERE name = {_q(name)}")


def _t_names_gt(s: _DbSpec, col: str, t: int) -> tuple[str, str]:
    c = col.split(".")[1]
    return (
        f"What are the names of {s.main_plur} whose {c} is greater than {t}?",
        f"SELECT name FROM {s.main} WHERE {c} > {t}",
    )


def _t_names_lt(s: _DbSpec, col: str, t: int) -> tuple[str, str]:
    c = col.split(".")[1]
    return (
        f"What are the names of {s.main_plur} whose {c} is less than {t}?",
        f"SELECT name FROM {s.main} WHERE {c} < {t}",
    )


def _agg(word: str, fn: str):
    def template(s: _DbSpec, col: str, p: Any) -> tuple[str, str]:
        table, c = col.split(".")
        return f"What is the {word} {c} of all {_plur(s, table)}?", f"SELECT {fn}({c}) FROM {table}"

    return template


def _arg(word: str, direction: str):
    def template(s: _DbSpec, col: str, p: Any) -> tuple[str, str]:
        c = col.split(".")[1]
        return (
            f"What is the name of the {s.main_sing} with the {word} {c}?",
            f"SELECT name FROM {s.main} ORDER BY {c} {direction} LIMIT 1",
        )

    return template


def _t_count_per_cat(s: _DbSpec, col: str, p: Any) -> tuple[str, str]:
    return (
        f"How many {s.main_plur} are there in each {s.cat_noun}?",
        f"SELECT {s.cat}, COUNT(*) FROM {s.main} GROUP BY {s.cat}",
    )


def _t_avg_per_cat(s: _DbSpec, col: str, p: Any) -> tuple[str, str]:
    c = col.split(".")[1]
    return (
        f"What is the average {c} of {s.main_plur} in each {s.cat_noun}?",
        f"SELECT {s.cat}, AVG({c}) FROM {s.main} GROUP BY {s.cat}",
    )


def _t_names_cat(s: _DbSpec, col: str, v: str) -> tuple[str, str]:
    return (
        f"What are the names of {s.main_plur} that {s.cat_pred.format(v=v)}?",
        f"SELECT name FROM {s.main} WHERE {s.cat} = {_q(v)}",
    )


def _t_names_sorted(s: _DbSpec, col: str, direction: str) -> tuple[str, str]:
    c = col.split(".")[1]
    word = "ascending" if direction == "ASC" else "descending"
    return (
        f"List the names of all {s.main_plur} ordered by {c} in {word} order.",
        f"SELECT name FROM {s.main} ORDER BY {c} {direction}",
    )


def _t_distinct_cat(s: _DbSpec, col: str, p: Any) -> tuple[str, str]:
    return f"What are the different {s.cat_plural} of all {s.main_plur}?", f"SELECT DISTINCT {s.cat} FROM {s.main}"


def _t_count_between(s: _DbSpec, col: str, ab: tuple[int, int]) -> tuple[str, str]:
    c = col.split(".")[1]
    a, b = ab
    article = "an" if c[0] in "aeiou" else "a"
    return (
        f"How many {s.main_plur} have {article} {c} between {a} and {b}?",
        f"SELECT COUNT(*) FROM {s.main} WHERE {c} BETWEEN {a} AND {b}",
    )


def _t_join_sum(s: _DbSpec, col: str, name: str) -> tuple[str, str]:
    c = s.child_num.col
    return (
        f"What is the total {c} of all {s.child_plur} of the {s.main_sing} named {name}?",
        f"SELECT SUM(T2.{c}) {_join(s)} WHERE T1.name = {_q(name)}",
    )


def _t_join_count(s: _DbSpec, col: str, name: str) -> tuple[str, str]:
    return (
        f"How many {s.child_plur} does the {s.main_sing} named {name} have?",
        f"SELECT COUNT(*) {_join(s)} WHERE T1.name = {_q(name)}",
    )


def _t_join_list(s: _DbSpec, col: str, name: str) -> tuple[str, str]:
    return (
        f"What are the {s.child_cat_plural} of all {s.child_plur} of the {s.main_sing} named {name}?",
        f"SELECT T2.{s.child_cat} {_join(s)} WHERE T1.name = {_q(name)}",
    )


def _t_join_having_cat(s: _DbSpec, col: str, v: str) -> tuple[str, str]:
    question = (
        f"What are the distinct names of {s.main_plur} with at least one {s.child_sing} whose {s.child_cat} is {v}?"
    )
    return (question, f"SELECT DISTINCT T1.name {_join(s)} WHERE T2.{s.child_cat} = {_q(v)}")


def _t_join_more_than(s: _DbSpec, col: str, k: int) -> tuple[str, str]:
    return (
        f"What are the names of {s.main_plur} with more than {k} {s.child_plur}?",
        f"SELECT T1.name {_join(s)} GROUP BY T1.id HAVING COUNT(*) > {k}",
    )


# template name -> (param kind, column selector, function). Column selectors:
#   tables: main and child table; main_num: the two main numeric columns; all_num: those plus the child numeric one;
#   main_cat / child_cat / child_num / main: a single combination.
TEMPLATES: dict[str, tuple[str, str, Any]] = {
    "count_all": ("none", "tables", _t_count_all),
    "count_cat": ("value", "main_cat", _t_count_cat),
    "value_of_named": ("name", "main_num", _t_value_of_named),
    "names_gt": ("thr", "main_num", _t_names_gt),
    "names_lt": ("thr", "main_num", _t_names_lt),
    "avg": ("none", "all_num", _agg("average", "AVG")),
    "max": ("none", "all_num", _agg("maximum", "MAX")),
    "min": ("none", "all_num", _agg("minimum", "MIN")),
    "argmax": ("none", "main_num", _arg("highest", "DESC")),
    "argmin": ("none", "main_num", _arg("lowest", "ASC")),
    "count_per_cat": ("none", "main_cat", _t_count_per_cat),
    "avg_per_cat": ("none", "main_num", _t_avg_per_cat),
    "names_cat": ("value", "main_cat", _t_names_cat),
    "names_sorted": ("value", "main_num", _t_names_sorted),
    "distinct_cat": ("none", "main_cat", _t_distinct_cat),
    "count_between": ("pair", "main_num", _t_count_between),
    "join_sum": ("name", "child_num", _t_join_sum),
    "join_count": ("name", "main", _t_join_count),
    "join_list": ("name", "child_cat", _t_join_list),
    "join_having_cat": ("value", "child_cat", _t_join_having_cat),
    "join_more_than": ("k", "main", _t_join_more_than),
}


def _columns(spec: _DbSpec, selector: str) -> list[str]:
    main_num = [f"{spec.main}.{n.col}" for n in spec.nums]
    return {
        "tables": [spec.main, spec.child],
        "main_num": main_num,
        "all_num": [*main_num, f"{spec.child}.{spec.child_num.col}"],
        "main_cat": [f"{spec.main}.{spec.cat}"],
        "child_cat": [f"{spec.child}.{spec.child_cat}"],
        "child_num": [f"{spec.child}.{spec.child_num.col}"],
        "main": [spec.main],
    }[selector]


# --------------------------------------------------------------------------------------------------------------------
# Splitting and sampling
# --------------------------------------------------------------------------------------------------------------------


def _split(items: list[Any], frac: float, rng: random.Random) -> tuple[list[Any], list[Any]]:
    """Random (train, dev) partition with at least one item on each side when there are >= 2 items."""
    items = list(items)
    rng.shuffle(items)
    n_dev = min(len(items) - 1, max(1, round(len(items) * frac))) if len(items) >= 2 else 0
    return sorted(items[n_dev:], key=str), sorted(items[:n_dev], key=str)


def _thresholds(conn: sqlite3.Connection, table: str, col: str) -> list[int]:
    """Round-number thresholds strictly between the column's min and max (so > and < filters are non-empty)."""
    lo, hi = conn.execute(f"SELECT MIN({col}), MAX({col}) FROM {table}").fetchone()
    step = next(s for s in (1, 2, 5, 10, 20, 25, 50, 100, 200, 500, 1000) if (hi - lo) / s <= MAX_THRESHOLDS)
    return [t for t in range(math.floor(lo / step) * step, math.ceil(hi) + 1, step) if lo < t < hi]


def _holdout_combos(combos: list[tuple[str, str, str]], rng: random.Random) -> set[tuple[str, str, str]]:
    """Hold out ~DEV_COMBO_FRACTION of the combinations, keeping >= 1 train combination per template."""
    order = list(combos)
    rng.shuffle(order)
    target = round(len(combos) * DEV_COMBO_FRACTION)
    remaining = {t: sum(1 for c in combos if c[1] == t) for t in TEMPLATES}
    held: set[tuple[str, str, str]] = set()
    for combo in order:
        if len(held) >= target:
            break
        if remaining[combo[1]] > 1:
            held.add(combo)
            remaining[combo[1]] -= 1
    return held


def _subset(items: list[Any], rng: random.Random, k: int = MAX_PAIRS_PER_COMBO) -> list[Any]:
    return items if len(items) <= k else sorted(rng.sample(items, k))


def _is_empty(rows: list[tuple[Any, ...]]) -> bool:
    return not rows or all(v is None for row in rows for v in row)


def _held_out_kind(record: dict[str, str]) -> str:
    """What splits dev from test evenly: what the question holds out, then its database and SQL skeleton."""
    return f"{record['held_out']}|{record['db_id']}|{sql_skeleton(record['query'])}"


def _sample(
    pool: dict[tuple[str, str, str], list[dict[str, str]]], n: int, rng: random.Random, exclude: set[str]
) -> list[dict[str, str]]:
    """Draw up to n unique pairs, picking a random non-exhausted combination each time (balances templates)."""
    queues = {k: list(v) for k, v in sorted(pool.items())}
    for q in queues.values():
        rng.shuffle(q)
    seen = set(exclude)
    out: list[dict[str, str]] = []
    active = [k for k, q in queues.items() if q]
    while active and len(out) < n:
        k = rng.choice(active)
        rec = queues[k].pop()
        if not queues[k]:
            active.remove(k)
        key = rec["db_id"] + "\x00" + rec["question"]
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out


def _build_pools(
    spec: _DbSpec, db_path: Path, held: set[tuple[str, str, str]], rng: random.Random
) -> tuple[dict[tuple[str, str, str], list[dict[str, str]]], dict[tuple[str, str, str], list[dict[str, str]]]]:
    conn = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        train_names, dev_names = _split(list(spec.names), DEV_NAME_FRACTION, rng)
        thr: dict[str, tuple[list[Any], list[Any]]] = {}
        for n in spec.nums:
            key = f"{spec.main}.{n.col}"
            thr[key] = _split(_thresholds(conn, spec.main, n.col), DEV_THRESHOLD_FRACTION, rng)
        max_children = conn.execute(
            f"SELECT MAX(c) FROM (SELECT COUNT(*) AS c FROM {spec.child} GROUP BY {spec.fk})"
        ).fetchone()[0]
        k_split = _split(list(range(max_children)), DEV_THRESHOLD_FRACTION, rng)

        train_pool: dict[tuple[str, str, str], list[dict[str, str]]] = {}
        dev_pool: dict[tuple[str, str, str], list[dict[str, str]]] = {}
        for tname, (kind, selector, fn) in TEMPLATES.items():
            for col in _columns(spec, selector):
                combo = (spec.db_id, tname, col)
                if kind == "none":
                    params: tuple[list[Any], list[Any]] = ([None], [])
                elif kind == "value":
                    values = {
                        "count_cat": spec.cat_values,
                        "names_cat": spec.cat_values,
                        "join_having_cat": spec.child_cat_values,
                    }.get(tname, ("ASC", "DESC"))
                    params = (list(values), [])
                elif kind == "name":
                    params = (train_names, dev_names)
                elif kind == "thr":
                    params = thr[col]
                elif kind == "pair":
                    pairs = [[(a, b) for a in ts for b in ts if a < b] for ts in thr[col]]
                    params = (_subset(pairs[0], rng), _subset(pairs[1], rng))
                elif kind == "k":
                    params = k_split
                else:  # pragma: no cover
                    raise ValueError(kind)
                held_out = {"name": HELD_OUT_ENTITY}.get(kind, HELD_OUT_VALUE)
                if combo in held:  # a held-out combination: every parameter goes to dev
                    params, held_out = ([], params[0] + params[1]), HELD_OUT_COMBINATION
                for split_params, pool in ((params[0], train_pool), (params[1], dev_pool)):
                    for p in split_params:
                        question, query = fn(spec, col, p)
                        rows = conn.execute(query).fetchall()
                        if _is_empty(rows) and not query.startswith("SELECT COUNT("):
                            continue
                        record = {"db_id": spec.db_id, "question": question, "query": query}
                        if pool is dev_pool:
                            record["held_out"] = held_out
                        pool.setdefault(combo, []).append(record)
        return train_pool, dev_pool
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------------


def _params(seed: int, n_train: int, n_dev: int, n_test: int) -> dict[str, int]:
    return {"generator_version": GENERATOR_VERSION, "seed": seed, "n_train": n_train, "n_dev": n_dev, "n_test": n_test}


def _is_complete(out_dir: Path, params: dict[str, int]) -> bool:
    try:
        meta = json.loads((out_dir / _META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("params") != params:
        return False
    if not all((out_dir / f).is_file() for f in _JSON_FILES):
        return False
    return all(
        (out_dir / "database" / s.db_id / f"{s.db_id}.sqlite").is_file()
        and (out_dir / "database" / s.db_id / "schema.sql").is_file()
        for s in _SPECS
    )


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_dataset(root: Path, seed: int, n_train: int, n_dev: int, n_test: int) -> dict[str, Any]:
    pools_train: dict[tuple[str, str, str], list[dict[str, str]]] = {}
    pools_dev: dict[tuple[str, str, str], list[dict[str, str]]] = {}
    combos = [(s.db_id, t, c) for s in _SPECS for t, (_, sel, _) in TEMPLATES.items() for c in _columns(s, sel)]
    held = _holdout_combos(combos, random.Random(f"{seed}:holdout"))
    for spec in _SPECS:
        db_dir = root / "database" / spec.db_id
        _build_db(spec, db_dir, random.Random(f"{seed}:data:{spec.db_id}"))
        tr, dv = _build_pools(spec, db_dir / f"{spec.db_id}.sqlite", held, random.Random(f"{seed}:split:{spec.db_id}"))
        pools_train.update(tr)
        pools_dev.update(dv)
    train = _sample(pools_train, n_train, random.Random(f"{seed}:train"), exclude=set())
    train_keys = {r["db_id"] + "\x00" + r["question"] for recs in pools_train.values() for r in recs}
    held_out = _sample(pools_dev, n_dev + n_test, random.Random(f"{seed}:dev"), exclude=train_keys)
    if n_test == 0:
        dev, test = held_out, []
    else:
        dev, test = stratified_split(held_out, n_dev / (n_dev + n_test), seed, "dev-test", _held_out_kind)
    _write_json(root / "train_spider.json", train)
    _write_json(root / "dev.json", dev)
    _write_json(root / "test.json", test)
    _write_json(root / "tables.json", [_tables_entry(s) for s in _SPECS])
    meta = {
        "params": _params(seed, n_train, n_dev, n_test),
        "n_train_written": len(train),
        "n_dev_written": len(dev),
        "n_test_written": len(test),
        "n_train_available": len(train_keys),
        "n_dev_available": len({r["question"] for recs in pools_dev.values() for r in recs}),
        "n_templates": len(TEMPLATES),
        "held_out_combos": sorted("/".join(c) for c in held),
    }
    _write_json(root / _META_FILE, meta)  # written last: marks the dataset complete
    return meta


def _remove_previous(out_dir: Path) -> None:
    """Remove an earlier (stale or partial) dataset; refuse to delete a non-empty directory we did not write."""
    if out_dir.is_dir() and not out_dir.is_symlink():
        if any(out_dir.iterdir()) and not (out_dir / _META_FILE).exists():
            raise FileExistsError(f"{out_dir} exists, is not empty and holds no {_META_FILE}; refusing to replace it")
        shutil.rmtree(out_dir)
    else:
        raise FileExistsError(f"{out_dir} exists and is not a directory")


def generate(out_dir: str | Path, *, seed: int = 0, n_train: int = 2000, n_dev: int = 100, n_test: int = 100) -> Path:
    """Write the dataset into out_dir (atomically: build in a temp dir next to it, then rename) and return out_dir.

    If out_dir already holds a complete dataset written with the same parameters (``_meta.json`` with the params and
    GENERATOR_VERSION), return immediately without rewriting.
    """
    out_dir = Path(out_dir)
    params = _params(seed, n_train, n_dev, n_test)
    if _is_complete(out_dir, params):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        _write_dataset(tmp, seed, n_train, n_dev, n_test)
        if out_dir.exists():
            if _is_complete(out_dir, params):  # another process finished first
                return out_dir
            _remove_previous(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not _is_complete(out_dir, params):  # lost a race to a writer with the same params: fine
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m data.spider_mini", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-dev", type=int, default=100)
    ap.add_argument("--n-test", type=int, default=100)
    args = ap.parse_args(argv)
    out = generate(args.out_dir, seed=args.seed, n_train=args.n_train, n_dev=args.n_dev, n_test=args.n_test)
    meta = json.loads((out / _META_FILE).read_text(encoding="utf-8"))
    print(
        f"{out}: {meta['n_train_written']} train / {meta['n_dev_written']} dev / {meta['n_test_written']} test pairs "
        f"({meta['n_train_available']} / {meta['n_dev_available']} available), {meta['n_templates']} templates"
    )


if __name__ == "__main__":
    main()

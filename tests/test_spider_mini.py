"""Tests for the deterministic Spider-layout mini dataset generator (data/spider_mini.py)."""

from __future__ import annotations

import dataclasses
import json
import re
import sqlite3
from pathlib import Path

import pytest

from agent.rollout import SUBSET
from data import spider_mini
from data.spider import SpiderData, load_split
from foundation.errors import ConfigError

N_TRAIN, N_DEV = 300, 50


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return spider_mini.generate(tmp_path_factory.mktemp("mini") / "spider_mini", seed=0, n_train=N_TRAIN, n_dev=N_DEV)


def _load(root: Path, name: str) -> list[dict]:
    return json.loads((root / name).read_text(encoding="utf-8"))


def test_layout(dataset: Path) -> None:
    for name in ("train_spider.json", "dev.json", "tables.json"):
        assert (dataset / name).is_file()
    tables = _load(dataset, "tables.json")
    db_ids = [t["db_id"] for t in tables]
    assert len(db_ids) == 3 and len(set(db_ids)) == 3
    for t in tables:
        db_dir = dataset / "database" / t["db_id"]
        assert (db_dir / f"{t['db_id']}.sqlite").is_file()
        schema = (db_dir / "schema.sql").read_text(encoding="utf-8")
        assert schema.count("CREATE TABLE") == len(t["table_names_original"])
        assert "PRIMARY KEY" in schema and "FOREIGN KEY" in schema
        cols = t["column_names_original"]
        assert cols[0] == [-1, "*"]
        assert len(t["column_types"]) == len(cols)
        assert t["primary_keys"] and t["foreign_keys"]
        for child, parent in t["foreign_keys"]:
            assert cols[child][0] != cols[parent][0]


def test_records(dataset: Path) -> None:
    train, dev = _load(dataset, "train_spider.json"), _load(dataset, "dev.json")
    assert 0 < len(train) <= N_TRAIN
    assert 0 < len(dev) <= N_DEV
    db_ids = {t["db_id"] for t in _load(dataset, "tables.json")}
    for rec in train + dev:
        assert {"db_id", "question", "query"} <= rec.keys()
        assert rec["db_id"] in db_ids and rec["question"] and rec["query"].startswith("SELECT ")
    assert len({(r["db_id"], r["question"]) for r in train}) == len(train)  # no duplicates


def test_gold_queries_execute(dataset: Path) -> None:
    records = _load(dataset, "train_spider.json") + _load(dataset, "dev.json")
    non_empty = 0
    for rec in records:
        path = dataset / "database" / rec["db_id"] / f"{rec['db_id']}.sqlite"
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = conn.execute(rec["query"]).fetchall()
        finally:
            conn.close()
        non_empty += bool(rows) and rows != [(0,)]
    assert non_empty >= 0.9 * len(records)


def test_deterministic_and_idempotent(tmp_path: Path, dataset: Path) -> None:
    # spelled with a leading "//" (POSIX keeps it; an sqlite URI would read it as a host) and URI characters
    other = spider_mini.generate(Path("/" + str(tmp_path / "a gain#1")), seed=0, n_train=N_TRAIN, n_dev=N_DEV)
    for name in ("train_spider.json", "dev.json", "tables.json"):
        assert (other / name).read_bytes() == (dataset / name).read_bytes()
    different = spider_mini.generate(tmp_path / "seed1", seed=1, n_train=N_TRAIN, n_dev=N_DEV)
    assert (different / "train_spider.json").read_bytes() != (dataset / "train_spider.json").read_bytes()

    mtimes = {p: p.stat().st_mtime_ns for p in other.rglob("*")}
    assert spider_mini.generate(other, seed=0, n_train=N_TRAIN, n_dev=N_DEV) == other
    assert {p: p.stat().st_mtime_ns for p in other.rglob("*")} == mtimes
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left behind

    # different parameters rewrite the directory
    spider_mini.generate(other, seed=0, n_train=20, n_dev=5)
    assert len(_load(other, "train_spider.json")) <= 20


def test_refuses_to_replace_foreign_dir(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        spider_mini.generate(tmp_path / "mine", n_train=10, n_dev=5)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_dev_is_held_out(dataset: Path) -> None:
    train, dev = _load(dataset, "train_spider.json"), _load(dataset, "dev.json")
    train_questions = {r["question"] for r in train}
    assert not [r["question"] for r in dev if r["question"] in train_questions]

    train_text = "\n".join(train_questions)
    named = [m.group(1) for r in dev if (m := re.search(r"named (.+)\?$", r["question"]))]
    unseen = [name for name in named if name not in train_text]
    assert unseen, "expected some dev questions about entities never mentioned in train"


def test_dev_questions_say_what_they_hold_out(dataset: Path) -> None:
    train, dev = _load(dataset, "train_spider.json"), _load(dataset, "dev.json")
    meta = json.loads((dataset / "_meta.json").read_text())
    assert all("held_out" not in r for r in train)
    kinds = {r["held_out"] for r in dev}
    assert kinds == {spider_mini.HELD_OUT_COMBINATION, spider_mini.HELD_OUT_ENTITY, spider_mini.HELD_OUT_VALUE}
    # a held-out combination's SQL shape (its query with the numbers blanked) is asked of no train question's column
    train_shapes = {re.sub(r"\d+(\.\d+)?|'[^']*'", "?", r["query"]) for r in train}
    combination = [r for r in dev if r["held_out"] == spider_mini.HELD_OUT_COMBINATION]
    assert combination and meta["held_out_combos"]
    assert sum(re.sub(r"\d+(\.\d+)?|'[^']*'", "?", r["query"]) not in train_shapes for r in combination) > 0.9 * len(
        combination
    )
    # an entity question names someone no train question names; a trained combination's shape is a train shape
    for r in dev:
        if r["held_out"] == spider_mini.HELD_OUT_ENTITY:
            name = re.search(r"'([^']*)'", r["query"]).group(1)
            assert name not in "\n".join(t["query"] for t in train), r
        elif r["held_out"] == spider_mini.HELD_OUT_VALUE:
            assert re.sub(r"\d+(\.\d+)?|'[^']*'", "?", r["query"]) in train_shapes, r


def test_validation_tasks_carry_their_subset_and_a_misspelt_field_is_an_error(dataset: Path) -> None:
    data = SpiderData(
        name="spider_mini",
        spider_dir=str(dataset),
        val_split="dev",
        test_split=None,
        val_from_train=None,
        val_limit=None,
        generate=None,
        val_subset_field="held_out",
    )
    dev = _load(dataset, "dev.json")
    assert [t[SUBSET] for t in data.val_tasks()] == [r["held_out"] for r in dev]
    assert all(SUBSET not in t for t in data.train_tasks())
    with pytest.raises(ConfigError, match=re.escape("data.val_subset_field=helt_out: no dev record has it")):
        dataclasses.replace(data, val_subset_field="helt_out").val_tasks()


def test_a_subset_names_metrics_so_it_is_checked(tmp_path: Path) -> None:
    records = [{"db_id": "d", "question": "q", "query": "SELECT 1", "kind": k} for k in ("a", None, "", float("nan"))]
    (tmp_path / "dev.json").write_text(json.dumps(records, allow_nan=True))
    assert [t.get(SUBSET) for t in load_split(tmp_path, "dev", "kind")] == ["a", None, None, None]
    (tmp_path / "dev.json").write_text(json.dumps([{**records[0], "kind": "a/b"}]))
    with pytest.raises(ValueError, match="may not contain"):
        load_split(tmp_path, "dev", "kind")

"""Spider in its own layout, for the real dataset and the bundled generated one alike (`conf/data/spider*.yaml`).

    <spider_dir>/train_spider.json | train_spider.parquet     list of {question, db_id, query, ...}
    <spider_dir>/dev.json | test_dev_500.parquet | dev.parquet
    <spider_dir>/test.json                                          (the generated set's; real Spider: dev is the test)
    <spider_dir>/database/<db_id>/<db_id>.sqlite (+ schema.sql)

The parquet names are the ones agent-lightning's Spider bundle uses (`VERL_SPIDER_DATA_DIR`).

Three splits: train (what training learns from), val (what a run validates on and a researcher tunes on) and test
(what judges, never tuned on). The real Spider has no public test set: its dev set is the test, and validation is
carved from train (`val_from_train`), stratified by database and SQL skeleton with `split_seed`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from agent.rollout import SUBSET
from data import spider_mini
from data.splits import KIND, sql_skeleton, stratified_split
from foundation.errors import ConfigError
from foundation.schema import number
from rewards.exec_match import ExecMatch

SPLIT_FILES = {
    "train": ("train_spider.json", "train_spider.parquet"),
    "dev": ("dev.json", "test_dev_500.parquet", "test_dev.parquet", "dev.parquet"),
    "test": ("test.json",),
}


def split_path(spider_dir: str | Path, split: str) -> Path | None:
    """The file that holds `split` (`train`, `dev`, `test`, or a file name) in `spider_dir`, or None."""
    root = Path(spider_dir)
    return next((p for p in (root / name for name in SPLIT_FILES.get(split, (split,))) if p.is_file()), None)


def split_names(split: str) -> str:
    """The file names looked for, as messages list them."""
    return " or ".join(SPLIT_FILES.get(split, (split,)))


def load_split(spider_dir: str | Path, split: str, subset_field: str | None = None) -> list[dict[str, Any]]:
    """Tasks of one split: `id`, `question`, `db_id`, `query` (gold), `db_path` and `kind` (database and SQL
    skeleton); and `subset`, the record's `subset_field` as text, where it has one (accuracy is reported per subset).

    `split` is `train`, `dev`, or a file name inside `spider_dir`.
    """
    root = Path(spider_dir)
    path = split_path(root, split)
    if path is None:
        names = ", ".join(SPLIT_FILES.get(split, (split,)))
        raise FileNotFoundError(f"no {split} split in {root}: looked for {names}")
    if path.suffix == ".parquet":
        records = pd.read_parquet(path).to_dict(orient="records")
    else:
        records = json.loads(path.read_text(encoding="utf-8"))
    tasks = []
    for i, record in enumerate(records):
        db_id = record["db_id"]
        task = {
            "id": f"{split}-{i}",
            "question": record["question"],
            "db_id": db_id,
            "query": record["query"],
            "db_path": str(root / "database" / db_id / f"{db_id}.sqlite"),
            KIND: f"{db_id}|{sql_skeleton(record['query'])}",
        }
        if subset_field is not None and (subset := _subset_name(record.get(subset_field))) is not None:
            task[SUBSET] = subset
        tasks.append(task)
    return tasks


def _subset_name(value: Any) -> str | None:
    """A record's subset as text (it names metrics: `val/<subset>/accuracy`); None when the record has none."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or str(value) == "":
        return None
    name = str(value)
    if "/" in name or ":" in name:
        raise ValueError(f"subset {name!r}: a subset name may not contain '/' or ':' (it names metrics)")
    return name


@dataclass
class SpiderData:
    """Train, validation and test tasks from a directory in Spider's layout; generated there first when `generate` is
    set."""

    task_kind: ClassVar[str] = "text_to_sql"

    # The keys conf/data/spider.yaml (the real Spider) and spider_mini.yaml (generated) set differently have no
    # default: each option decides them.
    name: str
    spider_dir: str | None
    val_split: str | None  # None: validation is carved from train (`val_from_train`)
    test_split: str | None  # None: no test split
    val_from_train: float | None = number(gt=0, lt=1)  # share of train carved out for validation
    val_limit: int | None = number(gt=0)  # validate on the first N tasks (None: all)
    generate: dict[str, int] | None  # data/spider_mini.py's generate() arguments; None: real data in spider_dir
    val_subset_field: str | None  # a field of the validation records: accuracy is also reported per value
    train_split: str = "train"
    split_seed: int = number(0, ge=0)  # the seed of every split of the tasks (validation from train, phases)

    def __post_init__(self) -> None:
        if (self.val_split is None) == (self.val_from_train is None):
            raise ConfigError(
                "data.val_split and data.val_from_train: set exactly one (a split's file, or a share of train)"
            )
        if not self.spider_dir:
            raise ValueError("data.spider_dir is not set (set it, or VERL_SPIDER_DATA_DIR, to Spider's directory)")
        if self.generate is None and not Path(self.spider_dir).is_dir():
            raise FileNotFoundError(f"data.spider_dir={self.spider_dir} does not exist")

    def prepare(self) -> Path:
        """Make sure the data is on disk (generating the bundled set once) and return its directory."""
        if self.generate is not None:
            spider_mini.generate(self.spider_dir, **self.generate)
        return Path(self.spider_dir)

    def metric(self) -> ExecMatch:
        """Spider's validation metric: execution accuracy."""
        return ExecMatch()

    def _carved(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(train, val): train's file, less the share carved out for validation when `val_from_train` is set."""
        tasks = load_split(self.prepare(), self.train_split, self.val_subset_field)
        if self.val_from_train is None:
            return tasks, []
        val, train = stratified_split(tasks, self.val_from_train, self.split_seed, "val")
        return train, val

    def train_tasks(self) -> list[dict[str, Any]]:
        return self._carved()[0]

    def missing_files(self, splits: Iterable[str]) -> list[str]:
        """What the phases `splits` (train, val, test) need that `spider_dir` lacks, one line each naming the key to
        set; nothing for a generated set (written on first use). The preflight asks it before anything loads."""
        if self.generate is not None:
            return []
        root, key = Path(self.spider_dir or ""), f"data.spider_dir={self.spider_dir}"
        wanted = list(splits)
        files = {"train": self.train_split, "val": self.val_split, "test": self.test_split}
        if "val" in wanted and self.val_split is None:  # carved from train
            wanted = ["train", *wanted]
        problems = []
        if "train" in wanted and split_path(root, self.train_split) is None:
            problems.append(self._no_train() if wanted == ["train", "val"] else self._no_split("train", key))
        for split in dict.fromkeys(s for s in wanted if s != "train"):
            if files.get(split) is not None and split_path(root, str(files[split])) is None:
                problems.append(self._no_split(split, key))
        if not (root / "database").is_dir():
            problems.append(f"{key} holds no database/ folder (Spider's database/<db_id>/<db_id>.sqlite)")
        return problems

    def _no_split(self, split: str, key: str) -> str:
        name = {"train": self.train_split, "val": self.val_split, "test": self.test_split}[split]
        return f"{key} holds no {split} split: data.{split}_split={name} looks for {split_names(str(name))}"

    def _no_train(self) -> str:
        """Validation asked of a folder without train's file: Spider's validation is carved from train, and its dev
        set is the test split here."""
        message = (
            f"data.spider_dir={self.spider_dir} holds no train split ({split_names(self.train_split)}), and "
            f"validation is carved from train (data.val_from_train={self.val_from_train})"
        )
        test_file = split_path(self.spider_dir or "", self.test_split) if self.test_split else None
        if test_file is not None:
            message += (
                f"; Spider's dev set ({test_file.name}) is the test split here (data.test_split={self.test_split}): "
                "job.split=test evaluates it"
            )
        return message

    def val_tasks(self) -> list[dict[str, Any]]:
        if self.val_split is None:
            if split_path(self.prepare(), self.train_split) is None:
                raise FileNotFoundError(self._no_train())
            tasks = self._carved()[1]
        else:
            tasks = self._checked(load_split(self.prepare(), self.val_split, self.val_subset_field), self.val_split)
        return tasks[: self.val_limit] if self.val_limit else tasks

    def test_tasks(self) -> list[dict[str, Any]]:
        if self.test_split is None:
            return []
        return self._checked(load_split(self.prepare(), self.test_split, self.val_subset_field), self.test_split)

    def _checked(self, tasks: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
        if self.val_subset_field is not None and not any(SUBSET in t for t in tasks):
            raise ConfigError(f"data.val_subset_field={self.val_subset_field}: no {split} record has it")
        return tasks

"""Spider in its own layout, for the real dataset and the bundled generated one alike (`conf/data/spider*.yaml`).

    <spider_dir>/train_spider.json | train_spider.parquet     list of {question, db_id, query, ...}
    <spider_dir>/dev.json | test_dev_500.parquet | dev.parquet
    <spider_dir>/database/<db_id>/<db_id>.sqlite (+ schema.sql)

The parquet names are the ones agent-lightning's Spider bundle uses (`VERL_SPIDER_DATA_DIR`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from agent.rollout import SUBSET
from data import spider_mini
from foundation.errors import ConfigError
from foundation.schema import number
from rewards.exec_match import ExecMatch

SPLIT_FILES = {
    "train": ("train_spider.json", "train_spider.parquet"),
    "dev": ("dev.json", "test_dev_500.parquet", "test_dev.parquet", "dev.parquet"),
}


def load_split(spider_dir: str | Path, split: str, subset_field: str | None = None) -> list[dict[str, Any]]:
    """Tasks of one split: `id`, `question`, `db_id`, `query` (gold) and `db_path`; and `subset`, the record's
    `subset_field` as text, where it has one (validation reports accuracy per subset).

    `split` is `train`, `dev`, or a file name inside `spider_dir`.
    """
    root = Path(spider_dir)
    candidates = [root / name for name in SPLIT_FILES.get(split, (split,))]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no {split} split in {root}: looked for {', '.join(p.name for p in candidates)}")
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
    """Train and validation tasks from a directory in Spider's layout; generated there first when `generate` is set."""

    task_kind: ClassVar[str] = "text_to_sql"

    name: str
    spider_dir: str | None
    train_split: str = "train"
    val_split: str = "dev"
    val_limit: int | None = number(None, gt=0)  # validate on the first N tasks (None: all)
    generate: dict[str, int] | None = None
    val_subset_field: str | None = None  # a field of the validation records: accuracy is also reported per value

    def __post_init__(self) -> None:
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

    def train_tasks(self) -> list[dict[str, Any]]:
        return load_split(self.prepare(), self.train_split)

    def val_tasks(self) -> list[dict[str, Any]]:
        tasks = load_split(self.prepare(), self.val_split, self.val_subset_field)
        if self.val_subset_field is not None and not any(SUBSET in t for t in tasks):
            raise ConfigError(f"data.val_subset_field={self.val_subset_field}: no {self.val_split} record has it")
        return tasks[: self.val_limit] if self.val_limit else tasks

"""Preference pairs in the DPO format (`prompt`, `chosen`, `rejected`, one JSON object per line), for reward-model
training and DPO.

    python -m data.preferences convert RAW.jsonl OUT.jsonl      # validate and convert raw records
    python -m data.preferences spider SPIDER_DIR OUT.jsonl      # pairs that prefer correct SQL (gold vs wrong)

Raw records may name the prompt `prompt` or `question` and the answers `chosen`/`rejected` or
`response_chosen`/`response_rejected`; every record is checked and all problems are reported together.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agent.sql_tool import run_query
from data.spider import load_split

_ALIASES = {
    "prompt": ("prompt", "question"),
    "chosen": ("chosen", "response_chosen"),
    "rejected": ("rejected", "response_rejected"),
}


class PreferenceError(ValueError):
    """Some records are not valid preference pairs; the message lists them."""


def to_pair(record: Any) -> dict[str, str]:
    """One raw record as {prompt, chosen, rejected}; raises ValueError saying what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object: {type(record).__name__}")
    pair = {}
    for key, names in _ALIASES.items():
        value = next((record[n] for n in names if n in record), None)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"'{key}' (or {', '.join(repr(n) for n in names[1:])}) must be a non-empty string")
        pair[key] = value
    if pair["chosen"].strip() == pair["rejected"].strip():
        raise ValueError("'chosen' and 'rejected' are the same")
    return pair


def convert(records: Iterable[Any]) -> list[dict[str, str]]:
    """Validate every record; raise one PreferenceError listing each bad record (1-based), else return the pairs."""
    pairs, problems = [], []
    for number, record in enumerate(records, start=1):
        try:
            pairs.append(to_pair(record))
        except ValueError as exc:
            problems.append(f"record {number}: {exc}")
    if problems:
        shown = "\n".join(problems[:20]) + (f"\n... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise PreferenceError(f"{len(problems)} invalid preference records:\n{shown}")
    return pairs


def read_jsonl(path: Path) -> list[Any]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise PreferenceError(f"{path}:{number}: not JSON: {exc}") from exc
    return records


def write_jsonl(pairs: list[dict[str, str]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs), encoding="utf-8")
    return path


def sql_pairs(spider_dir: str | Path, split: str = "train", *, seed: int = 0, limit: int | None = None) -> list[dict]:
    """Pairs that prefer the gold SQL to another query of the same database that returns something else."""
    rng = random.Random(seed)
    tasks = load_split(spider_dir, split)
    by_db: dict[str, list[dict]] = {}
    for task in tasks:
        by_db.setdefault(task["db_id"], []).append(task)
    pairs = []
    for task in tasks:
        gold_rows = run_query(task["db_path"], task["query"]).rows
        others = [t["query"] for t in by_db[task["db_id"]] if t["query"] != task["query"]]
        rng.shuffle(others)
        wrong = next((q for q in others if run_query(task["db_path"], q).rows != gold_rows), None)
        if wrong is not None:
            pairs.append({"prompt": task["question"], "chosen": task["query"], "rejected": wrong})
        if limit is not None and len(pairs) >= limit:
            break
    return convert(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert")
    conv.add_argument("raw", type=Path)
    conv.add_argument("out", type=Path)
    spider = sub.add_parser("spider")
    spider.add_argument("spider_dir", type=Path)
    spider.add_argument("out", type=Path)
    spider.add_argument("--split", default="train")
    args = parser.parse_args()
    pairs = convert(read_jsonl(args.raw)) if args.command == "convert" else sql_pairs(args.spider_dir, args.split)
    print(f"{len(pairs)} pairs -> {write_jsonl(pairs, args.out)}")


if __name__ == "__main__":
    main()

"""job=eval: the agent over the validation or the test split (`job.split`) against any OpenAI-compatible endpoint.

Writes `eval/summary.json` (accuracy, n, errors, mean_turns, wall_s; and the same per subset of the split where its
tasks have one, `data.val_subset_field`), `eval/records.jsonl` (one line per task) and `scores/<split>_eval.json`
(each question's score).
A rollout that fails is recorded with its error and reward 0; the others go on.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig

from agent.rollout import EvalSummary, evaluate, item_scores
from foundation.errors import ConfigError
from foundation.run_dir import RunDir
from foundation.schema import one_of
from jobs.config import build_components


@dataclass
class EvalJob:
    """conf/job/eval.yaml's keys."""

    name: str = "eval"
    split: str = one_of("val", ("val", "test"))  # val: for tuning; test: the verdict (data's test split)


def run(cfg: DictConfig, run_dir: RunDir) -> dict[str, Any]:
    parts = build_components(cfg)
    endpoint, data = parts["endpoint"], parts["data"]
    model = endpoint.check_reachable()  # before any task starts
    tasks = data.test_tasks() if cfg.job.split == "test" else data.val_tasks()
    if not tasks:
        raise ConfigError(f"job.split={cfg.job.split}: data={data.name} has no {cfg.job.split} tasks")
    tasks = tasks[: endpoint.limit] if endpoint.limit else tasks
    chats = [endpoint.chat(model) for _ in tasks]
    summary, rollouts = asyncio.run(
        evaluate(parts["agent"], tasks, lambda i: chats[i], data.metric(), concurrency=endpoint.concurrency)
    )
    subsets = EvalSummary.per_subset(rollouts)
    scores = asdict(summary) | ({"subsets": subsets} if subsets else {})
    out = run_dir.path / "eval"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(scores, indent=2), encoding="utf-8")
    with (out / "records.jsonl").open("w", encoding="utf-8") as f:
        for rollout in rollouts:
            f.write(json.dumps(rollout.record(), ensure_ascii=False) + "\n")
    run_dir.write_scores(f"{cfg.job.split}_eval", item_scores(rollouts))
    return {"eval": scores, "split": cfg.job.split, "endpoint": {"base_url": endpoint.base_url, "model": model}}

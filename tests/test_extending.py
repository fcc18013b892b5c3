"""README's worked examples, run as they stand: the reward, agent and data set files a newcomer copies out of
README.md compose, build and work with the rest (the agent answers a Spider task, scored by exec-match; the data set
feeds the Spider agent)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.trajectory import Trajectory
from jobs.config import build_components
from tests.conftest import ROOT
from tests.test_config import compose_with


def readme_files() -> dict[str, str]:
    """Each code block of README.md whose first line is a comment naming a file (`# rewards/short_sql.py`)."""
    blocks = re.findall(r"```(?:python|yaml)\n# (\S+)\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    return dict(blocks)


@pytest.fixture
def examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """README's files where it says they go: each module in a second directory of its package (the project's own
    modules stay importable), each YAML in a config directory on Hydra's search path (returned)."""
    files = readme_files()
    wanted = {"rewards/short_sql.py", "agent/one_shot_sql.py", "data/jsonl_sql.py"}
    assert wanted | {f"conf/{p.replace('.py', '.yaml').replace('rewards/', 'reward/')}" for p in wanted} <= files.keys()
    for path, body in files.items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)
        if path.endswith(".py"):
            package, module = path.removesuffix(".py").split("/")
            monkeypatch.setattr(sys.modules[package], "__path__", [*sys.modules[package].__path__, str(target.parent)])
            monkeypatch.delitem(sys.modules, f"{package}.{module}", raising=False)
    return tmp_path / "conf"


def with_examples(conf: Path, *overrides: str) -> dict[str, Any]:
    return build_components(compose_with(*overrides, f"hydra.searchpath=[file://{conf}]"))


def test_the_reward_example_scores_short_sql(examples: Path) -> None:
    reward = with_examples(examples, "reward=short_sql")["reward"]
    assert reward.name == "short_sql" and reward.max_chars == 200
    assert reward({}, Trajectory(final_sql="SELECT name FROM people")) == 1.0
    assert reward({}, Trajectory(final_sql="SELECT " + "x, " * 100 + "y FROM t")) == 0.0
    assert reward({}, Trajectory()) == 0.0  # no SQL


class Replies:
    """An endpoint that answers with the task's gold SQL, keeping what it was asked."""

    def __init__(self, answer: str) -> None:
        self.answer, self.asked = answer, []

    async def chat(self, messages: list[dict[str, Any]]) -> str:
        self.asked.append(messages)
        return self.answer


def test_the_agent_example_answers_a_spider_task_that_exec_match_scores(examples: Path, spider_mini_dir: Path) -> None:
    parts = with_examples(examples, "agent=one_shot_sql", f"data.spider_dir={spider_mini_dir}")
    agent, task = parts["agent"], parts["data"].val_tasks()[0]
    llm = Replies(task["query"])
    trajectory = asyncio.run(agent.run(task, llm))
    assert trajectory.final_sql == task["query"] and trajectory.turns == 1
    (asked,) = llm.asked
    assert task["question"] in asked[0]["content"] and "CREATE TABLE" in asked[0]["content"]  # the schema is shown
    assert parts["reward"](task, trajectory) == 1.0  # exec_match, with the agent's sql_timeout_s


def test_the_data_set_example_feeds_the_spider_agent(examples: Path, spider_mini_dir: Path, tmp_path: Path) -> None:
    tasks = json.loads((spider_mini_dir / "dev.json").read_text())
    rows = [{"question": t["question"], "query": t["query"], "db_id": t["db_id"]} for t in tasks]
    for row in rows:
        row["db_path"] = str(spider_mini_dir / "database" / row["db_id"] / f"{row['db_id']}.sqlite")
    for name, part in (("train", rows[:6]), ("dev", rows[6:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    files = [f"data.train_file={tmp_path / 'train.jsonl'}", f"data.val_file={tmp_path / 'dev.jsonl'}"]
    parts = with_examples(examples, "data=jsonl_sql", "agent=spider_sql", *files)  # composes: the kinds agree
    data = parts["data"]
    assert len(data.train_tasks()) == 6 and len(data.val_tasks()) == len(rows) - 6 and data.test_tasks() == []
    first = data.train_tasks()[0]
    assert first["id"] == "train-0" and first["kind"] == rows[0]["db_id"]
    assert data.metric()(first, Trajectory(final_sql=first["query"])) == 1.0

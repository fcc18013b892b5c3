"""Every agent, unchanged, against a scripted OpenAI-compatible server on loopback: correct at once, a wrong attempt
then a correction, the turn limit reached, malformed output. Scored with its data set's own metric."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from agent.llm import OpenAIChat
from agent.med_sql import TOOL_NAME
from agent.scripted import Reply, call, say, scripted_app, turn
from agent.spider_sql import INCORRECT
from jobs.config import build_components
from tests.conftest import ROOT, serve


def parts_for(agent: str, data_dir: Path) -> dict[str, Any]:
    key = {"spider_sql": "data.spider_dir", "med_sql": "data.data_dir", "dbbench": "data.data_dir"}[agent]
    extra = ["data.val_size=8", "data.test_size=4"] if agent == "dbbench" else []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"agent={agent}", f"{key}={data_dir}", "data.generate=null", *extra])
    return build_components(cfg)


# Per agent: a reply that never ends the rollout, and one that is malformed.
ENDLESS = {
    "spider_sql": lambda i: say(INCORRECT) if i % 2 else say("```sql\nSELECT 1\n```"),
    "med_sql": lambda i: call(TOOL_NAME, sql="SELECT 1"),
    "dbbench": lambda i: say("Action: Operation\n```sql\nSELECT 1\n```"),
}
MALFORMED = {
    "spider_sql": [say("I am not sure."), say(INCORRECT)],  # no SQL: the agent says so, the check fails, rewrite
    "med_sql": [Reply(tool=TOOL_NAME, arguments='{"sql": ')],  # broken JSON: comes back as tool text
    "dbbench": [say("SELECT * FROM it")],  # neither form: the agent asks again
}


@pytest.fixture(params=["spider_sql", "med_sql", "dbbench"])
def case(request: pytest.FixtureRequest, spider_mini_dir: Path, med_qa_dir: Path, dbbench_dir: Path) -> Any:
    agent = request.param
    data_dir = {"spider_sql": spider_mini_dir, "med_sql": med_qa_dir, "dbbench": dbbench_dir}[agent]
    parts = parts_for(agent, data_dir)
    # DB-bench: a question (its wrong-then-corrected script needs one; a wrong write cannot be undone)
    task = next(t for t in parts["data"].val_tasks() if "answer_info" not in t or t["answer_info"]["direct"])
    return agent, parts, task


def play(parts: dict[str, Any], task: dict[str, Any], replies: list[Reply] | Any) -> tuple[Any, float, int]:
    def script(messages: list[dict[str, Any]]) -> Reply:
        return replies(turn(messages)) if callable(replies) else replies[turn(messages)]

    app = scripted_app(script)
    with serve(app) as url:
        trajectory = asyncio.run(parts["agent"].run(task, OpenAIChat.connect(url, "scripted")))
    return trajectory, parts["data"].metric()(task, trajectory), len(app.state.requests)


def test_correct_at_once(case: Any) -> None:
    _, parts, task = case
    trajectory, score, calls = play(parts, task, parts["agent"].oracle(task))
    assert score == 1.0 and trajectory.error is None and calls == len(parts["agent"].oracle(task))


def test_wrong_then_corrected(case: Any) -> None:
    _, parts, task = case
    wrong = f"SELECT * FROM {task['db_id']} LIMIT 1" if "table_info" in task else "SELECT 1"
    script = parts["agent"].oracle(task, wrong)
    assert len(script) > len(parts["agent"].oracle(task))  # the oracle did put a wrong attempt first
    trajectory, score, _ = play(parts, task, script)
    assert score == 1.0 and trajectory.executions >= 2


def test_the_turn_limit_ends_the_rollout(case: Any) -> None:
    agent, parts, task = case
    trajectory, score, calls = play(parts, task, ENDLESS[agent])
    assert score == 0.0 and trajectory.answer is None
    limit = parts["agent"].max_turns
    assert calls == (2 * limit if agent == "spider_sql" else limit)  # spider: a write and a check per turn


def test_malformed_output_then_correct(case: Any) -> None:
    agent, parts, task = case
    trajectory, score, _ = play(parts, task, [*MALFORMED[agent], *parts["agent"].oracle(task)])
    assert score == 1.0 and trajectory.error is None

"""The medical QA agent (OpenAI Agents SDK) and its data, driven by a scripted server with tool calls."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from agent.llm import OpenAIChat, ScriptedChat
from agent.med_sql import TOOL_NAME, MedSQLAgent
from agent.rollout import evaluate
from agent.scripted import Reply, Script, call, first_user_text, last_tool_output, say, scripted_app, turn
from data import med_qa
from rewards.answer_match import AnswerMatch
from tests.conftest import ROOT, run_eval, serve


@pytest.fixture
def agent() -> MedSQLAgent:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["agent=med_sql"])
    return instantiate(cfg.agent)


def db_hash(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_with(agent: MedSQLAgent, tasks: list[dict[str, Any]], script: Script) -> list[Any]:
    """Evaluate `agent` on `tasks` against a loopback server answering with `script`."""
    with serve(scripted_app(script)) as url:
        summary, rollouts = asyncio.run(
            evaluate(agent, tasks, lambda _: OpenAIChat.connect(url, "scripted"), AnswerMatch(), concurrency=4)
        )
    return [summary, rollouts]


def gold_script(by_question: dict[str, str]) -> Script:
    """Query with the gold SQL, then answer with what the tool returned."""

    def script(messages: list[dict[str, Any]]) -> Reply:
        if turn(messages) == 0:
            return call(TOOL_NAME, sql=by_question[first_user_text(messages)])
        return say(f"According to the database: {last_tool_output(messages)}")

    return script


# ---- data ------------------------------------------------------------------------------------------------------------
def test_generated_set_has_both_languages_and_answers_from_the_database(med_qa_dir: Path) -> None:
    frame = pd.read_parquet(med_qa_dir / "train.parquet")
    assert {"id", "question", "answer", "query"} <= set(frame.columns)
    assert set(frame["lang"]) == {"zh", "en"}
    conn = sqlite3.connect(med_qa_dir / "medical.sqlite")
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == {"drugs_info", "disease"}
    for task in med_qa.load_split(med_qa_dir, "val"):
        values = [str(v) for row in conn.execute(task["query"]).fetchall() for v in row]
        assert task["answer"] == "、".join(values)
    train = set(frame["question"])
    val = set(pd.read_parquet(med_qa_dir / "val.parquet")["question"])
    assert not train & val


def test_answer_match_counts_the_gold_items() -> None:
    from agent.trajectory import Trajectory

    task = {"answer": "恶心、头痛", "answer_items": ["恶心", "头痛"]}
    assert AnswerMatch()(task, Trajectory(answer="可能出现恶心和头痛。")) == 1.0
    assert AnswerMatch()(task, Trajectory(answer="可能出现恶心。")) == 0.5
    assert AnswerMatch(all_or_nothing=True)(task, Trajectory(answer="可能出现恶心。")) == 0.0
    assert AnswerMatch()(task, Trajectory(answer=None)) == 0.0
    assert AnswerMatch()({"answer": "Ibuprofen"}, Trajectory(answer="IBUPROFEN, twice a day")) == 1.0


# ---- the agent's branches -------------------------------------------------------------------------------------------
def test_correct_at_once(agent: MedSQLAgent, med_qa_dir: Path) -> None:
    tasks = med_qa.load_split(med_qa_dir, "val")
    before = db_hash(tasks[0]["db_path"])
    summary, rollouts = run_with(agent, tasks, gold_script({t["question"]: t["query"] for t in tasks}))
    assert summary.accuracy == 1.0 and summary.errors == 0
    for rollout in rollouts:
        assert rollout.trajectory.turns == 2 and rollout.trajectory.executions == 1
        assert rollout.trajectory.final_sql == rollout.task["query"]
        roles = [m["role"] for m in rollout.trajectory.messages]
        assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert db_hash(tasks[0]["db_path"]) == before


def test_tool_error_then_correct(agent: MedSQLAgent, med_qa_dir: Path) -> None:
    task = med_qa.load_split(med_qa_dir, "val")[0]
    seen_errors: list[str] = []

    def script(messages: list[dict[str, Any]]) -> Reply:
        if turn(messages) == 0:
            return call(TOOL_NAME, sql="DROP TABLE drugs_info")
        if turn(messages) == 1:
            seen_errors.append(last_tool_output(messages))
            return call(TOOL_NAME, sql=task["query"])
        return say(last_tool_output(messages))

    before = db_hash(task["db_path"])
    _, [rollout] = run_with(agent, [task], script)
    assert seen_errors[0].startswith("Error:")
    assert rollout.reward == 1.0 and rollout.trajectory.execution_errors == 1 and rollout.trajectory.turns == 3
    assert db_hash(task["db_path"]) == before


def test_max_turns_reached(agent: MedSQLAgent, med_qa_dir: Path) -> None:
    task = med_qa.load_split(med_qa_dir, "val")[0]
    _, [rollout] = run_with(agent, [task], lambda _: call(TOOL_NAME, sql="SELECT 1"))
    assert rollout.reward == 0.0 and "MaxTurnsExceeded" in rollout.error
    assert rollout.trajectory.turns == agent.max_turns == 4
    assert rollout.trajectory.executions == agent.max_turns
    assert [m["role"] for m in rollout.trajectory.messages].count("tool") == agent.max_turns


def test_malformed_tool_arguments_come_back_as_tool_text(agent: MedSQLAgent, med_qa_dir: Path) -> None:
    task = med_qa.load_split(med_qa_dir, "val")[0]

    def script(messages: list[dict[str, Any]]) -> Reply:
        if turn(messages) == 0:
            return Reply(tool=TOOL_NAME, arguments='{"sql": "SELECT')  # broken JSON
        if turn(messages) == 1:
            assert "Invalid JSON" in last_tool_output(messages) or "error" in last_tool_output(messages).lower()
            return call(TOOL_NAME, sql=task["query"])
        return say(last_tool_output(messages))

    _, [rollout] = run_with(agent, [task], script)
    assert rollout.error is None and rollout.reward == 1.0


def test_a_call_to_an_unknown_tool_ends_the_rollout_with_its_error(agent: MedSQLAgent, med_qa_dir: Path) -> None:
    tasks = med_qa.load_split(med_qa_dir, "val")[:3]
    bad = tasks[1]["question"]
    gold = gold_script({t["question"]: t["query"] for t in tasks})

    def script(messages: list[dict[str, Any]]) -> Reply:
        return call("drop_everything") if first_user_text(messages) == bad else gold(messages)

    summary, rollouts = run_with(agent, tasks, script)
    assert summary.errors == 1 and summary.accuracy == pytest.approx(2 / 3)
    assert "drop_everything" in rollouts[1].error and rollouts[1].reward == 0.0


def test_it_needs_an_endpoint(agent: MedSQLAgent, med_qa_dir: Path) -> None:
    task = med_qa.load_split(med_qa_dir, "val")[0]
    with pytest.raises(TypeError, match="OpenAI-compatible"):
        asyncio.run(agent.run(task, ScriptedChat(["hi"])))


# ---- job=eval --------------------------------------------------------------------------------------------------------
@pytest.fixture
def gold_server(med_qa_dir: Path) -> Iterator[str]:
    tasks = med_qa.load_split(med_qa_dir, "val")
    with serve(scripted_app(gold_script({t["question"]: t["query"] for t in tasks}))) as url:
        yield url


def wrong_script(messages: list[dict[str, Any]]) -> Reply:
    if turn(messages) == 0:
        return call(TOOL_NAME, sql="SELECT name FROM disease WHERE disease_id = -1")
    return say(last_tool_output(messages))


@pytest.mark.integration
@pytest.mark.parametrize("answers", ["gold", "wrong"])
def test_eval_accuracy_follows_the_answers(answers: str, med_qa_dir: Path, cache_dir: Path, tmp_path: Path) -> None:
    tasks = med_qa.load_split(med_qa_dir, "val")
    script = gold_script({t["question"]: t["query"] for t in tasks}) if answers == "gold" else wrong_script
    args = ["agent=med_sql", "data.generate.n_train=40", "data.generate.n_val=10", "data.generate.n_test=10"]
    summary, run_dir = run_eval(scripted_app(script), args, cache_dir, tmp_path)
    assert summary["n"] == 10 and summary["errors"] == 0
    assert summary["accuracy"] == (1.0 if answers == "gold" else 0.0)
    record = json.loads((run_dir / "eval" / "records.jsonl").read_text().splitlines()[0])
    assert record["answer"] and record["final_sql"]

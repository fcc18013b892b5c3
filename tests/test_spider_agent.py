"""The Spider SQL agent's graph, driven by scripted models."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from agent.llm import ScriptedChat
from agent.spider_sql import SpiderSQLAgent, check_says_correct, extract_sql
from data.spider import load_split
from tests.conftest import ROOT


def agent_from_config(*overrides: str) -> SpiderSQLAgent:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return instantiate(cfg.agent)


@pytest.fixture
def task(spider_mini_dir: Path) -> dict:
    return load_split(spider_mini_dir, "train")[0]


def test_extract_sql_takes_the_last_fenced_block() -> None:
    text = "First:\n```sql\nSELECT 1\n```\nBetter:\n```sql\nSELECT 2\n```"
    assert extract_sql(text) == "SELECT 2"
    assert extract_sql("```\nSELECT 3\n```") == "SELECT 3"
    assert extract_sql("no code here") is None


def test_the_last_verdict_wins() -> None:
    assert check_says_correct("THE QUERY IS INCORRECT ... on reflection THE QUERY IS CORRECT")
    assert not check_says_correct("THE QUERY IS CORRECT? No: THE QUERY IS INCORRECT")
    assert not check_says_correct("looks fine")


def test_correct_check_ends_after_one_turn(task: dict) -> None:
    agent = agent_from_config("agent.check_step=true")
    chat = ScriptedChat([f"```sql\n{task['query']}\n```", "THE QUERY IS CORRECT"])
    trajectory = asyncio.run(agent.run(task, chat))
    assert trajectory.error is None and trajectory.turns == 1 and trajectory.final_sql == task["query"]
    assert trajectory.verdicts == [True]
    assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert "The query returned:" in trajectory.messages[3]["content"]


def test_incorrect_check_rewrites_until_max_turns(task: dict) -> None:
    agent = agent_from_config("agent.check_step=true", "agent.max_turns=2")
    replies = ["```sql\nSELECT nope\n```", "THE QUERY IS INCORRECT", "```sql\nSELECT 2\n```", "THE QUERY IS INCORRECT"]
    chat = ScriptedChat(replies)
    trajectory = asyncio.run(agent.run(task, chat))
    assert trajectory.turns == 2 and trajectory.final_sql == "SELECT 2" and trajectory.verdicts == [False, False]
    assert trajectory.executions == 2 and trajectory.execution_errors == 1
    assert "Error:" in chat.seen[1][-1]["content"]  # the failed query's error reached the model as tool text


def test_without_check_step_one_call_is_made(task: dict) -> None:
    agent = agent_from_config("agent.check_step=false")
    chat = ScriptedChat([f"```sql\n{task['query']}\n```"])
    trajectory = asyncio.run(agent.run(task, chat))
    assert len(chat.seen) == 1 and trajectory.turns == 1 and trajectory.last_execution_ok


def test_a_failing_model_is_recorded_not_raised(task: dict) -> None:
    trajectory = asyncio.run(agent_from_config().run(task, ScriptedChat([])))
    assert trajectory.error is not None and "ran out of replies" in trajectory.error

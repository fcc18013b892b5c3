"""DB-bench: the generator's format, the reward, and the agent's branches on its own in-memory table copy."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from agent.dbbench import DBBenchAgent, parse_action, scratch_for
from agent.llm import ScriptedChat
from agent.rollout import evaluate
from agent.scripted import Reply, say, scripted_app, turn
from agent.trajectory import Trajectory
from data import dbbench
from rewards.dbbench_match import DBBenchMatch, parse_rows
from tests.conftest import ROOT, run_eval


@pytest.fixture
def tasks(dbbench_dir: Path) -> list[dict[str, Any]]:
    return dbbench.load_entries(dbbench_dir)


@pytest.fixture
def agent() -> DBBenchAgent:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["agent=dbbench"])
    return instantiate(cfg.agent)


def operation(sql: str) -> str:
    return f"I will run it.\nAction: Operation\n```sql\n{sql}\n```"


def answer(task: dict[str, Any]) -> str:
    direct = task["answer_info"]["direct"]
    return "Action: Answer\nFinal Answer: " + (repr([tuple(r) for r in direct]) if direct is not None else "done")


def by_kind(tasks: list[dict[str, Any]], write: bool) -> dict[str, Any]:
    return next(t for t in tasks if (t["answer_info"]["md5"] is not None) == write)


def run(agent: DBBenchAgent, task: dict[str, Any], replies: list[str]) -> tuple[Trajectory, float]:
    trajectory = asyncio.run(agent.run(task, ScriptedChat(replies)))
    return trajectory, DBBenchMatch()(task, trajectory)


# ---- data ----------------------------------------------------------------------------------------------------------
def test_entries_have_lifelong_agent_bench_fields(dbbench_dir: Path) -> None:
    entries = json.loads((dbbench_dir / "entry_dict.json").read_text())
    assert len(entries) == 28
    skills = set()
    for entry in entries.values():
        assert set(entry) == {"instruction", "table_info", "answer_info", "skill_list"}
        assert set(entry["table_info"]) == {"name", "row_list", "column_info_list"}
        info = entry["answer_info"]
        is_select = info["sql"].startswith("SELECT")
        assert (info["direct"] is not None) == is_select and (info["md5"] is not None) == (not is_select)
        skills.update(entry["skill_list"])
    assert {"select", "insert", "update", "delete", "group_by_single_column"} <= skills


def test_md5_is_the_table_after_the_gold_sql(tasks: list[dict[str, Any]]) -> None:
    for task in (t for t in tasks if t["answer_info"]["md5"]):
        db = scratch_for(task)
        assert db.run(task["query"]).ok
        assert dbbench.table_md5(db.table_rows(task["db_id"])) == task["answer_info"]["md5"]
        db.close()


def test_a_real_format_entry_loads(tmp_path: Path) -> None:
    entry = {
        "instruction": "How many rows have a score above 50?",
        "table_info": {
            "name": "Scores",
            "row_list": [["a", 40], ["b", 60], ["c", 70]],
            "column_info_list": [{"name": "Name", "type": "TEXT"}, {"name": "Score", "type": "INT"}],
        },
        "answer_info": {"md5": None, "direct": [[2]], "sql": "SELECT COUNT(*) FROM `Scores` WHERE `Score` > 50;"},
        "skill_list": ["select", "where_single_condition"],
    }
    (tmp_path / "entry_dict.json").write_text(json.dumps({"0": entry}))
    [task] = dbbench.load_entries(tmp_path)
    assert task["db_id"] == "Scores" and task["question"] == entry["instruction"]
    assert scratch_for(task).run(task["query"]).rows == [(2,)]


# ---- reward --------------------------------------------------------------------------------------------------------
def test_parse_rows() -> None:
    assert parse_rows("[('a', 1), ('b', 2)]") == [("a", 1), ("b", 2)]
    assert parse_rows("[(3,)]") == [(3,)] and parse_rows("3") == [(3,)] and parse_rows("('x', 2)") == [("x", 2)]
    assert parse_rows("['a', 'b']") == [("a",), ("b",)]
    assert parse_rows("Lyon, 3") == [("Lyon", "3")]
    assert parse_rows("{[1]}") == [("{[1]}",)]  # what a sampling model writes must never raise


def test_odd_answers_score_zero_without_raising(tasks: list[dict[str, Any]]) -> None:
    question = by_kind(tasks, write=False)
    for odd in ["{[1]}", "9" * 400, "[(" * 200, "", "None", "[{'a': [1]}]"]:
        assert DBBenchMatch()(question, Trajectory(answer=odd)) == 0.0


def test_select_answers_compare_as_rows(tasks: list[dict[str, Any]]) -> None:
    unordered = next(t for t in tasks if t["query"].startswith("SELECT") and "ORDER BY" not in t["query"])
    rows = [tuple(r) for r in unordered["answer_info"]["direct"]]
    assert DBBenchMatch()(unordered, Trajectory(answer=repr(rows[::-1]))) == 1.0
    assert DBBenchMatch()(unordered, Trajectory(answer=repr([*rows, ("extra",)]))) == 0.0
    assert DBBenchMatch()(unordered, Trajectory(answer=None)) == 0.0


# ---- the agent -----------------------------------------------------------------------------------------------------
def test_parse_action() -> None:
    assert parse_action(operation("SELECT 1")) == ("sql", "SELECT 1")
    assert parse_action("Action: Answer\nFinal Answer: [(1,)]") == ("answer", "[(1,)]")
    assert parse_action("Action: Operation\nSELECT 1") is None
    assert parse_action("the answer is 3") is None


@pytest.mark.parametrize("write", [False, True])
def test_correct_at_once(agent: DBBenchAgent, tasks: list[dict[str, Any]], write: bool) -> None:
    task = by_kind(tasks, write)
    rows_before = json.dumps(task["table_info"]["row_list"])
    trajectory, reward = run(agent, task, [operation(task["query"]), answer(task)])
    assert reward == 1.0 and trajectory.turns == 2 and trajectory.executions == 1
    assert json.dumps(task["table_info"]["row_list"]) == rows_before  # the task itself is never written


def test_error_then_rewrite(agent: DBBenchAgent, tasks: list[dict[str, Any]]) -> None:
    task = by_kind(tasks, write=True)
    chat = ScriptedChat([operation("UPDATE nowhere SET x = 1"), operation(task["query"]), answer(task)])
    trajectory = asyncio.run(agent.run(task, chat))
    assert chat.seen[1][-1]["content"].startswith("Error:")
    assert trajectory.execution_errors == 1 and DBBenchMatch()(task, trajectory) == 1.0


def test_a_wrong_write_is_judged_on_the_table(agent: DBBenchAgent, tasks: list[dict[str, Any]]) -> None:
    task = by_kind(tasks, write=True)
    _, reward = run(agent, task, [operation(f"DELETE FROM {task['db_id']}"), answer(task)])
    assert reward == 0.0


def test_max_turns_reached(agent: DBBenchAgent, tasks: list[dict[str, Any]]) -> None:
    task = by_kind(tasks, write=False)
    trajectory, reward = run(agent, task, [operation("SELECT 1")] * agent.max_turns)
    assert trajectory.turns == agent.max_turns == 5 and trajectory.answer is None and reward == 0.0


def test_malformed_output_gets_a_reminder(agent: DBBenchAgent, tasks: list[dict[str, Any]]) -> None:
    task = by_kind(tasks, write=False)
    chat = ScriptedChat(["SELECT * FROM it", operation(task["query"]), answer(task)])
    trajectory = asyncio.run(agent.run(task, chat))
    assert chat.seen[1][-1]["content"] == agent.invalid_action_text
    assert DBBenchMatch()(task, trajectory) == 1.0


def test_concurrent_rollouts_write_only_their_own_copy(agent: DBBenchAgent, tasks: list[dict[str, Any]]) -> None:
    task = by_kind(tasks, write=False)
    n_rows = len(task["table_info"]["row_list"])
    count = f"SELECT COUNT(*) FROM {task['db_id']}"
    scripts = [
        ScriptedChat([operation(f"DELETE FROM {task['db_id']}"), operation(count), "Action: Answer\nFinal Answer: x"]),
        ScriptedChat([operation(count), operation(count), "Action: Answer\nFinal Answer: x"]),
    ]

    async def both() -> list[Trajectory]:
        return list(await asyncio.gather(*(agent.run(task, s) for s in scripts)))

    deleter, reader = asyncio.run(both())
    assert deleter.db_state == [] and scripts[0].seen[2][-1]["content"] == "(0,)"
    assert len(reader.db_state) == n_rows and scripts[1].seen[2][-1]["content"] == f"({n_rows},)"


# ---- job=eval ------------------------------------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("answers", ["gold", "wrong"])
def test_eval_accuracy_follows_the_answers(
    answers: str, dbbench_dir: Path, cache_dir: Path, tmp_path: Path, tasks: list[dict[str, Any]]
) -> None:
    def script(messages: list[dict[str, Any]]) -> Reply:  # two tasks may ask the same words of other tables
        prompt = messages[1]["content"]
        task = next(
            t
            for t in tasks
            if prompt.startswith(t["question"]) and json.dumps(t["table_info"], ensure_ascii=False) in prompt
        )
        if answers == "wrong":
            return say(
                operation(f"DELETE FROM {task['db_id']}") if turn(messages) == 0 else "Action: Answer\nFinal Answer: []"
            )
        return say(operation(task["query"]) if turn(messages) == 0 else answer(task))

    args = ["agent=dbbench", "data.generate.n=28", "data.val_size=10", "data.test_size=4"]
    summary, _ = run_eval(scripted_app(script), args, cache_dir, tmp_path)
    assert summary["n"] == 10 and summary["errors"] == 0
    assert summary["accuracy"] == (1.0 if answers == "gold" else 0.0)


def test_evaluate_runs_it_unchanged(agent: DBBenchAgent, tasks: list[dict[str, Any]]) -> None:
    chats = [ScriptedChat([operation(t["query"]), answer(t)]) for t in tasks]
    summary, _ = asyncio.run(evaluate(agent, tasks, lambda i: chats[i], DBBenchMatch()))
    assert summary.accuracy == 1.0 and summary.n == len(tasks)


def test_a_dropped_table_scores_zero_and_is_no_error(agent: DBBenchAgent, tasks: list[dict[str, Any]]) -> None:
    task = by_kind(tasks, write=True)
    trajectory, reward = run(agent, task, [operation(f"DROP TABLE {task['db_id']}"), answer(task)])
    assert trajectory.error is None and trajectory.db_state is None and reward == 0.0

"""Rule, LLM judge and hybrid rewards; the judge against a scripted loopback judge (good, malformed, slow, down)."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from agent.llm import ScriptedChat
from agent.rollout import evaluate
from agent.trajectory import Trajectory
from rewards.hybrid import Hybrid
from rewards.llm_judge import LLMJudge, parse_score
from rewards.rule import ExecutedSQL
from tests.conftest import ROOT, closed_port, serve

TASK = {"question": "What treats a headache?", "answer": "Ibuprofen."}


def judge_app(replies: list[str], hold: threading.Event | None = None) -> tuple[FastAPI, list[dict]]:
    """A judge that answers with `replies` in turn (the last one repeats); with `hold`, only once it is set."""
    app, seen = FastAPI(), []

    @app.post("/v1/chat/completions")
    def complete(body: dict[str, Any]) -> dict[str, Any]:
        seen.append(body)
        if hold is not None:
            hold.wait(60)
        content = replies[min(len(seen), len(replies)) - 1]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        }

    return app, seen


def judge(base_url: str, **kwargs: Any) -> LLMJudge:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["reward=llm_judge", f"reward.base_url={base_url}"])
    return instantiate(cfg.reward, **kwargs)


@pytest.mark.parametrize(
    ("text", "score"),
    [("Fine.\nSCORE: 0.8", 0.8), ("SCORE: 7/10", 0.7), ("**SCORE:** 1", 1.0), ("SCORE: 3", None), ("great", None)],
)
def test_parse_score(text: str, score: float | None) -> None:
    assert parse_score(text) == score


def test_rule_rewards_sql_that_ran() -> None:
    rule = ExecutedSQL(amount=0.1, no_sql_penalty=-1.0)
    assert rule({}, Trajectory(final_sql="SELECT 1", last_execution_ok=True)) == 0.1
    assert rule({}, Trajectory(final_sql="SELEC 1", last_execution_ok=False)) == 0.0
    assert rule({}, Trajectory(final_sql=None)) == -1.0


def test_judge_scores_and_caches_identical_requests() -> None:
    app, seen = judge_app(["Accurate and clear.\nSCORE: 0.9"])
    with serve(app) as url:
        reward = judge(url)
        answer = Trajectory(answer="Ibuprofen or paracetamol.")
        assert reward(TASK, answer) == 0.9 and reward(TASK, answer) == 0.9
    assert len(seen) == 1
    prompt = seen[0]["messages"][0]["content"]
    assert "What treats a headache?" in prompt and "Ibuprofen." in prompt and "accuracy" in prompt


def test_a_malformed_reply_is_asked_again() -> None:
    app, seen = judge_app(["I like it", "SCORE: 12", "SCORE: 0.4"])
    with serve(app) as url:
        assert judge(url, retries=2)(TASK, Trajectory(answer="x")) == 0.4
    assert len(seen) == 3


def test_never_readable_is_missing_not_zero() -> None:
    app, _ = judge_app(["no score here"])
    with serve(app) as url:
        assert judge(url, retries=1)(TASK, Trajectory(answer="x")) is None


def test_a_slow_judge_times_out_to_missing() -> None:
    hold = threading.Event()  # the judge answers only after the reward returned: None can only come from the timeout
    app, _ = judge_app(["SCORE: 1"], hold)
    with serve(app) as url:
        try:
            assert judge(url, timeout_s=0.3, retries=1)(TASK, Trajectory(answer="x")) is None
        finally:
            hold.set()


def test_a_down_judge_is_missing() -> None:
    reward = judge(f"http://127.0.0.1:{closed_port()}/v1", retries=1)
    assert reward(TASK, Trajectory(answer="x")) is None


def test_hybrid_is_rule_plus_judge_and_missing_when_the_judge_is() -> None:
    app, _ = judge_app(["SCORE: 0.5"])
    with serve(app) as url:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=["reward=hybrid", f"reward.terms.judge.base_url={url}"])
        hybrid: Hybrid = instantiate(cfg.reward)
        ran = Trajectory(final_sql="SELECT 1", last_execution_ok=True, answer="Ibuprofen.")
        assert hybrid(TASK, ran) == pytest.approx(0.6)
    down = Hybrid(
        terms={"rule": ExecutedSQL(), "judge": judge(f"http://127.0.0.1:{closed_port()}/v1", retries=0)}, weights={}
    )
    assert down(TASK, ran) is None


def test_hybrid_weights_must_name_terms() -> None:
    with pytest.raises(ValueError, match=r"reward\.weights\.jdge"):
        Hybrid(terms={"rule": ExecutedSQL()}, weights={"jdge": 1.0})


def test_a_missing_reward_stays_missing_through_the_rollout_loop() -> None:
    class OneCallAgent:
        async def run(self, task: dict, llm: Any) -> Trajectory:
            return Trajectory(answer=await llm.chat([{"role": "user", "content": task["question"]}]))

    tasks = [TASK, TASK | {"question": "What treats a fever?"}]
    chats = [ScriptedChat(["Ibuprofen."]), ScriptedChat(["Paracetamol."])]

    def flaky_judge(task: dict, trajectory: Trajectory) -> float | None:
        return None if "fever" in task["question"] else 0.7

    summary, rollouts = asyncio.run(evaluate(OneCallAgent(), tasks, lambda i: chats[i], flaky_judge))
    assert [r.reward for r in rollouts] == [0.7, None] and all(r.error is None for r in rollouts)
    assert [r.failure for r in rollouts] == [None, "reward_error"]  # training excludes it
    assert summary.missing == 1 and summary.accuracy == pytest.approx(0.7)


def test_a_gold_query_that_failed_is_run_again_next_time(tmp_path: Path) -> None:
    """A gold result is cached only when it ran: a transient failure (here, the table is missing at first) does not
    zero the task for the rest of the run."""
    import sqlite3

    from rewards.exec_match import clear_gold_cache, execution_match

    clear_gold_cache()
    db = tmp_path / "db.sqlite"
    sqlite3.connect(db).close()
    before = db.stat()
    with pytest.raises(ValueError, match="gold SQL fails"):
        execution_match("SELECT 1", "SELECT count(*) FROM t", db)
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    os.utime(db, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same cache key: only a retry can see the table
    assert execution_match("SELECT count(*) FROM t", "SELECT count(*) FROM t", db) == 1.0

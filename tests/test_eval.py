"""job=eval against a scripted OpenAI-compatible server on loopback."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, HTTPException

from tests.conftest import FAST_RUN, closed_port, launch, run_eval, serve

FAILING_QUESTION_INDEX = 1  # the server answers this dev question with HTTP 500


def scripted_server(gold: dict[str, str]) -> FastAPI:
    """Answers each question with its gold SQL (or 500 for one of them), like a perfect model behind vLLM."""
    app = FastAPI()
    failing = list(gold)[FAILING_QUESTION_INDEX]

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def complete(body: dict[str, Any]) -> dict[str, Any]:
        question = re.search(r"Question: (.*)", body["messages"][1]["content"]).group(1).strip()
        if question == failing:
            raise HTTPException(status_code=500, detail="scripted failure")
        content = f"```sql\n{gold[question]}\n```"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    return app


@pytest.fixture
def server(spider_mini_dir: Path) -> Iterator[str]:
    dev = json.loads((spider_mini_dir / "dev.json").read_text())
    test = json.loads((spider_mini_dir / "test.json").read_text())
    with serve(scripted_server({r["question"]: r["query"] for r in dev + test})) as url:
        yield url


@pytest.mark.integration
def test_eval_scores_every_task_and_keeps_going_past_a_failure(
    server: str, spider_mini_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = ["job=eval", *FAST_RUN, f"endpoint.base_url={server}", "endpoint.concurrency=3"]
    result = launch([*args, f"hydra.run.dir={run_dir}"], cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "eval" / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "eval" / "records.jsonl").read_text().splitlines()]
    assert summary["n"] == len(records) == 8 and summary["errors"] == 1
    assert summary["accuracy"] == pytest.approx(7 / 8)
    # spider_mini's dev questions say what they hold out: scored per subset too, each record names its subset
    assert sum(s["n"] for s in summary["subsets"].values()) == 8
    assert [r["subset"] for r in records] == [
        t["held_out"] for t in json.loads((spider_mini_dir / "dev.json").read_text())
    ]
    failed = records[FAILING_QUESTION_INDEX]
    assert failed["reward"] == 0.0 and "500" in failed["error"]
    scores = json.loads((run_dir / "scores" / "val_eval.json").read_text())  # each question's score, by its id
    assert scores == {r["id"]: r["reward"] for r in records}
    assert all(r["reward"] == 1.0 for i, r in enumerate(records) if i != FAILING_QUESTION_INDEX)


@pytest.mark.integration
def test_eval_scores_the_test_split_when_asked(
    server: str, spider_mini_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = ["job=eval", "job.split=test", *FAST_RUN, f"endpoint.base_url={server}"]
    result = launch([*args, f"hydra.run.dir={run_dir}"], cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "eval" / "records.jsonl").read_text().splitlines()]
    test = json.loads((spider_mini_dir / "test.json").read_text())
    assert [r["question"] for r in records] == [t["question"] for t in test]
    assert all(r["reward"] == 1.0 for r in records[:1]) and all(r["id"].startswith("test-") for r in records)
    assert json.loads((run_dir / "summary.json").read_text())["split"] == "test"


@pytest.mark.integration
def test_eval_limit(server: str, cache_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["job=eval", *FAST_RUN, f"endpoint.base_url={server}", "endpoint.limit=1"]
    result = launch([*args, f"hydra.run.dir={run_dir}"], cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_dir / "eval" / "summary.json").read_text())["n"] == 1


@pytest.mark.integration
def test_an_unreachable_endpoint_fails_before_any_task(cache_dir: Path, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    result = launch(["job=eval", *FAST_RUN, f"endpoint.base_url={url}"], cache_dir, tmp_path)
    assert result.returncode != 0
    assert f"endpoint.base_url={url} is not reachable" in result.stderr + result.stdout
    assert not list(tmp_path.rglob("records.jsonl"))


@pytest.mark.integration
def test_eval_of_wrong_sql_scores_zero(cache_dir: Path, tmp_path: Path) -> None:
    from agent.scripted import say, scripted_app

    wrong = scripted_app(lambda messages: say("```sql\nSELECT 1 WHERE 0\n```"))  # runs, returns nothing, never right
    summary, _ = run_eval(wrong, FAST_RUN, cache_dir, tmp_path)
    assert summary["n"] == 8 and summary["errors"] == 0 and summary["accuracy"] == 0.0

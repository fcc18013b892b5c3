"""backend=dev: agent-lightning's Trainer.dev against a scripted vLLM-style server on loopback (runs in .venv-verl).

The server answers like vLLM with `return_token_ids` (what agent-lightning's proxy asks for): `prompt_token_ids` at
the top and `token_ids` in the choice, and a unique response id per call (the adapter de-duplicates by id).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from data import med_qa, spider_mini
from tests.conftest import closed_port, launch, serve, wait_for

pytestmark = pytest.mark.verl

N_TASKS = 4
# The agents the issue names: the LangGraph SQL agent and the OpenAI Agents SDK one (tool calls), each on its data.
DATA = {
    "spider_sql": {"n_train": 24, "n_dev": 4},
    "med_sql": {"n_train": 24, "n_val": 4},
}
AGENTS = sorted(DATA)


def vllm_like_server(gold: dict[str, str], requests: list[dict[str, Any]]) -> FastAPI:
    """Answers a question it knows with its gold SQL (and a passing check verdict), anything else with SELECT 1."""
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def complete(body: dict[str, Any]) -> dict[str, Any]:
        requests.append(body)
        text = "\n".join(str(m.get("content") or "") for m in body["messages"])
        message: dict[str, Any]
        if body.get("tools"):  # the medical agent: one tool call with the gold SQL, then the tool's answer
            question = next(str(m["content"]) for m in body["messages"] if m["role"] == "user")
            if not any(m["role"] == "tool" for m in body["messages"]):
                arguments = json.dumps({"sql": gold.get(question, "SELECT 1")}, ensure_ascii=False)
                call = {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function"}
                call["function"] = {"name": "query_database_by_sql", "arguments": arguments}
                message, content = {"role": "assistant", "content": None, "tool_calls": [call]}, arguments
            else:
                content = next(str(m["content"]) for m in reversed(body["messages"]) if m["role"] == "tool")
                message = {"role": "assistant", "content": content}
        else:
            asked = re.findall(r"Question: (.*)", text)
            sql = gold.get(asked[-1].strip(), "SELECT 1") if asked else "SELECT 1"
            content = f"```sql\n{sql}\n```\nTHE QUERY IS CORRECT"
            message = {"role": "assistant", "content": content}
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        response: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [choice],
            "usage": {"prompt_tokens": len(text), "completion_tokens": len(content), "total_tokens": 0},
        }
        if body.get("return_token_ids"):  # vLLM >= 0.10.2
            response["prompt_token_ids"] = [b % 256 for b in text.encode()][:512]
            choice["token_ids"] = list(content.encode())
        return response

    return app


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    spider_mini.generate(tmp_path / "cache" / "spider_mini", seed=0, **DATA["spider_sql"])
    med_qa.generate(tmp_path / "cache" / "med_qa", seed=0, **DATA["med_sql"])
    return tmp_path / "cache"


@pytest.fixture
def server(cache: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    train = json.loads((cache / "spider_mini" / "train_spider.json").read_text())
    gold = {t["question"]: t["query"] for t in train}
    gold |= {t["question"]: t["query"] for t in med_qa.load_split(cache / "med_qa", "train")}
    requests: list[dict[str, Any]] = []
    with serve(vllm_like_server(gold, requests)) as url:
        yield url, requests


@pytest.fixture
def external_store() -> Iterator[str]:
    """agent-lightning's store as its own process (`agl store`), as on a cluster. `agl store` takes a port number, not
    a socket: a port taken between choosing and binding makes the process exit, and another port is tried."""
    env = os.environ | {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    agl = Path(sys.executable).parent / "agl"
    for _attempt in range(3):
        port = closed_port()
        process = subprocess.Popen([agl, "store", "--port", str(port)], env=env, stdout=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            up = partial(started_or_exited, process, url)
            wait_for(up, 120, f"agl store on port {port} to answer")
            if process.poll() is None:
                yield url
                return
        finally:
            process.terminate()
            process.wait(timeout=30)
    raise RuntimeError("agl store exited at start three times (ports taken?)")


def started_or_exited(process: subprocess.Popen[bytes], url: str) -> bool:
    if process.poll() is not None:
        return True
    try:
        return httpx.get(f"{url}/v1/agl/health", timeout=1.0).is_success
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("agent", AGENTS)
def test_dev_rollouts_become_triplets_with_token_ids_and_rewards(
    agent: str, server: tuple[str, list[dict[str, Any]]], cache: Path, tmp_path: Path
) -> None:
    records = run_dev(agent, server, cache, tmp_path)
    if agent == "spider_sql":
        # The server knows every training question's gold SQL, so the check passes: write, check, no rewrite.
        # agent_match "write" trains the write call only (the check call is traced but not a triplet).
        assert all(r["reward"] == 1.0 for r in records)
        assert all(r["span_names"]["write_query"] == r["span_names"]["check_query"] == 1 for r in records)
        assert all(len(r["triplets"]) == 1 for r in records)
    if agent == "med_sql":  # a tool call with the gold SQL, then the tool's rows as the answer: two trained calls
        assert all(r["reward"] == 1.0 and len(r["triplets"]) == 2 for r in records)


def test_dev_with_llm_proxy_tracing(server: tuple[str, list[dict[str, Any]]], cache: Path, tmp_path: Path) -> None:
    """The proxy's spans alone: every call (write and check) becomes a triplet, the reward on the last."""
    tracing = ["backend.tracing=llm_proxy", "backend.agent_match.spider_sql=null"]
    records = run_dev("spider_sql", server, cache, tmp_path, tracing)
    assert all([t["reward"] for t in r["triplets"]] == [None, 1.0] for r in records)


def test_dev_with_an_external_store(
    server: tuple[str, list[dict[str, Any]]], external_store: str, cache: Path, tmp_path: Path
) -> None:
    records = run_dev("spider_sql", server, cache, tmp_path, [f"backend.store_address={external_store}"])
    stored = httpx.get(f"{external_store}/v1/agl/rollouts", timeout=10.0).json()["items"]  # outlived the run
    assert sorted(r["rollout_id"] for r in stored) == sorted(r["rollout_id"] for r in records)


def run_dev(
    agent: str, server: tuple[str, list[dict[str, Any]]], cache: Path, tmp_path: Path, extra: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Run backend=dev as a user would; check every rollout completed and became triplets; return the records."""
    url, requests = server
    run_dir = tmp_path / "run"
    args = [
        *extra,
        "backend=dev",
        f"agent={agent}",
        "model=qwen2.5-coder-1.5b-instruct",
        f"backend.n_tasks={N_TASKS}",
        *[f"data.generate.{k}={v}" for k, v in DATA[agent].items()],
        f"endpoint.base_url={url}",
        "endpoint.model=scripted",
        f"hydra.run.dir={run_dir}",
    ]
    result = launch(args, cache, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "dev" / "rollouts.jsonl").read_text().splitlines()]
    assert summary["dev"]["rollouts"] == summary["dev"]["succeeded"] == len(records) == N_TASKS
    assert any(r.get("return_token_ids") for r in requests)  # the proxy asked the server for token ids
    for record in records:
        assert record["status"] == "succeeded" and record["spans"] > 0
        assert record["triplets"], record
        assert all(t["prompt_tokens"] > 0 and t["response_tokens"] > 0 for t in record["triplets"])
        assert record["reward"] is not None
    ids = [t["response_id"] for r in records for t in r["triplets"]]
    assert len(ids) == len(set(ids))
    return records

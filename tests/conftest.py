"""Shared fixtures: one generated dataset and one tiny model per test session, and a launcher for real runs."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from agent.trajectory import Trajectory
from models.tiny import TinyModel

ROOT = Path(__file__).resolve().parent.parent
# the repository's folders are the import names (nothing is installed): processes the tests start find them too
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

# A GRPO run small enough for a test (conf/experiment/smoke.yaml: 5 SFT steps, 2 tasks x 2 rollouts, 2 steps) with the
# Spider agent's multi-turn path (check, rewrite: tool text between turns masked from the loss) on a small data set.
FAST_RUN = [
    "experiment=smoke",
    "agent.check_step=true",
    "data.generate.n_train=120",
    "data.generate.n_dev=8",
    "data.generate.n_test=8",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tiers first (`slurm`, `integration`: seconds to minutes a test), the unit tests after them (stable:
    in their files' order otherwise). xdist hands tests out in this order, so the workers end on short tests
    together instead of one worker running a long test alone at the end."""
    items.sort(key=lambda item: not (item.get_closest_marker("slurm") or item.get_closest_marker("integration")))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache (generated data, built tiny models) for the whole session."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def spider_mini_dir(cache_dir: Path) -> Path:
    from data import spider_mini

    return spider_mini.generate(cache_dir / "spider_mini", seed=0, n_train=120, n_dev=8, n_test=8)


@pytest.fixture(scope="session")
def med_qa_dir(cache_dir: Path) -> Path:
    from data import med_qa

    return med_qa.generate(cache_dir / "med_qa", seed=0, n_train=40, n_val=10, n_test=10)


@pytest.fixture(scope="session")
def dbbench_dir(cache_dir: Path) -> Path:
    from data import dbbench

    return dbbench.generate(cache_dir / "dbbench", seed=0, n=28)


def micro_tiny(cache_dir: Path, **fields: Any) -> TinyModel:
    """A tiny model smaller still than `model=tiny` (2 layers x 32, 300 tokens), for unit tests; `fields` override."""
    settings: dict[str, Any] = {
        "context_length": 512,
        "tool_call_format": "hermes",
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "dtype": "auto",
    }
    return TinyModel(name="tiny", hub_id=None, path=None, cache_dir=str(cache_dir), **(settings | fields))


class HalfReward:
    """1 when the last reply's length is odd, else 0: a micro model's groups get rewards that differ."""

    name = "half"

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float:
        return float(len(trajectory.messages[-1]["content"]) % 2)


def agent_trainer(
    model: Any,
    tokenizer: Any,
    tasks: list[dict[str, Any]],
    rollout_func: Callable[..., dict[str, Any]],
    out: Path,
    group: int,
    tasks_per_step: int,
    lookahead: int,
    callbacks: list[Any] | None = None,
    take_rows: Callable[..., list[dict[str, Any]]] | None = None,
    save_every: int = 100,
    epochs: int = 2,
) -> Any:
    """The GRPO trainer the rollout tests train through: `epochs` over `tasks` on CPU, micro-batches of 2, the
    rollouts' rewards as they come ("half"), token-truncated IS correction; `lookahead` (steps read ahead) for
    asynchronous rollouts, `take_rows` for carry-over, a checkpoint every `save_every` steps (each kept)."""
    from datasets import Dataset

    from backends.algorithm import GRPO
    from backends.trl.arms import passthrough_reward
    from backends.trl.backend import TRLBackend
    from backends.trl.rollouts import task_prompt
    from backends.trl.trainer import AgentGRPOTrainer

    algo = GRPO(group_size=group, tasks_per_step=tasks_per_step, micro_batch_size=2, epochs=epochs,
                save_every=save_every, keep_checkpoints=10)  # fmt: skip
    return AgentGRPOTrainer(
        model=model,
        reward_funcs=[passthrough_reward("half")],
        args=TRLBackend().grpo_config(algo, str(out), seed=0, device="cpu"),
        train_dataset=Dataset.from_list([{"prompt": task_prompt(t)} for t in tasks]),
        processing_class=tokenizer,
        rollout_func=rollout_func,
        callbacks=callbacks,
        is_correction="token_truncate",
        lookahead=lookahead,
        take_rows=take_rows,
    )


def launch(
    args: list[str], cache: Path, output: Path, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python launch.py ARGS` as a user would, offline, with its own cache and output directories (and `env`
    on top of this process's environment)."""
    env = os.environ | {"ARL_CACHE_DIR": str(cache), "ARL_OUTPUT_DIR": str(output), "HF_HUB_OFFLINE": "1"} | (env or {})
    return subprocess.run(
        [sys.executable, "launch.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_eval(app: FastAPI, args: list[str], cache: Path, output: Path) -> tuple[dict, Path]:
    """`job=eval ARGS` against `app` served on loopback, as a user would run it; returns eval/summary.json and the
    run directory."""
    run_dir = output / "run"
    with serve(app) as url:
        result = launch(["job=eval", *args, f"endpoint.base_url={url}", f"hydra.run.dir={run_dir}"], cache, output)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((run_dir / "eval" / "summary.json").read_text()), run_dir


APT_LOCK = Path("/tmp/arl-apt.lock")  # apt-get in two test workers at once fails: `update` does not wait for its lock


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """`path` locked for this process while the block runs (another test worker that asks waits for it)."""
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def apt_lock() -> contextlib.AbstractContextManager[None]:
    """Held while a fixture may install packages (SLURM's cluster, MariaDB), so that one worker's apt-get runs at a
    time; a second waits, as long as the holder's commands may run (each has its timeout: 900 s)."""
    return file_lock(APT_LOCK)


def closed_port() -> int:
    """A loopback port nothing listens on, for "the server is down" cases (bound to find one, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Wait until `condition()` is true; after `timeout_s` (a hang guard, not a measurement) fail saying what for."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


@contextmanager
def serve(app: FastAPI, startup_timeout_s: float = 60.0) -> Iterator[str]:
    """Serve `app` on loopback in a thread; yields its `/v1` base URL and stops it afterwards. The socket is bound
    here to port 0 and handed to uvicorn, so no other process can take the port between choosing and binding it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), startup_timeout_s, f"the test server on port {port}")
        if not server.started:
            raise RuntimeError(f"the test server on port {port} stopped before it started")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

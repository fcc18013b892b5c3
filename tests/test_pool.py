"""algorithm.pool_samples: the RL tasks are those the starting policy solves sometimes, worked out once and reused."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from backends.trl import pool
from tests.conftest import FAST_RUN, launch

TASKS = [{"id": f"t{i}", "question": f"q{i}"} for i in range(5)]
RIGHT = {"t0": 0, "t1": 1, "t2": 3, "t3": 4, "t4": 2}  # of 4 samples: t1, t2, t4 are solved sometimes


def test_a_pool_keeps_the_tasks_solved_some_but_not_all_times(monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[int] = []

    def fake_validate(agent: Any, repeated: list[dict], *args: Any) -> tuple[None, list[Any]]:
        seen: dict[str, int] = {}
        rollouts = []
        for task in repeated:
            k = seen[task["id"]] = seen.get(task["id"], 0) + 1
            rollouts.append(SimpleNamespace(reward=1.0 if k <= RIGHT[task["id"]] else 0.0))
        return None, rollouts

    monkeypatch.setattr(pool, "validate_policy", fake_validate)
    monkeypatch.setattr(pool, "CHUNK_ROLLOUTS", 8)  # 2 tasks a chunk: 3 chunks, each after a load
    record = pool.sample_pool(None, TASKS, None, lambda: loads.append(1), None, {}, 4, None)  # type: ignore[arg-type]
    assert record["kept"] == ["t1", "t2", "t4"] and (record["never_right"], record["always_right"]) == (1, 1)
    assert len(loads) == 3


def test_a_pool_is_sampled_once_and_read_by_every_later_run(tmp_path: Path) -> None:
    calls: list[int] = []

    def sample() -> dict[str, Any]:
        calls.append(1)
        return {"samples": 4, "tasks": 5, "kept": ["t1", "t4"], "never_right": 2, "always_right": 1}

    path = tmp_path / "pools" / "pool-x.json"
    first, stats = pool.filtered_pool(TASKS, path, sample, exclusive=True)
    again, reused = pool.filtered_pool(TASKS, path, sample, exclusive=True)
    assert [t["id"] for t in first] == [t["id"] for t in again] == ["t1", "t4"] and len(calls) == 1
    assert stats["kept"] == 2 and reused["reused"] is True
    assert pool.pool_key("w1", TASKS, {"samples": 4}) != pool.pool_key("w2", TASKS, {"samples": 4})
    assert pool.pool_key("w1", TASKS, {"samples": 4}) == pool.pool_key("w1", TASKS[::-1], {"samples": 4})
    empty = tmp_path / "pools" / "pool-y.json"
    with pytest.raises(RuntimeError, match="none of 5 tasks is solved sometimes"):
        pool.filtered_pool(TASKS, empty, lambda: sample() | {"kept": []}, exclusive=True)


@pytest.mark.integration
def test_a_run_whose_start_solves_nothing_stops_with_the_pools_counts(cache_dir: Path, tmp_path: Path) -> None:
    """The smoke warm start solves no task: the pool is empty, and the run says so instead of training on nothing."""
    run_dir = tmp_path / "run"
    # about 8 of the 120 tasks for RL (the warm start trains on the rest): 16 pool rollouts, not 240
    args = [*FAST_RUN, "algorithm.pool_samples=2", "warmstart.rl_tasks=8", f"hydra.run.dir={run_dir}"]
    result = launch(args, cache_dir, tmp_path)
    assert result.returncode != 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and re.search(r"algorithm.pool_samples=2: none of \d tasks", summary["error"])
    assert list((cache_dir / "warmstarts" / "pools").glob("pool-*.json"))  # kept for the next run all the same

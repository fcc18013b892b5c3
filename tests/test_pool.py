"""algorithm.pool_samples: the RL tasks are those the starting policy solves sometimes, worked out once and reused."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from backends.algorithm import GRPO, RFT, SFTControl
from backends.compute import ComputeCount
from backends.trl import pool
from backends.trl.backend import TRLBackend
from tests.conftest import FAST_RUN, launch

TASKS = [{"id": f"t{i}", "question": f"q{i}"} for i in range(5)]
RIGHT = {"t0": 0, "t1": 1, "t2": 3, "t3": 4, "t4": 2}  # of 4 samples: t1, t2, t4 are solved sometimes


N = 1000  # the model's parameters
PROMPT, REPLY = 10, 3  # tokens each fake rollout's engine prefills and generates


class FakeServer:
    """What sample_pool reads of the policy server: the engine's token counts (the fake rollouts add to them)."""

    def __init__(self) -> None:
        self.model = "policy"
        self.prefilled_tokens = self.generated_tokens = 0

    def load(self, model: Any) -> None:
        pass


def fake_validate(
    agent: Any, repeated: list[dict], server: FakeServer, *args: Any, route: str = "val"
) -> tuple[None, list[Any]]:
    """Each task right RIGHT[id] of its samples; each rollout prefills PROMPT tokens and generates REPLY. The pool's
    rollouts must not be named as validation's (an agent=lit class would validate greedily: samples all alike)."""
    assert route == pool.POOL_ROUTE != "val"
    seen: dict[str, int] = {}
    rollouts = []
    for task in repeated:
        k = seen[task["id"]] = seen.get(task["id"], 0) + 1
        rollouts.append(SimpleNamespace(reward=1.0 if k <= RIGHT[task["id"]] else 0.0))
        server.prefilled_tokens += PROMPT
        server.generated_tokens += REPLY
    return None, rollouts


def test_a_pool_keeps_the_tasks_solved_some_but_not_all_times_and_records_its_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loads: list[int] = []
    monkeypatch.setattr(pool, "validate_policy", fake_validate)
    monkeypatch.setattr(pool, "CHUNK_ROLLOUTS", 8)  # 2 tasks a chunk: 3 chunks, each after a load
    clock = iter([100.0, 130.0])  # sampling took 30 s (a clock of its own: no waiting)
    monkeypatch.setattr(pool, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    server = FakeServer()
    server.prefilled_tokens = 7  # what the server prefilled before: not the pool's
    args = (None, TASKS, server, lambda: loads.append(1), None, {}, 4, None)
    record = pool.sample_pool(*args, parameters=N, ranks=2)  # type: ignore[arg-type]
    assert record["kept"] == ["t1", "t2", "t4"] and (record["never_right"], record["always_right"]) == (1, 1)
    assert len(loads) == 3
    rollouts = 4 * len(TASKS)
    assert (record["prefill_tokens"], record["generated_tokens"]) == (PROMPT * rollouts, REPLY * rollouts)
    assert record["flops"] == 2 * N * (PROMPT + REPLY) * rollouts
    assert (record["wall_s"], record["ranks"], record["gpu_s"]) == (30.0, 2, 60.0)


def test_an_arm_that_trains_on_the_pool_is_charged_its_sampling_also_when_it_reuses_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """GRPO, RFT and gold SFT on the pool (sft_demos=rl) are charged what sampling the pool cost, whichever run
    sampled it; the control that continues SFT on the warm start's own demonstrations uses no pool."""
    monkeypatch.setattr(pool, "validate_policy", fake_validate)
    servers: list[FakeServer] = []
    monkeypatch.setattr(TRLBackend, "policy_server", lambda self, *a: servers.append(FakeServer()) or servers[-1])
    setup = SimpleNamespace(
        algorithm=GRPO(pool_samples=4),
        agent="agent",
        warmstart=SimpleNamespace(cache_dir=tmp_path),
        run=SimpleNamespace(phase=""),
    )

    def context(compute: ComputeCount) -> Any:
        """What the pool phase reads of a run's context (backends/trl/context.py)."""
        return SimpleNamespace(
            setup=setup,
            algo=setup.algorithm,
            backend=TRLBackend(),
            model=torch.nn.Linear(2, 2),
            tokenizer=None,
            metric="metric",
            device="cpu",
            compute_dtype=torch.float32,
            compute=compute,
        )

    sampler = ComputeCount(N, 6, ranks=2)
    tasks, entry = pool.pool_of(context(sampler), TASKS, "w1")
    assert [t["id"] for t in tasks] == ["t1", "t2", "t4"] and "reused" not in entry and len(servers) == 1
    assert entry["flops"] == 2 * N * (PROMPT + REPLY) * 4 * len(TASKS) == sampler.pool_flops == entry["charged_flops"]
    assert entry["gpu_s"] == 2 * entry["wall_s"] == sampler.pool_gpu_s == entry["charged_gpu_s"]
    assert (sampler.flops, sampler.gpu_s) == (entry["flops"], entry["gpu_s"])  # nothing trained yet: the pool alone
    assert sampler.metrics()["compute/pool_flops"] == entry["flops"]

    reader = ComputeCount(N, 6)  # another arm or seed from the same warm start: reads the file
    monkeypatch.setattr(pool, "validate_policy", lambda *a: pytest.fail("the pool is sampled once"))
    _, again = pool.pool_of(context(reader), TASKS, "w1")
    assert again["reused"] and len(servers) == 1
    assert (reader.pool_flops, reader.pool_gpu_s) == (sampler.pool_flops, sampler.pool_gpu_s) != (0, 0)

    trains = pool.trains_on_pool
    assert all(trains(a) for a in (GRPO(pool_samples=4), RFT(pool_samples=4), SFTControl(pool_samples=4)))
    assert not trains(SFTControl(pool_samples=4, sft_demos="warmstart")) and not trains(GRPO())


def test_a_pool_is_sampled_once_and_read_by_every_later_run(tmp_path: Path) -> None:
    calls: list[int] = []

    def sample() -> dict[str, Any]:
        calls.append(1)
        return {"samples": 4, "tasks": 5, "kept": ["t1", "t4"], "never_right": 2, "always_right": 1, "flops": 1e9}

    path = tmp_path / "pools" / "pool-x.json"
    first, stats = pool.filtered_pool(TASKS, path, sample, exclusive=True)
    again, reused = pool.filtered_pool(TASKS, path, sample, exclusive=True)
    assert [t["id"] for t in first] == [t["id"] for t in again] == ["t1", "t4"] and len(calls) == 1
    assert stats["kept"] == 2 and reused["reused"] is True
    assert pool.pool_key("w1", TASKS, {"samples": 4}) != pool.pool_key("w2", TASKS, {"samples": 4})
    assert pool.pool_key("w1", TASKS, {"samples": 4}) == pool.pool_key("w1", TASKS[::-1], {"samples": 4})
    empty = tmp_path / "pools" / "pool-y.json"
    with pytest.raises(RuntimeError, match=r"none of 5 tasks is solved sometimes .*algorithm\.pool_samples=null"):
        pool.filtered_pool(TASKS, empty, lambda: sample() | {"kept": []}, exclusive=True)
    # a file that does not say what sampling it cost would charge its arms nothing: refused
    uncounted = tmp_path / "pools" / "pool-z.json"
    uncounted.write_text(json.dumps({k: v for k, v in sample().items() if k != "flops"}))
    with pytest.raises(RuntimeError, match="sampled before its compute was recorded; delete it"):
        pool.filtered_pool(TASKS, uncounted, sample, exclusive=True)


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
    # kept for the next run all the same, with what sampling it cost (HF generate: every prompt prefilled whole)
    pools = [json.loads(p.read_text()) for p in (cache_dir / "warmstarts" / "pools").glob("pool-*.json")]
    assert pools and all(p["prefill_tokens"] > p["samples"] * p["tasks"] and p["flops"] > 0 for p in pools)


@pytest.mark.integration
def test_training_tasks_that_cannot_fill_a_step_stop_the_run_before_it_trains(cache_dir: Path, tmp_path: Path) -> None:
    """About 8 tasks for GRPO and 16 a step: the trainer's data loader would have no batch and the run would end
    "completed" with no step (as a pool smaller than a step did); it stops, naming the key and what fits."""
    run_dir = tmp_path / "run"
    args = [*FAST_RUN, "warmstart.rl_tasks=8", "algorithm.tasks_per_step=16", f"hydra.run.dir={run_dir}"]
    result = launch(args, cache_dir, tmp_path)
    assert result.returncode != 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary.get("steps") in (None, 0)
    assert re.search(r"\d training tasks, fewer than a step's algorithm.tasks_per_step=16", summary["error"])
    assert not [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["step"] > 0]

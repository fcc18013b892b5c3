"""Compute counted alike for every arm (backends/compute.py): the FLOPs of each kind of token, GPU-seconds, a resumed
run's counts, and the GPU-seconds budget ending GRPO and the control at a step's end. The counts of a real step: the
prefill test in tests/test_rollouts.py; the pool's charge: tests/test_pool.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from backends.algorithm import GRPO, SFTControl
from backends.compute import ComputeCount
from backends.trl.callbacks import ControlLog, StepLog
from backends.trl.clock import Clock
from backends.verl.config import check_algorithm
from foundation.errors import ConfigError

N = 1000


def test_every_kind_of_token_and_the_pool_are_in_the_flops_and_seconds_are_gpu_seconds_on_every_rank() -> None:
    compute = ComputeCount(N, train_factor=4, ranks=2)  # LoRA on two ranks
    compute.charge_pool(flops=5e6, gpu_s=30.0)
    compute.add(trained=10, generated=3, forward_only=10, prefill=7, seconds=4.0)
    compute.add(trained=1, prefill=1, seconds=1.0)
    metrics = compute.metrics()
    assert metrics["compute/prefill_tokens"] == 8 and metrics["compute/pool_flops"] == 5e6
    assert metrics["compute/flops"] == 4 * N * 11 + 2 * N * (10 + 8 + 3) + 5e6
    assert metrics["compute/gpu_s"] == 2 * 5.0 + 30.0 and metrics["compute/pool_gpu_s"] == 30.0
    summary = compute.summary(wall_s=12.0)
    assert summary["wall_s"] == 12.0 and summary["ranks"] == 2 and summary["compute/gpu_s"] == 40.0


def test_a_resumed_run_continues_every_count_and_keeps_its_pool_charge() -> None:
    before = ComputeCount(N, 6, ranks=2)
    before.charge_pool(flops=1e6, gpu_s=10.0)
    before.add(trained=20, generated=5, forward_only=20, prefill=9, seconds=3.0)
    logged = [{"step": 0}, {"step": 1, **before.metrics()}, {"step": 2, "val/accuracy": 0.5}]

    after = ComputeCount(N, 6, ranks=2)
    after.charge_pool(flops=1e6, gpu_s=10.0)  # the restarted run reads the same pool file
    after.restore(logged)
    assert after.metrics() == before.metrics()
    after.add(prefill=1, seconds=1.0)
    assert after.prefill == 10 and after.gpu_s == before.gpu_s + 2.0


def steps(callback: Any, compute: ComputeCount, seconds: list[float], max_steps: int) -> list[bool]:
    """Step ends of `callback`, each after `seconds[i]` more training seconds on every rank (added to the count, not
    waited): whether it stopped training there."""
    stopped = []
    for step, extra in enumerate(seconds, start=1):
        compute.add(seconds=extra)
        control = SimpleNamespace(should_training_stop=False)
        callback.on_step_end(None, SimpleNamespace(global_step=step, max_steps=max_steps), control)
        stopped.append(control.should_training_stop)
    return stopped


def test_a_gpu_seconds_budget_ends_grpo_at_the_first_step_end_past_it() -> None:
    """Two ranks: 25 training seconds are 50 GPU-seconds of the budget's 100."""
    algo = GRPO(gpu_s_budget=100.0)
    assert algo.lr_schedule == "constant"  # its last step is not known ahead
    compute = ComputeCount(N, 6, ranks=2)
    rollouts = SimpleNamespace(last_stats={}, last_tokens={"trained": 10, "generated": 2, "prefill": 8}, memory=None)
    validated: list[str] = []
    clock = Clock(algo, algo.val_every, compute)
    step_log = StepLog(None, clock, rollouts, lambda m, when: validated.append(when) or {}, None)
    assert steps(step_log, compute, [0.0, 25.0, 25.0], max_steps=100) == [False, False, True]
    assert validated == ["final"] and compute.gpu_s >= 100.0 and compute.prefill == 3 * 8


def test_a_gpu_seconds_budget_ends_the_control_and_counts_the_pool_charge() -> None:
    """The control (gold SFT on the pool) charged 60 pool GPU-seconds: 20 training seconds on two ranks spend the
    100."""
    algo = SFTControl(gpu_s_budget=100.0, max_steps=-1, sft_val_every=1000)
    compute = ComputeCount(N, 6, ranks=2)
    compute.charge_pool(flops=0.0, gpu_s=60.0)
    logged: list[dict[str, Any]] = []
    run = SimpleNamespace(log=lambda step, metrics: logged.append({"step": step, **metrics}))
    budget = ControlLog(run, Clock(algo, algo.sft_val_every, compute), lambda m, when: {}, lambda: 100.0)
    assert steps(budget, compute, [0.0, 10.0, 10.0], max_steps=10**9) == [False, False, True]
    assert [m["step"] for m in logged] == [3] and logged[0]["compute/gpu_s"] >= 100.0


@pytest.mark.parametrize("key", ["time_budget_s", "flops_budget", "gpu_s_budget"])
def test_verl_refuses_every_budget_by_name(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"algorithm\.{key}=60.0: backend=trl's"):
        check_algorithm(GRPO(**{key: 60.0}))


def test_every_arm_validates_at_the_same_points_of_its_budget() -> None:
    """`algorithm.val_points=4` under one FLOPs budget: GRPO (80k FLOPs a step) and the SFT control (30k a step)
    each validate at the first step end past 1/4, 2/4 and 3/4 of the budget, and at its end: four points each,
    whatever their steps."""
    budget, points = 800_000.0, 4
    grpo = GRPO(flops_budget=budget, val_points=points, val_every=1000)
    compute = ComputeCount(N, 6)
    rollouts = SimpleNamespace(last_stats={}, last_tokens={"trained": 10, "generated": 2, "prefill": 8}, memory=None)
    seen: list[tuple[str, float]] = []
    step_log = StepLog(
        None,
        Clock(grpo, grpo.val_every, compute),
        rollouts,
        lambda m, when: seen.append((when, compute.flops / budget)) or {},
        None,
    )
    stopped = steps(step_log, compute, [0.0] * 10, max_steps=100)
    assert stopped == [False] * 9 + [True]
    assert seen == [("step3", 0.3), ("step5", 0.5), ("step8", 0.8), ("final", 1.0)]

    control = SFTControl(flops_budget=budget, val_points=points, max_steps=-1, sft_val_every=1000)
    compute = ComputeCount(N, 6)
    fractions: list[tuple[str, float]] = []
    tokens = iter(range(5, 1000, 5))  # the trainer's tokens so far: 5 more a step, 30k FLOPs
    sft = ControlLog(
        SimpleNamespace(log=lambda step, metrics: None),
        Clock(control, control.sft_val_every, compute),
        lambda m, when: fractions.append((when, compute.flops / budget)) or {},
        lambda: float(next(tokens)),
    )
    stopped = steps(sft, compute, [0.0] * 27, max_steps=10**9)
    assert stopped == [False] * 26 + [True]
    assert [name for name, _ in fractions] == ["step7", "step14", "step20", "final"]
    for k, (_, fraction) in enumerate(fractions[:3], start=1):
        assert k / points <= fraction < k / points + 30_000 / budget  # the first step end past each point


def test_without_val_points_each_arm_validates_every_its_own_steps() -> None:
    algo = GRPO(max_steps=5, val_every=2)
    compute = ComputeCount(N, 6)
    rollouts = SimpleNamespace(last_stats={}, last_tokens={"trained": 1}, memory=None)
    seen: list[str] = []
    step_log = StepLog(None, Clock(algo, algo.val_every, compute), rollouts, lambda m, w: seen.append(w) or {}, None)
    steps(step_log, compute, [0.0] * 5, max_steps=5)
    assert seen == ["step2", "step4", "final"]

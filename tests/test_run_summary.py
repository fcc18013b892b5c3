"""The end of a training run as a person reads it (jobs/train.py `describe`)."""

from __future__ import annotations

import pytest

from foundation.stats import wilson
from jobs.train import describe, sparkline


def summary(before: float, after: float, rewards: list[float | None]) -> dict:
    val = {"n": 100, "errors": 0, "missing": 0}
    return {
        "run_dir": "/runs/r",
        "wall_s": 400.0,
        "val_after_sft": val | {"accuracy": before},
        "val_final": val | {"accuracy": after},
        "sft": {"wall_s": 281.0},
        "grpo": {"wall_s": 58.0},
        "reward_per_step": rewards,
    }


def test_wilson_interval() -> None:
    low, high = wilson(0.41, 100)
    assert low == pytest.approx(0.3187, abs=1e-4) and high == pytest.approx(0.5080, abs=1e-4)  # 41/100
    assert wilson(0.0, 100)[0] == 0.0 and wilson(1.0, 100)[1] == pytest.approx(1.0)


def test_sparkline_scales_and_buckets() -> None:
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([0.2, None, 0.2]) == "▁ ▁"
    assert len(sparkline([float(i) for i in range(600)], width=60)) == 60


def test_a_small_difference_on_100_questions_is_inside_noise() -> None:
    text = describe(summary(0.41, 0.45, [0.1, 0.2, None, 0.3]))
    assert "val accuracy after SFT       0.41  [0.32, 0.51]  (n=100)" in text
    assert "+0.04" in text and "inside noise" in text
    assert "reward per step (4 steps, 0.10 -> 0.30, max 0.30)" in text
    assert "SFT 281 s, GRPO 58 s" in text and "/runs/r/summary.json" in text


def test_a_large_difference_is_beyond_noise() -> None:
    assert "beyond noise" in describe(summary(0.30, 0.60, [0.1]))


def test_accuracy_per_subset_before_and_after() -> None:
    runs = summary(0.41, 0.45, [0.1])
    runs["val_after_sft"]["subsets"] = {
        "combination": {"accuracy": 0.05, "n": 20},
        "entity": {"accuracy": 0.5, "n": 80},
    }
    runs["val_final"]["subsets"] = {"combination": {"accuracy": 0.1, "n": 20}, "entity": {"accuracy": 0.53, "n": 80}}
    del runs["val_final"]["subsets"]["entity"]  # a subset one validation lacks shows as "-"
    lines = describe(runs).splitlines()
    at = lines.index("  per subset (data.val_subset_field), after SFT -> after GRPO, each with its 95 % interval:")
    assert lines[at + 1 : at + 3] == [
        "    combination                0.05 [0.01, 0.24] -> 0.10 [0.03, 0.30]  (n=20)",
        "    entity                     0.50 [0.39, 0.61] -> -  (n=80)",
    ]
    assert "per subset" not in describe(summary(0.41, 0.45, [0.1]))  # a split without subsets: no such lines


def test_the_training_reward_trend_and_the_test_split_are_shown_with_intervals() -> None:
    rising = [0.10, 0.12, 0.14, 0.16, 0.20, 0.22, 0.25, 0.28, 0.30, 0.33]  # 10 steps: bins of 2
    runs = summary(0.41, 0.45, rising) | {
        "test_final": {"accuracy": 0.40, "n": 100, "subsets": {"entity": {"accuracy": 0.5, "n": 20}}},
        "grpo": {
            "wall_s": 10.0,
            "compute": {
                "compute/flops": 3.2e12,
                "compute/trained_tokens": 1e5,
                "compute/prefill_tokens": 5e4,
                "compute/generated_tokens": 2e4,
                "compute/pool_flops": 1e12,
                "compute/gpu_s": 120.0,
                "wall_s": 150.0,
            },
        },
    }
    lines = describe(runs).splitlines()
    trend = next(line for line in lines if "training reward, first 2 steps" in line)
    assert "0.11 [" in trend and "-> last 2 steps 0.32 [" in trend and "+0.21, beyond noise" in trend
    assert any(line.startswith("  test accuracy, final model   0.40  [0.31, 0.50]  (n=100)") for line in lines)
    assert any(line.strip().startswith("entity") and "(n=20)" in line for line in lines)
    compute = "3.20e+12 FLOPs (100,000 tokens trained, 50,000 prefilled, 20,000 generated, 1.00e+12 of them the pool's"
    assert any(compute in line and "), 120 GPU-seconds, 150 s wall" in line for line in lines)
    assert lines[-1].startswith("no control arm — no claim about GRPO vs SFT")
    flat = describe(summary(0.41, 0.45, [0.2, 0.3, 0.2, 0.3, 0.25, 0.2, 0.3, 0.2, 0.3, 0.25]))
    assert "inside noise" in next(line for line in flat.splitlines() if "training reward, first" in line)
    control = describe(summary(0.41, 0.45, []) | {"arm": "sft_control", "sft_control": {"wall_s": 9.0}})
    assert control.splitlines()[-1].startswith("this run is a control arm")

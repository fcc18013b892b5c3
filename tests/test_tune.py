"""python -m analysis.tune: each arm's learning rate chosen on validation over the same grid, recorded; a tuning run
that scored the test split is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis import tune
from tests.test_report import write_arm

# validation accuracy per arm, learning rate and seed: GRPO best at 1e-4, the SFT control at 3e-4
GRID = {
    ("grpo", "algorithm.learning_rate"): {"3e-05": (0.40, 0.42), "0.0001": (0.50, 0.52), "0.0003": (0.45, 0.469)},
    ("sft_control", "algorithm.sft_learning_rate"): {
        "3e-05": (0.30, 0.31),
        "0.0001": (0.33, 0.36),
        "0.0003": (0.36, 0.38),
    },
}


def write_grid(root: Path, test_final: float | None = None) -> None:
    num = 0
    for (arm, key), by_lr in GRID.items():
        for lr, values in by_lr.items():
            for seed, value in enumerate(values):
                write_arm(root / str(num), arm, seed, value, extra=[f"{key}={lr}"], test_final=test_final)
                num += 1


def test_each_arm_gets_its_best_setting_on_validation(tmp_path: Path) -> None:
    write_grid(tmp_path / "tuning")
    chosen = tune.main([str(tmp_path / "tuning"), "--out", str(tmp_path / "out")])
    assert chosen["grpo"]["overrides"] == ["algorithm.learning_rate=0.0001"]
    assert chosen["sft_control"]["overrides"] == ["algorithm.sft_learning_rate=0.0003"]
    # 51 vs 46: each seed better by 5.0 and 5.1 points, paired by seed (these runs have no warm start): beyond noise
    assert chosen["grpo"]["beyond_runner_up"] is True and chosen["grpo"]["at_edge"] is False
    assert chosen["sft_control"]["beyond_runner_up"] is False and chosen["sft_control"]["at_edge"] is True
    recorded = json.loads((tmp_path / "out" / "tuning.json").read_text())
    assert recorded["arms"]["grpo"]["overrides"] == ["algorithm.learning_rate=0.0001"]
    md = (tmp_path / "out" / "tuning.md").read_text()
    assert "| algorithm.learning_rate=0.0001 | 2 | 51.0 ± " in md and "beyond noise of the runner-up" in md
    assert "At the edge of the grid: the best setting may lie beyond it." in md


def test_tuning_runs_that_scored_the_test_split_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_grid(tmp_path / "tuning", test_final=0.3)
    with pytest.raises(SystemExit):
        tune.main([str(tmp_path / "tuning"), "--out", str(tmp_path / "out")])
    assert "12 tuning runs scored the test split" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

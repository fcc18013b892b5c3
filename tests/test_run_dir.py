"""A run directory takes only its own run again: another setting is refused, naming the key; when it stops may
change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foundation.errors import ConfigError
from foundation.run_dir import RUN_CONFIG, RunDir


def config(**algorithm: float) -> dict:
    return {
        "seed": 0,
        "paths": {"output_dir": "outputs"},
        "algorithm": {"learning_rate": 1e-4, "max_steps": 3} | algorithm,
    }


def test_the_first_start_records_its_config_and_the_same_run_starts_again(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.check_same_run(config())
    assert json.loads((run.path / RUN_CONFIG).read_text()) == config()
    run.check_same_run(config())  # resumed, requeued


def test_when_a_run_stops_and_where_it_writes_may_change(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.check_same_run(config())
    extended = config(max_steps=10) | {"paths": {"output_dir": "/scratch/outputs"}}
    run.check_same_run(extended)
    assert json.loads((run.path / RUN_CONFIG).read_text()) == extended  # the latest start's


def test_a_run_begun_before_validation_points_kept_checkpoints_and_declarations_starts_again(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.check_same_run(config())
    later = config(val_points=4, keep_checkpoints=1) | {"analysis": {"metric": "test_final", "comparisons": []}}
    run.check_same_run(later)


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        (config(learning_rate=0.5), "algorithm.learning_rate: 0.0001 there, 0.5 now"),
        (config(clip_ratio=0.2), "algorithm.clip_ratio: '(unset)' there, 0.2 now"),
        ({**config(), "seed": 1}, "seed: 0 there, 1 now"),
    ],
)
def test_another_setting_in_the_same_directory_is_refused_naming_it(tmp_path: Path, changed: dict, named: str) -> None:
    run = RunDir(tmp_path / "run")
    run.check_same_run(config())
    with pytest.raises(ConfigError, match="holds a run with other settings") as refused:
        run.check_same_run(changed)
    assert named in str(refused.value)
    assert json.loads((run.path / RUN_CONFIG).read_text()) == config()  # the run's own config stays

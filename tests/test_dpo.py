"""job=dpo: DPO on the tiny policy with generated SQL preference pairs widens the chosen-over-rejected margin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FAST_RUN, launch


@pytest.mark.integration
def test_dpo_widens_the_margin(cache_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = launch(["job=dpo", *FAST_RUN, "job.steps=30", f"hydra.run.dir={run}"], cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert summary["margin_after"] > summary["margin_before"] + 1.0
    assert (run / "checkpoints" / "final" / "config.json").is_file()

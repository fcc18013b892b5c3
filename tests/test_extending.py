"""README's worked examples, run as they stand: the files a newcomer copies out of README.md work."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from agent.trajectory import Trajectory
from experiments.config import build_components
from tests.conftest import ROOT
from tests.test_config import compose_with


def readme_files() -> dict[str, str]:
    """Each code block of README.md whose first line is a comment naming a file (`# rewards/short_sql.py`)."""
    blocks = re.findall(r"```(?:python|yaml)\n# (\S+)\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    return {path: body for path, body in blocks}


def test_the_readme_s_reward_example_composes_builds_and_scores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = readme_files()
    assert {"rewards/short_sql.py", "conf/reward/short_sql.yaml"} <= files.keys()
    # the files where README says they go, in a copy of the tree's layout: a package `rewards` of their own beside
    # the project's (the project's `rewards` stays importable: the example is a module of a second package path)
    package = tmp_path / "src" / "rewards"
    package.mkdir(parents=True)
    (package / "short_sql.py").write_text(files["rewards/short_sql.py"])
    import rewards

    monkeypatch.setattr(rewards, "__path__", [*rewards.__path__, str(package)])
    monkeypatch.delitem(sys.modules, "rewards.short_sql", raising=False)
    conf = tmp_path / "conf" / "reward"
    conf.mkdir(parents=True)
    (conf / "short_sql.yaml").write_text(files["conf/reward/short_sql.yaml"])

    cfg = compose_with("reward=short_sql", f"hydra.searchpath=[file://{tmp_path / 'conf'}]")
    reward = build_components(cfg)["reward"]
    assert reward.name == "short_sql" and reward.max_chars == 200
    assert reward({}, Trajectory(final_sql="SELECT name FROM people")) == 1.0
    assert reward({}, Trajectory(final_sql="SELECT " + "x, " * 100 + "y FROM t")) == 0.0
    assert reward({}, Trajectory()) == 0.0  # no SQL

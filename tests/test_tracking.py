"""logger=wandb and logger=swanlab: validated with the other groups, offline without a key, no environment value in
what they send, and never the cause of a failed run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from foundation.errors import ConfigError
from foundation.run_dir import RunDir
from jobs.config import build_group
from jobs.tracking import SwanLabLogger, WandbLogger, env_free_config, swept_keys
from tests.conftest import FAST_RUN, closed_port, launch
from tests.test_config import compose_with


def test_logger_none_builds_nothing_and_wandb_builds_a_logger() -> None:
    assert build_group(compose_with(), "logger") is None
    logger = build_group(compose_with("logger=wandb", "logger.project=p", "logger.tags=[a]"), "logger")
    assert isinstance(logger, WandbLogger) and logger.project == "p" and logger.tags == ["a"]


@pytest.mark.parametrize(
    ("override", "key"), [("logger.mode=sometimes", "logger.mode"), ("logger.tags=3", "logger.tags")]
)
def test_a_bad_logger_value_names_its_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_group(compose_with("logger=wandb", override), "logger")


def test_auto_mode_is_online_only_with_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert WandbLogger().resolved_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert WandbLogger().resolved_mode() == "online"
    assert WandbLogger(mode="offline").resolved_mode() == "offline"


def test_the_config_sent_keeps_environment_values_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_BASE_URL", "https://user:sentinel-token@judge.example/v1")
    monkeypatch.setenv("ARL_CACHE_DIR", "/sentinel-cache")
    cfg = compose_with("reward=llm_judge", "logger=wandb")
    assert cfg.reward.base_url.startswith("https://user:sentinel-token")  # what the run itself uses
    sent = env_free_config(cfg)
    assert "sentinel" not in repr(sent)
    assert sent["reward"]["base_url"] == "${oc.env:JUDGE_BASE_URL,http://127.0.0.1:8001/v1}"
    assert sent["model"]["cache_dir"] == "${oc.env:ARL_CACHE_DIR,.cache}/models"  # through ${paths.cache_dir}
    assert sent["reward"]["api_key_env"] == "JUDGE_API_KEY" and sent["agent"]["max_turns"] == 3


def test_swept_keys_come_from_the_command_line_and_the_preset(tmp_path: Path) -> None:
    multirun = {
        "hydra": {
            "sweeper": {"params": {"agent.max_turns": "1,3"}},
            "overrides": {"task": ["experiment=ablation-turns-tiny", "seed=0,1", "model=tiny"]},
        }
    }
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump(multirun))
    assert swept_keys(tmp_path) == ["agent.max_turns", "seed"]
    assert swept_keys(tmp_path / "missing") == []


def test_auto_mode_follows_wandb_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "k")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert WandbLogger().resolved_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert WandbLogger().resolved_mode() == "disabled"
    monkeypatch.setenv("WANDB_MODE", "dryrun")  # wandb's older name for offline
    assert WandbLogger().resolved_mode() == "offline"
    assert WandbLogger(mode="online").resolved_mode() == "online"  # a mode written in the config wins


class FailingTracker:
    def __init__(self) -> None:
        self.calls = 0

    def log(self, step: int, metrics: dict) -> None:
        self.calls += 1
        raise ConnectionError("the tracking server went away")


def test_a_tracker_that_fails_to_log_is_dropped_and_metrics_go_on(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    tracker = FailingTracker()
    run.trackers.append(tracker)
    for step in (1, 2, 3):
        run.log(step, {"train/reward_mean": 0.5})
    assert [m["step"] for m in run.metrics()] == [1, 2, 3]
    assert tracker.calls == 1 and run.trackers == []
    assert run.tracking_errors == ["FailingTracker.log at step 1: ConnectionError: the tracking server went away"]


@pytest.mark.integration
def test_an_unreachable_wandb_server_does_not_fail_the_run(tmp_path: Path) -> None:
    key = "sentinel-wandb-key-000000000000000000000000000000"
    env = {"WANDB_API_KEY": key, "WANDB_BASE_URL": f"http://127.0.0.1:{closed_port()}"}
    run_dir = tmp_path / "run"
    (tmp_path / "sweep" / "0").mkdir(parents=True)  # a sweep of one finished run: job=status has a table to print
    (tmp_path / "sweep" / "0" / "summary.json").write_text(json.dumps({"status": "completed", "overrides": []}))
    args = ["job=status", f"job.sweep_dir={tmp_path / 'sweep'}", "logger=wandb", "logger.mode=online"]
    args += ["logger.init_timeout_s=5", f"hydra.run.dir={run_dir}"]
    result = launch(args, tmp_path / "cache", tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    (error,) = summary["tracking_errors"]
    assert error.startswith("WandbLogger.start: ")
    assert "tracking off" in result.stderr
    assert not [p for p in run_dir.rglob("*") if p.is_file() and key in p.read_text(errors="ignore")]


def test_swanlab_builds_from_its_group_and_is_offline_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = build_group(compose_with("logger=swanlab", "logger.project=p", "logger.tags=[a]"), "logger")
    assert isinstance(logger, SwanLabLogger) and logger.project == "p" and logger.tags == ["a"]
    with pytest.raises(ConfigError, match=r"logger\.mode"):
        build_group(compose_with("logger=swanlab", "logger.mode=cloudy"), "logger")
    for name in ("SWANLAB_API_KEY", "SWANLAB_MODE"):
        monkeypatch.delenv(name, raising=False)
    assert SwanLabLogger().resolved_mode() == "offline"
    monkeypatch.setenv("SWANLAB_API_KEY", "k")
    assert SwanLabLogger().resolved_mode() == "online" and SwanLabLogger(mode="local").resolved_mode() == "local"
    monkeypatch.setenv("SWANLAB_MODE", "disabled")
    assert SwanLabLogger().resolved_mode() == "disabled"


@pytest.mark.integration
def test_a_smoke_run_with_swanlab_writes_an_offline_run_and_no_secret(tmp_path: Path) -> None:
    """No key: an offline SwanLab run under <run>/swanlog/ holding the step metrics; metrics.jsonl as ever; no key,
    token or endpoint from the environment in any file the run or SwanLab wrote."""
    secrets = {"SWANLAB_API_KEY": "", "OPENAI_API_KEY": "sentinel-openai-5c1d", "JUDGE_API_KEY": "sentinel-judge-5c1d"}
    secrets |= {"JUDGE_BASE_URL": "https://u:sentinel-url-5c1d@judge/v1", "HOME": str(tmp_path / "home")}
    run_dir = tmp_path / "run"
    args = [*FAST_RUN, "algorithm.max_steps=2", "logger=swanlab", f"hydra.run.dir={run_dir}"]
    result = launch(args, tmp_path / "cache", tmp_path, env=secrets)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["tracking_errors"] == []
    (record,) = (run_dir / "swanlog").glob("run-*/run-*.swanlab")
    data = record.read_bytes()
    assert b"train/reward_mean" in data and b"val/accuracy" in data
    config = next((run_dir / "swanlog").glob("run-*/files/config.yaml")).read_text()
    assert "hydra_overrides" in config and "logger=swanlab" in config  # the composed config, with what chose it
    written = [p for root in (run_dir, tmp_path / "home") for p in root.rglob("*") if p.is_file()]
    leaked = [p for p in written for v in secrets.values() if "sentinel" in v and v.encode() in p.read_bytes()]
    assert not leaked

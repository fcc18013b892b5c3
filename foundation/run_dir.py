"""The run directory, the one thing analysis reads: `.hydra/`, `metrics.jsonl`, `summary.json`, `attempts.jsonl`,
`run_config.json` (the composed config of its latest start: a later start must be the same run), `checkpoints/`,
`samples/`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import OmegaConf

from foundation.errors import ConfigError


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Tracker(Protocol):
    """Receives every step's metrics as they are written (`logger=wandb`: jobs/tracking.py)."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...


class RunDir:
    """Writes a run's metrics, samples and summary. `metrics.jsonl` holds one object per step, `step` first."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.trackers: list[Tracker] = []
        self.tracking_errors: list[str] = []  # one line per tracker that failed; summary.json lists them
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.path / "checkpoints"
        self.samples = self.path / "samples"
        self.scores = self.path / "scores"  # each question's score per evaluation, for analyses over questions
        self.phase = "starting"  # what the job is doing (set by the backend): an interrupted run's summary says it

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @property
    def attempts_file(self) -> Path:
        return self.path / "attempts.jsonl"

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one step to `metrics.jsonl`, then to each tracker; a tracker that fails is reported and dropped."""
        values = {k: _jsonable(v) for k, v in metrics.items()}
        with self.metrics_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        for tracker in list(self.trackers):
            try:
                tracker.log(step, values)
            except Exception as exc:  # tracking never stops training: metrics.jsonl has the step
                self.trackers.remove(tracker)
                self.tracking_errors.append(f"{type(tracker).__name__}.log at step {step}: {type(exc).__name__}: {exc}")
                print(f"tracking stopped ({self.tracking_errors[-1]}); metrics.jsonl goes on", file=sys.stderr)

    def metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_file.is_file():
            return []
        return [json.loads(line) for line in self.metrics_file.read_text(encoding="utf-8").splitlines() if line]

    def last_step(self) -> int | None:
        """The last step `metrics.jsonl` holds, or None."""
        steps = [m["step"] for m in self.metrics()]
        return max(steps) if steps else None

    def drop_metrics_after(self, step: int) -> None:
        """On resume from a checkpoint at `step`: forget what was logged after it, so no step appears twice."""
        kept = [m for m in self.metrics() if m["step"] <= step]
        tmp = self.metrics_file.with_suffix(".jsonl.tmp")  # a kill while rewriting must not lose the file
        tmp.write_text("".join(json.dumps(m) + "\n" for m in kept), encoding="utf-8")
        tmp.replace(self.metrics_file)

    def write_samples(self, name: str, records: list[dict[str, Any]]) -> None:
        self.samples.mkdir(parents=True, exist_ok=True)
        with (self.samples / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")

    def write_scores(self, name: str, scores: dict[str, float | None]) -> None:
        """`scores/<name>.json`: question id -> its score (None: missing) of one evaluation (`test_final`,
        `val_step40`), every question of it, so that a report can resample questions after the fact."""
        self.scores.mkdir(parents=True, exist_ok=True)
        path = self.scores / f"{name}.json"
        staging = path.with_suffix(".tmp")
        staging.write_text(json.dumps(scores, sort_keys=True, separators=(",", ":")) + "\n", encoding="utf-8")
        staging.replace(path)

    def check_same_run(self, config: dict[str, Any]) -> None:
        """Before a start in this directory: a directory that holds a run takes only that run again (resumed, requeued,
        extended), never a run of other settings, whose steps would mix with its checkpoints and metrics. Raises
        ConfigError naming each changed key (what may change between starts: `MAY_CHANGE`); else records `config`."""
        path = self.path / RUN_CONFIG
        config = json.loads(json.dumps(config, default=str))  # as it reads back
        if path.is_file():
            before = json.loads(path.read_text(encoding="utf-8"))
            changed = [k for k in config_changes(before, config) if not k.startswith(MAY_CHANGE)]
            if changed:
                was, now = _flat(before), _flat(config)
                listed = "; ".join(
                    f"{k}: {was.get(k, '(unset)')!r} there, {now.get(k, '(unset)')!r} now" for k in changed
                )
                raise ConfigError(
                    f"{self.path} holds a run with other settings ({listed}): start this one in another directory "
                    f"(hydra.run.dir), or resume that one with its own settings (between its starts only "
                    f"{', '.join(MAY_CHANGE)} may change)"
                )
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
        tmp.replace(path)

    def start_attempt(self, record: dict[str, Any]) -> int:
        """Append one line to `attempts.jsonl` each time the job starts in this directory (the first time, a re-run, a
        requeue after a preemption or a kill); returns how many times it has, this time included."""
        with self.attempts_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        return len(self.attempts_file.read_text(encoding="utf-8").splitlines())

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.summary_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2, ensure_ascii=False, default=str), encoding="utf-8")
        tmp.replace(self.summary_file)


RUN_CONFIG = "run_config.json"
# What may change between the starts of one run: where it writes and caches, what it logs to, when it stops, validates
# and which checkpoints it keeps, and how a study judges it (`analysis`).
MAY_CHANGE = (
    "paths.",
    "logger.",
    "analysis.",
    "algorithm.val_points",
    "algorithm.keep_checkpoints",
    "algorithm.max_steps",
    "algorithm.epochs",
    "algorithm.time_budget_s",
    "algorithm.flops_budget",
    "algorithm.gpu_s_budget",
    "algorithm.save_every",
    "algorithm.val_every",
)


def _flat(config: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists and empty dicts stay values."""
    if not isinstance(config, dict) or not config:
        return {prefix: config}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat |= _flat(value, f"{prefix}.{key}" if prefix else str(key))
    return flat


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The dotted keys whose values differ between two configs (a key in one only counts)."""
    a, b = _flat(before), _flat(after)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """step -> `checkpoint-<step>` in `folder` that the trainer finished writing: `trainer_state.json` is written
    last, and a job killed while saving (preemption, requeue) leaves a partial one."""
    return {
        int(p.name.split("-")[1]): p
        for p in folder.glob("checkpoint-*")
        if p.name.split("-")[1].isdigit() and (p / "trainer_state.json").is_file()
    }


def last_complete_checkpoint(folder: Path) -> str | None:
    """The latest complete `checkpoint-<step>` in `folder` (`complete_checkpoints`)."""
    steps = complete_checkpoints(folder)
    return str(steps[max(steps)]) if steps else None


# What a sweep may vary that is not an ablation factor (tracking tags, report tables): seeds are replicates, an
# experiment is a bundle of values (its keys are compared instead), analysis says how runs are judged, the rest does
# not change what is trained.
NOT_FACTORS = {"seed", "experiment", "logger", "hydra", "paths", "analysis"}
# the keys that name a warm start built before (its directory and digest): which one, as `warmstart.seed` says it
WARM_START_NAMES = {"warmstart.path", "warmstart.weights_sha256"}


def is_factor(key: str) -> bool:
    """False for what only draws another replicate: any seed (`seed`, `warmstart.seed`, `model.init_seed`: runs
    that differ by them are pooled, and paired by seed and warm start), the names of a warm start built before
    (`warmstart.path`: every cell of an ablation loads its warm start's one build) and the keys of NOT_FACTORS."""
    return (
        key.split(".")[0] not in NOT_FACTORS
        and key not in WARM_START_NAMES
        and not key.rsplit(".", 1)[-1].endswith("seed")
    )


def override_key(override: str) -> str:
    """`agent.max_turns` for `agent.max_turns=3`, `+x=1` and `~x`."""
    return override.split("=", 1)[0].lstrip("+~")


def sweep_overrides(sweep_dir: Path) -> list[Override]:
    """What a sweep directory's `multirun.yaml` asked for: the preset's `hydra.sweeper.params`, then the command
    line (as Hydra's basic sweeper combines them); empty for a directory that is not a sweep."""
    multirun = sweep_dir / "multirun.yaml"
    if not multirun.is_file():
        return []
    conf = OmegaConf.load(multirun)
    params = OmegaConf.select(conf, "hydra.sweeper.params") or {}
    given = [f"{k}={v}" for k, v in params.items()] + list(OmegaConf.select(conf, "hydra.overrides.task") or [])
    return OverridesParser.create().parse_overrides(given)


def git_commit(repo: Path | None = None) -> str | None:
    """The commit the code ran at (with `-dirty` when the tree had changes), or None outside a git checkout."""
    cwd = repo or Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("-dirty" if dirty.strip() else "")

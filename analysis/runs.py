"""Runs read back from run directories (a run, a sweep, a tree of them) or a W&B project, into one shape.

A run directory holds `.hydra/` (config, overrides, choices), `metrics.jsonl` (`metrics.jsonl.gz` once archived under
results/), `scores/` (each question's score per evaluation) and, once the job has ended, `summary.json`. A sweep
directory holds Hydra's `multirun.yaml` and one numbered run directory per job: jobs the sweep defines but that never
wrote a directory are kept as `not started`, so no run is silently dropped.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from foundation.run_dir import override_key, sweep_overrides

COMPLETED, FAILED, UNFINISHED, NOT_STARTED = "completed", "failed", "unfinished", "not started"
WANDB_PREFIX = "wandb:"


@dataclass
class Run:
    """One run: what it was asked to do (overrides, config, group choices) and what it wrote."""

    source: str
    name: str
    status: str
    overrides: list[str]
    config: dict[str, Any] = field(default_factory=dict)
    choices: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    # each question's score per evaluation (`scores/<split>_<name>.json`: test_final, val_final, val_step40, ...)
    items: dict[str, dict[str, float | None]] = field(default_factory=dict)

    @property
    def error(self) -> str | None:
        return self.summary.get("error")

    def value(self, key: str) -> Any:
        """A config key's value in this run; a config group's option name for a group (`model`)."""
        given = [o for o in self.overrides if override_key(o) == key]
        if self.status == NOT_STARTED and given:  # its own overrides; a sibling's config stands in for the rest
            return OverridesParser.create().parse_override(given[-1]).value()
        if key in self.choices:
            return self.choices[key]
        node = OmegaConf.select(OmegaConf.create(self.config), key, throw_on_resolution_failure=False)
        return node.get("name") if isinstance(node, DictConfig) else node


def load(sources: list[str]) -> list[Run]:
    """Every run under each source: a run or sweep directory, a tree of them, or `wandb:entity/project[/group]`."""
    runs: list[Run] = []
    for source in sources:
        if source.startswith(WANDB_PREFIX):
            runs += load_wandb(source.removeprefix(WANDB_PREFIX))
            continue
        root = Path(source)
        if not root.is_dir():
            raise FileNotFoundError(f"{source}: not a directory")
        runs += load_tree(root)
    return runs


def load_tree(root: Path) -> list[Run]:
    """Every run directory under `root` (at any depth: a run, a sweep, a folder of sweeps), and each sweep's jobs
    that never wrote one."""
    run_dirs = sorted({p.parent.parent for p in root.rglob(".hydra/overrides.yaml")}, key=_natural)
    found = [load_run_dir(d, root) for d in run_dirs]
    missing: list[Run] = []
    for sweep in sorted({p.parent for p in root.rglob("multirun.yaml")}):
        siblings = [run for d, run in zip(run_dirs, found, strict=True) if d.parent == sweep]
        missing += _not_started(sweep, root, siblings)
    return found + missing


def _natural(path: Path) -> tuple[tuple[int, int | str], ...]:
    """Job 10 after job 9."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in path.parts)


def _metrics_text(path: Path) -> str:
    """A run's `metrics.jsonl`, or its gzipped archive (results/ keeps them compressed); empty where neither exists."""
    if (plain := path / "metrics.jsonl").is_file():
        return plain.read_text()
    if (packed := path / "metrics.jsonl.gz").is_file():
        return gzip.decompress(packed.read_bytes()).decode()
    return ""


def load_run_dir(path: Path, root: Path) -> Run:
    hydra_dir = path / ".hydra"
    config = _yaml(hydra_dir / "config.yaml")
    hydra = _yaml(hydra_dir / "hydra.yaml").get("hydra", {})
    overrides = _yaml_list(hydra_dir / "overrides.yaml")
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
    metrics = [json.loads(line) for line in _metrics_text(path).splitlines() if line]
    status = summary.get("status", UNFINISHED)
    items = {f.stem: json.loads(f.read_text()) for f in sorted((path / "scores").glob("*.json"))}
    name = str(path.relative_to(root.parent))  # the sweep's name first: runs of several sweeps stay apart
    return Run(
        source=str(root),
        name=name,
        status=status,
        overrides=overrides or list(summary.get("overrides", [])),
        config=config,
        choices=dict(hydra.get("runtime", {}).get("choices", {})),
        summary=summary,
        metrics=metrics,
        items=items,
    )


def _not_started(sweep: Path, root: Path, siblings: list[Run]) -> list[Run]:
    """The jobs `multirun.yaml` defines that have no run directory (still queued, or never launched). Beyond its
    overrides, such a job's values are read from a sibling run's config (the sweep's shared settings)."""
    batches = BasicSweeper.split_arguments(sweep_overrides(sweep), None)  # the sweep's own job order
    jobs = [job for batch in batches for job in batch]
    present = {Path(run.name).name for run in siblings}
    config, choices = (siblings[0].config, siblings[0].choices) if siblings else ({}, {})
    return [
        Run(
            source=str(root),
            name=str((sweep / str(num)).relative_to(root.parent)),
            status=NOT_STARTED,
            overrides=list(job),
            config=config,
            choices=choices,
        )
        for num, job in enumerate(jobs)
        if str(num) not in present
    ]


def load_wandb(path: str, api: Any = None) -> list[Run]:
    """Runs of a W&B project (`entity/project`, or `entity/project/<group>` for one sweep) logged with
    `logger=wandb`; online, with WANDB_API_KEY set."""
    if api is None:
        import wandb

        api = wandb.Api()
    entity, project, *group = path.split("/", 2)
    runs = []
    for remote in api.runs(f"{entity}/{project}", filters={"group": group[0]} if group else None):
        config = dict(remote.config)
        summary = dict(remote.summary_metrics)
        status = summary.get("status") or {"running": UNFINISHED, "finished": COMPLETED}.get(remote.state, FAILED)
        metrics = [
            {"step": row["_step"], **{k: v for k, v in row.items() if not k.startswith("_")}}
            for row in remote.scan_history()
        ]
        runs.append(
            Run(
                source=f"{WANDB_PREFIX}{path}",
                name=remote.name,
                status=status,
                overrides=list(config.pop("hydra_overrides", [])),
                config=config,
                choices=dict(config.pop("hydra_choices", {})),
                summary=summary,
                metrics=metrics,
            )
        )
    return runs


def _yaml(path: Path) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.is_file() else {}  # type: ignore[return-value]


def _yaml_list(path: Path) -> list[str]:
    return [str(o) for o in OmegaConf.load(path)] if path.is_file() else []

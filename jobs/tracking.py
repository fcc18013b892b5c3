"""Tracking beyond `metrics.jsonl` (which every run writes, and which analysis reads: a tracker is a mirror):
`logger=wandb` mirrors a run's step metrics and summary to Weights & Biases (`conf/logger/wandb.yaml`),
`logger=swanlab` to SwanLab (`conf/logger/swanlab.yaml`).

`mode: auto` follows `WANDB_MODE` (`SWANLAB_MODE`) when it is set, else is offline (into `<run>/wandb/`
(`<run>/swanlog/`); `wandb sync` (`swanlab sync`) uploads it later) unless `WANDB_API_KEY` (`SWANLAB_API_KEY`) is set.
A tracker never stops training: one that fails to start, log or finish (no network, a bad key, a server down) is
reported once and left out; `metrics.jsonl` has everything. group = the sweep, tags = the swept keys' values, name =
the run's overrides (less the logger's). The config sent is the composed one with every value read from the
environment left as its `${oc.env:...}` interpolation, so no key or endpoint leaves in it; keys come only from the
environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from foundation.run_dir import RunDir, is_factor, override_key, sweep_overrides
from foundation.schema import number, one_of

MODES = ("auto", "online", "offline", "disabled")
WANDB_MODES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline", "disabled": "disabled"}
# summary.json keys mirrored into the W&B run summary.
SUMMARY_KEYS = ("status", "error", "wall_s", "steps", "val_accuracy_before", "val_accuracy_after", "device")


def swept_keys(sweep_dir: Path) -> list[str]:
    """The keys a multirun sweeps (command line and `hydra.sweeper.params`)."""
    return sorted({o.key_or_group for o in sweep_overrides(sweep_dir) if o.is_sweep_override()})


def env_free_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config, except that a value read from the environment (`${oc.env:...}`, directly or through
    another interpolation) stays the interpolation text."""

    def escape(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: escape(v) for k, v in node.items()}
        if isinstance(node, list):
            return [escape(v) for v in node]
        return node.replace("${", "\\${") if isinstance(node, str) and "oc.env" in node else node

    raw = OmegaConf.to_container(cfg, resolve=False)
    raw.pop("hydra", None)  # Hydra's own node (present when composed with return_hydra_config) is not the run's config
    return OmegaConf.to_container(OmegaConf.create(escape(raw)), resolve=True)


@dataclass
class Naming:
    """What a tracker calls a run: the sweep as its group, the swept keys' values as tags, its overrides as name,
    and the config without environment values (with Hydra's overrides and group choices beside it)."""

    group: str | None
    tags: list[str]
    name: str | None
    config: dict[str, Any]

    @classmethod
    def of(cls, cfg: DictConfig, hydra: DictConfig, tags: list[str]) -> Naming:
        task = {override_key(o): o for o in hydra.overrides.task}
        group, tags = None, list(tags)
        if hydra.mode == RunMode.MULTIRUN:
            sweep_dir = Path(hydra.sweep.dir)
            experiment = hydra.runtime.choices.get("experiment")
            group = f"{experiment}/{sweep_dir.name}" if experiment else sweep_dir.name
            tags += [task[k][:64] for k in swept_keys(sweep_dir) if k in task and is_factor(k)]
        name = ",".join(sorted(o for k, o in task.items() if not k.startswith(("logger", "hydra")))) or None
        config = env_free_config(cfg)
        config |= {"hydra_overrides": list(hydra.overrides.task), "hydra_choices": dict(hydra.runtime.choices)}
        return cls(group, tags, name, config)


@dataclass
class WandbLogger:
    """`logger=wandb`: one W&B run per run directory, fed by `RunDir.log` and closed with the run's summary."""

    name: str = "wandb"
    project: str = "agentic-rl"
    entity: str | None = None
    mode: str = one_of("auto", MODES)
    tags: list[str] = field(default_factory=list)
    init_timeout_s: float = number(90.0, gt=0)

    def __post_init__(self) -> None:
        self._run: Any = None

    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        if (env_mode := os.environ.get("WANDB_MODE", "").strip().lower()) in WANDB_MODES:
            return WANDB_MODES[env_mode]
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"

    def start(self, run: RunDir, cfg: DictConfig, hydra: DictConfig) -> None:
        import wandb  # the `wandb` extra; only a run with logger=wandb needs it

        named = Naming.of(cfg, hydra, self.tags)
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            mode=self.resolved_mode(),
            dir=str(run.path),
            group=named.group,
            tags=named.tags,
            name=named.name,
            config=named.config,
            settings=wandb.Settings(console="off", save_code=False, disable_git=True, init_timeout=self.init_timeout_s),
            reinit="finish_previous",
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        if self._run is None:
            return
        self._run.summary.update({k: summary[k] for k in SUMMARY_KEYS if k in summary})
        self._run.finish(exit_code=0 if summary.get("status") == "completed" else 1)
        self._run = None


SWANLAB_MODES = ("auto", "online", "local", "offline", "disabled")


@dataclass
class SwanLabLogger:
    """`logger=swanlab`: one SwanLab run per run directory (its files under `<run>/swanlog/`), fed by `RunDir.log`
    and closed with the run's summary, named and grouped as `logger=wandb` names them."""

    name: str = "swanlab"
    project: str = "agentic-rl"
    workspace: str | None = None
    mode: str = one_of("auto", SWANLAB_MODES)
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._run: Any = None

    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        if (env_mode := os.environ.get("SWANLAB_MODE", "").strip().lower()) in SWANLAB_MODES[1:]:
            return env_mode
        return "online" if os.environ.get("SWANLAB_API_KEY") else "offline"

    def start(self, run: RunDir, cfg: DictConfig, hydra: DictConfig) -> None:
        import swanlab  # the `swanlab` extra; only a run with logger=swanlab needs it

        named = Naming.of(cfg, hydra, self.tags)
        self._run = swanlab.init(
            project=self.project,
            workspace=self.workspace,
            mode=self.resolved_mode(),
            log_dir=str(run.path / "swanlog"),
            group=named.group,
            tags=named.tags,
            name=named.name,
            config=named.config,
            reinit=True,
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in metrics.items() if isinstance(v, int | float)}, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        if self._run is None:
            return
        ok = summary.get("status") == "completed"
        self._run.finish(state="success" if ok else "crashed", error=None if ok else str(summary.get("error")))
        self._run = None

"""Composing our config in-process, as launch.py does, for the tests that run in .venv-verl."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from tests.conftest import ROOT

AGENTS = sorted(p.stem for p in (ROOT / "conf" / "agent").glob("*.yaml"))
MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))  # the old names are aliases, not files
FINETUNES = sorted(p.stem for p in (ROOT / "conf" / "finetune").glob("*.yaml"))


def compose_config(overrides: list[str], cache: Path) -> DictConfig:
    """The config launch.py would run, with Hydra's runtime choices set (`${hydra:runtime.choices.agent}`)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.cache_dir={cache}", *overrides], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg

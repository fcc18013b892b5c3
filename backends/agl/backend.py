"""The classes `conf/backend/verl.yaml` and `conf/backend/dev.yaml` build: their settings (`settings.py`) and the
entry point that runs them.

The run code (`train.py`, `dev.py`) imports agent-lightning and verl, so it is imported only when a run starts, never
while a config is validated; it depends on the settings, and the settings depend on nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.agl.settings import DevSettings, VerlSettings
from backends.setup import TrainSetup


@dataclass
class VerlBackend(VerlSettings):
    """agent-lightning's `Trainer(algorithm=agl.VERL(...))` (backend=verl)."""

    def train(self, setup: TrainSetup) -> dict[str, Any]:
        from backends.agl.train import train_verl

        return train_verl(self, setup)


@dataclass
class DevBackend(DevSettings):
    """agent-lightning's `Trainer.dev` against an endpoint (backend=dev)."""

    def train(self, setup: TrainSetup) -> dict[str, Any]:
        from backends.agl.dev import run_dev

        return run_dev(self, setup)

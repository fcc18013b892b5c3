"""What verl 0.9.1 needs to run beside this project's trl 1.16, applied in every Ray worker process of a run
(`worker_process_setup_hook` of the run's runtime env, `config.py`).

The hook runs when a worker process starts, before Ray gives it an actor and that actor's GPUs (CUDA_VISIBLE_DEVICES):
it must not import torch or verl, whose import initialises CUDA with every GPU of the node visible, after which each
actor of the node would take the first one (NCCL: "Duplicate GPU detected", seen on 2 GPUs). So the patch waits for
verl's module to be imported, as the actor's own code does."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

PATCHED = "verl.utils.import_utils"


def hide_trl(module: ModuleType) -> None:
    """verl's actor patches `state_dict` of trl's value-head model whenever trl is importable, importing it from
    `trl.experimental.ppo` or `trl`; trl 1.16 has it in neither, so building the actor fails. The patch is for PPO
    critics, which GRPO has none of: verl is told trl is not there."""
    module.is_trl_available = lambda: False


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds `PATCHED` as Python would, and applies `hide_trl` once the module has run."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name != PATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def run_and_patch(module: ModuleType) -> None:
            run(module)
            hide_trl(module)

        spec.loader.exec_module = run_and_patch  # type: ignore[method-assign]
        return spec


# verl's modules that bind `is_trl_available` by name (`from verl.utils.import_utils import is_trl_available`)
BINDERS = ("verl.utils.model", "verl.models.transformers.monkey_patch")


def worker_setup() -> None:
    """Applies `hide_trl` to verl in this process: now if verl is imported already, else when it is."""
    if PATCHED in sys.modules:
        for name in (PATCHED, *BINDERS):
            if name in sys.modules:
                hide_trl(sys.modules[name])
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())

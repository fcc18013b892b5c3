"""Renamed `jobs` (the job functions that conf/job/ names). Kept for one release: run configs recorded before the
rename (`_target_: experiments.train.run`, results/ and SLURM jobs submitted then) still import, and `experiments.X` is
the very module `jobs.X` (one module object, so its classes are the same classes)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType


class _Renamed(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `experiments.X` as `jobs.X`."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(f"{__name__}."):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module("jobs" + spec.name.removeprefix(__name__))
        self._specs[module.__name__] = module.__spec__  # the import machinery sets the alias's spec on it next
        return module

    def exec_module(self, module: ModuleType) -> None:
        """`jobs.X` ran when it was imported; it keeps its own spec."""
        module.__spec__ = self._specs.pop(module.__name__)


if not any(isinstance(finder, _Renamed) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Renamed())

"""Hybrid reward: a weighted sum of other rewards (`conf/reward/hybrid.yaml`: rule + LLM judge by default).

Missing when any term is missing (a judge that could not be reached), so a partial sum never passes for a score.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hydra.utils import instantiate

from agent.trajectory import Trajectory


@dataclass
class Hybrid:
    terms: dict[str, Any]
    weights: dict[str, float]  # per term (a term not named: 1.0)
    name: str = "hybrid"

    def __post_init__(self) -> None:
        # The terms arrive as configs (`_recursive_: false` in the yaml: Hydra would turn built dataclasses back
        # into configs on the way in) and are built here.
        self.terms = {k: instantiate(v) if isinstance(v, Mapping) else v for k, v in self.terms.items()}
        unknown = sorted(set(self.weights) - set(self.terms))
        if unknown:
            raise ValueError(f"reward.weights.{unknown[0]} names no term (terms: {', '.join(self.terms)})")

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float | None:
        total = 0.0
        for key, term in self.terms.items():
            value = term(task, trajectory)
            if value is None:
                return None
            total += self.weights.get(key, 1.0) * value
        return total

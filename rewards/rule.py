"""Rule reward: a fixed amount when the agent's SQL ran without error (`conf/reward/rule.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.trajectory import Trajectory
from foundation.schema import number


@dataclass
class ExecutedSQL:
    """`amount` when the last query the agent ran executed without error, 0 when it failed.

    `no_sql_penalty` is the optional format term: what a trajectory with no parseable SQL gets (e.g. -1.0).
    """

    name: str = "rule"
    amount: float = number(0.1, ge=0)  # for a last query that ran
    no_sql_penalty: float = number(0.0, le=0)  # for no SQL at all: a penalty, 0 or below

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float:
        if trajectory.final_sql is None:
            return self.no_sql_penalty
        return self.amount if trajectory.last_execution_ok else 0.0

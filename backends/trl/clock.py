"""An arm's clock (backend=trl): one for GRPO's step log and the control arms' alike.

It keeps the arm's training seconds (validation not counted) beside its compute (backends/compute.py), says whether
its budget is spent (`algorithm.time_budget_s`, `flops_budget`, `gpu_s_budget`), and at each step's end whether that
step is the last and whether it validates: every `every` steps (`algorithm.val_every`, `sft_val_every`), or with
`algorithm.val_points` at each further 1/val_points of its budget spent, whatever its steps are (GRPO's of 128
rollouts, SFT's of 32 demonstrations), so the arms of a study are validated at the same points of their compute; and
always at the last step. Each verdict is rank 0's, on every rank: ranks' training seconds differ slightly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from backends.algorithm import GRPO
from backends.compute import ComputeCount
from backends.sft import agreed


@dataclass(frozen=True)
class StepEnd:
    """What a step's end decides."""

    spent: bool  # the budget is spent: training stops here
    last: bool  # the arm's last step: `max_steps` reached, or the budget spent
    validates: bool  # at the cadence, or at the last step (the "final" validation)


class Clock:
    """An arm's training seconds, compute, budget and validation cadence (see the module's docstring)."""

    def __init__(self, algo: GRPO, every: int, compute: ComputeCount, train_s: float = 0.0) -> None:
        self.algo = algo
        self.every = every  # validate every this many steps (without `val_points`)
        self.compute = compute  # every rank's tokens and FLOPs so far (`compute/*`)
        self.train_s = train_s  # training seconds so far (a resumed run's before its restart too): train/elapsed_s
        self.point = 0  # the budget points (`val_points`) passed so far
        self.started = time.perf_counter()

    def start(self) -> None:
        """Training goes on from here: the seconds until the next `lap` count."""
        self.started = time.perf_counter()

    def lap(self) -> float:
        """The training seconds since `start`, added to `train_s`."""
        seconds = time.perf_counter() - self.started
        self.train_s += seconds
        return seconds

    def spent(self) -> bool:
        """Whether the time, FLOPs or GPU-seconds budget is spent, rank 0's verdict on every rank (a collective)."""
        algo = self.algo
        out_of_time = algo.time_budget_s is not None and self.train_s >= algo.time_budget_s
        return agreed(out_of_time or self.compute.spent(algo.flops_budget, algo.gpu_s_budget))

    def step_end(self, step: int, max_steps: int) -> StepEnd:
        """The verdicts at the end of step `step` of `max_steps`, once its seconds and compute are counted (two
        collectives, in this order on every rank: the budget, then the cadence)."""
        spent = self.spent()
        last = step == max_steps or spent
        return StepEnd(spent=spent, last=last, validates=agreed(self._due(step, max_steps)) or last)

    def _due(self, step: int, max_steps: int) -> bool:
        """Whether the cadence validates at `step` (this rank's view)."""
        points = self.algo.val_points
        if points is None:
            return step % self.every == 0
        fraction = self.algo.budget_fraction(self.compute.flops, self.compute.gpu_s, self.train_s, step, max_steps)
        point = min(int(fraction * points), points)
        if point <= self.point:
            return False
        self.point = point
        return True

"""What a study declares before its runs (`analysis` in conf/config.yaml, set by an experiment preset): the metric its
verdicts are judged on, the unit that is independent (the cluster), the family-wise error rate, and the comparisons.

Each run records the declaration in its config (`.hydra/config.yaml`), so the report reads it from the runs it judges:
the declared comparisons form one family, adjusted by Holm; every other comparison the report prints is labelled
exploratory and uncorrected. A comparison names its two sides as overrides, matched against each run's values
(`algorithm=grpo` matches a run whose `algorithm` option is grpo; `agent.check_step=false` one whose key has that
value), so a declaration reads like the sweep that makes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from foundation.schema import number, one_of

# The metrics a study can be judged on (analysis/report.py computes each from a run's metrics.jsonl): the split is
# the metric's first word.
METRICS = {
    "val_final": "validation accuracy at the last step",
    "val_best": "best validation accuracy over steps",
    "val_initial": "validation accuracy before GRPO",
    "test_final": "test accuracy of the final model (the test split, scored once at the end)",
    "reward_final": "training reward at the last step",
}
WARM_START = "warm_start"  # the cluster of runs that share a warm start's weights (their digest, `sft.weights_sha256`)
ROLES = ("primary", "secondary")


@dataclass
class Declared:
    """One declared comparison: treatment - baseline on the study's metric."""

    name: str  # how the report and the ledger name it
    treatment: list[str]  # overrides a treatment run matches (algorithm=grpo)
    baseline: list[str]  # overrides a baseline run matches (algorithm=sft_ceiling)
    role: str = one_of("primary", ROLES)  # primary: the question; secondary: declared too, in the same Holm family


@dataclass
class Study:
    """`analysis` in conf/config.yaml."""

    metric: str = one_of("test_final", tuple(METRICS))  # the metric every declared verdict is judged on
    cluster: str = WARM_START  # the independent unit: warm_start, or a config key whose value names a run's cluster
    alpha: float = number(0.05, gt=0, lt=1)  # the family-wise error rate over the declared comparisons (Holm)
    comparisons: list[Declared] = field(default_factory=list)  # declared before the runs; none: all exploratory

    def __post_init__(self) -> None:
        names = [c.name for c in self.comparisons]
        if len(set(names)) < len(names):
            raise ValueError(f"analysis.comparisons: names must differ, got {names}")
        for c in self.comparisons:
            for side in (c.treatment, c.baseline):
                if not side or any("=" not in o for o in side):
                    raise ValueError(
                        f"analysis.comparisons[{c.name}]: treatment and baseline are lists of key=value overrides, "
                        f"got {side}"
                    )

    @property
    def split(self) -> str:
        """The split the metric scores: val, test or train (the reward)."""
        return {"test": "test", "reward": "train"}.get(self.metric.split("_")[0], "val")

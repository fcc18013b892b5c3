"""`experiments.train.run`, as run configs recorded before the rename to `jobs/` name it: the very function."""

from jobs.train import run

__all__ = ["run"]

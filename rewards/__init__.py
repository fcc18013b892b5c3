"""Rewards: `(task, trajectory) -> float` (`conf/reward/*.yaml`)."""

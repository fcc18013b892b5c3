"""Moved to `backends/sft.py` (the warm start is every backend's phase). Kept for the run configs results/ recorded
before the move, which name `backends.trl.sft.SFTWarmstart` (tests/test_config.py resolves each recorded target)."""

from backends.sft import SFTWarmstart

__all__ = ["SFTWarmstart"]

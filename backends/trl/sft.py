"""Moved to `backends/sft.py` (the warm start is every backend's phase). Kept for one release: the run configs
recorded before the move (`_target_: backends.trl.sft.SFTWarmstart`, results/ and SLURM jobs submitted then)."""

from backends.sft import SFTWarmstart

__all__ = ["SFTWarmstart"]

"""What verl 0.9.1 needs to run beside this project's trl 1.16, applied in every Ray worker process of a run
(`worker_process_setup_hook` of the run's runtime env, `config.py`)."""

from __future__ import annotations


def worker_setup() -> None:
    """verl's actor patches `state_dict` of trl's value-head model whenever trl is importable, importing it from
    `trl.experimental.ppo` or `trl`; trl 1.16 has it in neither, so building the actor fails. The patch is for PPO
    critics, which GRPO has none of: verl is told trl is not there."""
    from verl.utils import import_utils

    import_utils.is_trl_available = lambda: False

"""The job functions' old package name (now `jobs/`), kept for the run configs results/ recorded before the rename:
they name `experiments.train.run` (tests/test_config.py resolves every `_target_` a recorded config names)."""

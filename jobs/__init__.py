"""The jobs launch.py dispatches (`conf/job/*.yaml`): each is a `run(cfg) -> summary` function."""

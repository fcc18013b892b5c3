"""This project's Hydra launchers (`conf/hydra/launcher/`). Hydra loads launchers only from `hydra_plugins`."""

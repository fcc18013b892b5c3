"""The schema of `hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml): hydra-submitit-launcher's SLURM keys plus
`wait` and `srun_args`. Hydra imports this module when it scans for plugins, which registers it."""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf


@dataclass
class SlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.arl_launchers.slurm_launcher.SlurmLauncher"
    # false: submit the jobs and return (`python -m analysis.status <sweep_dir>` shows them later)
    wait: bool = True
    # arguments of the `srun` that starts the job inside its allocation: one task on the first node runs the job
    srun_args: list[str] | None = field(default_factory=lambda: ["--nodes=1", "--ntasks=1"])


ConfigStore.instance().store(group="hydra/launcher", name="slurm_schema", node=SlurmConf, provider="arl_launchers")

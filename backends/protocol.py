"""What jobs/ asks of a training backend: the interface every backend (`conf/backend/<name>.yaml`'s class) implements.

A run asks, in this order, before any weights load: `processes` (how many processes jobs/ starts for it), `check`
(settings that rule each other out, ConfigError naming the key), `plans` (memory and disk, each refused when it does
not fit); then `train` in each process, or `prepare` alone for `job=validate` (everything training would write and
check first, no training). `needs` says what the backend wants of the machine (`job=doctor`'s table). jobs/ never
names a backend: adding one is a class with these members and a YAML file (README, "Adding a backend").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from backends.setup import TrainSetup


@dataclass(frozen=True)
class Needs:
    """What a backend wants of the machine it runs on, as `job=doctor` checks it."""

    cuda: bool = False  # CUDA GPUs, resources.gpus_per_node of them on each node (else CPU or GPUs both work)
    packages: tuple[str, ...] = ()  # distributions that must be installed
    pinned_extra: str | None = None  # the pyproject extra whose pins must hold exactly (and its own requirements)
    vllm: bool = False  # vLLM, a version it ran with
    ray_across_nodes: bool = False  # a Ray cluster over the allocation when resources.nodes > 1


class Backend(Protocol):
    """A training backend, built from `conf/backend/<name>.yaml` (its keys are the class's fields)."""

    name: str

    @property
    def needs(self) -> Needs:
        """What the machine must have (`job=doctor`)."""
        ...

    def processes(self, nodes: int, gpus_per_node: int) -> int:
        """How many processes of this run jobs/ starts (jobs/ranks.py: torchrun, or srun in a SLURM job), each
        running `train`: one a GPU for a data-parallel backend, 1 for one that places its own workers (Ray)."""
        ...

    def check(self, setup: TrainSetup, processes: int) -> None:
        """Settings that rule each other out, before anything loads: a ConfigError naming the key to change."""
        ...

    def plans(self, setup: TrainSetup, processes: int, gpu_memory_gb: float | None) -> dict[str, dict[str, Any]]:
        """The run's plans by name (`memory_plan`, `disk_plan`; each with its words in `text`), kept in the
        summary; a ConfigError when one does not fit. `gpu_memory_gb`: each GPU's memory (None: not known here, no
        memory plan). `{}` where the backend plans nothing before it starts."""
        ...

    def prepare(self, setup: TrainSetup) -> dict[str, Any]:
        """Everything training writes and checks before its first step, without training (`job=validate`, on
        CPU): the backend's own settings derived from ours and validated by it; what it found."""
        ...

    def train(self, setup: TrainSetup) -> dict[str, Any]:
        """The run, in this process (one of `processes`): its results, which summary.json keeps."""
        ...

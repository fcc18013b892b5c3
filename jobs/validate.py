"""job=validate: everything a run does before its first step, on CPU, for any backend: our groups built and
validated, the backend's checks, then its `prepare` (backends/protocol.py): what training would write and check first
(backend=trl: the run's task splits and TRL's GRPOConfig; backend=verl: `<run>/verl/` and `<run>/verl_config.yaml`,
validated by verl too), without training."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from backends.protocol import Backend
from foundation.run_dir import RunDir
from jobs.config import build_components
from jobs.train import train_setup


def run(cfg: DictConfig, run_dir: RunDir) -> dict[str, Any]:
    parts = build_components(cfg)
    backend: Backend = parts["backend"]
    setup = train_setup(cfg, parts, run_dir)
    backend.check(setup, backend.processes(int(cfg.resources.nodes), int(cfg.resources.gpus_per_node)))
    return backend.prepare(setup)

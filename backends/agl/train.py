"""backend=verl: agent-lightning's Trainer with `agl.VERL` (verl GRPO, FSDP, vLLM rollouts) and our agent.

    our groups -> verl config (backends/agl/config.py, validated) -> agl.VERL
    agl.Trainer(algorithm, n_runners, LLM proxy, adapter, tracer, store) .fit(our agent as a LitAgent, tasks)

On several nodes (`resources.nodes` > 1) Ray must run across the allocation: unless RAY_ADDRESS names a cluster
already, the job starts one over its SLURM allocation (`backends.ray_cluster.start_ray_cluster`: the head here, a
worker on each other node) and verl's entry point joins it instead of starting a local one.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from omegaconf import OmegaConf

from backends.agl import agl as wiring
from backends.agl.agl import agl
from backends.agl.config import build_verl_config, own_hydra
from backends.agl.settings import VerlSettings
from backends.ray_cluster import start_ray_cluster
from backends.setup import TrainSetup
from foundation.errors import ConfigError

log = logging.getLogger(__name__)


def train_verl(backend: VerlSettings, setup: TrainSetup) -> dict[str, Any]:
    if setup.warmstart is not None:
        raise ConfigError(f"warmstart={setup.warmstart.name}: backend=verl has no warm start (add warmstart=none)")
    run = setup.run
    config = build_verl_config(setup.model, setup.finetune, setup.algorithm, backend, run.path, setup.seed)
    OmegaConf.save(config, run.path / "verl_config.yaml")
    if backend.nodes > 1 and not os.environ.get("RAY_ADDRESS") and start_ray_cluster() == "local":
        raise RuntimeError(
            f"resources.nodes={backend.nodes}, but this is not a job of several SLURM nodes: run it with "
            "hydra/launcher=slurm, or start Ray across the nodes yourself and export RAY_ADDRESS"
        )
    train_tasks, val_tasks = setup.data.train_tasks(), setup.data.val_tasks()
    with own_hydra():  # agl.VERL composes with Hydra's global instance, which launch.py holds
        algorithm = agl.VERL(
            OmegaConf.to_container(config, resolve=True),  # type: ignore[arg-type]
            daemon_cls=wiring.FailClosedDaemon,
        )
    store, port = wiring.store_and_port(backend)
    trainer = agl.Trainer(
        algorithm=algorithm,
        n_runners=backend.n_runners,
        port=port,
        store=store,
        llm_proxy=wiring.proxy([]),  # verl's daemon points it at the vLLM servers once they are up
        tracer=wiring.tracer(backend),
        adapter=wiring.adapter(backend),
    )
    results: dict[str, Any] = {
        "verl_config": str(run.path / "verl_config.yaml"),
        "train_tasks": len(train_tasks),
        "val_tasks": len(val_tasks),
        "n_runners": trainer.n_runners,
        "adapter": type(trainer.adapter).__name__,
        "store": backend.store_address or "in-process",
        # agent-lightning 0.3's daemon builds verl's batch without the sampler's log-probs: no correction can apply
        "is_correction": "none (not available on backend=verl)",
    }
    if setup.algorithm.is_correction != "none":
        log.warning(
            "algorithm.is_correction=%s is not applied on backend=verl: agent-lightning 0.3's daemon does not pass "
            "the sampler's log-probs to verl",
            setup.algorithm.is_correction,
        )
    if not backend.fit:
        return results | {"fit": "skipped (backend.fit=false)"}
    start = time.monotonic()
    # verl's daemon sets the temperature (train or validation); each call's reply is one triplet's response.
    per_call = {"max_tokens": setup.algorithm.max_tokens_per_turn or setup.algorithm.max_response_length}
    rollouts = wiring.AgentRollouts(setup.agent, setup.reward, per_call, setup.algorithm.reward_timeout_s)
    trainer.fit(rollouts, train_dataset=train_tasks, val_dataset=val_tasks)
    return results | {"fit": "done", "wall_s": time.monotonic() - start}

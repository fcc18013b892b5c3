"""A reward-only pool filtered to the tasks its starting policy solves sometimes (`algorithm.pool_samples`).

Before training, the policy the arms start from samples `pool_samples` rollouts of each RL task (at the training
temperature); the tasks it gets right on some but not all of them stay. Those are the tasks whose GRPO groups carry
a signal; a task always solved or never solved gives every rollout of its group one reward. The pool depends only on
the starting weights and the settings, so it is worked out once and kept in `<pools_dir>/<key>.json` for every arm and
seed that starts from the same weights (arms running side by side wait for the first to write it).

The file also records what sampling it cost (prompt tokens prefilled, tokens generated, their FLOPs, its wall seconds
and GPU-seconds): every arm that trains on the pool is charged that, whichever run sampled it (backends/compute.py).

`train_on_pool` is a backend=trl run's pool phase, over its context (backends/trl/context.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agent.rollout import Agent, Reward
from backends.algorithm import GRPO, SFTControl
from backends.compute import inference_flops
from backends.sft import agreed, weights_digest
from backends.trl.context import RunContext
from backends.trl.rollouts import validate_policy
from foundation.ranks import is_main, world_size
from inference.policy_server import PolicyServer


def pool_key(start: str, tasks: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    """What the pool depends on: the starting weights' digest, the tasks and the sampling settings."""
    key = [start, sorted(str(t["id"]) for t in tasks), settings]
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


CHUNK_ROLLOUTS = 1024  # rollouts sampled together (a training step's batch is about this size or less)
POOL_ROUTE = "pool"  # the pool's rollouts' route names: sampled as in training, never named as validation's (`val`)


def sample_pool(
    agent: Agent,
    tasks: list[dict[str, Any]],
    server: PolicyServer,
    load: Callable[[], None],
    metric: Reward,
    sampling: dict[str, Any],
    samples: int,
    reward_timeout_s: float | None,
    parameters: int,
    ranks: int,
) -> dict[str, Any]:
    """`samples` rollouts of each task (in chunks, each after `load` puts the policy into the server's engine); the
    ids of the tasks right on some but not all of them, and how many were never and always right. A rollout that
    fails counts as wrong. And what it cost: the tokens the server's engine prefilled and generated, their FLOPs
    (2 x `parameters` each), the wall seconds, and GPU-seconds: wall seconds x `ranks` (the run's ranks hold their
    GPUs while this one samples)."""
    began = time.perf_counter()
    prefilled, generated = server.prefilled_tokens, server.generated_tokens
    right: list[int] = []
    per_chunk = max(1, CHUNK_ROLLOUTS // samples)
    for start in range(0, len(tasks), per_chunk):
        chunk = tasks[start : start + per_chunk]
        load()
        repeated = [task for task in chunk for _ in range(samples)]
        _, rollouts = validate_policy(agent, repeated, server, metric, sampling, reward_timeout_s, route=POOL_ROUTE)
        right += [
            sum((r.reward or 0.0) >= 1.0 for r in rollouts[i * samples : (i + 1) * samples]) for i in range(len(chunk))
        ]
    wall_s = time.perf_counter() - began
    prefilled, generated = server.prefilled_tokens - prefilled, server.generated_tokens - generated
    return {
        "samples": samples,
        "tasks": len(tasks),
        "kept": [str(t["id"]) for t, n in zip(tasks, right, strict=True) if 0 < n < samples],
        "never_right": sum(n == 0 for n in right),
        "always_right": sum(n == samples for n in right),
        "prefill_tokens": prefilled,
        "generated_tokens": generated,
        "flops": inference_flops(parameters, prefilled, generated),
        "wall_s": wall_s,
        "ranks": ranks,
        "gpu_s": wall_s * ranks,
    }


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        yield


def filtered_pool(
    tasks: list[dict[str, Any]], path: Path, sample: Callable[[], dict[str, Any]], exclusive: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The tasks of the pool kept at `path`, sampled (`sample`) and written there first when it is not; `exclusive`:
    hold a file lock meanwhile (one process a run; the ranks of one run are not locked)."""
    with _locked(path) if exclusive else contextlib.nullcontext():
        if path.is_file():
            record = json.loads(path.read_text(encoding="utf-8")) | {"reused": True}
            if "flops" not in record:  # an arm trained on it would be charged nothing for it
                raise RuntimeError(
                    f"{path}: a pool sampled before its compute was recorded; delete it to sample it again (its "
                    "FLOPs and GPU-seconds are charged to every arm that trains on it)"
                )
        else:
            record = sample()
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_suffix(".tmp")
            staging.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
            staging.replace(path)
    kept = set(record["kept"])
    pool = [t for t in tasks if str(t["id"]) in kept]
    if not pool:
        raise RuntimeError(
            f"algorithm.pool_samples={record['samples']}: none of {record['tasks']} tasks is solved sometimes "
            f"({record['never_right']} never, {record['always_right']} always): nothing to train on, as GRPO "
            "learns only from a task whose rollouts' rewards differ. algorithm.pool_samples=null trains on every "
            "task anyway (a smoke run: experiment=smoke); a warm start that solves some tasks some of the time "
            f"fills the pool (its record: {path})"
        )
    return pool, {k: v for k, v in record.items() if k != "kept"} | {"kept": len(pool), "file": str(path)}


def trains_on_pool(algo: GRPO) -> bool:
    """Whether the arm's training data comes from the filtered pool (`algorithm.pool_samples`): GRPO's and RFT's tasks,
    gold SFT's demonstrations of them (`sft_demos=rl`); not SFT continued on the warm start's own demonstrations."""
    return algo.pool_samples is not None and not (isinstance(algo, SFTControl) and algo.sft_demos == "warmstart")


def train_on_pool(ctx: RunContext) -> None:
    """The pool phase: the arm's training tasks become the pool of the weights it starts from (`pool_of`), and the
    summary's `train_tasks` counts them."""
    start = weights_digest(ctx.begin.checkpoint) if ctx.begin.checkpoint else f"untrained {ctx.tasks.source}"
    ctx.tasks.train, ctx.results["pool"] = pool_of(ctx, ctx.tasks.train, start)
    ctx.results["train_tasks"] = len(ctx.tasks.train)


def pool_of(ctx: RunContext, tasks: list[dict[str, Any]], start: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The `tasks` the starting policy (`ctx.model`, whose weights `start` names) solves some but not all of
    `algorithm.pool_samples` times: worked out once per starting weights and settings, kept beside the shared warm
    starts (or in the run's checkpoints without one), read by every later run; and the summary's `pool`. What
    sampling the pool cost (at `ctx.compute`'s parameters and ranks, when this run samples it) is charged to
    `ctx.compute`, whichever run sampled it: this arm trains on the pool."""
    setup, algo = ctx.setup, ctx.algo
    sampling = algo.sampling(algo.temperature)
    settings = {
        "samples": algo.pool_samples,
        "sampling": sampling,
        "lengths": [algo.max_prompt_length, algo.max_response_length],
        "agent": repr(setup.agent),
        "metric": repr(ctx.metric),
        "route": POOL_ROUTE,  # in the key: pools sampled under validation's route names (agent=lit: greedy) are stale
    }
    pools = Path(setup.warmstart.cache_dir) / "pools" if setup.warmstart is not None else setup.run.checkpoints
    path = pools / f"pool-{pool_key(start, tasks, settings)}.json"
    server = None
    if agreed(not path.is_file()):  # every rank loads (a sharded model's weights are gathered by all)
        policy = ctx.backend.weights(ctx.device, ctx.compute_dtype).for_generation(ctx.model)
        server = ctx.backend.policy_server(policy, ctx.tokenizer, setup)
        server.load(policy)
        if not is_main():
            server.engine.sleep()

    def sample() -> dict[str, Any]:
        assert server is not None
        setup.run.phase = f"sampling the pool ({algo.pool_samples} a task)"
        load = lambda: server.load(server.model)  # noqa: E731  (the engine sleeps after each chunk)
        args = (setup.agent, tasks, server, load, ctx.metric, sampling, algo.pool_samples, algo.reward_timeout_s)
        return sample_pool(*args, parameters=ctx.compute.parameters, ranks=ctx.compute.ranks)

    if is_main():
        pool, record = filtered_pool(tasks, path, sample, exclusive=world_size() == 1)
    agreed(True)  # the other ranks wait here for rank 0's file
    if not is_main():
        pool, record = filtered_pool(tasks, path, sample, exclusive=False)
    ctx.compute.charge_pool(record["flops"], record["gpu_s"])
    return pool, record | {"charged_flops": ctx.compute.pool_flops, "charged_gpu_s": ctx.compute.pool_gpu_s}

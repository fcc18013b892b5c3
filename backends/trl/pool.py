"""A reward-only pool filtered to the tasks its starting policy solves sometimes (`algorithm.pool_samples`).

Before training, the policy the arms start from samples `pool_samples` rollouts of each RL task (at the training
temperature); the tasks it gets right on some but not all of them stay. Those are the tasks whose GRPO groups carry
a signal; a task always solved or never solved gives every rollout of its group one reward. The pool depends only on
the starting weights and the settings, so it is worked out once and kept in `<pools_dir>/<key>.json` for every arm and
seed that starts from the same weights (arms running side by side wait for the first to write it).

The file also records what sampling it cost (prompt tokens prefilled, tokens generated, their FLOPs, its wall seconds
and GPU-seconds): every arm that trains on the pool is charged that, whichever run sampled it (backends/compute.py).
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
from backends.compute import inference_flops
from backends.trl.rollouts import validate_policy
from inference.policy_server import PolicyServer


def pool_key(start: str, tasks: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    """What the pool depends on: the starting weights' digest, the tasks and the sampling settings."""
    key = [start, sorted(str(t["id"]) for t in tasks), settings]
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


CHUNK_ROLLOUTS = 1024  # rollouts sampled together (a training step's batch is about this size or less)


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
        _, rollouts = validate_policy(agent, repeated, server, metric, sampling, reward_timeout_s)
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
            f"({record['never_right']} never, {record['always_right']} always): nothing to train on"
        )
    return pool, {k: v for k, v in record.items() if k != "kept"} | {"kept": len(pool), "file": str(path)}

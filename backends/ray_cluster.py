"""A Ray cluster over the nodes of this SLURM job, for the backends that train through Ray (verl).

`hydra/launcher=slurm` runs a job as one task on the first node of its allocation (`srun_args` in
conf/hydra/launcher/slurm.yaml) with `resources.nodes` nodes. A backend calls `start_ray_cluster()` there before it
initialises Ray:

    address = start_ray_cluster()        # "10.0.0.5:6379" on 4 nodes, "local" on one node or outside SLURM
    ray.init(address=address)            # or let the trainer call ray.init(): RAY_ADDRESS is set

On N > 1 nodes it starts the Ray head on this node (`ray start --head --block`), one Ray worker on each other node
through `srun --overlap` (`ray start --address=... --block`), waits until all N nodes have joined and returns the
head's address. `stop_ray_cluster()` (also run at exit) stops both by their processes, not with `ray stop`, which would
also stop any other Ray on these nodes. `ray` is the one installed beside this Python (whose `import ray` must match
the cluster's version), else the first on PATH.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import subprocess
import sys
import time

log = logging.getLogger(__name__)

_head: subprocess.Popen[bytes] | None = None
_workers: subprocess.Popen[bytes] | None = None
POLL_S = 2.0  # how often to look whether the head listens and to count the nodes that joined


def slurm_nodes() -> list[str]:
    """The hostnames of this SLURM job, the head (first) first; empty outside a SLURM job."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def _node_resources() -> list[str]:
    """What each Ray node offers: the CPUs SLURM gave the task (GPUs: Ray reads CUDA_VISIBLE_DEVICES itself)."""
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    return [f"--num-cpus={cpus}"] if cpus else []


def _ray_cli() -> str:
    return shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"


def _listening(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=1):
            return True
    except OSError:
        return False


def start_ray_cluster(port: int = 6379, timeout_s: float = 600.0) -> str:
    """Start Ray on every node of this SLURM job and return the address for `ray.init(address=...)` (also set as
    RAY_ADDRESS). One node, or not in SLURM: starts nothing and returns "local". Must run on the job's first node."""
    nodes = slurm_nodes()
    if len(nodes) <= 1:
        return "local"
    head, others = nodes[0], nodes[1:]
    here = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    if here != head:
        raise RuntimeError(f"start_ray_cluster runs on the job's first node ({head}), not on {here}")
    ip = socket.gethostbyname(head)
    address = f"{ip}:{port}"
    log.info(f"Ray head on {head} ({address}), workers on {', '.join(others)}")
    atexit.register(stop_ray_cluster)
    try:
        _start(ip, port, others, len(nodes), time.monotonic() + timeout_s, timeout_s)
    except BaseException:
        stop_ray_cluster()  # what started, on a failure here
        raise
    os.environ["RAY_ADDRESS"] = address
    return address


def _start(ip: str, port: int, others: list[str], expected: int, deadline: float, timeout_s: float) -> None:
    global _head, _workers
    address, ray_cli = f"{ip}:{port}", _ray_cli()
    _head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", f"--node-ip-address={ip}", f"--port={port}", *_node_resources()]
    )
    while not _listening(ip, port):
        if _head.poll() is not None:
            raise RuntimeError(f"the Ray head exited ({_head.returncode}) before it listened at {address}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Ray head did not listen at {address} in {timeout_s} s")
        time.sleep(POLL_S)
    _workers = subprocess.Popen(
        [
            "srun",
            "--overlap",
            f"--nodes={len(others)}",
            f"--ntasks={len(others)}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(others)}",
            ray_cli,
            "start",
            f"--address={address}",
            "--block",
            *_node_resources(),
        ]
    )
    _wait_for_nodes(address, expected, deadline, timeout_s)


def _wait_for_nodes(address: str, expected: int, deadline: float, timeout_s: float) -> None:
    import ray  # the verl extra's; imported only where a multi-node run needs it

    ray.init(address=address, logging_level=logging.ERROR)
    try:
        while (alive := sum(1 for node in ray.nodes() if node["Alive"])) < expected:
            assert _workers is not None
            if _workers.poll() is not None:
                raise RuntimeError(f"the Ray workers' srun exited ({_workers.returncode}); {alive}/{expected} nodes")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{alive} of {expected} nodes joined the Ray cluster at {address} in {timeout_s} s")
            time.sleep(POLL_S)
        log.info(f"Ray cluster at {address}: {alive} nodes")
    finally:
        ray.shutdown()  # the trainer connects on its own


def stop_ray_cluster() -> None:
    """Stop the workers, then the head, that `start_ray_cluster` started (nothing if it started none). Each
    `ray start --block` stops its node's Ray processes when it is terminated."""
    global _head, _workers
    for process in (_workers, _head):
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    _head = _workers = None

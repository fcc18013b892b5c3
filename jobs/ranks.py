"""A run on several processes (`resources.gpus_per_node=N`, `resources.nodes=M`): `python launch.py ...
resources.gpus_per_node=2` starts them itself and waits. On one machine it starts N with torchrun. Inside a SLURM job
(`hydra/launcher=slurm`, which asks for M nodes x N GPUs) it starts M x N with `srun`, N on each node, and each
takes its rank from SLURM's environment (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS); several nodes need SLURM.

The processes run the same command in the same run directory (`hydra.run.dir`), marked by `ARL_RANK_OF`: each is
one rank of PyTorch's process group (NCCL on GPUs, gloo on CPU), and `backend=trl` trains data-parallel across them
(each rank runs its share of the step's rollouts on its own policy server and device). Rank 0 writes the run
directory (metrics.jsonl, samples, checkpoints) and its results to `ranks/results.json`; this process, the one the
user (or the SLURM job) started, writes summary.json from them, as for a run of one process. Each rank's output is
kept under `ranks/`: torchrun's layout (`ranks/<id>/attempt_0/<rank>/`, rank 0's shown on the console too) or
`ranks/slurm-<job>.<restart>/<rank>/` under srun.

Stopping: SIGTERM or SIGINT to this process (Ctrl-C, `kill`, an outer `timeout`) is forwarded to torchrun or srun,
which forward it to the ranks: each ends its step with a checkpoint and exits. Ranks that have not exited after
`STOP_GRACE_S` are killed (a second signal kills at once; shortly before, torchrun's ranks write their Python
stacks to their stderr: where they are stuck), and this process returns only when none of the run's
processes is left: the ranks, and what they started (vLLM's engine processes). torchrun runs each rank in its own
session, so a rank whose parent died is not in any process group of ours: this process is their subreaper (Linux),
so it still finds them. Under srun the ranks get the stop as SIGUSR1 (srun kills its tasks at once on a SIGTERM),
and SLURM's step holds the ranks and their children: srun's double SIGINT ends it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from foundation.errors import ConfigError
from foundation.interrupt import Interrupted
from foundation.ranks import RANK_OF, STACKS_SIGNAL
from foundation.run_dir import RunDir

LAUNCH = Path(__file__).resolve().parent.parent / "launch.py"
RESULTS = "ranks/results.json"
# How long the ranks get to stop after a stop signal before they are killed: a rank ends its step and writes a
# checkpoint first; torchrun itself kills its ranks 30 s after it forwarded the signal.
STOP_GRACE_S = 60.0
STACKS_BEFORE_KILL_S = 5.0  # ranks still running this long before the kill show where they are (`show_stacks`)
# prctl(2) options (linux/prctl.h)
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def check_devices(cfg: DictConfig, gpus: int) -> None:
    """One GPU a rank: a machine with `gpus` GPUs (0: CPU ranks, any number) runs at most that many a node."""
    per_node = max(1, int(cfg.resources.gpus_per_node))
    if cfg.backend.get("device", "auto") != "cpu" and 0 < gpus < per_node:
        raise ConfigError(f"resources.gpus_per_node={per_node}: this machine has {gpus} GPU(s), one a rank "
                          "(backend.device=cpu runs the ranks as CPU processes)")  # fmt: skip


def launch_ranks(cfg: DictConfig, run: RunDir) -> dict[str, Any]:
    """Start the run's processes in this run directory (torchrun, or srun inside a SLURM job); wait; return rank 0's
    results."""
    nodes, per_node = int(cfg.resources.nodes), max(1, int(cfg.resources.gpus_per_node))
    in_slurm = "SLURM_JOB_ID" in os.environ and shutil.which("srun") is not None
    if nodes > 1 and not in_slurm:
        raise ConfigError(f"resources.nodes={nodes}: a run on several nodes starts its ranks with srun, inside a "
                          "SLURM job (hydra/launcher=slurm)")  # fmt: skip
    if not in_slurm:  # under SLURM each node is checked by the job's allocation
        import torch

        check_devices(cfg, torch.cuda.device_count())
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("hydra.run.dir=")]
    own = [str(LAUNCH), *overrides, f"hydra.run.dir={run.path}"]
    (run.path / RESULTS).unlink(missing_ok=True)
    env = os.environ | {RANK_OF: str(run.path)}
    if cfg.backend.get("device", "auto") == "cpu":  # CPU ranks: FSDP2 would place its shards on a visible GPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    if in_slurm:
        command, env, logs = srun_command(nodes, per_node, own, run, env)
    else:
        logs = run.path / "ranks"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={per_node}",
            f"--log-dir={logs}", "--redirects=3", "--tee=3", "--local-ranks-filter=0", *own,
        ]  # fmt: skip
    returncode = run_ranks(command, env, str(run.path), under_srun=in_slurm)
    results_file = run.path / RESULTS
    if returncode != 0 or not results_file.is_file():
        raise RuntimeError(f"the run's {nodes * per_node} processes failed (exit {returncode}); each "
                           f"rank's output: {logs}")  # fmt: skip
    return json.loads(results_file.read_text())


def run_ranks(
    command: list[str], env: dict[str, str], run_id: str, *, under_srun: bool, grace_s: float = STOP_GRACE_S
) -> int:
    """Run the ranks' starter (torchrun, or srun) to its end and return its exit status. On a stop signal, stop the
    ranks (see the module's docstring) and raise it again. Either way, return only when no process of the run is
    left: every descendant of this process whose environment names this run (`RANK_OF=run_id`) is ended."""
    # torchrun kills its ranks this long after it forwarded a stop signal (its default: 30 s)
    env = env | {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(grace_s))}
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # a rank or engine left by its parent becomes our child, not init's
    parent = os.getpid()
    starter = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=lambda: _stop_with(parent))
    try:
        return starter.wait()
    except (Interrupted, KeyboardInterrupt) as stop:
        signum = stop.signum if isinstance(stop, Interrupted) else signal.SIGINT
        print(f"{signum.name}: stopping the run's ranks (up to {grace_s:.0f} s; again: kill them now)", file=sys.stderr)
        stop_starter(starter, signum, under_srun=under_srun, grace_s=grace_s, run_id=run_id)
        raise
    finally:
        with _signals_ignored():  # a further Ctrl-C must not cut the clean-up short
            if starter.poll() is None:
                starter.kill()
                starter.wait()
            end_run_processes(run_id, wait_s=min(grace_s, 10.0))
        _prctl(_PR_SET_CHILD_SUBREAPER, 0)


def stop_starter(starter: subprocess.Popen, signum: int, *, under_srun: bool, grace_s: float, run_id: str) -> None:
    """Forward the stop to the ranks' starter and wait up to `grace_s` for it to exit; then (or on a second signal)
    kill: srun ends its step on two SIGINTs within a second (SIGTERM, then SIGKILL to every process of the step),
    torchrun is killed (its ranks are then ours to end, `end_run_processes`). srun gets SIGUSR1, which it forwards to
    the ranks as it is (a SIGTERM it would turn into killing them, a single SIGINT into a status line). Shortly
    before the kill, ranks still running write their stacks to their stderr (`show_stacks`)."""
    starter.send_signal(signal.SIGUSR1 if under_srun else signum)
    stacks_at = grace_s - min(STACKS_BEFORE_KILL_S, grace_s / 2)
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            starter.wait(timeout=stacks_at)
            return
        if not under_srun:  # srun's ranks are not this process's descendants (and srun takes SIGQUIT as a kill)
            show_stacks(run_id, starter.pid)
        starter.wait(timeout=grace_s - stacks_at)
        return
    except (subprocess.TimeoutExpired, Interrupted, KeyboardInterrupt):
        pass
    with _signals_ignored():
        if under_srun and starter.poll() is None:
            starter.send_signal(signal.SIGINT)
            time.sleep(0.2)
            starter.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                starter.wait(timeout=grace_s)
        if starter.poll() is None:
            starter.kill()
            starter.wait()


def show_stacks(run_id: str, starter: int) -> list[int]:
    """Every rank of the run that this process can see (torchrun's, not srun's) writes its threads' Python stacks to
    its stderr (`STACKS_SIGNAL`, registered by each rank in jobs/job.py): where a rank that does not stop is
    stuck. Ranks are the run's processes that run launch.py with a `RANK`; the `starter` (torchrun, which would shut
    down on it) and what the ranks started (an engine, which would die of it) are left alone. The pids."""
    ranks = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            env = proc.environ()
            if proc.pid != starter and env.get(RANK_OF) == run_id and "RANK" in env and str(LAUNCH) in proc.cmdline():
                proc.send_signal(STACKS_SIGNAL)
                ranks.append(proc.pid)
    if ranks:
        print(f"ranks {ranks} have not stopped: their stacks are in their stderr (ranks/)", file=sys.stderr)
    return ranks


def end_run_processes(run_id: str, wait_s: float = 10.0, rounds: int = 5) -> list[int]:
    """End every living descendant of this process that belongs to the run (its environment has `RANK_OF=run_id`):
    SIGTERM, then SIGKILL after `wait_s`; wait for each. Again while new ones appear (one forked meanwhile), at most
    `rounds` times. The pids ended."""
    ended: list[int] = []
    for _ in range(rounds):
        procs = [p for p in psutil.Process().children(recursive=True) if _belongs(p, run_id)]
        if not procs:
            break
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        _, alive = psutil.wait_procs(procs, timeout=wait_s)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(alive, timeout=wait_s)
        ended += [p.pid for p in procs]
    if ended:
        print(f"ended {len(ended)} process(es) of the run left behind: {ended}", file=sys.stderr)
    return ended


def _belongs(proc: psutil.Process, run_id: str) -> bool:
    """A living process of the run. A zombie has freed what it held (GPU memory too), and whose it was cannot be
    read any more: it is left to its parent (or, adopted, to this process's exit)."""
    try:
        return proc.environ().get(RANK_OF) == run_id
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored while the block runs (main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _prctl(option: int, value: int) -> None:
    """Linux's prctl(2); elsewhere nothing (no subreaper: a rank whose parent died is then not found)."""
    if _LIBC is not None:
        _LIBC.prctl(option, value, 0, 0, 0)


def _stop_with(parent: int) -> None:
    """In the starter, before it runs: SIGTERM to it when this process dies (even by SIGKILL), so it stops the ranks;
    if it died already, the starter does not start."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def srun_command(
    nodes: int, per_node: int, own: list[str], run: RunDir, env: dict[str, str]
) -> tuple[list[str], dict[str, str], Path]:
    """The `srun` that starts `nodes` x `per_node` ranks in this SLURM job, the environment it gets, and where the
    ranks' output goes. The step overlaps the job's own (this process), shares the job's CPUs of each node among its
    ranks and sees the job's GPUs; a rank that fails stops the others. Rank 0 (SLURM task 0, on the job's first
    node, where this process runs) is the rendezvous."""
    logs = run.path / "ranks" / f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    for rank in range(nodes * per_node):
        (logs / str(rank)).mkdir(parents=True, exist_ok=True)
    cpus = max(1, int(os.environ.get("SLURM_CPUS_ON_NODE", per_node)) // per_node)
    rendezvous = {
        "MASTER_ADDR": socket.gethostname(),
        "MASTER_PORT": str(free_port()),
        "LOCAL_WORLD_SIZE": str(per_node),
    }
    # USR2 (a time limit or preemption ahead) goes to every step; this process's submitit handler requeues the job,
    # whose ranks then start again from the latest checkpoint: the ranks ignore it (an ignored signal survives exec)
    as_rank = 'trap "" USR2; export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS; exec "$@"'
    command = [
        "srun", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes * per_node}", f"--ntasks-per-node={per_node}",
        f"--cpus-per-task={cpus}", "--kill-on-bad-exit=1",
        f"--output={logs}/%t/stdout.log", f"--error={logs}/%t/stderr.log",
        "bash", "-c", as_rank, "rank", sys.executable, *own,
    ]  # fmt: skip
    return command, env | rendezvous, logs


def free_port() -> int:
    """A port nothing listens on here, for rank 0's rendezvous (torchrun --standalone chooses its own the same way)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def write_rank_results(run: RunDir, results: dict[str, Any]) -> None:
    """Rank 0's results, for the process that started the ranks."""
    path = run.path / RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, default=str))

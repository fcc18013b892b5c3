"""A run on 2 processes (`resources.gpus_per_node=2`): launch.py starts both ranks itself (torchrun; gloo on CPU),
each runs its share of the rollouts on its own policy server, FSDP2 shards the model across them (backend.sharding),
rank 0 writes the one run directory; a run started again resumes from the sharded checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import FAST_RUN, launch


@pytest.mark.integration
def test_two_ranks_train_one_run_stop_together_on_sigterm_and_resume_from_their_sharded_checkpoint(
    cache_dir: Path, tmp_path: Path
) -> None:
    """2 CPU ranks train one run (FSDP2, each its share of the rollouts, rank 0 alone writing). SIGTERM to launch.py
    while they train: both end the same step with their shards of its checkpoint, the run says `interrupted`, and no
    process of the run is left when launch.py returns. Launched again, both resume from that sharded checkpoint and
    finish: the final model gathered from the shards loads whole."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from foundation.ranks import RANK_OF
    from jobs.ranks import LAUNCH
    from tests.conftest import ROOT, wait_for

    launch_py = str(LAUNCH)  # in the ranks' command line (torchrun's too, which has no RANK)
    run_dir, max_steps = tmp_path / "run", 4
    args = [*FAST_RUN, "resources.gpus_per_node=2", f"algorithm.max_steps={max_steps}", f"hydra.run.dir={run_dir}"]
    env = os.environ | {"ARL_CACHE_DIR": str(cache_dir), "ARL_OUTPUT_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "launch.log"

    def run_processes() -> list[int]:
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(RANK_OF) == str(run_dir):
                    found.append(proc.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def metrics() -> list[dict]:
        path = run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    with log.open("w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "launch.py", *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_for(lambda: len(metrics()) >= 2, 600, "the ranks' first GRPO step in metrics.jsonl")
        assert len(run_processes()) >= 3  # torchrun and its two ranks
        # asked for their stacks (kill -QUIT), the ranks write them to their stderr and train on
        ranks = [p for p in map(psutil.Process, run_processes()) if "RANK" in p.environ() and launch_py in p.cmdline()]
        assert len(ranks) == 2, [p.cmdline() for p in ranks]
        for proc in ranks:
            proc.send_signal(signal.SIGQUIT)

        def stacks_written() -> int:
            return sum("most recent call first" in p.read_text() for p in (run_dir / "ranks").rglob("stderr.log"))

        wait_for(lambda: stacks_written() == 2, 60, "both ranks' stacks in their stderr.log")
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=180)
    finally:
        launcher.kill()
    assert launcher.returncode != 0, log.read_text()[-3000:]
    assert run_processes() == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary
    # both ranks ended the same step and wrote their shards of its checkpoint (model and optimizer state)
    logs = {p.parent.name: p.read_text() for p in (run_dir / "ranks").rglob("stderr.log")}
    stops = {m for log in logs.values() for m in re.findall(r"SIGTERM during GRPO: stopped after step (\d+)", log)}
    assert sorted(logs) == ["0", "1"] and all("SIGTERM during GRPO" in log for log in logs.values()), stops
    assert len(stops) == 1, stops
    stopped = int(stops.pop())
    assert 1 <= stopped < max_steps
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        shards = sorted(p.name for p in (run_dir / "checkpoints" / f"checkpoint-{stopped}" / part).glob("*.distcp"))
        assert shards == ["__0_0.distcp", "__1_0.distcp"]
    before = metrics()
    assert [m["step"] for m in before] == list(range(stopped + 1))  # one line per step: rank 0 alone writes
    assert all(m["rollout/llm_calls_mean"] >= 2 for m in before[1:])  # the check step ran on both ranks

    result = launch(args, cache_dir, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["status"] == "completed" and resumed["world_size"] == 2 and resumed["steps"] == max_steps
    assert resumed["resumed_from"] == f"checkpoint-{stopped}"
    assert resumed["sharding"] == "fsdp2"  # read off the trained model: its weights were DTensor shards
    # both ranks ran their share of the steps after the checkpoint: 2 tasks x 2 rollouts a step, shared
    assert resumed["rollouts_per_rank"] == [2 * (max_steps - stopped)] * 2
    after = metrics()
    assert [m["step"] for m in after] == list(range(max_steps + 1)) and after[: stopped + 1] == before
    assert len((run_dir / "attempts.jsonl").read_text().splitlines()) == 2  # the ranks are not attempts
    assert len(list(tmp_path.glob("runs/*"))) == 0  # no second run directory
    # each rank's output of both launches kept; rank 0 alone writes models (the final one; the shared cache's tiny
    # model, rank 1 waiting, where this session had not built it yet)
    both = {
        rank: "".join(p.read_text() for p in (run_dir / "ranks").glob(f"*/attempt_0/{rank}/stderr.log"))
        for rank in "01"
    }
    assert "Writing model shards" in both["0"] and "Writing model shards" not in both["1"]
    # the final model is whole: gathered from both ranks' shards, it loads as a plain checkpoint
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "final", output_loading_info=True)
    assert not any(final[1].values())  # no missing, unexpected or mismatched weights


@pytest.mark.integration
def test_ranks_that_cannot_share_the_batch_fail_before_starting(cache_dir: Path, tmp_path: Path) -> None:
    args = [*FAST_RUN, "resources.gpus_per_node=3", f"hydra.run.dir={tmp_path / 'run'}"]
    result = launch(args, cache_dir, tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert result.returncode != 0 and summary["status"] == "failed"
    assert "cannot be shared by 3 processes (resources.gpus_per_node)" in summary["error"]


def test_the_7b_full_preset_asks_for_two_sharded_ranks() -> None:
    """An experiment preset's `resources` override config.yaml's (the preset comes after it)."""
    from tests.test_config import compose_with

    cfg = compose_with("experiment=grpo-qwen2.5-7b-1n2g-full")
    assert cfg.resources.gpus_per_node == 2 and cfg.backend.sharding == "fsdp2" and cfg.finetune.name == "full"
    assert cfg.model.hub_id == "Qwen/Qwen2.5-7B-Instruct"


def test_more_ranks_than_gpus_fail_before_starting() -> None:
    from foundation.errors import ConfigError
    from jobs.ranks import check_devices
    from tests.test_config import compose_with

    cfg = compose_with("resources.gpus_per_node=2")
    with pytest.raises(ConfigError, match=r"resources\.gpus_per_node=2: this machine has 1 GPU"):
        check_devices(cfg, gpus=1)
    check_devices(cfg, gpus=2)
    check_devices(cfg, gpus=0)  # CPU ranks: gloo processes
    check_devices(compose_with("resources.gpus_per_node=2", "backend.device=cpu"), gpus=1)


# A stand-in for torchrun and a rank's vLLM engine, both deaf to SIGTERM: the starter starts the "engine" in its own
# session (as torchrun starts ranks), writes both pids, and sleeps.
STUCK_STARTER = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
engine = subprocess.Popen([sys.executable, "-c", deaf], start_new_session=True)
open(sys.argv[1], "w").write(f"{os.getpid()} {engine.pid}")
time.sleep(600)
"""

# The launcher's side: run_ranks under the stop signals, as launch.py runs a multi-rank job.
LAUNCHER = """
import os, sys
from jobs.ranks import run_ranks
from foundation.interrupt import Interrupted, stop_signals
from foundation.ranks import RANK_OF
env = os.environ | {RANK_OF: "run-under-test"}
try:
    with stop_signals():
        starter = [sys.executable, "-c", sys.argv[1], sys.argv[2]]
        run_ranks(starter, env, "run-under-test", under_srun=False, grace_s=1.0)
except Interrupted as stop:
    print("interrupted by", stop.signum.name)
    sys.exit(3)
"""


def test_a_stopped_launcher_leaves_no_process_of_its_run_also_one_in_another_session(tmp_path: Path) -> None:
    """SIGTERM to the launcher: the starter ignores it and is killed after the grace period; the engine it left
    behind, in its own session and deaf to SIGTERM, is adopted by the launcher (its subreaper) and killed too. The
    launcher returns only after both are gone."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from tests.conftest import ROOT, wait_for

    pids = tmp_path / "pids"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, STUCK_STARTER, str(pids)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: pids.is_file() and len(pids.read_text().split()) == 2, 60, "the starter and its engine")
        starter, engine = (int(pid) for pid in pids.read_text().split())
        assert psutil.Process(engine).ppid() == starter and os.getsid(engine) != os.getsid(starter)
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 3 and "interrupted by SIGTERM" in out
    assert not psutil.pid_exists(starter) and not psutil.pid_exists(engine)


# A stand-in for torchrun (deaf to SIGTERM, noting a SIGQUIT) and its one rank, stuck where a collective would wait
# and deaf to SIGTERM too; the rank registers the stacks signal as a rank of launch.py does. The starter writes both
# pids once the rank is ready.
STUCK_RANK = """
import os, signal, subprocess, sys, time
from jobs.ranks import LAUNCH
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGQUIT, lambda *_: open(sys.argv[1] + ".starter-quit", "w").close())  # must not come
ready = sys.argv[1] + ".ready"
rank = (
    "import faulthandler, signal, sys, time\\n"
    "from foundation.ranks import STACKS_SIGNAL\\n"
    "faulthandler.register(STACKS_SIGNAL, all_threads=True)\\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    "def waiting_in_a_collective():\\n"
    "    open(sys.argv[2], 'w').close()\\n"
    "    time.sleep(600)\\n"
    "waiting_in_a_collective()\\n"
)
err = open(sys.argv[1] + ".rank-stderr", "w")
proc = subprocess.Popen([sys.executable, "-c", rank, str(LAUNCH), ready], env=os.environ | {"RANK": "0"}, stderr=err)
while not os.path.exists(ready):
    time.sleep(0.05)
open(sys.argv[1], "w").write(f"{os.getpid()} {proc.pid}")
time.sleep(600)
"""


def test_a_rank_that_does_not_stop_shows_where_it_is_stuck_before_it_is_killed(tmp_path: Path) -> None:
    """SIGTERM to the launcher; the rank ignores it: shortly before the grace period ends, the launcher asks it for
    its stacks (its stderr shows the function it waits in), then kills it; nothing of the run is left."""
    import signal
    import subprocess
    import sys

    import psutil

    from tests.conftest import ROOT, wait_for

    pids = tmp_path / "pids"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, STUCK_RANK, str(pids)], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: pids.is_file() and len(pids.read_text().split()) == 2, 60, "the starter and its rank")
        starter, rank = (int(pid) for pid in pids.read_text().split())
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 3 and "interrupted by SIGTERM" in out
    assert f"ranks [{rank}] have not stopped" in err
    stacks = (tmp_path / "pids.rank-stderr").read_text()
    assert "most recent call first" in stacks and "waiting_in_a_collective" in stacks
    assert not (tmp_path / "pids.starter-quit").exists()  # torchrun would shut down on it
    assert not psutil.pid_exists(starter) and not psutil.pid_exists(rank)

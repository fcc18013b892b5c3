"""Dispatch without a cluster: launcher presets, local sweeps (a failing run, re-runs), analysis.status, resuming from
a complete checkpoint, the Ray bootstrap's commands. The SLURM side runs in test_dispatch_slurm.py."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.utils import JobReturn, JobStatus
from submitit.core.utils import FailedJobError, UncompletedJobError

from analysis.status import main as status_main
from analysis.status import sweep_status
from backends import ray_cluster
from foundation.run_dir import last_complete_checkpoint
from hydra_plugins.arl_launchers import slurm_launcher
from hydra_plugins.arl_launchers.slurm_launcher import SlurmLauncher
from tests.conftest import ROOT, launch

QUICK = ["job._target_=tests.jobs.quick", "+job._schema_=tests.jobs.QuickJob"]


def executions(run_dir: Path) -> int:
    return len((run_dir / "executions").read_text())


def test_the_slurm_preset_asks_for_the_resources_the_trainer_uses() -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            ["hydra/launcher=slurm", "resources.nodes=2", "resources.gpus_per_node=8"],
            return_hydra_config=True,
        )
        default = compose("config", [], return_hydra_config=True)
    assert (cfg.hydra.launcher.nodes, cfg.hydra.launcher.gpus_per_node) == (2, 8)
    assert cfg.hydra.launcher._target_ == "hydra_plugins.arl_launchers.slurm_launcher.SlurmLauncher"
    assert cfg.hydra.launcher.wait is True and cfg.hydra.launcher.max_num_timeout > 0
    assert default.hydra.launcher._target_.endswith("BasicLauncher")


@pytest.mark.integration
def test_a_failing_run_does_not_stop_a_local_sweep_and_a_rerun_only_reruns_it(cache_dir: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", *QUICK, "+job.fail=false,true", "seed=0,1", f"hydra.sweep.dir={sweep}"]
    first = launch(args, cache_dir, tmp_path, timeout=300)
    assert first.returncode == 1  # the sweep reports the failure...
    assert "asked to fail" in first.stderr
    summaries = {n: json.loads((sweep / str(n) / "summary.json").read_text()) for n in range(4)}
    assert [summaries[n]["status"] for n in range(4)] == ["completed", "completed", "failed", "failed"]  # ...after all
    assert summaries[2]["error"] == "RuntimeError: asked to fail (seed=0)"

    again = launch(args, cache_dir, tmp_path, timeout=300)
    assert again.returncode == 1
    assert again.stdout.count("completed before with the same overrides, not run again") == 2
    assert [executions(sweep / str(n)) for n in range(4)] == [1, 1, 2, 2]
    assert [json.loads((sweep / str(n) / "summary.json").read_text())["attempts"] for n in range(4)] == [1, 1, 2, 2]
    for n in (2, 3):  # a run's wall time is over its attempts, the latest one's beside it
        first_s, second = summaries[n], json.loads((sweep / str(n) / "summary.json").read_text())
        assert (first_s["wall_s_attempts"], second["wall_s_attempts"]) == (1, 2)
        assert first_s["wall_s"] == first_s["attempt_wall_s"]
        assert second["wall_s"] == pytest.approx(first_s["wall_s"] + second["attempt_wall_s"])

    runs = sweep_status(sweep)
    assert [(r.num, r.status) for r in runs] == [(0, "completed"), (1, "completed"), (2, "failed"), (3, "failed")]
    assert runs[2].error == "RuntimeError: asked to fail (seed=0)" and runs[2].job_id is None
    assert runs[2].error_tail[-1] == "RuntimeError: asked to fail (seed=0)"


@pytest.mark.integration
def test_a_sweep_directory_of_another_sweep_is_not_overwritten(cache_dir: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    assert launch(["-m", *QUICK, "seed=0", f"hydra.sweep.dir={sweep}"], cache_dir, tmp_path).returncode == 0
    before = (sweep / "0" / "summary.json").read_text()
    other = launch(["-m", *QUICK, "seed=5", f"hydra.sweep.dir={sweep}"], cache_dir, tmp_path)
    assert other.returncode == 1
    assert "holds a run of other overrides" in other.stderr and "hydra.sweep.dir" in other.stderr
    assert (sweep / "0" / "summary.json").read_text() == before and executions(sweep / "0") == 1


@pytest.mark.integration
def test_local_parallel_runs_every_run_and_reports_the_failure(cache_dir: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", *QUICK, "+job.fail=false,true,false", "hydra/launcher=local_parallel", f"hydra.sweep.dir={sweep}"]
    result = launch(args, cache_dir, tmp_path, timeout=300)
    assert result.returncode == 1
    statuses = [json.loads((sweep / str(n) / "summary.json").read_text())["status"] for n in range(3)]
    assert statuses == ["completed", "failed", "completed"]


def local_sweep(sweep: Path) -> Path:
    """A local sweep's directory: run 0 completed, run 1 failed, run 2 started without a summary yet."""
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "summary.json").write_text(json.dumps({"status": "completed", "overrides": ["seed=0"]}))
    (sweep / "1").mkdir()
    (sweep / "1" / "summary.json").write_text(
        json.dumps({"status": "failed", "overrides": ["seed=1"], "error": "ValueError: bad", "traceback": "a\nb\nc\n"})
    )
    (sweep / "2" / ".hydra").mkdir(parents=True)  # no scheduler to ask whether it still runs
    return sweep


def test_status_reads_a_sweep_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local_sweep(tmp_path)
    assert status_main([str(tmp_path), "--tail", "2"]) == 0
    text = capsys.readouterr().out
    assert f"{tmp_path}: 3 runs: 1 completed, 1 failed, 1 incomplete" in text
    assert "ValueError: bad" in text and "| b" in text and "| c" in text and "| a" not in text
    assert status_main([str(tmp_path), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["num"], r["status"], r["overrides"]) for r in rows] == [
        (0, "completed", ["seed=0"]),
        (1, "failed", ["seed=1"]),
        (2, "incomplete", []),
    ]
    assert status_main([str(tmp_path / "missing")]) == 2


@pytest.mark.integration
def test_job_status_prints_what_analysis_status_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep, run_dir = local_sweep(tmp_path / "sweep"), tmp_path / "run"
    assert status_main([str(sweep)]) == 0
    table = capsys.readouterr().out
    shown = launch(["job=status", f"job.sweep_dir={sweep}", f"hydra.run.dir={run_dir}"], tmp_path / "c", tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert table in shown.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["runs"] == {"completed": 1, "failed": 1, "incomplete": 1}

    missing = launch(["job=status", f"job.sweep_dir={tmp_path / 'nothing'}"], tmp_path / "c", tmp_path)
    assert missing.returncode != 0
    assert f"job.sweep_dir={tmp_path / 'nothing'}: no such sweep directory" in missing.stdout + missing.stderr


class FakeJob:
    """A submitit job whose waits end as `outcomes` say: a JobReturn, or an error that `result()` raises."""

    job_id = "7_0"

    def __init__(self, *outcomes: JobReturn | Exception) -> None:
        self.outcomes = list(outcomes)
        self.watcher = SimpleNamespace(cleared=0)
        self.watcher.clear = lambda: setattr(self.watcher, "cleared", self.watcher.cleared + 1)

    def result(self) -> JobReturn:
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_the_slurm_launcher_waits_again_for_a_job_that_squeue_still_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit read a requeued job's passing state as its end: squeue still lists it, so it is waited for again."""
    monkeypatch.setattr(slurm_launcher, "listed_state", lambda job_id: "PENDING")
    done = JobReturn(overrides=["seed=0"], status=JobStatus.COMPLETED, _return_value={"status": "completed"})
    job = FakeJob(UncompletedJobError("has not produced any output (state: REQUEUE_HOLD)"), done)
    assert SlurmLauncher._result(0, job, ["seed=0"]) is done
    assert job.watcher.cleared == 1 and not job.outcomes


def test_a_job_that_ended_without_a_result_is_a_failed_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_launcher, "listed_state", lambda job_id: None)
    for error in (UncompletedJobError("has not produced any output (state: CANCELLED)"), FailedJobError("boom")):
        failed = SlurmLauncher._result(0, FakeJob(error), ["seed=0"])
        assert failed.status == JobStatus.FAILED and failed.overrides == ["seed=0"]
        with pytest.raises(type(error)):  # what Hydra's sweeper raises once every run has returned
            _ = failed.return_value


def test_resume_skips_a_checkpoint_left_half_written(tmp_path: Path) -> None:
    assert last_complete_checkpoint(tmp_path) is None
    for step in (1, 2, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
    for step in (1, 2):
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-10" / "model.safetensors").write_text("")  # killed while saving step 10
    (tmp_path / "checkpoint-final").mkdir()
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")


# --- the Ray bootstrap, with stand-ins for `ray`, `srun` and `scontrol` (the real ones: test_verl_ray_slurm.py) ---


@pytest.fixture
def fake_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """`scontrol` and `srun` executables on PATH and a `ray` beside this Python that log their arguments (`ray start
    --block` and srun keep running), and a `ray` module whose nodes join one per poll after srun started, on a 3-node
    allocation whose first node is this one."""
    bin_dir, venv_bin, calls = tmp_path / "bin", tmp_path / "venv" / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    venv_bin.mkdir(parents=True)
    scripts = {
        bin_dir / "scontrol": "echo node1; echo node2; echo node3",
        bin_dir / "srun": f'echo "srun $*" >> {calls}; exec sleep 300',
        venv_bin / "ray": f'echo "ray $*" >> {calls}; [ -f {tmp_path}/head_fails ] && exit 3; exec sleep 300',
    }
    for path, body in scripts.items():
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(ray_cluster.sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-3]")
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster.socket, "gethostbyname", lambda host: {"node1": "10.0.0.1"}[host])
    monkeypatch.setattr(ray_cluster, "POLL_S", 0.01)

    def listening(ip: str, port: int) -> bool:  # the head listens once its process has started (unless it fails)
        started = calls.is_file() and "--head" in calls.read_text()
        return started and not (tmp_path / "head_fails").exists()

    monkeypatch.setattr(ray_cluster, "_listening", listening)
    state = SimpleNamespace(alive=1, join=True, connected=[], calls=calls, venv_bin=venv_bin, tmp_path=tmp_path)

    def nodes() -> list[dict]:  # a worker joins per poll once the workers' srun has started
        started = calls.is_file() and "srun" in calls.read_text()
        state.alive = min(3, state.alive + (state.join and started))
        return [{"Alive": i < state.alive} for i in range(3)]

    fake_ray = SimpleNamespace(
        init=lambda address, **kw: state.connected.append(address), nodes=nodes, shutdown=lambda: None
    )
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    yield state
    ray_cluster.stop_ray_cluster()


def test_ray_cluster_starts_the_head_here_and_workers_on_the_other_nodes(fake_cluster: SimpleNamespace) -> None:
    address = ray_cluster.start_ray_cluster(port=6380)
    assert address == "10.0.0.1:6380" and os.environ["RAY_ADDRESS"] == address
    assert fake_cluster.connected == [address]
    head, workers = ray_cluster._head, ray_cluster._workers
    assert head is not None and workers is not None
    assert head.poll() is None and workers.poll() is None  # both keep running with the job
    ray_cluster.stop_ray_cluster()
    assert head.poll() is not None and workers.poll() is not None  # stopped by their processes, not by `ray stop`
    calls = fake_cluster.calls.read_text().splitlines()
    assert calls == [
        "ray start --head --block --node-ip-address=10.0.0.1 --port=6380 --num-cpus=16",
        "srun --overlap --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=node2,node3 "
        f"{fake_cluster.venv_bin / 'ray'} start --address=10.0.0.1:6380 --block --num-cpus=16",  # this Python's ray
    ]


def test_ray_cluster_says_which_nodes_never_joined_and_stops_what_started(fake_cluster: SimpleNamespace) -> None:
    fake_cluster.join = False
    with pytest.raises(TimeoutError, match=r"1 of 3 nodes joined the Ray cluster at 10\.0\.0\.1:6379"):
        ray_cluster.start_ray_cluster(timeout_s=1)
    assert ray_cluster._head is None and ray_cluster._workers is None


def test_ray_cluster_says_when_the_head_did_not_start(fake_cluster: SimpleNamespace) -> None:
    (fake_cluster.tmp_path / "head_fails").touch()
    with pytest.raises(RuntimeError, match=r"the Ray head exited \(3\) before it listened at 10\.0\.0\.1:6379"):
        ray_cluster.start_ray_cluster()
    assert "srun" not in fake_cluster.calls.read_text()


def test_ray_cluster_runs_on_the_first_node_only(
    fake_cluster: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    with pytest.raises(RuntimeError, match=r"first node \(node1\), not on node2"):
        ray_cluster.start_ray_cluster()


def test_one_node_needs_no_ray_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert ray_cluster.start_ray_cluster() == "local"


def test_status_lists_named_runs_beside_a_sweep_and_the_runs_of_a_folder_of_sweeps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No run is dropped without a word: named run directories beside a sweep's numbered ones are listed, a folder of
    sweeps lists each sweep's runs, and a folder with none says so and exits 1."""
    local_sweep(tmp_path / "mixed")
    (tmp_path / "mixed" / "tuned").mkdir()
    (tmp_path / "mixed" / "tuned" / "summary.json").write_text(json.dumps({"status": "completed", "overrides": []}))
    assert status_main([str(tmp_path / "mixed"), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["num"] for r in rows] == [0, 1, 2, "tuned"]
    local_sweep(tmp_path / "study" / "ws0-grpo")
    local_sweep(tmp_path / "study" / "ws1-grpo")
    assert status_main([str(tmp_path / "study"), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["num"] for r in rows] == [f"ws{w}-grpo/{n}" for w in (0, 1) for n in (0, 1, 2)]
    (tmp_path / "empty" / "figures").mkdir(parents=True)
    assert status_main([str(tmp_path / "empty")]) == 1
    assert "no run directory or submitted run under it" in capsys.readouterr().err

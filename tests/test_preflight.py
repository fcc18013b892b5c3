"""The preflight (jobs/preflight.py): each failure one line naming what to set, before any weights load; a sweep
checked once; no secret printed."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import transformers
from fastapi import FastAPI, HTTPException, Request
from omegaconf import DictConfig

from agent.scripted import say, scripted_app
from data.spider import SpiderData
from jobs import preflight
from jobs.preflight import Preflight, data_findings, hub_findings, probes, run_probes, slurm_findings
from tests.conftest import closed_port, launch, serve
from tests.test_config import compose_with

QUICK = ["job._target_=tests.jobs.quick", "+job._schema_=tests.jobs.QuickJob"]  # a job of seconds (test_dispatch)
ABSENT_MODEL = "arl-tests/no-such-model"  # in no hub cache


@pytest.fixture
def no_weights_load(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every way transformers loads a model, tokenizer or config, recorded (and refused) instead."""
    loaded: list[str] = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer, transformers.AutoConfig):

        def refuse(*args: object, _name: str = cls.__name__, **kwargs: object) -> None:
            loaded.append(_name)
            raise AssertionError(f"{_name}.from_pretrained called by the preflight")

        monkeypatch.setattr(cls, "from_pretrained", refuse)
    return loaded


def failure_lines(capsys: pytest.CaptureFixture[str], cfg: DictConfig, settings: Preflight | None = None) -> list[str]:
    """Run the preflight on `cfg` as a single run's start does; it must exit 1. Its lines of failure on stderr."""
    with pytest.raises(SystemExit) as stopped:
        (settings or Preflight(timeout_s=2.0)).check([cfg], sweep=False)
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("preflight: this run cannot start; nothing was loaded or launched:\n")
    return [line.strip() for line in err.splitlines()[1:]]


def test_a_model_neither_local_nor_cached_names_model_path_offline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_weights_load: list[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose_with("model=qwen2.5-7b-instruct", f"model.hub_id={ABSENT_MODEL}")
    (line,) = failure_lines(capsys, cfg)
    assert line.startswith("model.path: ") and ABSENT_MODEL in line and "HF_HUB_OFFLINE=1" in line
    assert not no_weights_load


def test_a_model_when_the_hub_does_not_answer_names_model_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_weights_load: list[str]
) -> None:
    """One request to a hub that refuses the connection: no retries, the same line."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    cfg = compose_with("model=qwen2.5-7b-instruct", f"model.hub_id={ABSENT_MODEL}")
    (line,) = failure_lines(capsys, cfg)
    assert line.startswith("model.path: ") and "did not answer (ConnectError" in line
    assert not no_weights_load


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A loopback port that accepts connections and never answers (a hung server, a black hole)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_hub_that_never_answers_is_given_up_on_at_the_timeout(monkeypatch: pytest.MonkeyPatch, silent_server: str):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", silent_server)
    (finding,) = hub_findings(ABSENT_MODEL, timeout_s=0.2)
    assert not finding.ok and finding.fix.startswith("model.path: ") and "Timeout" in finding.fix


def test_a_local_model_path_must_exist_and_hold_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (line,) = failure_lines(capsys, compose_with("model=qwen2.5-7b-instruct", f"model.path={tmp_path}/absent"))
    assert line.startswith(f"model.path={tmp_path}/absent does not exist")
    (line,) = failure_lines(capsys, compose_with("model=qwen2.5-7b-instruct", f"model.path={tmp_path}"))
    assert line.startswith(f"model.path={tmp_path} holds no config.json")
    (tmp_path / "config.json").write_text("{}")
    assert Preflight().check([compose_with("model=qwen2.5-7b-instruct", f"model.path={tmp_path}")], sweep=False)
    assert capsys.readouterr().out == "preflight: model ok\n"


def test_an_unreachable_judge_names_judge_base_url_and_no_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_weights_load: list[str]
) -> None:
    monkeypatch.setenv("JUDGE_BASE_URL", f"http://u:sentinel-url-7f3a@127.0.0.1:{closed_port()}/v1?k=sentinel-q-7f3a")
    monkeypatch.setenv("JUDGE_API_KEY", "sentinel-key-7f3a")
    (line,) = failure_lines(capsys, compose_with("reward=hybrid"))
    assert line.startswith("JUDGE_BASE_URL: the judge at http://***@127.0.0.1:")
    assert "reward.terms.judge.base_url" in line and "does not answer (ConnectError" in line
    assert "sentinel" not in line
    assert not no_weights_load


def test_a_judge_that_never_answers_fails_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], silent_server: str
) -> None:
    monkeypatch.setenv("JUDGE_BASE_URL", f"{silent_server}/v1")
    (line,) = failure_lines(capsys, compose_with("reward=llm_judge"), Preflight(timeout_s=0.2))
    assert line.startswith("JUDGE_BASE_URL: the judge at") and "Timeout" in line


def test_a_judge_that_answers_passes_and_a_refused_key_names_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    app = FastAPI()

    @app.get("/v1/models")
    def models(request: Request) -> dict[str, list[dict[str, str]]]:
        if request.headers.get("authorization") != "Bearer right":
            raise HTTPException(401)
        return {"data": [{"id": "judge"}]}

    with serve(app) as url:
        monkeypatch.setenv("JUDGE_BASE_URL", url)
        monkeypatch.setenv("JUDGE_API_KEY", "right")
        assert Preflight().check([compose_with("reward=hybrid")], sweep=False)
        assert capsys.readouterr().out == "preflight: reward.terms.judge ok\n"
        monkeypatch.setenv("JUDGE_API_KEY", "wrong-key")
        (line,) = failure_lines(capsys, compose_with("reward=llm_judge"))
    assert line.startswith("JUDGE_API_KEY: the judge at") and "refused the key" in line and "wrong-key" not in line


def test_an_unreachable_reward_model_server_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REWARD_MODEL_URL", f"http://127.0.0.1:{closed_port()}")
    (line,) = failure_lines(capsys, compose_with("reward=reward_model"))
    assert line.startswith("REWARD_MODEL_URL: the reward model's server at http://127.0.0.1:")


def test_a_missing_dataset_path_names_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_weights_load: list[str]
) -> None:
    (line,) = failure_lines(capsys, compose_with("data=spider", f"data.spider_dir={tmp_path}/absent"))
    assert line == f"data.spider_dir={tmp_path}/absent does not exist"
    monkeypatch.delenv("VERL_SPIDER_DATA_DIR", raising=False)
    (line,) = failure_lines(capsys, compose_with("data=spider"))
    assert line.startswith("data.spider_dir is not set") and "VERL_SPIDER_DATA_DIR" in line
    lines = failure_lines(capsys, compose_with("agent=med_sql", f"data.data_dir={tmp_path}", "data.generate=null"))
    assert lines == [
        f"data.data_dir={tmp_path} holds no {split} split: data.{split}_split={split} looks for {split}.parquet"
        for split in ("train", "val", "test")
    ]
    assert not no_weights_load


@pytest.fixture
def dev_only(spider_mini_dir: Path, tmp_path: Path) -> Path:
    """A folder in Spider's layout with dev.json and the databases only (no train_spider.json)."""
    folder = tmp_path / "spider"
    folder.mkdir()
    (folder / "dev.json").write_text((spider_mini_dir / "test.json").read_text())
    (folder / "database").symlink_to(spider_mini_dir / "database")
    return folder


def test_eval_on_spider_dev_alone_says_it_is_the_test_split(dev_only: Path, capsys: pytest.CaptureFixture[str]):
    """Real Spider's validation is carved from train and its dev set is the test split: job=eval's default split
    (val) needs train_spider.json, and the message says job.split=test evaluates dev.json."""
    with serve(scripted_app(lambda messages: say("SELECT 1"))) as url:
        cfg = compose_with("job=eval", "data=spider", f"data.spider_dir={dev_only}", f"endpoint.base_url={url}")
        (line,) = failure_lines(capsys, cfg)
        assert line.startswith(f"data.spider_dir={dev_only} holds no train split (train_spider.json or ")
        assert "Spider's dev set (dev.json) is the test split here (data.test_split=dev): job.split=test" in line
        as_test = compose_with("job=eval", "job.split=test", "data=spider", f"data.spider_dir={dev_only}")
        assert [f.check for f in data_findings(as_test, ("test",)) if f.ok] == ["data"]
    # the run says so too where it reads the split, and evaluates dev.json as the test split
    data = SpiderData(
        name="spider", spider_dir=str(dev_only), val_split=None, test_split="dev", val_from_train=0.05,
        val_limit=None, generate=None, val_subset_field=None,
    )  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"job\.split=test evaluates it"):
        data.val_tasks()
    assert len(data.test_tasks()) == len(json.loads((dev_only / "dev.json").read_text()))


def test_training_on_spider_without_its_files_names_each(tmp_path: Path) -> None:
    cfg = compose_with("data=spider", f"data.spider_dir={tmp_path}")
    lines = [f.fix for f in data_findings(cfg, ("train", "val", "test"))]
    assert lines == [
        f"data.spider_dir={tmp_path} holds no train split: data.train_split=train looks for train_spider.json or "
        "train_spider.parquet",
        f"data.spider_dir={tmp_path} holds no test split: data.test_split=dev looks for dev.json or "
        "test_dev_500.parquet or test_dev.parquet or dev.parquet",
        f"data.spider_dir={tmp_path} holds no database/ folder (Spider's database/<db_id>/<db_id>.sqlite)",
    ]


def test_an_unreachable_eval_endpoint_names_endpoint_base_url(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    (line,) = failure_lines(capsys, compose_with("job=eval", f"endpoint.base_url={url}"))
    assert line.startswith(f"endpoint.base_url={url} is not reachable")


def fake_command(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)


def test_the_slurm_launcher_needs_sbatch_and_an_answering_squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    (finding,) = slurm_findings(timeout_s=5)
    assert not finding.ok and finding.fix.startswith("hydra/launcher=slurm: sbatch is not on PATH")
    fake_command(tmp_path, "sbatch", "exit 0")
    fake_command(tmp_path, "squeue", "echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1")
    (finding,) = slurm_findings(timeout_s=5)
    assert not finding.ok and "squeue failed (slurm_load_jobs error: Unable to contact slurm controller)" in finding.fix
    fake_command(tmp_path, "squeue", "exit 0")
    assert slurm_findings(timeout_s=5)[0].ok
    # asked of a sweep with hydra/launcher=slurm only
    cfg = compose_with("hydra/launcher=slurm")
    assert ("slurm",) in [p.key for p in probes(cfg, Preflight(), launcher=str(cfg.hydra.launcher._target_))]
    assert ("slurm",) not in [p.key for p in probes(cfg, Preflight(), launcher=None)]  # a single run submits nothing


def test_identical_checks_of_a_sweep_run_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counted(hub_id: str, timeout_s: float) -> list[preflight.Finding]:
        calls.append(hub_id)
        return [preflight.Finding("model", True, hub_id)]

    monkeypatch.setattr(preflight, "hub_findings", counted)
    configs = [compose_with("model=qwen2.5-7b-instruct", f"seed={seed}") for seed in range(3)]
    found = [p for cfg in configs for p in probes(cfg, Preflight())]
    assert len(run_probes(found, deadline_s=5)) == 1 and calls == ["Qwen/Qwen2.5-7B-Instruct"]


def test_a_check_past_the_deadline_fails_instead_of_waiting() -> None:
    release = threading.Event()

    def hangs() -> list[preflight.Finding]:
        release.wait(30)  # a hang guard: released below
        return []

    stuck = preflight.Probe(("server", "http://h/v1"), hangs, "JUDGE_BASE_URL (the judge at http://h/v1)", True)
    try:
        (finding,) = run_probes([stuck], deadline_s=0.1)
    finally:
        release.set()
    assert not finding.ok and finding.fix == (
        "JUDGE_BASE_URL (the judge at http://h/v1): no answer within 0.1 s (hydra.callbacks.preflight.timeout_s)"
    )


@pytest.mark.integration
def test_launch_stops_before_anything_loads_naming_model_path_and_judge_base_url(tmp_path: Path) -> None:
    """The flagship command's failure in miniature, through launch.py: one line each, exit 1, no traceback, no run
    directory (Hydra makes it after the preflight), nothing built."""
    run_dir = tmp_path / "run"
    env = {"JUDGE_BASE_URL": f"http://127.0.0.1:{closed_port()}/v1"}
    args = ["model=qwen2.5-7b-instruct", f"model.hub_id={ABSENT_MODEL}", "reward=hybrid", f"hydra.run.dir={run_dir}"]
    result = launch(args, tmp_path / "cache", tmp_path, env=env)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0] == "preflight: this run cannot start; nothing was loaded or launched:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["model.path", "JUDGE_BASE_URL"]
    assert "Traceback" not in result.stderr + result.stdout
    assert not run_dir.exists() and not (tmp_path / "cache").exists()


@pytest.mark.integration
@pytest.mark.parametrize("launcher", ["local", "local_parallel"])
def test_a_sweep_runs_the_preflight_once(launcher: str, spider_mini_dir: Path, tmp_path: Path) -> None:
    """Checked in the process that starts the sweep, once for its runs; the runs (in this process, or joblib's
    workers) do not check again."""
    sweep = tmp_path / "sweep"
    data = ["data=spider", f"data.spider_dir={spider_mini_dir}"]  # real files: a data check to pass
    args = ["-m", *QUICK, *data, "seed=0,1,2", f"hydra/launcher={launcher}", f"hydra.sweep.dir={sweep}"]
    result = launch(args, tmp_path / "cache", tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("preflight") == 1 and "preflight (3 runs): data ok" in result.stdout
    statuses = [json.loads((sweep / str(n) / "summary.json").read_text())["status"] for n in range(3)]
    assert statuses == ["completed"] * 3


@pytest.mark.integration
def test_a_sweep_that_cannot_start_launches_nothing(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", *QUICK, "data=spider", "data.spider_dir=/absent,/absent2", "seed=0,1", f"hydra.sweep.dir={sweep}"]
    result = launch(args, tmp_path / "cache", tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "preflight: this sweep (4 runs) cannot start; nothing was loaded or launched:",
        "  data.spider_dir=/absent does not exist",
        "  data.spider_dir=/absent2 does not exist",
    ]
    assert not sweep.exists()


def test_the_preflight_is_hydras_callback_in_every_run() -> None:
    assert compose_with().hydra.callbacks.preflight._target_ == "jobs.preflight.Preflight"

"""job=doctor: the default run passes; backend=verl on a machine without GPUs or vLLM fails, naming what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs import doctor
from tests.conftest import launch


def rows(run_dir: Path) -> dict[str, dict[str, str]]:
    return {r["check"]: r for r in json.loads((run_dir / "doctor.json").read_text())}


@pytest.mark.integration
def test_doctor_passes_for_the_default_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = launch(["job=doctor", "job.min_free_gb=0", f"hydra.run.dir={run_dir}"], tmp_path / "cache", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = rows(run_dir)
    assert not [name for name, r in table.items() if r["status"] == "FAIL"]
    assert table["trl"]["status"] == "ok" and table["config"]["status"] == "ok"
    assert table["verl"]["status"] == "ok"  # the main venv holds backend=verl's pinned set too
    for check in ("python", "torch", "cuda / GPUs", "vllm", "verl's requirements", "ray", "ray cluster", "wandb"):
        assert check in table
    assert "preflight for backend=trl" in result.stdout


@pytest.mark.integration
def test_doctor_fails_for_backend_verl_without_gpus_or_vllm(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["job=doctor", "backend=verl", "model=tiny", "warmstart=none", "algorithm.pool_samples=null"]
    result = launch([*args, "job.min_free_gb=0", f"hydra.run.dir={run_dir}"], tmp_path / "cache", tmp_path)
    assert result.returncode != 0
    table = rows(run_dir)
    assert table["vllm"]["status"] == "FAIL" and "vllm==0.20.2" in table["vllm"]["fix"]
    assert table["cuda / GPUs"]["status"] == "FAIL" and "resources.gpus_per_node=1" in table["cuda / GPUs"]["fix"]
    assert table["verl"]["status"] == "ok" and table["config"]["status"] == "ok"  # ours and verl's validation
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "vllm" in summary["error"]


@pytest.mark.integration
def test_doctor_fails_on_a_missing_model_path(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["job=doctor", "job.min_free_gb=0", f"model.path={tmp_path}/absent", f"hydra.run.dir={run_dir}"]
    result = launch(args, tmp_path / "cache", tmp_path)
    assert result.returncode != 0
    assert rows(run_dir)["model"]["status"] == "FAIL" and "does not exist" in rows(run_dir)["model"]["fix"]


def test_the_transformers_vllm_mismatch_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_vllm(name: str) -> None:
        raise ImportError("cannot import name 'ProcessorMixin' from 'transformers.processing_utils'")

    monkeypatch.setattr(doctor, "_version", lambda dist: {"vllm": "0.11.0", "transformers": "5.23.0"}.get(dist))
    monkeypatch.setattr(doctor.importlib, "import_module", broken_vllm)
    row = doctor.vllm_row(needed=True)
    assert row.status == "FAIL" and "ProcessorMixin" in row.value
    assert "vLLM 0.11.0 and transformers 5.23.0 disagree" in row.fix

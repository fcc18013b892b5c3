"""job=doctor in .venv-verl: the pinned set is recognised; what a CPU machine lacks for backend=verl fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import closed_port, launch

pytestmark = pytest.mark.verl


def test_doctor_in_the_verl_venv(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    store = f"http://127.0.0.1:{closed_port()}"
    args = ["job=doctor", "backend=verl", "model=qwen2.5-coder-1.5b-instruct", "finetune=lora", "job.min_free_gb=0"]
    result = launch([*args, f"backend.store_address={store}", f"hydra.run.dir={run_dir}"], tmp_path / "c", tmp_path)
    assert result.returncode != 0
    table = {r["check"]: r for r in json.loads((run_dir / "doctor.json").read_text())}
    for check in ("agentlightning", "verl", "transformers", "openai", "opentelemetry-api", "opentelemetry exporters"):
        assert table[check]["status"] == "ok", table[check]
    assert table["config"]["value"] == "ours and verl's validate_config pass"
    assert table["store"]["status"] == "FAIL" and "agl store" in table["store"]["fix"]
    assert table["vllm"]["status"] == "FAIL"  # no vLLM on CPU machines
    assert table["cuda / GPUs"]["status"] == "FAIL"


def test_doctor_passes_for_backend_dev(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "job=doctor",
        "backend=dev",
        "model=qwen2.5-coder-1.5b-instruct",
        "job.min_free_gb=0",
        f"hydra.run.dir={run_dir}",
    ]
    result = launch(args, tmp_path / "c", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = {r["check"]: r for r in json.loads((run_dir / "doctor.json").read_text())}
    assert table["vllm"]["status"] == "-" and table["agentlightning"]["status"] == "ok"

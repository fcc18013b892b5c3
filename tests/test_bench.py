"""bench/sharded_steps.py's bookkeeping: which workload a variant runs, and what a row keeps of a run that failed
after its GRPO steps (a GPU run whose final save found the disk full still has its steps' timings and memory); and
bench/agent_rollouts.py runs end to end on CPU (its GPU runs are the only other place it runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_wheels
from sharded_steps import RECIPE_TASKS, appended, row, scaling, tasks_of


def test_a_variant_s_tasks_come_from_its_suffix_else_extra_else_the_recipe() -> None:
    assert tasks_of("fsdp2x2:32", ["algorithm.tasks_per_step=8"]) == 32
    assert tasks_of("fsdp2x2", ["algorithm.tasks_per_step=8"]) == 8  # --extra is not overridden by the recipe's
    assert tasks_of("plain", []) == RECIPE_TASKS


def step(n: int, step_s: float, update_gb: float) -> dict[str, float]:
    return {
        "step": n,
        "timing_s/step": step_s,
        "timing_s/update": step_s / 2,
        "rollout/model_tokens_mean": 100.0,
        "rollout/excluded_rate": 0.25,
        "gpu_memory/peak_gb": update_gb,
        "gpu_memory/update_peak_gb": update_gb,
        "sampling/is_ratio/mean": 1.0 + n / 1000,
    }


def test_a_run_that_failed_after_its_steps_keeps_them_beside_the_failure(tmp_path: Path) -> None:
    lines = [{"step": 0}, step(1, 30.0, 60.0), step(2, 20.0, 70.0), step(3, 22.0, 71.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "error": "OSError: No space left"}))
    failed = row("fsdp2x2", tmp_path, False, 1, rollouts=64)
    assert failed["failed"] == "exit 1: OSError: No space left"
    assert failed["steps"] == 3 and failed["step_s_each"] == [30.0, 20.0, 22.0]
    assert failed["step_s"] == 21.0  # the median after the first step (which compiles)
    assert failed["rollouts_per_s"] == 64 / 21.0
    assert failed["model_tokens_per_s"] == 100.0 * 64 * 0.75 / 21.0  # the excluded rollouts' tokens not counted
    assert [m["gpu_memory/peak_gb"] for m in failed["gpu_memory_by_step"]] == [60.0, 70.0, 71.0]
    assert failed["is_ratio_by_step"] == [{"sampling/is_ratio/mean": 1.0 + n / 1000} for n in (1, 2, 3)]


def test_scaling_sets_each_n_gpu_row_against_its_backends_one_gpu_row() -> None:
    rows = [
        {"variant": "fsdp2x1", "rollouts_per_s": 2.0},
        {"variant": "plain", "rollouts_per_s": 3.0},  # not the sharded path: no baseline, no entry
        {"variant": "fsdp2x4:64", "rollouts_per_s": 7.4},
        {"variant": "fsdp2x4", "rollouts_per_s": 5.0},
        {"variant": "verlx4:64", "rollouts_per_s": 4.0},  # verl's own one-GPU row is not there yet
        {"variant": "fsdp2x2:48", "rollouts_per_s": 3.0},
        {"variant": "fsdp2x2:32", "failed": "exit 1"},
    ]
    got = {e["variant"]: (e["baseline"], e["gpus"], e["scaling"], e["speedup"]) for e in scaling(rows, [])}
    assert got == {
        "fsdp2x4:64": ("fsdp2x1", 4, "weak", 3.7),
        "fsdp2x4": ("fsdp2x1", 4, "strong", 2.5),
        "fsdp2x2:48": ("fsdp2x1", 2, "other", 1.5),
    }
    rows.append({"variant": "verlx1:16", "rollouts_per_s": 1.0})
    assert {e["variant"]: e["scaling"] for e in scaling(rows, [])}["verlx4:64"] == "weak"


def test_a_later_call_appends_only_to_the_same_workload_on_the_same_machine() -> None:
    first = {"command": "a", "shape": "qwen25_1_5b", "extra": [], "recipe": ["r"], "gpus": 4, "device": "H100"}
    first["rows"] = [{"variant": "fsdp2x1"}]
    later = {key: value for key, value in first.items() if key != "rows"} | {"command": "b"}
    both = appended(later | {"command": "c"}, appended(later, first))
    assert both["rows"] == [{"variant": "fsdp2x1"}] and both["command"] == "a"
    assert both["appended_commands"] == ["b", "c"]
    with pytest.raises(ValueError, match="--append: gpus is 2 here, 4 in the file"):
        appended(later | {"gpus": 2}, first)


def test_a_run_that_failed_before_any_step_is_only_its_failure(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "error": "ConfigError: memory plan"}))
    expected = {"variant": "plain", "failed": "exit 1: ConfigError: memory plan"}
    assert row("plain", tmp_path, False, 1, rollouts=64) == expected


@pytest.mark.integration
@pytest.mark.parametrize(
    ("mode", "overrides"),
    [
        (["--async"], ["algorithm.max_staleness=2"]),
        (["--async", "--partial", "--carry-over"], ["algorithm.max_staleness=3", "algorithm.read_ahead_steps=2"]),
    ],
)
def test_the_agent_rollouts_bench_runs_a_step_asynchronously_on_cpu(
    tmp_path: Path, mode: list[str], overrides: list[str]
) -> None:
    out = tmp_path / "r.json"
    command = [sys.executable, "bench/agent_rollouts.py", "--shape", "tiny", "--device", "cpu", "--engine", "hf"]
    command += ["--steps", "1", "--warmup", "0", "--tasks", "1", "--group", "2", "--turns", "1", "--micro-batch", "2"]
    command += ["--response-budget", "256", *mode, "--profile-step", "0"]
    command += ["--out", str(out), "--override", *overrides]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(out.read_text())["result"]
    # every step the run trained: the timed one and, with --async, one more (nothing generates behind a last step)
    assert result["asynchronous"] is True and len(result["per_step"]) == len(result["step_s"]) == 2
    assert result["carry_over"] is ("--carry-over" in mode)
    assert result["median_step_s"] == result["step_s"][0]
    assert result["per_step"][0]["generated_tokens"] > 0 and result["per_step"][0]["update_s"] > 0
    # the profiled step's operators, by their own time, the update's matrix products and backward among them
    profile = result["profile"]
    assert profile["step"] == 0 and profile["step_s"] == result["step_s"][0]
    assert profile["update_s"] == result["per_step"][0]["update_s"]
    names = [o["name"] for o in profile["operators"]]
    assert {"aten::mm", "aten::addmm"} & set(names) and any("Backward" in n for n in names), names
    own = [o["self_cpu_ms"] for o in profile["operators"]]
    assert own == sorted(own, reverse=True) and all(o["calls"] > 0 for o in profile["operators"])
    assert profile["kernels"] == [] and profile["device_busy_s"] == 0  # a CPU run launches no kernel


def test_a_profile_step_the_run_does_not_train_is_refused_before_it_starts() -> None:
    command = [sys.executable, "bench/agent_rollouts.py", "--shape", "tiny", "--device", "cpu", "--steps", "2"]
    command += ["--warmup", "1", "--tasks", "1", "--group", "2", "--turns", "1", "--micro-batch", "2"]
    finished = subprocess.run([*command, "--profile-step", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 2 and "the run trains steps 0 to 2" in finished.stderr, finished.stderr[-2000:]


def test_the_gpu_bundle_carries_what_its_stack_needs_in_parts_that_install_whole(tmp_path: Path) -> None:
    """The trl stack carries the project's closure minus the GPU image (no verl, no ray); the verl stack adds verl's
    closure and this venv's transformers, which the image has in a version verl refuses."""
    from importlib import metadata

    trl, verl = ({r.split("==")[0]: r.split("==")[1] for r in gpu_wheels.pinned(s)} for s in ("trl", "verl"))
    assert trl["trl"] == metadata.version("trl") and "hydra-core" in trl
    assert not {"verl", "ray", "transformers", "torch"} & trl.keys()
    assert verl.keys() > trl.keys() and verl["verl"] == metadata.version("verl") and "ray" in verl
    assert verl["transformers"] == metadata.version("transformers") and "torch" not in verl

    # left out with what only it needs: openai-agents' cryptography and mcp; starlette stays (fastapi needs it)
    lean = {r.split("==")[0] for r in gpu_wheels.pinned("trl", frozenset({"openai-agents"}))}
    assert lean < trl.keys() and not {"openai-agents", "cryptography", "mcp"} & lean
    assert {"starlette", "fastapi", "langgraph", "hydra-core"} <= lean

    whole = tmp_path / "wheels.tar"
    whole.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    parts = gpu_wheels.write_parts(whole, tmp_path, 4096)
    assert [p.name for p in parts] == ["part00", "part01", "part02"]
    assert b"".join(p.read_bytes() for p in parts) == whole.read_bytes()
    assert 'cat "$here"/part* | tar' in (tmp_path / "install.sh").read_text()


def test_a_spider_study_run_imports_nothing_the_lean_gpu_bundle_leaves_out() -> None:
    """`gpu_wheels.py --leave-out openai-agents` is safe for the ablation study's runs: composing and building one
    (agent, reward, data, model, backend) imports no module of a distribution the lean bundle drops (but
    python_multipart, which starlette imports only if it is there); agent=med_sql does."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    full, lean = (
        {r.split("==")[0] for r in gpu_wheels.pinned("trl", x)} for x in (frozenset(), frozenset({"openai-agents"}))
    )
    dropped = full - lean
    optional = {"python_multipart", "multipart"}  # starlette: try: import python_multipart ... except: None
    modules = {
        module
        for module, dists in metadata.packages_distributions().items()
        if {canonicalize_name(d) for d in dists} & dropped and module not in optional
    }
    assert {"agents", "mcp", "cryptography", "jwt", "jsonschema", "griffe"} <= modules
    code = (
        "import json, sys; from hydra import compose, initialize_config_dir; from jobs.config import build_components\n"
        "with initialize_config_dir(config_dir=sys.argv[1], version_base=None):\n"
        "    cfg = compose(config_name='config', overrides=sys.argv[3:])\n"
        "build_components(cfg)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(json.loads(sys.argv[2])))))"
    )
    conf = str(ROOT / "conf")
    found = {}
    for name, overrides in (
        ("study", ["experiment=learn-pool-gpu-ablations", "backend.device=cpu"]),
        ("med_sql", ["agent=med_sql"]),
    ):
        run = subprocess.run(
            [sys.executable, "-c", code, conf, json.dumps(sorted(modules)), *overrides],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        found[name] = set(json.loads(run.stdout.strip().splitlines()[-1]))
    assert found["study"] == set() and "agents" in found["med_sql"]

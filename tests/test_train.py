"""GRPO end to end on CPU through launch.py: metrics, checkpoints, resume, LoRA, a sweep."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.status import main as status_main
from tests.conftest import FAST_RUN, ROOT, launch, wait_for


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_grpo_writes_metrics_and_checkpoints_and_resumes(cache_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Qwen3's template (thinking on): the check step's user turns follow replies, token in, token out
    args = [*FAST_RUN, "model.chat_template=qwen3", "algorithm.max_steps=3", f"hydra.run.dir={run_dir}"]
    args += ["algorithm.keep_checkpoints=3"]  # every step's, for the crash below (the default keeps the last one)
    result = launch(args, cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"run directory: {run_dir}" in result.stdout

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3 and len(summary["reward_per_step"]) == 3
    assert {"val_after_sft", "val_final", "sft", "grpo"} <= summary.keys()
    # the run ends with what a person reads, not the JSON (which stays in the run directory), and bars on stderr
    assert "val accuracy after SFT" in result.stdout and "val accuracy after GRPO" in result.stdout
    assert "reward per step (3 steps" in result.stdout and "noise" in result.stdout
    assert '"reward_per_step"' not in result.stdout
    assert "warm start (SFT)" in result.stderr and "GRPO" in result.stderr

    metrics = metrics_of(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert "val/accuracy" in metrics[0] and "val/accuracy" in metrics[-1]
    # spider_mini's dev questions say what they hold out: validation is also scored per subset
    for m in (metrics[0], metrics[-1]):
        subsets = {k.split("/")[1] for k in m if k.startswith("val/") and k.endswith("/accuracy") and k.count("/") == 2}
        assert subsets and subsets <= {"combination", "entity", "value"}
        assert sum(m[f"val/{s}/n"] for s in subsets) == m["val/n"]
    assert summary["val_final"]["subsets"].keys() == subsets and "per subset" in result.stdout
    assert all("train/reward_mean" in m and "rollout/turns_mean" in m for m in metrics[1:])
    assert all(m["rollout/llm_calls_mean"] >= 2 for m in metrics[1:])  # write + check at least: multi-turn samples
    # every training step says what was excluded and why, how exact the samples were, and the log-prob gap
    keys = {"rollout/excluded_rate", "rollout/discontinuous_rate", "train/sampling/logp_diff/mean"}
    keys |= {"train/elapsed_s", "train/nonfinite_grad_steps", "rollout/check_said_correct_rate"}
    keys |= {f"rollout/excluded_{r}_rate" for r in ("agent_error", "reward_error", "inexact", "overflow")}
    keys |= {f"timing_s/{phase}" for phase in ("step", "weight_sync", "rollout", "reward_sum", "scoring", "update")}
    assert all(keys <= m.keys() for m in metrics[1:])
    # the phases are parts of the step (validation too, where the step validated)
    for m in metrics[1:]:
        parts = m["timing_s/weight_sync"] + m["timing_s/rollout"] + m["timing_s/scoring"] + m["timing_s/update"]
        parts += m.get("timing_s/validation", 0)
        assert 0 < parts <= m["timing_s/step"] and m["timing_s/reward_sum"] > 0
    assert "timing_s/validation" in metrics[-1]
    assert all(m["rollout/discontinuous_rate"] == 0 and m["rollout/excluded_inexact_rate"] == 0 for m in metrics[1:])
    assert all(m["train/sampling/logp_diff/max"] < 1e-4 for m in metrics[1:] if m["rollout/excluded_rate"] < 1)
    for step in (1, 2, 3):
        assert (run_dir / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").is_file()
    assert (run_dir / "checkpoints" / "final" / "config.json").is_file()
    sample = json.loads((run_dir / "samples" / "val_final.jsonl").read_text().splitlines()[0])
    assert {"question", "final_sql", "reward", "messages"} <= sample.keys()

    # The same directory with another setting is another run: refused before it starts, naming the key
    other = launch([*args, "algorithm.learning_rate=0.5"], cache_dir, tmp_path)
    assert other.returncode == 1 and "holds a run with other settings (algorithm.learning_rate: " in other.stderr
    assert "Traceback" not in other.stderr  # one line: the message says what to do
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    # A crash after step 2: the last checkpoint and everything after it are gone. Running again resumes.
    shutil.rmtree(run_dir / "checkpoints" / "checkpoint-3")
    shutil.rmtree(run_dir / "checkpoints" / "final")
    result = launch(args, cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["resumed_from"] == "checkpoint-2" and resumed["steps"] == 3
    assert (summary["attempts"], resumed["attempts"]) == (1, 2)
    again = metrics_of(run_dir)
    assert [m["step"] for m in again] == [0, 1, 2, 3]
    assert again[:3] == metrics[:3]  # steps before the checkpoint are kept as they were, not re-run
    state = json.loads((run_dir / "checkpoints" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3

    # Stopped after its last step's checkpoint, before the final model: running again trains no further step
    shutil.rmtree(run_dir / "checkpoints" / "final")
    result = launch(args, cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    final = json.loads((run_dir / "summary.json").read_text())
    assert final["resumed_from"] == "checkpoint-3" and final["steps"] == 3 and final["attempts"] == 3
    scores = [{k: v for k, v in s["val_final"].items() if k != "wall_s"} for s in (final, resumed)]
    assert scores[0] == scores[1] and "val accuracy after GRPO" in result.stdout  # the same weights, validated
    assert metrics_of(run_dir) == again and not (run_dir / "checkpoints" / "checkpoint-4").exists()
    assert (run_dir / "checkpoints" / "final" / "config.json").is_file()


@pytest.mark.integration
def test_grpo_with_lora_saves_an_adapter(cache_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = launch([*FAST_RUN, "finetune=lora", "finetune.rank=8", f"hydra.run.dir={run_dir}"], cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "checkpoints" / "checkpoint-2" / "adapter_model.safetensors").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


@pytest.mark.integration
def test_a_two_seed_sweep_without_a_warm_start_gives_one_run_directory_each(cache_dir: Path, tmp_path: Path) -> None:
    result = launch(["-m", "model=tiny", "seed=0,1", *FAST_RUN, "warmstart=none"], cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = sorted((tmp_path / "sweeps").glob("*/*/summary.json"))
    assert [p.parent.name for p in summaries] == ["0", "1"]
    loaded = [json.loads(p.read_text()) for p in summaries]
    assert all(s["status"] == "completed" and s["steps"] == 2 for s in loaded)
    assert ["seed=0" in s["overrides"] for s in loaded] == [True, False]
    # no warm start: GRPO starts from the model itself, validated first as it is
    assert all("sft" not in s and {"val_initial", "val_final"} <= s.keys() for s in loaded)
    assert not any((p.parent / "checkpoints" / "sft").exists() for p in summaries)


# The other agents, unchanged, through the same backend: small data, SFT demonstrations from their oracles. The data
# sizes are the session fixtures' (tests/conftest.py): a run generates into the same cache directory, and other sizes
# would replace the data a fixture's tests read (test_dbbench read 40 entries for its 28 when this ran first).
# Each: its overrides, and the training and validation tasks they give.
OTHER_AGENTS = {
    "med_sql": (
        ["agent=med_sql", "data.generate.n_train=40", "data.generate.n_val=10", "data.generate.n_test=10"],
        40,
        10,
    ),
    "dbbench": (["agent=dbbench", "data.generate.n=28", "data.val_size=6", "data.test_size=4"], 18, 6),
}


@pytest.mark.integration
@pytest.mark.parametrize("agent", sorted(OTHER_AGENTS))
def test_grpo_runs_every_agent(agent: str, cache_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args, n_train, n_val = OTHER_AGENTS[agent]
    result = launch(["experiment=smoke", *args, f"hydra.run.dir={run_dir}"], cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["sft"]["demonstrations"] == n_train  # every training task gave one
    assert summary["val_final"]["n"] == n_val and summary["val_final"]["errors"] == 0
    metrics = metrics_of(run_dir)
    assert all(m["rollout/agent_error_rate"] == 0.0 for m in metrics[1:])
    # token in, token out holds for every agent: no call restarted its rollout's sequence
    assert all(
        m["rollout/discontinuous_rate"] == 0.0 and m["rollout/excluded_inexact_rate"] == 0.0 for m in metrics[1:]
    )


def start(args: list[str], cache: Path, output: Path) -> subprocess.Popen[bytes]:
    """`python launch.py ARGS` in the background, as `launch` runs it; its output goes to `output`/std{out,err}."""
    env = os.environ | {"ARL_CACHE_DIR": str(cache), "ARL_OUTPUT_DIR": str(output), "HF_HUB_OFFLINE": "1"}
    with (output / "stdout").open("w") as out, (output / "stderr").open("w") as err:
        return subprocess.Popen([sys.executable, "launch.py", *args], cwd=ROOT, env=env, stdout=out, stderr=err)


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


@pytest.mark.integration
def test_sigterm_in_grpo_checkpoints_at_the_step_end_and_the_printed_command_resumes(
    cache_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = [*FAST_RUN, "algorithm.max_steps=4", "algorithm.save_every=100", f"hydra.run.dir={run_dir}"]
    process = start(args, cache_dir, tmp_path)
    try:
        # Step 1 logged: training is inside step 2, where a stop waits for the step's end.
        wait_for(lambda: len(lines_of(run_dir / "metrics.jsonl")) >= 2 or process.poll() is not None, 600, "step 1")
        assert process.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=600)
    finally:
        process.kill()
    out = (tmp_path / "stdout").read_text()
    assert process.returncode != 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "SIGTERM" in summary["error"]
    assert summary["stopped_at"] == {"phase": "GRPO", "step": 2}
    assert summary["checkpoint"] == str(run_dir / "checkpoints" / "checkpoint-2")
    assert f"resume: {summary['resume']}" in out

    status = status_main([str(run_dir)])
    assert status == 0

    command = shlex.split(summary["resume"])
    assert command[:2] == ["python", "launch.py"]
    result = launch(command[2:], cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["status"] == "completed" and resumed["resumed_from"] == "checkpoint-2" and resumed["steps"] == 4
    assert [m["step"] for m in metrics_of(run_dir)] == [0, 1, 2, 3, 4]


@pytest.mark.integration
def test_sigterm_during_the_warm_start_leaves_an_interrupted_summary_that_status_lists(
    cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    run_dir = runs / "2026-11-24_00-00-00"
    args = [*FAST_RUN, "warmstart.steps=100000", f"hydra.run.dir={run_dir}"]
    process = start(args, cache_dir, tmp_path)
    try:
        wait_for(lambda: lines_of(run_dir / "sft_metrics.jsonl") or process.poll() is not None, 600, "SFT's first log")
        assert process.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        process.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stopped_at"]["phase"] == "warm start (SFT)"
    assert summary["checkpoint"] is None
    capsys.readouterr()
    assert status_main([str(runs)]) == 0  # a folder of single runs, as outputs/runs is
    table = capsys.readouterr().out
    assert "1 interrupted" in table and "warm start (SFT)" in table and "resume: python launch.py" in table


CONTROL_FLOPS = 4e11  # a few SFT steps of the smoke run's tiny model (~8e10 FLOPs a step)


@pytest.mark.integration
def test_the_control_arm_starts_from_the_shared_warm_start_and_stops_on_its_budget(
    cache_dir: Path, tmp_path: Path
) -> None:
    """experiment=learn-gpu's machinery on CPU: GRPO under a time budget builds the shared warm start; the control
    (algorithm=sft_control) reuses the very same weights, trains SFT for its FLOPs budget and is validated like GRPO;
    both count their compute alike."""
    shared = [*FAST_RUN, "warmstart.shared=true", "warmstart.seed=0", "algorithm.max_prompt_length=512"]
    grpo_dir, control_dir = tmp_path / "grpo", tmp_path / "control"
    # a budget spent by the first step: GRPO stops there (not at max_steps) and validates as at the end
    grpo_args = [
        *shared,
        "seed=1",
        "algorithm.max_steps=50",
        "algorithm.time_budget_s=0.01",
        "algorithm.learning_rate=1e-4",
        "algorithm.lr_warmup_steps=4",
        f"hydra.run.dir={grpo_dir}",
    ]
    grpo = launch(grpo_args, cache_dir, tmp_path)
    assert grpo.returncode == 0, grpo.stderr[-3000:]
    first = json.loads((grpo_dir / "summary.json").read_text())
    # stopped after the checkpoint of the step that spent its budget, before the final model: no step more
    shutil.rmtree(grpo_dir / "checkpoints" / "final")
    again = launch(grpo_args, cache_dir, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((grpo_dir / "summary.json").read_text())
    assert resumed["resumed_from"] == "checkpoint-1" and resumed["grpo"]["steps"] == 1
    assert (grpo_dir / "checkpoints" / "final").is_dir() and not (grpo_dir / "checkpoints" / "checkpoint-2").exists()
    control = launch(
        [
            *shared,
            "seed=2",
            "algorithm=sft_control",
            f"algorithm.flops_budget={CONTROL_FLOPS}",
            "algorithm.max_steps=-1",  # the budget alone ends it
            "algorithm.sft_val_every=2",
            f"hydra.run.dir={control_dir}",
        ],
        cache_dir,
        tmp_path,
    )
    assert control.returncode == 0, control.stderr[-3000:]

    second = json.loads((control_dir / "summary.json").read_text())
    assert (first["arm"], second["arm"]) == ("grpo", "sft_control")
    assert "wall_s" in first["sft"] and second["sft"]["reused"] is True  # built once, by the first run
    assert first["sft"]["flops"] == 6 * first["grpo"]["compute"]["parameters"] * first["sft"]["trained_tokens"] > 0
    assert first["sft"]["checkpoint"] == second["sft"]["checkpoint"]
    assert first["sft"]["weights_sha256"] == second["sft"]["weights_sha256"] is not None
    same = ("accuracy", "n", "errors", "mean_turns")  # the same weights validate the same (greedy)
    assert {k: second["val_after_sft"][k] for k in same} == {k: first["val_after_sft"][k] for k in same}

    steps = metrics_of(grpo_dir)
    assert [m["step"] for m in steps] == [0, 1] and first["grpo"]["steps"] == 1
    # compute: 6N per trained token, 2N per prefilled or generated token and per forward-only one (a reference
    # model's: none here; the IS correction reads the loss's own forward); GPU-seconds: one rank's training seconds
    n, step = first["grpo"]["compute"]["parameters"], steps[-1]
    assert step["compute/trained_tokens"] > 0 and step["compute/generated_tokens"] > 0
    assert step["compute/prefill_tokens"] > 0 and step["compute/pool_flops"] == 0
    assert step["compute/forward_only_tokens"] == 0 and step["train/sampling/is_ratio/mean"] > 0
    flops = n * (6 * step["compute/trained_tokens"] + 2 * step["compute/forward_only_tokens"])
    assert step["compute/flops"] == flops + 2 * n * (step["compute/generated_tokens"] + step["compute/prefill_tokens"])
    assert step["compute/gpu_s"] == step["train/elapsed_s"] and first["grpo"]["compute"]["ranks"] == 1
    assert first["grpo"]["compute"]["wall_s"] == first["grpo"]["wall_s"] >= first["grpo"]["train_s"]
    assert steps[-1]["train/learning_rate"] == 0  # the first step of a warm-up from 0 (transformers' schedule)
    assert "val/accuracy" in steps[-1] and first["grpo"]["train_s"] == steps[-1]["train/elapsed_s"]

    lines = metrics_of(control_dir)
    assert lines[0]["step"] == 0 and {"val/accuracy"} <= lines[0].keys()  # after the warm start, before training
    assert all({"val/accuracy", "sft/loss"} <= m.keys() for m in lines[1:])
    assert [m["step"] % 2 for m in lines[1:-1]] == [0] * (len(lines) - 2)  # every sft_val_every steps, and the end
    assert second["sft_control"]["train_s"] == lines[-1]["train/elapsed_s"]
    # the FLOPs budget ends the control at the first step end past it: no step logged before it had spent it
    assert lines[-1]["compute/flops"] >= CONTROL_FLOPS > max(m["compute/flops"] for m in lines[1:-1])
    assert lines[-1]["compute/flops"] == 6 * n * lines[-1]["compute/trained_tokens"] and lines[-1]["step"] >= 3
    assert lines[-1]["compute/gpu_s"] == lines[-1]["train/elapsed_s"]  # one rank, no pool
    assert second["sft_control"]["steps"] == lines[-1]["step"] and "val_final" in second
    assert "val accuracy after more SFT" in control.stdout and "SFT reused" in control.stdout


@pytest.mark.integration
def test_rejection_sampling_fine_tuning_runs_as_an_arm(cache_dir: Path, tmp_path: Path) -> None:
    """algorithm=rft: GRPO's rollout loop, trained on the accepted rollouts (tests/test_rollouts.py has the loss)."""
    run_dir = tmp_path / "rft"
    args = [*FAST_RUN, "algorithm=rft", "algorithm.max_prompt_length=512", "algorithm.max_steps=1"]
    result = launch([*args, f"hydra.run.dir={run_dir}"], cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["arm"] == "rft" and summary["grpo"]["steps"] == 1
    step = metrics_of(run_dir)[-1]
    assert 0 <= step["train/rft/accepted_rate"] <= 1 and step["compute/flops"] > 0


@pytest.mark.integration
def test_a_warm_start_carried_from_elsewhere_is_loaded_and_checked_by_its_digest(
    cache_dir: Path, tmp_path: Path
) -> None:
    """One warm start for every arm, seed and machine: a later run loads it by path (no SFT of its own), and one that
    names another digest stops before any model loads."""
    built, carried = tmp_path / "built", tmp_path / "carried"
    one_step = [*FAST_RUN, "algorithm.max_steps=1"]
    first = launch([*one_step, f"hydra.run.dir={built}"], cache_dir, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    sft = json.loads((built / "summary.json").read_text())["sft"]
    checkpoint = tmp_path / "warmstart"
    shutil.copytree(sft["checkpoint"], checkpoint)  # as a GPU call's output folder brings it back
    given = [f"warmstart.path={checkpoint}", f"warmstart.weights_sha256={sft['weights_sha256']}"]
    second = launch([*one_step, *given, f"hydra.run.dir={carried}"], cache_dir, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    reused = json.loads((carried / "summary.json").read_text())
    assert reused["sft"]["reused"] is True and reused["sft"]["weights_sha256"] == sft["weights_sha256"]
    assert not (carried / "sft_metrics.jsonl").exists()  # no SFT ran
    first_val = json.loads((built / "summary.json").read_text())["val_after_sft"]
    assert reused["val_after_sft"]["accuracy"] == first_val["accuracy"]

    wrong = launch([*one_step, given[0], "warmstart.weights_sha256=0123456789abcdef"], cache_dir, tmp_path)
    assert wrong.returncode != 0
    assert "warmstart.weights_sha256=0123456789abcdef, but warmstart.path=" in wrong.stderr + wrong.stdout

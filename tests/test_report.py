"""analysis.report on run directories with known numbers: the seed articles' 3B results come out exactly, with
error bars, differences to the baseline and a noise flag; failed, unfinished and not-started runs are listed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats

from analysis import report, verdicts
from analysis.runs import load_wandb
from foundation.stats import Estimate

# The seed articles' Qwen2.5-Coder-3B results (validation accuracy, %) per (max prompt length, agent turns).
SEED_RESULTS = {(2048, 1): 73.2, (2048, 3): 76.4, (4096, 1): 80.2, (4096, 3): 80.4}
CHECK_STEP_RESULT = 77.6  # with the check step, at 4096 / 3 turns
SPREAD = (-0.005, 0.0, 0.005)
# which seed gets which offset, per cell of sweep A: every cell holds the same three values around its mean (its
# interval stays 1.2), while the differences of cells paired by seed vary (a paired interval of 2.2 points)
ROTATION = {(2048, 1): 0, (2048, 3): 1, (4096, 1): 1, (4096, 3): 2}
# what each verdict line of `write_arm`'s runs ends with
COST = (
    "Training GPU-seconds per run: 181 vs 181; FLOPs per run (`compute/flops`: training, rollouts, the pool's "
    "sampling): 1.81e+15 vs 1.81e+15; equal budget: training seconds (180 s)."
)  # seeds 0, 1, 2 around the cell mean: sd 0.5 points


def write_run(
    path: Path, overrides: list[str], config: dict[str, Any], summary: dict | None, val: float | None
) -> None:
    """A run directory as jobs/job.py and the TRL backend write it: validation at 0, 2, 4; reward per step."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    choices = {"model": "qwen2.5-coder-3b-instruct", "experiment": config.get("experiment_name", "x")}
    (path / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}))
    if val is None:  # ended before its first validation, or not ended
        if summary is not None:
            (path / "summary.json").write_text(json.dumps(summary))
        return
    lines = [{"step": 0, "val/accuracy": 0.6}]
    for step in range(1, 5):
        line: dict[str, Any] = {"step": step, "train/reward_mean": 0.1 * step, "train/num_tokens": 1000.0 * step}
        if step % 2 == 0:
            line["val/accuracy"] = val - 0.01 if step == 2 else val
        lines.append(line)
    if summary is None:  # still running: two steps so far
        lines = lines[:3]
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))


def config_of(ctx: int, turns: int, check: bool, seed: int, resources: dict | None = None) -> dict[str, Any]:
    config = {
        "seed": seed,
        "algorithm": {"name": "grpo", "max_prompt_length": ctx, "max_response_length": 1024},
        "agent": {"max_turns": turns, "check_step": check},
        "model": {"name": "qwen2.5-coder-3b-instruct"},
    }
    return config | ({"resources": resources} if resources else {})


@pytest.fixture
def sweeps(tmp_path: Path) -> tuple[Path, Path]:
    """Sweep A: 2 context lengths x 2 turn limits x seeds 0-3, seed 3 failed, unfinished or never started.
    Sweep B: the check step on, 4096 / 3 turns, seeds 0-2, on 2 GPUs (`resources`)."""
    a, b = tmp_path / "sweeps" / "A", tmp_path / "sweeps" / "B"
    a.mkdir(parents=True)
    task = ["algorithm.max_prompt_length=2048,4096", "agent.max_turns=1,3", "seed=0,1,2,3"]
    (a / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": task}, "sweeper": {}}}))
    num = 0
    for ctx in (2048, 4096):
        for turns in (1, 3):
            for seed in range(4):
                overrides = [f"algorithm.max_prompt_length={ctx}", f"agent.max_turns={turns}", f"seed={seed}"]
                ok = {"status": "completed", "wall_s": 7200.0, "device": "cuda", "overrides": overrides}
                value = SEED_RESULTS[(ctx, turns)] / 100
                if seed < 3:
                    offset = SPREAD[(seed + ROTATION[(ctx, turns)]) % 3]
                    write_run(a / str(num), overrides, config_of(ctx, turns, False, seed), ok, value + offset)
                elif (ctx, turns) in ((2048, 1), (4096, 3)):
                    failed = ok | {"status": "failed", "error": "OutOfMemoryError: CUDA out of memory\nTraceback..."}
                    write_run(a / str(num), overrides, config_of(ctx, turns, False, seed), failed, value)
                elif (ctx, turns) == (2048, 3):
                    write_run(a / str(num), overrides, config_of(ctx, turns, False, seed), None, value)
                num += 1  # (4096, 1) seed 3: no directory, the job never started
    for seed in range(3):
        overrides = ["agent.check_step=true", f"seed={seed}"]
        ok = {"status": "completed", "wall_s": 7200.0, "device": "cuda", "overrides": overrides}
        config = config_of(4096, 3, True, seed, resources={"nodes": 1, "gpus_per_node": 2})
        write_run(b / str(seed), overrides, config, ok, CHECK_STEP_RESULT / 100 + SPREAD[seed])
    return a, b


def cells(line: str) -> set[str]:
    return {c.strip() for c in line.split("|")}


def line_with(text: str, *wanted: str) -> str:
    """The one table row that has each of `wanted` as a whole cell."""
    lines = [line for line in text.splitlines() if set(wanted) <= cells(line)]
    assert len(lines) == 1, f"{wanted}: {lines}"
    return lines[0]


def test_report_shows_known_numbers_with_error_bars_and_noise_flags(sweeps: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = sweeps
    out = report.main([str(a), str(b), "--out", str(tmp_path / "report")])
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    tables = out_tables(md)

    # The cell table: every result exactly, mean ± 95% CI over 3 seeds (t: 4.303 x 0.5 / sqrt(3) = 1.2 points).
    for (ctx, turns), value in SEED_RESULTS.items():
        row = line_with(tables["All cells"], f"{ctx}", f"{turns}", "False", f"{value} ± 1.2")
        assert "2.000" in cells(row)  # GPU-hours per run: 2 h on one GPU
        assert f"{value} ± 1.2" in page
    row = line_with(tables["All cells"], "4096", "3", "True", f"{CHECK_STEP_RESULT} ± 1.2")
    assert "4.000" in cells(row)  # 2 h on 1 node x 2 GPUs
    assert "3/4" in line_with(tables["All cells"], "2048", "1", "False", "73.2 ± 1.2")  # one seed of four failed
    assert "3/4" in line_with(tables["All cells"], "4096", "1", "False", "80.2 ± 1.2")  # one never started

    # 1 vs 3 turns at 2048: +3.2 points, beyond noise; at 4096 the articles' 80.2 vs 80.4: +0.2, within noise.
    turns = tables["agent.max_turns"]
    assert {"+3.2", "beyond noise"} <= cells(line_with(turns, "2048", "76.4 ± 1.2"))
    assert {"+0.2", "within noise"} <= cells(line_with(turns, "4096", "80.4 ± 1.2"))
    assert "baseline" in cells(line_with(turns, "4096", "80.2 ± 1.2"))
    context = tables["algorithm.max_prompt_length"]
    assert {"+7.0", "beyond noise"} <= cells(line_with(context, "4096", "80.2 ± 1.2"))
    assert "+4.0" in cells(line_with(context, "4096", "80.4 ± 1.2"))
    check = tables["agent.check_step"]
    assert {"-2.8", "beyond noise"} <= cells(line_with(check, "True", "77.6 ± 1.2"))

    # Failed, unfinished and never-started runs are listed with their error, not averaged in.
    problems = tables["Failed and unfinished runs"]
    assert "OutOfMemoryError: CUDA out of memory" in line_with(problems, "A/3", "failed")
    assert "failed" in line_with(problems, "A/15")
    assert "unfinished" in line_with(problems, "A/7")
    assert "algorithm.max_prompt_length=4096 agent.max_turns=1 seed=3" in line_with(problems, "A/11", "not started")

    # One pandas table with every run; figures in both formats.
    runs = pd.read_csv(out / "runs.csv")
    assert len(runs) == 19 and set(runs.status) == {"completed", "failed", "unfinished", "not started"}
    done = runs[(runs.status == "completed") & (runs["algorithm.max_prompt_length"] == 2048)]
    assert sorted(done.val_final.round(3)) == [0.727, 0.732, 0.737, 0.759, 0.764, 0.769]
    assert set(done.val_best.round(3)) == set(done.val_final.round(3)) and set(done.tokens) == {4000.0}
    assert (out / "curves.png").stat().st_size > 0 and (out / "cost.png").stat().st_size > 0
    assert "![Learning curves](curves.png)" in md and page.count("data:image/png;base64,") == 2


def table_rows(section: str) -> list[dict[str, str]]:
    """A markdown table's rows as {column: cell}."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]]


def out_tables(md: str) -> dict[str, str]:
    """The report's sections by heading (factor sections by their key)."""
    sections: dict[str, str] = {}
    for chunk in md.split("\n## ")[1:]:
        heading, _, body = chunk.partition("\n")
        sections[heading.removeprefix("Factor ").strip("`")] = body
    return sections


def test_a_single_seed_has_no_error_bar_and_no_verdict(tmp_path: Path) -> None:
    for num, turns in enumerate((1, 3)):
        overrides = [f"agent.max_turns={turns}"]
        summary = {"status": "completed", "wall_s": 60.0, "device": "cpu"}
        write_run(tmp_path / "s" / str(num), overrides, config_of(2048, turns, False, 0), summary, 0.5 + turns / 100)
    out = report.main([str(tmp_path / "s")])
    md = (out / "report.md").read_text()
    assert {"+2.0", "no error bar (n < 2)"} <= cells(line_with(out_tables(md)["agent.max_turns"], "53.0"))
    assert "51.0" in cells(line_with(out_tables(md)["All cells"], "1", "1/1"))


def test_a_sweep_where_every_run_failed_still_gets_a_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for num, (turns, modules) in enumerate([(1, ["q_proj", "v_proj"]), (3, ["q_proj"])]):
        overrides = [f"agent.max_turns={turns}", f"finetune.target_modules=[{','.join(modules)}]"]
        config = config_of(2048, turns, False, 0) | {"finetune": {"target_modules": modules}}
        summary = {"status": "failed", "error": f"ValueError: bad {turns}\nTraceback", "wall_s": 1.0, "device": "cpu"}
        write_run(tmp_path / "s" / str(num), overrides, config, summary, None)
    out = report.main([str(tmp_path / "s")])
    md = (out / "report.md").read_text()
    assert "factors: agent.max_turns, finetune.target_modules\n" in capsys.readouterr().out
    assert list(pd.read_csv(out / "runs.csv")["finetune.target_modules"]) == ["['q_proj', 'v_proj']", "['q_proj']"]
    problems = table_rows(out_tables(md)["Failed and unfinished runs"])
    assert [(p["run"], p["status"], p["error"]) for p in problems] == [
        ("s/0", "failed", "ValueError: bad 1"),
        ("s/1", "failed", "ValueError: bad 3"),
    ]


def test_a_wandb_project_reads_like_run_directories() -> None:
    """The W&B source maps a project's runs (config and history as logger=wandb logs them) to the same rows."""

    class FakeRun:
        def __init__(self, turns: int, seed: int, state: str) -> None:
            self.name, self.state = f"agent.max_turns={turns},seed={seed}", state
            overrides = [f"agent.max_turns={turns}", f"seed={seed}"]
            self.config = config_of(2048, turns, False, seed) | {"hydra_overrides": overrides, "hydra_choices": {}}
            self.summary_metrics = {"status": "completed", "wall_s": 3600.0} if state == "finished" else {}
            self.rows = [{"_step": 0, "val/accuracy": 0.5}, {"_step": 1, "train/reward_mean": 0.3, "val/accuracy": 0.6}]

        def scan_history(self) -> list[dict[str, Any]]:
            return self.rows

    class FakeApi:
        def runs(self, path: str, filters: dict | None) -> list[FakeRun]:
            assert path == "me/agentic-rl" and filters == {"group": "ablation-turns/2026-11-21_22-16-17"}
            return [FakeRun(1, 0, "finished"), FakeRun(3, 0, "finished"), FakeRun(3, 1, "running")]

    runs = load_wandb("me/agentic-rl/ablation-turns/2026-11-21_22-16-17", FakeApi())
    built, factors = report.build(runs)
    assert factors == ["agent.max_turns"]
    assert list(built.runs.status) == ["completed", "completed", "unfinished"]
    assert list(built.runs.val_final) == [0.6, 0.6, 0.6] and list(built.runs.reward_final) == [0.3, 0.3, 0.3]
    assert list(built.problems.run) == ["agent.max_turns=3,seed=1"]


def write_arm(
    path: Path,
    arm: str,
    seed: int,
    val_final: float,
    subsets: dict[str, float] | None = None,
    warm_seed: int | None = None,
    analysis: dict[str, Any] | None = None,
    test_final: float | None = None,
    items: dict[str, float] | None = None,
    extra: list[str] | None = None,
    step_metrics: dict[str, float] | None = None,
) -> None:
    """A run of experiment=learn-gpu as the TRL backend writes it: validation after the warm start (step 0, no
    training seconds), then steps with `train/elapsed_s`; the control logs no reward. `subsets`: the last
    validation's accuracy per subset of the validation split. `warm_seed`: the run's `warmstart.seed` override, and a
    warm-start digest of its own. `analysis`: the study's declaration in its config; `test_final`: the final model's
    test accuracy; `items`: each test question's score (`scores/test_final.json`); `extra`: more overrides;
    `step_metrics`: more of each step's metrics (timings, compute)."""
    overrides = [f"algorithm={arm}", f"seed={seed}"] + ([] if warm_seed is None else [f"warmstart.seed={warm_seed}"])
    overrides += extra or []
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    config: dict[str, Any] = {"seed": seed, "algorithm": {"name": arm, "time_budget_s": 180.0}}
    config |= {} if warm_seed is None else {"warmstart": {"seed": warm_seed}}
    config |= {} if analysis is None else {"analysis": analysis}
    for override in extra or []:  # in the config too, as Hydra composes it
        key, value = override.split("=", 1)
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    choices = {"algorithm": arm, "experiment": "learn-gpu"}
    (path / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}))
    lines: list[dict[str, Any]] = [{"step": 0, "val/accuracy": 0.5}]
    for step, elapsed in ((10, 90.0), (20, 181.0)):
        line: dict[str, Any] = {"step": step, "train/elapsed_s": elapsed, "compute/flops": elapsed * 1e13}
        line |= {"val/accuracy": val_final if step == 20 else 0.52}
        line |= {f"val/{k}/accuracy": v for k, v in (subsets or {}).items() if step == 20}
        line |= {f"val/{k}/n": 100 for k in (subsets or {}) if step == 20}
        line |= {"train/reward_mean": 0.4} if arm == "grpo" else {"sft/loss": 0.1}
        line |= {"test/accuracy": test_final} if test_final is not None and step == 20 else {}
        lines.append(line | (step_metrics or {}))
    if items is not None:
        (path / "scores").mkdir()
        (path / "scores" / "test_final.json").write_text(json.dumps(items))
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    summary = {"status": "completed", "wall_s": 300.0, "device": "cuda", "overrides": overrides, "arm": arm}
    if warm_seed is not None:
        summary["sft"] = {"weights_sha256": f"warm{warm_seed}"}
    (path / "summary.json").write_text(json.dumps(summary))


@pytest.mark.parametrize(
    ("grpo", "control", "verdict"),
    [
        ((0.62, 0.64, 0.66), (0.54, 0.55, 0.56), "**better than the control, beyond noise**"),
        ((0.50, 0.56, 0.62), (0.53, 0.55, 0.57), "**inside noise**"),
        ((0.40, 0.42, 0.43), (0.54, 0.55, 0.56), "**worse than the control, beyond noise**"),
    ],
)
def test_a_treatment_is_judged_against_its_control(
    tmp_path: Path, grpo: tuple[float, ...], control: tuple[float, ...], verdict: str
) -> None:
    """The treatment is listed first in the sweep; the control still is the baseline, the verdict line says how the
    treatment compares over seeds, and cost is the training GPU-seconds both arms share."""
    sweep = tmp_path / "learning"
    num = 0
    for arm, values in (("grpo", grpo), ("sft_control", control)):
        for seed, value in enumerate(values):
            write_arm(sweep / str(num), arm, seed, value)
            num += 1
    out = report.main([str(sweep)])
    md = (out / "report.md").read_text()
    lines = [line for line in out_tables(md)["Treatment against control"].splitlines() if line.startswith("- ")]
    mean = sum(grpo) / 3 * 100
    expected = f"{mean:.1f} ± " if len(set(grpo)) > 1 else f"{mean:.1f}"
    assert len(lines) == 1 and lines[0].startswith(f"- algorithm=grpo against the control: {expected}")
    # seeds 0-2 in both arms, no warm start: each pair is its own unit
    assert f"{verdict} (exploratory, uncorrected); paired (3 pairs), it could detect |Δ| ≥ " in lines[0]
    assert lines[0].endswith(" with 80% power. " + COST)
    diff = (sum(grpo) - sum(control)) / 3 * 100
    assert f"Δ {diff:+.1f} [" in lines[0]
    rows = table_rows(out_tables(md)["algorithm"])
    expected_rows = [("sft_control", "baseline"), ("grpo", f"{diff:+.1f}")]
    assert [(r["algorithm"], r["Δ vs baseline"]) for r in rows] == expected_rows
    assert (out / "curves.png").stat().st_size > 0
    assert line_with(out_tables(md)["All cells"], "grpo").count("181") == 1


def test_a_treatment_is_judged_on_each_validation_subset_too(tmp_path: Path) -> None:
    """Inside noise on all questions, beyond noise on one subset: the report says both, subset by subset, each
    subset's CI widened for the number of subsets (Bonferroni)."""
    sweep = tmp_path / "learning"
    runs = [("grpo", 0.50, 0.30, 0.44), ("grpo", 0.56, 0.32, 0.48), ("grpo", 0.62, 0.31, 0.52)]
    runs += [("sft_control", 0.53, 0.10, 0.34), ("sft_control", 0.55, 0.11, 0.38), ("sft_control", 0.57, 0.12, 0.42)]
    for num, (arm, val, entity, value) in enumerate(runs):  # the control's seeds differ: Welch's test, not paired
        seed = num % 3 + (10 if arm == "sft_control" else 0)
        write_arm(sweep / str(num), arm, seed, val, {"combination": 0.05, "entity": entity, "value": value})
    # runs from before subsets were logged count in the overall verdict, not in the subsets' ones
    write_arm(tmp_path / "older" / "0", "grpo", 3, 0.56)
    write_arm(tmp_path / "older" / "1", "sft_control", 3, 0.55)
    out = report.main([str(sweep), str(tmp_path / "older"), "--out", str(tmp_path / "report")])
    md = (out / "report.md").read_text()
    section = out_tables(md)["Treatment against control"]
    assert "with 3 subsets each Δ's CI is 98.3% (Bonferroni)" in section
    lines = [line for line in section.splitlines() if line.startswith("- ")]
    assert len(lines) == 4 and lines[0].startswith("- algorithm=grpo against the control: 56.0 ± ")
    assert "(n=4) vs 55.0 ± " in lines[0] and "inside noise" in lines[0]
    assert all(line.count("(n=3)") == 2 for line in lines[1:])
    assert lines[1].startswith("- `combination` questions: algorithm=grpo against the control: 5.0 ± 0.0 (n=3) vs")
    subsets = "(exploratory; Bonferroni over 3 subsets, p x 3)"
    assert lines[1].endswith(f": **inside noise** {subsets}; Welch. " + COST)  # no spread: no power
    assert lines[2].startswith("- `entity` questions: algorithm=grpo against the control: 31.0 ± 2.5 (n=3) vs 11.0")
    assert "Δ +20.0 [" in lines[2] and "**better than the control, beyond noise**" in lines[2]
    # +10 points at a spread of 4: beyond noise at 95% (Welch: [+0.9, +19.1]), not at 98.3%
    assert lines[3].startswith("- `value` questions:") and "Δ +10.0 [-2.9, +22.9], p = " in lines[3]
    assert f"**inside noise** {subsets}; Welch" in lines[3]
    p = float(lines[3].split("p = ")[1].split(":")[0])  # p x 3 over 0.05 where the 98.3% CI holds 0
    assert p > 0.05
    cells = table_rows(out_tables(md)["All cells"])
    assert [r["val_final:entity"] for r in cells] == ["11.0 ± 2.5 (n=3)", "31.0 ± 2.5 (n=3)"]


def test_no_control_no_verdict_section(sweeps: tuple[Path, Path]) -> None:
    md = (report.main([str(sweeps[0])]) / "report.md").read_text()
    assert "Treatment against control" not in md


def test_a_metric_the_control_does_not_log_gets_no_verdict(tmp_path: Path) -> None:
    """The control logs no reward: comparing `reward_final` says so instead of judging it."""
    for num, (arm, seed) in enumerate([(a, s) for a in ("grpo", "sft_control") for s in range(2)]):
        write_arm(tmp_path / "learning" / str(num), arm, seed, 0.5 + seed / 100)
    md = (report.main([str(tmp_path / "learning"), "--metric", "reward_final"]) / "report.md").read_text()
    assert "**no verdict (an arm has no `reward_final`)**" in out_tables(md)["Treatment against control"]


def test_paired_runs_are_compared_pair_by_pair_and_the_detectable_effect_is_stated(tmp_path: Path) -> None:
    """Seeds 0-3 in both arms from one warm start: the per-seed differences (-3, +1, +5, +1 points) are tested, not
    the arms' spreads; the smallest effect detectable at 80% power is (t(0.975, 3) + t(0.8, 3)) x sd / sqrt(4)."""
    grpo, control = (0.50, 0.56, 0.62, 0.58), (0.53, 0.55, 0.57, 0.57)
    for num, (arm, seed, value) in enumerate(
        [("grpo", s, v) for s, v in enumerate(grpo)] + [("sft_control", s, v) for s, v in enumerate(control)]
    ):
        write_arm(tmp_path / "paired" / str(num), arm, seed, value)
    md = (report.main([str(tmp_path / "paired")]) / "report.md").read_text()
    line = next(x for x in out_tables(md)["Treatment against control"].splitlines() if x.startswith("- "))
    d = [g - c for g, c in zip(grpo, control, strict=True)]
    sd = pd.Series(d).std()
    detectable = (stats.t.ppf(0.975, 3) + stats.t.ppf(0.8, 3)) * sd / 2
    test = stats.ttest_1samp(d, 0.0)
    ci = test.confidence_interval(0.95)
    assert f"Δ +1.0 [{ci.low * 100:+.1f}, {ci.high * 100:+.1f}], p = {test.pvalue:.3f}: **inside noise**" in line
    assert "**inside noise** (exploratory, uncorrected); paired (4 pairs)" in line
    assert f"it could detect |Δ| ≥ {detectable * 100:.1f} with 80% power" in line


def test_a_folder_of_sweeps_is_read_whole(tmp_path: Path) -> None:
    """`results/<experiment>/runs/<sweep>/<job>`: every sweep's runs, and each sweep's jobs that never started."""
    for sweep, seeds in (("s0", (0, 1)), ("s1", (2, 3))):
        root = tmp_path / "runs" / sweep
        root.mkdir(parents=True)
        task = ["algorithm=grpo,sft_control", f"seed={seeds[0]},{seeds[1]}"]
        (root / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": task}, "sweeper": {}}}))
        for num, (arm, seed) in enumerate([(a, s) for a in ("grpo", "sft_control") for s in seeds][:3]):
            write_arm(root / str(num), arm, seed, 0.5)
    built, _ = report.build(report.load([str(tmp_path)]))
    assert sorted(built.runs.status) == ["completed"] * 6 + ["not started"] * 2


def test_an_archived_run_with_gzipped_metrics_reads_as_the_plain_one(sweeps: tuple[Path, Path]) -> None:
    """results/ keeps metrics.jsonl gzipped: the curves and the report read from it are the plain run's."""
    _, b = sweeps
    plain = report.load([str(b)])
    for metrics in b.rglob("metrics.jsonl"):
        metrics.with_suffix(".jsonl.gz").write_bytes(gzip.compress(metrics.read_bytes()))
        metrics.unlink()
    archived = report.load([str(b)])
    assert [r.metrics for r in archived] == [r.metrics for r in plain] and plain[0].metrics


def test_the_verdict_names_the_budget_both_arms_shared() -> None:
    def arm(budget_flops: float | None, budget_s: float | None, budget_gpu_s: float | None = None) -> pd.DataFrame:
        row = {"train_gpu_s": 150.0, "gpu_s": 180.0, "flops": 2e15, "budget_flops": budget_flops, "budget_s": budget_s}
        return pd.DataFrame([row | {"budget_gpu_s": budget_gpu_s}] * 2, dtype=float)

    line = report._compute_line(arm(2e15, None), arm(2e15, 150))
    assert line.startswith("Training GPU-seconds per run: 150 vs 150; GPU-seconds with the pool's sampling: 180 vs 180")
    assert line.endswith("; equal budget: FLOPs (2.00e+15).")
    assert report._compute_line(arm(None, None, 300), arm(None, 150, 300)).endswith("equal budget: GPU-seconds (300).")
    assert report._compute_line(arm(None, 150), arm(None, 150)).endswith("; equal budget: training seconds (150 s).")
    assert report._compute_line(arm(2e15, None), arm(None, 150)).endswith(
        "; no budget shared by every run of both arms."
    )


def test_treatments_are_also_judged_against_each_other(tmp_path: Path) -> None:
    """GRPO and RFT from one start: besides each against the control, RFT against GRPO, paired by seed."""
    values = {"grpo": (0.50, 0.56, 0.62), "rft": (0.49, 0.54, 0.61), "sft_control": (0.40, 0.45, 0.41)}
    num = 0
    for arm, by_seed in values.items():
        for seed, value in enumerate(by_seed):
            write_arm(tmp_path / "arms" / str(num), arm, seed, value)
            num += 1
    md = (report.main([str(tmp_path / "arms")]) / "report.md").read_text()
    lines = [x for x in out_tables(md)["Treatments against each other"].splitlines() if x.startswith("- ")]
    assert len(lines) == 1 and lines[0].startswith("- algorithm=rft against algorithm=grpo: 54.7 ± ")
    assert "Δ -1.3 [" in lines[0] and "; paired (3 pairs), it could detect" in lines[0]


def test_a_factor_only_some_arms_set_makes_one_cell_per_arm_not_one_per_run(tmp_path: Path) -> None:
    """The control's own learning rate, absent from the RL arm (NaN there): GRPO's runs are one cell, one line."""
    num = 0
    for arm, lr in (("grpo", None), ("sft_control", "0.003")):
        for seed in range(3):
            extra = [] if lr is None else [f"algorithm.sft_learning_rate={lr}"]
            value = 0.5 + 0.01 * seed + (0.1 if lr is None else 0.0)
            write_arm(tmp_path / "arms" / str(num), arm, seed, value, extra=extra)
            num += 1
    md = (report.main([str(tmp_path / "arms")]) / "report.md").read_text()
    lines = [x for x in out_tables(md)["Treatment against control"].splitlines() if x.startswith("- ")]
    assert len(lines) == 1 and lines[0].startswith("- algorithm=grpo against the control: 61.0 ± 2.5 (n=3) vs 51.0")
    assert out_tables(md)["algorithm.sft_learning_rate"].strip().startswith("No two cells differ in")
    assert line_with(out_tables(md)["All cells"], "grpo", "unset", "3/3")


def test_runs_from_several_warm_starts_are_paired_within_each_and_judged_per_warm_start(tmp_path: Path) -> None:
    """Seeds 0-1 from one warm start, 2-3 from another (`warmstart.seed`): a seed is a replicate, not a factor, so
    one verdict over the four pairs, each treatment run against the control with its seed and warm start; the warm
    start is the independent unit (2 of them: no claim beyond them)."""
    num = 0
    for arm, by_seed in (("grpo", (0.55, 0.58, 0.54, 0.60)), ("sft_control", (0.50, 0.51, 0.52, 0.53))):
        for seed, value in enumerate(by_seed):
            write_arm(tmp_path / "warm" / str(num), arm, seed, value, warm_seed=seed // 2)
            num += 1
    md = (report.main([str(tmp_path / "warm")]) / "report.md").read_text()
    lines = [x for x in out_tables(md)["Treatment against control"].splitlines() if x.startswith("- ")]
    assert len(lines) == 1 and lines[0].startswith("- algorithm=grpo against the control: ")
    assert "paired at the warm start level (2 warm starts, 4 pairs)" in lines[0]
    assert "2 warm starts: cannot speak beyond its warm starts" in lines[0]
    assert "Factor `warmstart.seed`" not in md


# Three warm starts x three seeds whose gain differs by warm start (+1, +9, +17 points, seeds within 1 point):
# pooled over the nine pairs the interval is narrow; at the warm-start level (2 degrees of freedom) it holds 0.
HETEROGENEOUS = {0: (0.010, 0.015, 0.005), 1: (0.090, 0.095, 0.085), 2: (0.170, 0.175, 0.165)}


def write_study(root: Path, analysis: dict[str, Any] | None, gains: dict[int, tuple[float, ...]]) -> None:
    """GRPO, RFT and the control from warm starts 0-2 with three seeds each; GRPO = control + the warm start's gain,
    RFT = control + half of it; test accuracy as the metric, each run's 10 test questions' scores kept."""
    num = 0
    for warm, by_seed in gains.items():
        for i, gain in enumerate(by_seed):
            seed = 3 * warm + i
            control = 0.30 + 0.01 * i
            for arm, value in (("sft_control", control), ("grpo", control + gain), ("rft", control + gain / 2)):
                items = {f"q{q}": float(q < round(value * 10)) for q in range(10)}
                write_arm(
                    root / str(num), arm, seed, 0.5, warm_seed=warm, analysis=analysis, test_final=value, items=items
                )
                num += 1


def test_heterogeneous_warm_starts_widen_the_interval_beyond_the_pooled_one(tmp_path: Path) -> None:
    write_study(tmp_path / "study", None, HETEROGENEOUS)
    built, _ = report.build(report.load([str(tmp_path / "study")]), "test_final")
    line = next(line for line in built.verdicts if line.verdict and line.verdict.name.startswith("algorithm=grpo"))
    clustered = line.verdict.comparison
    pooled = stats.ttest_1samp([g for gains in HETEROGENEOUS.values() for g in gains], 0.0).confidence_interval()
    assert clustered.test == "paired at the warm start level (3 warm starts, 9 pairs)"
    assert clustered.high - clustered.low > 3 * (pooled.high - pooled.low)
    assert pooled.low > 0 and clustered.low < 0 < clustered.high  # beyond noise pooled, not per warm start
    assert clustered.heterogeneity is not None and clustered.heterogeneity.p < 0.001
    assert "heterogeneity across warm starts F = " in line.text and "**inside noise**" in line.text


def test_an_undeclared_comparison_is_labelled_exploratory(tmp_path: Path) -> None:
    """No declaration: every verdict line is exploratory and uncorrected, and the report says none was declared."""
    write_study(tmp_path / "study", None, HETEROGENEOUS)
    md = (report.main([str(tmp_path / "study"), "--metric", "test_final"]) / "report.md").read_text()
    tables = out_tables(md)
    assert tables["Declared comparisons"].strip().startswith("None: the runs declare no comparison")
    verdicts = [
        x
        for name in ("Treatment against control", "Treatments against each other")
        for x in tables[name].splitlines()
        if x.startswith("- ")
    ]
    assert len(verdicts) == 3  # GRPO and RFT against the control, RFT against GRPO
    assert all("(exploratory, uncorrected)" in x for x in verdicts)


DECLARED = {
    "metric": "test_final",
    "cluster": "warm_start",
    "alpha": 0.05,
    "comparisons": [
        {"name": "grpo_vs_control", "treatment": ["algorithm=grpo"], "baseline": ["algorithm=sft_control"]},
        {
            "name": "rft_vs_control",
            "treatment": ["algorithm=rft"],
            "baseline": ["algorithm=sft_control"],
            "role": "secondary",
        },
    ],
}
# Gains that hold in every warm start: GRPO +3 to +4 points (seeds vary by a point), RFT half of it.
STEADY = {0: (0.02, 0.03, 0.04), 1: (0.04, 0.05, 0.03), 2: (0.04, 0.02, 0.03)}


def test_declared_comparisons_are_adjusted_by_holm_over_their_family(tmp_path: Path) -> None:
    write_study(tmp_path / "study", DECLARED, STEADY)
    built, _ = report.build(report.load([str(tmp_path / "study")]))
    grpo, rft = built.declared
    assert (grpo.name, grpo.role, rft.role) == ("grpo_vs_control", "primary", "secondary")
    p = sorted([grpo.comparison.p, rft.comparison.p])
    holm = [min(1.0, 2 * p[0]), min(1.0, max(2 * p[0], p[1]))]  # Holm over two: 2 x the smaller, then the larger
    assert sorted([grpo.p_holm, rft.p_holm]) == pytest.approx(holm)
    assert grpo.comparison.test == "paired at the warm start level (3 warm starts, 9 pairs)"
    md = (report.main([str(tmp_path / "study")]) / "report.md").read_text()
    section = out_tables(md)["Declared comparisons"]
    line = next(x for x in section.splitlines() if x.startswith("- **grpo_vs_control** (primary)"))
    assert f"Holm-adjusted p = {grpo.p_holm:.3f} (family of 2, alpha 0.05)" in line
    # what it could detect at the level the correction tests first (alpha / 2), over the 3 warm starts' means
    means = [np.mean(gains) for gains in STEADY.values()]
    strict = (stats.t.ppf(1 - 0.05 / 4, 2) + stats.t.ppf(0.8, 2)) * np.std(means, ddof=1) / np.sqrt(3)
    assert grpo.comparison.detectable == pytest.approx(strict)
    assert f"it could detect |Δ| ≥ {strict * 100:.1f} with 80% power at alpha 0.05/2 (Holm's first step)" in line
    # each run's 10 questions: right on the first round(accuracy x 10); the resampled mean is the pairs' mean
    per_question = (
        np.mean(
            [
                round((0.30 + 0.01 * i + g) * 10) - round((0.30 + 0.01 * i) * 10)
                for gains in STEADY.values()
                for i, g in enumerate(gains)
            ]
        )
        * 10
    )
    assert grpo.bootstrap is not None and grpo.bootstrap[0] == pytest.approx(per_question / 100)
    assert f"resampling clusters and questions: Δ {per_question:+.1f} [" in line
    assert "(exploratory" not in section
    # the exploratory sections name a declared comparison instead of judging it again at 95 %
    control = out_tables(md)["Treatment against control"]
    assert "- algorithm=grpo against the control: declared as `grpo_vs_control`, judged above (Holm" in control
    assert "- algorithm=rft against the control: declared as `rft_vs_control`, judged above" in control
    others = out_tables(md)["Treatments against each other"]
    assert "- algorithm=rft against algorithm=grpo: " in others and "(exploratory, uncorrected)" in others


def test_a_declared_comparison_between_treatments_is_named_either_way_round(tmp_path: Path) -> None:
    """GRPO against RFT declared with GRPO as the treatment: the report lists RFT against GRPO (the later-listed arm
    against the earlier), names the declaration the other way round and judges it only in the declared block."""
    analysis = DECLARED | {
        "comparisons": [{"name": "grpo_vs_rft", "treatment": ["algorithm=grpo"], "baseline": ["algorithm=rft"]}]
    }
    write_study(tmp_path / "study", analysis, STEADY)
    built, _ = report.build(report.load([str(tmp_path / "study")]))
    named = [line for line in built.pairs if "declared as" in line.text]
    assert [line.verdict for line in named] == [None]
    assert named[0].text == (
        "algorithm=rft against algorithm=grpo: declared as `grpo_vs_rft` (the other way round), judged above (Holm "
        "over its family)."
    )
    assert [v.name for v in built.declared] == ["grpo_vs_rft"]


def test_each_warm_start_s_difference_is_shown_beside_the_declared_verdicts(tmp_path: Path) -> None:
    """The units the verdicts are taken over: per warm start, the mean of its seeds' differences and its pairs."""
    write_study(tmp_path / "study", DECLARED, STEADY)
    built, _ = report.build(report.load([str(tmp_path / "study")]))
    table = built.by_cluster
    assert len(table) == 3 and (table["pairs grpo_vs_control"] == 3).all()
    assert sorted(table["Δ grpo_vs_control"]) == pytest.approx(sorted(np.mean(g) for g in STEADY.values()))
    assert table["Δ rft_vs_control"].to_numpy() == pytest.approx(table["Δ grpo_vs_control"].to_numpy() / 2)
    section = out_tables((report.main([str(tmp_path / "study")]) / "report.md").read_text())
    rows = section["Declared comparisons per warm start"]
    assert line_with(rows, "warm1", "+4.0", "+2.0")  # warm start 1: GRPO +4/+5/+3, RFT half of it
    assert "val_initial" in rows


def test_a_comparison_beyond_noise_alone_is_inside_noise_after_holm(tmp_path: Path) -> None:
    """Five declared comparisons of the same two arms: one p under 0.05 alone is over it x 5."""
    comparisons = [
        {"name": f"c{i}", "treatment": ["algorithm=grpo"], "baseline": ["algorithm=sft_control"]} for i in range(5)
    ]
    gains = {0: (0.01, 0.02, 0.03), 1: (0.03, 0.04, 0.05), 2: (0.02, 0.03, 0.04)}  # t = 5.2 on 2 df
    write_study(tmp_path / "study", DECLARED | {"comparisons": comparisons}, gains)
    built, _ = report.build(report.load([str(tmp_path / "study")]))
    first = built.declared[0]
    assert first.comparison.p < 0.05 < first.p_holm == pytest.approx(min(1.0, 5 * first.comparison.p))
    assert first.comparison.flag == "beyond noise" and first.outcome == "inside noise"


def test_runs_that_declare_different_analyses_are_refused(tmp_path: Path) -> None:
    write_study(tmp_path / "a", DECLARED, STEADY)
    write_study(tmp_path / "b", DECLARED | {"alpha": 0.01}, STEADY)
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "a"), str(tmp_path / "b")])


def test_every_look_at_the_test_split_is_recorded_and_a_changed_verdict_says_so(tmp_path: Path) -> None:
    """A pilot's look (one warm start: no verdict), a re-render into another folder (the same runs and scores: not a
    new look, and the same ledger: it is kept with the runs), then more warm starts: the second look is in the
    ledger, and the verdict says it changed since the first."""
    study = tmp_path / "study"
    write_study(study / "ws0", DECLARED, {0: STEADY[0]})
    report.main([str(study), "--out", str(tmp_path / "report")])
    report.main([str(study), "--out", str(tmp_path / "elsewhere")])
    ledger = [json.loads(x) for x in (study / "ledger.jsonl").read_text().splitlines()]
    assert [look["look"] for look in ledger] == [1]
    assert ledger[0]["runs"] == 9 and ledger[0]["verdicts"]["grpo_vs_control"]["outcome"].startswith("no verdict")
    write_study(study / "ws12", DECLARED, {1: STEADY[1], 2: STEADY[2]})
    md = (report.main([str(study), "--out", str(tmp_path / "report")]) / "report.md").read_text()
    ledger = [json.loads(x) for x in (study / "ledger.jsonl").read_text().splitlines()]
    assert [(look["look"], look["runs"]) for look in ledger] == [(1, 9), (2, 27)]
    line = next(x for x in out_tables(md)["Declared comparisons"].splitlines() if "grpo_vs_control" in x)
    assert "test look 2 (" in line and "after 1 earlier look" in line
    assert "CHANGED since: no verdict" in line and "at look 1 (9 runs)" in line
    assert "look 2 at it (" in md and "1 look before this one" in md


def test_a_report_on_part_of_a_judged_study_is_a_look_at_that_study(tmp_path: Path) -> None:
    """After the study's look, a report on one of its folders (or on its folders named one by one) is recorded in
    the study's ledger, not as the first look of a ledger of its own."""
    study = tmp_path / "study"
    write_study(study / "ws0", DECLARED, {0: STEADY[0]})
    write_study(study / "ws12", DECLARED, {1: STEADY[1], 2: STEADY[2]})
    report.main([str(study), "--out", str(tmp_path / "report")])
    report.main([str(study / "ws12"), "--out", str(tmp_path / "part")])
    report.main([str(study / "ws0"), str(study / "ws12"), "--out", str(tmp_path / "named")])
    ledger = [json.loads(x) for x in (study / "ledger.jsonl").read_text().splitlines()]
    assert [(look["look"], look["runs"]) for look in ledger] == [(1, 27), (2, 18)]
    assert not (study / "ws12" / "ledger.jsonl").exists()
    assert "look 2 at it (" in (tmp_path / "part" / "report.md").read_text()


def test_showing_test_scores_is_a_look_whatever_metric_the_report_judges(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cells table shows `test_final` beside validation: a report on `val_final` still records the look, and
    says so where it is run."""
    write_study(tmp_path / "study", None, STEADY)
    report.main([str(tmp_path / "study"), "--metric", "val_final"])
    (look,) = [json.loads(x) for x in (tmp_path / "study" / "ledger.jsonl").read_text().splitlines()]
    assert look["runs"] == 27 and look["metric"] == "test_final"
    assert "The test split's scores here are look 1 at it (" in capsys.readouterr().out


def test_a_run_without_its_partner_is_named_not_pooled(tmp_path: Path) -> None:
    """One GRPO run lost its metric: the other eight pairs are compared at the warm-start level, and the line names
    the runs left out (falling back to Welch over all runs would ignore the warm starts: on the pool study that
    turned an interval holding 0 into one that does not)."""
    write_study(tmp_path / "study", None, HETEROGENEOUS)
    lost = next(
        p for p in (tmp_path / "study").iterdir() if "algorithm=grpo" in (p / ".hydra/overrides.yaml").read_text()
    )
    metrics = [json.loads(x) for x in (lost / "metrics.jsonl").read_text().splitlines()]
    (lost / "metrics.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in m.items() if k != "test/accuracy"}) + "\n" for m in metrics)
    )
    built, _ = report.build(report.load([str(tmp_path / "study")]), "test_final")
    line = next(x for x in built.verdicts if x.verdict and x.verdict.name.startswith("algorithm=grpo"))
    c = line.verdict.comparison
    assert c.test == "paired at the warm start level (3 warm starts, 8 pairs)" and c.low < 0 < c.high
    # the lost run and its seed's control run, both named
    assert "2 runs without a partner left out (" in line.text and str(lost.relative_to(tmp_path)) in line.text


def test_differences_without_spread_get_no_verdict(tmp_path: Path) -> None:
    """Every warm start gains exactly 2 points: no spread, no test, no certain verdict."""
    write_study(tmp_path / "study", None, {w: (0.02, 0.02, 0.02) for w in range(3)})
    built, _ = report.build(report.load([str(tmp_path / "study")]), "test_final")
    line = next(x for x in built.verdicts if x.verdict and x.verdict.name.startswith("algorithm=grpo"))
    assert "**no verdict (no spread between the units: no test)**" in line.text


def test_two_warm_starts_of_one_seed_each_say_they_cannot_speak_beyond_them(tmp_path: Path) -> None:
    write_study(tmp_path / "study", None, {0: (0.02,), 1: (0.05,)})
    built, _ = report.build(report.load([str(tmp_path / "study")]), "test_final")
    line = next(x for x in built.verdicts if x.verdict and x.verdict.name.startswith("algorithm=grpo"))
    assert "2 warm starts: cannot speak beyond its warm starts" in line.text


@pytest.mark.parametrize(
    ("value", "override", "matches"),
    [
        (False, "x=false", True),
        (0, "x=false", False),  # 0 is not false
        (True, "x=1", False),
        (2048, "x=2048.0", True),
        (None, "x=null", True),
        (float("nan"), "x=null", True),
        ("grpo", "x=grpo", True),
        ("grpo", "x=rft", False),
    ],
)
def test_a_declared_override_matches_values_of_its_type(value: Any, override: str, matches: bool) -> None:
    table = pd.DataFrame({"value:x": [value]})
    assert len(verdicts.matching(table, [override])) == int(matches)


def test_a_declaration_that_matches_no_run_says_so(tmp_path: Path) -> None:
    typo = DECLARED | {
        "comparisons": [{"name": "typo", "treatment": ["algorithm=grop"], "baseline": ["algorithm=rft"]}]
    }
    write_study(tmp_path / "study", typo, STEADY)
    md = (report.main([str(tmp_path / "study")]) / "report.md").read_text()
    assert "no completed run matches algorithm=grop" in out_tables(md)["Declared comparisons"]


def test_runs_without_a_declaration_do_not_join_a_declared_study(tmp_path: Path) -> None:
    write_study(tmp_path / "declared", DECLARED, STEADY)
    write_study(tmp_path / "older", None, STEADY)
    with pytest.raises(ValueError, match="27 runs declare no analysis"):
        report.build(report.load([str(tmp_path / "declared"), str(tmp_path / "older")]))


def test_the_ablation_table_pairs_by_warm_start_shows_the_declared_holm_p_and_the_cost(tmp_path: Path) -> None:
    """An ablation of the check step from three warm starts x two seeds, declared: the factor's table has each cell
    with its interval, Δ paired at the warm start's level, the declared comparison's Holm-adjusted p and role, and
    what a run cost (GPU-seconds, seconds a step, the rollouts' share, tokens generated)."""
    analysis = {
        "metric": "test_final",
        "cluster": "warm_start",
        "comparisons": [
            {"name": "no_check", "treatment": ["agent.check_step=false"], "baseline": ["agent.check_step=true"]},
            {"name": "one_turn", "treatment": ["agent.max_turns=1"], "baseline": ["agent.max_turns=3"]},
        ],
    }
    num = 0
    for warm in range(3):
        for seed in (2 * warm, 2 * warm + 1):
            for check, value, step_s in ((True, 0.40, 6.0), (False, 0.30 + 0.02 * warm + 0.01 * (seed % 2), 4.0)):
                cost = {"timing_s/step": step_s, "timing_s/rollout": step_s / 2, "compute/gpu_s": 60 * step_s}
                write_arm(
                    tmp_path / "study" / str(num),
                    "grpo",
                    seed,
                    0.5,
                    warm_seed=warm,
                    analysis=analysis,
                    test_final=value,
                    extra=[f"agent.check_step={str(check).lower()}"],
                    step_metrics=cost | {"compute/generated_tokens": 1000 * step_s},
                )
                num += 1
    md = (report.main([str(tmp_path / "study")]) / "report.md").read_text()
    rows = {r["agent.check_step"]: r for r in table_rows(out_tables(md)["agent.check_step"])}
    assert rows["True"]["Δ vs baseline"] == "baseline" and rows["True"]["test_final"] == "40.0 ± 0.0"
    no_check = rows["False"]
    assert no_check["Δ vs baseline"] == "-7.5" and no_check["noise"] == "beyond noise"
    # 3 warm starts, not 6 pairs: t(2) over the warm starts' mean differences -9.5, -7.5, -5.5
    per_warm = stats.ttest_1samp([-0.095, -0.075, -0.055], 0.0).confidence_interval()
    assert no_check["95% CI of Δ"] == f"[{per_warm.low * 100:+.1f}, {per_warm.high * 100:+.1f}]"
    assert no_check["Holm p"].endswith("(primary)")  # its declared verdict, adjusted over the family of two
    se = np.std([-0.095, -0.075, -0.055], ddof=1) / np.sqrt(3)  # detectable at Holm's first step, alpha / 2
    assert no_check["detectable Δ"] == f"{(stats.t.ppf(1 - 0.05 / 4, 2) + stats.t.ppf(0.8, 2)) * se * 100:.1f}"
    assert (no_check["GPU-s/run"], no_check["s/step"], no_check["rollout share"]) == ("240", "4.00", "50%")
    assert no_check["generated tokens/run"] == "4,000" and rows["True"]["GPU-s/run"] == "360"


def test_one_at_a_time_cells_find_their_declarations_in_each_factor_s_table(tmp_path: Path) -> None:
    """A baseline cell and one factor changed in each other cell, declared with every factor named on both sides
    (as experiment=learn-pool-gpu-ablations does): each factor's table shows its own declaration's Holm p."""
    base = ["agent.check_step=true", "agent.max_turns=3"]
    analysis = {
        "metric": "test_final",
        "comparisons": [
            {"name": "no_check", "treatment": ["agent.check_step=false", "agent.max_turns=3"], "baseline": base},
            {"name": "one_turn", "treatment": ["agent.check_step=true", "agent.max_turns=1"], "baseline": base},
        ],
    }
    cells = {"baseline": (base, 0.40), "no_check": (["agent.check_step=false", "agent.max_turns=3"], 0.30)}
    cells["one_turn"] = (["agent.check_step=true", "agent.max_turns=1"], 0.38)
    num = 0
    for warm in range(3):
        for seed in (2 * warm, 2 * warm + 1):
            for overrides, value in cells.values():
                value += 0.01 * warm + 0.005 * seed * (overrides != base)
                write_arm(
                    tmp_path / "s" / str(num), "grpo", seed, 0.5, warm_seed=warm, analysis=analysis, test_final=value,
                    extra=overrides,
                )  # fmt: skip
                num += 1
    built, _ = report.build(report.load([str(tmp_path / "s")]))
    holm = {v.name: v.p_holm for v in built.declared}
    check = built.factors["agent.check_step"]
    assert list(check["Holm p"]) == ["", f"{holm['no_check']:.3f} (primary)"]
    turns = built.factors["agent.max_turns"]
    assert list(turns["agent.max_turns"]) == [3, 1] and list(turns["Holm p"]) == [
        "",
        f"{holm['one_turn']:.3f} (primary)",
    ]


def test_a_declared_row_of_a_factor_table_is_in_or_beyond_noise_as_its_family_judges_it(tmp_path: Path) -> None:
    """The check step off gains 5, 7 and 9 points in three warm starts: beyond noise at 95 % on its own (p 0.026),
    inside noise in a declared family of three (Holm: 3p). The factor table's `noise` is the family's verdict."""
    analysis = {
        "metric": "test_final",
        "comparisons": [
            {"name": "no_check", "treatment": ["agent.check_step=false"], "baseline": ["agent.check_step=true"]},
            {"name": "one_turn", "treatment": ["agent.max_turns=1"], "baseline": ["agent.max_turns=3"]},
            {"name": "short", "treatment": ["algorithm.max_response_length=256"], "baseline": ["agent.max_turns=3"]},
        ],
    }
    num = 0
    for warm, gain in enumerate((0.05, 0.07, 0.09)):
        for seed in (2 * warm, 2 * warm + 1):
            for check, value in ((True, 0.40 + 0.01 * warm), (False, 0.40 + 0.01 * warm + gain)):
                write_arm(
                    tmp_path / "s" / str(num), "grpo", seed, 0.5, warm_seed=warm, analysis=analysis,
                    test_final=value, extra=[f"agent.check_step={str(check).lower()}"],
                )  # fmt: skip
                num += 1
    built, _ = report.build(report.load([str(tmp_path / "s")]))
    no_check = built.declared[0]
    assert no_check.comparison.p < 0.05 < no_check.p_holm and no_check.outcome == "inside noise"
    row = built.factors["agent.check_step"].iloc[1]
    assert float(row["p"]) < 0.05 and row["noise"] == "within noise"


def test_a_curves_band_is_taken_over_warm_starts_not_over_seeds_that_share_them() -> None:
    """Two warm starts, two seeds each, seeds alike within a warm start: four values look like four independent
    draws (a narrow band); the band is over the two warm starts' means (t with 1 degree of freedom: wide)."""
    curves = pd.DataFrame({"point": [1] * 4, "cluster": ["a", "a", "b", "b"], "val/accuracy": [0.10, 0.11, 0.20, 0.21]})
    points, mean, half = report.curve_band(curves, "val/accuracy")
    pooled = Estimate.of(curves["val/accuracy"])
    assert list(points) == [1] and mean[0] == pytest.approx(0.155)
    assert half[0] > 3 * (pooled.half or 0.0) > 0  # t(1) x sd of 0.105 and 0.205 / sqrt 2, not t(3) x sd of four


def test_a_folder_that_is_not_there_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        report.main([str(tmp_path / "nowhere")])
    assert stopped.value.code == 2 and f"{tmp_path / 'nowhere'}: not a directory" in capsys.readouterr().err


def test_an_interim_report_leaves_the_test_split_unread(tmp_path: Path) -> None:
    """`--no-test` on a declared study whose runs scored the test split (overall, per subset, per question): no test
    score anywhere in the report, no verdict on it, no look in the ledger; the exploratory tables on validation (not
    the declared `test_final`); asking for a test metric with it is refused."""
    write_study(tmp_path / "study", DECLARED, STEADY)
    for metrics in (tmp_path / "study").glob("*/metrics.jsonl"):
        lines = [json.loads(x) for x in metrics.read_text().splitlines()]
        lines[-1] |= {"test/value/accuracy": 0.777, "test/value/n": 10}
        metrics.write_text("".join(json.dumps(m) + "\n" for m in lines))
    out = report.main([str(tmp_path / "study"), "--no-test", "--out", str(tmp_path / "interim")])
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert not (tmp_path / "study" / "ledger.jsonl").exists() and not (out / "ledger.jsonl").exists()
    assert "left unread (`--no-test`: an interim report); no look at it." in md
    assert md.count("no verdict (a side has no runs with the metric)") == 2
    assert md.count("the test split left unread (`--no-test`).") == 2
    assert "Metric: validation accuracy at the last step (`val_final`" in md
    assert "77.7" not in md and "77.7" not in page
    table = pd.read_csv(out / "runs.csv")
    assert table.test_final.isna().all() and table.val_final.notna().all()
    assert not [c for c in table.columns if c.startswith("test_final:")]
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "study"), "--no-test", "--metric", "test_final", "--out", str(tmp_path / "x")])
    # read as it reads them: without any test score, per question included
    run = report.load([str(tmp_path / "study")])[0]
    hidden = report.without_test(run)
    assert run.items.get("test_final") and not hidden.items
    assert not [k for m in hidden.metrics for k in m if k.startswith("test/")]


def test_runs_lost_before_their_end_are_judged_again_at_a_score_beside_the_declared_verdicts(tmp_path: Path) -> None:
    """One GRPO run a warm start stopped before its end (`interrupted`: no `sft` block in its summary, no test
    accuracy, as a stopped run leaves it): the declared verdicts leave them out (GRPO still beyond noise on the six
    pairs left); `--unfinished-as 0` judges the same family again with them scored 0, paired with their twins
    through the digest their config pinned: GRPO's verdict then differs (beyond noise the other way), RFT's (no run
    lost) agrees, each line counting the runs imputed on each side; that analysis is a look of its own in the ledger
    (a plain report after it another, a re-render none); the plain report has no such block and its run table is as
    before (the lost runs unpaired); a score outside an accuracy's 0-1, or with --no-test, is refused."""
    write_study(tmp_path / "study", DECLARED, STEADY)
    lost = []
    for run in sorted((tmp_path / "study").iterdir(), key=lambda p: int(p.name)):
        config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
        warm = config["warmstart"]["seed"]
        if config["algorithm"]["name"] != "grpo" or str(warm) in lost:
            continue
        lost.append(str(warm))
        config["warmstart"]["weights_sha256"] = f"warm{warm}"
        (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
        summary = json.loads((run / "summary.json").read_text())
        del summary["sft"]
        (run / "summary.json").write_text(json.dumps(summary | {"status": "interrupted"}))
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        (run / "metrics.jsonl").write_text(  # its questions' scores kept, as a run failed after its test: never used
            "".join(json.dumps({k: v for k, v in m.items() if k != "test/accuracy"}) + "\n" for m in metrics)
        )
    assert len(lost) == 3
    runs = report.load([str(tmp_path / "study")])
    plain, _ = report.build(runs)
    assert plain.sensitivity == [] and plain.unfinished_as is None
    assert plain.runs[plain.runs.status == "interrupted"].pair.str.endswith("warm=None").all()
    built, _ = report.build(runs, unfinished_as=0.0)
    assert [v.outcome for v in built.declared] == [v.outcome for v in plain.declared] == ["beyond noise"] * 2
    assert built.declared[0].comparison.test == "paired at the warm start level (3 warm starts, 6 pairs)"
    assert len(built.imputed) == 3 and all(name.startswith("study/") for name in built.imputed)
    assert built.imputed_sides == [(3, 0), (0, 0)]
    grpo, rft = built.sensitivity
    assert (grpo.name, grpo.role) == ("grpo_vs_control (unfinished at 0)", "sensitivity")
    assert grpo.comparison.test == "paired at the warm start level (3 warm starts, 9 pairs)"
    # three pairs at 0 - ~0.3, one a warm start: beyond noise again, on the other side of 0
    assert grpo.comparison.diff < 0 and grpo.outcome == "beyond noise" and grpo.bootstrap is None
    assert rft.comparison.diff == pytest.approx(built.declared[1].comparison.diff) and rft.outcome == "beyond noise"
    high, _ = report.build(runs, unfinished_as=1.0)  # the score given, not 0: three pairs at 1 - ~0.3
    assert high.sensitivity[0].comparison.diff > built.declared[0].comparison.diff > 0
    out = report.main([str(tmp_path / "study"), "--unfinished-as", "0", "--out", str(tmp_path / "r")])
    md = (out / "report.md").read_text()
    section = out_tables(md)["Declared comparisons, unfinished runs scored 0"]
    assert "(`--unfinished-as 0`)" in section and "each of the 3 runs that started" in section
    lines = {x.split("**")[1]: x for x in section.splitlines() if x.startswith("- **")}
    grpo_line, rft_line = lines["grpo_vs_control (unfinished at 0)"], lines["rft_vs_control (unfinished at 0)"]
    assert "runs imputed: 3 of the treatment, 0 of the baseline; **differs from the declared verdict**" in grpo_line
    assert "runs imputed: 0 of the treatment, 0 of the baseline; agrees with the declared verdict" in rft_line
    assert "look 1 at it, through the analysis `unfinished at 0`" in md
    ledger = tmp_path / "study" / "ledger.jsonl"
    (look,) = [json.loads(x) for x in ledger.read_text().splitlines()]
    assert look["runs"] == 24 and look["variant"] == "unfinished at 0"
    assert look["verdicts"]["grpo_vs_control (unfinished at 0)"]["diff"] < 0
    assert look["verdicts"]["grpo_vs_control"]["outcome"] == "beyond noise"
    md = (report.main([str(tmp_path / "study"), "--out", str(tmp_path / "plain")]) / "report.md").read_text()
    assert "unfinished runs scored" not in md and "look 2 at it (" in md
    report.main([str(tmp_path / "study"), "--unfinished-as", "0", "--out", str(tmp_path / "again")])
    assert [json.loads(x)["variant"] for x in ledger.read_text().splitlines()] == ["unfinished at 0", ""]
    for bad in (["--unfinished-as", "7.1"], ["--no-test", "--unfinished-as", "0"]):
        with pytest.raises(SystemExit):
            report.main([str(tmp_path / "study"), *bad, "--out", str(tmp_path / "x")])

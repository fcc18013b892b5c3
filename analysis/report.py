"""An ablation report from run directories (or a W&B project): one pandas table, `report.md` and `report.html`.

    python -m analysis.report outputs/sweeps/<time> [more dirs | wandb:entity/project[/group]] [--out DIR]

Declared comparisons first: the runs' `analysis` block (foundation/study.py, declared by a preset before the runs)
names the comparisons of one family; each is tested at the level of the independent unit (analysis/verdicts.py
`compare`: runs paired by seed and warm start, the pairs of one warm start averaged first), its p adjusted by Holm
over the family, its look at the test split recorded in the runs' `ledger.jsonl`. Everything else is exploratory and
says so. `--no-test`: an interim report (a study still running) that reads no test score and records no look.
`--unfinished-as SCORE`: the declared comparisons again with every run that started and did not complete scored
SCORE (`imputed`), beside them: how far each verdict rests on the runs lost.

Factors are the override keys whose value differs between runs (not seed, experiment, logger, hydra, paths,
analysis); a cell is one combination of factor values, its seeds the runs in it. Per cell: the metric as mean ± 95%
confidence interval (t) over its runs, or over its warm starts' means where seeds share them. Per factor: each cell
against the baseline cell (the factor's first value, the others held fixed), the difference with its 95% CI (Welch's
t) and a flag saying whether the difference is within noise (the CI contains 0). Failed, unfinished and not-started
runs are listed, never averaged.

Arms and controls: a run whose summary says `arm: sft_control` (algorithm=sft_control) is a control. Its cell is the
baseline of the factor that tells it from the treatments, and the report gives one verdict line per treatment: its
metric against the control's, the difference with its 95% CI and p, better / worse / inside noise, and the smallest
difference the comparison could have detected (80% power), paired where the runs pair (`compare`), else Welch's.
Curves are drawn against training seconds (`train/elapsed_s`) where every run logs them, so arms of equal compute
line up. The statistics are foundation/stats.py's.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib
import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from analysis.runs import COMPLETED, NOT_STARTED, WANDB_PREFIX, Run, load
from analysis.verdicts import (
    EXPLORATORY,
    LEDGER,
    Ledger,
    Verdict,
    compare,
    declared,
    declared_keys,
    estimate_of,
    ledger_folder,
    look_note,
    matching,
    parse_override,
    per_cluster,
    same_value,
    unit_of,
    value_column,
)
from foundation.run_dir import is_factor, override_key
from foundation.stats import BEYOND_NOISE, POWER, WITHIN_NOISE, Comparison, Estimate
from foundation.study import METRICS, WARM_START, Declared, Study

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ACCURACY_METRICS = {"val_initial", "val_final", "val_best", "test_final"}  # fractions, shown as percentages
SUBSET_SEP = ":"  # `val_final:entity`: the final validation accuracy on one subset (logged as val/entity/accuracy)
SPLIT_METRICS = ("val_final", "test_final")  # final accuracies also logged per subset of their split
CONTROL_ARM = "sft_control"  # the `arm` a control run's summary names (backends/algorithm.py SFTControl)
ELAPSED = "train/elapsed_s"  # training seconds, validation not counted


def _last(metrics: list[dict[str, Any]], key: str) -> float | None:
    values = [m[key] for m in metrics if m.get(key) is not None]
    return values[-1] if values else None


def _mean(metrics: list[dict[str, Any]], key: str) -> float | None:
    values = [m[key] for m in metrics if m.get(key) is not None]
    return sum(values) / len(values) if values else None


def gpus_of(run: Run) -> int | None:
    """GPUs the run held: `resources` when the config has it, else 1 on CUDA and 0 on CPU; None if unknown."""
    resources = run.config.get("resources") or {}
    if resources.get("nodes") and resources.get("gpus_per_node") is not None:
        return int(resources["nodes"]) * int(resources["gpus_per_node"])
    device = run.summary.get("device")
    return None if device is None else int(device == "cuda")


def factor_keys(runs: list[Run]) -> list[str]:
    """Override keys (in first-seen order) whose value differs between runs."""
    keys = list(dict.fromkeys(override_key(o) for run in runs for o in run.overrides))
    keys = [k for k in keys if is_factor(k)]
    return [k for k in keys if len({repr(run.value(k)) for run in runs}) > 1]


def final_subsets(run: Run, split: str = "val") -> dict[str, float]:
    """The last score's accuracy per subset of a split (`val/<subset>/accuracy`, `test/<subset>/accuracy`)."""
    last = next((m for m in reversed(run.metrics) if m.get(f"{split}/accuracy") is not None), {})
    parts = (k.split("/") for k in last)
    return {p[1]: last["/".join(p)] for p in parts if len(p) == 3 and p[0] == split and p[2] == "accuracy"}


def warm_start_of(run: Run) -> str | None:
    """The digest of the weights the run's training started from (a warm start's), where it has one."""
    return (run.summary.get("sft") or {}).get("weights_sha256")


def cluster_of(run: Run, key: str) -> str | None:
    """The run's cluster (`analysis.cluster`): its warm start's digest, or the value of the config key named."""
    value = warm_start_of(run) if key == WARM_START else run.value(key)
    return None if value is None else str(value)


def run_table(
    runs: list[Run], factors: list[str], study: Study | None = None, metric: str = "val_final"
) -> pd.DataFrame:
    """One row per run: factors, seed, status, metrics, cost; the final accuracy per validation subset; its cluster
    (`study.cluster`), the values the study's declarations match on and each question's `metric` score (`items`)."""
    study = study or Study()
    keys = [k for k in declared_keys(study) if k not in factors]
    rows = []
    for run in runs:
        val = [m["val/accuracy"] for m in run.metrics if m.get("val/accuracy") is not None]
        subsets = {f"val_final{SUBSET_SEP}{name}": acc for name, acc in final_subsets(run).items()}
        subsets |= {f"test_final{SUBSET_SEP}{name}": acc for name, acc in final_subsets(run, "test").items()}
        wall_s = run.summary.get("wall_s")
        gpus = gpus_of(run)
        rows.append(
            {
                "source": run.source,
                "run": run.name,
                "status": run.status,
                **{f: _cell_value(run.value(f)) for f in factors},
                "seed": run.value("seed"),
                "val_initial": val[0] if val else None,
                "val_final": val[-1] if val else None,
                "val_best": max(val) if val else None,
                "test_final": _last(run.metrics, "test/accuracy"),
                "reward_final": _last(run.metrics, "train/reward_mean"),
                "steps": max((m["step"] for m in run.metrics), default=None),
                "wall_s": wall_s,
                "gpus": gpus,
                "gpu_hours": wall_s * gpus / 3600 if wall_s is not None and gpus is not None else None,
                "arm": run.summary.get("arm"),
                "pair": f"seed={run.value('seed')} warm={warm_start_of(run)}",  # runs of one pair: the same start
                "cluster": cluster_of(run, study.cluster),  # the independent unit the pair belongs to
                "items": run.items.get(metric),  # id -> score on the metric's evaluation, where the run kept them
                "train_gpu_s": _train_gpu_s(run, gpus),
                "gpu_s": _last(run.metrics, "compute/gpu_s"),  # training's and the pool's charge (backends/compute.py)
                "tokens": _last(run.metrics, "train/num_tokens"),
                "generated": _last(run.metrics, "compute/generated_tokens"),  # sampled by the run's rollouts
                "step_s": _mean(run.metrics, "timing_s/step"),  # a training step's seconds, validation included
                "rollout_s": _mean(run.metrics, "timing_s/rollout"),  # of which the rollouts' (and their rewards')
                "flops": _last(run.metrics, "compute/flops"),
                "budget_s": run.value("algorithm.time_budget_s"),
                "budget_flops": run.value("algorithm.flops_budget"),
                "budget_gpu_s": run.value("algorithm.gpu_s_budget"),
                "error": (run.error or "").splitlines()[0] if run.error else None,
                "overrides": " ".join(run.overrides),
                **subsets,
                **{value_column(f): _cell_value(run.value(f)) for f in factors},
                **{value_column(k): _cell_value(run.value(k)) for k in keys},
            }
        )
    table = pd.DataFrame(rows)
    numeric = ["val_initial", "val_final", "val_best", "test_final", "reward_final", "steps", "wall_s", "gpus"]
    numeric += ["gpu_hours", "tokens", "flops", "budget_s", "budget_flops", "budget_gpu_s"]
    numeric += ["train_gpu_s", "gpu_s", "generated", "step_s", "rollout_s", *subset_metrics(table)]
    table[numeric] = table[numeric].apply(pd.to_numeric)
    # controls first: the first value of a factor is its baseline, and a control is its factor's baseline
    return table.sort_values("arm", key=lambda arm: arm != CONTROL_ARM, kind="stable").reset_index(drop=True)


def subset_metrics(table: pd.DataFrame, metric: str = "val_final") -> list[str]:
    """The table's per-subset accuracy columns of `metric` (`val_final:<subset>`), in the order they first appear."""
    return [c for c in table.columns if c.startswith(f"{metric}{SUBSET_SEP}")]


def is_accuracy(metric: str) -> bool:
    return metric.split(SUBSET_SEP)[0] in ACCURACY_METRICS


def _train_gpu_s(run: Run, gpus: int | None) -> float | None:
    """GPU-seconds of training (warm start and validation not counted), from the last `train/elapsed_s`."""
    elapsed = _last(run.metrics, ELAPSED)
    return None if elapsed is None or gpus is None else elapsed * max(gpus, 1)


def _cell_value(value: Any) -> Any:
    """Lists and mappings (`finetune.target_modules=[q_proj,v_proj]`) as text, so that cells can be grouped."""
    return str(value) if isinstance(value, list | dict) else value


def _fmt(value: float | None, metric: str, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    scale, digits = (100, 1) if is_accuracy(metric) else (1, 3)
    return f"{value * scale:{'+' if signed else ''}.{digits}f}"


def _fmt_estimate(e: Estimate, metric: str) -> str:
    if e.n == 0:
        return "n/a"
    return f"{_fmt(e.mean, metric)} ± {_fmt(e.half, metric)}" if e.half is not None else _fmt(e.mean, metric)


def _cells(done: pd.DataFrame, factors: list[str]) -> list[tuple[Any, ...]]:
    """Cells in the order their first run appears (a sweep's order: its first value is the baseline)."""
    if not factors:
        return [()] if len(done) else []
    cells: dict[tuple[str, ...], tuple[Any, ...]] = {}  # keyed as `_in_cell` matches: NaN (a key an arm lacks) is
    for row in done[factors].itertuples(index=False):  # one value, not one per run (nan != nan)
        cells.setdefault(tuple(map(repr, row)), tuple(row))
    return list(cells.values())


def _in_cell(done: pd.DataFrame, factors: list[str], cell: tuple[Any, ...]) -> pd.DataFrame:
    mask = pd.Series(True, index=done.index)
    for f, v in zip(factors, cell, strict=True):
        mask &= done[f].map(repr) == repr(v)
    return done[mask]


def cell_table(table: pd.DataFrame, factors: list[str], metric: str = "val_final") -> pd.DataFrame:
    """One row per cell: seeds, accuracy and reward as mean ± 95% CI (and `metric` per subset: the validation's, or
    the test split's), and cost per run."""
    done = table[table.status == COMPLETED]
    subsets = subset_metrics(table, metric if metric in SPLIT_METRICS else "val_final")
    rows = []
    for cell in _cells(done, factors):
        runs = _in_cell(done, factors, cell)
        total = len(_in_cell(table, factors, cell))
        row: dict[str, Any] = {f: "unset" if _unset(v) else v for f, v in zip(factors, cell, strict=True)}
        row["seeds"] = f"{len(runs)}/{total}"
        for metric in ("val_initial", "val_final", "val_best", "test_final", "reward_final", *subsets):
            estimate = estimate_of(runs, metric)
            row[metric] = _fmt_estimate(estimate, metric)
            if metric in subsets and 0 < estimate.n < len(runs):  # not every run logs subsets
                row[metric] += f" (n={estimate.n})"
        row["wall_h/run"] = _fmt_num(runs.wall_s.mean() / 3600)
        row["gpu_h/run"] = _fmt_num(runs.gpu_hours.mean())
        row["train_gpu_s/run"] = _fmt_num(runs.train_gpu_s.mean(), 0)
        row["tokens/run"] = _fmt_num(runs.tokens.mean(), 0)
        rows.append(row)
    return pd.DataFrame(rows)


def _fmt_num(value: Any, digits: int = 3) -> str:
    return "n/a" if value is None or pd.isna(value) else f"{value:,.{digits}f}"


def factor_table(
    table: pd.DataFrame,
    factors: list[str],
    factor: str,
    metric: str,
    study: Study | None = None,
    declared_verdicts: list[Verdict] | None = None,
) -> pd.DataFrame:
    """The ablation table of `factor`: each value against its baseline value (its first), the other factors held
    fixed. Per cell: `metric` with its 95% interval; Δ to the baseline paired by seed and warm start, at the
    independent unit's level (`verdicts.compare`), with its interval, p and the Δ it could detect; the Holm-adjusted p
    where the study declared that comparison on `metric` (`exploratory` where it did not); and what a run cost
    (GPU-seconds, seconds a step, the rollouts' share of a step, tokens generated)."""
    study = study or Study()
    unit = unit_of(study)
    done = table[table.status == COMPLETED]
    others = [f for f in factors if f != factor]
    levels = list(dict.fromkeys(done[factor].map(repr)))
    values = {repr(v): v for v in done[factor]}
    rows = []
    for context in _cells(done, others) if levels else []:
        group = _in_cell(done, others, context)
        base = group[group[factor].map(repr) == levels[0]]
        present = [lv for lv in levels if (group[factor].map(repr) == lv).any()]
        if base.empty or len(present) < 2:
            continue
        for level in present:
            runs = group[group[factor].map(repr) == level]
            row: dict[str, Any] = dict(zip(others, context, strict=True))
            row[factor] = values[level]
            row["n"] = len(runs)
            row[metric] = _fmt_estimate(estimate_of(runs, metric), metric)
            if level == levels[0]:
                row |= {"Δ vs baseline": "baseline", "95% CI of Δ": "", "p": "", "noise": "", "Holm p": ""}
                row["detectable Δ"] = ""
            else:
                c = compare(base, runs, metric, unit=unit)
                ci = f"[{_fmt(c.low, metric, True)}, {_fmt(c.high, metric, True)}]" if c.low is not None else "n/a"
                where = dict(zip(others, context, strict=True))
                judged = _declared_for(
                    study, declared_verdicts or [], metric, factor, values[levels[0]], values[level], where
                )
                row |= {
                    "Δ vs baseline": _fmt(c.diff, metric, True),
                    "95% CI of Δ": ci,
                    "p": _fmt_p(c.p),
                    "noise": c.flag if judged is None else _family_flag(judged),
                    "Holm p": "exploratory" if judged is None else f"{_fmt_p(judged.p_holm)} ({judged.role})",
                    "detectable Δ": _fmt_detectable(c if judged is None else judged.comparison, metric),
                }
            rows.append(row | _cost(runs))
    return pd.DataFrame(rows)


def _family_flag(verdict: Verdict) -> str:
    """A declared row's `noise`: its verdict at the family's level (Holm), in the table's words."""
    return {"inside noise": WITHIN_NOISE, "beyond noise": BEYOND_NOISE}.get(verdict.outcome, verdict.outcome)


def _fmt_detectable(c: Comparison, metric: str) -> str:
    return _fmt(c.detectable, metric) if c.detectable is not None else "n/a"


def _declared_for(
    study: Study,
    verdicts: list[Verdict],
    metric: str,
    factor: str,
    baseline: Any,
    level: Any,
    context: dict[str, Any],
) -> Verdict | None:
    """The declared verdict on `metric` of `factor=level` against `factor=baseline` with the other factors at
    `context`'s values: a declaration whose sides differ in `factor` alone and agree with `context` on what they
    share (`[agent.check_step=false, agent.max_turns=3]` against `[agent.check_step=true, agent.max_turns=3]`)."""
    if metric != study.metric:
        return None
    for declaration, verdict in zip(study.comparisons, verdicts, strict=False):
        treated, base = (
            {k: v for k, v in map(parse_override, side)} for side in (declaration.treatment, declaration.baseline)
        )
        if treated.keys() != base.keys() or factor not in treated:
            continue
        shared = {k: v for k, v in base.items() if k != factor}
        if any(not same_value(treated[k], v) for k, v in shared.items()):
            continue
        if not (same_value(level, treated[factor]) and same_value(baseline, base[factor])):
            continue
        if all(same_value(context[k], v) for k, v in shared.items() if k in context):
            return verdict
    return None


def _cost(runs: pd.DataFrame) -> dict[str, str]:
    """What a run of the cell cost, on average: GPU-seconds (training and any pool charged, else training seconds x
    GPUs), seconds a step, the rollouts' share of a step, tokens generated."""
    gpu_s = runs.gpu_s.mean() if runs.gpu_s.notna().any() else runs.train_gpu_s.mean()
    share = runs.rollout_s.mean() / runs.step_s.mean() if runs.step_s.notna().any() else None
    return {
        "GPU-s/run": _fmt_num(gpu_s, 0),
        "s/step": _fmt_num(runs.step_s.mean(), 2),
        "rollout share": "n/a" if share is None or pd.isna(share) else f"{share:.0%}",
        "generated tokens/run": _fmt_num(runs.generated.mean(), 0),
    }


def control_verdicts(
    table: pd.DataFrame,
    factors: list[str],
    metric: str,
    level: float = 0.95,
    family: int = 1,
    unit: str = "warm start",
    declared_sides: DeclaredSides | None = None,
) -> list[Line]:
    """One line per treatment cell against the control run with the same other factors: both means ± 95% CI, the
    difference with its CI at `level` (`compare`: paired at the warm-start level where the runs pair, else Welch),
    and better / worse / inside noise (that CI against 0), exploratory; a comparison in `declared_sides` is named,
    not judged again (`_declared_instead`)."""
    controls, treatments, arm_factors, others = _arms(table, factors)
    if controls.empty or treatments.empty:
        return []
    lines = []
    for context in _cells(treatments, others):
        control = _in_cell(controls, others, context)
        group = _in_cell(treatments, others, context)
        where = f" ({_label(others, context)})" if others else ""
        if control.empty:
            lines.append(Line(f"{_label(others, context)}: no control run with these values, no verdict.", None))
            continue
        for cell in _cells(group, arm_factors):
            runs = _in_cell(group, arm_factors, cell)
            label = f"{_label(arm_factors, cell)} against the control{where}"
            if named := _declared_instead(label, control, runs, declared_sides):
                lines.append(named)
                continue
            lines.append(
                _verdict(
                    label,
                    control,
                    runs,
                    metric,
                    level,
                    family=family,
                    unit=unit,
                )
            )
    return lines


def _arms(table: pd.DataFrame, factors: list[str]) -> tuple[pd.DataFrame, pd.DataFrame, list[str], list[str]]:
    """The completed control and treatment runs, the factors that tell arms apart (algorithm=...: no value shared by
    a control and a treatment), and the other factors."""
    done = table[table.status == COMPLETED]
    controls, treatments = done[done.arm == CONTROL_ARM], done[done.arm != CONTROL_ARM]
    arm_factors = [f for f in factors if not set(controls[f].map(repr)) & set(treatments[f].map(repr))]
    return controls, treatments, arm_factors, [f for f in factors if f not in arm_factors]


def treatment_pairs(
    table: pd.DataFrame,
    factors: list[str],
    metric: str,
    level: float = 0.95,
    unit: str = "warm start",
    declared_sides: DeclaredSides | None = None,
) -> list[Line]:
    """The treatments against each other (the later-listed against the earlier, the other factors fixed), as the
    verdict lines judge each against the control: does one arm add what another with the same information lacks?
    A comparison in `declared_sides` is named, not judged again."""
    controls, treatments, arm_factors, others = _arms(table, factors)
    if controls.empty:
        return []
    lines = []
    for context in _cells(treatments, others):
        group = _in_cell(treatments, others, context)
        where = f" ({_label(others, context)})" if others else ""
        cells = _cells(group, arm_factors)
        for i, first in enumerate(cells):
            for later in cells[i + 1 :]:
                base, runs = _in_cell(group, arm_factors, first), _in_cell(group, arm_factors, later)
                label = f"{_label(arm_factors, later)} against {_label(arm_factors, first)}{where}"
                named = _declared_instead(label, base, runs, declared_sides)
                lines.append(named or _verdict(label, base, runs, metric, level, "it", unit=unit))
    return lines


DeclaredSides = dict[tuple[frozenset[str], frozenset[str]], str]  # (baseline runs, treatment runs) -> its name


def declared_sides(table: pd.DataFrame, study: Study) -> DeclaredSides:
    """Each declared comparison's completed runs on either side, either way round: the exploratory sections name a
    comparison with these sides instead of judging it again at 95 % (an uncorrected twin of a declared verdict)."""
    done = table[table.status == COMPLETED]
    sides: DeclaredSides = {}
    for d in study.comparisons:
        base, treated = frozenset(matching(done, d.baseline).run), frozenset(matching(done, d.treatment).run)
        sides[(base, treated)] = f"`{d.name}`"
        sides[(treated, base)] = f"`{d.name}` (the other way round)"
    return sides


def _declared_instead(label: str, base: pd.DataFrame, runs: pd.DataFrame, sides: DeclaredSides | None) -> Line | None:
    """The line that names `label` as a declared comparison (judged in the declared section, Holm over its
    family), or None where it is not one."""
    name = (sides or {}).get((frozenset(base.run), frozenset(runs.run)))
    return None if name is None else Line(f"{label}: declared as {name}, judged above (Holm over its family).", None)


class Line(NamedTuple):
    """A verdict as the report prints it, and what the ledger records of it."""

    text: str
    verdict: Verdict | None  # None: a line that judges nothing (no control run to compare with)


def _verdict(
    label: str,
    base: pd.DataFrame,
    runs: pd.DataFrame,
    metric: str,
    level: float,
    than: str = "the control",
    family: int = 1,
    unit: str = "warm start",
) -> Line:
    """An exploratory verdict, `label`: both means, Δ with its CI and p (foundation.stats: paired at the level of
    `unit`, or Welch), better / worse / inside noise by that CI, labelled exploratory. `family` > 1: one of that many
    subsets' verdicts, its CI at `level` (Bonferroni) and its p multiplied by `family`, said so."""
    c = compare(base, runs, metric, level, unit)
    if family > 1 and c.p is not None:
        c = dataclasses.replace(c, p=min(1.0, c.p * family))
    verdict = Verdict(label, "exploratory", c, estimate_of(runs, metric), estimate_of(base, metric))
    outcome = verdict.outcome
    if base[metric].isna().all() or runs[metric].isna().all():
        outcome = f"no verdict (an arm has no `{metric}`)"
    elif outcome == "beyond noise":
        outcome = f"{'better' if c.diff > 0 else 'worse'} than {than}, beyond noise"
    tag = EXPLORATORY if family == 1 else f"exploratory; Bonferroni over {family} subsets, p x {family}"
    text = f"{label}: {_means(verdict, metric)}: **{outcome}** ({tag}){_details(c, metric)}. "
    return Line(text + _compute_line(runs[runs[metric].notna()], base[base[metric].notna()]), verdict)


def _means(verdict: Verdict, metric: str) -> str:
    """Both sides' means and Δ with its interval and p."""
    c, treated, base = verdict.comparison, verdict.treated, verdict.base
    ci = f" [{_fmt(c.low, metric, True)}, {_fmt(c.high, metric, True)}]" if c.low is not None else ""
    p = f", p = {_fmt_p(c.p)}" if c.p is not None else ""
    return (
        f"{_fmt_estimate(treated, metric)} (n={treated.n}) vs {_fmt_estimate(base, metric)} (n={base.n}); "
        f"Δ {_fmt(c.diff, metric, True)}{ci}{p}"
    )


def _details(c: Comparison, metric: str, at: str = "") -> str:
    """The test, what it could detect (`at`: the level, where not the interval's), the heterogeneity across clusters
    and what it cannot claim."""
    text = f"; {c.test}"
    if c.detectable is not None:
        text += f", it could detect |Δ| ≥ {_fmt(c.detectable, metric)} with {POWER:.0%} power{at}"
    if c.heterogeneity is not None:
        h = c.heterogeneity
        text += f"; heterogeneity across {h.unit}s F = {h.f:.1f}, p = {_fmt_p(h.p)}"
    if c.caveat:
        text += f"; {c.caveat}"
    return text


def _declared_line(verdict: Verdict, family: int, metric: str, look: str) -> str:
    """A declared comparison: Δ with its CI, p and Holm-adjusted p over the family, the verdict at the family's
    alpha, the resampled interval over clusters and questions where item scores exist, and the look it comes from."""
    c = verdict.comparison
    holm_p = f", Holm-adjusted p = {_fmt_p(verdict.p_holm)} (family of {family}, alpha {verdict.alpha:g})"
    text = f"**{verdict.name}** ({verdict.role}): {_means(verdict, metric)}{holm_p if c.p is not None else ''}: "
    at = f" at alpha {verdict.alpha:g}/{family} (Holm's first step)"
    text += f"**{verdict.outcome}**{_details(c, metric, at)}"
    if verdict.bootstrap is not None:
        mean, low, high = verdict.bootstrap
        text += (
            f"; resampling clusters and questions: Δ {_fmt(mean, metric, True)} [{_fmt(low, metric, True)}, "
            f"{_fmt(high, metric, True)}]"
        )
    return text + (f"; {look}" if look else "") + "."


def _fmt_p(p: float | None) -> str:
    return "n/a" if p is None else "<0.001" if p < 0.001 else f"{p:.3f}"


BUDGETS = (("budget_flops", "FLOPs", "{:.2e}"), ("budget_gpu_s", "GPU-seconds", "{:g}"))
BUDGETS += (("budget_s", "training seconds", "{:g} s"),)


def _compute_line(treated: pd.DataFrame, control: pd.DataFrame) -> str:
    """What each arm spent per run (training GPU-seconds; GPU-seconds with the pool's charge and FLOPs where the runs
    count them) and which budget the arms shared: FLOPs, GPU-seconds, training seconds, or none."""
    seconds = [_fmt_num(r.train_gpu_s.mean(), 0) for r in (treated, control)]
    line = f"Training GPU-seconds per run: {seconds[0]} vs {seconds[1]}"
    if "gpu_s" in treated and (treated.gpu_s.notna().any() or control.gpu_s.notna().any()):
        whole = ["n/a" if r.gpu_s.isna().all() else _fmt_num(r.gpu_s.mean(), 0) for r in (treated, control)]
        line += f"; GPU-seconds with the pool's sampling: {whole[0]} vs {whole[1]}"
    if treated.flops.notna().any() or control.flops.notna().any():
        flops = ["n/a" if r.flops.isna().all() else f"{r.flops.mean():.2e}" for r in (treated, control)]
        line += f"; FLOPs per run (`compute/flops`: training, rollouts, the pool's sampling): {flops[0]} vs {flops[1]}"
    both = pd.concat([treated, control])
    for column, name, fmt in BUDGETS:
        values = both[column]
        if values.notna().all() and values.nunique() == 1:
            return f"{line}; equal budget: {name} ({fmt.format(values.iloc[0])})."
    return f"{line}; no budget shared by every run of both arms."


def _cluster_rows(by_cluster: pd.DataFrame, metric: str) -> pd.DataFrame:
    """`per_cluster`'s table as the report prints it: differences signed, accuracies in points."""
    out = by_cluster.copy()
    for column in out.columns:
        if column.startswith("Δ "):
            out[column] = [_fmt(v, metric, True) for v in out[column]]
        elif column == "val_initial":
            out[column] = [_fmt(v, "val_initial") for v in out[column]]
    return out.reset_index()


def _label(factors: list[str], cell: tuple[Any, ...]) -> str:
    """`key=value` of each factor the cell sets (a key its arm lacks, NaN, is left out)."""
    return ", ".join(f"{f}={v}" for f, v in zip(factors, cell, strict=True) if not _unset(v)) or "all runs"


def _unset(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def curve_band(curves: pd.DataFrame, key: str, by_time: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A cell's curve of `key` (its runs' logged values, a `point` and a `cluster` per row): each point's x (the point,
    or with `by_time` its values' mean training seconds), mean and 95% half-width, taken as the verdicts take theirs:
    over warm starts where seeds share them (`estimate_of`), else over the values."""
    known = curves.dropna(subset=[key])
    points = sorted(known.point.unique())
    bands = [estimate_of(known[known.point == p], key) for p in points]
    x = known.groupby("point")[ELAPSED].mean().loc[points].to_numpy() if by_time else np.array(points)
    return x, np.array([b.mean for b in bands]), np.array([b.half or 0.0 for b in bands])


def curves_figure(runs: list[Run], table: pd.DataFrame, factors: list[str], path: Path) -> None:
    """Training reward and validation accuracy, one line per cell (mean, ±95% CI band over warm starts where seeds
    share them, else over seeds: `estimate_of`), against training seconds where every run logs them (arms of equal
    compute line up; averaged in 12 time bins), else against step."""
    done = table[table.status == COMPLETED]
    by_name = {(r.source, r.name): r for r in runs}
    members = [by_name[(row.source, row.run)] for row in done.itertuples()]
    use_time = bool(members) and all(any(ELAPSED in m for m in run.metrics) for run in members)
    longest = max((m.get(ELAPSED) or 0.0 for run in members for m in run.metrics), default=0.0)
    time_bin = max(longest, 1e-9) / 12
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for index, cell in enumerate(_cells(done, factors)):
        color = f"C{index % 10}"  # a cell's colour on both axes (a control has no reward line)
        frames = [
            pd.DataFrame(by_name[(row.source, row.run)].metrics).assign(run=row.run, cluster=row.cluster)
            for row in _in_cell(done, factors, cell).itertuples()
        ]
        curves = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        if use_time:  # seeds log at different times: points are averaged in time bins (step 0: at 0 s, alone)
            curves[ELAPSED] = curves[ELAPSED].where(curves.step != 0, 0.0)
            curves["point"] = np.ceil(curves[ELAPSED] / time_bin)
        else:
            curves["point"] = curves.step
        for ax, key in zip(axes, ("train/reward_mean", "val/accuracy"), strict=True):
            if key not in curves or curves[key].isna().all():
                continue
            x, mean, half = curve_band(curves, key, use_time)
            ax.plot(x, mean, marker=".", label=_label(factors, cell), color=color)
            ax.fill_between(x, mean - half, mean + half, alpha=0.2, color=color)
    for ax, title in zip(
        axes, ("training reward (train/reward_mean)", "validation accuracy (val/accuracy)"), strict=True
    ):
        ax.set_title(title)
        ax.set_xlabel("training seconds (train/elapsed_s), 12 bins" if use_time else "step")
        ax.grid(alpha=0.3)
    axes[1].set_ylim(max(axes[1].get_ylim()[0], 0.0), min(axes[1].get_ylim()[1], 1.0))  # an accuracy
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    fig.tight_layout(rect=(0, 0.06 * math.ceil(len(labels) / 2), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cost_figure(table: pd.DataFrame, factors: list[str], metric: str, path: Path) -> None:
    """The metric (mean ± 95% CI) against cost per run: training GPU-seconds where every run logs them, else GPU-hours
    where known, else wall-clock hours."""
    done = table[table.status == COMPLETED]
    if len(done) and done.train_gpu_s.notna().all():  # training alone: what arms of equal compute share
        cost, unit, per = "train_gpu_s", "training GPU-seconds per run", 1
    elif done.gpu_hours.notna().all() and (done.gpu_hours > 0).any():
        cost, unit, per = "gpu_hours", "GPU-hours per run", 1
    else:
        cost, unit, per = "wall_s", "wall-clock hours per run", 3600
    scale = 100 if is_accuracy(metric) else 1
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for cell in _cells(done, factors):
        runs = _in_cell(done, factors, cell)
        x = runs[cost].mean() / per
        e = estimate_of(runs, metric)
        ax.errorbar(
            [x], [e.mean * scale], yerr=[(e.half or 0) * scale], fmt="o", capsize=4, label=_label(factors, cell)
        )
    ax.set_xlabel(unit)
    ax.set_ylabel(METRICS[metric] + (" (%)" if scale == 100 else ""))
    ax.grid(alpha=0.3)
    if len(done):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class Report:
    runs: pd.DataFrame
    cells: pd.DataFrame
    factors: dict[str, pd.DataFrame]
    problems: pd.DataFrame
    metric: str
    verdicts: list[Line]
    subset_verdicts: list[Line]  # the final accuracy's verdicts again, on each subset of the split
    pairs: list[Line]  # the treatments against each other
    study: Study  # what the runs declared (`analysis`)
    declared: list[Verdict]  # the declared comparisons on the study's metric, Holm-adjusted together
    by_cluster: pd.DataFrame  # each warm start's mean difference per declared comparison (empty: none to show)
    unfinished_as: float | None = None  # the score the sensitivity block gives each run that started and did not end
    imputed: list[str] = dataclasses.field(default_factory=list)  # those runs (`unfinished_as` set)
    imputed_sides: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # per declaration: treatment, base
    sensitivity: list[Verdict] = dataclasses.field(default_factory=list)  # the declared ones again, those runs scored

    @property
    def judged(self) -> list[tuple[str, Verdict]]:
        """Every verdict with the metric it judged: what a look at the test split records."""
        lines = [*self.verdicts, *self.subset_verdicts, *self.pairs]
        out = [(self.study.metric, v) for v in [*self.declared, *self.sensitivity]]
        return out + [(self.metric, line.verdict) for line in lines if line.verdict is not None]


def study_of(runs: list[Run]) -> Study:
    """The declaration the runs recorded (`analysis` in their configs): the same in every run. Runs from before
    declarations existed have none (no comparison is declared); a mix of runs with and without one is refused, so
    that no run enters a declared family it was not run under."""
    declarations = {json.dumps(r.config["analysis"], sort_keys=True): r for r in runs if r.config.get("analysis")}
    without = [r.name for r in runs if r.config and not r.config.get("analysis")]
    if declarations and without:
        raise ValueError(
            f"{len(without)} runs declare no analysis ({', '.join(without[:3])}) beside runs that do: runs from "
            "before the study's declaration are not part of it; report them apart"
        )
    if len(declarations) > 1:
        names = ", ".join(r.name for r in declarations.values())
        raise ValueError(
            f"the runs declare different analyses (runs {names}): a study's declaration is fixed before its runs; "
            "report each study on its own"
        )
    if not declarations:
        return Study()
    (declaration,) = (json.loads(d) for d in declarations)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Study), declaration))  # type: ignore[return-value]


def _renamed(verdict: Verdict | None, metric: str) -> Verdict | None:
    """A subset's verdict named after its subset too (the ledger keeps each comparison under its own name)."""
    return None if verdict is None else dataclasses.replace(verdict, name=f"{metric}: {verdict.name}")


def started_not_completed(table: pd.DataFrame) -> pd.Series:
    """The rows of runs that started and did not complete: failed, interrupted, unfinished (not `not started`)."""
    return (table.status != COMPLETED) & (table.status != NOT_STARTED)


def imputed(table: pd.DataFrame, runs: list[Run], study: Study, value: float) -> tuple[pd.DataFrame, list[str]]:
    """The run table with every run that started and did not complete (failed, interrupted, unfinished: not `not
    started`) counted as completed with the study's metric = `value`, and those runs: what the declared verdicts
    would be had the runs lost scored `value`, beside them, never instead. A run stopped before the end of its
    summary has no `sft` block: it pairs with its twins through the warm start its config pinned
    (`warmstart.weights_sha256`, which the run checked the weights it loaded against: backends/sft.py)."""
    lost = started_not_completed(table)
    by_name = {(run.source, run.name): run for run in runs}
    out = table.copy()
    for i in out.index[lost]:
        run = by_name[(out.at[i, "source"], out.at[i, "run"])]
        warm = warm_start_of(run) or run.value("warmstart.weights_sha256")
        out.at[i, "pair"] = f"seed={run.value('seed')} warm={warm}"
        if study.cluster == WARM_START:
            out.at[i, "cluster"] = None if warm is None else str(warm)
    out.loc[lost, study.metric] = value
    out.loc[lost, "items"] = None  # no question scored: a comparison with such a run has no interval over questions
    out.loc[lost, "status"] = COMPLETED
    return out, list(table.run[lost])


def build(runs: list[Run], metric: str | None = None, unfinished_as: float | None = None) -> tuple[Report, list[str]]:
    """`metric`: what the exploratory tables compare (default: the declared metric where comparisons are declared,
    else `val_final`); declared comparisons are always judged on the study's own metric. `unfinished_as`: the
    declared comparisons also with each run that started and did not complete scored that (`imputed`)."""
    study = study_of(runs)
    metric = metric or (study.metric if study.comparisons else "val_final")
    factors = factor_keys(runs)
    table = run_table(runs, factors, study, study.metric if study.comparisons else metric)
    problems = table[table.status != COMPLETED][["run", "status", "error", "overrides"]].fillna("")
    decl = declared(table, study, study.metric)
    per_factor = {f: factor_table(table, factors, f, metric, study, decl) for f in factors}
    unit = unit_of(study)
    sides = declared_sides(table, study) if metric == study.metric else None  # another metric: none declared
    verdicts = control_verdicts(table, factors, metric, unit=unit, declared_sides=sides)
    columns = subset_metrics(table, metric) if metric in SPLIT_METRICS else []
    level = 1 - 0.05 / max(len(columns), 1)  # Bonferroni: one test per subset, 5 % for all of them together
    by_subset = [
        Line(f"`{column.split(SUBSET_SEP, 1)[1]}` questions: {line.text}", _renamed(line.verdict, column))
        for column in columns
        for line in control_verdicts(table, factors, column, level, len(columns), unit)
    ]
    cells = cell_table(table, factors, metric)
    pairs = treatment_pairs(table, factors, metric, unit=unit, declared_sides=sides)
    by_cluster = per_cluster(table, study, study.metric)
    report = Report(table, cells, per_factor, problems, metric, verdicts, by_subset, pairs, study, decl, by_cluster)
    if unfinished_as is not None and study.comparisons:
        if is_accuracy(study.metric) and not 0 <= unfinished_as <= 1:
            raise ValueError(f"--unfinished-as {unfinished_as:g}: `{study.metric}` is an accuracy, from 0 to 1")
        filled, report.imputed = imputed(table, runs, study, unfinished_as)
        if report.imputed:
            name = f"unfinished at {unfinished_as:g}"
            report.sensitivity = [
                dataclasses.replace(v, name=f"{v.name} ({name})", role="sensitivity")
                for v in declared(filled, study, study.metric)
            ]
            report.imputed_sides = [imputed_sides(table, d) for d in study.comparisons]
        report.unfinished_as = unfinished_as
    return report, factors


def imputed_sides(table: pd.DataFrame, declaration: Declared) -> tuple[int, int]:
    """How many runs of the treatment and of the baseline side of a declared comparison started and did not
    complete (the runs `imputed` scores)."""
    lost = table[started_not_completed(table)]
    return len(matching(lost, declaration.treatment)), len(matching(lost, declaration.baseline))


def _sections(report: Report, sources: list[str], looks: dict[str, str]) -> list[tuple[str, str, pd.DataFrame | None]]:
    """(heading, text, table) in report order; a figure goes where text names it. `looks`: per declared comparison,
    where its verdict stands among the looks at the test split."""
    metric = report.metric
    done = int((report.runs.status == COMPLETED).sum())
    intro = (
        f"Sources: {', '.join(sources)}. {len(report.runs)} runs: {done} completed, {len(report.problems)} failed, "
        f"unfinished or not started (listed at the end, left out of every number). Metric: {METRICS[metric]} "
        f"(`{metric}`{', percent' if is_accuracy(metric) else ''}). Cells show mean ± 95% confidence "
        "interval over seeds, or over warm starts where seeds share them (t distribution); a cell with one seed has no "
        "error bar."
    )
    if "" in looks:
        intro += " " + looks[""]
    out: list[tuple[str, str, pd.DataFrame | None]] = [("Ablation report", intro, None)]
    out.append(("Declared comparisons", _declared_text(report, looks), None))
    if report.unfinished_as is not None:  # set only where the study declares comparisons
        out.append(
            (f"Declared comparisons, unfinished runs scored {report.unfinished_as:g}", _sensitivity_text(report), None)
        )
    if len(report.by_cluster) > 1:
        unit = unit_of(report.study)
        text = (
            f"Each {unit}'s mean difference (treatment - baseline, the seeds that share it averaged) on "
            f"`{report.study.metric}`, and its pairs: the units the verdicts above are taken over, so a reader sees "
            f"how far they agree. `val_initial`: the {unit}'s own validation score before training."
        )
        out.append((f"Declared comparisons per {unit}", text, _cluster_rows(report.by_cluster, report.study.metric)))
    if report.verdicts:
        text = (
            f"Everything below is {EXPLORATORY}: comparisons the study did not declare, each at 95% on its own (a "
            "declared one is named, and judged above). "
            "Each treatment against its control (a run with `arm: sft_control`: the warm start's SFT continued for "
            "the same budget); Δ = treatment - control with its 95% CI: where every treatment run has a control run "
            "with its seed and warm start, a paired t-test, taken on the warm starts' mean differences when seeds "
            "share warm starts (the warm start is the independent unit); else Welch's t-test; and the smallest |Δ| "
            f"that test would detect with {POWER:.0%} power (at the same confidence level).\n\n"
        )
        text += "\n".join(f"- {line.text}" for line in report.verdicts)
        if report.subset_verdicts:
            k = len(subset_metrics(report.runs, metric))
            split = "test" if metric == "test_final" else "validation"
            text += (
                f"\n\nThe same on each subset of the {split} questions (`data.val_subset_field`), n counting the "
                f"runs that log it; with {k} subsets each Δ's CI is {100 - 5 / k:.1f}% (Bonferroni), so that the "
                f"{k} verdicts together are wrong with at most 5% probability:\n\n"
            )
            text += "\n".join(f"- {line.text}" for line in report.subset_verdicts)
        out.append(("Treatment against control", text, None))
    if report.pairs:
        text = (
            f"The treatments against each other ({EXPLORATORY}), the later-listed against the earlier, tested as "
            "above (95%): one arm against another with the same information (GRPO against RFT: the policy "
            "gradient's baseline and negative samples) or against a ceiling.\n\n"
        )
        out.append(("Treatments against each other", text + "\n".join(f"- {line.text}" for line in report.pairs), None))
    cells = (
        "Accuracy in percent (`val_initial`: before GRPO, after any warm start), mean ± 95% CI over the runs, or over "
        "the warm starts' means where seeds share warm starts. seeds: completed runs of all runs in the cell. Cost "
        "per run: GPU-hours = wall time x GPUs (from `resources`, else 1 on CUDA, 0 on CPU)."
    )
    out.append(("All cells", cells, report.cells))
    for factor, table in report.factors.items():
        text = (
            f"Each `{factor}` value against the baseline `{factor}` (its first value), the other factors fixed. "
            "Δ: difference of means (percentage points for accuracy) with its 95% CI, p and the |Δ| the test would "
            f"detect with {POWER:.0%} power (at 95%; a declared comparison's at its family's alpha / size, the level "
            "of Holm's first step): paired by seed and warm start, at the warm start's level where seeds share one "
            "(else Welch's t-test). Holm p: the comparison's adjusted p in the family the study declared, "
            f"with its role; `exploratory` where it was not declared ({EXPLORATORY}). Cost per run: GPU-seconds "
            "(the pool's sampling included where charged), seconds a step, the rollouts' share of a step, tokens "
            "generated."
        )
        if table.empty:  # e.g. each arm's own learning rate: it moves with `algorithm`, never alone
            text = (
                f"No two cells differ in `{factor}` alone (it changes only together with another factor), so it has "
                "no table of its own: the comparisons above judge the cells it sets."
            )
        out.append((f"Factor `{factor}`", text, table if not table.empty else None))
    out.append(("Learning curves", "curves.png", None))
    out.append(("Cost next to accuracy", "cost.png", None))
    problems = report.problems if not report.problems.empty else None
    out.append(("Failed and unfinished runs", "" if problems is not None else "None.", problems))
    return out


def _declared_text(report: Report, looks: dict[str, str]) -> str:
    """The study's declared comparisons, or why there are none."""
    study = report.study
    if not study.comparisons:
        return (
            "None: the runs declare no comparison (`analysis.comparisons`, set by an experiment preset before its "
            f"runs), so every verdict below is {EXPLORATORY}: a reviewer reads it as a lead, not a result."
        )
    text = (
        f"Declared before the runs (`analysis` in every run's config), judged on `{study.metric}` "
        f"({METRICS[study.metric]}): {len(report.declared)} comparisons, one family, p-values adjusted by Holm's "
        f"step-down (family-wise error at most alpha = {study.alpha:g}); a verdict is beyond noise when its "
        "adjusted p is below alpha. Δ = treatment - baseline with its unadjusted 95% CI. The independent unit is "
        f"`analysis.cluster` ({study.cluster}): the seeds that share one are averaged first, and under 3 of them a "
        "verdict says it cannot speak beyond them.\n\n"
    )
    family = len(report.declared)
    return text + "\n".join(
        f"- {_declared_line(v, family, study.metric, looks.get(v.name, ''))}" for v in report.declared
    )


def _sensitivity_text(report: Report) -> str:
    """The declared comparisons again with the runs that started and did not complete scored `unfinished_as`: per
    comparison, how many each side had, and whether its verdict agrees with the declared one."""
    metric, value = report.study.metric, report.unfinished_as
    if not report.imputed:
        return "Every run that started completed: the declared verdicts above stand for all of them."
    text = (
        f"Beside the verdicts above, not instead (`--unfinished-as {value:g}`): the declared comparisons again with "
        f"each of the {len(report.imputed)} runs that started and did not complete ({', '.join(report.imputed)}) "
        f"scored {value:g} on `{metric}` and paired with its twins, Holm over the same family. The verdicts above "
        "leave those runs out; where one side loses runs whose outcome would have been poor (a run that collapsed "
        "and was stopped before its budget), the runs left flatter that side, and a low score for them shows how far "
        "a verdict rests on that. A low score is the worst case only for the side that lost the runs (runs lost on "
        "a shared baseline make every treatment look better). Holm couples the family: a comparison with no run "
        "imputed can move with the others' p. A line that differs says the verdict depends on what the runs lost "
        "would have scored.\n\n"
    )
    lines = []
    for declared_verdict, bound, (treated, base) in zip(
        report.declared, report.sensitivity, report.imputed_sides, strict=True
    ):
        same = bound.outcome == declared_verdict.outcome and (  # beyond noise: on the same side of 0 too
            bound.outcome != "beyond noise" or (bound.comparison.diff > 0) == (declared_verdict.comparison.diff > 0)
        )
        agree = "agrees with the declared verdict" if same else "**differs from the declared verdict**"
        runs = f"runs imputed: {treated} of the treatment, {base} of the baseline; {agree}"
        lines.append(f"- {_declared_line(bound, len(report.sensitivity), metric, runs)}")
    return text + "\n".join(lines)


def _html_text(text: str) -> str:
    """Escaped, with `code` spans as <code>."""
    return re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(text))


def without_test(run: Run) -> Run:
    """The run as an interim report reads it (`--no-test`): its test-split scores, overall, per subset and per
    question, left unread, so the report shows none and records no look at the test split."""
    return dataclasses.replace(
        run,
        metrics=[{k: v for k, v in m.items() if not k.startswith("test/")} for m in run.metrics],
        items={k: v for k, v in run.items.items() if not k.startswith("test")},
    )


def record_looks(report: Report, ledger_dir: Path, test_read: bool = True) -> dict[str, str]:
    """Where the report shows test-split scores (any completed run's `test_final`), its look goes into the ledger
    kept with the runs (`ledger_dir`: the study's folder, whichever folder the report is written to; see
    analysis/verdicts.py `Ledger`, `ledger_folder`). Per declared comparison, the note its verdict carries; under "",
    a sentence for the report's introduction (`test_read` false: that the test split was left unread)."""
    if not test_read:
        unread = {v.name: "the test split left unread (`--no-test`)" for v in report.declared}
        intro = "The test split's scores were left unread (`--no-test`: an interim report); no look at it."
        return unread | {"": intro}
    done = report.runs[report.runs.status == COMPLETED]
    if done.test_final.isna().all():
        return {}
    judged = [v for metric, v in report.judged if metric.startswith("test")]
    ledger = Ledger(ledger_dir / LEDGER)
    variant = f"unfinished at {report.unfinished_as:g}" if report.sensitivity else ""
    look, before = ledger.record(report.runs, "test_final", judged, variant)
    notes = {v.name: look_note(v.name, v.outcome, look, before) for v in report.declared}
    through = f", through the analysis `{look.variant}`" if look.variant else ""
    notes[""] = (
        f"The test split's scores here are look {look.look} at it{through} ({ledger.path}: {len(before)} "
        f"look{'' if len(before) == 1 else 's'} before this one; a re-render of the same runs and scores is not a "
        "new look)."
    )
    return notes


def write(
    report: Report,
    runs: list[Run],
    factors: list[str],
    sources: list[str],
    out: Path,
    ledger_dir: Path | None = None,
    test_read: bool = True,
) -> str | None:
    """The report's files into `out`; a look at the test split into the ledger in `ledger_dir` (default: `out`);
    `test_read` false where the runs' test scores were left unread (`without_test`). What the report says of the test
    split (which look it is, or that it was left unread); None where no run scored it."""
    out.mkdir(parents=True, exist_ok=True)
    curves_figure(runs, report.runs, factors, out / "curves.png")
    cost_figure(report.runs, factors, report.metric, out / "cost.png")
    report.runs.drop(columns=["items"]).to_csv(out / "runs.csv", index=False)
    md, body = [], []
    looks = record_looks(report, ledger_dir or out, test_read)
    for heading, text, table in _sections(report, sources, looks):
        level = "#" if heading == "Ablation report" else "##"
        md.append(f"{level} {heading}\n")
        body.append(f"<h{len(level)}>{html.escape(heading.replace('`', ''))}</h{len(level)}>")
        if text.endswith(".png"):
            md.append(f"![{heading}]({text})\n")
            encoded = base64.b64encode((out / text).read_bytes()).decode()
            body.append(f'<img alt="{html.escape(heading)}" src="data:image/png;base64,{encoded}">')
        elif text:
            md.append(text + "\n")
            body.append(f"<p>{_html_text(text)}</p>")
        if table is not None:
            md.append(table.to_markdown(index=False, disable_numparse=True) + "\n")
            body.append(table.to_html(index=False, na_rep="", border=1))
    (out / "report.md").write_text("\n".join(md), encoding="utf-8")
    style = "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{padding:2px 8px}"
    page = f"<!doctype html><html><head><meta charset='utf-8'><title>Ablation report</title><style>{style}</style>"
    (out / "report.html").write_text(f"{page}</head><body>{''.join(body)}</body></html>", encoding="utf-8")
    return looks.get("")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.split("\n")[0])
    parser.add_argument("sources", nargs="+", help="run or sweep directories, or wandb:entity/project[/group]")
    parser.add_argument("--out", type=Path, help="where to write the report (default: the first directory given)")
    parser.add_argument(
        "--metric",
        choices=sorted(METRICS),
        help="the metric the exploratory tables compare (default: the declared one where the runs declare "
        "comparisons, else val_final; val_final with --no-test); declared comparisons use the study's own",
    )
    parser.add_argument(
        "--no-test",
        action="store_true",
        help="leave every test-split score unread (an interim report on a study still running, or while tuning): "
        "test columns empty, no declared verdict, no look in the ledger",
    )
    parser.add_argument(
        "--unfinished-as",
        type=float,
        metavar="SCORE",
        help="the declared comparisons again with every run that started and did not complete (failed, "
        "interrupted) scored SCORE on the study's metric, in its own units (accuracy: 0 to 1), beside the declared "
        "verdicts, never instead: how far each rests on the runs lost (0: the worst case for the side that lost them)",
    )
    args = parser.parse_args(argv)
    if args.no_test and args.metric and args.metric.startswith("test"):
        parser.error(f"--metric {args.metric} reads the test split, which --no-test leaves unread")
    if args.no_test and args.unfinished_as is not None:
        parser.error("--unfinished-as judges the declared comparisons again, which --no-test leaves unjudged")
    local = [s for s in args.sources if not s.startswith(WANDB_PREFIX)]
    out = args.out or (Path(local[0]) if local else Path("outputs/reports"))
    try:
        runs = load(args.sources)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    if not runs:
        parser.error(f"no runs found under {' '.join(args.sources)}")
    if args.no_test:
        runs = [without_test(run) for run in runs]
    try:
        report, factors = build(runs, args.metric or ("val_final" if args.no_test else None), args.unfinished_as)
    except ValueError as exc:
        parser.error(str(exc))
    test = write(report, runs, factors, args.sources, out, ledger_folder(local) if local else out, not args.no_test)
    print(f"{len(runs)} runs ({len(report.problems)} failed or unfinished), factors: {', '.join(factors) or 'none'}")
    if test is not None:  # a look at the test split is said where the report is run, not only inside it
        print(test if args.no_test else f"{test} (--no-test: a report that reads none)")
    print(f"report: {out / 'report.md'} and {out / 'report.html'}")
    return out


if __name__ == "__main__":
    main()

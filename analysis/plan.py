"""How many warm starts and seeds a study needs, planned from a pilot before the study runs.

    python -m analysis.plan <pilot run or sweep dirs> --mde 5 [--power 0.8] [--out DIR]

For each comparison the pilot's runs declare (`analysis.comparisons`; `--treatment`/`--baseline` name one otherwise),
the pilot's paired differences on the declared metric give two variance components (foundation.stats): between
clusters (warm starts: what a new warm start would change) and within them (seeds). A study of k clusters x m seeds
then estimates the difference with standard error sqrt((between + within / m) / k) on k - 1 degrees of freedom; the
plan prints, per m, the fewest clusters (at least 3) whose test detects `--mde` with `--power` at the family's
alpha divided by its size (Holm's first step, the strictest one). `--mde` is in the report's units: percentage points
for accuracies. The plan is written beside the pilot's report (`plan.md`) so that it is committed before the study.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pandas as pd

from analysis.report import factor_keys, is_accuracy, run_table, study_of
from analysis.runs import COMPLETED, load
from analysis.verdicts import matching
from foundation.stats import POWER, Components, plan, study_detectable, variance_components
from foundation.study import Declared

SEEDS = (1, 2, 3, 4)  # seeds per warm start the plan considers


def paired_differences(table: pd.DataFrame, declared: Declared, metric: str) -> tuple[list[float], list[str]]:
    """The pilot's treatment - baseline differences, one per seed and warm start, and each one's cluster."""
    done = table[(table.status == COMPLETED) & table[metric].notna()]
    treated = matching(done, declared.treatment).set_index("pair")
    base = matching(done, declared.baseline).set_index("pair")
    pairs = [p for p in base.index if p in treated.index]
    differences = [float(treated.at[p, metric] - base.at[p, metric]) for p in pairs]
    clusters = [str(base.at[p, "cluster"]) for p in pairs]
    return differences, clusters


def plan_lines(name: str, components: Components, mde: float, alpha: float, power: float, scale: float) -> list[str]:
    needed = plan(components, mde, alpha, power, SEEDS)
    lines = [
        f"## {name}",
        "",
        f"Pilot: {components.pairs} pairs in {components.clusters} clusters; mean difference "
        f"{components.mean * scale:+.2f}; between-cluster sd {math.sqrt(components.between) * scale:.2f}, "
        f"within-cluster (seed) sd {math.sqrt(components.within) * scale:.2f}.",
        "",
        "| seeds per cluster | clusters needed | detectable at that size |",
        "|---|---|---|",
    ]
    for seeds, clusters in needed.items():
        if clusters is None:
            lines.append(f"| {seeds} | more than 64 | - |")
        else:
            detectable = study_detectable(components, clusters, seeds, alpha, power) * scale
            lines.append(f"| {seeds} | {clusters} | {detectable:.2f} |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m analysis.plan", description=__doc__.split("\n")[0])
    parser.add_argument("sources", nargs="+", help="the pilot's run or sweep directories")
    parser.add_argument("--mde", type=float, required=True, help="the effect to detect (points for accuracies)")
    parser.add_argument("--power", type=float, default=POWER, help="the power to detect it with")
    parser.add_argument("--treatment", nargs="*", default=[], help="key=value overrides of the treatment runs")
    parser.add_argument("--baseline", nargs="*", default=[], help="key=value overrides of the baseline runs")
    parser.add_argument("--out", type=Path, help="write plan.md here (default: print only)")
    args = parser.parse_args(argv)
    runs = load(args.sources)
    if not runs:
        parser.error(f"no runs found under {' '.join(args.sources)}")
    study = study_of(runs)
    if args.treatment or args.baseline:
        study = dataclasses.replace(study, comparisons=[Declared("given", args.treatment, args.baseline)])
    comparisons = study.comparisons
    if not comparisons:
        parser.error(
            "the pilot's runs declare no comparison (analysis.comparisons): name one with --treatment/--baseline"
        )
    metric = study.metric
    table = run_table(runs, factor_keys(runs), study, metric)
    scale = 100.0 if is_accuracy(metric) else 1.0
    alpha = study.alpha / len(comparisons)  # Holm's strictest step: a plan that holds for every comparison
    lines = [
        f"# Study plan from a pilot ({', '.join(args.sources)})",
        "",
        f"Metric `{metric}`; effect to detect {args.mde:g}{' points' if scale == 100 else ''} with "
        f"{args.power:.0%} power at alpha {study.alpha:g} / {len(comparisons)} comparisons = {alpha:.4f} "
        "(two-sided, at the cluster level).",
        "",
    ]
    for declared in comparisons:
        differences, clusters = paired_differences(table, declared, metric)
        try:
            components = variance_components(differences, clusters)
        except ValueError as exc:
            parser.error(f"{declared.name}: {exc} in the pilot")
        lines += plan_lines(declared.name, components, args.mde / scale, alpha, args.power, scale)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan.md").write_text(text + "\n", encoding="utf-8")
    return text


if __name__ == "__main__":
    main()

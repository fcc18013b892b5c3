"""How many warm starts and seeds a study needs, planned from a pilot before the study runs.

    python -m analysis.plan <pilot run or sweep dirs> --mde 5 [--power 0.8] [--out DIR]

For each comparison the pilot's runs declare (`analysis.comparisons`; `--treatment`/`--baseline` name one otherwise;
with `--experiment` too, that one stands in for each comparison the preset declares, at the preset's family size),
the pilot's paired differences on the declared metric give two variance components (foundation.stats): between
clusters (warm starts: what a new warm start would change) and within them (seeds). A study of k clusters x m seeds
then estimates the difference with standard error sqrt((between + within / m) / k) on k - 1 degrees of freedom; the
plan prints, per m, the fewest clusters (at least 3) whose test detects `--mde` with `--power` at the family's
alpha divided by its size (Holm's first step, the strictest one). `--mde` is in the report's units: percentage points
for accuracies. The spread is read from the pilot's validation scores by default (`--metric`), so that planning is no
look at the test split. The between-cluster variance of a pilot of few clusters is itself uncertain (3 clusters: 2
degrees of freedom); the plan prints it as an upper bound too (its one-sided 80% bound from the chi-square), and
the clusters that bound would need. A comparison whose completed pairs cannot give the two components (fewer than 2,
or none of its warm starts with 2: its runs interrupted, say) is named with why and not planned; the others still are.
The plan is written beside the pilot (`plan.md`) to be committed before the study.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pandas as pd
from hydra import compose, initialize_config_dir

from analysis.report import factor_keys, is_accuracy, run_table, study_of
from analysis.runs import COMPLETED, load
from analysis.verdicts import matching, pairs_of
from foundation.stats import POWER, Components, plan, study_detectable, variance_components
from foundation.study import METRICS, Declared, Study
from jobs.config import check_study

SEEDS = (1, 2, 3, 4)  # seeds per warm start the plan considers
UPPER = 0.8  # the confidence of the between-cluster variance's upper bound the cautious column plans on


class TooFewPairs(ValueError):
    """The pilot's completed pairs of a comparison cannot give its variance components (fewer than 2 pairs, or no
    warm start with 2): that one is not planned, the others are."""


def paired_differences(table: pd.DataFrame, declared: Declared, metric: str) -> tuple[list[float], list[str]]:
    """The pilot's treatment - baseline differences, one per seed and warm start (as the report pairs them), and each
    one's cluster (a pair without one is its own)."""
    done = table[table.status == COMPLETED]
    sides = {"baseline": matching(done, declared.baseline), "treatment": matching(done, declared.treatment)}
    found = pairs_of(sides["baseline"], sides["treatment"], metric)
    if found is None:
        twice = [name for name, runs in sides.items() if not runs[runs[metric].notna()].pair.is_unique]
        if twice:
            raise ValueError(
                f"the pilot's runs of {declared.name} do not pair by seed and warm start: its {' and '.join(twice)} "
                "side holds more than one run of a seed and warm start (it matches more than one cell: name the "
                "side's value of every factor)"
            )
        statuses = {
            name: ", ".join(f"{n} {status}" for status, n in matching(table, side).status.value_counts().items())
            for name, side in (("baseline", declared.baseline), ("treatment", declared.treatment))
        }
        raise TooFewPairs(
            f"fewer than 2 seeds and warm starts have completed runs with {metric} on both sides (the pilot's baseline "
            f"runs: {statuses['baseline'] or 'none'}; treatment runs: {statuses['treatment'] or 'none'}; where both "
            "sides completed, do they start from one warm start?)"
        )
    clusters = [c if c is not None else f"pair {i}" for i, c in enumerate(found.clusters)]
    return list(found.differences), clusters


def components_of(table: pd.DataFrame, declared: Declared, metric: str) -> Components:
    """The variance components of the pilot's paired differences of one comparison; TooFewPairs where its completed
    pairs cannot give them (foundation.stats.variance_components: 2 warm starts or more, one with 2 pairs or more)."""
    differences, clusters = paired_differences(table, declared, metric)
    try:
        return variance_components(differences, clusters)
    except ValueError as exc:
        raise TooFewPairs(
            f"its {len(differences)} completed pairs in {len(set(clusters))} warm starts cannot separate warm starts "
            "from seeds (that needs 2 warm starts or more, one of them with 2 pairs or more)"
        ) from exc


def plan_lines(name: str, components: Components, mde: float, alpha: float, power: float, scale: float) -> list[str]:
    upper = components.upper(UPPER)
    needed, cautious = plan(components, mde, alpha, power, SEEDS), plan(upper, mde, alpha, power, SEEDS)
    lines = [
        f"## {name}",
        "",
        f"Pilot: {components.pairs} pairs in {components.clusters} clusters; mean difference "
        f"{components.mean * scale:+.2f}; between-cluster sd {math.sqrt(components.between) * scale:.2f} "
        f"({UPPER:.0%} upper bound {math.sqrt(upper.between) * scale:.2f}), within-cluster (seed) sd "
        f"{math.sqrt(components.within) * scale:.2f}.",
        "",
        "| seeds per cluster | clusters needed | detectable at that size | clusters at the upper bound |",
        "|---|---|---|---|",
    ]
    for seeds, clusters in needed.items():
        more = cautious[seeds] if cautious[seeds] is not None else "more than 64"
        if clusters is None:
            lines.append(f"| {seeds} | more than 64 | - | {more} |")
        else:
            detectable = study_detectable(components, clusters, seeds, alpha, power) * scale
            lines.append(f"| {seeds} | {clusters} | {detectable:.2f} | {more} |")
    return [*lines, ""]


def declared_by(experiment: str) -> Study:
    """The analysis an experiment preset declares (the study being planned, whose pilot declared nothing)."""
    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return check_study(compose("config", overrides=[f"experiment={experiment}"]).analysis)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m analysis.plan", description=__doc__.split("\n")[0])
    parser.add_argument("sources", nargs="+", help="the pilot's run or sweep directories")
    parser.add_argument("--mde", type=float, required=True, help="the effect to detect (points for accuracies)")
    parser.add_argument("--power", type=float, default=POWER, help="the power to detect it with")
    parser.add_argument(
        "--experiment", help="plan for this preset's declared comparisons (conf/experiment/; default: the pilot's own)"
    )
    parser.add_argument("--treatment", nargs="*", default=[], help="key=value overrides of the treatment runs")
    parser.add_argument("--baseline", nargs="*", default=[], help="key=value overrides of the baseline runs")
    parser.add_argument("--out", type=Path, help="write plan.md here (default: print only)")
    parser.add_argument(
        "--metric",
        default="val_final",
        choices=sorted(METRICS),
        help="the pilot's score whose spread stands in for the study's (default val_final: the test split stays "
        "unseen until the study)",
    )
    args = parser.parse_args(argv)
    runs = load(args.sources)
    if not runs:
        parser.error(f"no runs found under {' '.join(args.sources)}")
    study = declared_by(args.experiment) if args.experiment else study_of(runs)
    family = len(study.comparisons) if args.experiment else 1  # a given comparison stands in for the preset's each
    if args.treatment or args.baseline:
        study = dataclasses.replace(study, comparisons=[Declared("given", args.treatment, args.baseline)])
    comparisons = study.comparisons
    family = max(family, len(comparisons))
    if not comparisons:
        parser.error(
            "the pilot's runs declare no comparison (analysis.comparisons): name one with --treatment/--baseline"
        )
    metric = args.metric
    table = run_table(runs, factor_keys(runs), study, metric)
    scale = 100.0 if is_accuracy(metric) else 1.0
    alpha = study.alpha / family  # Holm's strictest step: a plan that holds for every comparison
    lines = [
        f"# Study plan from a pilot ({', '.join(args.sources)}"
        + (f"; the comparisons experiment={args.experiment} declares)" if args.experiment else ")")
        + (
            f"\n\n`given` ({' '.join(args.treatment)} against {' '.join(args.baseline)}) stands in for each of them."
            if args.experiment and (args.treatment or args.baseline)
            else ""
        ),
        "",
        f"Metric `{metric}`; effect to detect {args.mde:g}{' points' if scale == 100 else ''} with "
        f"{args.power:.0%} power at alpha {study.alpha:g} / {family} comparisons = {alpha:.4f} "
        "(two-sided, at the cluster level).",
        "",
    ]
    unplanned = []
    for declared in comparisons:
        try:
            components = components_of(table, declared, metric)
        except TooFewPairs as exc:
            lines += [f"## {declared.name}", "", f"Not planned from this pilot: {exc}.", ""]
            unplanned.append(f"{declared.name}: {exc}")
            continue
        except ValueError as exc:
            parser.error(f"{declared.name}: {exc} in the pilot")
        lines += plan_lines(declared.name, components, args.mde / scale, alpha, args.power, scale)
    if len(unplanned) == len(comparisons):
        parser.error("no comparison has 2 completed pairs in the pilot; " + "; ".join(unplanned))
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan.md").write_text(text + "\n", encoding="utf-8")
    return text


if __name__ == "__main__":
    main()

"""The tuning stage of a study: each arm's setting chosen on the validation split, over the same grid for every arm,
and recorded before the main study runs.

    python -m analysis.tune <tuning sweep dirs> --out DIR [--metric val_final]

The tuning runs sweep each arm (`algorithm=...`) over a grid (for example `algorithm.learning_rate=3e-5,1e-4,3e-4`
for the arms that sample, `algorithm.sft_learning_rate=...` for the SFT arms: each arm's own learning rate, over the
same values). Per arm, every setting's validation score is averaged over its runs (seeds, warm starts) and the best
one is chosen (an exact tie keeps the setting the sweep ran first). Runs that scored the test split are refused:
tuning on test would leave no held-out verdict. Writes `tuning.md` (each arm's grid with mean ± 95% CI, the choice,
whether it is beyond noise of the runner-up and whether it sits at the grid's edge) and `tuning.json` (per arm, the
overrides the main study passes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from analysis.runs import COMPLETED, Run, load
from foundation.run_dir import is_factor, override_key
from foundation.stats import Comparison, Estimate, paired, welch

ARM_KEY = "algorithm"  # what tells arms apart in a tuning sweep
TUNING_METRICS = ("val_final", "val_best")


def score(run: Run, metric: str) -> float | None:
    """The run's validation score: at its last validation (`val_final`) or its best one (`val_best`)."""
    values = [m["val/accuracy"] for m in run.metrics if m.get("val/accuracy") is not None]
    if not values:
        return None
    return values[-1] if metric == "val_final" else max(values)


def setting_of(run: Run) -> tuple[str, ...]:
    """The run's tuned overrides: the factors it sets on the command line besides its arm."""
    return tuple(sorted(o for o in run.overrides if is_factor(override_key(o)) and override_key(o) != ARM_KEY))


def choose(runs: list[Run], metric: str) -> dict[str, dict[str, Any]]:
    """Per arm: each setting's scores and the best setting (the highest mean), whether it is at the edge of the grid,
    and whether it beats the runner-up beyond noise: paired by warm start and seed where both settings ran from the
    same ones (warm starts differ more than settings do), else Welch's."""
    looked = [r.name for r in runs if any(k.startswith("test/") for m in r.metrics for k in m)]
    if looked:
        raise ValueError(
            f"{len(looked)} tuning runs scored the test split ({looked[0]}, ...): tune with "
            "algorithm.test_at_end=false, so that the test split stays unseen until the main study"
        )
    scores: dict[str, dict[tuple[str, ...], dict[str, float]]] = {}
    for run in runs:
        value = score(run, metric) if run.status == COMPLETED else None
        if value is not None:
            start = f"seed={run.value('seed')} warm={(run.summary.get('sft') or {}).get('weights_sha256')}"
            scores.setdefault(str(run.value(ARM_KEY)), {}).setdefault(setting_of(run), {})[start] = value
    chosen: dict[str, dict[str, Any]] = {}
    for arm, settings in scores.items():
        ranked = sorted(settings, key=lambda s: Estimate.of(list(settings[s].values())).mean, reverse=True)
        best = ranked[0]
        margin = _margin(settings[best], settings[ranked[1]]) if len(ranked) > 1 else None
        chosen[arm] = {
            "overrides": list(best),
            "grid": {" ".join(s) or "(defaults)": list(settings[s].values()) for s in ranked},
            "beyond_runner_up": None if margin is None or margin.low is None else margin.low > 0,
            "at_edge": _at_edge(best, list(settings)),
        }
    return chosen


def _margin(best: dict[str, float], runner_up: dict[str, float]) -> Comparison:
    """best - runner-up: paired over the starts both ran from, where they share them all."""
    if set(best) == set(runner_up) and len(best) > 1:
        return paired([best[s] - runner_up[s] for s in best])
    return welch(list(runner_up.values()), list(best.values()))


def _at_edge(best: tuple[str, ...], settings: list[tuple[str, ...]]) -> bool:
    """Whether the chosen setting is the grid's smallest or largest value of a numeric key it tunes alone (the
    optimum may lie beyond the grid)."""
    if len(best) != 1 or any(len(s) != 1 or s[0].split("=")[0] != best[0].split("=")[0] for s in settings):
        return False
    try:
        values = sorted(float(s[0].split("=", 1)[1]) for s in settings)
        return len(values) > 2 and float(best[0].split("=", 1)[1]) in (values[0], values[-1])
    except ValueError:
        return False


def write(chosen: dict[str, dict[str, Any]], metric: str, sources: list[str], out: Path) -> str:
    lines = [
        f"# Tuning ({', '.join(sources)})",
        "",
        f"Each arm's setting chosen by its mean `{metric}` over its runs (validation only; no run scored the test "
        "split). The main study passes each arm's chosen overrides.",
        "",
    ]
    for arm, result in chosen.items():
        lines += [f"## `{ARM_KEY}={arm}`", "", f"| setting | runs | {metric} (%) |", "|---|---|---|"]
        for setting, values in result["grid"].items():
            e = Estimate.of(values)
            half = f" ± {e.half * 100:.1f}" if e.half is not None else ""
            lines.append(f"| {setting} | {e.n} | {e.mean * 100:.1f}{half} |")
        margin = {True: "beyond noise of", False: "inside noise of", None: "not testable against"}
        edge = " At the edge of the grid: the best setting may lie beyond it." if result["at_edge"] else ""
        lines += [
            "",
            f"Chosen: `{' '.join(result['overrides']) or '(defaults)'}`, "
            f"{margin[result['beyond_runner_up']]} the runner-up (paired by warm start and seed, 95%).{edge}",
            "",
        ]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuning.md").write_text(text + "\n", encoding="utf-8")
    record = {"metric": metric, "sources": sources, "arms": chosen}
    (out / "tuning.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m analysis.tune", description=__doc__.split("\n")[0])
    parser.add_argument("sources", nargs="+", help="the tuning sweeps' directories")
    parser.add_argument("--out", type=Path, required=True, help="where tuning.md and tuning.json go")
    parser.add_argument("--metric", default="val_final", choices=TUNING_METRICS, help="the validation score")
    args = parser.parse_args(argv)
    runs = load(args.sources)
    if not runs:
        parser.error(f"no runs found under {' '.join(args.sources)}")
    try:
        chosen = choose(runs, args.metric)
    except ValueError as exc:
        parser.error(str(exc))
    print(write(chosen, args.metric, args.sources, args.out))
    return chosen


if __name__ == "__main__":
    main()

"""Our execution match against Spider's official evaluator, side by side on the same pairs, in one run.

    git clone https://github.com/taoyds/test-suite-sql-eval /tmp/test-suite-sql-eval   # not vendored here
    python bench/exec_match_vs_official.py --official /tmp/test-suite-sql-eval

1. Verdicts: every pair of `bench/exec_match_suite.py` through both; any disagreement is printed, exit 1.
2. Speed: the scoring of GRPO groups (each gold query against `--group` predictions, as a training step scores
   them), timed for both over the same pairs; prints both times and the ratio, writes `bench/results/exec_match.json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.exec_match_suite import CASES, build_database
from rewards.exec_match import clear_gold_cache, execution_match


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official", type=Path, required=True, help="a checkout of taoyds/test-suite-sql-eval")
    parser.add_argument("--group", type=int, default=8, help="predictions scored per gold query")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "exec_match.json")
    args = parser.parse_args()
    sys.path.insert(0, str(args.official))
    from exec_eval import eval_exec_match  # the official evaluator

    def official(pred: str, gold: str, db: Path) -> int:
        return eval_exec_match(
            str(db), pred, gold, plug_value=False, keep_distinct=False, progress_bar_for_each_datapoint=False
        )

    db = build_database(Path(tempfile.mkdtemp()))
    disagreements = []
    for pred, gold, _ in CASES:
        theirs, ours = official(pred, gold, db), int(execution_match(pred, gold, db))
        if theirs != ours:
            disagreements.append({"pred": pred, "gold": gold, "official": theirs, "ours": ours})
    for d in disagreements:
        print(f"DISAGREE official={d['official']} ours={d['ours']}: {d['pred']!r} vs {d['gold']!r}")

    # GRPO-shaped workload: each gold query with `group` predictions (the suite's predictions for it, cycled).
    golds = sorted({gold for _, gold, _ in CASES})
    preds_for = {g: [p for p, gg, _ in CASES if gg == g] for g in golds}
    workload = [(preds_for[g][i % len(preds_for[g])], g) for g in golds for i in range(args.group)]

    def timed(score) -> float:
        best = float("inf")
        for _ in range(args.repeats):
            clear_gold_cache()  # each repeat starts cold, as a fresh training step on new tasks would
            start = time.perf_counter()
            for pred, gold in workload:
                score(pred, gold, db)
            best = min(best, time.perf_counter() - start)
        return best

    official_s = timed(official)
    ours_s = timed(lambda p, g, d: execution_match(p, g, d))
    result = {
        "pairs_checked": len(CASES),
        "disagreements": disagreements,
        "workload": f"{len(golds)} gold queries x {args.group} predictions = {len(workload)} scorings",
        "official_s": round(official_s, 4),
        "ours_s": round(ours_s, 4),
        "speedup": round(official_s / ours_s, 2),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "command": " ".join(["python", *sys.argv]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"verdicts: {len(CASES) - len(disagreements)}/{len(CASES)} pairs agree with the official evaluator")
    print(
        f"{result['workload']}: official {official_s * 1000:.1f} ms, ours {ours_s * 1000:.1f} ms, "
        f"ours is {result['speedup']}x faster"
    )
    return 1 if disagreements else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The verdicts a report gives: two groups of runs compared at the level of their independent unit, the study's
declared comparisons adjusted together by Holm, and the ledger of looks at the test split.

- `compare`: paired by seed and warm start where the runs pair, then taken per cluster (foundation.stats.clustered);
  Welch's t where they do not pair.
- `declared`: the comparisons the runs' `analysis` block declared (foundation/study.py), each matched to its runs,
  tested, and adjusted by Holm over the declared family. Everything else a report prints is exploratory.
- `Ledger`: every report that judges on the test split appends a look (date, runs, each comparison's verdict) to
  `ledger.jsonl` in the report's folder, unless the same runs with the same scores were looked at before through the
  same analysis (a re-render looks at nothing new; `--unfinished-as` is an analysis of its own: its `variant`). A
  verdict says which look it is and whether it changed since an earlier look.
- `item_differences`: per-question score differences of paired runs (their `scores/<metric>.json`), for the
  bootstrap over clusters and questions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hydra.core.override_parser.overrides_parser import OverridesParser

from analysis.runs import COMPLETED, WANDB_PREFIX
from foundation.stats import LEVEL, Comparison, Estimate, bootstrap_clusters_items, clustered, holm, paired, welch
from foundation.study import WARM_START, Study

EXPLORATORY = "exploratory, uncorrected"
LEDGER = "ledger.jsonl"


@dataclass
class Pairs:
    """Two sides' runs matched by seed and warm start (`pair`): the differences, each pair's cluster (None: the pair
    is its own unit) and the runs of either side left without a partner."""

    differences: np.ndarray
    clusters: list[str | None]
    unpaired: list[str]


def pairs_of(base: pd.DataFrame, other: pd.DataFrame, metric: str) -> Pairs | None:
    """other - base per pair, over the pairs both sides have (runs with the metric); None where a side has a pair
    twice (runs of one seed and start that are not one run) or fewer than 2 pairs exist."""
    a, b = base[base[metric].notna()], other[other[metric].notna()]
    if not a.pair.is_unique or not b.pair.is_unique:
        return None
    shared = [p for p in a.pair if p in set(b.pair)]
    if len(shared) < 2:
        return None
    a, b = a.set_index("pair").loc[shared], b.set_index("pair").loc[shared]
    d = b[metric].to_numpy(dtype=float) - a[metric].to_numpy(dtype=float)
    clusters = [c if isinstance(c, str) and c else None for c in a.cluster]
    unpaired = sorted(set(base.run[~base.pair.isin(shared)]) | set(other.run[~other.pair.isin(shared)]))
    return Pairs(d, clusters, unpaired)


def compare(
    base: pd.DataFrame, other: pd.DataFrame, metric: str, level: float = LEVEL, unit: str = "warm start"
) -> Comparison:
    """`other` against `base` on `metric`: paired by seed and warm start (`pairs_of`), taken at the level of the
    independent unit where pairs share a cluster (`cluster`: a warm start; foundation.stats.clustered); runs left
    without a partner (a failed run) are named, never silently pooled. Where the runs do not pair: Welch's t over
    the clusters' means where runs have clusters, else over runs."""
    found = pairs_of(base, other, metric)
    if found is not None:
        if all(c is None for c in found.clusters):
            result = paired(found.differences, level)
        else:
            labels = [c if c is not None else f"pair {i}" for i, c in enumerate(found.clusters)]
            result = clustered(found.differences, labels, level, unit)
        if found.unpaired:
            left = f"{len(found.unpaired)} runs without a partner left out ({', '.join(found.unpaired[:3])}"
            left += ", ...)" if len(found.unpaired) > 3 else ")"
            result = dataclasses.replace(result, caveat="; ".join(filter(None, [result.caveat, left])))
        return result
    a, b = base[base[metric].notna()], other[other[metric].notna()]
    if a.cluster.notna().all() and b.cluster.notna().all() and len(a) and len(b):
        means = [side.groupby("cluster")[metric].mean() for side in (a, b)]
        result = welch(means[0], means[1], level)
        return dataclasses.replace(result, test=f"Welch over {unit} means (runs do not pair)")
    return welch(a[metric], b[metric], level)


def estimate_of(runs: pd.DataFrame, metric: str) -> Estimate:
    """A group's mean and 95% interval: over its clusters' means where runs share a cluster (seeds of one warm start
    are not independent draws), else over its runs. `n` stays the runs that have the metric."""
    known = runs[runs[metric].notna()]
    if known.empty or known.cluster.isna().any() or known.cluster.is_unique:
        return Estimate.of(known[metric])
    means = Estimate.of(known.groupby("cluster")[metric].mean())
    return Estimate(means.mean, means.half, len(known))


def value_column(key: str) -> str:
    """The run table's column holding `key`'s value for matching declarations (factors have their own)."""
    return f"value:{key}"


def declared_keys(study: Study) -> list[str]:
    return list(dict.fromkeys(parse_override(o)[0] for c in study.comparisons for o in (*c.treatment, *c.baseline)))


def parse_override(override: str) -> tuple[str, Any]:
    """An override's key (or group) and its typed value: `agent.check_step=false` -> (`agent.check_step`, False)."""
    parsed = OverridesParser.create().parse_override(override)
    return parsed.key_or_group, parsed.value()


def same_value(value: Any, want: Any) -> bool:
    """A run's value against an override's, types kept apart: a bool equals only a bool (0 is not `false`), null
    equals None or a missing number (NaN), numbers compare as numbers (2048 = 2048.0), the rest as text."""
    if want is None:
        return value is None or (isinstance(value, float) and math.isnan(value))
    if isinstance(want, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(want, bool) and value == want
    if isinstance(want, int | float) and isinstance(value, int | float):
        return float(value) == float(want)
    return str(value) == str(want)


def matching(table: pd.DataFrame, overrides: list[str]) -> pd.DataFrame:
    """The rows whose values equal every override's (`algorithm=grpo`, `agent.check_step=false`)."""
    mask = pd.Series(True, index=table.index)
    for override in overrides:
        key, value = parse_override(override)
        mask &= table[value_column(key)].map(lambda v, want=value: same_value(v, want))
    return table[mask]


@dataclass
class Verdict:
    """One comparison's result: declared (with its Holm-adjusted p) or exploratory."""

    name: str
    role: str  # primary, secondary, or exploratory
    comparison: Comparison
    treated: Estimate
    base: Estimate
    p_holm: float | None = None
    alpha: float = 0.05
    bootstrap: tuple[float, float, float] | None = None  # mean, low, high over clusters x questions

    @property
    def declared(self) -> bool:
        return self.role != "exploratory"

    @property
    def outcome(self) -> str:
        """beyond noise / inside noise / no verdict: for a declared comparison by its Holm-adjusted p against the
        family's alpha; for an exploratory one by its unadjusted interval."""
        c = self.comparison
        if math.isnan(c.diff):
            return "no verdict (a side has no runs with the metric)"
        if c.low is None:
            return "no verdict (" + (c.caveat or "fewer than 2 runs or pairs") + ")"
        if self.declared:
            beyond = self.p_holm is not None and self.p_holm < self.alpha
            if self.p_holm is None:  # no spread at all: the interval is the difference itself
                beyond = not c.low <= 0 <= c.high
        else:
            beyond = not c.low <= 0 <= c.high
        return "beyond noise" if beyond else "inside noise"

    def record(self) -> dict[str, Any]:
        c = self.comparison
        return {
            "role": self.role,
            "diff": c.diff,
            "low": c.low,
            "high": c.high,
            "p": c.p,
            "p_holm": self.p_holm,
            "test": c.test,
            "outcome": self.outcome,
        }


def per_cluster(table: pd.DataFrame, study: Study, metric: str) -> pd.DataFrame:
    """Each cluster's (warm start's) mean difference on `metric` for every declared comparison, the seeds that share
    it averaged: the units the declared verdicts are taken over, one row a cluster, with its pairs per comparison and
    (where runs log it) the cluster's `val_initial` (its start's own validation score). Empty where no comparison
    pairs runs that share clusters."""
    done = table[table.status == COMPLETED]
    columns: dict[str, pd.Series] = {}
    for declaration in study.comparisons:
        found = pairs_of(matching(done, declaration.baseline), matching(done, declaration.treatment), metric)
        if found is None or any(c is None for c in found.clusters):
            continue
        by_cluster = pd.Series(found.differences, index=found.clusters).groupby(level=0, sort=False)
        columns[f"Δ {declaration.name}"] = by_cluster.mean()
        columns[f"pairs {declaration.name}"] = by_cluster.size()
    if not columns:
        return pd.DataFrame()
    out = pd.DataFrame(columns)
    if "val_initial" in done and done.val_initial.notna().any():
        out.insert(0, "val_initial", done.groupby("cluster").val_initial.mean().reindex(out.index))
    return out.rename_axis(study.cluster)


def declared(table: pd.DataFrame, study: Study, metric: str) -> list[Verdict]:
    """The study's declared comparisons on `metric` (completed runs), Holm-adjusted together: one family. Each
    one's detectable |Δ| is at alpha / m, the level Holm's first step tests at, so that it states what the verdict
    could have found: a 95 % level would promise effects that the correction leaves inside noise."""
    done = table[table.status == COMPLETED]
    unit = unit_of(study)
    verdicts = []
    for declaration in study.comparisons:
        treated, base = matching(done, declaration.treatment), matching(done, declaration.baseline)
        comparison = compare(base, treated, metric, LEVEL, unit)
        # what it could detect under the family's correction: at alpha / m, Holm's first (strictest) step
        strict = compare(base, treated, metric, 1 - study.alpha / len(study.comparisons), unit)
        comparison = dataclasses.replace(comparison, detectable=strict.detectable)
        empty = [" ".join(side) for side, runs in ((declaration.treatment, treated), (declaration.baseline, base))]
        empty = [side for side, runs in zip(empty, (treated, base), strict=True) if runs.empty]
        if empty:  # a misspelt declaration, or runs not done yet: said, not judged
            comparison = dataclasses.replace(comparison, caveat=f"no completed run matches {' and '.join(empty)}")
        verdicts.append(
            Verdict(
                declaration.name,
                declaration.role,
                comparison,
                estimate_of(treated, metric),
                estimate_of(base, metric),
                alpha=study.alpha,
                bootstrap=_bootstrap(base, treated, metric),
            )
        )
    for verdict, p in zip(verdicts, holm([v.comparison.p for v in verdicts]), strict=True):
        verdict.p_holm = p
    return verdicts


def unit_of(study: Study) -> str:
    """What the study's cluster is, in words."""
    return "warm start" if study.cluster == WARM_START else study.cluster


def item_differences(base: pd.DataFrame, treated: pd.DataFrame) -> list[np.ndarray] | None:
    """Per cluster, a (pairs x questions) array of treated - base per-question scores over the questions every run
    scored (`items`: id -> score); None where the runs do not pair or lack item-level scores."""
    if base.empty or not base.pair.is_unique or not treated.pair.is_unique:
        return None
    shared = [p for p in base.pair if p in set(treated.pair)]  # as `pairs_of`: runs without a partner left out
    if len(shared) < 2:
        return None
    base, treated = base[base.pair.isin(shared)], treated[treated.pair.isin(shared)]
    items = list(base["items"]) + list(treated["items"])
    if any(not isinstance(i, dict) or not i for i in items):
        return None
    questions = sorted(set.intersection(*(set(i) for i in items)))
    if not questions:
        return None
    a, b = base.set_index("pair"), treated.set_index("pair")
    rows: dict[str, list[np.ndarray]] = {}
    for pair in a.index:
        cluster = a.at[pair, "cluster"]
        key = cluster if isinstance(cluster, str) and cluster else pair
        scores = [np.array([_score(x[q]) for q in questions]) for x in (a.at[pair, "items"], b.at[pair, "items"])]
        rows.setdefault(key, []).append(scores[1] - scores[0])
    return [np.stack(r) for r in rows.values()]


def _score(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _bootstrap(base: pd.DataFrame, treated: pd.DataFrame, metric: str) -> tuple[float, float, float] | None:
    base, treated = base[base[metric].notna()], treated[treated[metric].notna()]
    if "items" not in base:
        return None
    differences = item_differences(base, treated)
    if differences is None or len(differences) < 2:
        return None
    return bootstrap_clusters_items(differences)


@dataclass
class Look:
    """One look at the test split: which, when, on how many runs, and each comparison's verdict then."""

    look: int
    date: str
    metric: str
    runs: int
    fingerprint: str  # the runs and their scores looked at, and the variant of the analysis
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)
    variant: str = ""  # an analysis beyond the declared one (`unfinished at 0`): its own look, recorded


@dataclass
class Ledger:
    """`ledger.jsonl` in a report's folder: every look at the test split, in order."""

    path: Path

    def looks(self) -> list[Look]:
        if not self.path.is_file():
            return []
        return [Look(**json.loads(line)) for line in self.path.read_text(encoding="utf-8").splitlines() if line]

    def record(
        self, table: pd.DataFrame, metric: str, verdicts: list[Verdict], variant: str = ""
    ) -> tuple[Look, list[Look]]:
        """This look (appended unless the same runs and scores were looked at before through the same `variant`
        of the analysis: a variant first rendered after the plain report is a look of its own) and those before."""
        done = table[(table.status == COMPLETED) & table[metric].notna()]
        # each run named from the folder above the ledger's, however the report named its sources
        base = self.path.parent.parent
        runs = [
            r if s.startswith(WANDB_PREFIX) else os.path.relpath(Path(s).parent / r, base)
            for s, r in zip(done.source, done.run, strict=True)
        ]
        scores = sorted((str(r), float(v)) for r, v in zip(runs, done[metric], strict=True))
        seen = [metric, scores] + ([variant] if variant else [])  # the plain report's fingerprints as they were
        fingerprint = hashlib.sha256(json.dumps(seen).encode()).hexdigest()[:16]
        looks = self.looks()
        for i, look in enumerate(looks):
            if look.fingerprint == fingerprint:
                return look, looks[:i]
        look = Look(
            look=len(looks) + 1,
            date=datetime.now(UTC).isoformat(timespec="seconds"),
            metric=metric,
            runs=len(done),
            fingerprint=fingerprint,
            verdicts={v.name: v.record() for v in verdicts},
            variant=variant,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(look)) + "\n")
        return look, looks


def ledger_folder(sources: list[str]) -> Path:
    """Where a report on the run folders `sources` records its look at the test split: the nearest folder at or above
    their common folder that already keeps a ledger (a report on part of a judged study is a look at that study, not
    the first look at a new one), else the common folder itself."""
    try:
        common = Path(os.path.commonpath(sources))
    except ValueError:  # absolute and relative paths mixed
        common = Path(os.path.commonpath([str(Path(s).resolve()) for s in sources]))
    for folder in (common, *common.parents):
        if (folder / LEDGER).is_file():
            return folder
    return common


def look_note(name: str, outcome: str, look: Look, before: list[Look]) -> str:
    """Which look at the test split this verdict comes from, and whether it changed since an earlier one."""
    note = f"test look {look.look} ({look.date[:10]}, {look.runs} runs)"
    if not before:
        return note + ", the first"
    changes = [
        f"{earlier['outcome']} at look {b.look} ({b.runs} runs)"
        for b in before
        if (earlier := b.verdicts.get(name)) is not None and earlier["outcome"] != outcome
    ]
    note += f", after {len(before)} earlier look{'s' if len(before) > 1 else ''}"
    if changes:
        note += (
            f"; CHANGED since: {'; '.join(changes)} (runs added or removed, or the analysis changed, after the test "
            "was seen): not confirmatory unless planned before the first look"
        )
    return note

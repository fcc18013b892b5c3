"""The statistics every verdict here is computed with: the end-of-run text (jobs/train.py), the report
(analysis/report.py) and a study's plan (analysis/plan.py) call these functions, so that a number is computed alike
wherever it is printed.

- Intervals: a mean over runs (Student's t), an accuracy over questions (Wilson).
- Comparisons, each with a two-sided p, a confidence interval and the smallest difference it could detect at
  `POWER` (the normal-approximation formula with t quantiles: (t_{1-a/2} + t_{power}) x standard error):
  - `welch`: independent runs;
  - `paired`: pairs of runs (a treatment and a baseline from the same seed and start), a t-test on the differences;
  - `clustered`: pairs nested in clusters (several seeds sharing one warm start). The pairs' differences are averaged
    per cluster and the t-test runs on those means (clusters - 1 degrees of freedom): a warm start, not a seed, is
    the independent unit when what varies between warm starts would vary again in a new study. The heterogeneity
    across clusters is a one-way ANOVA of the differences by cluster. Under 3 clusters a study cannot speak beyond
    its warm starts (`Comparison.caveat` says so).
- `holm`: Holm's step-down adjustment of a declared family's p-values (family-wise error at most alpha).
- `variance_components` and `plan`: a pilot's between- and within-cluster variance of a paired difference, and the
  clusters x seeds a study needs to detect a planned effect.
- `bootstrap_clusters_items`: an interval from resampling clusters and questions (crossed), from per-question
  scores.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

POWER = 0.8  # the power at which the smallest detectable difference is stated
LEVEL = 0.95  # the confidence level of every interval unless a caller asks for another
MIN_CLUSTERS = 3  # fewer independent units than this: no claim beyond the units themselves
WITHIN_NOISE, BEYOND_NOISE, NO_ERROR_BAR = "within noise", "beyond noise", "no error bar (n < 2)"


@dataclass(frozen=True)
class Estimate:
    """A mean and the half-width of its confidence interval over n values (half None when n < 2)."""

    mean: float
    half: float | None
    n: int

    @classmethod
    def of(cls, values: Sequence[float] | np.ndarray, level: float = LEVEL) -> Estimate:
        x = _finite(values)
        n = len(x)
        if n == 0:
            return cls(math.nan, None, 0)
        half = float(stats.t.ppf(1 - (1 - level) / 2, n - 1) * x.std(ddof=1) / math.sqrt(n)) if n > 1 else None
        return cls(float(x.mean()), half, n)


def wilson(p: float, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The Wilson interval of an accuracy p measured on n questions."""
    z = float(stats.norm.ppf(1 - (1 - level) / 2))
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low, high = max(0.0, centre - half), min(1.0, centre + half)
    return (0.0 if p <= 0 else low), (1.0 if p >= 1 else high)  # exact at the ends, whatever the rounding


def proportion_difference(p_base: float, n_base: int, p_other: float, n_other: int, level: float = LEVEL) -> Comparison:
    """p_other - p_base for accuracies on n questions each, as if independent (Wald): one run's accuracy before and
    after training, where no other unit of replication exists. Scored on the same questions the two are correlated
    and this interval is conservative."""
    diff = p_other - p_base
    se = math.sqrt(p_base * (1 - p_base) / n_base + p_other * (1 - p_other) / n_other)
    z = float(stats.norm.ppf(1 - (1 - level) / 2))
    p = float(2 * stats.norm.sf(abs(diff) / se)) if se > 0 else None
    detectable_diff = float((z + stats.norm.ppf(POWER)) * se) if se > 0 else None
    return Comparison(
        diff, diff - z * se, diff + z * se, p, detectable_diff, "two proportions (Wald)", min(n_base, n_other)
    )


@dataclass(frozen=True)
class Heterogeneity:
    """How much a paired difference varies between clusters beyond what its seeds explain (one-way ANOVA)."""

    f: float
    p: float
    clusters: int
    pairs: int
    unit: str = "cluster"  # what a cluster is ("warm start")


@dataclass(frozen=True)
class Comparison:
    """other - base: the difference, its interval at the level asked, the two-sided p and the smallest |difference|
    the test would detect with `POWER` (None where the data give no spread to judge by). `n` counts the independent
    units the test ran on (runs per side for Welch, pairs, or clusters); `caveat` says what the test cannot claim."""

    diff: float
    low: float | None
    high: float | None
    p: float | None
    detectable: float | None
    test: str
    n: int
    heterogeneity: Heterogeneity | None = None
    caveat: str | None = None

    @property
    def flag(self) -> str:
        if self.low is None or self.high is None:
            return NO_ERROR_BAR
        return WITHIN_NOISE if self.low <= 0 <= self.high else BEYOND_NOISE


def welch(base: Sequence[float] | np.ndarray, other: Sequence[float] | np.ndarray, level: float = LEVEL) -> Comparison:
    """other - base over independent runs (Welch's t)."""
    a, b = _finite(base), _finite(other)
    diff = float(b.mean() - a.mean()) if len(a) and len(b) else math.nan
    n = min(len(a), len(b))
    if n < 2:
        return Comparison(diff, None, None, None, None, "Welch", n)
    if _constant(a) and _constant(b):  # no seed variance at all: the t-test is undefined
        return _no_spread(diff, "Welch", n)
    test = stats.ttest_ind(b, a, equal_var=False)
    ci = test.confidence_interval(level)
    se = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return Comparison(
        diff, float(ci.low), float(ci.high), float(test.pvalue), detectable(se, float(test.df), level), "Welch", n
    )


NO_SPREAD = "no spread between the units: no test"


def _no_spread(diff: float, test: str, n: int) -> Comparison:
    """Every unit alike: a zero difference is inside noise; any other has no interval to judge it by (accuracies on
    few questions tie often), so no verdict rather than a certain one."""
    if diff == 0:
        return Comparison(0.0, 0.0, 0.0, None, None, test, n)
    return Comparison(diff, None, None, None, None, test, n, caveat=NO_SPREAD)


def paired(differences: Sequence[float] | np.ndarray, level: float = LEVEL, test: str | None = None) -> Comparison:
    """The mean of paired differences against 0 (one-sample t on them)."""
    d = _finite(differences)
    name = test or f"paired ({len(d)} pairs)"
    diff = float(d.mean()) if len(d) else math.nan
    if len(d) < 2:
        return Comparison(diff, None, None, None, None, name, len(d))
    if _constant(d):
        return _no_spread(diff, name, len(d))
    result = stats.ttest_1samp(d, 0.0)
    ci = result.confidence_interval(level)
    se = float(d.std(ddof=1) / math.sqrt(len(d)))
    return Comparison(
        diff, float(ci.low), float(ci.high), float(result.pvalue), detectable(se, len(d) - 1, level), name, len(d)
    )


def clustered(
    differences: Sequence[float] | np.ndarray, clusters: Sequence[Hashable], level: float = LEVEL, unit: str = "cluster"
) -> Comparison:
    """Paired differences nested in clusters (`unit`: what a cluster is, e.g. "warm start"): the t-test on the
    clusters' mean differences, each cluster weighing alike, with the heterogeneity across clusters. Where every
    cluster holds one pair this is `paired`."""
    d = np.asarray(differences, dtype=float)
    labels = np.asarray([str(c) for c in clusters])
    keep = np.isfinite(d)
    d, labels = d[keep], labels[keep]
    groups = [d[labels == c] for c in dict.fromkeys(labels)]
    k, pairs = len(groups), len(d)
    if k == pairs:  # one pair a cluster: the pairs are the units
        result = paired(d, level)
        if k < MIN_CLUSTERS and result.caveat is None:
            result = dataclasses.replace(result, caveat=f"{k} {unit}s: cannot speak beyond its {unit}s")
        return result
    means = np.array([g.mean() for g in groups])
    het = heterogeneity(groups, unit)
    if k == 1:  # one cluster: its seeds say nothing about another warm start
        within = paired(d, level, test=f"paired ({pairs} pairs) within 1 {unit}")
        caveat = f"1 {unit}: says nothing beyond it (no {unit}-level interval)"
        return Comparison(within.diff, None, None, None, None, within.test, 1, het, caveat)
    result = paired(means, level, test=f"paired at the {unit} level ({k} {unit}s, {pairs} pairs)")
    few = f"{k} {unit}s: cannot speak beyond its {unit}s" if k < MIN_CLUSTERS else None
    caveat = "; ".join(c for c in (result.caveat, few) if c) or None
    return Comparison(result.diff, result.low, result.high, result.p, result.detectable, result.test, k, het, caveat)


def heterogeneity(groups: Sequence[np.ndarray], unit: str = "cluster") -> Heterogeneity | None:
    """One-way ANOVA of the differences by cluster; None where no cluster has two values to give a within spread."""
    groups = [np.asarray(g, dtype=float) for g in groups if len(g)]
    if len(groups) < 2 or sum(len(g) for g in groups) <= len(groups):
        return None
    within = sum(float(((g - g.mean()) ** 2).sum()) for g in groups)
    if within == 0:
        return None
    result = stats.f_oneway(*groups)
    return Heterogeneity(float(result.statistic), float(result.pvalue), len(groups), sum(len(g) for g in groups), unit)


def detectable(se: float, df: float, level: float = LEVEL, power: float = POWER) -> float:
    """The smallest |difference| a two-sided t-test at `level` with standard error `se` detects with `power`."""
    return float((stats.t.ppf(1 - (1 - level) / 2, df) + stats.t.ppf(power, df)) * se)


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (monotone, at most 1). A comparison without a p (it could not be tested)
    keeps None but still counts in the family's size: it was declared, so it spent its share of alpha."""
    known = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m = len(pvalues)
    adjusted: list[float | None] = [None] * m
    running = 0.0
    for rank, (p, i) in enumerate(known):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


@dataclass(frozen=True)
class Components:
    """A paired difference's variance between clusters (`between`: of the clusters' true means) and within them
    (`within`: between seeds of one cluster), from a one-way random-effects ANOVA (moment estimates, the between
    part floored at 0)."""

    mean: float
    between: float
    within: float
    clusters: int
    pairs: int
    msb: float = math.nan  # the between-cluster mean square (k - 1 degrees of freedom)
    n0: float = math.nan  # the effective pairs per cluster

    def upper(self, confidence: float = 0.8) -> Components:
        """The same with the between part at its one-sided `confidence` upper bound: the between mean square's
        chi-square bound on k - 1 degrees of freedom (a pilot of 3 clusters knows it within a wide range)."""
        df = self.clusters - 1
        msb = self.msb * df / float(stats.chi2.ppf(1 - confidence, df))
        return dataclasses.replace(self, between=max(0.0, (msb - self.within) / self.n0), msb=msb)


def variance_components(differences: Sequence[float], clusters: Sequence[Hashable]) -> Components:
    d = np.asarray(differences, dtype=float)
    labels = np.asarray([str(c) for c in clusters])
    groups = [d[labels == c] for c in dict.fromkeys(labels)]
    k, n = len(groups), len(d)
    if k < 2 or n <= k:
        raise ValueError(
            f"variance components need 2 clusters or more, one with 2 pairs or more (got {k} clusters, {n} pairs)"
        )
    grand = d.mean()
    msw = sum(float(((g - g.mean()) ** 2).sum()) for g in groups) / (n - k)
    msb = sum(len(g) * float((g.mean() - grand) ** 2) for g in groups) / (k - 1)
    n0 = (n - sum(len(g) ** 2 for g in groups) / n) / (k - 1)  # the mean cluster size, for unequal sizes
    return Components(float(grand), max(0.0, (msb - msw) / n0), msw, k, n, msb, n0)


def study_detectable(
    components: Components, clusters: int, seeds: int, alpha: float = 0.05, power: float = POWER
) -> float:
    """The smallest |difference| a cluster-level paired test detects with `clusters` x `seeds` pairs at `alpha`
    (two-sided), given the pilot's variance components."""
    se = math.sqrt((components.between + components.within / seeds) / clusters)
    return detectable(se, clusters - 1, 1 - alpha, power)


def plan(
    components: Components,
    mde: float,
    alpha: float = 0.05,
    power: float = POWER,
    seeds: Sequence[int] = (1, 2, 3, 4),
    max_clusters: int = 64,
) -> dict[int, int | None]:
    """Per number of seeds a cluster, the fewest clusters (at least `MIN_CLUSTERS`) whose study detects `mde` at
    `alpha` with `power`; None when even `max_clusters` do not."""
    needed: dict[int, int | None] = {}
    for m in seeds:
        needed[m] = next(
            (
                k
                for k in range(MIN_CLUSTERS, max_clusters + 1)
                if study_detectable(components, k, m, alpha, power) <= mde
            ),
            None,
        )
    return needed


def bootstrap_clusters_items(
    differences: Sequence[np.ndarray],
    level: float = LEVEL,
    resamples: int = 4000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """The mean paired difference and its interval, resampling clusters and questions (crossed: every cluster
    answered the same questions, in the same order: the caller aligns them by id). `differences[c]` is a (pairs x
    questions) array of one cluster's per-question score differences (NaN where a score is missing). The statistic:
    the mean over clusters of each cluster's mean over pairs and questions. The interval is t(clusters - 1) x the
    resampled standard error: with few clusters a percentile interval covers too little (82 % for a nominal 95 % at 3
    clusters, simulated), as the cluster-level t would not."""
    arrays = [np.atleast_2d(np.asarray(c, dtype=float)) for c in differences]
    questions = {a.shape[1] for a in arrays}
    if len(questions) != 1:
        raise ValueError(f"every cluster must score the same questions (got {sorted(questions)} per cluster)")
    q = questions.pop()
    per_question = np.stack([np.nanmean(a, axis=0) for a in arrays])  # clusters x questions: pairs averaged
    estimate = float(np.nanmean(per_question))
    rng = np.random.default_rng(seed)
    k = len(arrays)
    draws = np.empty(resamples)
    for i in range(resamples):
        rows = rng.integers(0, k, k)
        cols = rng.integers(0, q, q)
        draws[i] = np.nanmean(per_question[np.ix_(rows, cols)])
    half = float(stats.t.ppf(1 - (1 - level) / 2, k - 1) * draws.std(ddof=1))
    return estimate, estimate - half, estimate + half


def _finite(values: Sequence[float] | np.ndarray) -> np.ndarray:
    x = np.asarray(values, dtype=float)
    return x[np.isfinite(x)]


def _constant(x: np.ndarray) -> bool:
    """No spread beyond rounding (0.62 - 0.54 and 0.64 - 0.55 differ by 1e-17)."""
    return bool(np.ptp(x) <= 1e-12 * max(1.0, float(np.abs(x).max())))

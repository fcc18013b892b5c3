"""foundation/stats.py against values computed by hand or by scipy directly: Holm's adjustment, the cluster-level
test and its heterogeneity, variance components and the plan built on them, the two-level bootstrap; and
`python -m analysis.plan` on a pilot."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from analysis import plan as plan_cli
from foundation import stats
from tests.test_report import DECLARED, HETEROGENEOUS, write_arm, write_study


def test_holm_adjusts_step_down_and_keeps_the_order() -> None:
    # sorted 0.01, 0.02, 0.03, 0.04 -> x4, x3 (max with the previous), x2, x1
    assert stats.holm([0.04, 0.01, 0.03, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    assert stats.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1


def test_a_declared_comparison_without_a_p_still_counts_in_the_family() -> None:
    assert stats.holm([0.02, None]) == pytest.approx([0.04, None])


def test_pairs_in_one_cluster_each_are_a_plain_paired_test() -> None:
    d = [0.01, 0.03, 0.02, 0.05]
    c = stats.clustered(d, ["a", "b", "c", "d"], unit="warm start")
    direct = scipy_stats.ttest_1samp(d, 0.0)
    assert c.test == "paired (4 pairs)" and c.p == pytest.approx(direct.pvalue) and c.heterogeneity is None


def test_the_cluster_level_test_runs_on_the_cluster_means() -> None:
    d = [0.01, 0.02, 0.10, 0.11, 0.05, 0.07]
    clusters = ["w0", "w0", "w1", "w1", "w2", "w2"]
    c = stats.clustered(d, clusters, unit="warm start")
    means = [0.015, 0.105, 0.06]
    direct = scipy_stats.ttest_1samp(means, 0.0)
    assert c.n == 3 and c.p == pytest.approx(direct.pvalue)
    assert (c.low, c.high) == pytest.approx(tuple(direct.confidence_interval()))
    anova = scipy_stats.f_oneway([0.01, 0.02], [0.10, 0.11], [0.05, 0.07])
    assert c.heterogeneity is not None and c.heterogeneity.f == pytest.approx(anova.statistic)
    assert c.caveat is None


@pytest.mark.parametrize(
    ("clusters", "caveat", "has_interval"),
    [
        (["w0"] * 4, "1 warm start: says nothing beyond it", False),
        (["w0", "w0", "w1", "w1"], "2 warm starts: cannot speak beyond its warm starts", True),
    ],
)
def test_under_three_clusters_a_study_says_it_cannot_speak_beyond_them(
    clusters: list[str], caveat: str, has_interval: bool
) -> None:
    c = stats.clustered([0.01, 0.03, 0.02, 0.06], clusters, unit="warm start")
    assert c.caveat is not None and c.caveat.startswith(caveat)
    assert (c.low is not None) == has_interval


def test_variance_components_recover_the_spread_between_and_within_clusters() -> None:
    rng = np.random.default_rng(0)
    means = rng.normal(0.0, 0.05, size=400)  # between-cluster sd 0.05
    d = np.concatenate([m + rng.normal(0.0, 0.02, size=3) for m in means])  # within sd 0.02, 3 seeds each
    components = stats.variance_components(d, np.repeat(np.arange(400), 3))
    assert components.between == pytest.approx(0.05**2, rel=0.15)
    assert components.within == pytest.approx(0.02**2, rel=0.1)


def test_the_plan_finds_the_fewest_clusters_that_detect_the_effect() -> None:
    components = stats.Components(mean=0.04, between=0.002, within=0.0007, clusters=3, pairs=9)
    needed = stats.plan(components, mde=0.05)
    for seeds, clusters in needed.items():
        assert clusters is not None and clusters >= stats.MIN_CLUSTERS
        assert stats.study_detectable(components, clusters, seeds) <= 0.05
        if clusters > stats.MIN_CLUSTERS:
            assert stats.study_detectable(components, clusters - 1, seeds) > 0.05
    assert needed[4] <= needed[1]  # more seeds never need more warm starts
    assert stats.plan(components, mde=0.001, max_clusters=10) == {1: None, 2: None, 3: None, 4: None}


def test_the_upper_bound_of_the_between_variance_is_wider_and_plans_more_clusters() -> None:
    d = [0.01, 0.02, 0.10, 0.11, 0.05, 0.07]
    components = stats.variance_components(d, ["w0", "w0", "w1", "w1", "w2", "w2"])
    upper = components.upper(0.8)
    msb_upper = components.msb * 2 / scipy_stats.chi2.ppf(0.2, 2)
    assert upper.between == pytest.approx((msb_upper - components.within) / components.n0)
    assert upper.between > components.between and upper.within == components.within
    assert stats.plan(upper, 0.05)[2] >= stats.plan(components, 0.05)[2]


def test_the_bootstrap_resamples_clusters_and_questions() -> None:
    rng = np.random.default_rng(1)
    same = [rng.normal(0.1, 0.3, size=(3, 200)) for _ in range(6)]  # clusters alike: a narrow interval
    spread = [rng.normal(0.1 + 0.2 * (i - 2.5), 0.3, size=(3, 200)) for i in range(6)]  # clusters differ
    mean, low, high = stats.bootstrap_clusters_items(same)
    assert low < mean < high and low > 0
    _, wide_low, wide_high = stats.bootstrap_clusters_items(spread)
    assert wide_high - wide_low > 3 * (high - low)
    with pytest.raises(ValueError, match="same questions"):
        stats.bootstrap_clusters_items([np.zeros((2, 5)), np.zeros((2, 6))])


def test_the_plan_command_reads_a_pilot_and_writes_its_plan(tmp_path: Path) -> None:
    write_study(tmp_path / "pilot", DECLARED, HETEROGENEOUS)
    text = plan_cli.main(
        [str(tmp_path / "pilot"), "--mde", "5", "--metric", "test_final", "--out", str(tmp_path / "plan")]
    )
    assert "alpha 0.05 / 2 comparisons = 0.0250" in text
    assert "## grpo_vs_control" in text and "## rft_vs_control" in text
    assert "Pilot: 9 pairs in 3 clusters; mean difference +9.00; between-cluster sd 7.99 (80% upper bound " in text

    assert (tmp_path / "plan" / "plan.md").read_text().startswith("# Study plan from a pilot")


def test_the_plan_takes_the_family_a_preset_declares(tmp_path: Path) -> None:
    """A pilot that declared nothing, planned for experiment=learn-pool-gpu-v2's three comparisons (alpha / 3)."""
    num = 0
    for warm in range(3):
        for i in range(2):
            seed = 2 * warm + i
            for arm, gain in (("sft_ceiling", 0.0), ("grpo", 0.05 + 0.01 * warm + 0.005 * i), ("rft", 0.02 * i)):
                write_arm(tmp_path / "pilot" / str(num), arm, seed, 0.3 + gain, warm_seed=warm)
                num += 1
            write_arm(tmp_path / "pilot" / str(num), "sft_continue", seed, 0.25 + 0.01 * i, warm_seed=warm)
            num += 1
    text = plan_cli.main([str(tmp_path / "pilot"), "--mde", "5", "--experiment", "learn-pool-gpu-v2"])
    assert "the comparisons experiment=learn-pool-gpu-v2 declares" in text and "0.05 / 3 comparisons" in text
    for name in ("grpo_vs_gold_sft", "grpo_vs_rft", "grpo_vs_no_new_data"):
        assert f"## {name}\n\nPilot: 6 pairs in 3 clusters" in text


def test_a_given_comparison_stands_in_for_each_of_a_preset_s_family(tmp_path: Path) -> None:
    """A pilot without the preset's cells: a comparison it has stands in for each of the three the preset declares,
    planned at alpha / 3, not / 1."""
    num = 0
    for warm in range(3):
        for i in range(2):
            for arm, gain in (("grpo", 0.0), ("rft", 0.02 * i + 0.01 * warm)):
                write_arm(tmp_path / "pilot" / str(num), arm, 2 * warm + i, 0.3 + gain, warm_seed=warm)
                num += 1
    args = ["--mde", "5", "--experiment", "learn-pool-gpu-ablations", "--treatment", "algorithm=rft"]
    text = plan_cli.main([str(tmp_path / "pilot"), *args, "--baseline", "algorithm=grpo"])
    assert "0.05 / 3 comparisons = 0.0167" in text and "stands in for each of them" in text
    assert "## given\n\nPilot: 6 pairs in 3 clusters" in text


ABLATION_CELLS = {  # experiment=learn-pool-gpu-ablations' four cells, each with its value of every factor
    "baseline": ("true", 3, 512),
    "nocheck": ("false", 3, 512),
    "oneturn": ("true", 1, 512),
    "short": ("true", 3, 256),
}


def write_ablation_pilot(root: Path, interrupted: Collection[str], second_seed: Collection[str] = ()) -> None:
    """Three warm starts x 2 seeds of each cell; the runs of the cells in `interrupted` stopped before the end (as a
    cell that needs more than a call's time does), or only each warm start's second seed of those in
    `second_seed`. An interrupted run keeps the validation scores it had."""
    num = 0
    for warm in range(3):
        for i in range(2):
            for cell, (check, turns, length) in ABLATION_CELLS.items():
                extra = [f"agent.check_step={check}", f"agent.max_turns={turns}"]
                extra += [f"algorithm.max_response_length={length}"]
                gain = 0.01 * warm + 0.02 * i * (cell != "baseline")
                write_arm(root / str(num), "grpo", 2 * warm + i, 0.3 + gain, warm_seed=warm, extra=extra)
                if cell in interrupted or (i == 1 and cell in second_seed):
                    summary = json.loads((root / str(num) / "summary.json").read_text())
                    (root / str(num) / "summary.json").write_text(json.dumps(summary | {"status": "interrupted"}))
                num += 1


def test_a_comparison_the_pilot_cannot_pair_is_named_and_the_others_are_planned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pilot's no-check-step runs were all interrupted: the plan says that comparison is not planned and why
    (each side's runs by status), and plans the two others at the family's alpha / 3; a pilot where no comparison
    pairs is an error."""
    write_ablation_pilot(tmp_path / "pilot", interrupted={"nocheck"})
    text = plan_cli.main([str(tmp_path / "pilot"), "--mde", "5", "--experiment", "learn-pool-gpu-ablations"])
    assert "0.05 / 3 comparisons = 0.0167" in text
    assert (
        "## no_check_step\n\nNot planned from this pilot: fewer than 2 seeds and warm starts have completed runs "
        "with val_final on both sides (the pilot's baseline runs: 6 completed; treatment runs: 6 interrupted; where "
        "both sides completed, do they start from one warm start?)."
    ) in text
    for name in ("one_turn", "short_context"):
        assert f"## {name}\n\nPilot: 6 pairs in 3 clusters" in text

    # one seed of each warm start left: 3 pairs, none of them a second seed of its warm start
    write_ablation_pilot(tmp_path / "one-seed", interrupted=set(), second_seed={"oneturn"})
    text = plan_cli.main([str(tmp_path / "one-seed"), "--mde", "5", "--experiment", "learn-pool-gpu-ablations"])
    assert (
        "## one_turn\n\nNot planned from this pilot: its 3 completed pairs in 3 warm starts cannot separate warm "
        "starts from seeds"
    ) in text
    for name in ("no_check_step", "short_context"):
        assert f"## {name}\n\nPilot: 6 pairs in 3 clusters" in text

    write_ablation_pilot(tmp_path / "none", interrupted={"nocheck", "oneturn", "short"})
    with pytest.raises(SystemExit):
        plan_cli.main([str(tmp_path / "none"), "--mde", "5", "--experiment", "learn-pool-gpu-ablations"])
    assert "no comparison has 2 completed pairs in the pilot" in capsys.readouterr().err


def test_a_side_that_matches_more_than_one_cell_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--baseline agent.check_step=true` over an ablation pilot matches the baseline, one-turn and short cells: the
    plan says the side holds more than one run of a seed and warm start, not only that runs do not pair."""
    num = 0
    cells = (["agent.check_step=true"], ["agent.check_step=false"], ["agent.check_step=true", "agent.max_turns=1"])
    for warm in range(3):
        for i in range(2):
            for cell in cells:
                write_arm(tmp_path / "pilot" / str(num), "grpo", 2 * warm + i, 0.3, warm_seed=warm, extra=cell)
                num += 1
    args = ["--mde", "5", "--treatment", "agent.check_step=false", "--baseline", "agent.check_step=true"]
    with pytest.raises(SystemExit):
        plan_cli.main([str(tmp_path / "pilot"), *args])
    assert "its baseline side holds more than one run of a seed and warm start" in capsys.readouterr().err

"""Splits that do not bias a comparison: shuffled with a seed, stratified by kind, recorded; no held-out text leaks."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from backends.sft import SFTWarmstart
from data import dbbench, med_qa, spider_mini
from data.dbbench import DBBenchData
from data.med_qa import MedQAData
from data.spider import SpiderData
from data.splits import KIND, held_out_text_in, kind_distance, sql_skeleton, stratified_split, training_corpus
from foundation.errors import ConfigError
from tests.conftest import FAST_RUN, launch

SMALL_DISTANCE = 0.1  # total variation between the phases' kind mixes a split may leave (a random one: ~0.18 here)


@pytest.fixture(scope="module")
def mini(tmp_path_factory: pytest.TempPathFactory) -> SpiderData:
    """spider_mini at the size experiments use (train capped at ~1,055 by the pools; its file order is biased)."""
    root = tmp_path_factory.mktemp("splits") / "spider_mini"
    spider_mini.generate(root, seed=0, n_train=2000, n_dev=200, n_test=200)
    return SpiderData(
        name="spider_mini",
        spider_dir=str(root),
        val_split="dev",
        test_split="test",
        val_from_train=None,
        val_limit=None,
        generate=None,
        val_subset_field="held_out",
    )


def test_the_skeleton_of_a_query_drops_its_literals() -> None:
    assert sql_skeleton("SELECT COUNT(*) FROM t WHERE a BETWEEN 3 AND 9.5;") == (
        "select count(*) from t where a between 0 and 0"
    )
    assert sql_skeleton("SELECT name FROM t WHERE x = 'It''s'") == sql_skeleton('select name from t where x = "b"')
    assert sql_skeleton("SELECT t1.c2 FROM t1") == "select t1.c2 from t1"  # digits inside names stay


def test_a_stratified_split_shares_every_kind_and_follows_its_seed() -> None:
    items = [{"id": i, KIND: f"k{i % 7}" if i < 90 else f"rare{i}"} for i in range(100)]
    chosen, rest = stratified_split(items, 0.3, seed=0, salt="x")
    assert len(chosen) in (30, 31) and sorted(x["id"] for x in chosen + rest) == list(range(100))
    counts, totals = Counter(x[KIND] for x in chosen), Counter(x[KIND] for x in items)
    assert all(abs(counts[k] - 0.3 * n) < 1 for k, n in totals.items())  # every kind: floor or ceil of its share
    assert [x["id"] for x in chosen] == sorted(x["id"] for x in chosen)  # in the items' own order
    assert stratified_split(items, 0.3, seed=0, salt="x") == (chosen, rest)
    assert stratified_split(items, 0.3, seed=1, salt="x")[0] != chosen
    assert stratified_split(items, 0.3, seed=0, salt="y")[0] != chosen


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_the_warm_start_split_is_not_file_order_and_keeps_the_kind_mix(mini: SpiderData, share: float) -> None:
    tasks = mini.train_tasks()
    warm, rl = SFTWarmstart(task_share=share).split(tasks, seed=0)
    cut = round(share * len(tasks))
    assert abs(len(warm) - cut) <= 1 and len(warm) + len(rl) == len(tasks)
    assert {t["id"] for t in warm}.isdisjoint(t["id"] for t in rl)
    assert [t["id"] for t in warm] != [t["id"] for t in tasks[: len(warm)]]
    assert kind_distance(warm, rl) < SMALL_DISTANCE
    # what the check stands against: the file order's split, which gave GRPO 22 of the 86 SQL shapes
    assert kind_distance(tasks[:cut], tasks[cut:]) > 4 * SMALL_DISTANCE
    sizes = Counter(t[KIND] for t in tasks)  # a kind with 1/share tasks or more is in the warm start, and so on
    assert {t[KIND] for t in warm} >= {k for k, n in sizes.items() if n * share >= 1}
    assert {t[KIND] for t in rl} >= {k for k, n in sizes.items() if n * (1 - share) >= 1}
    assert SFTWarmstart(task_share=share).split(tasks, seed=1)[0] != warm


def test_rl_tasks_holds_about_that_many_tasks_out_of_the_warm_start_stratified(mini: SpiderData) -> None:
    """model=tiny's split: GRPO on 16 tasks, the warm start on the others, drawn across kinds (not the file's first or
    last 16); a share below 1 decides over the count; a count of every task is refused."""
    tasks = mini.train_tasks()
    warm, rl = SFTWarmstart(rl_tasks=16).split(tasks, seed=0)
    assert abs(len(rl) - 16) <= 1 and len(warm) + len(rl) == len(tasks)
    assert {t["id"] for t in warm}.isdisjoint(t["id"] for t in rl)
    assert len({t[KIND] for t in rl}) >= len(rl) // 2  # spread over kinds, as the file's first 16 are not
    assert [t["id"] for t in rl] not in ([t["id"] for t in tasks[: len(rl)]], [t["id"] for t in tasks[-len(rl) :]])
    assert SFTWarmstart(rl_tasks=16, task_share=0.5).split(tasks, seed=0) == SFTWarmstart(task_share=0.5).split(
        tasks, seed=0
    )
    with pytest.raises(ConfigError, match="leaves the warm start none"):
        SFTWarmstart(rl_tasks=len(tasks)).split(tasks, seed=0)


def test_dev_and_test_are_disjoint_and_ask_the_same_mix(mini: SpiderData) -> None:
    val, test, train = mini.val_tasks(), mini.test_tasks(), mini.train_tasks()
    assert len(val) and len(test) and abs(len(val) - len(test)) <= 1
    questions = [{t["question"] for t in split} for split in (train, val, test)]
    assert not (questions[0] & questions[1] or questions[0] & questions[2] or questions[1] & questions[2])
    subsets = [Counter(t["subset"] for t in split) for split in (val, test)]
    assert all(abs(subsets[0][k] - subsets[1][k]) <= 2 for k in subsets[0] | subsets[1])
    assert kind_distance(val, test) < 2 * SMALL_DISTANCE  # held-out kinds are few a kind: one more here or there


def test_real_spider_carves_validation_from_train_and_tests_on_dev(tmp_path: Path) -> None:
    root = tmp_path / "spider"
    spider_mini.generate(root, seed=0, n_train=300, n_dev=20, n_test=0)  # Spider's layout: train + dev, no test
    (root / "test.json").unlink()
    data = SpiderData(
        name="spider",
        spider_dir=str(root),
        val_split=None,
        val_from_train=0.1,
        test_split="dev",
        val_limit=None,
        generate=None,
        val_subset_field=None,
    )
    train, val, test = data.train_tasks(), data.val_tasks(), data.test_tasks()
    everything = json.loads((root / "train_spider.json").read_text())
    assert len(train) + len(val) == len(everything) and abs(len(val) - 0.1 * len(everything)) <= 1
    assert {t["id"] for t in train}.isdisjoint(t["id"] for t in val)
    assert [t["question"] for t in test] == [r["question"] for r in json.loads((root / "dev.json").read_text())]
    with pytest.raises(Exception, match=r"val_split and data\.val_from_train"):
        SpiderData(
            name="spider",
            spider_dir=str(root),
            val_split="dev",
            val_from_train=0.1,
            test_split=None,
            val_limit=None,
            generate=None,
            val_subset_field=None,
        )


def test_med_qa_and_dbbench_split_in_their_kinds_proportions(tmp_path: Path) -> None:
    med = MedQAData(name="med_qa", data_dir=str(med_qa.generate(tmp_path / "med")), generate=None)
    train, val, test = med.train_tasks(), med.val_tasks(), med.test_tasks()
    assert (len(train), len(val), len(test)) == (320, 60, 60)
    questions = [{t["question"] for t in split} for split in (train, val, test)]
    assert not (questions[0] & questions[1] or questions[0] & questions[2] or questions[1] & questions[2])
    assert kind_distance(val, test) < 0.25 and kind_distance(train, val) < 0.25  # 24 kinds over 60 questions
    assert all(KIND in t for t in train + val + test)

    generated = str(dbbench.generate(tmp_path / "db", n=140))
    bench = DBBenchData(name="dbbench", data_dir=generated, generate=None, val_size=21, test_size=21)
    train, val, test = bench.train_tasks(), bench.val_tasks(), bench.test_tasks()
    assert (len(train), len(val), len(test)) == (98, 21, 21)
    assert {t["id"] for t in val}.isdisjoint(t["id"] for t in test)
    skills = Counter(t[KIND].split("|")[0] for t in train + val + test)  # 6 skill lists, one twice as common
    for split in (val, test):
        counts = Counter(t[KIND].split("|")[0] for t in split)
        assert all(abs(counts[k] - n * 21 / 140) <= 1.5 for k, n in skills.items())


def test_held_out_text_reaching_the_training_corpus_stops_the_run(mini: SpiderData) -> None:
    train, held_out = mini.train_tasks(), mini.val_tasks() + mini.test_tasks()
    corpus = training_corpus([], train, held_out, train)
    assert not held_out_text_in(corpus, held_out, train)
    with pytest.raises(RuntimeError, match="validation/test questions are in the training corpus"):
        training_corpus([], [*train, held_out[0]], held_out, train)


@pytest.mark.integration
def test_a_run_records_its_phases_task_ids_and_scores_the_test_split_at_the_end(
    cache_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    result = launch([*FAST_RUN, "warmstart.task_share=0.5", f"hydra.run.dir={run_dir}"], cache_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    splits = json.loads((run_dir / "splits.json").read_text())
    phases: dict[str, Any] = splits["phases"]
    data = json.loads((run_dir / "summary.json").read_text())
    assert len(phases["warmstart"]) == data["warmstart_tasks"] and len(phases["rl"]) == data["train_tasks"]
    assert set(phases["warmstart"]).isdisjoint(phases["rl"]) and len(phases["warmstart"]) == 60
    assert phases["warmstart"] != [f"train-{i}" for i in range(60)]  # not the file's first half
    assert len(phases["val"]) == data["val_final"]["n"] == 8 and len(phases["test"]) == data["test_final"]["n"] == 8
    assert splits["split_seed"] == 0 and splits["kind_distance_warmstart_rl"] is not None
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["test/n"] == 8 and "test/accuracy" in last  # the final model only
    earlier = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][:-1]
    assert not any(k.startswith("test/") for m in earlier for k in m)
    # every evaluation keeps each question's score: the final model's test and validation, the first validation
    for name, split in (("test_final", "test"), ("val_final", "val"), ("val_after_sft", "val")):
        scores = json.loads((run_dir / "scores" / f"{name}.json").read_text())
        assert sorted(scores) == sorted(phases[split]) and all(v in (0.0, 1.0) for v in scores.values())
    test_scores = json.loads((run_dir / "scores" / "test_final.json").read_text()).values()
    assert sum(test_scores) / len(test_scores) == pytest.approx(last["test/accuracy"])

    # the control continues on the warm start's own demonstrations (sft_demos=warmstart), not on the RL tasks' gold
    control_dir = tmp_path / "control"
    args = [*FAST_RUN, "warmstart.task_share=0.5", "algorithm=sft_control", "algorithm.sft_demos=warmstart"]
    args += ["algorithm.max_prompt_length=512", f"hydra.run.dir={control_dir}"]
    control = launch(args, cache_dir, tmp_path)
    assert control.returncode == 0, control.stderr[-3000:]
    demos = json.loads((control_dir / "summary.json").read_text())["sft_control_demos"]
    assert demos == {"tasks": "warmstart", "demonstrations": data["sft"]["demonstrations"]}
    assert json.loads((control_dir / "splits.json").read_text())["phases"] == phases  # the same split, recorded


def test_a_warm_start_on_tasks_without_sql_fields_shows_plain_demonstrations() -> None:
    """Rewrite demonstrations borrow another task's gold query on the same database: a data set whose tasks carry no
    `db_id` / `query` gets plain ones (no wrong first query), never a KeyError at run time; SQL tasks still get them."""
    asked: list[tuple[str, str | None]] = []

    class Agent:
        def oracle(self, task: dict[str, Any], wrong: str | None = None) -> list[Any]:
            asked.append((task["id"], wrong))
            return []

        async def run(self, task: dict[str, Any], chat: Any) -> Any:
            return type("Trajectory", (), {"error": "scripted only"})()

    warm = SFTWarmstart(rewrite_demo_fraction=1.0)
    assert warm.demonstrations(Agent(), [{"id": "a", "question": "?"}, {"id": "b", "question": "?"}], 0) == []
    assert asked == [("a", None), ("b", None)]
    asked.clear()
    sql = [{"id": i, "db_id": "d", "query": f"SELECT {i}"} for i in ("a", "b")]
    warm.demonstrations(Agent(), sql, 0)
    assert asked == [("a", "SELECT b"), ("b", "SELECT a")]

"""The reward-model pipeline: preference data, a tiny reward model trained on CPU, served on loopback, merged."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from agent.trajectory import Trajectory
from data.preferences import PreferenceError, convert, sql_pairs
from experiments.reward_model import load_reward_model
from rewards.reward_model import RewardModelReward, Scorer, create_app
from tests.conftest import FAST_RUN, closed_port, launch, serve

TRAIN = ["job=reward_model_train", *FAST_RUN, "job.steps=150", "job.eval_pairs=60"]


def test_convert_accepts_aliases_and_lists_every_bad_record() -> None:
    good = {"question": "q", "response_chosen": "a", "response_rejected": "b"}
    assert convert([good]) == [{"prompt": "q", "chosen": "a", "rejected": "b"}]
    with pytest.raises(PreferenceError) as error:
        convert([good, {"prompt": "q", "chosen": "a"}, {"prompt": "q", "chosen": "a", "rejected": " a "}, "text"])
    message = str(error.value)
    assert "3 invalid" in message and "record 2: 'rejected'" in message and "record 3" in message
    assert "record 4: not a JSON object" in message


def test_sql_pairs_prefer_gold_over_a_query_with_another_result(spider_mini_dir: Path) -> None:
    pairs = sql_pairs(spider_mini_dir, limit=20)
    assert len(pairs) == 20 and all(p["chosen"] != p["rejected"] for p in pairs)


@pytest.fixture(scope="module")
def trained(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("rm")
    result = launch([*TRAIN, f"hydra.run.dir={out / 'run'}"], cache_dir, out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "run", json.loads((out / "run" / "summary.json").read_text())


@pytest.mark.integration
def test_training_learns_to_prefer_correct_sql(trained: tuple[Path, dict]) -> None:
    _, summary = trained
    assert summary["status"] == "completed" and summary["steps"] == 150
    assert summary["pairwise_accuracy_held_in"] >= 0.8


@pytest.mark.integration
def test_served_model_scores_correct_above_incorrect(trained: tuple[Path, dict], spider_mini_dir: Path) -> None:
    run, _ = trained
    model, tokenizer = load_reward_model(run / "checkpoints" / "final")
    pairs = [p | {"prompt": p["prompt"] + "\n"} for p in sql_pairs(spider_mini_dir, limit=40)]
    with serve(create_app(Scorer(model, tokenizer, max_length=512))) as url:
        base = url.removesuffix("/v1")
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        replies = [httpx.post(f"{base}/score-pair", json=p).json() for p in pairs]
        assert sum(r["preferred"] == "chosen" for r in replies) / len(replies) >= 0.8
        one = httpx.post(f"{base}/score", json={"prompt": pairs[0]["prompt"], "response": pairs[0]["chosen"]})
        assert one.json()["score"] == pytest.approx(replies[0]["chosen_score"], abs=1e-4)
        texts = [pairs[0]["prompt"] + pairs[0]["chosen"], pairs[0]["prompt"] + pairs[0]["rejected"]]
        assert len(httpx.post(f"{base}/get_reward", json={"query": texts}).json()["rewards"]) == 2

        # Malformed and oversized input: 422 with a reason.
        missing = httpx.post(f"{base}/score", json={"prompt": "q"})
        assert missing.status_code == 422 and "response" in missing.text
        huge = httpx.post(f"{base}/score", json={"prompt": "q", "response": "x" * 200_000})
        assert huge.status_code == 422
        assert httpx.post(f"{base}/get_reward", json={"query": []}).status_code == 422

        # Concurrent clients: every one answered, the same scores as one at a time.
        def ask(p: dict) -> float:
            return httpx.post(f"{base}/score", json={"prompt": p["prompt"], "response": p["chosen"]}).json()["score"]

        with ThreadPoolExecutor(16) as pool:
            concurrent = list(pool.map(ask, pairs))
        assert concurrent == pytest.approx([r["chosen_score"] for r in replies], abs=1e-4)

        reward = RewardModelReward(base_url=base)
        task = {"question": pairs[0]["prompt"].strip()}
        assert reward(task, Trajectory(final_sql=pairs[0]["chosen"])) == pytest.approx(
            replies[0]["chosen_score"], abs=1e-4
        )
    assert RewardModelReward(base_url=f"http://127.0.0.1:{closed_port()}")(task, Trajectory(final_sql="x")) is None


@pytest.mark.integration
def test_lora_reward_model_merges_into_a_standalone_model(cache_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "lora"
    args = [*TRAIN, "job.steps=5", "finetune=lora", "finetune.rank=8", f"hydra.run.dir={run}"]
    assert launch(args, cache_dir, tmp_path).returncode == 0
    merged = tmp_path / "merged"
    result = launch(
        ["job=merge_lora", f"job.adapter_path={run / 'checkpoints' / 'final'}", f"job.output_path={merged}"],
        cache_dir,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (merged / "config.json").is_file() and not (merged / "adapter_config.json").exists()
    texts = ["How many students are there?\nSELECT COUNT(*) FROM students"]
    adapter_scores = Scorer(*load_reward_model(run / "checkpoints" / "final"), max_length=512).score_texts(texts)
    merged_scores = Scorer(*load_reward_model(merged), max_length=512).score_texts(texts)
    assert merged_scores == pytest.approx(adapter_scores, abs=1e-4)

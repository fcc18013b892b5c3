"""The reward-model pipeline: preference data, a tiny reward model trained on CPU, served on loopback, merged."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import transformers

from agent.trajectory import Trajectory
from data.preferences import PreferenceError, convert, sql_pairs
from jobs.reward_model import load_reward_model
from models.tiny import train_tokenizer
from rewards.reward_model import RewardModelReward, Scorer, create_app
from tests.conftest import FAST_RUN, closed_port, launch, serve

pytestmark = pytest.mark.xdist_group("reward_model")  # one xdist worker: the trained model is a module fixture

TRAIN = ["job=reward_model_train", *FAST_RUN, "job.steps=60", "job.eval_pairs=60"]


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
    assert summary["status"] == "completed" and summary["steps"] == 60
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


class FlakyScorer(Scorer):
    """A scorer that fails on a marker text, as a tokenizer or model might on an input no validation foresaw."""

    failed_batch_sizes: list[int]

    def score_texts(self, texts: list[str]) -> list[float]:
        if any("POISON" in t for t in texts):
            self.failed_batch_sizes.append(len(texts))
            raise RuntimeError("this item cannot be scored")
        return super().score_texts(texts)


@pytest.fixture(scope="module")
def untrained_scorer() -> FlakyScorer:
    tokenizer = train_tokenizer(["select name from people where age > 30", "what is the answer"], 300)
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    scorer = FlakyScorer(model, tokenizer, max_length=64)
    scorer.failed_batch_sizes = []
    return scorer


BAD_BODIES = {
    "nan_literal": ("/score", '{"prompt": NaN, "response": "x"}'),
    "infinity_literal": ("/score", '{"prompt": "q", "response": Infinity}'),
    "lone_high_surrogate": ("/score", '{"prompt": "q", "response": "a\\ud800b"}'),
    "lone_low_surrogate_in_list": ("/get_reward", '{"query": ["fine", "\\udfff"]}'),
    "surrogate_in_pair": ("/score-pair", '{"prompt": "q", "chosen": "a", "rejected": "\\ud83d"}'),
    "number_for_text": ("/score", '{"prompt": 1, "response": "x"}'),
    "null_for_text": ("/score", '{"prompt": null, "response": "x"}'),
    "object_for_text": ("/score", '{"prompt": {"a": 1}, "response": "x"}'),
    "missing_field": ("/score", '{"prompt": "q"}'),
    "not_json": ("/score", "prompt=q&response=x"),
    "truncated_json": ("/score", '{"prompt": "q", "resp'),
    "array_body": ("/score", '["q", "x"]'),
    "empty_body": ("/score", ""),
    "empty_query_list": ("/get_reward", '{"query": []}'),
    "query_not_a_list": ("/get_reward", '{"query": "text"}'),
    "too_many_queries": ("/get_reward", json.dumps({"query": ["x"] * 1025})),
    "oversized_text": ("/score", json.dumps({"prompt": "q", "response": "x" * 200_000})),
    "oversized_query": ("/get_reward", json.dumps({"query": ["x" * 200_000]})),
}


def test_every_bad_input_is_a_4xx_with_a_reason_and_poisons_nothing(untrained_scorer: FlakyScorer) -> None:
    with serve(create_app(untrained_scorer, batch_wait_s=0.05)) as url:
        base = url.removesuffix("/v1")
        good = {"prompt": "what is the answer\n", "response": "select name from people"}
        expected = httpx.post(f"{base}/score", json=good).json()["score"]
        for name, (path, body) in BAD_BODIES.items():
            reply = httpx.post(f"{base}{path}", content=body, headers={"content-type": "application/json"})
            assert 400 <= reply.status_code < 500, (name, reply.status_code, reply.text[:300])
            assert reply.json()["detail"], name
        assert httpx.get(f"{base}/score").status_code == 405
        as_json = {"content-type": "application/json"}
        surrogate = httpx.post(f"{base}/score", content=BAD_BODIES["lone_high_surrogate"][1], headers=as_json)
        surrogate = surrogate.json()["detail"][0]
        assert surrogate["loc"] == ["body", "response"] and "unicode" in surrogate["msg"]

        # Good and bad requests at once: only the bad ones fail, also when one slips past validation into a batch.
        def ask(i: int) -> httpx.Response:
            if i % 10 == 3:
                return httpx.post(f"{base}/score", content=BAD_BODIES["lone_high_surrogate"][1], headers=as_json)
            if i % 10 == 7:
                return httpx.post(f"{base}/score", json={"prompt": "q", "response": "POISON"})
            return httpx.post(f"{base}/score", json=good)

        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(ask, range(60)))
        for i, reply in enumerate(replies):
            if i % 10 == 3:
                assert reply.status_code == 422
            elif i % 10 == 7:
                assert reply.status_code == 500
            else:
                assert reply.status_code == 200 and reply.json()["score"] == pytest.approx(expected, abs=1e-5)
        assert max(untrained_scorer.failed_batch_sizes) > 1, "no poisoned item was ever batched with others"

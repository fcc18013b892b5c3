"""Our agents in verl 0.9's agent loop (`backends/verl/loop.py`), through verl's own AgentLoopWorker code (its
rollout, padding and batch building) with a scripted stand-in for verl's LLM server client:

- the same agent and scripted replies give backend=trl's sample and verl's batch row token for token: prompt ids,
  response ids, response mask, the sampler's log-probs and the reward;
- a rollout whose agent fails and one whose reward fails reach verl's batch with no token in the loss, and the
  advantage estimator `grpo_fail_closed` leaves them out of their group's baseline (verl's `grpo` counts them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop import agent_loop as verl_loop
from verl.trainer.ppo import rollout_corr_helper
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_adv_estimator_fn
from verl.trainer.ppo.metric_utils import process_validation_metrics
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.reward import extract_reward
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from backends.samples import sample_of
from backends.trl.rollouts import rollouts_on_server
from backends.verl import runner
from backends.verl.loop import FAIL_CLOSED_GRPO, ITEM_ID, ITEM_SCORE, LOOP_NAME, loop_config, task_row
from backends.verl.runner import step_metrics
from backends.verl.train import copy_item_scores
from foundation.run_dir import RunDir
from inference.policy_server import PolicyServer, eos_ids_of
from models.chat import ChatFormat
from tests.conftest import ROOT, micro_tiny
from tests.test_rollouts import REWARDS
from tests.test_token_exact import TEMPLATE_IDS, TEMPLATES, THOUGHT, ScriptedEngine, tiny_with

PROMPT_LENGTH, RESPONSE_LENGTH = 2048, 2048


WEIGHTS_STEP = 3  # the global step of the weights the scripted servers answer with


class ScriptedServers:
    """verl's LLM server client (`generate(request_id, prompt_ids=, sampling_params=)` -> TokenOutput), answering
    from a ScriptedEngine (as verl's client, tagged with the weights' step); keeps every request. The calls numbered
    in `aborted` come back as verl's aborted requests."""

    def __init__(self, engine: ScriptedEngine, aborted: tuple[int, ...] = ()) -> None:
        self.engine = engine
        self.aborted = aborted
        self.requests: list[dict[str, Any]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> Any:
        self.requests.append({"request_id": request_id, "prompt_ids": prompt_ids, **sampling_params})
        tags = {"global_steps": WEIGHTS_STEP, "min_global_steps": WEIGHTS_STEP, "max_global_steps": WEIGHTS_STEP}
        if len(self.requests) - 1 in self.aborted:
            return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted", extra_fields=tags)
        [completion] = self.engine.generate(None, [prompt_ids], [sampling_params["max_tokens"]])
        return TokenOutput(
            token_ids=completion.token_ids, log_probs=completion.logprobs, stop_reason="completed", extra_fields=tags
        )


def verl_worker(tokenizer: Any, entry: dict[str, Any], servers: Any) -> verl_loop.AgentLoopWorker:
    """verl's AgentLoopWorker with what its rollout and batch code read (its __init__ wants Ray and a model path)."""
    config = OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": {"prompt_length": PROMPT_LENGTH, "response_length": RESPONSE_LENGTH}},
            "data": {},
        }
    )
    worker = verl_loop.AgentLoopWorker.__new__(verl_loop.AgentLoopWorker)
    worker.config, worker.rollout_config, worker.llm_client = config, config.actor_rollout_ref.rollout, servers
    worker.tokenizer, worker.processor, worker.hf_model_type, worker.mm_processor_kwargs = tokenizer, None, None, {}
    worker.dataset_cls, worker.tools, worker.reward_loop_worker_handles = RLHFDataset, [], None
    worker.distillation_enabled = False
    verl_loop._agent_loop_registry[LOOP_NAME] = entry  # what agent_loop_config_path would register
    return worker


def run_in_verl(worker: Any, tasks: list[dict[str, Any]], uids: list[str], temperature: float = 1.0) -> Any:
    """One rollout per task through verl's `_run_agent_loop`, the batch through its `_postprocess` (a DataProto)."""
    sampling = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}

    async def go() -> list[Any]:
        outputs = []
        for i, task in enumerate(tasks):  # one at a time: the scripted replies are in order
            row = task_row(task, "test", i)
            row["raw_prompt"] = row.pop("prompt")
            trajectory = {"step": 0, "sample_index": i, "rollout_n": 0, "validate": False}
            outputs.append(await worker._run_agent_loop(sampling, trajectory, trace=False, **row))
        return outputs

    outputs = asyncio.run(go())
    return worker._postprocess(outputs, input_non_tensor_batch={"uid": np.array(uids, dtype=object)})


def row_of(batch: Any, i: int) -> dict[str, Any]:
    """Row i of verl's batch without its padding: prompt, response, mask, log-probs, reward."""
    prompt_attention = batch.batch["attention_mask"][i, :PROMPT_LENGTH].bool()
    response_attention = batch.batch["attention_mask"][i, PROMPT_LENGTH:].bool()
    return {
        "prompt_ids": batch.batch["prompts"][i][prompt_attention].tolist(),
        "response_ids": batch.batch["responses"][i][response_attention].tolist(),
        "response_mask": batch.batch["response_mask"][i][response_attention].tolist(),
        "logprobs": batch.batch["rollout_log_probs"][i][response_attention].tolist(),
        "reward": float(batch.batch["rm_scores"][i].sum()),
    }


def composed(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize("template", [TEMPLATES[1], TEMPLATES[3]], ids=[TEMPLATE_IDS[1], TEMPLATE_IDS[3]])
def test_a_rollout_in_verls_agent_loop_is_the_sample_backend_trl_trains(
    template: tuple[str, bool | None, str], spider_mini_dir: Path, tmp_path: Path
) -> None:
    """The Spider agent with its check step (thinking blocks, a rewrite), scripted: trl's sample == verl's row."""
    from jobs.config import build_components

    overrides = ["agent=spider_sql", f"data.spider_dir={spider_mini_dir}", "data.generate=null"]
    cfg = composed([*overrides, "agent.check_step=true", "agent.max_turns=2"])
    built = build_components(cfg)
    task = built["data"].val_tasks()[0]
    texts = [
        f"{THOUGHT}```sql\nSELECT name FROM people\n```",
        "THE QUERY IS INCORRECT",
        f"{THOUGHT}```sql\n{task['query']}\n```",
        "THE QUERY IS CORRECT",
    ]
    name, thinking, tool_format = template
    model, tokenizer = tiny_with(name, tmp_path, [*texts, task["question"]] * 3)
    chat_kwargs = {} if thinking is None else {"enable_thinking": thinking}

    # backend=trl: the policy server with the scripted engine, the rollout function's loop and sample
    trl_engine = ScriptedEngine(tokenizer, texts)
    server = PolicyServer(
        model,
        tokenizer,
        max_prompt_tokens=PROMPT_LENGTH,
        max_response_tokens=RESPONSE_LENGTH,
        engine=trl_engine,
        chat_format=ChatFormat(tokenizer, tool_format, chat_kwargs),
    )
    sampling = {"temperature": 1.0}
    [rollout], [calls] = asyncio.run(
        rollouts_on_server(built["agent"], [task], server, sampling, built["reward"], lambda n: ["r0"])
    )
    sample = sample_of(rollout, calls, RESPONSE_LENGTH, tokenizer.pad_token_id)
    assert sample.excluded is None and rollout.reward == 1.0 and len(calls) == 4

    # backend=verl: the same agent and reward, composed as the loop's YAML carries them, against verl's client
    spec = micro_tiny(tmp_path, context_length=4096, chat_template=name, tool_call_format=tool_format)
    model_cfg = {"_target_": "models.tiny.TinyModel", **dataclasses.asdict(spec)}
    eos = sorted(eos_ids_of(model.generation_config, tokenizer))
    [entry] = loop_config(
        OmegaConf.to_container(cfg.agent, resolve=True),
        OmegaConf.to_container(cfg.reward, resolve=True),
        model_cfg | ({} if thinking is None else {"enable_thinking": thinking}),
        max_prompt_tokens=PROMPT_LENGTH,
        max_response_tokens=RESPONSE_LENGTH,
        max_tokens_per_turn=None,
        reward_timeout_s=None,
        eos_ids=eos,
    )
    servers = ScriptedServers(ScriptedEngine(tokenizer, texts))
    batch = run_in_verl(verl_worker(tokenizer, entry, servers), [task], ["u0"])
    row = row_of(batch, 0)
    assert row["prompt_ids"] == sample.prompt_ids
    assert row["response_ids"] == sample.completion_ids
    assert row["response_mask"] == sample.env_mask
    assert row["logprobs"] == pytest.approx(sample.logprobs, abs=1e-6)  # float32 in verl's batch
    assert row["reward"] == rollout.reward
    assert batch.non_tensor_batch["excluded"].tolist() == [""]
    assert batch.non_tensor_batch["min_global_steps"].tolist() == [WEIGHTS_STEP]  # verl's staleness tags, as its loops
    # each call: the policy server's ids, under the rollout's one request id, with the sampler's log-probs asked for
    assert [r["prompt_ids"] for r in servers.requests] == [c.prompt_ids for c in calls]
    assert len({r["request_id"] for r in servers.requests}) == 1
    assert all(r["logprobs"] is True and r["stop_token_ids"] == eos for r in servers.requests)


class TwoTurns:
    """Asks twice in one conversation; raises in the task named "agent fails"."""

    async def run(self, task: dict[str, Any], llm: Any) -> Any:
        from agent.trajectory import Trajectory

        messages = [{"role": "user", "content": task["question"]}]
        first = await llm.chat(messages)
        if task["id"] == "agent fails":
            raise RuntimeError("the agent broke")
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Again."}]
        second = await llm.chat(messages)
        return Trajectory(messages=[*messages, {"role": "assistant", "content": second}], answer=task["id"], turns=2)


class ById:
    """The reward in REWARDS by task id; raises for "reward fails"."""

    name = "by_id"

    def __call__(self, task: dict[str, Any], trajectory: Any) -> float:
        if task["id"] == "reward fails":
            raise ValueError("the reward broke")
        return REWARDS[task["id"]]


def two_turn_batch(tmp_path: Path, ids: list[str], uids: list[str], aborted: tuple[int, ...] = ()) -> Any:
    """verl's batch of TwoTurns rollouts of the tasks `ids` (groups `uids`) rewarded ById by a micro tiny model's
    scripted replies; the calls numbered in `aborted` come back aborted."""
    corpus = ["How many people are there?", "Again.", "SELECT count(*) FROM people"] * 10
    spec = micro_tiny(tmp_path)
    source = spec.prepare(corpus)
    model, tokenizer = spec.load_model(source, "cpu"), spec.load_tokenizer(source)
    [entry] = loop_config(
        {"_target_": f"{__name__}.TwoTurns"},
        {"_target_": f"{__name__}.ById"},
        {"_target_": "models.tiny.TinyModel", **dataclasses.asdict(spec)},
        max_prompt_tokens=256,
        max_response_tokens=96,
        max_tokens_per_turn=8,
        reward_timeout_s=5.0,
        eos_ids=sorted(eos_ids_of(model.generation_config, tokenizer)),
    )
    replies = ["SELECT count(*) FROM people", "Again."] * len(ids)
    servers = ScriptedServers(ScriptedEngine(tokenizer, replies), aborted=aborted)
    return run_in_verl(verl_worker(tokenizer, entry, servers), [{"id": i, "question": "How many?"} for i in ids], uids)


def test_failed_rollouts_train_nothing_in_verls_batch_and_leave_their_groups_baseline(tmp_path: Path) -> None:
    # group A: two rollouts that train (rewards 1, 0), one whose agent fails, one whose reward fails; group B: two
    # that train and one whose first call verl aborted (the 12th call)
    ids = ["r0", "agent fails", "r1", "reward fails", "r3", "r4", "aborted"]
    uids = ["A", "A", "A", "A", "B", "B", "B"]
    batch = two_turn_batch(tmp_path, ids, uids, aborted=(11,))

    excluded = batch.non_tensor_batch["excluded"].tolist()
    assert excluded == ["", "agent_error", "", "reward_error", "", "", "agent_error"]
    mask = batch.batch["response_mask"]
    assert [bool(mask[i].sum() > 0) for i in range(len(ids))] == [reason == "" for reason in excluded]

    rewards = batch.batch["rm_scores"]
    estimate = get_adv_estimator_fn(FAIL_CLOSED_GRPO)
    config = OmegaConf.create({"norm_adv_by_std_in_grpo": True})
    advantages, _ = estimate(token_level_rewards=rewards, response_mask=mask, index=np.array(uids), config=config)
    # the trained rollouts' advantages are verl's GRPO over the trained rollouts alone; the excluded ones get 0
    kept = [i for i, reason in enumerate(excluded) if reason == ""]
    alone, _ = compute_grpo_outcome_advantage(rewards[kept], mask[kept], np.array(uids)[kept])
    assert torch.allclose(advantages[kept], alone)
    assert all(torch.all(advantages[i] == 0) for i, reason in enumerate(excluded) if reason)
    assert float(advantages[0][mask[0].bool()][0]) > 0 > float(advantages[2][mask[2].bool()][0])
    # verl's own grpo would have counted the excluded rollouts' 0 in group A's mean: other advantages
    counted, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(uids))
    assert not torch.allclose(counted[0], advantages[0])
    assert json.dumps(batch.non_tensor_batch["llm_calls"].tolist()) == "[2, 1, 2, 2, 2, 2, 0]"
    # the step's log (FailClosedTrainer): the excluded share by reason, means over the rollouts that train
    batch.batch["token_level_scores"] = rewards
    metrics = step_metrics(batch)
    assert metrics["rollout/excluded_rate"] == pytest.approx(3 / 7)
    assert metrics["rollout/excluded_agent_error_rate"] == 2 / 7
    assert metrics["rollout/excluded_reward_error_rate"] == 1 / 7
    assert metrics["train/reward_mean"] == pytest.approx(np.mean([REWARDS[i] for i in ("r0", "r1", "r3", "r4")]))
    assert metrics["rollout/llm_calls_mean"] == 2.0


def test_each_questions_validation_score_reaches_the_run_through_verls_own_dump(tmp_path: Path) -> None:
    """verl's validation as its `_validate` runs on our loop's batch: its metrics (they skip our string ids), its
    dump in `trainer.validation_data_dir` (verl's own writer), read back into the run's scores/ as backend=trl writes
    them: every question's score, None where its reward is missing."""
    ids = ["r0", "agent fails", "r1", "reward fails"]
    batch = two_turn_batch(tmp_path, ids, ["A", "A", "B", "B"])
    reward_tensor, extra = extract_reward(batch)
    scores = reward_tensor.sum(-1).tolist()
    infos = {"reward": list(scores)} | {k: v.tolist() for k, v in extra.items()}
    metrics = process_validation_metrics(["spider"] * len(ids), ids, infos)["spider"]
    assert ITEM_ID not in metrics and metrics[ITEM_SCORE]["mean@1"] == pytest.approx(0.5)  # over the scored ones
    dumps = tmp_path / "validation"
    for step, step_scores in ((0, scores), (5, [0.0] * len(ids))):
        RayPPOTrainer._write_generations(["q"] * 4, ["a"] * 4, [None] * 4, step_scores, infos, str(dumps), step)
    run = RunDir(tmp_path / "run")
    copy_item_scores(dumps, run)
    written = {f.stem: json.loads(f.read_text()) for f in run.scores.glob("*.json")}
    assert sorted(written) == ["val_final", "val_step0", "val_step5"]
    assert written["val_final"] == {"r0": 1.0, "agent fails": None, "r1": 0.0, "reward fails": None}
    assert written["val_step0"] == written["val_step5"] == written["val_final"]  # our scores, not verl's `score`


class NoUpdate:
    """verl's actor worker group, which a step where nothing trains must not reach."""

    def update_actor(self, batch: Any) -> Any:
        raise AssertionError("the actor was updated on a step where no rollout trains")


def test_a_step_where_every_rollout_is_excluded_updates_nothing_and_says_so(tmp_path: Path) -> None:
    batch = two_turn_batch(tmp_path, ["agent fails", "reward fails"], ["A", "A"])
    batch.batch["token_level_scores"] = batch.batch["rm_scores"]
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
    correction = OmegaConf.create({"rollout_is": "token", "rollout_is_threshold": 2.0})
    with pytest.raises(ValueError, match="at least one valid token"):  # verl's own check, which ours steps around
        runner._verl_rollout_correction(batch, correction)
    # what verl's fit() calls (imported from the module at each step), and its update
    corrected, is_metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, correction)
    assert corrected is batch and is_metrics == {} and "rollout_is_weights" not in batch.batch
    trainer = runner.FailClosedTrainer.__new__(runner.FailClosedTrainer)
    trainer.actor_rollout_wg = NoUpdate()
    metrics = trainer._update_actor(batch).meta_info["metrics"]
    assert metrics["train/update_skipped"] == 1.0 and metrics["rollout/excluded_rate"] == 1.0
    assert math.isnan(metrics["train/reward_mean"]) and math.isnan(metrics["rollout/model_tokens_mean"])


def test_a_trained_steps_log_has_the_from_update_losss_sampling_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`backend.old_log_probs=from_update`: the loss's token sums, as verl's actor returns them, become the step's
    `sampling/*` metrics beside `step_metrics`, and leave verl's."""
    from verl.protocol import DataProto
    from verl.utils.metric import Metric

    batch = two_turn_batch(tmp_path, ["r0", "r1"], ["A", "A"])
    batch.batch["token_level_scores"] = batch.batch["rm_scores"]
    sums = {"tokens": [10.0, 30.0], "diff": [1.0, 1.0], "ratio": [10.0, 30.5], "over": [0.0, 2.0]}  # 2 micro-batches
    # as verl's actor returns them: each key's mean over ranks and micro-batches, a value a mini-batch
    verls = {}
    for key, values in sums.items():
        one_rank = Metric("mean")
        one_rank.extend(values)
        verls[f"actor/is_sums/{key}"] = [Metric.aggregate_dp([one_rank])]
    monkeypatch.setattr(
        RayPPOTrainer, "_update_actor", lambda self, b: DataProto.from_single_dict({}, meta_info={"metrics": verls})
    )
    trainer = runner.FailClosedTrainer.__new__(runner.FailClosedTrainer)
    metrics = trainer._update_actor(batch).meta_info["metrics"]
    assert not any(key.startswith("actor/is_sums/") for key in metrics)
    assert metrics["sampling/is_ratio/mean"] == pytest.approx(40.5 / 40)
    assert metrics["sampling/is_ratio/clipped_frac"] == pytest.approx(2 / 40)
    assert metrics["sampling/logp_diff/mean"] == pytest.approx(2 / 40)
    assert metrics["train/update_skipped"] == 0.0 and metrics["rollout/excluded_rate"] == 0.0

"""Our agents in verl 0.9's agent loop: one rollout per `AgentLoop.run`, token in, token out, fail closed.

verl's AgentLoopWorker calls `run(sampling_params, **row)` once per rollout with the dataset row's fields; the task
rides in `row["extra_info"]["task"]` (JSON: `task_row`). The agent runs unchanged against the token ledger that
backend=trl's policy server uses (`inference/ledger.py`), whose calls here go to verl's LLM server client
(`VerlServerEngine`): each model call is `server_manager.generate(request_id, prompt_ids=..., sampling_params=...)`
with the ids the ledger built, so call k+1's prompt is call k's prompt + the ids sampled for it + the template's delta
for the new messages. The rollout's calls become one sample (`backends/samples.py`), exactly as under backend=trl,
with the sampler's log-probs (verl's `rollout_log_probs`, which its rollout correction reads).

Fail closed: an excluded rollout (agent_error, reward_error, inexact, overflow) reaches verl's batch as one response
token with response_mask 0, and `extra_fields["excluded"]` names why. It gets no gradient, and the advantage
estimator `grpo_fail_closed` (`algorithm.adv_estimator`) leaves it out of its group's mean and std: verl's `grpo`
would count it, with the 0 its `rm_scores` must hold, as a real reward.

verl builds the loop with Hydra from `actor_rollout_ref.rollout.agent.agent_loop_config_path`, a YAML list whose entry
carries our agent, reward and model groups as they were composed (`loop_config`): each is instantiated once per
worker process, not per rollout.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput
from verl.trainer.ppo.core_algos import register_adv_est

from agent.rollout import Agent, Reward, Rollout, run_rollouts
from backends.samples import Sample, sample_of
from inference.engine import Completion, finish
from inference.ledger import TokenLedger
from inference.policy_server import rollout_chat
from models.chat import ChatFormat

# The name under which verl finds the loop (`agent_name` of each row, `agent.default_agent_loop`).
LOOP_NAME = "arl_agent"
ITEM_ID, ITEM_SCORE = "item_id", "item_score"  # the keys of each rollout's question id and score in verl's dumps
# The advantage estimator that leaves excluded rollouts out of their group (`algorithm.adv_estimator`).
FAIL_CLOSED_GRPO = "grpo_fail_closed"


class VerlServerEngine:
    """verl's LLM server client, for one rollout, with a continuous engine's `submit`: every call goes out under the
    rollout's request id (verl routes one id to one server, whose prefix cache then holds the conversation). The
    weights are verl's business (its workers sync them into the servers)."""

    def __init__(self, server_manager: Any, request_id: str, top_k: int = -1) -> None:
        self.server_manager = server_manager
        self.request_id = request_id
        self.top_k = top_k  # verl's rollout.top_k (-1: off)
        self.weight_steps: list[int] = []  # the global steps of the weights that answered each call (verl's tags)
        self.generate_s = 0.0  # seconds the rollout waited on its calls

    async def submit(
        self, prompt_ids: list[int], max_new_tokens: int, *, temperature: float, top_p: float, eos_ids: set[int]
    ) -> Completion:
        params = {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": self.top_k,
            "max_tokens": max_new_tokens,
            "logprobs": True,  # the sampled token's own log-prob (verl's server asks vLLM for 0 alternatives)
            "stop_token_ids": sorted(i for i in eos_ids if i >= 0),
        }
        start = time.perf_counter()
        output = await self.server_manager.generate(self.request_id, prompt_ids=prompt_ids, sampling_params=params)
        self.generate_s += time.perf_counter() - start
        tags = output.extra_fields
        self.weight_steps += [s for s in (tags.get("min_global_steps"), tags.get("max_global_steps")) if s is not None]
        if output.stop_reason == "aborted":  # a request verl cut off (a weight update): its tokens are not a reply
            raise RuntimeError("verl aborted the generation")
        if output.log_probs is None or len(output.log_probs) != len(output.token_ids):
            raise RuntimeError("verl's server returned no log-prob for every sampled token")
        return finish(output.token_ids, max_new_tokens, eos_ids, output.log_probs)


def task_row(task: dict[str, Any], data_source: str, index: int) -> dict[str, Any]:
    """The dataset row verl reads for `task` (the `index`-th of its split): the agent builds its own prompt, so
    `prompt` only names the question (verl's dataset wants one); the task travels whole in `extra_info`."""
    return {
        "data_source": data_source,
        "agent_name": LOOP_NAME,
        "prompt": [{"role": "user", "content": str(task.get("question", ""))}],
        "extra_info": {"task": json.dumps(task, sort_keys=True), "index": index},
    }


def loop_config(agent: dict[str, Any], reward: dict[str, Any], model: dict[str, Any], **settings: Any) -> list:
    """The entry of verl's agent-loop YAML for our loop: the composed agent, reward and model groups and the
    settings `AgentLoop` takes."""
    target = f"{AgentLoop.__module__}.{AgentLoop.__qualname__}"
    groups = {"agent": agent, "reward": reward, "model": model}
    # not recursive: verl's Hydra would build the groups for every rollout; `_parts` builds them once a process
    return [{"name": LOOP_NAME, "_target_": target, "_recursive_": False, **groups, **settings}]


_PARTS: dict[str, tuple[Agent, Reward, Any]] = {}  # per process: instantiated once, shared by its rollouts


class AgentLoop(AgentLoopBase):
    """One of our rollouts in verl's agent loop (see the module's docstring).

    agent, reward, model: our groups' composed configs (`_target_` and fields); max_prompt_tokens and
    max_response_tokens: the rollout's budgets (algorithm.max_prompt_length, max_response_length);
    max_tokens_per_turn: one call's cap (None: the response budget); reward_timeout_s: the reward's time limit;
    eos_ids: the ids that end a reply (the model's generation config's)."""

    def __init__(
        self,
        *args: Any,
        agent: Any,
        reward: Any,
        model: Any,
        max_prompt_tokens: int,
        max_response_tokens: int,
        max_tokens_per_turn: int | None,
        reward_timeout_s: float | None,
        eos_ids: list[int],
        **kwargs: Any,
    ) -> None:
        kwargs.pop("tools", None)  # verl's own tool list: our agents bring their tools
        super().__init__(*args, **kwargs)
        self.agent, self.reward, model_spec = _parts(agent, reward, model)
        self.chat_format: ChatFormat = model_spec.chat_format(self.tokenizer)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_response_tokens = max_response_tokens
        self.max_tokens_per_turn = max_tokens_per_turn
        self.reward_timeout_s = reward_timeout_s
        self.eos_ids = set(eos_ids)

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        task = json.loads(row["extra_info"]["task"])
        request_id = uuid.uuid4().hex
        engine = VerlServerEngine(self.server_manager, request_id, int(sampling_params.get("top_k", -1)))
        ledger = TokenLedger(
            self.tokenizer,
            self.chat_format,
            max_prompt_tokens=self.max_prompt_tokens,
            max_response_tokens=self.max_response_tokens,
            generate=functools.partial(engine.submit, eos_ids=self.eos_ids),
        )
        sampling: dict[str, Any] = {"temperature": sampling_params["temperature"], "top_p": sampling_params["top_p"]}
        if self.max_tokens_per_turn is not None:
            sampling["max_tokens"] = self.max_tokens_per_turn
        chat = rollout_chat(ledger, request_id, sampling)  # its HTTP surface is built only if an agent calls it
        [rollout] = await run_rollouts(
            self.agent, [task], lambda _i: chat, self.reward, reward_timeout_s=self.reward_timeout_s
        )
        calls = ledger.pop_records(request_id)
        sample = sample_of(rollout, calls, self.max_response_tokens, self.tokenizer.pad_token_id)
        # the weights' steps, as verl's own loops tag them (its staleness control reads them); no call: the row's
        steps = engine.weight_steps or [row.get("global_steps")]
        return loop_output(rollout, sample, len(calls), engine.generate_s, (min(steps), max(steps)))


def loop_output(
    rollout: Rollout, sample: Sample, llm_calls: int, generate_s: float, weight_steps: tuple[Any, Any]
) -> AgentLoopOutput:
    """verl's record of one rollout: the sample's ids, mask and log-probs, and the reward (0 where excluded: verl
    needs a number, and `grpo_fail_closed` reads the zero mask, not the 0)."""
    excluded = sample.excluded is not None
    return AgentLoopOutput(
        prompt_ids=sample.prompt_ids,
        response_ids=sample.completion_ids,
        response_mask=sample.env_mask,
        response_logprobs=sample.logprobs,
        reward_score=0.0 if excluded else rollout.reward,
        num_turns=len(rollout.trajectory.messages),
        metrics=AgentLoopMetrics(generate_sequences=generate_s, compute_score=rollout.reward_s or 0.0),
        extra_fields={
            "excluded": sample.excluded or "",  # why it trains nothing ("" when it trains)
            "llm_calls": llm_calls,
            "agent_turns": rollout.trajectory.turns,
            "min_global_steps": weight_steps[0],
            "max_global_steps": weight_steps[1],
            # verl's validation dumps these per rollout (trainer.validation_data_dir): each question's score, read
            # back into the run's scores/ (backends/verl/train.py `copy_item_scores`); None where the reward is missing
            "reward_extra_info": {ITEM_ID: str(rollout.task["id"]), ITEM_SCORE: rollout.reward},
        },
    )


def _parts(agent: Any, reward: Any, model: Any) -> tuple[Agent, Reward, Any]:
    """The agent, reward and model spec from their composed configs, built once per process."""
    plain = [
        OmegaConf.to_container(c, resolve=True) if isinstance(c, DictConfig) else c for c in (agent, reward, model)
    ]
    key = json.dumps(plain, sort_keys=True, default=str)
    if key not in _PARTS:
        _PARTS[key] = tuple(instantiate(c, _convert_="all") for c in plain)  # type: ignore[assignment]
    return _PARTS[key]


@register_adv_est(FAIL_CLOSED_GRPO)
def fail_closed_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO outcome advantage over the rollouts that train: a rollout whose response_mask is all zeros (an
    excluded one) is left out of its group's mean and std and gets advantage 0. A group with one rollout that trains
    gives it 0 as well (its own mean). `config.norm_adv_by_std_in_grpo` as verl's (False: Dr. GRPO)."""
    scores = token_level_rewards.sum(dim=-1)
    trains = response_mask.sum(dim=-1) > 0
    normalize = True if config is None else bool(config.get("norm_adv_by_std_in_grpo", True))
    groups: dict[Any, list[int]] = defaultdict(list)
    for i in range(scores.shape[0]):
        if trains[i]:
            groups[index[i]].append(i)
    advantages = torch.zeros_like(scores)
    with torch.no_grad():
        for members in groups.values():
            if len(members) < 2:
                continue
            group = scores[members]
            centred = group - group.mean()
            advantages[members] = centred / (group.std() + epsilon) if normalize else centred
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages

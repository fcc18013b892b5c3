"""Our agents and rewards as an agent-lightning LitAgent, and the tracer, adapter and store the config selects."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from agent.llm import OpenAIChat
from agent.rollout import Agent, Reward, run_rollouts
from backends.agl.settings import AglWiring

# LiteLLM (agent-lightning's proxy) fetches a model cost map from the internet at import and retries for seconds.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# agent-lightning starts AgentOps with a dummy key; its spans go to agent-lightning's store. Keep AgentOps' own
# service (prompts, SQL, schemas) out of reach unless a user points these somewhere on purpose.
os.environ.setdefault("AGENTOPS_API_ENDPOINT", "http://127.0.0.1:9")
os.environ.setdefault("AGENTOPS_EXPORTER_ENDPOINT", "http://127.0.0.1:9")

import agentlightning as agl
from agentlightning.verl.daemon import AgentModeDaemon

LLM_RESOURCE = "main_llm"
log = logging.getLogger(__name__)


class AgentRollouts(agl.LitAgent[dict[str, Any]]):
    """Runs one of our agents unchanged against the rollout's LLM endpoint and returns our reward for it.

    The endpoint is agent-lightning's: `get_base_url(rollout_id, attempt_id)` routes every call through its LLM
    proxy, which records the calls (token ids included) as spans of this rollout.
    """

    def __init__(
        self, agent: Agent, reward: Reward, sampling: dict[str, Any], reward_timeout_s: float | None = None
    ) -> None:
        super().__init__()
        self.agent = agent
        self.reward = reward
        self.sampling = sampling  # ours (max_tokens per call), on top of what the resource sets (temperature)
        self.reward_timeout_s = reward_timeout_s

    async def rollout_async(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> Any:
        llm = resources[LLM_RESOURCE]
        if not isinstance(llm, agl.LLM):
            raise TypeError(f"resource {LLM_RESOURCE} is a {type(llm).__name__}, not an LLM")
        attempt_id = rollout.attempt.attempt_id if isinstance(rollout, agl.AttemptedRollout) else None
        chat = OpenAIChat.connect(
            llm.get_base_url(rollout.rollout_id, attempt_id),
            llm.model,
            api_key=llm.api_key or "EMPTY",
            sampling=llm.sampling_parameters | self.sampling,
        )
        # The same loop as backend=trl: an agent that raised or a reward that raised or timed out fails the rollout.
        [result] = await run_rollouts(
            self.agent, [task], lambda _i: chat, self.reward, reward_timeout_s=self.reward_timeout_s
        )
        if result.failure is not None:
            log.warning("rollout on task %s excluded (%s): %s", task.get("id"), result.failure, result.error)
            return None
        # None (a judge that could not be reached) stays missing: no reward span, never a silent 0.
        return result.reward


class FailClosedDaemon(AgentModeDaemon):
    """agent-lightning's verl daemon, except that a rollout without a reward (failed, or its reward missing) gives
    no training samples: agent-lightning 0.3 would fill its reward with 0 (`reward_fillna_value`) and train on it.
    With no triplets the daemon skips the rollout, so it is neither trained nor part of its group's baseline; it is
    counted in `training/n_excluded_rollouts`, and `training/reward` is the mean over the rollouts with a reward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.excluded = 0

    async def _validate_data_v1(self, rollout: Any) -> Any:
        legacy = await super()._validate_data_v1(rollout)
        if legacy.final_reward is None and legacy.triplets:
            legacy.triplets = []
            self.excluded += 1
        return legacy

    def get_train_data_batch(self, *args: Any, **kwargs: Any) -> Any:
        rewards = [r.final_reward for r in self._completed_rollouts_v0.values() if r.final_reward is not None]
        batch, metrics = super().get_train_data_batch(*args, **kwargs)
        # agent-lightning's own mean counts the excluded rollouts as 0
        metrics["training/reward"] = sum(rewards) / len(rewards) if rewards else float("nan")
        metrics["training/n_excluded_rollouts"] = self.excluded
        return batch, metrics

    def clear_data_and_server(self) -> Any:
        self.excluded = 0
        return super().clear_data_and_server()


def tracer(wiring: AglWiring) -> agl.Tracer:
    """agentops: AgentOps spans of the agent's steps and calls; llm_proxy: OpenTelemetry in the runners (the proxy
    records the LLM calls)."""
    return agl.AgentOpsTracer() if wiring.tracing == "agentops" else agl.OtelTracer()


def adapter(wiring: AglWiring) -> agl.TraceAdapter[Any]:
    if wiring.tracing == "agentops":
        return agl.TracerTraceToTriplet(agent_match=wiring.trained_calls)
    return agl.LlmProxyTraceToTriplet()


def store_and_port(wiring: AglWiring) -> tuple[agl.LightningStore | None, int]:
    """An external store (`backend.store_address`, which the trainer must not manage: AGL_MANAGED_STORE=0), or
    none (the trainer serves an in-memory one on a free port)."""
    if wiring.store_address is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return None, s.getsockname()[1]
    os.environ["AGL_MANAGED_STORE"] = "0"
    port = int(wiring.store_address.rsplit(":", 1)[1].split("/")[0])
    return agl.LightningStoreClient(wiring.store_address), port


def proxy(model_list: list[dict[str, Any]]) -> agl.LLMProxy:
    """agent-lightning's LLM proxy (LiteLLM), on loopback only: the runners reach it there, and it has no key
    (LiteLLM >= 1.106.2 refuses to start keyless unless told to, which is only safe bound to 127.0.0.1)."""
    settings = {"general_settings": {"dangerously_permit_weak_or_unset_master_key": True}}
    return agl.LLMProxy(model_list=model_list, host="127.0.0.1", litellm_config=settings)  # type: ignore[arg-type]


def endpoint_model(base_url: str, model: str, api_key_env: str) -> dict[str, Any]:
    """A vLLM-style OpenAI-compatible server as a proxy model; its key stays in the environment (LiteLLM reads
    `os.environ/<name>` itself)."""
    params = {"model": f"hosted_vllm/{model}", "api_base": base_url}
    if os.environ.get(api_key_env):
        params["api_key"] = f"os.environ/{api_key_env}"
    return {"model_name": model, "litellm_params": params}


def runner(wiring: AglWiring, poll_interval_s: float) -> agl.LitAgentRunner[Any]:
    return agl.LitAgentRunner(tracer=tracer(wiring), poll_interval=poll_interval_s)

"""What `conf/backend/verl.yaml` and `conf/backend/dev.yaml` hold: agent-lightning's wiring and verl's cluster shape.

Importable without agent-lightning or verl (config validation and `job=doctor` run in either venv). The run code
(`train.py`, `dev.py`) reads these settings; the classes the config groups build (`backend.py`) add the entry point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from foundation.schema import number, one_of

TRACING_MODES = ("llm_proxy", "agentops")
TRACE_AGGREGATIONS = ("transition", "trajectory")  # each LLM call a sample, or a rollout's calls merged into one
NEEDS_VENV = "agent-lightning and verl are not installed here: make setup-verl, then run with .venv-verl/bin/python"


@dataclass
class AglWiring:
    """How agent-lightning runs the agent and turns its LLM calls into training triplets.

    tracing=agentops: the agent process is traced (AgentOps) and TracerTraceToTriplet keeps the calls made inside
    the agent steps matching `agent_match[<agent option>]` (an agent not listed: every call). tracing=llm_proxy:
    every call through agent-lightning's LLM proxy becomes a triplet (LlmProxyTraceToTriplet).
    """

    # per agent option: regex of the agent steps whose LLM calls are trained (None: every call); conf/agl/wiring.yaml
    agent_match: dict[str, str | None]
    agent: str = "spider_sql"  # the agent option (conf/agent/<name>.yaml); set from Hydra's choice
    n_runners: int = number(8, gt=0)  # agent runners (processes) executing rollouts
    tracing: str = one_of("agentops", TRACING_MODES)
    store_address: str | None = None  # an external `agl store` (http://host:port); null: one in this process

    def __post_init__(self) -> None:
        if self.tracing == "llm_proxy" and self.trained_calls is not None:
            raise ValueError(
                f"backend.agent_match.{self.agent}={self.trained_calls!r} needs backend.tracing=agentops (the LLM "
                f"proxy's spans carry no agent steps); set backend.agent_match.{self.agent}=null to train every call"
            )
        if self.store_address is not None:
            url = urlparse(self.store_address)
            if url.scheme not in ("http", "https") or not url.hostname or not url.port:
                raise ValueError(f"backend.store_address must be http://host:port, got {self.store_address!r}")

    @property
    def trained_calls(self) -> str | None:
        """The adapter's `agent_match` for this agent (None: every LLM call is trained)."""
        return self.agent_match.get(self.agent)


@dataclass
class VerlSettings(AglWiring):
    """agent-lightning's `Trainer(algorithm=agl.VERL(...))`: verl GRPO with vLLM rollouts on `resources` GPUs."""

    name: str = "verl"
    max_turns: int = number(3, gt=0)  # ${agent.max_turns}: the agent's turn limit, also verl's rollout.multi_turn bound
    nodes: int = number(1, gt=0)  # ${resources.nodes}
    gpus_per_node: int = number(1, gt=0)  # ${resources.gpus_per_node}
    tensor_parallel_size: int = number(1, gt=0)  # vLLM's; must divide gpus_per_node
    gpu_memory_utilization: float = number(0.6, gt=0, le=1)  # vLLM's share of each GPU
    gradient_checkpointing: bool = True
    param_offload: bool = False
    logger: list[str] = field(default_factory=lambda: ["console"])
    trace_aggregation: str = one_of("transition", TRACE_AGGREGATIONS)
    project_name: str = "agentic-rl"
    overrides: dict[str, Any] = field(default_factory=dict)  # verl keys our groups do not set
    fit: bool = True  # false: build the verl config, agl.VERL and the Trainer, then stop before fit (works on CPU)


@dataclass
class DevSettings(AglWiring):
    """agent-lightning's `Trainer.dev` with its Baseline algorithm: rollouts against any OpenAI-compatible endpoint
    (`conf/endpoint`), traced into triplets and written to `<run>/dev/`; no weights change."""

    name: str = "dev"
    n_runners: int = number(2, gt=0)  # agent runners (processes) executing rollouts
    base_url: str = "http://127.0.0.1:8000/v1"  # ${endpoint.base_url}
    model: str | None = None  # ${endpoint.model}
    api_key_env: str = "OPENAI_API_KEY"  # ${endpoint.api_key_env}
    n_tasks: int = number(4, gt=0)  # the first N training tasks
    poll_interval_s: float = number(0.5, gt=0)  # how often runners and the algorithm poll the store

"""An agent's steps as OpenTelemetry spans named `agent.name`: what agent-lightning's adapter matches `agent_match`
against (backend=verl/dev with `backend.tracing=agentops`). Without a tracer provider the spans are no-ops."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace

_TRACER = trace.get_tracer("agentic_rl.agent")


@contextmanager
def agent_step(name: str) -> Iterator[None]:
    """The LLM calls made inside belong to the agent step `name`."""
    with _TRACER.start_as_current_span(name, attributes={"agent.name": name}):
        yield

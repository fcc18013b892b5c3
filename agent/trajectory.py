"""What one agent rollout produces, whatever agent or backend ran it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from agent.llm import Message


@dataclass
class Trajectory:
    """The conversation an agent had, its final SQL (or answer), and how its tool calls went."""

    messages: list[Message] = field(default_factory=list)
    final_sql: str | None = None
    answer: str | None = None
    turns: int = 0
    executions: int = 0
    execution_errors: int = 0
    last_execution_ok: bool = False
    verdicts: list[bool] = field(default_factory=list)  # each check step's verdict, in order (True: "correct")
    error: str | None = None
    # For agents that write (DB-bench): the rows of the task's table when the rollout ended.
    db_state: list[list[Any]] | None = None
    # For agents that score themselves (agent=lit: what a LitAgent's rollout returned); None: none, or missing.
    agent_reward: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

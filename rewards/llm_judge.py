"""LLM-judge reward: a judge model behind any OpenAI-compatible endpoint scores an answer from 0 to 1.

The rubric (accuracy, completeness, clarity, professionalism) is a prompt in `conf/reward/llm_judge.yaml`; the judge
must end its reply with `SCORE: <0..1>` (`x/10` and `x/100` are read too). A malformed reply is asked again, up to
`retries` times; identical requests are answered from a cache. When the judge cannot be reached or never gives a
readable score the reward is `None`: missing, counted in the metrics, never a silent 0.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

import openai
from openai import OpenAI

from agent.trajectory import Trajectory
from foundation.schema import number

_SCORE = re.compile(r"SCORE:\s*\**\s*([0-9]*\.?[0-9]+)\s*(?:/\s*(10|100))?", re.IGNORECASE)


def parse_score(text: str) -> float | None:
    """The last `SCORE: x` in `text` as a number in [0, 1], or None when there is none or it is out of range."""
    matches = _SCORE.findall(text or "")
    if not matches:
        return None
    value, scale = matches[-1]
    score = float(value) / (float(scale) if scale else 1.0)
    return score if 0.0 <= score <= 1.0 else None


@dataclass
class LLMJudge:
    base_url: str
    model: str
    rubric: str
    name: str = "llm_judge"
    api_key_env: str = "JUDGE_API_KEY"
    timeout_s: float = number(30.0, gt=0)  # per call
    retries: int = number(2, ge=0)  # more calls after a failed or unreadable reply (0: one call only)
    temperature: float = number(0.0, ge=0)  # the judge's sampling temperature (0: greedy)
    max_tokens: int = number(512, gt=0)  # of the judge's reply

    def __post_init__(self) -> None:
        self._cache: dict[str, float] = {}
        self._lock = threading.Lock()

    def prompt(self, task: dict[str, Any], trajectory: Trajectory) -> str | None:
        answer = trajectory.answer if trajectory.answer is not None else trajectory.final_sql
        if answer is None:
            return None
        reference = task.get("answer") or task.get("query") or "(no reference answer)"
        return self.rubric.format(question=task["question"], answer=answer, reference=reference)

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float | None:
        prompt = self.prompt(task, trajectory)
        if prompt is None:  # nothing to judge: the agent gave no answer
            return 0.0
        key = hashlib.sha256(f"{self.model}\0{self.temperature}\0{prompt}".encode()).hexdigest()
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        client = OpenAI(
            base_url=self.base_url,
            api_key=os.environ.get(self.api_key_env, "EMPTY"),
            timeout=self.timeout_s,
            max_retries=0,
        )
        for _ in range(self.retries + 1):
            try:
                reply = client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": prompt}],
                    temperature=self.temperature,
                    max_tokens=self.max_tokens,
                )
            except (openai.APIConnectionError, openai.APITimeoutError, openai.APIStatusError):
                continue
            score = parse_score(reply.choices[0].message.content or "")
            if score is not None:
                with self._lock:
                    self._cache[key] = score
                return score
        return None

"""Answer match: does a prose answer mention the values the gold SQL returned (`task["answer_items"]`)?"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from agent.trajectory import Trajectory

_IGNORED = re.compile(r"[\s\W_]+", re.UNICODE)


def normalize(text: str) -> str:
    """Case-folded, width-folded (NFKC), without spaces or punctuation: `"Cefixime, 2"` and `"cefixime 2"` match."""
    return _IGNORED.sub("", unicodedata.normalize("NFKC", text).casefold())


@dataclass
class AnswerMatch:
    """The fraction of gold items the answer mentions (1.0 when it mentions all); 0.0 without an answer.

    `all_or_nothing: true` scores 1.0 only when every item is mentioned.
    """

    name: str = "answer_match"
    all_or_nothing: bool = False

    def __call__(self, task: dict[str, Any], trajectory: Trajectory) -> float:
        items = [normalize(str(item)) for item in task.get("answer_items") or [task["answer"]]]
        items = [item for item in items if item]
        if not trajectory.answer or not items:
            return 0.0
        answer = normalize(trajectory.answer)
        found = sum(item in answer for item in items) / len(items)
        return float(found == 1.0) if self.all_or_nothing else found

"""Splits of a task list that do not bias a comparison: shuffled with a seed and stratified by a task's kind.

Every dataset gives each task a `kind` (`KIND`): what makes two tasks the same sort of question (Spider: the database
and the SQL skeleton, `sql_skeleton`; med_qa: template and language; DB-bench: skill and table). `stratified_split`
cuts a list in two so that every kind is shared between the parts in the asked proportion (to within one task), in an
order drawn from the seed, never in file order (generated and real files alike are ordered: Spider's train file by
database, spider_mini's by how its pools drain).

    chosen, rest = stratified_split(tasks, share=0.25, seed=0, salt="warmstart")

The method is systematic sampling over the tasks sorted by kind (shuffled within a kind) from a random start: each
kind's block gets floor or ceil of `share` of its tasks, the total is floor or ceil of `share` of all, and kinds
too small to split (one task) fall to either side with probability `share`.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

KIND = "kind"  # a task's stratum: tasks of one kind are the same sort of question

T = TypeVar("T")

_STRING = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")
_SPACE = re.compile(r"\s+")


def sql_skeleton(query: str) -> str:
    """A query's shape: literals replaced (strings by `'_'`, numbers by `0`), keywords and names lower-cased,
    whitespace collapsed. `SELECT COUNT(*) FROM t WHERE a BETWEEN 3 AND 9` -> `select count(*) from t where a
    between 0 and 0`."""
    shape = _STRING.sub("'_'", query.strip().rstrip(";"))
    shape = _NUMBER.sub("0", shape)
    return _SPACE.sub(" ", shape).lower()


def task_kind(task: dict[str, Any]) -> str:
    return str(task[KIND])


def stratified_split(
    items: Sequence[T], share: float, seed: int, salt: str, kind: Callable[[T], str] = task_kind
) -> tuple[list[T], list[T]]:
    """(`share` of `items`, the rest), each kind in that proportion; both in the items' own order. `salt` names the
    split, so that two splits from one seed (validation from train, then warm start from the rest) draw apart."""
    if not 0 < share < 1:
        raise ValueError(f"a split's share must be between 0 and 1, got {share}")
    rng = random.Random(f"{seed}:{salt}")
    order = list(range(len(items)))
    rng.shuffle(order)
    order.sort(key=lambda i: kind(items[i]))  # stable: shuffled within a kind
    start = rng.random()
    chosen = {
        i for rank, i in enumerate(order) if math.floor((rank + 1) * share + start) > math.floor(rank * share + start)
    }
    return [x for i, x in enumerate(items) if i in chosen], [x for i, x in enumerate(items) if i not in chosen]


def kind_distance(a: Sequence[T], b: Sequence[T], kind: Callable[[T], str] = task_kind) -> float:
    """The total-variation distance between the kinds' distributions in `a` and in `b` (0: the same mix; 1: no kind
    in common)."""
    if not a or not b:
        return 1.0
    ca, cb = Counter(map(kind, a)), Counter(map(kind, b))
    return 0.5 * sum(abs(ca[k] / len(a) - cb[k] / len(b)) for k in sorted(ca.keys() | cb.keys()))  # one order: one sum


def held_out_text_in(
    corpus: Sequence[str], held_out: Sequence[dict[str, Any]], train: Sequence[dict[str, Any]]
) -> list[str]:
    """The questions of `held_out` tasks (validation, test) that appear in `corpus`, unless a training task asks the
    same words: what a tokenizer, or anything else built from training text, must not contain."""
    text = "\n".join(corpus)
    asked = {task["question"] for task in train}
    return [q for task in held_out if (q := task["question"]) and q not in asked and q in text]


def training_corpus(
    demo_texts: list[str], rl_tasks: list[dict[str, Any]], held_out: list[dict[str, Any]], train: list[dict[str, Any]]
) -> list[str]:
    """What a model built here (the tiny one's tokenizer) is trained on: the demonstrations' text and the questions
    of the tasks RL trains on (the policy reads them); without demonstrations, the training tasks' questions and gold
    SQL. Never validation or test text: a held-out question found in it stops the run."""
    corpus = [*demo_texts, *(t["question"] for t in rl_tasks)]
    if not demo_texts:
        corpus += [t["query"] for t in rl_tasks]
    if leaked := held_out_text_in(corpus, held_out, train):
        raise RuntimeError(f"{len(leaked)} validation/test questions are in the training corpus, e.g. {leaked[0]!r}")
    return corpus

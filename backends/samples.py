"""A rollout's training sample, the same for every backend: its calls become one token sequence, or it is excluded.

A sample is the first call's prompt, then every model turn (trained: mask 1, with the sampler's log-probs) and the
tokens the conversation added between turns (tool results, check and rewrite requests: mask 0) in between. Because
the policy server builds each prompt token in, token out (`inference/policy_server.py`), this is by construction
what was sampled plus environment tokens. The whole multi-turn rollout is one sample, as in TRL's tool loop and
verl's agent loop (not agent-lightning's one sample per call).

Fail closed: a rollout that cannot be trained on exactly is excluded, for one of `EXCLUSION_REASONS`:
- `agent_error`: the agent raised, or a model call failed (e.g. its first prompt was too long);
- `reward_error`: the reward raised, timed out or returned None (missing);
- `inexact`: a call's messages did not extend the conversation (the agent rewrote or dropped a message, or changed
  `tools`);
- `overflow`: the rollout went on after its response budget was spent (a call got an empty reply it never sampled);
- `stale`: one of its calls was sent to weights older than the step that trains it allows (`oldest_allowed`: the
  trainer's step less `algorithm.max_staleness`; asynchronous and partial rollouts, whose calls record the weights
  they were sent to, `CallRecord.weights_version`).
An excluded rollout's sample is one token with mask 0 and no reward: no gradient, and no part in its group's
baseline (each backend says how it keeps it out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent.rollout import Rollout
from inference.policy_server import CallRecord

EXCLUSION_REASONS = ("agent_error", "reward_error", "inexact", "overflow", "stale")


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]
    logprobs: list[float]  # the sampler's, for model tokens; 0.0 for environment tokens
    excluded: str | None = None  # why it gets no gradient (one of EXCLUSION_REASONS), or None


def flatten(calls: list[CallRecord], max_completion_tokens: int) -> Sample | str:
    """One sequence from a rollout's calls, or the reason it cannot be built exactly (`inexact`, `overflow`).

    Each later call's prompt must start with the sequence so far (the server marks it `continues`; checked here on
    the ids too). A token whose sampler log-prob is unknown gets NaN: the importance weight treats it as 1."""
    if not calls:
        return "inexact"
    if any(not call.sampled for call in calls):
        return "overflow"
    first = calls[0]
    sequence = list(first.prompt_ids)
    mask: list[int] = []
    logprobs: list[float] = []
    for i, call in enumerate(calls):
        if i and not (call.continues and call.prompt_ids[: len(sequence)] == sequence):
            return "inexact"
        added = call.prompt_ids[len(sequence) :]  # empty for the first call
        sampled = call.completion_ids
        sampled_logprobs = call.logprobs if call.logprobs is not None else [math.nan] * len(sampled)
        if len(sampled_logprobs) != len(sampled):
            raise ValueError(f"the engine returned {len(sampled_logprobs)} log-probs for {len(sampled)} tokens")
        sequence += added + sampled
        mask += [0] * len(added) + [1] * len(sampled)
        logprobs += [0.0] * len(added) + list(sampled_logprobs)
    completion = sequence[len(first.prompt_ids) :]
    if len(completion) > max_completion_tokens:  # the server's budget prevents this; never cut a sample silently
        return "overflow"
    return Sample(first.prompt_ids, completion, mask, logprobs)


def excluded_sample(reason: str, pad_id: int) -> Sample:
    """What an excluded rollout contributes: one masked token (no gradient; its reward is None)."""
    return Sample([pad_id], [pad_id], [0], [0.0], excluded=reason)


def oldest_weights(calls: list[CallRecord]) -> int | None:
    """The oldest weights any of the calls was sent to (`CallRecord.weights_version`: the trainer's optimizer steps
    then; a call's tokens were sampled by those or newer ones); None when none was sampled."""
    return min((call.weights_version for call in calls if call.sampled), default=None)


def sample_of(
    rollout: Rollout,
    calls: list[CallRecord],
    max_completion_tokens: int,
    pad_id: int,
    *,
    oldest_allowed: int | None = None,
) -> Sample:
    """The rollout's sample, or an excluded one: the agent's or reward's failure first, then its staleness (a call
    sent to weights older than `oldest_allowed`; None: no bound), then the sequence's."""
    if rollout.failure is not None:
        return excluded_sample(rollout.failure, pad_id)
    oldest = oldest_weights(calls)
    if oldest_allowed is not None and oldest is not None and oldest < oldest_allowed:
        return excluded_sample("stale", pad_id)
    built = flatten(calls, max_completion_tokens)
    return excluded_sample(built, pad_id) if isinstance(built, str) else built


def check_stats(rollouts: list[Rollout]) -> dict[str, float]:
    """How an agent's check step judged (nothing when no rollout checked): the share of verdicts that said the query
    is correct, and of the scored rollouts that ended on such a verdict (when any did), the share whose reward is
    below 1 (for a 0/1 reward such as exec-match: a wrong query accepted)."""
    verdicts = [v for r in rollouts for v in r.trajectory.verdicts]
    if not verdicts:
        return {}
    accepted = [r.reward for r in rollouts if r.trajectory.verdicts[-1:] == [True] and r.reward is not None]
    stats = {"rollout/check_said_correct_rate": sum(verdicts) / len(verdicts)}
    if accepted:  # else undefined, not 0: a check that accepts nothing is not a check that is never wrong
        stats["rollout/check_accepted_wrong_rate"] = sum(reward < 1 for reward in accepted) / len(accepted)
    return stats

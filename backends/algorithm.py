"""GRPO's settings, written once and mapped by each backend onto its trainer's config (`conf/algorithm/grpo.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass

# How the sampler's log-probs correct the update for the engine/trainer mismatch (truncated importance sampling):
# per token or per sequence; ratios above the cap are clipped to it (truncate) or weighted 0 (mask).
IS_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")  # TRL's, each with a verl loss_agg_mode


@dataclass
class GRPO:
    """Group-relative policy optimisation. One step = `tasks_per_step` tasks x `group_size` rollouts each."""

    name: str = "grpo"
    group_size: int = 8
    tasks_per_step: int = 4
    micro_batch_size: int = 8
    learning_rate: float = 1e-6
    kl_coef: float = 0.0
    clip_ratio: float = 0.2
    clip_ratio_high: float | None = None
    temperature: float = 1.0
    max_prompt_length: int = 2048
    max_response_length: int = 1024
    max_tokens_per_turn: int | None = None
    epochs: float = 1.0
    max_steps: int = -1
    save_every: int = 50
    val_every: int = 50
    max_grad_norm: float = 1.0
    loss_type: str = "dapo"
    is_correction: str = "token_truncate"
    is_cap: float = 2.0
    reward_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"algorithm.loss_type must be one of {', '.join(LOSS_TYPES)}; got {self.loss_type!r}")
        if self.is_correction not in IS_CORRECTIONS:
            raise ValueError(
                f"algorithm.is_correction must be one of {', '.join(IS_CORRECTIONS)}; got {self.is_correction!r}"
            )
        if self.is_cap <= 1.0:
            raise ValueError(f"algorithm.is_cap must be > 1, got {self.is_cap}")
        if self.reward_timeout_s <= 0:
            raise ValueError(f"algorithm.reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        for key in ("group_size", "tasks_per_step", "micro_batch_size", "max_prompt_length", "max_response_length"):
            if getattr(self, key) <= 0:
                raise ValueError(f"algorithm.{key} must be > 0, got {getattr(self, key)}")
        if self.group_size < 2:
            raise ValueError(f"algorithm.group_size must be >= 2 for group-relative advantages, got {self.group_size}")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"algorithm.micro_batch_size={self.micro_batch_size} must divide the step's batch of "
                f"tasks_per_step x group_size = {self.batch_size} sequences"
            )
        if self.max_tokens_per_turn is not None and not 0 < self.max_tokens_per_turn <= self.max_response_length:
            raise ValueError(
                f"algorithm.max_tokens_per_turn must be in (0, max_response_length={self.max_response_length}], "
                f"got {self.max_tokens_per_turn}"
            )
        if self.learning_rate <= 0:
            raise ValueError(f"algorithm.learning_rate must be > 0, got {self.learning_rate}")
        if self.kl_coef < 0 or self.clip_ratio <= 0:
            raise ValueError("algorithm.kl_coef must be >= 0 and algorithm.clip_ratio > 0")
        if self.save_every <= 0 or self.val_every <= 0:
            raise ValueError("algorithm.save_every and algorithm.val_every must be > 0")

    @property
    def batch_size(self) -> int:
        """Sequences per optimizer step."""
        return self.tasks_per_step * self.group_size

    def sampling(self, temperature: float) -> dict[str, float | int]:
        """What each LLM call of a rollout asks for."""
        params: dict[str, float | int] = {"temperature": temperature}
        if self.max_tokens_per_turn is not None:
            params["max_tokens"] = self.max_tokens_per_turn
        return params

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.batch_size // self.micro_batch_size

"""GRPO's settings, written once and mapped by each backend onto its trainer's config (`conf/algorithm/grpo.yaml`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from foundation.errors import ConfigError
from foundation.schema import number, one_of

# How the sampler's log-probs correct the update for the engine/trainer mismatch (truncated importance sampling):
# per token or per sequence; ratios above the cap are clipped to it (truncate) or weighted 0 (mask).
IS_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")  # TRL's, each with a verl loss_agg_mode


@dataclass
class GRPO:
    """Group-relative policy optimisation. One step = `tasks_per_step` tasks x `group_size` rollouts each."""

    name: str = "grpo"
    group_size: int = number(4, ge=2)  # group-relative advantages need two rollouts at least
    tasks_per_step: int = number(8, gt=0)
    micro_batch_size: int = number(4, gt=0)
    learning_rate: float = number(1e-6, gt=0)
    lr_warmup_steps: int = number(0, ge=0)  # optimizer steps over which the learning rate rises from 0 to its value
    kl_coef: float = number(0.0, ge=0)
    clip_ratio: float = number(0.2, gt=0)
    clip_ratio_high: float | None = number(0.3, gt=0)  # None: = clip_ratio
    temperature: float = number(1.0, gt=0)
    max_prompt_length: int = number(4096, gt=0)
    max_response_length: int = number(2048, gt=0)
    max_tokens_per_turn: int | None = number(None, gt=0)
    epochs: float = number(2.0, gt=0)
    max_steps: int = number(-1, ge=-1)  # -1: as many as `epochs` make
    save_every: int = number(64, gt=0)
    keep_checkpoints: int = number(1, ge=1)  # complete checkpoints kept; the oldest goes once a newer one is complete
    val_every: int = number(16, gt=0)
    # validate each time another 1/val_points of the run's budget is spent (its FLOPs, GPU-seconds or training
    # seconds; max_steps without one), and at the end: every arm of a study at the same points of its compute, so
    # every arm has a curve (None: every val_every steps, sft_val_every for the SFT arms)
    val_points: int | None = number(None, gt=0)
    max_grad_norm: float = number(1.0, gt=0)
    loss_type: str = one_of("dapo", LOSS_TYPES)
    is_correction: str = one_of("token_truncate", IS_CORRECTIONS)
    is_cap: float = number(2.0, gt=1)
    reward_timeout_s: float = number(60.0, gt=0)
    time_budget_s: float | None = number(None, gt=0)  # stop at the first step end after this much training
    flops_budget: float | None = number(None, gt=0)  # likewise after this many training FLOPs (backends/compute.py)
    gpu_s_budget: float | None = number(None, gt=0)  # likewise after this many GPU-seconds (backends/compute.py)
    test_at_end: bool = True  # the final model is scored on the data's test split too (test/*), never before
    pool_samples: int | None = number(None, ge=2)  # train on the tasks the start solves some of N times (None: all)
    async_rollouts: bool = False  # step k+1's rollouts generate during step k's update (one step off-policy)
    # with async_rollouts: each step's weights load while the batch read ahead still generates (it finishes under
    # them) and the next batch starts before that one is waited for: two batches in flight
    partial_rollouts: bool = False
    # with partial_rollouts: a step trains the groups that finished first (older read-aheads first) and carries the
    # unfinished ones over to later steps, generating on, so its longest rollouts stop setting the step
    carry_over: bool = False
    # with carry_over: each step adds the groups of the step this many steps on, so a group has that many steps'
    # time to finish and the engine that many steps' groups to batch (a group trained on time is this many steps old)
    read_ahead_steps: int = number(1, ge=1)
    # a rollout sampled in part by weights more than this many optimizer steps older than those it trains is
    # excluded (`stale`); None: no bound
    max_staleness: int | None = number(1, ge=0)

    def __post_init__(self) -> None:
        if self.partial_rollouts and not self.async_rollouts:
            raise ValueError("algorithm.partial_rollouts: a batch read ahead that finishes under the next weights; it "
                             "needs algorithm.async_rollouts=true")  # fmt: skip
        if self.carry_over and not self.partial_rollouts:
            raise ValueError("algorithm.carry_over takes the groups finished first from partial rollouts' batches in "
                             "flight; it needs algorithm.partial_rollouts=true")  # fmt: skip
        if self.read_ahead_steps > 1 and not self.carry_over:
            raise ValueError(f"algorithm.read_ahead_steps={self.read_ahead_steps}: only algorithm.carry_over reads "
                             f"more than one step ahead (set 1, or carry_over=true)")  # fmt: skip
        if self.carry_over and self.max_staleness is not None and self.max_staleness <= self.read_ahead_steps:
            raise ValueError(f"algorithm.max_staleness={self.max_staleness} with algorithm.carry_over: a group read "
                             f"ahead (algorithm.read_ahead_steps={self.read_ahead_steps}) and carried over once is "
                             f"{self.read_ahead_steps + 1} steps old, excluded (set {self.read_ahead_steps + 1} or "
                             f"more, or null)")  # fmt: skip
        if self.async_rollouts and self.max_staleness is not None and self.max_staleness < 1:
            raise ValueError(f"algorithm.max_staleness={self.max_staleness} with algorithm.async_rollouts: every batch "
                             f"read ahead is one step old and would be excluded (set 1 or more, or null)")  # fmt: skip
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"algorithm.micro_batch_size={self.micro_batch_size} must divide the step's batch of "
                f"tasks_per_step x group_size = {self.batch_size} sequences"
            )
        if self.max_tokens_per_turn is not None and self.max_tokens_per_turn > self.max_response_length:
            raise ValueError(
                f"algorithm.max_tokens_per_turn must be <= max_response_length={self.max_response_length}, "
                f"got {self.max_tokens_per_turn}"
            )

    @property
    def batch_size(self) -> int:
        """Sequences per optimizer step."""
        return self.tasks_per_step * self.group_size

    @property
    def overlapped(self) -> bool:
        """The next step's rollouts generate during this step's update (`async_rollouts`, for arms with rollouts)."""
        return self.async_rollouts

    @property
    def steps_read_ahead(self) -> int:
        """Optimizer steps whose batches the Trainer reads before their turn: `read_ahead_steps` where rollouts
        generate ahead (`overlapped`), else none."""
        return self.read_ahead_steps if self.overlapped else 0

    def sampling(self, temperature: float) -> dict[str, float | int]:
        """What each LLM call of a rollout asks for."""
        params: dict[str, float | int] = {"temperature": temperature}
        if self.max_tokens_per_turn is not None:
            params["max_tokens"] = self.max_tokens_per_turn
        return params

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.batch_size // self.micro_batch_size

    def per_rank(self, ranks: int) -> tuple[int, int]:
        """Micro-batch and accumulation steps of each of `ranks` processes sharing the step's batch: micro-batches
        of at most `micro_batch_size` sequences of the rank's share."""
        if self.batch_size % ranks:
            raise ConfigError(
                f"algorithm.tasks_per_step x group_size = {self.batch_size} sequences cannot be shared by {ranks} "
                "processes (resources.gpus_per_node)"
            )
        share = self.batch_size // ranks
        if self.carry_over and share % self.group_size:
            raise ConfigError(
                f"algorithm.carry_over takes whole groups on each rank: {ranks} processes' shares of {share} "
                f"sequences are not whole groups of algorithm.group_size={self.group_size}"
            )
        micro = math.gcd(share, self.micro_batch_size)
        return micro, share // micro

    @property
    def budgeted(self) -> bool:
        """Whether a budget (time, FLOPs or GPU-seconds) may end training before `max_steps` or `epochs`."""
        return any(b is not None for b in (self.time_budget_s, self.flops_budget, self.gpu_s_budget))

    def budget_fraction(self, flops: float, gpu_s: float, train_s: float, step: int, max_steps: int) -> float:
        """How much of the run's budget is spent: the most of each budget it has (FLOPs, GPU-seconds, training
        seconds), or of its steps when it has none."""
        budgets = [(flops, self.flops_budget), (gpu_s, self.gpu_s_budget), (train_s, self.time_budget_s)]
        shares = [spent / budget for spent, budget in budgets if budget is not None]
        if shares:
            return max(shares)
        return step / max_steps if max_steps > 0 else 0.0

    @property
    def lr_schedule(self) -> str:
        """After `lr_warmup_steps`, linear decay to the last step; constant under a time, FLOPs or GPU-seconds
        budget, whose last step is not known ahead."""
        if not self.budgeted:
            return "linear"
        return "constant_with_warmup" if self.lr_warmup_steps else "constant"


@dataclass
class SFTControl(GRPO):
    """The control arm of a GRPO experiment (`algorithm=sft_control`): from the same warm start, supervised
    fine-tuning on demonstrations (`sft_demos`: of the tasks GRPO would train on, see `warmstart.task_share`, or the
    warm start's own) goes on instead of GRPO, for the treatment's budget (`time_budget_s` training seconds,
    `flops_budget` FLOPs or `gpu_s_budget` GPU-seconds; else `max_steps` SFT steps), validated as GRPO is. It reads
    GRPO's lengths, validation and budget keys; its own `sft_*` keys say how it trains (an experiment's GRPO settings
    leave them alone); GRPO's sampling and loss keys, and `async_rollouts`, are unused.
    """

    name: str = "sft_control"
    sft_learning_rate: float = number(1e-4, gt=0)  # constant
    sft_batch_size: int = number(32, gt=0)  # demonstrations per SFT step
    sft_val_every: int = number(1000, gt=0)  # validate every N SFT steps (and at the end)
    # whose demonstrations: rl, the tasks GRPO trains on (gold GRPO never sees: with warmstart.task_share < 1, a
    # ceiling); warmstart, the warm start's own (SFT continued on what it had: no data GRPO's pool lacks)
    sft_demos: str = one_of("rl", ("rl", "warmstart"))
    max_steps: int = number(1000, ge=-1)  # SFT steps, unless a budget (time, FLOPs, GPU-seconds) ends it first

    @property
    def overlapped(self) -> bool:
        return False  # no rollouts

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.budgeted and self.max_steps <= 0:
            raise ValueError(
                "algorithm=sft_control needs algorithm.time_budget_s, flops_budget or gpu_s_budget (the treatment's "
                "compute) or max_steps"
            )


@dataclass
class RFT(GRPO):
    """Rejection-sampling fine-tuning (`algorithm=rft`), a control for GRPO with the same information: each step samples
    `group_size` rollouts of `tasks_per_step` tasks from the current policy, as GRPO does, keeps those whose reward is
    at least `accept_reward` and fine-tunes on their sampled tokens (the mean log-likelihood of the kept model tokens;
    the others get no gradient). No baseline, no negative samples: what GRPO adds over learning from its own
    successes. Every GRPO key applies (lengths, sampling, budgets, the importance-sampling correction)."""

    name: str = "rft"
    accept_reward: float = number(1.0, ge=0)  # a rollout with at least this reward is kept as a demonstration

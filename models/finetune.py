"""How the policy's weights are trained: all of them, or a LoRA adapter (`conf/finetune/*.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from peft import LoraConfig

from foundation.schema import number


@dataclass
class Full:
    """Full fine-tuning: every weight is trained."""

    name: str = "full"

    def peft_config(self, task_type: str = "CAUSAL_LM") -> None:
        return None


@dataclass
class LoRA:
    """A LoRA adapter on `target_modules` (PEFT)."""

    name: str = "lora"
    rank: int = number(32, gt=0)
    alpha: int = number(64, gt=0)  # the update is scaled by alpha / rank
    dropout: float = number(0.0, ge=0, lt=1)
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    def __post_init__(self) -> None:
        if not self.target_modules:
            raise ValueError("finetune.target_modules must not be empty")

    def peft_config(self, task_type: str = "CAUSAL_LM") -> LoraConfig:
        """PEFT's config; `task_type="SEQ_CLS"` for a reward model (its scalar head is then trained in full)."""
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            task_type=task_type,
        )

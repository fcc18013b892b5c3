"""A model from the Hugging Face hub or a local directory (`conf/model/*.yaml`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from foundation.schema import number, one_of
from models.chat import TOOL_CALL_FORMATS, ChatFormat

DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 on CUDA, float32 elsewhere
# What transformers' `attn_implementation` names (eager: its own; sdpa: torch's; the rest need their package).
ATTN_IMPLEMENTATIONS = (
    "eager",
    "sdpa",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "flex_attention",
)


@dataclass
class HubModel:
    """A pretrained causal LM. `path` (a local directory) wins over `hub_id`; HF_HUB_OFFLINE=1 fetches nothing."""

    name: str
    hub_id: str | None
    path: str | None
    context_length: int = number(gt=0)  # tokens the model attends to (prompt and response)
    tool_call_format: str = one_of(dataclasses.MISSING, TOOL_CALL_FORMATS)  # how replies carry tool calls
    dtype: str = one_of("auto", DTYPES)
    attn_implementation: str = one_of("sdpa", ATTN_IMPLEMENTATIONS)
    enable_thinking: bool | None = None  # Qwen3's thinking switch, passed to the chat template (None: its default)
    keep_thinking: bool = True  # thinking before a new user message: kept as sampled, or the rollout excluded (False)

    def __post_init__(self) -> None:
        if not (self.hub_id or self.path):
            raise ValueError("model.hub_id or model.path must be set")

    @property
    def source(self) -> str:
        return self.path or str(self.hub_id)

    def check_available(self) -> None:
        """Fail early, naming `model.path`, when a local path was given but does not exist."""
        if self.path and not Path(self.path).exists():
            raise FileNotFoundError(f"model.path={self.path} does not exist")

    def prepare(self, corpus_texts: list[str]) -> str:
        """Make the weights available locally if needed; returns what `from_pretrained` should load."""
        del corpus_texts  # pretrained models bring their own tokenizer
        self.check_available()
        return self.source

    def load_tokenizer(self, source: str) -> PreTrainedTokenizerBase:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline())
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def chat_format(self, tokenizer: PreTrainedTokenizerBase) -> ChatFormat:
        """How prompts are rendered and replies read for this model (token in, token out across turns)."""
        kwargs = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return ChatFormat(tokenizer, self.tool_call_format, kwargs, keep_thinking=self.keep_thinking)

    def architecture(self) -> PretrainedConfig:
        """The model's config (config.json alone: the memory plan's shape, before any weight loads)."""
        self.check_available()
        return AutoConfig.from_pretrained(self.source, local_files_only=offline())

    def load_model(self, source: str, device: str) -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(
            source,
            dtype=self.compute_dtype(device),
            attn_implementation=self.attn_implementation,
            local_files_only=offline(),
        ).to(device)

    def compute_dtype(self, device: str) -> torch.dtype:
        """The dtype the model is loaded in and generates in on `device` (`auto`: bf16 on CUDA, else fp32)."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")

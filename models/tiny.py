"""A tiny random-init Qwen3 model with a byte-level BPE tokenizer trained locally: the CPU stand-in for a real policy.

Built on first use into `cache_dir` (no network), keyed by its architecture and the text its tokenizer was trained
on, and loaded like any local checkpoint afterwards.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from foundation.schema import number, one_of
from models.chat import CHAT_TEMPLATES, chat_template, check_template_pair
from models.hub import DTYPES, HubModel

BUILD_VERSION = 2


@dataclass(frozen=True)
class _Tokens:
    """The tokens a template family's tokenizer has: special (control) tokens, its eos, its pad, and the plain added
    tokens its models emit as text (Qwen's tool-call and thinking tags, which `skip_special_tokens` keeps)."""

    special: tuple[str, ...]
    eos: str
    pad: str
    added: tuple[str, ...] = ()


_QWEN = _Tokens(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    eos="<|im_end|>",
    pad="<|endoftext|>",
    added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
)
_LLAMA3 = _Tokens(
    (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
    ),
    eos="<|eot_id|>",
    pad="<|finetune_right_pad_id|>",
)
TEMPLATE_TOKENS = {"qwen25": _QWEN, "qwen3": _QWEN, "llama3": _LLAMA3}


def train_tokenizer(corpus_texts: list[str], vocab_size: int, template: str = "qwen25") -> PreTrainedTokenizerFast:
    """Byte-level BPE with digits split one by one, so numbers in SQL and results tokenize uniformly; the special
    and added tokens of `template`'s model family, and that template."""
    tokens = TEMPLATE_TOKENS[template]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(tokens.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts, trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens.added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=tokens.eos, pad_token=tokens.pad, padding_side="left"
    )
    if template == "llama3":
        fast.bos_token = "<|begin_of_text|>"
    fast.chat_template = chat_template(template)
    return fast


@dataclass
class TinyModel(HubModel):
    """A Qwen3-architecture model small enough to train on 2 CPU cores in minutes."""

    cache_dir: str = ".cache/models"
    dtype: str = one_of("float32", DTYPES)  # weights and compute (auto: bf16 on GPU, fp32 on CPU)
    vocab_size: int = number(2048, ge=256)  # the byte-level alphabet alone is 256 tokens: below it, no effect
    hidden_size: int = number(128, gt=0)
    intermediate_size: int = number(512, gt=0)
    num_hidden_layers: int = number(4, gt=0)
    num_attention_heads: int = number(4, gt=0)
    num_key_value_heads: int = number(2, gt=0)
    init_seed: int = number(0, ge=0)  # torch's seed for the random weights
    chat_template: str = one_of("qwen25", CHAT_TEMPLATES)  # the tokenizer's (models/chat_templates/)
    # A real model's shape for benchmarks: its vocabulary's rows in the embedding (null: the tokenizer's size; ids
    # past the tokenizer decode to nothing), and its output layer apart from the embedding or tied to it.
    embedding_rows: int | None = number(None, ge=256)
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:  # no hub_id or path needed: built here
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("model.hidden_size must be divisible by model.num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("model.num_attention_heads must be divisible by model.num_key_value_heads")
        check_template_pair(self.chat_template, self.tool_call_format)

    def build_dir(self, corpus_texts: list[str]) -> Path:
        arch = {k: v for k, v in asdict(self).items() if k not in ("name", "path", "cache_dir", "dtype")}
        for key, default in (("embedding_rows", None), ("tie_word_embeddings", True)):  # builds from before them
            if arch[key] == default:
                del arch[key]
        digest = hashlib.sha256(json.dumps([BUILD_VERSION, arch, corpus_texts], sort_keys=True).encode()).hexdigest()
        return Path(self.cache_dir) / f"tiny-qwen3-{digest[:12]}"

    def prepare(self, corpus_texts: list[str]) -> str:
        """Use `model.path` if given; otherwise build (once) from `corpus_texts` and return the build directory."""
        if self.path:
            self.check_available()
            return self.path
        target = self.build_dir(corpus_texts)
        if not (target / "config.json").is_file():
            self.build(target, corpus_texts)
        return str(target)

    def architecture(self) -> Qwen3Config:
        """The model's config before it is built (the memory plan's shape): the vocabulary at its largest, the
        tokenizer trained on the corpus may be smaller."""
        return self._config(self.embedding_rows or self.vocab_size, eos=None, pad=None)

    def _config(self, vocab: int, eos: int | None, pad: int | None) -> Qwen3Config:
        return Qwen3Config(
            vocab_size=vocab,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.hidden_size // self.num_attention_heads,
            max_position_embeddings=self.context_length,
            tie_word_embeddings=self.tie_word_embeddings,
            eos_token_id=eos,
            pad_token_id=pad,
            bos_token_id=None,
        )

    def build(self, target: Path, corpus_texts: list[str]) -> None:
        tokenizer = train_tokenizer(corpus_texts, self.vocab_size, self.chat_template)
        eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        if self.embedding_rows is not None and self.embedding_rows < len(tokenizer):
            raise ValueError(f"model.embedding_rows={self.embedding_rows} is below the tokenizer's {len(tokenizer)}")
        config = self._config(self.embedding_rows or len(tokenizer), eos, tokenizer.pad_token_id)
        torch.manual_seed(self.init_seed)
        model = Qwen3ForCausalLM(config)
        model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if not (staging / "config.json").is_file():  # never publish a build without its model
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(f"building the tiny model in {staging} wrote no config.json")
        try:
            staging.rename(target)
        except OSError:  # built concurrently by another run: keep theirs
            shutil.rmtree(staging, ignore_errors=True)

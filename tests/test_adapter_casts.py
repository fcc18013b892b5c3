"""The loss's forward skips PEFT's casts of each adapter's input where it autocasts to bf16 (backends/trl/trainer.py's
module docstring): the same bits with fewer copies, and only there."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.helpers import disable_input_dtype_casting
from peft.tuners.tuners_utils import BaseTunerLayer
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen2Config
from trl import GRPOTrainer

from backends.trl.trainer import AgentGRPOTrainer

CPU_BF16 = SimpleNamespace(device=torch.device("cpu"), autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
NO_AUTOCAST = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)


class Copies(TorchDispatchMode):
    """Counts the copies (dtype casts included) the ops under it run."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def lora_model(dropout: float = 0.0) -> Any:
    """A two-layer Qwen2 in bf16 with LoRA on every linear layer; PEFT keeps the adapters in fp32, both of their
    matrices drawn at random (B is zero by default, which would leave A without a gradient)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=modules, init_lora_weights=False)
    return get_peft_model(model, lora)


def loss_and_gradients(model: Any, skip_casts: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    model.zero_grad(set_to_none=True)
    ids = torch.arange(40).reshape(2, 20) % 128
    with disable_input_dtype_casting(model, active=skip_casts), Copies() as copies:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, copies.count


def test_under_bf16_autocast_skipping_the_adapter_casts_changes_no_bit_and_saves_copies():
    model = lora_model()
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    loss, grads, copies = loss_and_gradients(model, skip_casts=False)
    loss_skipped, grads_skipped, copies_skipped = loss_and_gradients(model, skip_casts=True)
    assert torch.equal(loss, loss_skipped)
    assert grads.keys() == grads_skipped.keys() and len(grads) == 2 * 7 * 2  # A and B of 7 layers, 2 blocks
    for name, grad in grads.items():
        assert torch.equal(grad, grads_skipped[name]), name
        assert grad.abs().sum() > 0, name
    # each of the 14 adapted layers casts its input to fp32 in the forward and the gradient back in the backward
    assert copies - copies_skipped >= 2 * 14


def cast_flags(model: Any) -> set[bool]:
    return {m.cast_input_dtype_enabled for m in model.modules() if isinstance(m, BaseTunerLayer)}


@pytest.mark.parametrize(
    ("accelerator", "skip_adapter_casts", "dropout", "skipped"),
    [
        (CPU_BF16, True, 0.0, True),
        (NO_AUTOCAST, True, 0.0, False),  # no autocast: nothing casts the input back
        (CPU_BF16, False, 0.0, False),  # the bench's reference (--peft-casts)
        (CPU_BF16, True, 0.1, False),  # dropout runs on the cast input: in fp32 its output differs in the last bits
    ],
)
def test_the_loss_forward_skips_the_casts_only_where_autocast_undoes_them(
    monkeypatch: pytest.MonkeyPatch, accelerator: Any, skip_adapter_casts: bool, dropout: float, skipped: bool
):
    """`AgentGRPOTrainer._compute_loss` runs TRL's loss with the casts off where bf16 autocast undoes them, and puts
    them back after it."""
    model, seen = lora_model(dropout), []

    def trl_loss(_self: Any, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        seen.append(cast_flags(model))
        return torch.zeros(())

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", trl_loss)
    trainer = AgentGRPOTrainer.__new__(AgentGRPOTrainer)  # only what _compute_loss reads
    trainer.is_correction, trainer.accelerator, trainer.skip_adapter_casts = "none", accelerator, skip_adapter_casts
    trainer._compute_loss(model, {})
    assert seen == [{not skipped}]
    assert cast_flags(model) == {True}


@pytest.mark.parametrize(("precision", "autocasts"), [("bf16", True), ("no", False)])
def test_accelerate_autocasts_to_bf16_only_with_bf16(precision: str, autocasts: bool):
    """What `autocasts_to_bf16` reads from accelerate itself (in a process of its own: accelerate's state is one per
    process)."""
    code = (
        "from accelerate import Accelerator; from backends.trl.trainer import autocasts_to_bf16; "
        f"print(autocasts_to_bf16(Accelerator(cpu=True, mixed_precision={precision!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == str(autocasts)

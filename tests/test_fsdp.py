"""FSDP2 on 2 CPU ranks (gloo), the path backend=trl takes with `sharding=fsdp2`: accelerate shards the model (promoted
to FSDP on CPU by `shard_on_cpu`), and one optimizer step on each rank's half of a batch leaves exactly the weights
one process gets from the whole batch; `full_weights` gathers them whole (LoRA merged) and `GenerationWeights` fills
its plain copy with them (or hands the sharded model to an engine that gathers into its own weights)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from peft import LoraConfig, get_peft_model
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from inference.vllm import architecture
from inference.weights import GenerationWeights, full_weights, is_sharded
from jobs.ranks import free_port

WORLD = 2


def _model(lora: bool) -> PreTrainedModel:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,  # as the project's tiny model: the tied weight is FSDP2's trickiest case
    )
    model = Qwen3ForCausalLM(config)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    return model


def _batch() -> torch.Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))


def _loss(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss  # as TRL's GRPO forward (no KV cache)


def _rank(rank: int, port: int, out: Path, lora: bool, checkpointing: bool) -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    from backends.trl.fsdp import fsdp_arguments, shard_on_cpu

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD)
    )
    args = TrainingArguments(output_dir=str(out / "args"), use_cpu=True, report_to=[], **fsdp_arguments(checkpointing))
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(**args.fsdp_plugin_args))
    assert shard_on_cpu(accelerator, args.fsdp_plugin_args)
    model = _model(lora)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    sharded = is_sharded(model)
    accelerator.backward(_loss(model, _batch()[rank::WORLD]))  # this rank's half
    optimizer.step()
    weights = {name: tensor.clone() for name, tensor in full_weights(model)}  # every rank gathers
    copy = GenerationWeights("cpu", torch.float32).for_generation(model)
    vllm_like = GenerationWeights("cpu", torch.float32, engine_gathers=True)  # it gathers into its own weights
    base = model.get_base_model() if lora else model  # what vLLM is built from
    own = vllm_like.for_generation(model) is model and architecture(base) == "Qwen3ForCausalLM"  # its class's name
    shard_sizes = [p.to_local().numel() for p in model.parameters()]
    if rank == 0:
        got = {"sharded": sharded, "weights": weights, "copy": copy.state_dict(), "shards": shard_sizes, "own": own}
        torch.save(got, out / "0")


@pytest.mark.parametrize(
    ("lora", "checkpointing"), [(False, False), (True, False), (False, True)], ids=["full", "lora", "checkpointing"]
)
def test_two_sharded_ranks_step_like_one_process_and_gather_the_full_weights(
    tmp_path: Path, lora: bool, checkpointing: bool
) -> None:
    """`checkpointing`: FSDP's activation checkpointing (backend.gradient_checkpointing) wraps each layer, and its
    parameters' names with it; the gathered weights keep the checkpoint's names."""
    mp.spawn(_rank, args=(free_port(), tmp_path, lora, checkpointing), nprocs=WORLD, join=True)
    got = torch.load(tmp_path / "0")

    reference = _model(lora)
    whole = {name: p.numel() for name, p in reference.named_parameters()}
    optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
    ids = _batch()
    # FSDP averages the ranks' gradients: the mean of the two halves' losses
    ((_loss(reference, ids[0::WORLD]) + _loss(reference, ids[1::WORLD])) / WORLD).backward()
    optimizer.step()
    expected = dict(full_weights(reference))

    assert got["sharded"] and sum(got["shards"]) < sum(whole.values())  # rank 0 held part of the weights only
    assert got["own"]  # an engine with its own weights is handed the sharded model, and told its architecture
    assert got["weights"].keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    if lora:  # the step moved the adapters (B starts at 0): the merged weight differs from the base one
        q = "base_model.model.model.layers.0.self_attn.q_proj"
        base = dict(reference.named_parameters())[f"{q}.base_layer.weight"]
        assert not torch.allclose(expected["model.layers.0.self_attn.q_proj.weight"], base)
    copy = got["copy"]
    for name, tensor in expected.items():
        torch.testing.assert_close(copy[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def _save_rank(rank: int, port: int, out: Path) -> None:
    """save_final on 2 sharded ranks; rank 0's write waits (bounded) for rank 1 to leave save_final, and rank 1 notes
    whether the model was written when it left."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    from backends.trl.arms import save_final
    from backends.trl.fsdp import fsdp_arguments, shard_on_cpu
    from tests.conftest import wait_for

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD)
    )
    args = TrainingArguments(output_dir=str(out / "args"), use_cpu=True, report_to=[], **fsdp_arguments(False))
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(**args.fsdp_plugin_args))
    assert shard_on_cpu(accelerator, args.fsdp_plugin_args)
    plain = _model(lora=False)
    model, _ = accelerator.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.1))  # FSDP2 takes both together
    left, final = out / "rank1_left", out / "final"
    if rank == 0:
        inner = accelerator.unwrap_model(model)
        write = inner.save_pretrained

        def save_after_rank1_left(*a: object, **kw: object) -> None:
            # rank 1 cannot leave before this write returns: the wait runs out, and that is the point
            with contextlib.suppress(TimeoutError):
                wait_for(left.exists, timeout_s=5, what="rank 1 to leave save_final")
            write(*a, **kw)

        inner.save_pretrained = save_after_rank1_left
    save_final(SimpleNamespace(model=model, accelerator=accelerator), final, torch.float32)
    if rank == 1:
        (out / "model_written_when_rank1_left").write_text(str((final / "config.json").is_file()))
        left.touch()


def test_every_rank_leaves_the_final_save_only_once_rank_0_has_written_the_model(tmp_path: Path) -> None:
    """A rank that left (and exited) while its part of the gather was still queued left rank 0 waiting forever."""
    mp.spawn(_save_rank, args=(free_port(), tmp_path), nprocs=WORLD, join=True)
    assert (tmp_path / "model_written_when_rank1_left").read_text() == "True"
    assert (tmp_path / "final" / "config.json").is_file()


def test_an_unsharded_model_is_generated_from_as_it_is() -> None:
    model = _model(lora=False)
    assert not is_sharded(model)
    assert GenerationWeights("cpu", torch.float32).for_generation(model) is model

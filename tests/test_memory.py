"""The memory plan (backends/memory.py): a 7B model trained in full on two 80 GB GPUs, with and without offload;
and a run whose plan does not fit stops before any rank starts, naming the keys to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import Qwen2Config

from backends.memory import Setting, Shape, explain, plan_memory
from tests.conftest import FAST_RUN, launch

# Qwen2.5-7B-Instruct's config.json (the fields the plan reads)
QWEN25_7B = Qwen2Config(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
H100_GB = 85.5  # nvidia-smi's 81,559 MiB


def two_gpus(offload: str, share: float = 0.3, micro: int = 2) -> Setting:
    return Setting(
        full=True,
        ranks=2,
        sharded=True,
        offload=offload,
        gradient_checkpointing=True,
        micro_batch_tokens=micro * 3072,
        engine="vllm",
        engine_share=share,
        engine_sleeps=True,
    )


def test_the_shape_counts_a_real_model_s_parameters() -> None:
    shape = Shape.of(QWEN25_7B)
    assert shape.parameters == 7_615_616_512  # Qwen2.5-7B's count
    assert shape.embedding_parameters == 2 * 152064 * 3584  # untied: embedding and output layer
    lora = Shape.of(QWEN25_7B, lora_rank=32, lora_targets=["q_proj", "v_proj"])
    assert lora.adapter_parameters == 28 * 32 * ((3584 + 3584) + (3584 + 512))


def test_7b_full_on_two_80gb_gpus_fits_only_with_its_optimizer_state_offloaded() -> None:
    shape = Shape.of(QWEN25_7B)
    plain = plan_memory(shape, two_gpus("none"), H100_GB)
    # the sharded state alone: 16 bytes a parameter over 2 ranks
    assert plain["phases"]["update"]["parts_gb"]["trainer weights, gradients, optimizer"] == pytest.approx(60.9, 0.01)
    assert not plain["fits"]  # what the first 2 x H100 run met: out of memory at its first step
    words = explain(plain, two_gpus("none"))
    assert "it does not fit" in words and "backend.offload=optimizer" in words
    assert "backend.vllm_gpu_memory_utilization (now 0.3)" in words and "finetune=lora" in words
    offloaded = plan_memory(shape, two_gpus("optimizer", share=0.4, micro=1), H100_GB)
    assert offloaded["fits"], explain(offloaded, two_gpus("optimizer", share=0.4, micro=1))
    assert offloaded["phases"]["rollout"]["parts_gb"]["trainer weights"] == pytest.approx(15.2, 0.01)  # fp32 shard
    everything = plan_memory(shape, two_gpus("all", share=0.5), H100_GB)
    assert (
        everything["fits"] and everything["phases"]["update"]["parts_gb"]["trainer weights, gradients, optimizer"] == 0
    )


def test_async_rollouts_count_the_engine_awake_and_the_weights_copy_in_the_update() -> None:
    """algorithm.async_rollouts: the engine generates during the update; a static engine from its own bf16 copy."""
    import dataclasses

    shape = Shape.of(QWEN25_7B)
    one = Setting(True, 1, False, "none", True, 3072, "static", 0.5, True)
    on_policy = plan_memory(shape, one, 141.0)["phases"]["update"]["parts_gb"]["engine asleep"]
    overlapped = plan_memory(shape, dataclasses.replace(one, snapshot=True), 141.0)["phases"]["update"]["parts_gb"]
    assert on_policy == 0 and overlapped["engine asleep"] == pytest.approx(15.2, 0.01)  # 2 bytes x 7.6B parameters
    vllm = dataclasses.replace(one, engine="vllm", engine_sleeps=False, snapshot=True)
    assert plan_memory(shape, vllm, 141.0)["phases"]["update"]["parts_gb"]["engine asleep"] == pytest.approx(70.5)


def test_lora_keeps_the_base_in_bf16_and_trains_only_the_adapter() -> None:
    shape = Shape.of(QWEN25_7B, lora_rank=32, lora_targets=["q_proj", "v_proj"])
    one = Setting(False, 1, False, "none", True, 4 * 3072, "vllm", 0.5, True)
    plan = plan_memory(shape, one, H100_GB)
    assert plan["fits"]
    state = plan["phases"]["update"]["parts_gb"]["trainer weights, gradients, optimizer"]
    assert state == pytest.approx((2 * 7.6156 + 16 * shape.adapter_parameters / 1e9), abs=0.1)


@pytest.mark.integration
def test_a_run_whose_plan_does_not_fit_stops_before_any_rank_starts(cache_dir: Path, tmp_path: Path) -> None:
    """model=tiny in Qwen2.5-7B's shape (nothing is built: the plan reads the shape off the config), full fine-tuning
    on 2 GPUs of 80 GB, stated by resources.gpu_memory_gb (this machine has none)."""
    run_dir = tmp_path / "run"
    shape = ["model.hidden_size=3584", "model.intermediate_size=18944", "model.num_hidden_layers=28"]
    shape += ["model.num_attention_heads=28", "model.num_key_value_heads=4", "model.embedding_rows=152064"]
    shape += ["model.tie_word_embeddings=false", "model.context_length=4096"]
    shape += ["algorithm.max_prompt_length=2048", "algorithm.max_response_length=1024"]
    args = [*FAST_RUN, *shape, "resources.gpus_per_node=2", "resources.gpu_memory_gb=85.5"]
    args += ["backend.vllm_gpu_memory_utilization=0.3", f"hydra.run.dir={run_dir}"]
    result = launch(args, cache_dir, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert result.returncode != 0 and summary["status"] == "failed"
    assert summary["error"].startswith("ConfigError: memory plan per GPU (85.5 GB)")
    assert "backend.offload=optimizer" in summary["error"] and "backend.memory_check=false" in summary["error"]
    assert not (run_dir / "ranks").exists()  # no rank was started
    built = [json.loads(c.read_text()) for c in Path(cache_dir, "models").glob("tiny-qwen3-*/config.json")]
    assert not any(config["hidden_size"] == 3584 for config in built)  # nothing of this shape was built


def test_device_memory_keeps_each_phase_s_peak_and_what_the_engine_freed() -> None:
    """The phases a GRPO step passes through (AgentRollouts sets them), read off a scripted device."""
    from backends.memory import DeviceMemory

    readings = iter([10.0, 52.0, 51.0, 12.0, 70.0, 64.0])
    memory = DeviceMemory("cuda:0")
    memory.used_gb = lambda: next(readings)  # type: ignore[method-assign]
    memory.sample()  # loading the model
    memory.phase = "rollout"
    memory.sample()  # the engine awake, generating
    awake = memory.sample()
    memory.engine_slept(awake)  # 51 -> 12: the engine freed 39
    memory.phase = "update"
    memory.sample()
    memory.sample()
    assert memory.summary()["phase_peak_gb"] == {"start": 10.0, "rollout": 52.0, "update": 70.0}
    assert memory.summary()["peak_gb"] == 70.0 and memory.summary()["engine_gb"] == 39.0
    assert memory.peaks["rollout"] == 52.0  # the sample taken as the engine slept counts for the rollout phase


def test_each_step_logs_the_most_any_rank_s_gpu_had_in_use_per_phase() -> None:
    """gpu_memory/* in metrics.jsonl: a run killed before its summary (an OOM, a full disk) keeps them."""
    from backends.memory import gpu_memory_metrics

    ranks = [
        {"peak_gb": 70.0, "phase_peak_gb": {"start": 10.0, "rollout": 52.0, "update": 70.0}},
        {"peak_gb": 66.0, "phase_peak_gb": {"start": 11.0, "rollout": 66.0}},  # rank 1 has no update sample yet
    ]
    assert gpu_memory_metrics(ranks) == {
        "gpu_memory/peak_gb": 70.0,
        "gpu_memory/start_peak_gb": 11.0,
        "gpu_memory/rollout_peak_gb": 66.0,
        "gpu_memory/update_peak_gb": 70.0,
    }


# The hub models of the GPU presets, as their config.json has them (no download here)
HUB_SHAPES = {
    "Qwen/Qwen2.5-7B-Instruct": QWEN25_7B,
    "Qwen/Qwen2.5-Coder-1.5B-Instruct": Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-Coder-3B-Instruct": Qwen2Config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize(
    "preset",
    [
        "grpo-qwen2.5-7b-1n1g-lora",
        "grpo-qwen2.5-coder-1.5b-1n1g-lora",
        "grpo-qwen2.5-coder-3b-1n1g-lora",
        "grpo-qwen2.5-7b-1n2g-full",
    ],
)
def test_every_gpu_preset_s_plan_fits_an_80gb_card(
    preset: str, spider_mini_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The presets are sized for H100s (80 GB): their own plan, with vLLM as the engine, must not refuse them."""
    import backends.trl.backend as trl_backend
    from jobs.config import build_components
    from tests.test_config import compose_with

    cfg = compose_with(f"experiment={preset}", f"data.spider_dir={spider_mini_dir}")
    parts = build_components(cfg)
    model = parts["model"]
    monkeypatch.setattr(model, "architecture", lambda: HUB_SHAPES[model.hub_id])
    monkeypatch.setattr(trl_backend, "resolve_engine", lambda name, device: "vllm")
    ranks = parts["backend"].processes(int(cfg.resources.nodes), int(cfg.resources.gpus_per_node))
    plan = parts["backend"].memory_plan(model, parts["finetune"], parts["algorithm"], ranks, H100_GB)
    assert plan["fits"], plan["text"]


@pytest.mark.parametrize(
    ("overrides", "ranks", "message"),
    [
        (["backend.offload=all"], 1, r"backend.offload=all: FSDP2 offloads, so it needs several ranks"),
        (["backend.offload=all", "backend.sharding=ddp"], 2, r"backend.offload=all: .*\(now 2 rank\(s\), ddp\)"),
        (["backend.offload=optimizer", "backend.device=cpu"], 1, r"backend.offload=optimizer: on cpu the trainer's"),
        (
            ["backend.offload=optimizer", "algorithm.async_rollouts=true"],
            1,
            r"algorithm.async_rollouts: the engine generates during the update.*backend.offload=optimizer",
        ),
        (["algorithm.async_rollouts=true", "algorithm.is_correction=none"], 1, r"async_rollouts trains one step off"),
    ],
)
def test_an_offload_that_cannot_apply_stops_the_run_instead_of_being_ignored(
    overrides: list[str], ranks: int, message: str
) -> None:
    from foundation.errors import ConfigError
    from jobs.config import build_components
    from tests.test_config import compose_with

    parts = build_components(compose_with(*overrides))
    with pytest.raises(ConfigError, match=message):
        parts["backend"].check_settings(ranks, parts["algorithm"])
    plain = build_components(compose_with("backend.device=cpu"))
    plain["backend"].check_settings(2, plain["algorithm"])  # no offload: nothing to check

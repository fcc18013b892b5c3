"""Every option of every config group composes and builds; bad values fail before any model loads, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.config import build_components
from foundation.errors import ConfigError
from tests.conftest import ROOT, launch

CONF = ROOT / "conf"
GROUPS = ["job", "model", "finetune", "algorithm", "agent", "reward", "data", "backend", "warmstart", "experiment"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_with(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # `${hydra:runtime.choices.agent}` resolves as under launch.py
    return cfg


# Options that need another option: a model other than the default tiny one (whose context is 1024 tokens), or the
# agent that answers the data set's tasks.
NEEDS = {
    ("algorithm", "grpo"): "model=qwen7b",
    ("data", "med_qa"): "agent=med_sql",
    ("data", "dbbench"): "agent=dbbench",
}


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_builds(group: str, option: str, spider_mini_dir: Path) -> None:
    overrides = [f"{group}={option}", *([NEEDS[group, option]] if (group, option) in NEEDS else [])]
    cfg = compose_with(*overrides)
    if cfg.data.name == "spider":  # the real Spider is not here: its loader reads the generated set in its layout
        cfg = compose_with(*overrides, f"data.spider_dir={spider_mini_dir}")
    built = build_components(cfg)
    if group in built:
        assert (built[group] is None) == (option == "none")


def test_model_presets_name_their_hub_ids() -> None:
    hub_ids = {o: compose_with(f"model={o}").model.hub_id for o in options("model")}
    assert hub_ids == {
        "tiny": None,
        "qwen3_0_6b": "Qwen/Qwen3-0.6B",
        "qwen25_coder_1_5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "qwen25_coder_3b": "Qwen/Qwen2.5-Coder-3B-Instruct",
        "qwen7b": "Qwen/Qwen2.5-7B-Instruct",
    }


def test_model_path_overrides_the_hub_id(tmp_path: Path) -> None:
    model = build_components(compose_with("model=qwen7b", f"model.path={tmp_path}"))["model"]
    assert model.prepare([]) == str(tmp_path)


def test_values_used_twice_are_written_once() -> None:
    cfg = compose_with("agent.sql_timeout_s=7", "paths.cache_dir=/elsewhere")
    assert cfg.reward.timeout_s == 7
    assert cfg.model.cache_dir == "/elsewhere/models" and cfg.data.spider_dir == "/elsewhere/spider_mini"


def test_tiny_selects_its_warm_start_and_cpu_sizes_but_real_models_do_not() -> None:
    assert compose_with().warmstart.name == "sft" and compose_with().algorithm.max_steps > 0
    real = compose_with("model=qwen7b")
    assert not real.warmstart and real.algorithm.max_prompt_length == 4096


def test_warmstart_none_means_no_warm_start_also_with_an_experiment_that_shortens_it() -> None:
    assert build_components(compose_with("experiment=smoke"))["warmstart"].steps == 5
    for overrides in (["experiment=smoke", "warmstart=none"], ["warmstart=none", "experiment=ablation_check_tiny"]):
        assert build_components(compose_with(*overrides))["warmstart"] is None


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["finetune=lora", "finetune.rank=0"], "finetune.rank"),
        (["finetune=lora", "finetune.rank=-4"], "finetune.rank"),
        (["finetune=lora", "+finetune.rnak=8"], "finetune.rnak"),
        (["algorithm.max_response_length=4096"], "algorithm.max_response_length"),
        (["algorithm.micro_batch_size=5"], "algorithm.micro_batch_size"),
        (["algorithm.group_size=abc"], "algorithm.group_size"),
        (["agent.max_turns=0"], "agent.max_turns"),
        (["data=spider", "data.spider_dir=/no/such/dir"], "data.spider_dir"),
        (["data=spider", "data.spider_dir=null"], "data.spider_dir"),
        (["model=qwen7b", "model.path=/no/such/model"], "model.path"),
        (["model.chat_template=qwen9"], "model.chat_template"),
        (["model=qwen3_0_6b", "model.tool_call_format=xml"], "model.tool_call_format"),
        (["algorithm.is_correction=always"], "algorithm.is_correction"),
        (["algorithm.is_cap=0.5"], "algorithm.is_cap"),
        (["algorithm.reward_timeout_s=0"], "algorithm.reward_timeout_s"),
        (["algorithm.loss_type=bogus"], "algorithm.loss_type"),
    ],
)
def test_bad_values_name_their_key(overrides: list[str], key: str) -> None:
    cfg = compose_with(*overrides)
    with pytest.raises((ConfigError, FileNotFoundError), match=key.replace(".", r"\.")):
        parts = build_components(cfg)
        parts["model"].check_available()


def test_a_mistyped_key_fails_at_composition() -> None:
    with pytest.raises(Exception, match=r"finetune\.rnak"):
        compose_with("finetune=lora", "finetune.rnak=8")


@pytest.mark.integration
def test_launch_fails_fast_on_a_bad_value_and_records_it(tmp_path: Path) -> None:
    result = launch(["finetune=lora", "finetune.rank=0"], tmp_path / "cache", tmp_path / "out")
    assert result.returncode != 0
    assert "finetune.rank must be > 0" in result.stderr + result.stdout
    summaries = list((tmp_path / "out").rglob("summary.json"))
    assert len(summaries) == 1 and '"status": "failed"' in summaries[0].read_text()
    assert not (tmp_path / "cache" / "models").exists()  # nothing was built or loaded


@pytest.mark.integration
def test_launch_rejects_an_unknown_group_option(tmp_path: Path) -> None:
    result = launch(["model=qwen99"], tmp_path / "cache", tmp_path / "out")
    assert result.returncode != 0 and "model/qwen99" in result.stderr


@pytest.mark.integration
def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    result = launch(["--cfg", "job", "model=qwen7b", "finetune=lora"], tmp_path / "cache", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert "hub_id: Qwen/Qwen2.5-7B-Instruct" in result.stdout and "rank: 32" in result.stdout


@pytest.mark.parametrize(
    ("agent", "data", "reward"),
    [
        ("spider_sql", "spider_mini", "exec_match"),
        ("med_sql", "med_qa", "answer_match"),
        ("dbbench", "dbbench", "dbbench_match"),
    ],
)
def test_an_agent_brings_its_data_and_reward(agent: str, data: str, reward: str) -> None:
    cfg = compose_with(f"agent={agent}")
    assert (cfg.agent.name, cfg.data.name, cfg.reward.name) == (agent, data, reward)
    assert compose_with(f"agent={agent}", "reward=rule").reward.name == "rule"  # the command line still decides


def test_an_agent_and_data_of_different_kinds_fail_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"agent=med_sql answers med_qa tasks; data=spider_mini"):
        build_components(compose_with("agent=med_sql", "data=spider_mini"))

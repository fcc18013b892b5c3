"""Every option of every config group composes and builds; bad values fail before any model loads, naming the key."""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping
from datetime import date
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from foundation.errors import ConfigError
from foundation.schema import declared
from hydra_plugins.arl_aliases import ALIASES, REMOVE_ON
from jobs.config import RunSettings, build_components, check_job, check_run, check_schema, check_study
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
    ("algorithm", "grpo"): "model=qwen2.5-7b-instruct",
    ("algorithm", "sft_control"): "experiment=learn-gpu",  # a warm start, and lengths that fit the tiny model
    ("algorithm", "rft"): "experiment=learn-gpu",
    ("algorithm", "sft_continue"): "experiment=learn-gpu",
    ("algorithm", "sft_ceiling"): "experiment=learn-gpu",
    ("data", "med_qa"): "agent=med_sql",
    ("data", "dbbench"): "agent=dbbench",
    ("job", "status"): "job.sweep_dir=outputs/sweeps/any",  # the jobs' mandatory (???) keys
    ("job", "merge_lora"): "job.adapter_path=/any/adapter",
    ("job", "reward_model_serve"): "job.model_path=/any/model",
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
    check_run(cfg)
    check_job(cfg)


def test_model_presets_name_their_hub_ids() -> None:
    hub_ids = {o: compose_with(f"model={o}").model.hub_id for o in options("model")}
    assert hub_ids == {
        "tiny": None,
        "qwen3-0.6b": "Qwen/Qwen3-0.6B",
        "qwen2.5-coder-1.5b-instruct": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "qwen2.5-coder-3b-instruct": "Qwen/Qwen2.5-Coder-3B-Instruct",
        "qwen2.5-7b-instruct": "Qwen/Qwen2.5-7B-Instruct",
    }


def test_model_path_overrides_the_hub_id(tmp_path: Path) -> None:
    model = build_components(compose_with("model=qwen2.5-7b-instruct", f"model.path={tmp_path}"))["model"]
    assert model.prepare([]) == str(tmp_path)


def test_values_used_twice_are_written_once() -> None:
    cfg = compose_with("agent.sql_timeout_s=7", "paths.cache_dir=/elsewhere")
    assert cfg.reward.timeout_s == 7
    assert cfg.model.cache_dir == "/elsewhere/models" and cfg.data.spider_dir == "/elsewhere/spider_mini"


def test_tiny_selects_its_warm_start_and_cpu_sizes_but_real_models_do_not() -> None:
    tiny = compose_with()
    assert tiny.warmstart.name == "sft_tiny" and tiny.warmstart.rl_tasks == 16 and tiny.algorithm.max_steps > 0
    assert tiny.algorithm.pool_samples == 8
    real = compose_with("model=qwen2.5-7b-instruct")
    assert not real.warmstart and real.algorithm.max_prompt_length == 4096 and real.algorithm.pool_samples is None


def test_warmstart_none_means_no_warm_start_also_with_an_experiment_that_shortens_it() -> None:
    assert build_components(compose_with("experiment=smoke"))["warmstart"].steps == 5
    for overrides in (["experiment=smoke", "warmstart=none"], ["warmstart=none", "experiment=ablation-check-tiny"]):
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
        (["model=qwen2.5-7b-instruct", "model.path=/no/such/model"], "model.path"),
        (["model.chat_template=qwen9"], "model.chat_template"),
        (["model.chat_template=llama3"], "model.chat_template=llama3 writes tool calls as llama3_json"),
        (["data.split_seed=-1"], "data.split_seed"),
        (["algorithm.flops_budget=0"], "algorithm.flops_budget"),
        (["algorithm.gpu_s_budget=0"], "algorithm.gpu_s_budget"),
        (["algorithm.pool_samples=1"], "algorithm.pool_samples"),
        (["warmstart.path=/no/such/warmstart"], "warmstart.path"),
        (["model=qwen3-0.6b", "model.tool_call_format=xml"], "model.tool_call_format"),
        (["algorithm.is_correction=always"], "algorithm.is_correction"),
        (["algorithm.is_cap=0.5"], "algorithm.is_cap"),
        (["algorithm.reward_timeout_s=0"], "algorithm.reward_timeout_s"),
        (["algorithm.loss_type=bogus"], "algorithm.loss_type"),
        (["algorithm.time_budget_s=0"], "algorithm.time_budget_s"),
        (["algorithm=sft_control", "algorithm.max_prompt_length=512", "algorithm.max_steps=-1"], "sft_control needs"),
        (["experiment=learn-gpu", "algorithm=sft_control", "algorithm.sft_learning_rate=0"], "algorithm.sft_learn"),
        (["model=qwen2.5-7b-instruct", "algorithm=sft_control", "warmstart=none"], "algorithm=sft_control continues"),
        (["experiment=learn-gpu", "algorithm=sft_control", "finetune=lora"], "algorithm=sft_control trains every"),
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
    """One line on stderr naming the key, exit 1; the traceback goes to summary.json, not the terminal."""
    result = launch(["finetune=lora", "finetune.rank=0"], tmp_path / "cache", tmp_path / "out")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == "ConfigError: finetune.rank must be > 0, got 0"
    assert "Traceback" not in result.stderr + result.stdout
    summaries = list((tmp_path / "out").rglob("summary.json"))
    summary = json.loads(summaries[0].read_text())
    assert len(summaries) == 1 and summary["status"] == "failed" and "Traceback" in summary["traceback"]
    assert not (tmp_path / "cache" / "models").exists()  # nothing was built or loaded


@pytest.mark.integration
def test_launch_rejects_an_unknown_group_option(tmp_path: Path) -> None:
    result = launch(["model=qwen99"], tmp_path / "cache", tmp_path / "out")
    assert result.returncode != 0 and "model/qwen99" in result.stderr


@pytest.mark.integration
def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    result = launch(
        ["--cfg", "job", "model=qwen2.5-7b-instruct", "finetune=lora"], tmp_path / "cache", tmp_path / "out"
    )
    assert result.returncode == 0, result.stderr
    assert "hub_id: Qwen/Qwen2.5-7B-Instruct" in result.stdout and "rank: 32" in result.stdout


@pytest.mark.parametrize(
    ("agent", "data", "reward"),
    [
        ("spider_sql", "spider_mini", "exec_match"),
        ("med_sql", "med_qa", "answer_match"),
        ("dbbench", "dbbench", "dbbench_match"),
        ("lit", "spider_mini", "agent_reward"),
    ],
)
def test_an_agent_brings_its_data_and_reward(agent: str, data: str, reward: str) -> None:
    cfg = compose_with(f"agent={agent}")
    assert (cfg.agent.name, cfg.data.name, cfg.reward.name) == (agent, data, reward)
    assert compose_with(f"agent={agent}", "reward=rule").reward.name == "rule"  # the command line still decides


def test_the_learning_experiment_gives_both_arms_the_same_budget_and_warm_start() -> None:
    """experiment=learn-gpu: the GRPO settings it writes leave the control's own SFT keys alone."""
    grpo = build_components(compose_with("experiment=learn-gpu", "algorithm=grpo"))
    control = build_components(compose_with("experiment=learn-gpu", "algorithm=sft_control"))
    assert grpo["algorithm"].time_budget_s == control["algorithm"].time_budget_s == 150
    assert (grpo["algorithm"].learning_rate, control["algorithm"].sft_learning_rate) == (1e-4, 1e-4)
    assert control["algorithm"].sft_val_every == 1000 and grpo["algorithm"].val_every == 20
    assert grpo["warmstart"] == control["warmstart"] and control["warmstart"].shared
    assert grpo["algorithm"].lr_schedule == "constant_with_warmup" and grpo["algorithm"].lr_warmup_steps == 10


def test_an_agent_and_data_of_different_kinds_fail_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"agent=med_sql answers med_qa tasks; data=spider_mini"):
        build_components(compose_with("agent=med_sql", "data=spider_mini"))


# Every group's schema: ranges and choices declared on its dataclass's fields, checked before anything is built.


@cache
def schemas() -> dict[str, tuple[str, str, type]]:
    """Each group's schemas (an option's `_schema_`, else its `_target_` when that is a dataclass), by dotted name:
    (group, the first option that names it, the dataclass). The top level's are group "" and "resources"."""
    found: dict[str, tuple[str, str, type]] = {}
    for group_dir in sorted(p for p in CONF.iterdir() if p.is_dir()):
        for path in sorted(group_dir.glob("*.yaml")):
            text = path.read_text(encoding="utf-8")
            data = yaml.safe_load(text) or {}
            node = data.get(group_dir.name) if "@package _global_" in text.split("\n", 1)[0] else data
            name = (node or {}).get("_schema_") or (node or {}).get("_target_")
            if name and name not in found and dataclasses.is_dataclass(cls := get_object(name)):
                found[name] = (group_dir.name, path.stem, cls)
    found["jobs.config.RunSettings"] = ("", "", RunSettings)
    resources = next(f.default_factory for f in dataclasses.fields(RunSettings) if f.name == "resources")
    found["jobs.config.Resources"] = ("resources", "", resources)
    return found


def violations(spec: Mapping[str, Any]) -> list[str]:
    """Values that break a field's declared range (one per bound) or choices."""
    outside = {"ge": lambda b: b - 1, "gt": lambda b: b, "le": lambda b: b + 1, "lt": lambda b: b}
    values = [str(outside[name](bound)) for name, bound in spec.get("bounds", {}).items()]
    return values + (["not_one_of_them"] if "choices" in spec else [])


def check(group: str, cfg: DictConfig) -> None:
    """What validates `group` before anything is built."""
    if group in ("", "resources"):
        check_run(cfg)
    elif group == "job":
        check_job(cfg)
    else:
        check_schema(group, cfg[group])


def test_the_walk_finds_every_group_and_the_top_level() -> None:
    groups = {group for group, _, _ in schemas().values()}
    assert groups >= {*GROUPS, "endpoint", "logger", "", "resources"} - {"experiment"}
    assert {"DPOJob", "StatusJob", "DoctorJob", "TinyModel", "HubModel", "Endpoint", "LLMJudge"} <= {
        cls.__name__ for _, _, cls in schemas().values()
    }


@pytest.mark.parametrize("schema", sorted(schemas()))
def test_every_declared_range_and_choice_is_checked_naming_its_key(schema: str) -> None:
    group, option, cls = schemas()[schema]
    base = [f"{group}={option}"] if option else []
    base += [NEEDS[group, option]] if (group, option) in NEEDS else []
    for field, spec in declared(cls).items():
        key = f"{group}.{field}" if group else field
        for value in violations(spec):
            cfg = compose_with(*base, f"++{key}={value}")  # ++: also a key the option leaves to its default
            with pytest.raises(ConfigError) as raised:
                check(group, cfg)
            assert re.match(rf"{re.escape(key)}[ :]", str(raised.value)), (key, value, str(raised.value))


# str fields whose value is not one of a fixed set (prompts, paths, URLs, model and variable names, labels); every
# other str field of a schema declares its choices. `name`, the option's label, is free in every schema.
FREE_TEXT = {
    "DBBenchAgent": {"system_prompt", "task_prompt", "invalid_action_text"},
    "MedSQLAgent": {"instructions", "tool_description"},
    "LitAgentRunner": {"cls"},  # a class, package.module:Class
    "SpiderSQLAgent": {"system_prompt", "write_prompt", "check_prompt", "rewrite_prompt", "no_query_text", "dialect"},
    "VerlBackend": {"project_name"},
    "TRLBackend": {"device"},  # a torch device: auto, cpu, cuda, cuda:1, ...
    "DBBenchData": {"data_dir", "entry_file"},
    "MedQAData": {"data_dir", "train_split", "val_split", "test_split"},  # a split is any <name>.parquet there
    "SpiderData": {"spider_dir", "train_split", "val_split", "test_split", "val_subset_field"},  # train, dev, a file
    "SFTWarmstart": {"cache_dir", "path", "weights_sha256"},
    "Endpoint": {"base_url", "model", "api_key_env"},
    "HubModel": {"hub_id", "path"},
    "TinyModel": {"hub_id", "path", "cache_dir"},
    "LLMJudge": {"base_url", "model", "rubric", "api_key_env"},
    "RewardModelReward": {"base_url"},
    "WandbLogger": {"project", "entity"},
    "SwanLabLogger": {"project", "workspace"},
    "DPOJob": {"pairs"},
    "RewardModelTrainJob": {"pairs"},
    "RewardModelServeJob": {"model_path", "host"},
    "MergeLoraJob": {"adapter_path", "output_path"},
    "StatusJob": {"sweep_dir"},
}


def scalar_type(annotation: Any) -> Any:
    """int for `int` and `int | None`; the annotation itself otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


@pytest.mark.parametrize("schema", sorted(schemas()))
def test_every_number_has_a_range_and_every_enumerated_string_its_choices(schema: str) -> None:
    _, _, cls = schemas()[schema]
    hints = typing.get_type_hints(cls)
    free = FREE_TEXT.get(cls.__name__, set()) | {"name"}
    for field in dataclasses.fields(cls):
        kind = scalar_type(hints[field.name])
        if kind in (int, float):
            assert "bounds" in field.metadata, f"{cls.__name__}.{field.name}: a number with no declared range"
        elif kind is str and field.name not in free:
            assert "choices" in field.metadata, f"{cls.__name__}.{field.name}: not free text, yet no choices"
    strings = {f.name for f in dataclasses.fields(cls) if scalar_type(hints[f.name]) is str}
    assert FREE_TEXT.get(cls.__name__, set()) <= strings - set(declared(cls))  # no stale entry


def test_free_text_names_only_schemas_that_exist() -> None:
    assert set(FREE_TEXT) <= {cls.__name__ for _, _, cls in schemas().values()}


ISSUE_LINES = [
    ("algorithm", "algorithm.temperature=-1"),
    ("agent", "agent.sql_timeout_s=-1"),
    ("algorithm", "algorithm.loss_type=bogus"),
    ("agent", "agent.result_max_rows=0"),
    ("model", "model.vocab_size=0"),
    ("", "seed=abc"),
    ("endpoint", "endpoint.timeout_s=-1"),
    ("endpoint", "endpoint.max_tokens=0"),
    ("", "seed=-1"),
    ("resources", "resources.nodes=0"),
    ("resources", "resources.gpus_per_node=abc"),
    ("reward", "reward=hybrid reward.terms.judge.timeout_s=0"),  # the components a group builds itself
    ("reward", "reward=llm_judge reward.temperature=-0.5"),
    ("finetune", "finetune=lora finetune.rank=0"),
    ("job", "job=dpo job.learning_rate=0"),
    ("job", "job=reward_model_serve job.model_path=/m job.port=70000"),
    ("job", "job=status"),  # job.sweep_dir: ???
    ("job", "job=train +job.steps=10"),  # a job with no keys but its name
]


@pytest.mark.parametrize(("group", "line"), ISSUE_LINES, ids=[line for _, line in ISSUE_LINES])
def test_a_bad_value_is_rejected_naming_its_key(group: str, line: str) -> None:
    overrides = line.split()
    key = {"job=status": "job.sweep_dir"}.get(line) or overrides[-1].lstrip("+").split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}[ :]"):
        check(group, compose_with(*overrides))


def test_the_pool_experiment_gives_every_arm_one_warm_start_and_one_flops_budget() -> None:
    """experiment=learn-pool-gpu: four arms (GRPO, RFT, SFT continued on the warm start's demonstrations, a gold-SFT
    ceiling) from a warm start on a quarter of the tasks, at one FLOPs budget and no time budget."""
    arms = {
        name: build_components(compose_with("experiment=learn-pool-gpu", f"algorithm={name}"))
        for name in ("grpo", "rft", "sft_continue", "sft_ceiling")
    }
    assert {a["algorithm"].name for a in arms.values()} == {"grpo", "rft", "sft_control", "sft_ceiling"}
    assert {(a["algorithm"].flops_budget, a["algorithm"].time_budget_s) for a in arms.values()} == {(4.5e14, None)}
    assert {a["warmstart"].task_share for a in arms.values()} == {0.25}
    assert {a["algorithm"].pool_samples for a in arms.values()} == {16}
    assert (
        arms["sft_continue"]["algorithm"].sft_demos == "warmstart"
        and arms["sft_ceiling"]["algorithm"].sft_demos == "rl"
    )


def test_the_pool_study_s_two_budget_conditions_differ_only_in_the_budget_and_declare_a_family_each() -> None:
    """experiment=learn-pool-gpu-v2 (equal FLOPs) and -gpu-s (equal GPU-seconds): the same arms, warm start and
    cadence; one budget each; each condition its own declared family of three, one primary."""
    flops, gpu_s = (
        compose_with(f"experiment={p}", "algorithm=sft_ceiling")
        for p in ("learn-pool-gpu-v2", "learn-pool-gpu-v2-gpu-s")
    )
    budgets = {k: (flops.algorithm[k], gpu_s.algorithm[k]) for k in ("flops_budget", "gpu_s_budget", "time_budget_s")}
    assert budgets == {"flops_budget": (8.4e14, None), "gpu_s_budget": (None, 400), "time_budget_s": (None, None)}
    rest = [OmegaConf.masked_copy(c, [k for k in c if k not in ("analysis", "hydra")]) for c in (flops, gpu_s)]
    for c in rest:
        c.algorithm.flops_budget = c.algorithm.gpu_s_budget = None
    assert rest[0] == rest[1]
    families = [check_study(c.analysis) for c in (flops, gpu_s)]
    for family in families:
        assert [c.role for c in family.comparisons] == ["primary", "secondary", "secondary"]
    assert {c.name for c in families[0].comparisons}.isdisjoint(c.name for c in families[1].comparisons)


@pytest.mark.parametrize(("group", "old", "new"), [(g, o, n) for g, names in ALIASES.items() for o, n in names.items()])
def test_an_old_name_composes_exactly_what_its_new_name_does(group: str, old: str, new: str) -> None:
    def composed(option: str) -> dict[str, Any]:
        config = OmegaConf.to_container(compose_with(f"{group}={option}"), resolve=False)
        assert isinstance(config, dict)
        return config | {"hydra": None}  # the overrides it records name the option

    assert old not in options(group) and new in options(group)  # an alias, not a file beside its new name
    assert composed(old) == composed(new)


def test_the_old_names_go_on_their_date() -> None:
    assert date.today() <= REMOVE_ON, f"conf/aliases.yaml: the old names were due to go on {REMOVE_ON}: delete them"


@pytest.mark.parametrize("group", ["experiment", "model"])
def test_presets_and_model_options_are_named_in_one_scheme(group: str) -> None:
    """Lowercase words joined by hyphens (a dot inside a version: qwen2.5); the old names are aliases, not files."""
    assert [n for n in options(group) if not re.fullmatch(r"[a-z0-9.]+(-[a-z0-9.]+)*", n)] == []


COMPONENT_GROUPS = ["agent", "algorithm", "backend", "data", "endpoint", "finetune", "job", "logger", "reward",
                    "warmstart", "hydra/launcher"]  # fmt: skip


def test_every_group_is_one_of_the_two_schemes() -> None:
    """conf/README.md's "Names": what a `_target_` builds is a snake_case identifier (the label it reports under);
    presets and models are hyphenated; no group is left out of both."""
    groups = {str(p.parent.relative_to(CONF)) for p in CONF.rglob("*.yaml") if p.parent != CONF}
    assert groups == set(COMPONENT_GROUPS) | {"experiment", "model"}


@pytest.mark.parametrize("group", COMPONENT_GROUPS)
def test_component_options_are_snake_case_identifiers(group: str) -> None:
    assert options(group) and [n for n in options(group) if not re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", n)] == []


def test_a_config_recorded_before_the_warm_start_moved_still_builds_it() -> None:
    # results/ holds run configs that name backends.trl.sft (the warm start's module before it moved)
    from hydra.utils import instantiate

    from backends.sft import SFTWarmstart

    recorded = {"_target_": "backends.trl.sft.SFTWarmstart", "steps": 5}
    assert isinstance(instantiate(recorded), SFTWarmstart)


# The modules kept under an old import path only because run configs recorded in results/ name that path
OLD_PATHS = {"experiments.train.run": "jobs.train.run", "backends.trl.sft.SFTWarmstart": "backends.sft.SFTWarmstart"}


def test_every_target_a_recorded_config_names_still_resolves() -> None:
    recorded = [*ROOT.glob("results/**/.hydra/config.yaml"), *ROOT.glob("results/**/run_config.json")]
    pattern = r'"?_(?:target|schema)_"?:\s*"?([\w.]+)'
    targets = {name for path in recorded for name in re.findall(pattern, path.read_text(encoding="utf-8"))}
    unresolved = []
    for name in sorted(targets):
        try:
            get_object(name)
        except Exception as error:  # what Hydra says when a recorded config is run
            unresolved.append(f"{name}: {error}")
    assert unresolved == []
    for old, new in OLD_PATHS.items():  # one object under both names, and no old path kept that nothing records
        assert old in targets and get_object(old) is get_object(new)

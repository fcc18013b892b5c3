"""From a composed config to built components, failing before any model loads with the bad key named.

Each group's `_target_` is a dataclass, whose fields are the group's schema; a `job`'s `_target_` is a function, and
its option names its schema in `_schema_`. Unknown keys and wrong types are rejected by OmegaConf, ranges and choices
declared on the fields (`foundation.schema`) by `check_values`, what spans fields by the dataclass's `__post_init__`,
and what spans groups here. The top-level keys (`seed`, `resources`, `analysis`) are `RunSettings`'s, checked by
`check_run`; the job's by `check_job`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from backends.algorithm import SFTControl
from foundation.errors import ConfigError
from foundation.schema import check_values, number
from foundation.study import Declared, Study

COMPONENT_GROUPS = ("model", "finetune", "algorithm", "agent", "reward", "data", "backend", "warmstart", "endpoint")


# `_schema_`: the dataclass whose fields are the keys of an option whose `_target_` is not one (a job's function).
HYDRA_KEYS = {"_target_", "_recursive_", "_convert_", "_partial_", "_args_", "_schema_"}


@dataclass
class Resources:
    """What a run asks its cluster for and its trainer uses (`resources` in conf/config.yaml)."""

    nodes: int = number(1, ge=1)
    gpus_per_node: int = number(1, ge=0)  # 0: CPU jobs (a SLURM sweep on a CPU cluster)
    gpu_memory_gb: float | None = number(None, gt=0)  # each GPU's memory for the memory plan (null: read off the GPUs)


@dataclass
class RunSettings:
    """The top-level keys of conf/config.yaml that are settings of the run (the groups have their own schemas)."""

    seed: int = number(0, ge=0)  # every random generator of the run starts from it
    resources: Resources = field(default_factory=Resources)
    analysis: Study = field(default_factory=Study)  # what the study's verdicts are judged on (foundation/study.py)


def check_schema(group: str, node: DictConfig) -> None:
    """Reject keys the group's dataclass (`_schema_`, else `_target_`) does not have, values of the wrong type and
    values outside their declared ranges and choices; then the same for the components nested in it (`_target_`)."""
    key = "_schema_" if "_schema_" in node else "_target_"
    target = node.get(key)
    if target is None:
        raise ConfigError(f"{group}._target_ is missing")
    try:
        cls = get_object(target)
    except Exception as exc:
        raise ConfigError(f"{group}.{key}={target} cannot be imported: {exc}") from exc
    if not dataclasses.is_dataclass(cls):
        return
    check_fields(group, cls, node, target)
    for name, child in node.items():  # components built by this one: a field's, or a dict field's (reward.terms)
        if not isinstance(child, DictConfig):
            continue
        if "_target_" in child:
            check_schema(f"{group}.{name}", child)
            continue
        for sub_name, sub in child.items():
            if isinstance(sub, DictConfig) and "_target_" in sub:
                check_schema(f"{group}.{name}.{sub_name}", sub)


def check_fields(prefix: str, cls: type, node: DictConfig, known_as: str) -> None:
    """Check `node`'s keys, types, ranges and choices against dataclass `cls`, naming a bad key `<prefix>.<key>`."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(node.keys()) - fields - HYDRA_KEYS)
    if unknown:
        raise ConfigError(f"{_key(prefix, unknown[0])} is not a key of {known_as} (known: {', '.join(sorted(fields))})")
    values = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in HYDRA_KEYS}
    try:
        typed = OmegaConf.merge(OmegaConf.structured(cls), values)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        raise ConfigError(f"{_key(prefix, key)}: {exc.msg if hasattr(exc, 'msg') else exc}") from exc
    if missing := sorted(OmegaConf.missing_keys(typed)):
        raise ConfigError(f"{_key(prefix, missing[0])} must be set (it is ???)")
    check_values(prefix, cls, {k: typed[k] for k in values})


def _key(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def check_job(cfg: DictConfig) -> None:
    """The `job` group's keys, types, ranges and choices (its `_schema_`); a job with none has `name` only."""
    node = cfg.get("job")
    if not node:
        raise ConfigError("job is missing (job=train, job=eval, ...)")
    if "_schema_" not in node:
        extra = sorted(set(node.keys()) - {"name"} - HYDRA_KEYS)
        if extra:
            raise ConfigError(f"job.{extra[0]} is not a key of job={node.get('name')} (it has none but name)")
    check_schema("job", node)


def check_run(cfg: DictConfig) -> None:
    """The run's top-level settings (`seed`, `resources`, `analysis`): keys, types, ranges and what spans fields."""
    if "resources" in cfg:
        check_fields("resources", Resources, cfg.resources, "resources")
    if "analysis" in cfg:  # first: its comparisons' bad keys named in full
        check_study(cfg.analysis)
    node = OmegaConf.masked_copy(cfg, [f.name for f in dataclasses.fields(RunSettings) if f.name in cfg])
    check_fields("", RunSettings, node, "the run's settings")


def check_study(node: DictConfig) -> Study:
    """The study's declaration (`analysis`): each comparison's keys, types and role, then what spans them."""
    for i, comparison in enumerate(node.get("comparisons") or []):
        check_fields(f"analysis.comparisons[{i}]", Declared, comparison, "a declared comparison")
    check_fields("analysis", Study, node, "analysis")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Study), node))  # type: ignore[return-value]
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def build_group(cfg: DictConfig, group: str) -> Any:
    """Validate and instantiate one group's option; None for an empty option (such as `warmstart=none`)."""
    node = cfg.get(group)
    if not node:
        return None
    check_schema(group, node)
    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        message = str(cause)
        raise ConfigError(message if message.startswith(f"{group}.") else f"{group}: {message}") from exc


def build_components(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate every component group, then check what spans groups."""
    built = {group: build_group(cfg, group) for group in COMPONENT_GROUPS}
    check_cross_group(built)
    return built


def check_cross_group(built: dict[str, Any]) -> None:
    model, algo = built["model"], built["algorithm"]
    total = algo.max_prompt_length + algo.max_response_length
    if total > model.context_length:
        raise ConfigError(
            f"algorithm.max_response_length={algo.max_response_length}: with algorithm.max_prompt_length="
            f"{algo.max_prompt_length} it needs {total} tokens, more than model.context_length={model.context_length}"
        )
    if isinstance(algo, SFTControl) and built["warmstart"] is None:
        raise ConfigError("algorithm=sft_control continues the warm start's SFT: it needs warmstart=sft")
    if isinstance(algo, SFTControl) and built["finetune"].peft_config() is not None:
        raise ConfigError("algorithm=sft_control trains every weight: it needs finetune=full (LoRA is not built in)")
    agent, data = built["agent"], built["data"]
    if agent.task_kind != data.task_kind:
        raise ConfigError(
            f"agent={agent.name} answers {agent.task_kind} tasks; data={data.name} holds {data.task_kind} tasks "
            "(pick a matching data=, or leave data= to the agent's default)"
        )

"""From a composed config to built components, failing before any model loads with the bad key named.

Each group's `_target_` is a dataclass (or a function, for `job`). Its fields are the group's schema: unknown keys and
wrong types are rejected by OmegaConf, ranges and choices declared on the fields (`foundation.schema`) by
`check_values`, what spans fields by the dataclass's `__post_init__`, and what spans groups here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from foundation.errors import ConfigError
from foundation.schema import check_values

COMPONENT_GROUPS = ("model", "finetune", "algorithm", "agent", "reward", "data", "backend", "warmstart", "endpoint")


HYDRA_KEYS = {"_target_", "_recursive_", "_convert_", "_partial_", "_args_"}


def check_schema(group: str, node: DictConfig) -> None:
    """Reject keys the group's dataclass does not have and values of the wrong type."""
    target = node.get("_target_")
    if target is None:
        raise ConfigError(f"{group}._target_ is missing")
    try:
        cls = get_class(target)
    except Exception as exc:
        raise ConfigError(f"{group}._target_={target} cannot be imported: {exc}") from exc
    if not dataclasses.is_dataclass(cls):
        return
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(node.keys()) - fields - HYDRA_KEYS)
    if unknown:
        raise ConfigError(f"{group}.{unknown[0]} is not a key of {target} (known: {', '.join(sorted(fields))})")
    values = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in HYDRA_KEYS}
    try:
        typed = OmegaConf.merge(OmegaConf.structured(cls), values)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        raise ConfigError(f"{group}.{key}: {exc.msg if hasattr(exc, 'msg') else exc}") from exc
    check_values(group, cls, {k: typed[k] for k in values})


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
    agent, data = built["agent"], built["data"]
    if agent.task_kind != data.task_kind:
        raise ConfigError(
            f"agent={agent.name} answers {agent.task_kind} tasks; data={data.name} holds {data.task_kind} tasks "
            "(pick a matching data=, or leave data= to the agent's default)"
        )

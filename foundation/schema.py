"""Ranges and choices of config fields, declared on the group's dataclass field and checked before anything is built.

    group_size: int = number(8, ge=2)                 # a number and its bounds (ge, gt, le, lt; None: unbounded)
    loss_type: str = one_of("dapo", LOSS_TYPES)       # one of a fixed set of values
    max_tokens_per_turn: int | None = number(None, gt=0)   # None passes: "not set"

`jobs.config.check_schema` runs `check_values` on every group's values, after OmegaConf has checked keys and
types, so a bad value is a `ConfigError` naming `group.key` before any model loads. What spans fields stays in the
dataclass's `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from foundation.errors import ConfigError

_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b)}
_BOUNDS |= {"le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def number(
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A numeric field whose value must satisfy the given bounds (None, where the field allows it, always passes)."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return dataclasses.field(default=default, metadata={"bounds": bounds})


def one_of(default: Any, choices: Iterable[Any]) -> Any:
    """A field whose value must be one of `choices`."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


def value_error(key: str, value: Any, spec: Mapping[str, Any]) -> str | None:
    """Why `value` breaks the field's declared range or choices (`spec`: the field's metadata), or None."""
    if value is None:
        return None
    if "choices" in spec and value not in spec["choices"]:
        return f"{key} must be one of {', '.join(map(str, spec['choices']))}; got {value!r}"
    for name, bound in spec.get("bounds", {}).items():
        symbol, holds = _BOUNDS[name]
        if (isinstance(value, float) and math.isnan(value)) or not holds(value, bound):
            return f"{key} must be {symbol} {bound:g}, got {value!r}"
    return None


def check_values(group: str, cls: type, values: Mapping[str, Any]) -> None:
    """Raise ConfigError naming `group.key` (`key` for the top level, group "") for the first value outside its
    field's declared range or choices."""
    for field in dataclasses.fields(cls):
        if field.name not in values:
            continue
        key = f"{group}.{field.name}" if group else field.name
        if problem := value_error(key, values[field.name], field.metadata):
            raise ConfigError(problem)


def declared(cls: type) -> dict[str, Mapping[str, Any]]:
    """The fields of `cls` with a declared range or choices, and their declarations."""
    return {f.name: f.metadata for f in dataclasses.fields(cls) if "bounds" in f.metadata or "choices" in f.metadata}

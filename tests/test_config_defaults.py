"""One source per default, and every config key documented where it is written.

Defaults. The YAML in conf/ is the source of every value (it is what `python launch.py` runs); a dataclass default
exists for code that builds the object directly, and must then be the YAML's value, or absent (a required field).
The rule, per dataclass (an option's `_schema_`, else its `_target_` when that is a dataclass):

- Its base options are the options that name it themselves (their own file sets `_target_` or `_schema_`). What a base
  option inherits through its defaults list counts as written by it: conf/algorithm/rft.yaml and sft_control.yaml
  take conf/algorithm/grpo.yaml's keys, so RFT's and SFTControl's inherited defaults must be grpo.yaml's values (and
  sft_control's own `max_steps: 1000` SFTControl's).
- An option that sets no `_target_` of its own and takes a sibling through its defaults list (algorithm=grpo_tiny,
  warmstart=sft_tiny, agent=spider_sql_tiny, ...) is a variant: it overrides values on purpose and is not compared;
  nor are the experiment presets (they override other groups' keys).
- A dataclass that several base options name (conf/model/qwen*.yaml: HubModel; conf/data/spider.yaml and
  spider_mini.yaml: SpiderData) has no single base: a key they all write alike must equal the default, and a key they
  write differently is each option's choice, so its field must be required (no default): a default would silently
  pick one of them for an object built directly.
- A mandatory key (`???`) must be a required field too.
- Values are compared as composed (`<group>=<option>`, everything else at its default) and resolved. An interpolation
  that reads the machine or the run (`oc.env`, `hydra:`, `now:`, directly or through another key, like every
  `${paths.cache_dir}/...`) is skipped: its value differs per machine and run, so no default can equal it.
- Beside the groups: conf/config.yaml's `seed` and `resources` against RunSettings, its `hydra.callbacks.preflight`
  against Preflight (jobs/preflight.py), and conf/hydra/launcher/slurm.yaml against the keys SlurmConf declares
  itself (the keys it inherits are hydra-submitit-launcher's, whose defaults the YAML overrides on purpose).

Comments. Every leaf key of conf/**/*.yaml (a `key: value` line whose value is a scalar, a flow list or map, a block
scalar or a block list; not a key holding a nested mapping) has a trailing `# ...` comment or a comment line directly
above it at its own indentation. `_target_` and the entries of a `defaults:` list need none; `# @package` is a
directive, not a comment.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from functools import cache
from typing import Any

import pytest
import yaml
from hydra.utils import get_object
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.arl_launchers.config import SlurmConf
from jobs.config import HYDRA_KEYS, RunSettings
from jobs.preflight import Preflight
from tests.conftest import ROOT
from tests.test_config import CONF, compose_with, options

NO_DEFAULT = object()


def default_of(field: dataclasses.Field[Any]) -> Any:
    """The field's default (its factory's value), or NO_DEFAULT for a required field."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return NO_DEFAULT


def plain(value: Any) -> Any:
    """Tuples as lists, to compare a default with what YAML writes."""
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


RUN_RESOLVERS = ("oc.env:", "hydra:", "now:")


def reads_the_run(raw: Any, tree: dict[str, Any]) -> bool:
    """Whether an unresolved value reads the environment or the run (a run resolver, or a key that does)."""
    for ref in re.findall(r"\$\{([^}]*)\}", str(raw)):
        if ref.startswith(RUN_RESOLVERS):
            return True
        node: Any = tree
        for part in ref.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and reads_the_run(node, tree):
            return True
    return False


def own_schema(group: str, option: str) -> type | None:
    """The dataclass an option names in its own file (`_schema_`, else `_target_`), or None."""
    text = (CONF / group / f"{option}.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    node = data.get(group) if text.startswith("# @package _global_") else data
    name = (node or {}).get("_schema_") or (node or {}).get("_target_")
    cls = get_object(name) if name else None
    return cls if dataclasses.is_dataclass(cls) else None


def written(cfg: DictConfig, node: DictConfig, keys: set[str] | None = None) -> dict[str, Any]:
    """A composed node's keys and their resolved values (NO_DEFAULT for one that reads the machine or the run)."""
    tree = OmegaConf.to_container(cfg, resolve=False)
    raw = OmegaConf.to_container(node, resolve=False)
    values = {}
    for key, value in raw.items():
        if key in HYDRA_KEYS or (keys is not None and key not in keys):
            continue
        if OmegaConf.is_missing(node, key):
            values[key] = "???"  # mandatory: its field must be required too
        else:
            values[key] = NO_DEFAULT if reads_the_run(value, tree) else plain(resolved(node[key]))
    return values


def resolved(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


@cache
def sources() -> dict[type, list[tuple[str, dict[str, Any]]]]:
    """Each dataclass and what its base options write: [(their file, {key: resolved value})]."""
    found: dict[type, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for group_dir in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"):
        group = group_dir.name
        for option in options(group):
            if (cls := own_schema(group, option)) is not None:
                cfg = compose_with(f"{group}={option}")
                found[cls].append((f"conf/{group}/{option}.yaml", written(cfg, cfg[group])))
    top = compose_with()
    found[RunSettings].append(("conf/config.yaml", written(top, top, {"seed"})))
    resources = next(f.default_factory for f in dataclasses.fields(RunSettings) if f.name == "resources")
    found[resources].append(("conf/config.yaml", written(top, top.resources)))
    found[Preflight].append(("conf/config.yaml", written(top, top.hydra.callbacks.preflight)))
    slurm = compose_with("hydra/launcher=slurm")
    own = {f.name for f in dataclasses.fields(SlurmConf)} - {f.name for f in dataclasses.fields(SlurmQueueConf)}
    found[SlurmConf].append(("conf/hydra/launcher/slurm.yaml", written(slurm, slurm.hydra.launcher, own)))
    return dict(found)


def disagreements(cls: type) -> list[str]:
    """Where `cls`'s defaults disagree with what its base options write, one line each."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    by_key: dict[str, dict[str, Any]] = defaultdict(dict)
    for path, values in sources()[cls]:
        for key, value in values.items():
            if value is not NO_DEFAULT:
                by_key[key][path] = value
    problems = []
    for key, values in by_key.items():
        if key not in fields:
            problems.append(f"{', '.join(values)}: {key} is not a field of {cls.__name__}")
            continue
        default = default_of(fields[key])
        if default is NO_DEFAULT:
            continue
        distinct = {repr(v) for v in values.values()}
        if len(distinct) > 1:
            listed = ", ".join(f"{path}: {value!r}" for path, value in values.items())
            problems.append(f"{cls.__name__}.{key}: written differently ({listed}), yet defaults to {default!r}")
            continue
        for path, value in values.items():
            if value != plain(default):
                problems.append(f"{path}: {key}: YAML {value!r}, {cls.__name__} default {default!r}")
    return problems


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


SCHEMAS = sorted(sources(), key=qualname)


def test_the_walk_finds_every_schema() -> None:
    names = {cls.__name__ for cls in SCHEMAS}
    assert names >= {"GRPO", "RFT", "SFTControl", "SFTWarmstart", "SpiderSQLAgent", "MedSQLAgent", "DBBenchAgent"}
    assert names >= {"SpiderData", "MedQAData", "DBBenchData", "HubModel", "TinyModel", "VerlBackend"}
    assert names >= {"TRLBackend", "DPOJob", "RewardModelTrainJob", "Hybrid", "RunSettings", "Resources", "SlurmConf"}
    assert "Preflight" in names
    assert len(next(s for c, s in sources().items() if c.__name__ == "HubModel")) == 4


@pytest.mark.parametrize("cls", SCHEMAS, ids=qualname)
def test_every_default_is_its_yaml_value(cls: type) -> None:
    problems = disagreements(cls)
    assert not problems, "\n".join(problems)


def test_a_value_the_machine_or_the_run_decides_is_not_compared() -> None:
    tree = {"paths": {"cache_dir": "${oc.env:ARL_CACHE_DIR,.cache}"}, "agent": {"max_turns": 3}}
    assert reads_the_run("${paths.cache_dir}/models", tree) and reads_the_run("${hydra:runtime.choices.agent}", tree)
    assert not reads_the_run("${agent.max_turns}", tree) and not reads_the_run("plain", tree)


# Every leaf key documented.

KEY_LINE = re.compile(r"^(?P<indent> *)(?P<item>- +)?(?P<key>[^\s#'\"][^#]*?|'[^']*'|\"[^\"]*\"):(?:\s+(?P<rest>.*))?$")
QUOTED = re.compile(r"'[^']*'|\"(?:[^\"\\]|\\.)*\"")
EXEMPT_KEYS = {"_target_"}
YAML_FILES = sorted(p.relative_to(ROOT).as_posix() for p in CONF.rglob("*.yaml"))


def trailing_comment(rest: str) -> bool:
    """Whether a value (what follows `key:`) ends in a `# ...` comment (a `#` after a space, outside quotes)."""
    return re.search(r"(^|\s)#", QUOTED.sub('""', rest)) is not None


def undocumented(text: str) -> list[tuple[int, str]]:
    """(line number, key) of each leaf key with neither a trailing comment nor a comment line directly above it at its
    indentation."""
    lines = text.splitlines()
    found = []
    block_scalar_indent: int | None = None  # inside a block scalar (`key: |-`): the key's indentation
    defaults_indent: int | None = None  # inside a `defaults:` list: the key's indentation
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip(" "))
        if block_scalar_indent is not None:
            if not stripped or indent > block_scalar_indent:
                continue
            block_scalar_indent = None
        if not stripped or stripped.startswith("#"):
            continue
        if defaults_indent is not None:
            if indent > defaults_indent or (indent == defaults_indent and stripped.startswith("- ")):
                continue
            defaults_indent = None
        match = KEY_LINE.match(line)
        if match is None or match["item"]:
            continue  # a block list's entry: its key is the leaf
        key, rest = match["key"].strip(), (match["rest"] or "").strip()
        if key == "defaults" and not rest:
            defaults_indent = indent
            continue
        if key in EXEMPT_KEYS:
            continue
        if rest and not rest.startswith("#"):  # a value on the line: a scalar, a flow list or map, a block scalar
            if re.match(r"[|>][-+]?\d*(\s|$)", rest):
                block_scalar_indent = indent
            if trailing_comment(rest) or documented_above(lines, number - 1, indent):
                continue
            found.append((number, key))
            continue
        below = next((n for n in lines[number:] if n.strip() and not n.strip().startswith("#")), "")
        below_indent = len(below) - len(below.lstrip(" "))
        if below_indent > indent and not below.strip().startswith("- "):
            continue  # it holds a nested mapping; a block list or nothing (null) below it is its value: a leaf
        if rest.startswith("#") or documented_above(lines, number - 1, indent):
            continue
        found.append((number, key))
    return found


def documented_above(lines: list[str], index: int, indent: int) -> bool:
    """Whether the line before lines[index] is a comment at `indent` (not a `# @package` directive)."""
    if index == 0:
        return False
    above = lines[index - 1]
    stripped = above.strip()
    return (
        stripped.startswith("#")
        and not stripped.startswith("# @package")
        and len(above) - len(above.lstrip(" ")) == indent
    )


@pytest.mark.parametrize("path", YAML_FILES)
def test_every_leaf_key_has_a_comment(path: str) -> None:
    missing = undocumented((ROOT / path).read_text(encoding="utf-8"))
    assert not missing, "\n".join(f"{path}:{number}: {key} has no comment" for number, key in missing)


def test_the_comment_check_tells_leaves_from_blocks() -> None:
    text = """# @package _global_
defaults:
  - grpo
  - override /model: tiny

_target_: a.B
documented: 1   # it is
# it is, above
above: 2
bare: 3
url: "http://host/#anchor"
prompt: |-
  Question: {question}
nested:
  inner: x
  # at its indentation
  listed: [a, b]
flow: {a: 1}  # ok
blocklist:
  - a
empty:
after: 4   # ok
"""
    found = [(10, "bare"), (11, "url"), (12, "prompt"), (15, "inner"), (19, "blocklist"), (21, "empty")]
    assert undocumented(text) == found

"""Old option names (conf/aliases.yaml) as options of their groups: each is a config whose defaults list is its new
name, stored in Hydra's ConfigStore, which every composition searches. Hydra imports this module when it scans
`hydra_plugins` for plugins, before it composes (as it does hydra_plugins/arl_launchers/config.py)."""

from __future__ import annotations

from datetime import date
from pathlib import Path

import yaml
from hydra.core.config_store import ConfigStore

CONF = Path(__file__).resolve().parents[2] / "conf"
LISTED = yaml.safe_load((CONF / "aliases.yaml").read_text(encoding="utf-8"))
REMOVE_ON = date.fromisoformat(LISTED["remove_on"])  # the last day the old names compose
ALIASES: dict[str, dict[str, str]] = {group: names for group, names in LISTED.items() if group != "remove_on"}


def package_of(group: str, option: str) -> str | None:
    """`_global_` for an option whose file declares it (a preset: `# @package _global_`), else the group's (None)."""
    header = (CONF / group / f"{option}.yaml").read_text(encoding="utf-8").split("\n", 1)[0]
    return "_global_" if header == "# @package _global_" else None


for group, names in ALIASES.items():
    for old, new in names.items():
        node = {"defaults": [new]}
        ConfigStore.instance().store(group=group, name=old, node=node, package=package_of(group, new), provider="alias")

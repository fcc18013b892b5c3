"""job=doctor: a preflight table of what the selected run needs; exits non-zero when the run would fail.

Each row is `ok`, `FAIL` (the run would fail: the row says how to fix it), `warn` (worth knowing, not fatal) or
`-` (not used by this run). Nothing from verl or vLLM is imported at the top.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import netrc
import os
import shutil
import sys
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from backends.protocol import Needs
from foundation.errors import ConfigError
from foundation.run_dir import RunDir
from foundation.schema import number
from jobs import validate
from jobs.config import build_group
from jobs.preflight import probes, run_probes, settings

ROOT = Path(__file__).resolve().parent.parent
# vLLM is not in the verl extra (no CPU build); backend=verl ran with these (bench/results/verl_vs_trl_*.json).
VLLM_TESTED = ("0.20.2",)


@dataclass
class DoctorJob:
    """conf/job/doctor.yaml's keys."""

    name: str
    min_free_gb: float = number(20.0, ge=0)  # free disk wanted under paths.output_dir for checkpoints


@dataclass
class Row:
    check: str
    status: str  # ok | FAIL | warn | -
    value: str
    fix: str = ""


class PreflightFailed(RuntimeError):
    """At least one row would make the run fail."""


def extra_pins(extra: str) -> dict[str, str]:
    """A verified set: the pins of one of pyproject.toml's extras (`verl`: backend=verl's)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {}
    for line in extras[extra]:
        req = Requirement(line)
        pins[canonicalize_name(req.name)] = str(req.specifier).removeprefix("==")
    return pins


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _row(check: str, needed: bool, ok: bool, value: str, fix: str, *, soft: bool = False) -> Row:
    """`ok` when it holds; otherwise FAIL (or warn, when soft) if this run needs it, else `-`."""
    if ok:
        return Row(check, "ok", value)
    if not needed:
        return Row(check, "-", value)
    return Row(check, "warn" if soft else "FAIL", value, fix)


def python_rows() -> list[Row]:
    version = ".".join(map(str, sys.version_info[:3]))
    ok = (3, 11) <= sys.version_info[:2] < (3, 13)
    return [
        _row("python", True, ok, f"{version} ({sys.prefix})", "use Python 3.11 or 3.12 (pyproject requires-python)")
    ]


def torch_rows(backend: str, cuda: bool, gpus_per_node: int) -> list[Row]:
    import torch

    rows = [Row("torch", "ok", torch.__version__)]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = [torch.cuda.get_device_properties(i) for i in range(count)]
    listed = ", ".join(f"{p.name} {p.total_memory / 2**30:.0f} GiB" for p in gpus) or "none"
    cuda_text = f"CUDA {torch.version.cuda}, {count} GPU(s): {listed}" if count else "no CUDA GPU"
    fix = (
        f"backend={backend} needs resources.gpus_per_node={gpus_per_node} CUDA GPUs on each node: run on a GPU node "
        "(on CPU: job=validate checks the run)"
    )
    rows.append(_row("cuda / GPUs", cuda, count >= gpus_per_node, cuda_text, fix))
    return rows


def package_rows(backend: str, needs: Needs) -> list[Row]:
    """The backend's packages: an extra's pinned set (every pin, and what its main package requires of the rest),
    the distributions it names, vLLM; every pinned extra's rows are shown, `-` where this backend does not use it."""
    rows = []
    for extra in ("verl",):
        used = needs.pinned_extra == extra
        for dist, want in extra_pins(extra).items():
            have = _version(dist)
            fix = f"pip install -c constraints.txt -e '.[{extra}]' (pins {dist}=={want}), or make setup"
            rows.append(_row(dist, used, have == want, f"{have or 'not installed'} (pinned {want})", fix))
        if _version(extra) is not None:  # what it requires of the set itself (verl: transformers < 5.11, numpy >= 2)
            unmet = [
                f"{req.name} {req.specifier} (have {_version(req.name) or 'none'})"
                for req in map(Requirement, importlib.metadata.requires(extra) or [])
                if req.marker is None and not req.specifier.contains(_version(req.name) or "0", prereleases=True)
            ]
            value = "; ".join(unmet) or "all met"
            rows.append(
                _row(f"{extra}'s requirements", used, not unmet, value, f"install the versions {extra} requires")
            )
    for dist in needs.packages:
        have = _version(dist)
        rows.append(
            _row(dist, True, have is not None, have or "not installed", f"backend={backend} runs in .venv: make setup")
        )
    rows.append(vllm_row(needs.vllm))
    return rows


def vllm_row(needed: bool) -> Row:
    version = _version("vllm")
    tested = " or ".join(VLLM_TESTED)
    install = f"pip install vllm=={VLLM_TESTED[-1]} on the GPU machine (backend=verl ran with {tested})"
    if version is None:
        return _row("vllm", needed, False, "not installed", install)
    try:
        importlib.import_module("vllm")
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
        fix = install
        if "ProcessorMixin" in message:
            fix = (
                f"vLLM {version} and transformers {_version('transformers')} disagree (ProcessorMixin): install the "
                f"transformers vLLM {version} requires (pip show vllm), or vLLM {VLLM_TESTED[-1]} with the pinned set"
            )
        return _row("vllm", needed, False, f"{version}, import fails: {message[:160]}", fix)
    if version not in VLLM_TESTED:
        return _row("vllm", needed, False, f"{version} (tested: {tested})", install, soft=True)
    return Row("vllm", "ok", version)


def cluster_rows(cfg: DictConfig, needs: Needs) -> list[Row]:
    nodes = int(cfg.resources.nodes)
    address = os.environ.get("RAY_ADDRESS")
    fix = "start Ray across the allocation first (the SLURM launcher does; see README) and export RAY_ADDRESS"
    value = f"resources.nodes={nodes}, RAY_ADDRESS={address or 'unset'}"
    return [_row("ray cluster", needs.ray_across_nodes and nodes > 1, nodes == 1 or bool(address), value, fix)]


def wandb_rows(cfg: DictConfig) -> list[Row]:
    used = (cfg.get("logger") or {}).get("name") == "wandb"
    version = _version("wandb")
    try:
        logged_in = bool(os.environ.get("WANDB_API_KEY")) or bool(netrc.netrc().authenticators("api.wandb.ai"))
    except (FileNotFoundError, netrc.NetrcParseError):
        logged_in = False
    value = f"{version or 'not installed'}, {'logged in' if logged_in else 'not logged in'}"
    fix = "wandb login (or export WANDB_API_KEY), or drop wandb from backend.logger"
    return [_row("wandb", used, bool(version) and logged_in, value, fix)]


def disk_rows(cfg: DictConfig, min_free_gb: float) -> list[Row]:
    target = Path(cfg.paths.output_dir).resolve()
    existing = next(p for p in (target, *target.parents) if p.exists())
    free = shutil.disk_usage(existing).free / 2**30
    fix = f"free space at {existing} or point ARL_OUTPUT_DIR (paths.output_dir) at a disk with {min_free_gb:g} GiB"
    return [_row("disk (checkpoints)", True, free >= min_free_gb, f"{free:.0f} GiB free at {existing}", fix)]


def needs_rows(cfg: DictConfig) -> list[Row]:
    """What a training run of this config needs from outside itself, as every run's preflight checks it
    (jobs/preflight.py): the model's weights, the servers its rewards ask, the data's files, a warm start's path;
    SLURM's commands with hydra/launcher=slurm."""
    from hydra.core.hydra_config import HydraConfig

    launcher = str(HydraConfig.get().launcher.get("_target_", "")) if HydraConfig.initialized() else None
    found = run_probes(probes(cfg, settings(), job="train", launcher=launcher), settings().deadline_s(True))
    rows = [Row(f.check, "ok" if f.ok else "FAIL", f.value, f.fix) for f in found]
    if not any(r.check == "model" for r in rows):
        rows.insert(0, Row("model", "ok", f"model={cfg.model.name}: built on first use"))
    return rows


def config_rows(cfg: DictConfig, run_dir: RunDir) -> list[Row]:
    """Our config validation, then the backend's `prepare` (job=validate, written under the doctor's run directory)
    where its packages are installed."""
    try:
        validate.run(cfg, run_dir)
    except ModuleNotFoundError as exc:  # ours built and checked; the backend's own package is missing
        return [Row("config", "ok", f"ours valid; backend={cfg.backend.name}'s own check skipped ({exc.name} missing)")]
    except (ConfigError, ValueError, OSError) as exc:
        return [Row("config", "FAIL", str(exc)[:200], "fix the key the message names")]
    return [Row("config", "ok", f"ours and backend={cfg.backend.name}'s checks pass")]


def preflight(cfg: DictConfig, run_dir: RunDir) -> list[Row]:
    backend = str(cfg.backend.name)
    try:
        needs = build_group(cfg, "backend").needs
    except ConfigError as exc:
        return [Row("backend", "FAIL", str(exc)[:200], "fix the key the message names")]
    return [
        *python_rows(),
        *torch_rows(backend, needs.cuda, int(cfg.resources.gpus_per_node)),
        *package_rows(backend, needs),
        *cluster_rows(cfg, needs),
        *wandb_rows(cfg),
        *disk_rows(cfg, float(cfg.job.min_free_gb)),
        *needs_rows(cfg),
        *config_rows(cfg, run_dir),
    ]


def table(rows: list[Row]) -> str:
    widths = [max(len(getattr(r, k)) for r in rows) for k in ("check", "status")]
    lines = []
    for r in rows:
        line = f"{r.check:<{widths[0]}}  {r.status:<{widths[1]}}  {r.value}"
        lines.append(
            line + (f"\n{'':<{widths[0] + widths[1] + 4}}fix: {r.fix}" if r.status in ("FAIL", "warn") else "")
        )
    return "\n".join(lines)


def run(cfg: DictConfig, run_dir: RunDir) -> dict[str, Any]:
    rows = preflight(cfg, run_dir)
    print(f"preflight for backend={cfg.backend.name}, model={cfg.model.name}:\n{table(rows)}", flush=True)
    (run_dir.path / "doctor.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    failed = [r.check for r in rows if r.status == "FAIL"]
    if failed:
        raise PreflightFailed(f"{len(failed)} check(s) would make this run fail: {', '.join(failed)}")
    return {"checks": len(rows), "warnings": [r.check for r in rows if r.status == "warn"]}

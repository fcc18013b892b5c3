"""The preflight: what a run needs from outside itself, checked in seconds before any weights load.

- the model's weights: `model.path` (a directory with a config.json), else the hub cache (config and weights), else
  one HEAD request to the hub with a short timeout and no retries (none with HF_HUB_OFFLINE=1: the cache only);
- every server a reward or the evaluation talks to, one request each: a judge (`GET <base_url>/models`), the reward
  model's server (`GET /health`), job=eval's endpoint (`GET /models`);
- the data set's files for the splits the job reads (`data.spider_dir`, `data.data_dir`), and paths a job is given
  (`warmstart.path`, `job.pairs`, `job.model_path`, `job.adapter_path`);
- SLURM's commands for a sweep with `hydra/launcher=slurm` (`sbatch` and `squeue` on PATH, squeue answering);
- with `data.engine=mysql` (DB-bench on a server), PyMySQL installed and the server (`data.mysql`) answering one
  `SELECT VERSION()` as its account.

Each failure is one line that names the key or the environment variable to set; then the process exits 1, before
anything is loaded or launched. A single run (`python launch.py ...`) is checked by the Hydra callback's
`on_run_start`, before Hydra makes its run directory; a sweep (`launch.py -m`) by `on_multirun_start`, once for all
of its runs (each run's config composed, identical checks done once, runs that completed before skipped). The runs
themselves never call it: Hydra calls neither hook in a sweep's jobs (in this process, a joblib worker or a SLURM
job) nor in the ranks of a run of several processes. The network checks run at once, each bounded; no secret (a key,
credentials in a URL) is printed. `hydra.callbacks.preflight` holds its settings (conf/config.yaml); job=doctor shows
the same checks as rows of its table.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from foundation.ranks import started_by_launcher
from foundation.schema import check_values, number

# The servers a reward talks to, by its `_target_`: the route one GET asks and what to call the server. A reward
# not listed whose config has a `base_url` is asked `GET <base_url>` (any HTTP answer: it is up).
REWARD_SERVERS = {
    "rewards.llm_judge.LLMJudge": ("/models", "the judge"),
    "rewards.reward_model.RewardModelReward": ("/health", "the reward model's server"),
}
# What each job reads, by `job.name` ("pairs": the data set when job.pairs is null); a job in neither table (doctor,
# status, one of your own) is not checked.
NEEDS: dict[str, tuple[str, ...]] = {
    "train": ("model", "warmstart", "reward", "data"),
    "eval": ("endpoint", "data"),
    "dpo": ("model", "pairs"),
    "reward_model_train": ("model", "pairs"),
    "validate": ("model",),
}
# The job's own keys that name a path to read, by `job.name`.
JOB_PATHS: dict[str, tuple[str, ...]] = {
    "dpo": ("pairs",),
    "reward_model_train": ("pairs",),
    "reward_model_serve": ("model_path",),
    "merge_lora": ("adapter_path",),
}
ENV_REF = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class Finding:
    """One check's outcome: `fix` (when not ok) is the line a user reads, naming the key or variable to set."""

    check: str
    ok: bool
    value: str
    fix: str = ""


@dataclass
class Probe:
    """A check not run yet. `key` identifies it: a sweep's runs that need the same check share one."""

    key: tuple[Any, ...]
    run: Callable[[], list[Finding]]
    label: str  # what it checks, as a failure names it (no secret)
    network: bool = False  # run at once with the others, bounded by the deadline


def offline() -> bool:
    """HF_HUB_OFFLINE as models/hub.py reads it (weights are then loaded from the cache or model.path only)."""
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


# Secrets: credentials in a URL, its query, an API key. Never printed.


def shown_url(url: str) -> str:
    """`url` without its credentials and query (`https://u:p@host/v1?key=k` -> `https://***@host/v1?***`)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a URL that does not parse)"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", ""))


def scrubbed(text: str, secrets: Iterable[str]) -> str:
    """`text` with each secret (of 4 characters or more) replaced by ***."""
    for secret in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def url_secrets(url: str) -> list[str]:
    try:
        parts = urlsplit(url)
    except ValueError:
        return [url]
    found = [parts.query] if parts.query else []
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        found += [userinfo, *userinfo.split(":")]
    return found


def error_text(exc: BaseException, secrets: Iterable[str] = ()) -> str:
    """An exception as a short line: its type and the first line of its message, secrets removed."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return scrubbed(f"{type(exc).__name__}: {message}"[:200] if message else type(exc).__name__, secrets)


# The checks.


def path_findings(check: str, key: str, path: str, what: str, fix: str, *, config_json: bool = False) -> list[Finding]:
    """`key`=`path` must exist (and hold a config.json, for a model directory)."""
    p = Path(path).expanduser()
    if not p.exists():
        return [Finding(check, False, f"{path}: does not exist", f"{key}={path} does not exist: {fix}")]
    if config_json and p.is_dir() and not (p / "config.json").is_file():
        message = f"{key}={path} holds no config.json: it must be {what} (a Hugging Face model directory)"
        return [Finding(check, False, f"{path}: no config.json", message)]
    return [Finding(check, True, path)]


def weights_cached(hub_id: str) -> bool:
    """Whether the hub cache holds `hub_id`'s config.json and its weights (every shard its index lists)."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(hub_id, "config.json")
    if not isinstance(config, str):
        return False
    snapshot = Path(config).parent
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (snapshot / index).is_file():
            try:
                shards = set(json.loads((snapshot / index).read_text(encoding="utf-8"))["weight_map"].values())
            except (OSError, ValueError, KeyError, AttributeError):
                return False
            return all((snapshot / shard).is_file() for shard in shards)
    return any((snapshot / name).is_file() for name in ("model.safetensors", "pytorch_model.bin"))


def hub_findings(hub_id: str, timeout_s: float) -> list[Finding]:
    """The hub's weights: in the cache, or the hub answering one HEAD request for config.json within `timeout_s`."""
    if weights_cached(hub_id):
        return [Finding("model", True, f"{hub_id}: in the hub cache")]
    snapshot = f"set model.path to a local snapshot (hf download {hub_id} --local-dir DIR, where the hub is reachable)"
    if offline():
        fix = (
            f"model.path: {hub_id} (model.hub_id) is not in the hub cache and HF_HUB_OFFLINE=1 downloads nothing: "
            f"{snapshot}, or fill the cache first (hf download {hub_id})"
        )
        return [Finding("model", False, f"{hub_id}: not in the hub cache (HF_HUB_OFFLINE=1)", fix)]
    import httpx
    from huggingface_hub import constants, get_token

    # One HEAD request (httpx's own: huggingface_hub's calls may first fetch a registry of their own, and retry)
    url = f"{constants.ENDPOINT}/{hub_id}/resolve/main/config.json"
    token = get_token()
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = httpx.head(url, headers=headers, timeout=timeout_s, follow_redirects=True)
    except Exception as exc:  # no network, DNS, a timeout: the hub cannot be used from here
        why = error_text(exc, [token] if token else [])
        fix = (
            f"model.path: {hub_id} (model.hub_id) is not in the hub cache and the hub ({constants.ENDPOINT}) did not "
            f"answer ({why}): {snapshot}; or fill the hub cache and set HF_HUB_OFFLINE=1"
        )
        return [Finding("model", False, f"{hub_id}: not cached, hub unreachable", fix)]
    error = response.headers.get("X-Error-Code", "")
    if error == "GatedRepo" or response.status_code == 403:
        fix = (
            f"HF_TOKEN: {hub_id} is gated and the hub refused this machine's token: accept its terms on the hub, then "
            f"hf auth login (or export HF_TOKEN); or {snapshot}"
        )
        return [Finding("model", False, f"{hub_id}: gated", fix)]
    if error == "RepoNotFound" or response.status_code == 401:
        fix = f"model.hub_id={hub_id}: the hub has no such model (or it is private: HF_TOKEN); fix it, or {snapshot}"
        return [Finding("model", False, f"{hub_id}: not on the hub", fix)]
    if error == "EntryNotFound":
        fix = f"model.hub_id={hub_id}: the hub's {hub_id} has no config.json (not a transformers model); fix it"
        return [Finding("model", False, f"{hub_id}: no config.json", fix)]
    if response.status_code >= 400:
        fix = (
            f"model.path: {hub_id} (model.hub_id) is not in the hub cache and the hub ({constants.ENDPOINT}) answered "
            f"{response.status_code}: {snapshot}; or fill the hub cache and set HF_HUB_OFFLINE=1"
        )
        return [Finding("model", False, f"{hub_id}: not cached, hub answered {response.status_code}", fix)]
    return [Finding("model", True, f"{hub_id}: on the hub (downloaded on first use)")]


def model_probe(cfg: DictConfig, timeout_s: float) -> Probe | None:
    """The model's weights; None for a model built on first use (model=tiny without a path)."""
    node = cfg.model
    path, hub_id = node.get("path"), node.get("hub_id")
    if path:
        fix = f"download it (hf download {hub_id} --local-dir {path})" if hub_id else "build it (model.path=null)"
        return Probe(
            ("path", "model.path", path),
            lambda: path_findings("model", "model.path", path, "a model directory", fix, config_json=True),
            "model.path",
        )
    if not hub_id:
        return None
    return Probe(("hub", hub_id), lambda: hub_findings(hub_id, timeout_s), f"model.path ({hub_id} on the hub)", True)


def server_findings(
    check: str,
    url_key: str,
    base_url: str,
    route: str,
    what: str,
    *,
    env: str | None,
    key_env: str | None,
    timeout_s: float,
    hint: str = "",
) -> list[Finding]:
    """One GET of `base_url` + `route` within `timeout_s`. Unreachable, a refused key or a server error fails."""
    import httpx

    key = os.environ.get(key_env) if key_env else None
    secrets = [*url_secrets(base_url), *([key] if key else [])]
    shown = shown_url(base_url)
    to_set = env or url_key
    default = f", the default: {env} is not set" if env and env not in os.environ else ""
    where = f"{what} at {shown} ({url_key}{default})"
    try:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.get(base_url.rstrip("/") + route, headers=headers, timeout=timeout_s)
    except Exception as exc:
        why = error_text(exc, secrets)
        fix = f"{to_set}: {where} does not answer ({why}): start it, or set {to_set}{hint}"
        return [Finding(check, False, f"{shown}: {why}", fix)]
    if response.status_code in (401, 403) and key_env:
        fix = f"{key_env}: {where} refused the key in ${key_env} ({response.status_code}): set {key_env}"
        return [Finding(check, False, f"{shown}: {response.status_code}", fix)]
    if response.status_code >= 500:
        fix = f"{to_set}: {where} answered {response.status_code} to GET {route}: is it up? or set {to_set}{hint}"
        return [Finding(check, False, f"{shown}: {response.status_code}", fix)]
    return [Finding(check, True, f"{shown}: answers")]


def raw_value(node: DictConfig, key: str) -> str:
    """A key's value as written, before interpolation (`${oc.env:JUDGE_BASE_URL,...}`)."""
    return str((OmegaConf.to_container(node, resolve=False) or {}).get(key, ""))  # type: ignore[union-attr]


def reward_probes(node: Any, prefix: str, timeout_s: float) -> list[Probe]:
    """One probe per server the reward (and the terms it is built from) asks: each node with a `base_url`."""
    if not isinstance(node, DictConfig):
        return []
    probes = []
    if "_target_" in node and "base_url" in node:
        target = str(node._target_)
        route, what = REWARD_SERVERS.get(target, ("", "the reward's server"))
        env_refs = ENV_REF.findall(raw_value(node, "base_url"))
        env = env_refs[0] if env_refs else None
        key_env = node.get("api_key_env")
        base_url = str(node.base_url)
        hint = ""
        if target == "rewards.llm_judge.LLMJudge":
            hint = " to its OpenAI-compatible URL (reward=hybrid and reward=llm_judge need a judge)"
        elif target == "rewards.reward_model.RewardModelReward":
            hint = " to the URL of job=reward_model_serve"
        probes.append(
            Probe(
                ("server", base_url, route, key_env),
                lambda: server_findings(
                    prefix,
                    f"{prefix}.base_url",
                    base_url,
                    route,
                    what,
                    env=env,
                    key_env=key_env,
                    timeout_s=timeout_s,
                    hint=hint,
                ),
                f"{env or prefix + '.base_url'} ({what} at {shown_url(base_url)})",
                network=True,
            )
        )
    for name, child in node.items():
        probes += reward_probes(child, f"{prefix}.{name}", timeout_s)
    return probes


def endpoint_findings(node: DictConfig, timeout_s: float) -> list[Finding]:
    """job=eval's endpoint: `GET /models` answers, and names the model when endpoint.model is not set (as
    agent.llm.Endpoint.check_reachable asks it again when the job starts)."""
    import httpx

    base_url, key_env = str(node.base_url), str(node.get("api_key_env") or "OPENAI_API_KEY")
    key = os.environ.get(key_env)
    secrets = [*url_secrets(base_url), *([key] if key else [])]
    shown, url = shown_url(base_url), base_url.rstrip("/") + "/models"
    try:
        response = httpx.get(url, headers={"Authorization": f"Bearer {key or 'EMPTY'}"}, timeout=timeout_s)
    except Exception as exc:
        why = error_text(exc, secrets)
        fix = f"endpoint.base_url={shown} is not reachable ({why}): start the server, or set endpoint.base_url"
        return [Finding("endpoint", False, f"{shown}: {why}", fix)]
    if response.status_code in (401, 403):
        fix = f"{key_env}: endpoint.base_url={shown} refused the key in ${key_env}: set it (endpoint.api_key_env)"
        return [Finding("endpoint", False, f"{shown}: {response.status_code}", fix)]
    if node.get("model") is None:
        try:
            served = [m.get("id") for m in response.json().get("data", [])] if response.is_success else []
        except (ValueError, AttributeError):
            served = []
        if len(served) != 1:
            fix = f"endpoint.model is not set and {shown}/models lists {served or 'nothing'}: set endpoint.model"
            return [Finding("endpoint", False, f"{shown}: lists {len(served)} models", fix)]
    return [Finding("endpoint", True, f"{shown}: answers")]


def data_findings(cfg: DictConfig, splits: Sequence[str]) -> list[Finding]:
    """The data set builds (its directory exists) and holds the files of `splits` (`missing_files`, where the data
    class has it; generated data is written on first use)."""
    from jobs.config import build_group

    try:
        data = build_group(cfg, "data")
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError; each message names the key
        return [Finding("data", False, str(exc), str(exc))]
    missing = getattr(data, "missing_files", None)
    problems = list(missing(splits)) if missing is not None else []
    if not problems:
        return [Finding("data", True, f"data={data.name}: {', '.join(splits)}")]
    return [Finding("data", False, problem, problem) for problem in problems]


def slurm_findings(timeout_s: float) -> list[Finding]:
    """hydra/launcher=slurm submits with sbatch and watches with squeue: both on PATH, and squeue answering."""
    other = "or pick hydra/launcher=local (or local_parallel)"
    for command in ("sbatch", "squeue"):
        if shutil.which(command) is None:
            fix = (
                f"hydra/launcher=slurm: {command} is not on PATH: launch from a machine with SLURM's client commands "
                f"(a login node; PATH, SLURM_CONF), {other}"
            )
            return [Finding("slurm", False, f"{command}: not on PATH", fix)]
    try:
        answer = subprocess.run(["squeue", "-h", "--me", "-o", "%i"], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        fix = (
            f"hydra/launcher=slurm: squeue did not answer within {timeout_s:g} s: is the controller up (scontrol "
            f"ping; SLURM_CONF)? {other}"
        )
        return [Finding("slurm", False, "squeue: no answer", fix)]
    except OSError as exc:
        fix = f"hydra/launcher=slurm: squeue does not run ({exc}), {other}"
        return [Finding("slurm", False, f"squeue: {exc}", fix)]
    if answer.returncode != 0:
        said = (answer.stderr.strip().splitlines() or [f"exit status {answer.returncode}"])[-1][:200]
        fix = f"hydra/launcher=slurm: squeue failed ({said}): check the controller (scontrol ping; SLURM_CONF), {other}"
        return [Finding("slurm", False, f"squeue: {said}", fix)]
    return [Finding("slurm", True, "sbatch, squeue: answer")]


def mysql_findings(node: DictConfig, timeout_s: float) -> list[Finding]:
    """data.engine=mysql: the driver installed, and the server `node` (data.mysql) answering as its account within
    `timeout_s`."""
    from agent.mysql_tool import MySQLServer, driver
    from foundation.errors import ConfigError

    try:
        driver()
        server = MySQLServer(**OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]
    except (ConfigError, TypeError) as exc:
        return [Finding("mysql", False, str(exc), str(exc))]
    password = os.environ.get(server.password_env, "")
    try:
        version = server.check(timeout_s)
    except Exception as exc:
        why = error_text(exc, [password])
        if exc.args and exc.args[0] == 1045:  # access denied
            fix = (
                f"{server.password_env}: the MySQL server {server.where()} (data.mysql, data.engine=mysql) refused the "
                f"account ({why}): set {server.password_env} (and DBBENCH_MYSQL_USER, data.mysql.user)"
            )
        else:
            fix = (
                f"DBBENCH_MYSQL_HOST: the MySQL server {server.where()} (data.mysql, engine=mysql) does not answer "
                f"({why}): start it, or set DBBENCH_MYSQL_HOST and DBBENCH_MYSQL_PORT (or DBBENCH_MYSQL_SOCKET)"
            )
        return [Finding("mysql", False, f"{server.where()}: {why}", fix)]
    return [Finding("mysql", True, f"{server.where()}: {version}")]


def data_splits(cfg: DictConfig, job: str) -> tuple[str, ...]:
    """The splits a job reads: training all three (the final model meets the test split), eval the one it asks."""
    if job == "eval":
        return (str(cfg.job.get("split", "val")),)
    if job in ("dpo", "reward_model_train"):
        return ("train",)
    return ("train", "val", "test")


def probes(cfg: DictConfig, settings: Preflight, *, job: str | None = None, launcher: str | None = None) -> list[Probe]:
    """The checks `cfg`'s job needs (`job`: check as that job instead), no I/O yet; `launcher`: the sweep's
    launcher (`hydra.launcher._target_`), checked too."""
    job = job or str(cfg.job.get("name", ""))
    needs, found = NEEDS.get(job, ()), []
    if "model" in needs and cfg.get("model"):
        found.append(model_probe(cfg, settings.timeout_s))
    if "warmstart" in needs and cfg.get("warmstart") and cfg.warmstart.get("path"):
        path = str(cfg.warmstart.path)
        fix = "point it at a warm start's checkpoint directory (summary.json: sft.path), or set warmstart.path=null"
        check = partial(path_findings, "warmstart", "warmstart.path", path, "", fix)
        found.append(Probe(("path", "warmstart.path", path), check, "warmstart.path"))
    if "reward" in needs and cfg.get("reward"):
        found += reward_probes(cfg.reward, "reward", settings.timeout_s)
    if "endpoint" in needs and cfg.get("endpoint"):
        node = cfg.endpoint
        key = ("endpoint", str(node.base_url), node.get("model"), node.get("api_key_env"))
        found.append(Probe(key, lambda: endpoint_findings(node, settings.timeout_s), "endpoint.base_url", True))
    uses_data = "data" in needs or ("pairs" in needs and not cfg.job.get("pairs"))
    if uses_data and cfg.get("data") and not cfg.data.get("generate"):  # generated data: written on first use
        splits = data_splits(cfg, job)
        content = json.dumps(OmegaConf.to_container(cfg.data, resolve=True), sort_keys=True, default=str)
        found.append(Probe(("data", content, splits), lambda: data_findings(cfg, splits), f"data={cfg.data.name}"))
    if uses_data and cfg.get("data") and cfg.data.get("engine") == "mysql" and cfg.data.get("mysql") is not None:
        server = json.dumps(OmegaConf.to_container(cfg.data.mysql, resolve=True), sort_keys=True, default=str)
        check = partial(mysql_findings, cfg.data.mysql, settings.timeout_s)
        found.append(Probe(("mysql", server), check, "data.mysql (the MySQL server)", network=True))
    for name in JOB_PATHS.get(job, ()):
        if value := cfg.job.get(name):
            key, value = f"job.{name}", str(value)
            found.append(Probe(("path", key, value), partial(path_findings, "job", key, value, "", "fix it"), key))
    if launcher and launcher.endswith("SlurmLauncher"):
        found.append(Probe(("slurm",), lambda: slurm_findings(settings.slurm_timeout_s), "hydra/launcher=slurm", True))
    return [p for p in found if p is not None]


def run_probes(checks: Iterable[Probe], deadline_s: float) -> list[Finding]:
    """Every distinct check once: the network ones at once in daemon threads (left behind, never waited for, past
    `deadline_s`), the local ones here meanwhile. A check that raises is a failure saying so."""
    unique = list({p.key: p for p in checks}.values())
    results: dict[int, list[Finding]] = {}

    def run(i: int, probe: Probe) -> None:
        try:
            results[i] = probe.run()
        except Exception as exc:  # a bug of the check's own: said, not hidden
            results[i] = [
                Finding(probe.label, False, error_text(exc), f"{probe.label}: the check failed: {error_text(exc)}")
            ]

    start = time.monotonic()
    threads = []
    for i, probe in enumerate(unique):
        if probe.network:
            thread = threading.Thread(target=run, args=(i, probe), name=f"preflight-{i}", daemon=True)
            thread.start()
            threads.append(thread)
    for i, probe in enumerate(unique):
        if not probe.network:
            run(i, probe)
    for thread in threads:
        thread.join(max(0.0, deadline_s - (time.monotonic() - start)))
    findings = []
    for i, probe in enumerate(unique):
        if i not in results:
            fix = f"{probe.label}: no answer within {deadline_s:g} s (hydra.callbacks.preflight.timeout_s)"
            results[i] = [Finding(probe.label, False, "no answer", fix)]
        findings += results[i]
    return findings


def sweep_configs(config: DictConfig) -> list[DictConfig]:
    """Each run's config of the sweep `config` starts (what Hydra's basic sweeper will launch: `hydra.sweeper.params`
    and the command line), less the runs that completed before in its directory; [config] for another sweeper or
    when the runs cannot be composed here (the sweeper then says why)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from jobs.sweep import RunDirConflict, completed_run

    sweeper = config.hydra.sweeper
    if not str(sweeper.get("_target_", "")).endswith("BasicSweeper") or not GlobalHydra.instance().is_initialized():
        return [config]
    loader = GlobalHydra.instance().config_loader()
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    arguments = [*params, *OmegaConf.to_container(config.hydra.overrides.task, resolve=False)]  # type: ignore[misc]
    try:
        (jobs,) = BasicSweeper.split_arguments(
            OverridesParser.create(config_loader=loader).parse_overrides(arguments), None
        )
        configs = [loader.load_sweep_config(config, list(overrides)) for overrides in jobs]
    except Exception:
        return [config]
    sweep_dir = Path(str(config.hydra.sweep.dir))
    numbered = OmegaConf.to_container(config.hydra.sweep)["subdir"] == "${hydra.job.num}"  # type: ignore[index]
    if not (numbered and sweep_dir.is_dir()):
        return configs
    to_run = []
    for num, (overrides, cfg) in enumerate(zip(jobs, configs, strict=True)):
        try:
            if completed_run(sweep_dir / str(num), list(overrides)) is not None:
                continue
        except RunDirConflict:
            pass  # the launcher refuses it, naming the directory
        to_run.append(cfg)
    return to_run


def failure_text(findings: list[Finding], runs: int | None = None) -> str:
    failed = list(dict.fromkeys(f.fix for f in findings if not f.ok))
    what = "this run cannot start" if runs is None else f"this sweep ({runs} run{'s' * (runs != 1)}) cannot start"
    return "\n".join([f"preflight: {what}; nothing was loaded or launched:", *(f"  {line}" for line in failed)])


def passed_text(findings: list[Finding], runs: int | None = None) -> str:
    checks = ", ".join(dict.fromkeys(f.check for f in findings))
    return f"preflight{'' if runs is None else f' ({runs} run' + 's' * (runs != 1) + ')'}: {checks} ok"


@dataclass
class Preflight(Callback):
    """`hydra.callbacks.preflight` (conf/config.yaml): the checks above before a run or a sweep starts."""

    enabled: bool = True  # false: start without the checks
    timeout_s: float = number(5.0, gt=0)  # each network check's one request (the hub, a judge, a server)
    slurm_timeout_s: float = number(10.0, gt=0)  # squeue's answer (a controller that is down takes ~9 s to say so)

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        check_values("hydra.callbacks.preflight", type(self), values)

    def deadline_s(self, slurm: bool) -> float:
        return max(self.timeout_s, self.slurm_timeout_s if slurm else 0.0) + 2.0

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.enabled or started_by_launcher():  # a rank: the process that started it checked
            return
        self.check([config], sweep=False)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.enabled or started_by_launcher():
            return
        self.check(sweep_configs(config), sweep=True, launcher=str(config.hydra.launcher.get("_target_", "")))

    def check(self, configs: list[DictConfig], *, sweep: bool, launcher: str | None = None) -> list[Finding]:
        """Check the runs of `configs`; print one line per failure to stderr and exit 1, or one line of what passed."""
        from hydra.core.hydra_config import HydraConfig

        found: list[Probe] = []
        hydra = HydraConfig.instance()
        before = hydra.cfg
        try:
            for cfg in configs:
                hydra.set_config(cfg)  # as the run will see it (`${hydra:...}` resolves)
                try:
                    found += probes(cfg, self, launcher=launcher)
                except Exception:
                    continue  # a config error: the run's own validation names it (and records it)
        finally:
            hydra.cfg = before
        httpx_log = logging.getLogger("httpx")  # one INFO line per request otherwise (a run's logging quiets it too)
        level = httpx_log.level
        httpx_log.setLevel(max(level, logging.WARNING))
        try:
            findings = run_probes(found, self.deadline_s(any(p.key == ("slurm",) for p in found)))
        finally:
            httpx_log.setLevel(level)
        runs = len(configs) if sweep else None
        if any(not f.ok for f in findings):
            print(failure_text(findings, runs), file=sys.stderr, flush=True)
            raise SystemExit(1)
        if findings:
            print(passed_text(findings, runs), flush=True)
        return findings


def settings() -> Preflight:
    """This process's preflight settings (`hydra.callbacks.preflight`), the defaults outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and (node := HydraConfig.get().get("callbacks", {}).get("preflight")) is not None:
        return Preflight(**{k: v for k, v in node.items() if k != "_target_"})
    return Preflight()

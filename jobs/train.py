"""job=train: build the components from the config and hand them to the selected backend."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from omegaconf import DictConfig, OmegaConf

from backends.protocol import Backend
from backends.setup import TrainSetup
from foundation.ranks import started_by_launcher
from foundation.run_dir import RunDir
from foundation.stats import BEYOND_NOISE, Estimate, proportion_difference, welch, wilson
from jobs.config import build_components
from jobs.ranks import launch_ranks


def run(cfg: DictConfig, run_dir: RunDir) -> dict[str, Any]:
    """The backend's checks and plans (backends/protocol.py) before any model loads or process starts; then its
    processes started here (several: jobs/ranks.py) or its training in this one."""
    parts = build_components(cfg)  # validated here, also before a run of several processes starts them
    backend: Backend = parts["backend"]
    setup = train_setup(cfg, parts, run_dir)
    ranks = backend.processes(int(cfg.resources.nodes), int(cfg.resources.gpus_per_node))
    backend.check(setup, ranks)
    starter = not started_by_launcher()  # the process the user started: it plans memory and shows the plans
    capacity = (cfg.resources.get("gpu_memory_gb") or gpu_memory_gb()) if starter else None
    plans = backend.plans(setup, ranks, capacity)  # every rank: each save is checked against the disk plan
    if starter:
        for plan in plans.values():
            print(plan["text"], flush=True)
    setup.disk_plan = plans.get("disk_plan")
    if ranks > 1 and starter:
        parts["algorithm"].per_rank(ranks)  # the ranks can share the step's batch
        return summarize(launch_ranks(cfg, run_dir), run_dir) | plans
    return summarize(backend.train(setup), run_dir) | plans


def train_setup(cfg: DictConfig, parts: dict[str, Any], run_dir: RunDir) -> TrainSetup:
    """What a backend receives: the built components, the seed, the run directory and the groups' configs (the disk
    plan is the backend's, added once made)."""
    return TrainSetup(
        model=parts["model"],
        finetune=parts["finetune"],
        algorithm=parts["algorithm"],
        agent=parts["agent"],
        reward=parts["reward"],
        data=parts["data"],
        warmstart=parts["warmstart"],
        seed=cfg.seed,
        run=run_dir,
        groups={k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("agent", "reward", "model")},  # type: ignore[misc]
    )


def gpu_memory_gb() -> float | None:
    """The smallest memory (GB) of this machine's GPUs (all of them: nvidia-smi's order is not CUDA's), None where
    there are none."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    listed = subprocess.run(query, capture_output=True, text=True, timeout=60)
    sizes = [int(mib) * 2**20 / 1e9 for mib in listed.stdout.split() if mib.strip().isdigit()]
    return min(sizes, default=None)


def summarize(results: dict[str, Any], run_dir: RunDir) -> dict[str, Any]:
    """The backend's results and what metrics.jsonl says: steps, reward per step, validation before and after."""
    steps = [m for m in run_dir.metrics() if "train/reward_mean" in m]
    validations = [m for m in run_dir.metrics() if "val/accuracy" in m]
    return results | {
        "steps": len(steps),
        # None: a step whose rollouts were all excluded (see rollout/excluded_*_rate)
        "reward_per_step": [
            None if m["train/reward_mean"] is None else round(m["train/reward_mean"], 4) for m in steps
        ],
        "val_accuracy_before": validations[0]["val/accuracy"] if validations else None,
        "val_accuracy_after": validations[-1]["val/accuracy"] if len(validations) > 1 else None,
    }


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float | None], width: int = 60) -> str:
    """One character per step (averaged into `width` buckets when longer); a step with no reward is a space."""
    if len(values) > width:
        size = len(values) / width
        buckets = [values[int(i * size) : int((i + 1) * size)] for i in range(width)]
        values = [None if not (b := [v for v in bucket if v is not None]) else sum(b) / len(b) for bucket in buckets]
    known = [v for v in values if v is not None]
    if not known:
        return " " * len(values)
    low, high = min(known), max(known)
    span = (high - low) or 1.0
    return "".join(" " if v is None else SPARKS[round((v - low) / span * (len(SPARKS) - 1))] for v in values)


def _with_interval(p: float, n: int) -> str:
    low, high = wilson(p, n)
    return f"{p:.2f} [{low:.2f}, {high:.2f}]"


def describe(summary: dict[str, Any]) -> str:
    """What a person reads at the end of a training run (summary.json keeps everything)."""
    run = summary["run_dir"]
    lines = [f"run directory: {run}", ""]
    before = summary.get("val_after_sft") or summary.get("val_initial")
    after = summary.get("val_final")
    control = "sft_control" in summary  # the control arm's results (its ceiling too): SFT went on, no GRPO
    first = "after SFT" if "val_after_sft" in summary else "before GRPO"
    rows = [(first, before), ("after more SFT" if control else "after GRPO", after)]
    for label, val in rows:
        if val:
            low, high = wilson(val["accuracy"], val["n"])
            lines.append(f"  val accuracy {label:<15} {val['accuracy']:.2f}  [{low:.2f}, {high:.2f}]  (n={val['n']})")
    if before and after:
        change = proportion_difference(before["accuracy"], before["n"], after["accuracy"], after["n"])
        diff, low, high = change.diff, change.low, change.high
        trained = "the control's SFT" if control else "GRPO"
        verdict = f"inside noise: this run alone shows no effect of {trained}"
        verdict = "beyond noise" if change.flag == BEYOND_NOISE else verdict

        lines.append(f"  difference                   {diff:+.2f}  [{low:+.2f}, {high:+.2f}]  {verdict}")
    shown = [val for _, val in rows if val]
    subsets = list(dict.fromkeys(name for val in shown for name in val.get("subsets", {})))
    if subsets:
        labels = " -> ".join(label for label, val in rows if val)
        lines.append(f"  per subset (data.val_subset_field), {labels}, each with its 95 % interval:")
    for name in subsets:
        scores = [val.get("subsets", {}).get(name) for val in shown]
        cells = ["-" if s is None else _with_interval(s["accuracy"], s["n"]) for s in scores]
        n = next(s["n"] for s in scores if s is not None)
        lines.append(f"    {name:<26} {' -> '.join(cells)}  (n={n})")
    test = summary.get("test_final")
    if test:
        low, high = wilson(test["accuracy"], test["n"])
        lines.append(f"  test accuracy, final model   {test['accuracy']:.2f}  [{low:.2f}, {high:.2f}]  (n={test['n']})")
        for name, scores in test.get("subsets", {}).items():
            lines.append(f"    {name:<26} {_with_interval(scores['accuracy'], scores['n'])}  (n={scores['n']})")
    rewards = summary.get("reward_per_step") or []
    known = [r for r in rewards if r is not None]
    if known:
        lines += [
            "",
            f"  reward per step ({len(rewards)} steps, {known[0]:.2f} -> {known[-1]:.2f}, max {max(known):.2f}):",
            f"  {sparkline(rewards)}",
        ]
        lines += reward_trend(rewards)
    c = (summary.get("grpo") or summary.get("sft_control") or {}).get("compute")
    if c:
        pool = f", {c['compute/pool_flops']:.2e} of them the pool's sampling" if c.get("compute/pool_flops") else ""
        lines.append(
            f"  compute: {c['compute/flops']:.2e} FLOPs ({c['compute/trained_tokens']:,.0f} tokens trained, "
            f"{c.get('compute/prefill_tokens', 0):,.0f} prefilled, {c['compute/generated_tokens']:,.0f} "
            f"generated{pool}), {c.get('compute/gpu_s', 0):,.0f} GPU-seconds, {c.get('wall_s', 0):,.0f} s wall "
            "(backends/compute.py)"
        )
    sft, grpo, more = (summary.get(k, {}) for k in ("sft", "grpo", "sft_control"))
    phases = [
        f"SFT {sft['wall_s']:.0f} s" if "wall_s" in sft else "SFT reused" if sft else "",
        f"GRPO {grpo['wall_s']:.0f} s" if grpo else "",
        f"SFT control {more['wall_s']:.0f} s" if more else "",
    ]
    lines += [
        "",
        f"  time: {', '.join(p for p in phases if p) or '-'}; whole run {summary['wall_s'] / 60:.1f} min",
        "",
        f"open: {run}/summary.json (everything),",
        "      metrics.jsonl (one line per step), samples/ (validation trajectories)",
        "one run says little (the interval above): compare seeds, e.g. python launch.py -m seed=0,1,2 then",
        "      python -m analysis.report outputs/sweeps/<time>",
    ]
    if summary.get("arm") == "sft_control":
        lines.append("this run is a control arm: judge its treatment against it with python -m analysis.report")
    else:
        lines.append(
            "no control arm — no claim about GRPO vs SFT (run algorithm=sft_control and algorithm=rft from the same "
            "warm start, e.g. python launch.py -m experiment=learn-gpu, then python -m analysis.report)"
        )
    return "\n".join(lines)


def reward_trend(rewards: list[float | None]) -> list[str]:
    """Training reward in the first and the last fifth of the steps, each mean with its 95 % interval over the steps
    (t), and whether the change is beyond noise (Welch). Steps are not independent draws: a rough check, no verdict
    on GRPO."""
    known = [r for r in rewards if r is not None]
    size = max(2, len(known) // 5)
    if len(known) < 2 * size:
        return []
    first, last = known[:size], known[-size:]
    change = welch(first, last)
    verdict = "beyond noise" if change.flag == BEYOND_NOISE else "inside noise"
    return [
        f"  training reward, first {size} steps {_mean_interval(first)} -> last {size} steps "
        f"{_mean_interval(last)}: {change.diff:+.2f}, {verdict}",
    ]


def _mean_interval(values: list[float]) -> str:
    estimate = Estimate.of(values)
    half = estimate.half or 0.0
    return f"{estimate.mean:.2f} [{estimate.mean - half:.2f}, {estimate.mean + half:.2f}]"

"""GRPO steps through the real launcher, unsharded on one device against FSDP2 on N ranks: step time, its phases,
rollouts/s and model tokens/s, peak memory per rank, and the ratios to the first variant, side by side in one run.

Each variant is one `python launch.py` run of the same recipe (the Spider agent with the check step, random weights of
a real model's shape built by `model=tiny`, no warm start) in its own run directory, sharing one cache (data, the
built model). A variant is `plain` (one process, `resources.gpus_per_node=1`), or `fsdp2xN`: N ranks sharded with
FSDP2, started as `launch.py resources.gpus_per_node=N` starts them (torchrun). `fsdp2x1` is one rank under torchrun:
the whole sharded path (accelerate's FSDP2 on CUDA with fp32 master weights, the gathered bf16 copy that the engine
generates from, sharded checkpoints) on a machine with one GPU, with nothing to share it with. `VARIANT:T` runs it at T
tasks a step (4 rollouts each) instead of 16 (`--extra algorithm.tasks_per_step=T`: every variant): `fsdp2x2:32`
gives each of 2 GPUs the work one GPU has at 16 (weak scaling). `verlxN` runs the same recipe with backend=verl on N
GPUs (verl places its Ray workers itself); `--trl-extra` and `--verl-extra` reach one backend's variants only.
`--resume-steps K` runs each variant that finished once more in its own directory with K more steps: it resumes from
the checkpoint its first run saved at its last step (weights and optimizer state), and its row gets a `resume` entry
(the steps the second start trained, its wall time, the run's disk plan and what its checkpoints and final model take
on disk, hard links counted once) beside `disk`, the same after the first start: the save-and-resume check of a
full fine-tune at scale (issue 46: `--shape qwen25_7b --variants fsdp2x2 --steps 2 --resume-steps 1`). Where both
starts do not fit one device call, `--resume-only` (the next call on the same warm machine, the same arguments) runs
only the second start of each variant that `--out` already holds finished, and adds its `resume` entry there.
The response budget holds a whole rollout of a random model (6 calls of 256 tokens and the tool results between them),
so every rollout is trained on, as in a real run.

Memory: each row has the run's memory plan (its estimate per GPU, made before the ranks start: backends/memory.py)
beside what each GPU had in use (sampled, every process on it), per phase, and what the engine freed when it slept.
The 7B shape has Qwen2.5-7B's vocabulary rows and untied output layer (7.6B parameters; ids past the tiny tokenizer
decode to nothing), so its memory is the real model's; the 1.5B shape keeps the tiny tokenizer's ~2k rows, as in the
results committed before.

    python bench/sharded_steps.py --shape qwen25_1_5b --variants plain fsdp2x1 --out bench/results/x.json   # 1 GPU
    python bench/sharded_steps.py --shape qwen25_1_5b --variants plain fsdp2x2 --out ...                   # 2 GPUs
    python bench/sharded_steps.py --shape qwen25_1_5b --variants plain fsdp2x2 fsdp2x2:32 --out ...  # + weak scaling
    python bench/sharded_steps.py --shape qwen25_7b --variants fsdp2x2 --steps 3 \
        --extra backend.offload=optimizer backend.vllm_gpu_memory_utilization=0.5 backend.gradient_checkpointing=true \
        algorithm.micro_batch_size=1 algorithm.tasks_per_step=8 --out ...                       # 7B full, 2 GPUs
    python bench/sharded_steps.py --shape tiny --device cpu --variants plain fsdp2x2 --steps 2       # the same on CPU
    python bench/sharded_steps.py --shape qwen25_7b --variants fsdp2x2 --steps 2 --resume-steps 1 \
        --extra [the 7B line's] algorithm.keep_checkpoints=1 --out ...           # 7B full: save, then resume a step
    python bench/sharded_steps.py --shape qwen25_1_5b --steps 3 --variants verlx1 plain --extra finetune=full \
        algorithm.test_at_end=false --trl-extra backend.memory_check=false --out ...        # verl beside trl, 1 GPU
    python bench/sharded_steps.py --shape qwen25_1_5b --steps 5 --variants fsdp2x1 fsdp2x4:64 --out X  # 4 GPUs
    python bench/sharded_steps.py --shape qwen25_1_5b --steps 5 --variants fsdp2x4 --append --out X    # next call

`--append` adds a call's rows to the `--out` file an earlier call wrote on the same machine (one device call runs at
most 10 minutes), refusing a different workload. `scaling` in the file sets each N-GPU row against its backend's
`fsdp2x1` / `verlx1` row: the rollouts/s speedup, weak where it ran N times the tasks, strong where as many.

Timings are medians over the steps after the first (which compiles and captures the engine's graphs), validation left
out; each step's own time is in `step_s_each`. A run that fails after some steps (its final save, say) keeps them in
its row beside the failure, with each step's `gpu_memory/*` from metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# model=tiny's fields for a real model's shape (Qwen3 architecture, the project's tokenizer: vocab ~2k, not ~152k)
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
    "qwen25_1_5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12},
    "qwen25_7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28},
}
KV_HEADS = {"tiny": 2, "qwen25_1_5b": 2, "qwen25_7b": 4}
EMBEDDINGS = {"qwen25_7b": ["model.embedding_rows=152064", "model.tie_word_embeddings=false"]}

RECIPE_TASKS, RECIPE_GROUP = 16, 4
# The workload: 16 tasks x 4 rollouts a step, the check step (up to 6 calls a rollout), 256 tokens a call at most
RECIPE = [
    "warmstart=none",
    "agent.check_step=true",
    f"algorithm.group_size={RECIPE_GROUP}",
    f"algorithm.tasks_per_step={RECIPE_TASKS}",
    "algorithm.micro_batch_size=8",
    "algorithm.max_prompt_length=1024",
    "algorithm.max_response_length=3072",  # 6 calls x 256 + the tool results: no rollout overflows (1536: 83-100 %)
    "algorithm.max_tokens_per_turn=256",
    "algorithm.learning_rate=1e-6",
    "algorithm.val_every=1000",
    "algorithm.save_every=1000",
    "algorithm.pool_samples=null",  # model=tiny's GRPO (grpo_tiny) filters a pool first: not this workload
    "data.generate.n_dev=16",
    "model.context_length=4096",
    "model.dtype=auto",
]


def setting(extra: list[str], key: str, default: int) -> int:
    """`key`'s value among the `--extra` overrides (the last one given), else `default`."""
    values = [o.partition("=")[2] for o in extra if o.partition("=")[0].lstrip("+") == key]
    return int(values[-1]) if values else default


def tasks_of(variant: str, extra: list[str]) -> int:
    """Tasks a step of `variant`: T of `VARIANT:T`, else `--extra`'s algorithm.tasks_per_step, else the recipe's."""
    tasks = variant.partition(":")[2]
    return int(tasks) if tasks else setting(extra, "algorithm.tasks_per_step", RECIPE_TASKS)


def gpus_of(variant: str) -> int | None:
    """N of `fsdp2xN` / `verlxN` (None for `plain`, which is not the sharded path)."""
    kind = variant.partition(":")[0]
    for prefix in ("fsdp2x", "verlx"):
        if kind.startswith(prefix) and kind.removeprefix(prefix).isdigit():
            return int(kind.removeprefix(prefix))
    return None


def variant_command(variant: str, args: argparse.Namespace, run_dir: Path, steps: int) -> list[str]:
    shape = [f"model.{k}={v}" for k, v in SHAPES[args.shape].items()]
    shape += [f"model.num_key_value_heads={KV_HEADS[args.shape]}", *EMBEDDINGS.get(args.shape, [])]
    common = [*RECIPE, *shape, f"algorithm.max_steps={steps}", *args.extra]
    common.append(f"algorithm.tasks_per_step={tasks_of(variant, args.extra)}")
    launch = [sys.executable, str(ROOT / "launch.py"), *common, f"hydra.run.dir={run_dir}"]
    kind = variant.partition(":")[0]
    if kind.startswith("verlx"):  # verl places its workers itself (Ray), on resources.gpus_per_node GPUs
        return [*launch, "backend=verl", f"resources.gpus_per_node={gpus_of(variant)}", *args.verl_extra]
    launch += [f"backend.device={args.device}", *args.trl_extra]
    if kind == "plain":
        return launch
    ranks = gpus_of(variant)
    if ranks > 1:
        return [*launch, f"resources.gpus_per_node={ranks}", "backend.sharding=fsdp2"]
    # one rank, as jobs/ranks.py starts each (a run of N > 1 processes starts them itself)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *launch[1:]]


def run_dir_of(variant: str, out_dir: Path) -> Path:
    return out_dir / variant.replace(":", "-")


def summary_of(run_dir: Path) -> dict[str, Any]:
    """The run's summary.json ({} where it wrote none)."""
    return json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}


def start_variant(variant: str, args: argparse.Namespace, out_dir: Path, steps: int) -> tuple[int, float]:
    """One start of the variant's run in its directory, trained up to `steps`: its exit code and wall seconds."""
    run_dir = run_dir_of(variant, out_dir)
    env = os.environ | {"ARL_CACHE_DIR": str(out_dir / "cache"), "ARL_OUTPUT_DIR": str(out_dir)}
    if variant.partition(":")[0] == "fsdp2x1":
        env["ARL_RANK_OF"] = str(run_dir)  # foundation.ranks.RANK_OF: this process is a rank of the run
    start = time.monotonic()
    finished = subprocess.run(variant_command(variant, args, run_dir, steps), env=env, cwd=ROOT)
    return finished.returncode, time.monotonic() - start


def run_variant(variant: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    run_dir = run_dir_of(variant, out_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # a run left there would refuse other settings, or be resumed
    one_rank = variant.partition(":")[0] == "fsdp2x1"  # a rank of its own: it writes ranks/results.json
    returncode, wall_s = start_variant(variant, args, out_dir, args.steps)
    rollouts = tasks_of(variant, args.extra) * setting(args.extra, "algorithm.group_size", RECIPE_GROUP)
    return row(variant, run_dir, one_rank, returncode, rollouts) | {"wall_s": wall_s, "disk": disk(run_dir)}


def resume_variant(variant: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """The variant's finished run started again with `--resume-steps` more steps: it resumes from its checkpoint."""
    run_dir = run_dir_of(variant, out_dir)
    returncode, wall_s = start_variant(variant, args, out_dir, args.steps + args.resume_steps)
    summary = summary_of(run_dir)
    metrics = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    trained = [m for m in steps if "timing_s/step" in m and m.get("step", 0) > args.steps]
    return {
        "command": " ".join([sys.executable, *sys.argv]),  # this call's (`--resume-only`: not the first start's)
        "returncode": returncode,
        "status": summary.get("status"),
        "error": None if returncode == 0 else str(summary.get("error"))[-2000:],
        "steps_after_resume": [m.get("step") for m in trained],
        "step_s_each": [round(m["timing_s/step"] - m.get("timing_s/validation", 0.0), 2) for m in trained],
        "wall_s": wall_s,
        "disk": disk(run_dir),
    }


def disk(run_dir: Path) -> dict[str, Any]:
    """The run's disk plan (summary.json) and what each of its checkpoints and its final model take on disk, a file
    hard-linked into several of them counted in the first only; and the disk's free bytes now."""
    summary = summary_of(run_dir)
    seen: set[int] = set()
    used: dict[str, int] = {}
    checkpoints = run_dir / "checkpoints"
    for entry in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else []:
        stats = [f.stat() for f in entry.rglob("*") if f.is_file()]
        fresh = {st.st_ino: st.st_size for st in stats if st.st_ino not in seen}
        seen.update(fresh)
        used[entry.name] = sum(fresh.values())
    return {
        "plan": summary.get("disk_plan"),
        "final_model": summary.get("final_model"),
        "bytes_new_in_each": used,
        "free_bytes": shutil.disk_usage(run_dir if run_dir.exists() else run_dir.parent).free,
    }


def row(variant: str, run_dir: Path, one_rank: bool, returncode: int, rollouts: int) -> dict[str, Any]:
    """The variant's row from its run directory: the GRPO steps it logged (metrics.jsonl), and its summary's
    figures when it finished. A run that failed after some steps (its final save, say) keeps those steps' timings
    and memory beside the failure."""
    results_file = run_dir / ("ranks/results.json" if one_rank else "summary.json")
    metrics = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()][1:] if metrics.is_file() else []
    steps = [m for m in steps if "timing_s/step" in m]
    failed = returncode != 0 or not results_file.is_file()
    out: dict[str, Any] = {"variant": variant}
    if failed:
        summary = summary_of(run_dir)
        out["failed"] = f"exit {returncode}: {str(summary.get('error'))[-2000:]}"
        if not steps:
            return out
    results = {} if failed else json.loads(results_file.read_text())
    timed = steps[1:] or steps  # the first step compiles and captures

    def median(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in timed)

    step_s = statistics.median(m["timing_s/step"] - m.get("timing_s/validation", 0.0) for m in timed)
    tokens = median("rollout/model_tokens_mean") * rollouts * (1 - median("rollout/excluded_rate"))
    return out | {
        "world_size": results.get("world_size"),
        "sharding": results.get("sharding", "none"),
        "steps": len(steps),
        "rollouts_per_step": rollouts,
        "step_s": step_s,
        "step_s_each": [round(m["timing_s/step"] - m.get("timing_s/validation", 0.0), 2) for m in steps],
        "phases_s": {
            k: median(f"timing_s/{k}") for k in ("weight_sync", "rollout", "scoring", "old_logprobs", "update")
        },
        "rollouts_per_s": rollouts / step_s,
        "model_tokens_per_s": tokens / step_s,
        # sampler vs trainer, each step: backend=trl's and from_update's mean IS ratio before truncation; verl's
        # decoupled mode logs its truncated weights' mean
        "is_ratio_by_step": [
            {k: m[k] for k in ("sampling/is_ratio/mean", "rollout_corr/rollout_is_mean") if k in m} for m in steps
        ],
        # the most any rank's GPU had in use so far, per phase, as each step logged it (gpu_memory/*)
        "gpu_memory_by_step": [{k: v for k, v in m.items() if k.startswith("gpu_memory/")} for m in steps],
        "peak_gpu_memory_gb_per_rank": results.get("peak_gpu_memory_gb_per_rank"),
        "gpu_memory_per_rank": results.get("gpu_memory_per_rank"),
        "memory_plan": results.get("memory_plan"),
        # backend=verl: its actor workers' torch allocator peaks (vLLM's servers are other processes)
        "verl_actor_memory_gb": {
            k: median(f"actor/perf/{k}") for k in ("max_memory_allocated_gb", "max_memory_reserved_gb")
        }
        if variant.startswith("verl")
        else None,
    }


def scaling(rows: list[dict[str, Any]], extra: list[str]) -> list[dict[str, Any]]:
    """Each finished N-GPU row against its backend's one-GPU row (`fsdp2x1`, `verlx1`: the same code path) at T0
    tasks a step: rollouts/s speedup, weak where it ran N x T0 tasks (each GPU the one GPU's load), strong where
    T0."""
    done = [r for r in rows if "failed" not in r and gpus_of(r["variant"])]
    out = []
    for row in done:
        family = row["variant"].partition(":")[0].rstrip("0123456789")  # fsdp2x, verlx
        bases = [r for r in done if r["variant"].partition(":")[0] == f"{family}1"]
        n = gpus_of(row["variant"])
        if not bases or n == 1:
            continue
        base = bases[0]
        tasks, base_tasks = tasks_of(row["variant"], extra), tasks_of(base["variant"], extra)
        kind = "weak" if tasks == n * base_tasks else "strong" if tasks == base_tasks else "other"
        out.append(
            {
                "variant": row["variant"],
                "baseline": base["variant"],
                "gpus": n,
                "scaling": kind,
                "speedup": row["rollouts_per_s"] / base["rollouts_per_s"],
            }
        )
    return out


def appended(report: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """`earlier` (an earlier call's --out) going on with this call's rows: the same workload on the same machine,
    else an error naming what differs. Each later call's command is kept beside the first's."""
    for key in ("shape", "extra", "recipe", "gpus", "device"):
        if earlier.get(key) != report[key]:
            raise ValueError(f"--append: {key} is {report[key]!r} here, {earlier.get(key)!r} in the file")
    return earlier | {"appended_commands": [*earlier.get("appended_commands", []), report["command"]]}


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen25_1_5b")
    parser.add_argument("--variants", nargs="+", default=["plain", "fsdp2x1"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--work", type=Path, default=Path("outputs/bench-sharded"))
    parser.add_argument("--out", type=Path, help="results JSON")
    parser.add_argument("--extra", nargs="*", default=[], help="more launch.py overrides, for every variant")
    parser.add_argument("--resume-steps", type=int, default=0, help="start each finished run again: K more steps")
    parser.add_argument("--resume-only", action="store_true", help="only the second starts of --out's finished rows")
    parser.add_argument("--append", action="store_true", help="add this call's rows to --out's (a later device call)")
    parser.add_argument("--trl-extra", nargs="*", default=[], help="overrides for the backend=trl variants only")
    parser.add_argument("--verl-extra", nargs="*", default=[], help="overrides for the backend=verl variants only")
    args = parser.parse_args()
    for variant in args.variants:
        kind, _, tasks = variant.partition(":")
        if not (kind == "plain" or gpus_of(variant)):
            parser.error(f"unknown variant {variant!r}: plain, fsdp2xN or verlxN, each with :T for T tasks a step")
        if tasks and not tasks.isdigit():
            parser.error(f"unknown variant {variant!r}: T in VARIANT:T is a number of tasks")

    import accelerate
    import torch
    import transformers
    import trl

    cuda = torch.cuda.is_available() and args.device != "cpu"
    rows: list[dict[str, Any]] = []
    report = {
        "bench": "sharded_steps",
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "accelerate": accelerate.__version__,
            **{name: _version(name) for name in ("verl", "vllm", "ray")},
        },
        "shape": args.shape,
        "model": SHAPES[args.shape] | {"num_key_value_heads": KV_HEADS[args.shape]},
        "embeddings": EMBEDDINGS.get(args.shape, ["the tiny tokenizer's rows, tied"]),
        "extra": args.extra,
        "recipe": RECIPE,
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)

    def resume(row: dict[str, Any]) -> None:  # the second start of a finished row, kept as soon as it ends
        row["resume"] = resume_variant(row["variant"], args, args.work)
        print(json.dumps(row["resume"]))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))

    if args.resume_only:  # the first starts ran in an earlier call: their rows are in --out, their runs in --work
        if not (args.resume_steps and args.out and args.out.is_file()):
            parser.error("--resume-only needs --resume-steps and the --out file the first starts wrote")
        report = json.loads(args.out.read_text())
        for row in report["rows"]:
            if "failed" not in row and row["variant"] in args.variants:
                resume(row)
        return
    report_command = report["command"]  # this call's, kept in each of its rows
    if args.append:  # the rows of earlier calls (the machine's time limit a call) go on in one file
        if not (args.out and args.out.is_file()):
            parser.error("--append needs the --out file an earlier call wrote")
        try:
            report = appended(report, json.loads(args.out.read_text()))
        except ValueError as exc:
            parser.error(str(exc))
        rows = report["rows"]
    # written after every variant, so a bench stopped by its time limit keeps the variants it finished
    for variant in args.variants:
        row = run_variant(variant, args, args.work) | {"command": report_command}
        rows.append(row)
        if "failed" not in row and "failed" not in rows[0]:
            row["throughput_vs_first"] = row["rollouts_per_s"] / rows[0]["rollouts_per_s"]
        report["scaling"] = scaling(rows, args.extra)
        print(json.dumps(row))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        if args.resume_steps and "failed" not in row:
            resume(row)


if __name__ == "__main__":
    main()

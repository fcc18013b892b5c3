"""Ablation grids: every cell of every preset builds; a tiny grid goes from `launch.py -m` to the report, tracked by
W&B offline, with no key in anything it writes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from scipy import stats

from analysis.report import factor_keys
from analysis.runs import Run
from jobs.config import build_components, check_study
from tests.conftest import ROOT, launch
from tests.test_config import CONF, options
from tests.test_report import out_tables, table_rows

GRIDS = [o for o in options("experiment") if o.startswith("ablation-")]
SWEPT = {
    "ablation-context": ("algorithm.max_prompt_length", ["2048", "4096"]),
    "ablation-turns": ("agent.max_turns", ["1", "3"]),
    "ablation-check": ("agent.check_step", ["True", "False"]),
    "ablation-models": ("model", ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-3b-instruct"]),
}


def grid_cells(preset: str) -> list[list[str]]:
    """The overrides of each cell a preset's `hydra.sweeper.params` defines."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={preset}"], return_hydra_config=True)
    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
    cells: list[list[str]] = [[]]
    for override in OverridesParser.create().parse_overrides(params):
        values = [f"{override.key_or_group}={v}" for v in override.sweep_string_iterator()]
        cells = [[*cell, v] for cell in cells for v in values]
    return cells


def test_every_grid_has_a_cpu_twin_and_sweeps_what_it_says() -> None:
    assert sorted(GRIDS) == sorted([*SWEPT, *(f"{g}-tiny" for g in SWEPT)])
    for preset, (key, values) in SWEPT.items():
        assert grid_cells(preset) == [[f"{key}={v}"] for v in values]
        tiny_key = "model.hidden_size" if key == "model" else key  # two sizes of the tiny model
        assert [c[0].split("=")[0] for c in grid_cells(f"{preset}-tiny")] == [tiny_key, tiny_key]


@pytest.mark.parametrize("preset", GRIDS)
def test_every_grid_declares_its_comparison_between_the_values_it_sweeps(preset: str) -> None:
    """One primary comparison, judged on the test split: the grid's other value against its baseline, each side one
    of the cells the grid runs (so the report finds both), valid as a study's declaration."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={preset}"])
    study = check_study(cfg.analysis)
    (declared,) = study.comparisons
    assert (study.metric, study.cluster, declared.role) == ("test_final", "warm_start", "primary")
    cells = [cell[0] for cell in grid_cells(preset)]
    parse = OverridesParser.create().parse_override
    sides = [(parse(o).key_or_group, str(parse(o).value())) for o in (*declared.treatment, *declared.baseline)]
    assert sorted(sides) == sorted((parse(c).key_or_group, str(parse(c).value())) for c in cells)


@pytest.mark.parametrize("preset", GRIDS)
def test_every_cell_of_every_grid_builds(preset: str, spider_mini_dir: Path) -> None:
    """Validated before any GPU time is spent: lengths against the model's context, keys, types."""
    for cell in grid_cells(preset):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[f"experiment={preset}", *cell, f"data.spider_dir={spider_mini_dir}"])
        built = build_components(cfg)
        key, value = cell[0].split("=")
        if key == "model":
            assert built["model"].name == value
        else:
            assert str(getattr(built[key.split(".")[0]], key.split(".")[1])) == value


def files_under(*roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


@pytest.mark.integration
def test_a_tiny_grid_goes_from_launch_to_report(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = {"WANDB_API_KEY": "sentinel-wandb-7f3a", "OPENAI_API_KEY": "sentinel-openai-7f3a"}
    secrets |= {"JUDGE_API_KEY": "sentinel-judge-7f3a", "JUDGE_BASE_URL": "https://u:sentinel-url-7f3a@judge/v1"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    wandb_home = tmp_path / "wandb-home"
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(wandb_home / name))

    # 2 values x 2 seeds, tracked offline although a key is set (the mode says so), then the report.
    args = ["-m", "experiment=ablation-turns-tiny", "seed=0,1", "logger=wandb", "logger.mode=offline"]
    result = launch(args, cache_dir, tmp_path, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep,) = (tmp_path / "sweeps").iterdir()
    runs = sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert [p.name for p in runs] == ["0", "1", "2", "3"]
    summaries = [json.loads((p / "summary.json").read_text()) for p in runs]
    assert all(s["status"] == "completed" for s in summaries)

    report = subprocess.run(
        [sys.executable, "-m", "analysis.report", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert report.returncode == 0, report.stderr[-3000:]
    assert "factors: agent.max_turns\n" in report.stdout
    md = (sweep / "report.md").read_text()
    assert (sweep / "report.html").is_file() and (sweep / "curves.png").is_file() and (sweep / "cost.png").is_file()

    # Each cell's numbers, recomputed here from the runs' own metrics.jsonl.
    finals: dict[str, list[float]] = {"1": [], "3": []}
    for path, summary in zip(runs, summaries, strict=True):
        turns = next(o.split("=")[1] for o in summary["overrides"] if o.startswith("agent.max_turns="))
        lines = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        finals[turns].append([m["val/accuracy"] for m in lines if "val/accuracy" in m][-1])
    rows = {row["agent.max_turns"]: row for row in table_rows(out_tables(md)["All cells"])}
    assert sorted(rows) == ["1", "3"]
    for turns, values in finals.items():
        mean = sum(values) / 2
        half = stats.t.ppf(0.975, 1) * math.sqrt(sum((v - mean) ** 2 for v in values)) / math.sqrt(2)
        assert rows[turns]["seeds"] == "2/2" and rows[turns]["val_final"] == f"{100 * mean:.1f} ± {100 * half:.1f}"

    # W&B: one offline run per run directory; group = the sweep, tag = the swept value, name = the overrides.
    for path, summary in zip(runs, summaries, strict=True):
        (record,) = path.glob("wandb/offline-run-*/run-*.wandb")
        data = record.read_bytes()
        turns = next(o for o in summary["overrides"] if o.startswith("agent.max_turns="))
        assert f"ablation-turns-tiny/{sweep.name}".encode() in data and turns.encode() in data
        assert b"val/accuracy" in data and b"train/reward_mean" in data and b"experiment=ablation-turns-tiny" in data

    # No key in any config, log, metric, W&B record or report.
    for path in files_under(sweep, wandb_home):
        data = path.read_bytes()
        leaked = [name for name, value in secrets.items() if value.encode() in data]
        assert not leaked, f"{leaked} in {path}"


POOL_CELLS = {  # experiment=learn-pool-gpu-ablations: the baseline cell and one factor changed in each other cell
    "baseline": [],
    "no_check_step": ["agent.check_step=false"],
    "one_turn": ["agent.max_turns=1"],
    "short_context": ["algorithm.max_response_length=256"],
}


def test_the_pool_world_s_ablations_declare_each_cell_against_the_baseline_cell(spider_mini_dir: Path) -> None:
    """Each declared comparison's sides are exactly two of the four cells the preset's launches run (every other
    factor at its baseline value, so no other cell matches either side), GRPO only, every cell valid."""
    values = {}
    for cell, overrides in POOL_CELLS.items():
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(
                "config",
                overrides=["experiment=learn-pool-gpu-ablations", *overrides, f"data.spider_dir={spider_mini_dir}"],
                return_hydra_config=True,
            )
        built = build_components(cfg)
        assert built["algorithm"].name == "grpo" and str(cfg.hydra.sweeper.params.algorithm) == "grpo"
        a = built["agent"]
        values[cell] = {
            "agent.check_step": a.check_step,
            "agent.max_turns": a.max_turns,
            "algorithm.max_response_length": built["algorithm"].max_response_length,
        }
    study = check_study(cfg.analysis)
    parse = OverridesParser.create().parse_override

    def cells_matching(side: list[str]) -> list[str]:
        want = {parse(o).key_or_group: parse(o).value() for o in side}
        return [c for c, v in values.items() if all(v[k] == w for k, w in want.items())]

    assert [(c.name, cells_matching(c.treatment), cells_matching(c.baseline)) for c in study.comparisons] == [
        (name, [name], ["baseline"]) for name in ("no_check_step", "one_turn", "short_context")
    ]


def test_the_warm_start_a_cell_loads_is_not_one_of_its_factors() -> None:
    """Every cell of warm start W loads W's one build (`warmstart.path` and its digest, as the ablations' device script
    passes them): those name the replicate, as `warmstart.seed` does, so the cells' factor is the one they vary."""

    def cell(w: int, seed: int, *factor: str) -> Run:
        built = [f"warmstart.path=/tmp/cache/warmstarts/sft-{w}", f"warmstart.weights_sha256={w:064x}"]
        overrides = [f"warmstart.seed={w}", f"model.init_seed={w}", *built, *factor, f"seed={seed}"]
        config = OmegaConf.to_container(OmegaConf.from_dotlist(overrides))
        return Run(source="x", name=f"{w}-{seed}-{factor}", status="completed", overrides=overrides, config=config)

    runs = [cell(w, s, *f) for w in (100, 101) for s in (2 * w, 2 * w + 1) for f in ([], ["agent.check_step=false"])]
    assert factor_keys(runs) == ["agent.check_step"]

"""The single entry point: compose the config (Hydra), then run the selected job in its run directory.

python launch.py                                  # the default: tiny SQL agent, GRPO on CPU
python launch.py --cfg job model=qwen2.5-7b-instruct finetune=lora
python launch.py -m model=tiny seed=0,1           # a sweep: one run directory per run
"""

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

from jobs.job import run_job

# The repository's folders are the import names (nothing is installed): every process a run starts (its ranks, SLURM
# jobs, Ray workers) finds them on PYTHONPATH
ROOT = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_job(cfg)


if __name__ == "__main__":
    main()

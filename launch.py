"""The single entry point: compose the config (Hydra), then run the selected job in its run directory.

python launch.py                                  # the default: tiny SQL agent, GRPO on CPU
python launch.py --cfg job model=qwen2.5-7b-instruct finetune=lora
python launch.py -m model=tiny seed=0,1           # a sweep: one run directory per run
"""

import hydra
from omegaconf import DictConfig

from experiments.job import run_job


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_job(cfg)


if __name__ == "__main__":
    main()

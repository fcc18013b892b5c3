"""backend=verl: verl 0.9's PPO trainer (Ray, FSDP2 workers, vLLM servers) with our agents in its agent loop, token
in, token out, fail closed: `backend.py` (the group's class), `config.py` (verl's config from ours), `loop.py` (the
agent loop), `runner.py` (verl's driver: TaskRunner and trainer), `train.py` (the run), `compat.py` (beside trl)."""

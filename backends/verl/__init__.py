"""The scale backend: agent-lightning's Trainer with verl's PPO/GRPO and vLLM rollouts (`backend=verl`), and its
developer mode against any OpenAI-compatible endpoint (`backend=dev`); both need .venv-verl (`make setup-verl`:
agent-lightning 0.3 on verl 0.6). `loop.py` is its successor's core, in the main venv: our agents in verl 0.9's agent
loop, token in, token out, fail closed (docs/verl.md)."""

"""The scale backend: agent-lightning's Trainer with verl's PPO/GRPO and vLLM rollouts (`backend=verl`), and its
developer mode against any OpenAI-compatible endpoint (`backend=dev`). Needs .venv-verl (`make setup-verl`)."""

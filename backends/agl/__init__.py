"""backend=verl today: agent-lightning 0.3's Trainer with verl 0.6's PPO/GRPO and vLLM rollouts, and its developer
mode against any OpenAI-compatible endpoint (`backend=dev`). Needs .venv-verl (`make setup-verl`: the `agl` extra).
verl 0.6 needs torch 2.8 and vLLM <= 0.11, so this path runs on CPU only here; its successor on verl 0.9 grows in
`backends/verl/` (docs/verl.md)."""

"""verl 0.9 as a backend, in the main venv (the `verl` extra): `loop.py` runs our agents in verl's agent loop, token
in, token out, fail closed. The trainer around it is not built yet; `backend=verl` is still agent-lightning 0.3 on
verl 0.6 (`backends/agl/`, docs/verl.md)."""

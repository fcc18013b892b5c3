# `make run` and `make test` set everything up (a virtualenv in .venv, CPU torch pinned by constraints.txt) first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRAS := trl,verl,analysis,wandb,swanlab,mysql,dev

.PHONY: setup run test test-fast lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

run: setup
	$(BIN)/python launch.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The edit loop: unit tests only (no `integration` or `slurm` marker), under 2 minutes.
test-fast: setup
	$(BIN)/python -m pytest -m "not integration and not slurm"

# The suite on pytest-xdist workers (a file's tests go to one worker where they share a module fixture: `xdist_group`
# marks). 3 workers on 2 cores: many tests wait (on a launched run's start, a server, a SLURM job), and a third worker
# fills those waits. One torch thread per process: workers (and the runs they start) with torch's default of one
# thread per core oversubscribe the cores, and two tiny runs side by side then take 2.3x as long (66 s against 29 s,
# measured).
XDIST := --dist loadgroup
ONE_THREAD := OMP_NUM_THREADS=1
test: lint
	$(ONE_THREAD) $(BIN)/python -m pytest -n 3 $(XDIST)

# `make run` and `make test` set everything up (a virtualenv in .venv, CPU torch pinned by constraints.txt) first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRAS := trl,verl,analysis,wandb,dev
# backend=verl (agent-lightning 0.3 + verl 0.6) needs its own venv: its set conflicts with the trl extra's.
VERL_VENV := .venv-verl
VERL_BIN := $(VERL_VENV)/bin

.PHONY: setup setup-verl run test test-fast lint
setup: $(VENV)/.installed

setup-verl: $(VERL_VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

# One install against the locked set (constraints-verl.txt pins every package, so pip does not backtrack).
$(VERL_VENV)/.installed: pyproject.toml constraints-verl.txt
	test -x $(VERL_BIN)/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_BIN)/pip install --quiet --upgrade pip
	$(VERL_BIN)/pip install --quiet -c constraints-verl.txt -e ".[agl,dev]"
	touch $@

run: setup
	$(BIN)/python launch.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The edit loop: unit tests only (no `integration`, `slurm` or `verl` marker), under 2 minutes.
test-fast: setup
	$(BIN)/python -m pytest -m "not integration and not slurm and not verl"

# The main suite in .venv, then the scale backend's tests (tests/test_verl_*.py, marked `verl`) in .venv-verl, on
# pytest-xdist workers (a file's tests go to one worker where they share a module fixture: `xdist_group` marks). The
# main suite takes 3 workers on 2 cores: many of its tests wait (on a launched run's start, a server, a SLURM job),
# and a third worker fills those waits. The verl suite's length is its Ray group's, on one worker: 2 are enough.
# One torch thread per process: workers (and the runs they start) with torch's default of one thread per core
# oversubscribe the cores, and two tiny runs side by side then take 2.3x as long (66 s against 29 s, measured).
XDIST := --dist loadgroup
ONE_THREAD := OMP_NUM_THREADS=1
# .venv-verl is installed while the main suite runs (pip waits on the network and the disk, the tests on the CPU); its
# log is outputs/setup-verl.log, shown when the install fails. Both suites run whatever the other's result.
SETUP_VERL_LOG := outputs/setup-verl.log
test: lint
	@mkdir -p outputs && rm -f $(SETUP_VERL_LOG).rc
	( $(MAKE) --no-print-directory setup-verl > $(SETUP_VERL_LOG) 2>&1; echo $$? > $(SETUP_VERL_LOG).rc ) & \
	$(ONE_THREAD) $(BIN)/python -m pytest -n 3 $(XDIST) -m "not verl"; main=$$?; \
	wait; \
	if [ "$$(cat $(SETUP_VERL_LOG).rc)" != 0 ]; then cat $(SETUP_VERL_LOG); echo "make setup-verl failed"; exit 1; fi; \
	$(ONE_THREAD) $(VERL_BIN)/python -m pytest -n 2 $(XDIST) -m verl tests/test_verl_*.py; verl=$$?; \
	exit $$(( main || verl ))

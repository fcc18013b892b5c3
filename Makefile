# `make run` and `make test` set everything up (a virtualenv in .venv, CPU torch pinned by constraints.txt) first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRAS := trl,analysis,wandb,dev

.PHONY: setup run test lint
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

test: lint
	$(BIN)/python -m pytest

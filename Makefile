# The two commands of the README. Each sets up what it needs (a virtual environment in .venv) first.
#   make demo   run the end-to-end recovery demo
#   make test   lint, type-check and run the whole test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/remesh demo

lint: $(BIN)/.installed
	PATH=$(abspath $(BIN)):$$PATH protos/generate.sh --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy services agent benchmarks

test: lint
	$(BIN)/python -m pytest -q

bench: $(BIN)/.installed
	$(BIN)/python benchmarks/detection.py

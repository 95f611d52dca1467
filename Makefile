# The two commands of the README. Each sets up what it needs (a virtual environment in .venv) first.
#   make demo   run the end-to-end recovery demo
#   make test   lint, type-check and run the whole test suite, then the control plane's tests on the
#               lowest versions pyproject.toml allows (what CI runs)
# and, beside them:
#   make docs   build the documentation site (mkdocs.yml) into site/, strictly: any warning fails it
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint docs lowest bench

LOWEST := .venv-lowest
# The control plane's tests, on a plain `pip install remesh` (no extras, so no JAX) pinned to the
# lowest versions pyproject.toml declares: a declared minimum that is wrong fails here.
LOWEST_TESTS := tests/test_control_plane.py tests/test_redis_production.py tests/test_bad_input.py tests/test_contract.py tests/test_metrics.py

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/remesh demo

# The docs are linted too: a broken link or anchor, a page left out of the nav or an API name that no
# longer resolves fails `make lint`, and so `make test`.
lint: $(BIN)/.installed docs
	PATH=$(abspath $(BIN)):$$PATH protos/generate.sh --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy services agent benchmarks
	$(BIN)/lint-imports

# NO_MKDOCS_2_WARNING: the Material theme's notice about its successor, printed on every build.
docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Two workers (pytest-xdist), each taking a whole test module at a time: a module's fixtures (a clean
# run to compare with, a Redis) are made once.
test: lint
	$(BIN)/python -m pytest -q -rs -n 2 --dist loadfile
	$(MAKE) lowest

lowest:
	rm -rf $(LOWEST)
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install -q --upgrade pip
	$(PYTHON) .ci/lowest_constraints.py > $(LOWEST)/constraints.txt
	$(LOWEST)/bin/python -m pip install -q -c $(LOWEST)/constraints.txt . pytest pytest-timeout pytest-xdist hypothesis
	$(LOWEST)/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("jax") is not None)'
	$(LOWEST)/bin/remesh coordinator --help > /dev/null
	$(LOWEST)/bin/remesh agent --help > /dev/null
	$(LOWEST)/bin/python -m pytest -q -p no:cacheprovider -n 2 $(LOWEST_TESTS)

bench: $(BIN)/.installed
	$(BIN)/python benchmarks/detection.py

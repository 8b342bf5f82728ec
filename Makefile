# One entry point for humans and CI. `make test` works on a fresh machine: it creates the
# virtualenv, installs the pinned dependencies, then runs lint, types and every test tier.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: venv lint typecheck check test test-fast lock clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=25"
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[dev]'
	touch $@

venv: $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

check: lint typecheck

## Everything: lint, strict types, and all test tiers (unit, broker, S3, slow).
test: check
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## Unit tests only (no brokers, no S3, nothing slow).
test-fast: venv
	$(BIN)/python -m pytest -m "not broker and not s3 and not slow and not helm" $(PYTEST_ARGS)

## Re-pin every dependency to what is installed in the virtualenv.
lock: venv
	$(BIN)/python -m pip freeze --exclude-editable --exclude lance-sink | sort > requirements.lock

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache .pytest_cache

